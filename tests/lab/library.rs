//! Library nodes (`meshd::Node::spawn`, the API of custom rendezvous) on loopback, for the
//! suites that run a mesh inside the test process.

use meshd::mesh::MeshConfig;
use meshd::transport::auth::Token;

/// The mesh of a library node on loopback port `port`, joining through every port of
/// `ports` (each one node), the data plane on; `token` is its token and its run id.
pub fn mesh(ports: &[u16], port: u16, token: &str) -> MeshConfig {
    let peers = ports
        .iter()
        .map(|&p| (format!("127.0.0.1:{p}"), std::net::SocketAddr::from(([127, 0, 0, 1], p))))
        .collect();
    MeshConfig {
        plane: Some(true),
        ..MeshConfig::new(
            meshd::random_node_id(),
            port,
            Some(Token::new(token)),
            token,
            peers,
            ports.len() as u32,
        )
    }
}

/// A library node of [`mesh`] once its roster is agreed: the handle and its node rank.
pub async fn node(ports: &[u16], port: u16, token: &str) -> (meshd::NodeHandle, usize) {
    let mut node = meshd::Node::spawn(meshd::NodeConfig::new(mesh(ports, port, token))).await.expect("node");
    let roster = node.roster().await.expect("roster");
    let rank = roster.node_rank(node.id()).expect("in the roster");
    (node, rank)
}
