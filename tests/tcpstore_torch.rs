//! meshd's TCPStore server (`meshd::tcpstore`) against real torch clients: every op of
//! `TCPStore(host, port, is_master=False)`, a get that blocks until another process sets,
//! PrefixStore, Gloo's rendezvous and collectives over it (a store handed to
//! `init_process_group`, and `env://` with `TORCHELASTIC_USE_AGENT_STORE=True`, torchrun's
//! agent-store mode), and hostile bytes from raw sockets that must not hurt it. On torch
//! 1.13 (Debian) and torch 2 (`MESHD_TORCH2_PYTHON`; see tests/torches/mod.rs).

mod torches;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use meshd::tcpstore::{TcpStoreHandle, TcpStoreServer};
use torches::Torch;

const SCRIPTS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python");

/// A store served on 127.0.0.1 by its own runtime (the test thread blocks on Python).
struct Served {
    handle: Option<TcpStoreHandle>,
    rt: tokio::runtime::Runtime,
}

impl Served {
    fn start() -> Served {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let handle = rt.block_on(async {
            let addr: SocketAddr = "127.0.0.1:0".parse().expect("addr");
            TcpStoreServer::bind(addr).await.expect("bind").spawn().expect("spawn")
        });
        Served { handle: Some(handle), rt }
    }

    fn handle(&self) -> &TcpStoreHandle {
        self.handle.as_ref().expect("serving")
    }

    fn port(&self) -> u16 {
        self.handle().local_addr().port()
    }

    fn stats(&self) -> meshd::tcpstore::TcpStoreStats {
        self.rt.block_on(self.handle().stats())
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _g = self.rt.enter();
        self.handle.take();
    }
}

fn python(t: &Torch, args: &[&str], env: &[(&str, String)]) -> Command {
    let mut c = Command::new(&t.python);
    c.arg("-W").arg("ignore").args(args).envs(t.env()).envs(env.iter().map(|(k, v)| (*k, v)));
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

fn run_ok(mut c: Command, what: &str) -> String {
    let child = c.spawn().unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    let out = child.wait_with_output().expect("wait");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && stdout.contains("OK"),
        "{what} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Both ranks at once; each must print OK.
fn two_ranks(t: &Torch, what: &str, make: impl Fn(usize) -> Command) {
    let children: Vec<_> = (0..2)
        .map(|r| make(r).spawn().unwrap_or_else(|e| panic!("{what} rank {r}: cannot start: {e}")))
        .collect();
    for (r, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().expect("wait");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("OK"),
            "{what} rank {r} on {} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{}",
            t.label(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Raw sockets that send what no torch sends; each must be closed by the server.
fn hostile(port: u16) {
    let mut magic_then_huge = vec![0u8, 0xce, 0xf7, 0x85, 0x3c, 1];
    magic_then_huge.extend_from_slice(&u64::MAX.to_le_bytes());
    let cases: Vec<Vec<u8>> = vec![
        (0..=255u8).cycle().take(4096).collect(),
        vec![0, 0xde, 0xad, 0xbe, 0xef, 0xff, 0xff, 0xff, 0xff, 0xff],
        magic_then_huge,
        vec![0, 0xce, 0xf7, 0x85, 0x3c, 250],
    ];
    for bytes in cases {
        let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        // The server may close before all is written.
        let _ = s.write_all(&bytes);
        let mut b = [0u8; 64];
        loop {
            match s.read(&mut b) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e) => panic!("not closed after {:?}...: {e}", &bytes[..bytes.len().min(8)]),
            }
        }
    }
    // And one that sends half a query, then vanishes.
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let _ = s.write_all(&[0, 0xce, 0xf7, 0x85, 0x3c, 1, 9, 0, 0, 0, 0, 0, 0, 0, b'/']);
    drop(s);
}

on_torches!([torch1_13, torch2] fn every_op_of_a_client(t) {
    let served = Served::start();
    let port = served.port().to_string();
    let out = run_ok(python(t, &[&format!("{SCRIPTS}/tcpstore_ops.py"), "127.0.0.1", &port], &[]), "tcpstore_ops.py");
    assert!(out.contains(&t.version), "{out}");
});

on_torches!([torch1_13, torch2] fn hostile_bytes_then_a_real_client(t) {
    let served = Served::start();
    hostile(served.port());
    let port = served.port().to_string();
    run_ok(python(t, &[&format!("{SCRIPTS}/tcpstore_ops.py"), "127.0.0.1", &port], &[]), "tcpstore_ops.py after hostile peers");
    // Every connection, hostile or not, is gone once its peer is.
    let mut s = served.stats();
    for _ in 0..100 {
        if s.connections == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        s = served.stats();
    }
    assert_eq!((s.connections, s.waiting), (0, 0), "{s:?}");
});

on_torches!([torch1_13, torch2] fn gloo_over_a_store_handed_to_init(t) {
    let served = Served::start();
    let port = served.port().to_string();
    two_ranks(t, "gloo store=", |r| {
        python(t, &[&format!("{SCRIPTS}/tcpstore_gloo.py"), "store", &r.to_string(), "127.0.0.1", &port], &[])
    });
});

on_torches!([torch1_13, torch2] fn gloo_env_init_with_the_agent_store(t) {
    let served = Served::start();
    let port = served.port().to_string();
    let env = [
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.clone()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".to_string()),
        ("TORCHELASTIC_RESTART_COUNT", "0".to_string()),
        ("GLOO_SOCKET_IFNAME", "lo".to_string()),
    ];
    two_ranks(t, "gloo env://", |r| {
        python(t, &[&format!("{SCRIPTS}/tcpstore_gloo.py"), "env", &r.to_string()], &env)
    });
    // The ranks used our store, under torchrun's per-attempt prefix.
    assert!(served.stats().keys > 0);
});
