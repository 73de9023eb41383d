//! The device code this crate ships: kernels compiled ahead of time by `generate.sh` (a cubin
//! for sm_90 and PTX for compute_80 of each source, checked in as `nccl-sys`'s bindings are),
//! so that using them needs no CUDA toolkit, and building the crate none either:
//! `allreduce.cu` (the all-reduce, all-gather and fused epilogue of
//! [`LsaAllReduce`](super::LsaAllReduce)) and `moe.cu` (the dispatch and combine of
//! [`ExpertExchange`](super::ExpertExchange)). [`load`] and [`load_moe`] pick the image for a
//! context's GPU; [`ABI`] is the NCCL header version they were compiled against, which the
//! device communicator they read is created for.

use std::sync::Arc;

use parking_lot::Mutex;

use cudarc::driver::CudaContext;

use super::kernel::DeviceModule;
use super::{DeviceAbi, DEV_COMM_SINCE};
use crate::error::{Error, Result};

/// The NCCL headers the shipped kernels were compiled against: the first versioned device
/// communicator ([`DEV_COMM_SINCE`], 2.29.2), whose LSA layout every later library keeps; so
/// it is also the oldest library they run on.
pub(crate) const ABI: DeviceAbi = DeviceAbi::new(DEV_COMM_SINCE);

/// The cubin for Hopper (sm_90), loaded as is.
const CUBIN_SM_90: &[u8] = include_bytes!("allreduce.sm_90.cubin");
/// PTX for Ampere and later (compute_80), JIT-compiled by the driver on other GPUs.
const PTX_COMPUTE_80: &str = include_str!("allreduce.compute_80.ptx");
/// The expert exchange's images, as the all-reduce's.
const MOE_CUBIN_SM_90: &[u8] = include_bytes!("moe.sm_90.cubin");
const MOE_PTX_COMPUTE_80: &str = include_str!("moe.compute_80.ptx");

/// One compiled source: its cubin for sm_90 and its PTX.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Image {
    AllReduce,
    Moe,
}

impl Image {
    fn cubin(self) -> &'static [u8] {
        match self {
            Image::AllReduce => CUBIN_SM_90,
            Image::Moe => MOE_CUBIN_SM_90,
        }
    }

    fn ptx(self) -> &'static str {
        match self {
            Image::AllReduce => PTX_COMPUTE_80,
            Image::Moe => MOE_PTX_COMPUTE_80,
        }
    }
}

/// The modules loaded so far, one per CUDA context, kept for the life of the process: a
/// module is never unloaded under a kernel that may still run (one that gave up waiting ends
/// only after its timeout), and a second instance on a context loads (and, from PTX, JIT-
/// compiles) nothing. Each entry holds its context, so no other context can take its address.
static LOADED: Mutex<Vec<(Arc<CudaContext>, Image, DeviceModule)>> = Mutex::new(Vec::new());

/// The shipped kernels in `ctx`: the cubin on sm_90, the PTX on any other GPU from sm_80 on
/// (the driver must load PTX ISA 9.0: 580 or later); older GPUs get [`Error::Unavailable`].
pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<DeviceModule> {
    load_image(ctx, Image::AllReduce)
}

/// The expert exchange's kernels in `ctx`, as [`load`].
pub(crate) fn load_moe(ctx: &Arc<CudaContext>) -> Result<DeviceModule> {
    load_image(ctx, Image::Moe)
}

fn load_image(ctx: &Arc<CudaContext>, image: Image) -> Result<DeviceModule> {
    let mut loaded = LOADED.lock();
    if let Some((_, _, module)) = loaded
        .iter()
        .find(|(c, i, _)| c.cu_ctx() == ctx.cu_ctx() && *i == image)
    {
        return Ok(module.clone());
    }
    let (major, minor) = ctx.compute_capability()?;
    let module = match (major, minor) {
        (9, 0) => DeviceModule::from_cubin(ctx, image.cubin().to_vec(), ABI),
        (m, _) if m >= 8 => DeviceModule::from_ptx(ctx, image.ptx(), ABI),
        _ => {
            return Err(Error::Unavailable {
                api: "nccl-rs's shipped device kernels",
                reason: format!(
                    "they are built for compute capability 8.0 and later; this GPU is \
                     {major}.{minor}"
                ),
            })
        }
    }?;
    loaded.push((ctx.clone(), image, module.clone()));
    Ok(module)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_images_hold_every_kernel() {
        for name in ["flags", "barrier"] {
            for elem in ["f32", "bf16", "f16"] {
                let kernel = format!("nccl_rs_oneshot_{name}_{elem}");
                assert!(
                    PTX_COMPUTE_80.contains(&format!(".entry {kernel}(")),
                    "{kernel}"
                );
                let bytes = kernel.as_bytes();
                assert!(
                    CUBIN_SM_90.windows(bytes.len()).any(|w| w == bytes),
                    "{kernel} in the cubin"
                );
            }
        }
        for elem in ["f32", "bf16", "f16"] {
            for kernel in ["fused_add_rms_norm", "add_rms_norm"] {
                let kernel = format!(".entry nccl_rs_{kernel}_{elem}(");
                assert!(PTX_COMPUTE_80.contains(&kernel), "{kernel}");
            }
        }
        assert!(PTX_COMPUTE_80.contains(".entry nccl_rs_fill_u32("));
        for kernel in [
            "nccl_rs_fused_add_rms_norm_bf16",
            "nccl_rs_add_rms_norm_f16",
            "nccl_rs_fill_u32",
        ] {
            let bytes = kernel.as_bytes();
            assert!(
                CUBIN_SM_90.windows(bytes.len()).any(|w| w == bytes),
                "{kernel} in the cubin"
            );
        }
        assert!(PTX_COMPUTE_80.contains(".target sm_80"));
        for kernel in ["dispatch", "pack", "count_rows", "unpack", "pack_back"]
            .map(String::from)
            .into_iter()
            .chain(
                ["combine", "reduce"]
                    .iter()
                    .flat_map(|k| ["f32", "bf16", "f16"].map(|e| format!("{k}_{e}"))),
            )
        {
            let kernel = format!("nccl_rs_moe_{kernel}");
            assert!(
                MOE_PTX_COMPUTE_80.contains(&format!(".entry {kernel}(")),
                "{kernel}"
            );
            let bytes = kernel.as_bytes();
            assert!(
                MOE_CUBIN_SM_90.windows(bytes.len()).any(|w| w == bytes),
                "{kernel} in the cubin"
            );
        }
        assert_eq!(
            u16::from_le_bytes([MOE_CUBIN_SM_90[18], MOE_CUBIN_SM_90[19]]),
            190
        );
        // An ELF for sm_90: the cubin's machine is CUDA (190).
        assert_eq!(&CUBIN_SM_90[..4], b"\x7fELF");
        assert_eq!(u16::from_le_bytes([CUBIN_SM_90[18], CUBIN_SM_90[19]]), 190);
    }
}
