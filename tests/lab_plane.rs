//! Lab: the ring over the data plane (AEAD datagrams on meshd's one UDP port) behind a
//! firewall that opens only that port: exact results with 1% random loss on every link,
//! and QUIC streams where a middlebox drops the plane's datagrams.

mod lab;
use lab::{Lab, meshd};
use std::time::Duration;

fn firewalled_lab() -> Lab {
    let lab = Lab::new(3);
    for i in 0..3 {
        lab.firewall_only_udp(i, 29400);
    }
    lab
}

/// `meshd bench allreduce` of one size on every host with `--plane plane`; per host, the
/// "served by" of each row. The bench checks every result before timing it.
fn bench(lab: &mut Lab, size: &str, plane: &str) -> Vec<Vec<String>> {
    let peers = lab.peers();
    let args = [
        meshd(),
        "bench",
        "allreduce",
        "--nnodes",
        "3",
        "--peers",
        &peers,
        "--size",
        size,
        "--iters",
        "2",
        "--plane",
        plane,
        "--json",
    ];
    let res = lab.run_on_all(
        &args,
        &[("MESHD_TOKEN", "plane"), ("MESHD_RING_CHUNK", "262144")],
        Duration::from_secs(180),
    );
    res.iter()
        .enumerate()
        .map(|(i, (code, out, err))| {
            assert_eq!(*code, Some(0), "host {i}:\n{out}\n{err}");
            let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object");
            let rows = v["results"].as_array().expect("results");
            rows.iter().map(|r| r["served"].as_str().expect("served").to_string()).collect()
        })
        .collect()
}

#[test]
fn ring_over_the_plane_is_exact_under_one_percent_loss_and_streams_in_the_same_run() {
    if !lab::available() {
        return;
    }
    let mut lab = firewalled_lab();
    for i in 0..3 {
        lab.loss(i, 1);
    }
    let served = bench(&mut lab, "8388608", "both");
    for (i, rows) in served.iter().enumerate() {
        assert_eq!(rows, &["data plane: datagrams", "QUIC streams"], "host {i}");
    }
}

#[test]
fn a_middlebox_that_drops_plane_datagrams_leaves_the_ring_on_quic_streams() {
    if !lab::available() {
        return;
    }
    let mut lab = firewalled_lab();
    // Host 1 drops every UDP datagram to meshd's port whose first payload byte has the top
    // two bits clear: the plane's, never QUIC's (meshd does not grease the fixed bit).
    lab.nft(
        1,
        "table inet mdplane {\n chain input {\n type filter hook input priority -5; policy accept;\n \
         udp dport 29400 @th,64,8 & 0xc0 == 0 drop\n }\n}\n",
    );
    let served = bench(&mut lab, "4194304", "auto");
    // Host 1 hears nothing back on its plane link, nor does the host before it; the third
    // host's next one is not host 1.
    assert_eq!(served[1], ["QUIC streams"], "{served:?}");
    let datagrams = served.iter().filter(|r| r[0] == "data plane: datagrams").count();
    let streams = served.iter().filter(|r| r[0] == "QUIC streams").count();
    assert_eq!((datagrams, streams), (1, 2), "{served:?}");
}
