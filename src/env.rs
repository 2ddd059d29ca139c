//! The environment variables meshd reads, read once at start-up in one place: its own
//! tuning knobs, handed to the library in its configuration structs (the library reads no
//! environment of its own), and what the CLI takes from its surroundings (SLURM, the Python
//! to run a script with, the visible GPUs). Flags' `PET_*` variables are clap's.
//!
//! A value that does not parse is reported and replaced by the default, as it always was:
//! a tuning knob set wrong must not stop a job.

use meshd::collective::RingConfig;
use meshd::transport::CongestionControl;
use meshd_proto::wire::MAX_LANES;
use std::ffi::OsString;
use std::num::NonZeroUsize;
use std::path::PathBuf;

/// meshd's own environment variables (README, "Environment").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvConfig {
    /// `MESHD_LANES`: QUIC connections the ring sends over (1 to `MAX_LANES`).
    pub lanes: Option<NonZeroUsize>,
    /// `MESHD_RING_CHUNK`: the ring's chunk size in bytes.
    pub ring_chunk: NonZeroUsize,
    /// `MESHD_GSO`: anything but `0` keeps UDP segmentation offload on.
    pub gso: bool,
    /// `MESHD_PLANE`: `0` keeps the ring on QUIC streams, anything else runs the data plane
    /// (the ring's bulk as AEAD datagrams); unset: the data plane.
    pub plane: Option<bool>,
    /// `MESHD_CC`: `cubic`, `bbr` or `newreno`.
    pub cc: CongestionControl,
    /// `MESHD_PRELOAD_LIB`: the tunnel's preload library, instead of meshd's embedded copy.
    pub preload_lib: Option<PathBuf>,
    /// `XDG_RUNTIME_DIR`, else `/tmp`: where a job's socket directory goes.
    pub runtime_dir: PathBuf,
    /// `MESHD_THREADS`: the async runtime's worker threads (unset or not a number: chosen
    /// from the core count).
    pub threads: Option<usize>,
    /// `MALLOC_ARENA_MAX` or `GLIBC_TUNABLES` is set: the user tunes the allocator, meshd
    /// does not.
    pub allocator_tuned: bool,
    /// `MESHD_PYTHON`, else torchrun's `PYTHON_EXEC` (blank is unset): the Python that runs
    /// a script given torchrun's way.
    pub python: Option<String>,
    /// `MESHD_NCCL_LIB` names a library (NCCL is then loaded even without a GPU).
    pub nccl_lib: bool,
    /// `CUDA_VISIBLE_DEVICES`, which narrows the GPUs `--nproc-per-node auto` counts.
    pub cuda_visible: Option<String>,
    /// What SLURM says about the job step.
    pub slurm: Slurm,
}

/// SLURM's variables as meshd uses them (none outside SLURM).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Slurm {
    /// The step's node count: `SLURM_STEP_NUM_NODES`, else `SLURM_NNODES`, else
    /// `SLURM_JOB_NUM_NODES`.
    pub nnodes: Option<String>,
    /// The step's node list: `SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST`.
    pub nodelist: Option<String>,
    /// `SLURM_JOB_ID` (empty is unset).
    pub job_id: Option<String>,
}

impl EnvConfig {
    /// Reads the process environment.
    pub fn from_env() -> Self {
        Self::from_lookup(|k| std::env::var_os(k))
    }

    /// Reads the variables through `get` (a test passes its own).
    fn from_lookup(get: impl Fn(&str) -> Option<OsString>) -> Self {
        let text = |k: &str| get(k).map(|v| v.to_string_lossy().into_owned());
        let lanes = text("MESHD_LANES").and_then(|v| match v.trim().parse::<usize>() {
            Ok(n) if (1..=MAX_LANES).contains(&n) => NonZeroUsize::new(n),
            _ => {
                tracing::warn!("MESHD_LANES={v:?} is not a number from 1 to {MAX_LANES}; using the default");
                None
            }
        });
        let ring_chunk = text("MESHD_RING_CHUNK")
            .and_then(|v| match v.trim().parse::<NonZeroUsize>() {
                Ok(n) => Some(n),
                Err(_) => {
                    tracing::warn!("MESHD_RING_CHUNK={v:?} is not a byte count above 0; using 1 MiB");
                    None
                }
            })
            .unwrap_or(RingConfig::DEFAULT_CHUNK);
        let cc = text("MESHD_CC")
            .and_then(|v| match v.parse::<CongestionControl>() {
                Ok(cc) => Some(cc),
                Err(e) => {
                    tracing::warn!("MESHD_CC: {e}; using cubic");
                    None
                }
            })
            .unwrap_or_default();
        let set = |k: &str| text(k).filter(|v| !v.trim().is_empty());
        let slurm = Slurm {
            nnodes: meshd::peers::slurm_nnodes(|k| text(k)).map(|(_, n)| n),
            nodelist: meshd::peers::slurm_nodelist(|k| text(k)).map(|(_, l)| l),
            job_id: text("SLURM_JOB_ID").filter(|j| !j.is_empty()),
        };
        EnvConfig {
            threads: text("MESHD_THREADS").and_then(|v| v.parse::<usize>().ok()),
            allocator_tuned: ["MALLOC_ARENA_MAX", "GLIBC_TUNABLES"].iter().any(|v| get(v).is_some()),
            python: set("MESHD_PYTHON").or_else(|| set("PYTHON_EXEC")),
            nccl_lib: get("MESHD_NCCL_LIB").is_some_and(|v| !v.is_empty()),
            cuda_visible: text("CUDA_VISIBLE_DEVICES"),
            slurm,
            lanes,
            ring_chunk,
            gso: text("MESHD_GSO").is_none_or(|v| v != "0"),
            plane: text("MESHD_PLANE").map(|v| v != "0"),
            cc,
            preload_lib: get("MESHD_PRELOAD_LIB").filter(|p| !p.is_empty()).map(PathBuf::from),
            // Empty is unset (XDG Base Directory spec): never a socket directory under the
            // current directory.
            runtime_dir: get("XDG_RUNTIME_DIR")
                .filter(|d| !d.is_empty())
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/tmp")),
        }
    }

