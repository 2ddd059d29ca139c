use meshd_proto::sim::{Sim, SimConfig};
use std::time::Duration;
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let n: usize = a[1].parse().unwrap_or(8);
    let seed: u64 = a[2].parse().unwrap_or(1);
    let secs: u64 = a[3].parse().unwrap_or(60);
    let mut s = Sim::new(SimConfig { nodes: n, seed, loss: 0.1, ..SimConfig::default() });
    s.start_all();
    let c = s.run_until(Duration::from_secs(60), Sim::converged);
    eprintln!("converged {c:?} at {:?}", s.now());
    s.run_for(Duration::from_secs(secs));
    for i in 0..n { eprintln!("node {i} = {}", s.id(i)); }
    eprintln!("{:?}", s.verdicts());
}
