//! The environment variables that tune meshd itself, read once at start-up and handed to
//! the library in its configuration structs (the library reads no environment of its own).
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
    /// (the ring's bulk as AEAD datagrams); unset: by the interface's MTU.
    pub plane: Option<bool>,
    /// `MESHD_CC`: `cubic`, `bbr` or `newreno`.
    pub cc: CongestionControl,
    /// `MESHD_PRELOAD_LIB`: the tunnel's preload library, instead of meshd's embedded copy.
    pub preload_lib: Option<PathBuf>,
    /// `XDG_RUNTIME_DIR`, else `/tmp`: where a job's socket directory goes.
    pub runtime_dir: PathBuf,
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
        EnvConfig {
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
}
