//! Lab: `meshd status` shows the live members of a running mesh.

mod lab;
use lab::{Lab, meshd};
use std::time::Duration;

#[test]
fn status_lists_every_member_with_role_state_and_rtt() {
    lab_or_skip!();
    let mut lab = Lab::new(3);
    let args = lab.meshd_run().cmd(&["sleep", "6"]);
    let ks: Vec<usize> = (0..3).map(|i| lab.spawn(i, &args, &[("MESHD_TOKEN", "st")])).collect();
    std::thread::sleep(Duration::from_secs(3));
    let q = lab.spawn(0, &[meshd(), "status", "--json"], &[("MESHD_TOKEN", "st")]);
    let (code, out, err) = lab.wait(q, Duration::from_secs(10));
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    let members = v["members"].as_array().expect("members");
    assert_eq!(members.len(), 3, "{v}");
    let masters: Vec<_> = members.iter().filter(|m| m["role"] == "master").collect();
    assert_eq!(masters.len(), 1, "{v}");
    assert_eq!(masters[0]["addr"], "198.19.0.7");
    // Node-rank order: the master first, then by address.
    let addrs: Vec<&str> = members.iter().map(|m| m["addr"].as_str().unwrap_or("")).collect();
    assert_eq!(addrs, ["198.19.0.7", "198.19.0.19", "198.19.0.30"], "{v}");
    assert!(members.iter().all(|m| m["nproc"] == 1), "{v}");
    // The table: addresses and host names, the flags' words, no internal ids.
    let q = lab.spawn(0, &[meshd(), "status"], &[("MESHD_TOKEN", "st")]);
    let (code, out, err) = lab.wait(q, Duration::from_secs(10));
    assert_eq!(code, Some(0), "{err}");
    let rows: Vec<&str> = out.lines().skip(2).collect();
    assert!(out.lines().nth(1).is_some_and(|h| h.contains(" nproc ") && h.contains(" host ")), "{out}");
    assert!(rows.first().is_some_and(|r| r.starts_with("198.19.0.7 ")), "master first:\n{out}");
    for m in members {
        assert!(!out.contains(m["id"].as_str().unwrap_or("?")), "no internal ids:\n{out}");
    }
    for m in members {
        assert_eq!(m["iface"], "eth1", "{m}");
        assert_eq!(m["state"], "running", "{m}");
        assert_eq!(m["health"], "alive", "{m}");
        if m["addr"] != "198.19.0.30" {
            assert!(m["rtt_ms"].as_f64().is_some_and(|r| (0.0..1000.0).contains(&r)), "{m}");
        }
    }
    // Asked remotely, with the wrong token: refused, with the reason.
    let q = lab.spawn(0, &[meshd(), "status", "--peers", "198.19.0.19"], &[("MESHD_TOKEN", "nope")]);
    let (code, _, err) = lab.wait(q, Duration::from_secs(10));
    assert_ne!(code, Some(0));
    assert!(err.contains("different token"), "{err}");
    for k in ks {
        let (code, _, err) = lab.wait(k, Duration::from_secs(20));
        assert_eq!(code, Some(0), "{err}");
    }
}
