//! Error type of this crate.

use std::path::PathBuf;

/// Everything that can go wrong between meshd and CUDA/NCCL. Messages name the cause and,
/// where there is one, the fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NcclError {
    /// No libnccl was found anywhere it was looked for.
    #[error(
        "libnccl not found (tried: {}); set MESHD_NCCL_LIB=/path/to/libnccl.so.2 or pip install nvidia-nccl-cu12",
        .tried.join("; ")
    )]
    NotFound {
        /// Every place tried, in words, in order.
        tried: Vec<String>,
    },
    /// The file does not exist.
    #[error("{}: no such file", .path.display())]
    NoSuchFile {
        /// The path given.
        path: PathBuf,
    },
    /// `dlopen` refused the file.
    #[error("cannot load {}: {reason}", .path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// `dlerror()`'s text.
        reason: String,
    },
    /// The file loaded but is not libnccl (or too old): a symbol is missing.
    #[error("{} is not libnccl: symbol {symbol} not found", .path.display())]
    MissingSymbol {
        /// The file.
        path: PathBuf,
        /// The missing symbol.
        symbol: &'static str,
    },
    /// An NCCL call returned an error code.
    #[error("{call} failed: code {code} ({})", nccl_result_name(*.code))]
    Nccl {
        /// The NCCL function.
        call: &'static str,
        /// Its `ncclResult_t`.
        code: i32,
    },
    /// libcuda.so.1 cannot be opened.
    #[error("libcuda.so.1 not found: no NVIDIA driver on this host ({reason})")]
    NoDriver {
        /// `dlerror()`'s text.
        reason: String,
    },
    /// A CUDA driver call returned an error.
    #[error("{call} failed: {message}")]
    Cuda {
        /// The driver function.
        call: &'static str,
        /// The driver's error name and text.
        message: String,
    },
    /// cudarc panicked (caught; a library or symbol it wanted was missing).
    #[error("{what} panicked inside cudarc: {message}")]
    Panic {
        /// What was being done.
        what: &'static str,
        /// The panic message.
        message: String,
    },
}

/// The name of an `ncclResult_t` code, e.g. 2 -> "ncclSystemError".
pub fn nccl_result_name(code: i32) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        _ => "unknown ncclResult_t",
    }
}

/// The text of a caught panic payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_owned()
    }
}