    /// The ring's configuration.
    pub fn ring(&self) -> RingConfig {
        RingConfig { lanes: self.lanes, chunk_bytes: self.ring_chunk, ..RingConfig::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(vars: &[(&str, &str)]) -> EnvConfig {
        EnvConfig::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| OsString::from(v)))
    }

    #[test]
    fn defaults_when_unset() {
        let e = with(&[]);
        assert_eq!(e.lanes, None);
        assert_eq!(e.ring_chunk.get(), 1 << 20);
        assert!(e.gso);
        assert_eq!(e.cc, CongestionControl::Cubic);
        assert_eq!(e.preload_lib, None);
        assert_eq!(e.runtime_dir, PathBuf::from("/tmp"));
    }

    #[test]
    fn reads_each_variable() {
        let e = with(&[
            ("MESHD_LANES", "4"),
            ("MESHD_RING_CHUNK", "65536"),
            ("MESHD_GSO", "0"),
            ("MESHD_CC", "bbr"),
            ("MESHD_PRELOAD_LIB", "/opt/libmeshd_preload.so"),
            ("XDG_RUNTIME_DIR", "/run/user/1000"),
        ]);
        assert_eq!(e.lanes.map(NonZeroUsize::get), Some(4));
        assert_eq!(e.ring_chunk.get(), 65536);
        assert!(!e.gso);
        assert_eq!(e.cc, CongestionControl::Bbr);
        assert_eq!(e.preload_lib, Some(PathBuf::from("/opt/libmeshd_preload.so")));
        assert_eq!(e.runtime_dir, PathBuf::from("/run/user/1000"));
        assert_eq!(with(&[("MESHD_CC", "newreno")]).cc, CongestionControl::NewReno);
        assert!(with(&[("MESHD_GSO", "1")]).gso);
    }

    #[test]
    fn bad_values_fall_back_to_the_defaults() {
        let e = with(&[
            ("MESHD_LANES", "0"),
            ("MESHD_RING_CHUNK", "0"),
            ("MESHD_CC", "vegas"),
            ("MESHD_PRELOAD_LIB", ""),
            ("XDG_RUNTIME_DIR", ""),
        ]);
        assert_eq!(e.lanes, None);
        assert_eq!(e.ring_chunk, RingConfig::DEFAULT_CHUNK);
        assert_eq!(e.cc, CongestionControl::Cubic);
        assert_eq!(e.preload_lib, None);
        assert_eq!(e.runtime_dir, PathBuf::from("/tmp"));
        assert_eq!(with(&[("MESHD_LANES", &(MAX_LANES + 1).to_string())]).lanes, None);
        assert_eq!(with(&[("MESHD_LANES", "many")]).lanes, None);
    }

    #[test]
    fn the_cli_surroundings_are_read_once_here() {
        let e = with(&[]);
        assert_eq!((e.threads, e.allocator_tuned, e.python.clone(), e.nccl_lib), (None, false, None, false));
        assert_eq!((e.cuda_visible.clone(), e.slurm.clone()), (None, Slurm::default()));
        let e = with(&[
            ("MESHD_THREADS", "3"),
            ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"),
            ("MESHD_PYTHON", " "),
            ("PYTHON_EXEC", "/venv/bin/python3"),
            ("MESHD_NCCL_LIB", "/opt/libnccl.so.2"),
            ("CUDA_VISIBLE_DEVICES", "0,1"),
            ("SLURM_NNODES", "4"),
            ("SLURM_STEP_NUM_NODES", "2"),
            ("SLURM_JOB_NODELIST", "gpu[1-4]"),
            ("SLURM_STEP_NODELIST", "gpu[1-2]"),
            ("SLURM_JOB_ID", "77"),
        ]);
        assert_eq!(e.threads, Some(3));
        assert!(e.allocator_tuned && e.nccl_lib);
        // A blank MESHD_PYTHON is unset: torchrun's PYTHON_EXEC is next.
        assert_eq!(e.python.as_deref(), Some("/venv/bin/python3"));
        assert_eq!(e.cuda_visible.as_deref(), Some("0,1"));
        // Inside a step, the step's count and list.
        assert_eq!(e.slurm.nnodes.as_deref(), Some("2"));
        assert_eq!(e.slurm.nodelist.as_deref(), Some("gpu[1-2]"));
        assert_eq!(e.slurm.job_id.as_deref(), Some("77"));
        assert_eq!(with(&[("MESHD_THREADS", "many"), ("SLURM_JOB_ID", "")]).threads, None);
        assert_eq!(with(&[("SLURM_JOB_ID", "")]).slurm.job_id, None);
    }
}
