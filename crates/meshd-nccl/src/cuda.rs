//! The CUDA driver through cudarc (dynamic loading), without ever panicking.

use crate::NcclError;
use crate::error::panic_message;

/// What the CUDA driver reports on this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaInfo {
    /// `cuDriverGetVersion`, e.g. 12080 for CUDA 12.8.
    pub driver_version: u32,
    /// `cuDeviceGetCount` (honours `CUDA_VISIBLE_DEVICES`).
    pub devices: u32,
}

/// Asks the CUDA driver API (libcuda.so.1, loaded by cudarc at run time): `cuInit`,
/// `cuDriverGetVersion`, `cuDeviceGetCount`. `Err(NcclError::NoDriver)` when there is no
/// driver (the normal case on CPU machines); never panics.
pub fn cuda_info() -> Result<CudaInfo, NcclError> {
    // cudarc panics when it cannot open the library: look first.
    crate::lib_nccl::dlopen(c"libcuda.so.1").map_err(|reason| NcclError::NoDriver { reason })?;
    let r = std::panic::catch_unwind(|| -> Result<CudaInfo, NcclError> {
        use cudarc::driver::{result, sys};
        let err = |call: &'static str| {
            move |e: result::DriverError| NcclError::Cuda { call, message: driver_error_text(&e) }
        };
        let mut v: std::ffi::c_int = 0;
        // SAFETY: cuDriverGetVersion writes one int; it may be called before cuInit.
        unsafe { sys::cuDriverGetVersion(&mut v) }.result().map_err(err("cuDriverGetVersion"))?;
        result::init().map_err(err("cuInit"))?;
        let n = result::device::get_count().map_err(err("cuDeviceGetCount"))?;
        Ok(CudaInfo { driver_version: u32::try_from(v).unwrap_or(0), devices: u32::try_from(n).unwrap_or(0) })
    });
    match r {
        Ok(x) => x,
        Err(p) => Err(NcclError::Panic { what: "CUDA driver query", message: panic_message(p.as_ref()) }),
    }
}

/// "CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected" from a cudarc driver error.
pub(crate) fn driver_error_text(e: &cudarc::driver::DriverError) -> String {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    match (name.is_empty(), text.is_empty()) {
        (false, false) => format!("{name}: {text} (code {})", e.0 as i64),
        (false, true) => format!("{name} (code {})", e.0 as i64),
        _ => format!("CUDA error code {}", e.0 as i64),
    }
}
