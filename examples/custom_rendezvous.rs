//! Custom rendezvous with the meshd library, without the CLI: join a mesh from seeds and a
//! token, await the agreed roster (master, ranks, addresses), then use the same QUIC
//! endpoint for a ring allreduce, a broadcast, a barrier and an 8 MiB average whose chunks
//! go to QUIC without being copied, and the job-wide store. The node's actor answers the
//! mesh on its own.
//!
//! Run the same line for each node (here two nodes on loopback):
//!
//! ```sh
//! cargo run --example custom_rendezvous -- 127.0.0.1:29701,127.0.0.1:29702 29701 &
//! cargo run --example custom_rendezvous -- 127.0.0.1:29701,127.0.0.1:29702 29702
//! ```

use meshd::collective::CollectiveBuffer;
use meshd::mesh::MeshConfig;
use meshd::proto::membership::MembershipConfig;
use meshd::proto::reduce::{DType, ReduceOp};
use meshd::transport::auth::Token;
use meshd::{Node, NodeConfig};
use std::time::Duration;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let peers_arg = args.get(1).cloned().unwrap_or_else(|| "127.0.0.1:29701,127.0.0.1:29702".into());
    let port: u16 = args.get(2).and_then(|p| p.parse().ok()).unwrap_or(29701);
    let specs = meshd::peers::parse(&peers_arg)?;
    let (peers, _unresolved) = meshd::peers::resolve(&specs, port);
    let n = peers.len() as u32;

    // 1. Join: any one reachable member is enough; the token authenticates every link.
    let mut node = Node::spawn(NodeConfig::new(MeshConfig {
        node: meshd::random_node_id(),
        port,
        token: Some(Token::new("example-secret")),
        run_id: "custom-rendezvous-example".into(),
        peers,
        unresolved: Vec::new(),
        resolve_timeout: Duration::from_secs(60),
        min_nodes: n,
        max_nodes: n,
        iface: None,
        nproc: 1,
        cmd_hash: 0,
        membership: MembershipConfig::default(),
        gso: true,
        plane: Some(true),
        plane_lanes: None,
        cc: Default::default(),
    }))
    .await?;

    // 2. Await the roster: the same on every node, master = lowest address.
    let roster = node.roster().await?;
    let rank = roster.node_rank(node.id()).ok_or("not in roster")?;
    let master = roster.master().map(|m| m.addr.to_string()).unwrap_or_default();
    println!("node rank {rank} of {}, master {master}", roster.members.len());

    // 3. Collectives on the same QUIC endpoint; every node issues the same operations with
    //    the same ids, in the same order.
    let mut ring = node.ring().ok_or("no roster")?;
    let mut buf: Vec<u8> = (0..1000).flat_map(|_| ((rank + 1) as f32).to_le_bytes()).collect();
    ring.allreduce(1, &mut buf, DType::F32, ReduceOp::Sum).await?;
    // Node 0's bytes to everyone (any length), then wait for every node.
    let mut msg = if rank == 0 { *b"hello from node 0" } else { [0u8; 17] };
    ring.broadcast(2, &mut msg, 0).await?;
    ring.barrier(3).await?;
    // Large buffers: a CollectiveBuffer lends its chunks to QUIC instead of copying them.
    // 8 MiB of float32 gradients, averaged over the nodes.
    let mut grads =
        CollectiveBuffer::from_vec((0..2 << 20).flat_map(|_| (rank as f32).to_le_bytes()).collect());
    ring.allreduce_buffer(4, &mut grads, DType::F32, ReduceOp::Avg).await?;
    let g = grads.as_slice();
    println!(
        "allreduce sum over {} nodes: {}",
        roster.members.len(),
        f32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]])
    );
    println!("broadcast from node 0: {}", String::from_utf8_lossy(&msg));
    println!("8 MiB average of the node ranks: {}", f32::from_le_bytes([g[0], g[1], g[2], g[3]]));

    // 4. The job-wide store: node 0 publishes, every node reads (waiting until it is set).
    if rank == 0 {
        node.store_set("greeting", b"hi from node 0".to_vec()).await?;
    }
    let greeting = node.store_get("greeting", Duration::from_secs(30)).await.ok_or("no greeting")?;
    println!("store: {}", String::from_utf8_lossy(&greeting));

    // 5. Done: wait until every node is, then leave.
    let end = node.finish().await?;
    println!("{}", end.message);
    Ok(())
}
