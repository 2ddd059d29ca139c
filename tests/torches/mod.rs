//! The PyTorch installations the Python suites run on, and a macro (`on_torches!`) that runs
//! one test body on several of them as separate tests (so the closing line of
//! scripts/test.sh counts each):
//!
//! - `torch1_13`: Debian's python3-torch 1.13 (2022) at `/usr/bin/python3`, with numpy: the
//!   oldest torch meshd supports (scripts/setup.sh installs it).
//! - `torch2`: PyPI's current torch in the venv `scripts/fetch-torch.sh` makes and caches
//!   outside the clone (pinned there), named by `MESHD_TORCH2_PYTHON` (scripts/test.sh sets
//!   it), WITHOUT numpy: torch 2.x no longer depends on it and users run it so. The venv holds
//!   numpy (Lightning and Accelerate need it), so its absence is emulated: the ranks get
//!   `tests/python/without_numpy` first on `PYTHONPATH`, where `import numpy` fails as if
//!   it were not installed.
//! - `torch2_numpy`: the same venv with its numpy (where a test asks for it: torch's own
//!   `all_gather_object` and friends need numpy, and so do Lightning and Accelerate).
//!
//! Without `MESHD_TORCH2_PYTHON` the torch 2 variants say loudly that they skip, unless
//! `MESHD_REQUIRE_TORCH2=1` (CI) makes that a failure. Each variant checks once per test
//! binary that its interpreter really is what it claims (torch version, numpy visible or
//! not) before the body runs.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// Debian's interpreter (python3-torch 1.13).
pub const DEBIAN_PYTHON: &str = "/usr/bin/python3";

/// One interpreter a test body runs on.
#[derive(Clone, Debug)]
pub struct Torch {
    /// `torch1_13`, `torch2` or `torch2_numpy`: also the name of the generated test.
    pub variant: &'static str,
    /// The interpreter's path.
    pub python: String,
    /// Whether the ranks may import numpy.
    pub numpy: bool,
    /// `torch.__version__` without its local part (`2.15.0`, `1.13.0a0`).
    pub version: String,
}

/// Directory whose `numpy` package fails to import (PYTHONPATH for "without numpy").
pub fn without_numpy_dir() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/without_numpy").to_string()
}

impl Torch {
    /// Debian's torch 1.13; panics with what to install when it is missing.
    pub fn debian() -> Torch {
        checked("torch1_13", DEBIAN_PYTHON, true).unwrap_or_else(|e| {
            panic!(
                "Debian's python3-torch is required ({e}; apt-get install python3-torch python3-numpy; \
                 scripts/setup.sh installs it)"
            )
        })
    }

    /// The venv's torch 2.x (`MESHD_TORCH2_PYTHON`), with or without numpy; None (said on
    /// stderr) when it is not given and not required.
    pub fn current(numpy: bool) -> Option<Torch> {
        let variant = if numpy { "torch2_numpy" } else { "torch2" };
        let required = std::env::var("MESHD_REQUIRE_TORCH2").as_deref() == Ok("1");
        let python = match std::env::var("MESHD_TORCH2_PYTHON") {
            Ok(p) if !p.trim().is_empty() => p,
            _ if required => panic!(
                "MESHD_REQUIRE_TORCH2=1 but MESHD_TORCH2_PYTHON is not set: run \
                 MESHD_TORCH2_PYTHON=$(scripts/fetch-torch.sh) (scripts/test.sh does)"
            ),
            _ => {
                eprintln!(
                    "*** TORCH 2 VARIANT SKIPPED: MESHD_TORCH2_PYTHON is not set (scripts/fetch-torch.sh makes \
                     the venv; scripts/test.sh sets it) ***"
                );
                return None;
            }
        };
        let t = checked(variant, &python, numpy)
            .unwrap_or_else(|e| panic!("MESHD_TORCH2_PYTHON={python} is not a usable torch 2 venv: {e}"));
        assert!(
            t.version.starts_with("2."),
            "MESHD_TORCH2_PYTHON={python} runs torch {}, not 2.x",
            t.version
        );
        Some(t)
    }

    /// Environment for the ranks (and meshd, which passes it on): PYTHONPATH with the
    /// numpy-hiding directory for the variants without numpy.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        if self.numpy { Vec::new() } else { vec![("PYTHONPATH", without_numpy_dir())] }
    }

    /// `torch 2.15.0 without numpy`, for messages.
    pub fn label(&self) -> String {
        format!("torch {}{}", self.version, if self.numpy { "" } else { " without numpy" })
    }
}

/// Asks the interpreter once per (path, numpy) what it runs; Err says why it is unusable.
fn checked(variant: &'static str, python: &str, numpy: bool) -> Result<Torch, String> {
    // (interpreter, numpy visible) -> its torch version, or why it is unusable.
    type Answers = BTreeMap<(String, bool), Result<String, String>>;
    static SEEN: OnceLock<Mutex<Answers>> = OnceLock::new();
    let seen = SEEN.get_or_init(|| Mutex::new(BTreeMap::new()));
    let key = (python.to_string(), numpy);
    let mut cache = seen.lock().unwrap_or_else(|e| e.into_inner());
    let version = cache
        .entry(key)
        .or_insert_with(|| {
            let mut c = Command::new(python);
            c.args([
                "-W",
                "ignore",
                "-c",
                "import sys, torch\n\
                 try:\n    import numpy; np = True\nexcept ImportError:\n    np = False\n\
                 t = torch.ones(3); t.add_(1)\n\
                 print(torch.__version__.split('+')[0], np)",
            ]);
            if !numpy {
                c.env("PYTHONPATH", without_numpy_dir());
            }
            let out = c.output().map_err(|e| format!("cannot run {python}: {e}"))?;
            let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if !out.status.success() {
                return Err(format!(
                    "`import torch` failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            let (v, np) = text.split_once(' ').ok_or_else(|| format!("unexpected answer {text:?}"))?;
            if np != if numpy { "True" } else { "False" } {
                return Err(format!("numpy importable: {np}, wanted {numpy}"));
            }
            Ok(v.to_string())
        })
        .clone()?;
    Ok(Torch { variant, python: python.to_string(), numpy, version })
}

/// The variant named `torch1_13`, `torch2` or `torch2_numpy` (None: torch 2 skipped).
pub fn variant(name: &str) -> Option<Torch> {
    match name {
        "torch1_13" => Some(Torch::debian()),
        "torch2" => Torch::current(false),
        "torch2_numpy" => Torch::current(true),
        other => panic!("no torch variant {other:?} (torch1_13, torch2, torch2_numpy)"),
    }
}

/// One test body on several torches, each its own test: `on_torches!([torch1_13, torch2]
/// fn name(t) { ... })` makes the module `name` with the tests `name::torch1_13` and
/// `name::torch2`, each calling the body with its [`Torch`] (a skipped torch 2 returns
/// before the body).
#[macro_export]
macro_rules! on_torches {
    ([$($variant:ident),+] $(#[$m:meta])* fn $name:ident($t:ident) $body:block) => {
        $(#[$m])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            fn body($t: &$crate::torches::Torch) $body
            $(
                #[test]
                fn $variant() {
                    if let Some(t) = $crate::torches::variant(stringify!($variant)) {
                        body(&t)
                    }
                }
            )+
        }
    };
}
