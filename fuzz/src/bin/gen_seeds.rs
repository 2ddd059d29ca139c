//! Writes each target's seed inputs to `$MESHD_FUZZ_SEEDS/<target>/` and exits (run by
//! scripts/fuzz.sh). Seeds are encoded by the real encoders, so they follow the wire
//! format as it is now. It is a libFuzzer binary only because everything `cargo fuzz
//! build` links is instrumented and needs libFuzzer's runtime.
#![no_main]

use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;

fn write_seeds() -> std::io::Result<()> {
    let dir = PathBuf::from(std::env::var_os("MESHD_FUZZ_SEEDS").unwrap_or_else(|| "fuzz/seeds".into()));
    let sets = [
        ("frame", meshd_fuzz::seeds::frame_inputs()),
        ("handshake", meshd_fuzz::seeds::handshake_inputs()),
        ("ring", meshd_fuzz::seeds::ring_inputs()),
        ("service", meshd_fuzz::seeds::service_inputs()),
        ("plane_header", meshd_fuzz::seeds::plane_header_inputs()),
        ("plane_frame", meshd_fuzz::seeds::plane_frame_inputs()),
        ("plane_ack", meshd_fuzz::seeds::plane_ack_inputs()),
        ("plane_link", meshd_fuzz::seeds::plane_link_inputs()),
    ];
    for (target, inputs) in sets {
        let d = dir.join(target);
        std::fs::create_dir_all(&d)?;
        for (i, input) in inputs.iter().enumerate() {
            std::fs::write(d.join(format!("seed-{i:02}")), input)?;
        }
        println!("{target}: {} seeds in {}", inputs.len(), d.display());
    }
    Ok(())
}

/// Exits with `code` (a function returning `()`, so the macro's code after `init` is not
/// "unreachable").
fn exit(code: i32) {
    std::process::exit(code)
}

fuzz_target!(
    init: {
        if let Err(e) = write_seeds() {
            eprintln!("gen_seeds: {e}");
            exit(1);
        }
        exit(0);
    },
    |_data: &[u8]| {}
);
