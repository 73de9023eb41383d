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

use cudarc::driver::{CudaContext, CudaFunction};

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

/// Every kernel of the shipped images, one row each: the image that holds it and its symbol,
/// `nccl_rs_{name}` or, for the kernels compiled per element type, `nccl_rs_{name}_{elem}`
/// (`f32`, `bf16`, `f16`). The callers look kernels up here, and the images' test checks every
/// row, so a kernel renamed on one side fails the tests, not a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShippedFn {
    OneShotFlags,
    TwoShotFlags,
    AllGather,
    OneShotBarrier,
    FusedAddRmsNorm,
    AddRmsNorm,
    FillU32,
    MoeDispatch,
    MoeCombine,
    MoePack,
    MoeCountRows,
    MoeUnpack,
    MoePackBack,
    MoeReduce,
}

impl ShippedFn {
    /// Every row.
    #[cfg(test)]
    const ALL: [ShippedFn; 14] = [
        ShippedFn::OneShotFlags,
        ShippedFn::TwoShotFlags,
        ShippedFn::AllGather,
        ShippedFn::OneShotBarrier,
        ShippedFn::FusedAddRmsNorm,
        ShippedFn::AddRmsNorm,
        ShippedFn::FillU32,
        ShippedFn::MoeDispatch,
        ShippedFn::MoeCombine,
        ShippedFn::MoePack,
        ShippedFn::MoeCountRows,
        ShippedFn::MoeUnpack,
        ShippedFn::MoePackBack,
        ShippedFn::MoeReduce,
    ];

    /// The row: image, name, and whether it is compiled per element type.
    const fn row(self) -> (Image, &'static str, bool) {
        match self {
            ShippedFn::OneShotFlags => (Image::AllReduce, "oneshot_flags", true),
            ShippedFn::TwoShotFlags => (Image::AllReduce, "twoshot_flags", true),
            ShippedFn::AllGather => (Image::AllReduce, "all_gather", true),
            ShippedFn::OneShotBarrier => (Image::AllReduce, "oneshot_barrier", true),
            ShippedFn::FusedAddRmsNorm => (Image::AllReduce, "fused_add_rms_norm", true),
            ShippedFn::AddRmsNorm => (Image::AllReduce, "add_rms_norm", true),
            ShippedFn::FillU32 => (Image::AllReduce, "fill_u32", false),
            ShippedFn::MoeDispatch => (Image::Moe, "moe_dispatch", false),
            ShippedFn::MoeCombine => (Image::Moe, "moe_combine", true),
            ShippedFn::MoePack => (Image::Moe, "moe_pack", false),
            ShippedFn::MoeCountRows => (Image::Moe, "moe_count_rows", false),
            ShippedFn::MoeUnpack => (Image::Moe, "moe_unpack", false),
            ShippedFn::MoePackBack => (Image::Moe, "moe_pack_back", false),
            ShippedFn::MoeReduce => (Image::Moe, "moe_reduce", true),
        }
    }

    /// Its symbol for element type `elem` (ignored by the untyped kernels).
    fn symbol(self, elem: &str) -> String {
        match self.row() {
            (_, name, true) => format!("nccl_rs_{name}_{elem}"),
            (_, name, false) => format!("nccl_rs_{name}"),
        }
    }
}

/// Kernel `f` of `module` (loaded by [`load`] or [`load_moe`], as `f`'s image), for element
/// type `elem` (an [`LsaElem`](super::LsaElem) suffix).
pub(crate) fn function(module: &DeviceModule, f: ShippedFn, elem: &str) -> Result<CudaFunction> {
    Ok(module.function(&f.symbol(elem))?)
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
        for f in ShippedFn::ALL {
            let (image, _, typed) = f.row();
            let elems: &[&str] = if typed {
                &["f32", "bf16", "f16"]
            } else {
                &[""]
            };
            for elem in elems {
                let kernel = f.symbol(elem);
                assert!(
                    image.ptx().contains(&format!(".entry {kernel}(")),
                    "{kernel} in the PTX"
                );
                let bytes = kernel.as_bytes();
                assert!(
                    image.cubin().windows(bytes.len()).any(|w| w == bytes),
                    "{kernel} in the cubin"
                );
            }
        }
        for image in [Image::AllReduce, Image::Moe] {
            assert!(image.ptx().contains(".target sm_80"));
            // An ELF for sm_90: the cubin's machine is CUDA (190).
            assert_eq!(&image.cubin()[..4], b"\x7fELF");
            assert_eq!(
                u16::from_le_bytes([image.cubin()[18], image.cubin()[19]]),
                190
            );
        }
        assert_eq!(
            ShippedFn::OneShotFlags.symbol("bf16"),
            "nccl_rs_oneshot_flags_bf16"
        );
        assert_eq!(
            ShippedFn::MoeDispatch.symbol("bf16"),
            "nccl_rs_moe_dispatch"
        );
    }
}
