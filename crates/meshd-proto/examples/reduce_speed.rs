//! Times the reduction kernels: `reduce_into` on 64 MiB buffers for every dtype and op,
//! plus `finish_avg`, printing GB/s of accumulator bytes processed (each reduce reads
//! two buffers and writes one, so memory traffic is 3x the figure).
//!
//! `cargo run --release -p meshd-proto --example reduce_speed -- [MiB] [reps]`
//!
//! A rough guide, not a benchmark suite: machines are shared and noisy, so compare the
//! rows of one run with each other rather than with a number from elsewhere.

use meshd_proto::reduce::{DType, ReduceOp, finish_avg, reduce_into};
use std::time::Instant;

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(64);
    let reps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let len = mib << 20;
    // Bytes that are ordinary finite values for every dtype (no NaN/Inf slow paths):
    // small repeating patterns, 0x3c/0x3f in the high byte of each 16-bit lane.
    let a: Vec<u8> = (0..len).map(|i| if i % 2 == 1 { 0x3c } else { (i % 251) as u8 }).collect();
    let b: Vec<u8> = (0..len).map(|i| if i % 2 == 1 { 0x3b } else { (i % 241) as u8 }).collect();
    let mut acc = a.clone();

    println!("{mib} MiB buffers, best of {reps} runs; GB/s = accumulator bytes / second");
    println!("{:<10} {:>8} {:>8} {:>8} {:>8} {:>10}", "dtype", "sum", "avg", "min", "max", "finish_avg");
    for dtype in DType::ALL {
        let mut row = format!("{:<10}", dtype.name());
        for op in ReduceOp::ALL {
            let best = best_of(reps, || {
                if let Err(e) = reduce_into(dtype, op, &mut acc, &b) {
                    panic!("reduce_into: {e}");
                }
            });
            row += &format!(" {:>8.2}", len as f64 / best / 1e9);
            acc.copy_from_slice(&a); // keep the values from drifting to Inf over reps
        }
        let best = best_of(reps, || {
            if let Err(e) = finish_avg(dtype, &mut acc, 3) {
                panic!("finish_avg: {e}");
            }
        });
        acc.copy_from_slice(&a);
        row += &format!(" {:>10.2}", len as f64 / best / 1e9);
        println!("{row}");
    }
    let best = best_of(reps, || acc.copy_from_slice(&b));
    println!("memcpy reference: {:.2} GB/s", len as f64 / best / 1e9);
    std::hint::black_box(&acc);
}

/// Best wall time in seconds over `reps` runs of `f`.
fn best_of(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}
