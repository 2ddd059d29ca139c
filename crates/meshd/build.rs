//! Compiles `crates/meshd-preload/src/lib.rs` (no dependencies; its modules are the
//! files beside it) with rustc alone into
//! `$OUT_DIR/libmeshd_preload.so`, which `meshd::tunnel` embeds (`include_bytes!`) and
//! writes next to the job's sockets at run time: one meshd binary (cargo, the wheel) is
//! the whole install, whatever `cargo build` selected.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let src = manifest.join("../meshd-preload/src/lib.rs");
    // The directory: any of the crate's files (its modules) changing rebuilds it.
    println!("cargo:rerun-if-changed={}", manifest.join("../meshd-preload/src").display());
    println!("cargo:rerun-if-changed=build.rs");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("libmeshd_preload.so");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let target = std::env::var("TARGET").expect("TARGET");
    let mut cmd = Command::new(rustc);
    cmd.args(["--edition", "2024", "--crate-type", "cdylib", "--crate-name", "meshd_preload"])
        .args(["-C", "opt-level=2", "-C", "panic=abort", "-C", "debuginfo=0", "-C", "strip=debuginfo"])
        .args(["--cap-lints", "allow", "--target", &target, "-o"])
        .arg(&out)
        .arg(&src);
    // A cross linker configured for the target applies here too.
    let linker_var = format!("CARGO_TARGET_{}_LINKER", target.to_uppercase().replace('-', "_"));
    if let Ok(linker) = std::env::var(&linker_var) {
        cmd.arg("-C").arg(format!("linker={linker}"));
    }
    let status = cmd.status().expect("run rustc for libmeshd_preload.so");
    assert!(status.success(), "building libmeshd_preload.so from {} failed", src.display());
}
