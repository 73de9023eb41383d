//! candle's CUDA kernels loaded up front, for ranks that share a GPU in one process.
//!
//! candle loads each of its kernel modules (PTX, compiled by the driver) on a device at the
//! first use of one of its kernels, and loading a module can wait for everything running in
//! the CUDA context. Two ranks of one process sharing a GPU share that context, and a
//! collective of one rank spins there until the other joins it: a module the other rank
//! loads in between waits for the first rank's collective, which waits for it. Both hang
//! (seen on one H200 with candle's first use of an op between two ranks' collectives, and
//! with CUDA's eager loading too). Loading every module before any rank's first collective
//! leaves nothing to load later.

use candle_core::Device;

use crate::Result;

/// One kernel of each of candle 0.11.1's kernel modules (`candle_kernels::ALL_IDS`): asking
/// for it loads its whole module on the device.
#[cfg(feature = "cuda")]
const ONE_KERNEL_EACH: [(&str, &candle_kernels::Module); 11] = [
    ("affine_f32", &candle_kernels::AFFINE),
    ("bmul_f32", &candle_kernels::BINARY),
    ("cast_f32_f32", &candle_kernels::CAST),
    ("conv1d_f32", &candle_kernels::CONV),
    ("fill_f32", &candle_kernels::FILL),
    ("is_u32_f32", &candle_kernels::INDEXING),
    ("quantize_q8_1", &candle_kernels::QUANTIZED),
    ("fast_sum_f32", &candle_kernels::REDUCE),
    ("asort_asc_f32", &candle_kernels::SORT),
    ("where_u32_f32", &candle_kernels::TERNARY),
    ("uexp_f32", &candle_kernels::UNARY),
];

/// Loads every one of candle-kernels' modules on `device` (nothing on a CPU device) and
/// waits for the device, so that no candle op built on them has a module left to load.
/// Not covered: the kernels candle links in from its own static libraries (its GGUF
/// matrix-vector and mixture-of-experts kernels), which CUDA loads as any linked kernel.
///
/// Needed where ranks of one process share a GPU (`NCCL_MULTI_RANK_GPU_ENABLE=1`,
/// `Comm::init_all` with one GPU twice): call it on every rank's device before any rank's
/// first collective, since a module loaded later can wait for a peer's collective that waits
/// for this rank (see the module docs). It needs `CUDA_MODULE_LOADING=EAGER` there as well:
/// lazily, each kernel of a loaded module is still loaded at its first use (`init_all`
/// refuses such ranks; ranks made with `Comm::init_rank` on threads are the caller's to
/// check, with `nccl::library::lazy_module_loading`). Harmless elsewhere; a device's modules
/// load once (from the driver's cache after the first time a machine compiles them).
pub fn load_kernels(device: &Device) -> Result<()> {
    let Device::Cuda(cuda) = device else {
        return Ok(());
    };
    load_modules(cuda)?;
    device.synchronize()?;
    Ok(())
}

#[cfg(feature = "cuda")]
fn load_modules(cuda: &candle_core::CudaDevice) -> Result<()> {
    for (kernel, module) in ONE_KERNEL_EACH {
        cuda.get_or_load_func(kernel, module)?;
    }
    Ok(())
}

/// Without `cuda` there are no kernels, and `cuda` is candle's placeholder, which no `Device`
/// is made of (see `cuda_device`).
#[cfg(not(feature = "cuda"))]
fn load_modules(_: &candle_core::CudaDevice) -> Result<()> {
    Err(crate::cuda_device::not_compiled())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "cuda")]
    #[test]
    fn one_kernel_of_every_module() {
        let mut modules: Vec<usize> = ONE_KERNEL_EACH.iter().map(|(_, m)| m.index()).collect();
        modules.sort_unstable();
        modules.dedup();
        assert_eq!(modules.len(), candle_kernels::ALL_IDS.len());
    }

    #[test]
    fn nothing_to_load_on_the_cpu() {
        load_kernels(&Device::Cpu).unwrap();
    }
}
