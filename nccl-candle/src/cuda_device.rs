//! What this crate asks of candle's CUDA device beyond `Device`'s own methods, in one place,
//! so that the crate also builds without candle's CUDA backend.
//!
//! With the `cuda` feature off (the docs' build: docs.rs has no nvcc, which candle-kernels'
//! build script runs) candle-core puts a placeholder `CudaDevice` of the same name in place of
//! its CUDA device, without these methods; no `Device` is made of it (`Device::new_cuda`
//! fails with candle's `NotCompiledWithCudaSupport`). These then refuse with that error, and
//! the public API, documented from that build, stays the same.
//!
//! cudarc's types are named through nccl-rs (`nccl::cudarc`), which the placeholder lacks:
//! it is the one cudarc candle's CUDA backend uses too (the `cuda` build, which passes
//! candle's streams where these types are expected, would not compile otherwise).

use std::sync::Arc;

use candle_core::CudaDevice;
use nccl::cudarc::driver::CudaStream;

use crate::Result;

/// The stream candle runs `cuda`'s work on (cudarc's, the one nccl-rs takes).
#[cfg(feature = "cuda")]
pub(crate) fn stream(cuda: &CudaDevice) -> Result<Arc<CudaStream>> {
    Ok(cuda.cuda_stream())
}

/// Whether cudarc tracks cross-stream events on `cuda`'s context.
#[cfg(feature = "cuda")]
pub(crate) fn is_event_tracking(cuda: &CudaDevice) -> Result<bool> {
    Ok(cuda.is_event_tracking())
}

/// Stops cudarc's cross-stream event tracking on `cuda`'s context.
///
/// # Safety
///
/// candle's `CudaDevice::disable_event_tracking`'s: the caller orders every use of the
/// device's tensors on another stream.
#[cfg(feature = "cuda")]
pub(crate) unsafe fn disable_event_tracking(cuda: &CudaDevice) -> Result<()> {
    // SAFETY: the caller's contract is candle's.
    unsafe { cuda.disable_event_tracking() };
    Ok(())
}

/// candle's cache of small host uploads in device memory, on while the guard lives (for a
/// CUDA graph's capture: the captured kernels keep reading them).
#[cfg(feature = "cuda")]
pub(crate) fn graph_htod_cache(cuda: &CudaDevice) -> Result<impl Sized> {
    Ok(cuda.enable_cuda_graph_htod_cache())
}

/// candle's refusal of CUDA when built without it.
#[cfg(not(feature = "cuda"))]
pub(crate) fn not_compiled() -> crate::Error {
    crate::Error::Candle(candle_core::Error::NotCompiledWithCudaSupport)
}

/// The stream candle runs `cuda`'s work on (cudarc's, the one nccl-rs takes).
#[cfg(not(feature = "cuda"))]
pub(crate) fn stream(_: &CudaDevice) -> Result<Arc<CudaStream>> {
    Err(not_compiled())
}

/// Whether cudarc tracks cross-stream events on `cuda`'s context.
#[cfg(not(feature = "cuda"))]
pub(crate) fn is_event_tracking(_: &CudaDevice) -> Result<bool> {
    Err(not_compiled())
}

/// Stops cudarc's cross-stream event tracking on `cuda`'s context.
///
/// # Safety
///
/// candle's `CudaDevice::disable_event_tracking`'s (without `cuda`, a refusal).
#[cfg(not(feature = "cuda"))]
pub(crate) unsafe fn disable_event_tracking(_: &CudaDevice) -> Result<()> {
    Err(not_compiled())
}

/// candle's cache of small host uploads in device memory, on while the guard lives.
#[cfg(not(feature = "cuda"))]
pub(crate) fn graph_htod_cache(_: &CudaDevice) -> Result<impl Sized> {
    Err::<(), _>(not_compiled())
}
