//! NCCL's device API: kernels that communicate themselves, by loads and stores into the
//! peers' memory of one LSA (load/store-accessible, NVLink or same-GPU) team, with barriers
//! that run inside the kernel (NCCL 2.29.2+ here).
//!
//! The rooms:
//!
//! * [`DeviceAbi`] (this file): the NCCL version whose headers device code was compiled
//!   against, which decides the layout of the device communicator that code reads.
//! * `requirements.rs`: [`DevCommRequirements`], what a device communicator must provide
//!   (LSA barriers, LL all-to-all slots, multicast, GIN), checked against
//!   [`Comm::properties`](crate::Comm::properties) before NCCL is asked.
//! * `dev_comm.rs`: [`DevComm`], the device communicator (`ncclDevCommCreate`), lent by
//!   NCCL on a [`Comm`](crate::Comm) and passed to kernels as a pointer to a device copy.
//! * `agreement.rs`: the ranks' agreement before NCCL is asked (every rank's own verdict,
//!   requirements and ABI, all-gathered and judged alike on every rank), so a rank refused
//!   alone, or requirements that differ, give every rank a typed error instead of leaving
//!   its peers in NCCL's collective creation.
//! * `team.rs`: [`Team`] and the host-side team queries and rank translation.
//! * `all_reduce/`: [`LsaAllReduce`], the all-reduce kernels this crate ships (one-shot,
//!   with flags or with a barrier) and the fused tensor-parallel epilogue (all-reduce,
//!   residual add, RMSNorm), for small messages inside one LSA team.
//! * `moe/`: [`ExpertExchange`], mixture-of-experts dispatch and combine by shipped kernels
//!   over an LSA team's memory, or NCCL's all-to-all-v elsewhere.
//! * `shipped/`: those kernels' CUDA source, its generator and the checked-in cubin and PTX
//!   (no CUDA toolkit needed to build or use them).
//! * [`kernel`]: the toolchain that turns CUDA C++ into a loaded module: `nvcc` at run time
//!   with the headers of the loaded NCCL, or a cubin/PTX the user built.
//!
//! Window pointers for kernels (LSA and peer addresses, the window handle as a kernel
//! argument) live with the windows: [`Window::lsa_ptr`](crate::Window::lsa_ptr),
//! [`Window::device_window`](crate::Window::device_window).
//!
//! # Writing and running a communicating kernel
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
//! use nccl::device::{kernel::Toolchain, DevComm, DevCommRequirements};
//! use nccl::{Comm, NcclBuffer, WindowFlags};
//!
//! const SOURCE: &str = r#"
//! #include <nccl_device.h>
//! extern "C" __global__ void add_peers(const ncclDevComm* comm, ncclWindow_t win, size_t n) {
//!   ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), *comm, ncclTeamLsa(*comm),
//!                                          comm->lsaBarrier, blockIdx.x};
//!   bar.sync(ncclCoopCta(), cuda::memory_order_acquire);
//!   float* out = (float*)ncclGetLocalPointer(win, n * sizeof(float));
//!   for (size_t i = threadIdx.x; i < n; i += blockDim.x) {
//!     float sum = 0;
//!     for (int peer = 0; peer < comm->lsaSize; peer++)
//!       sum += ((const float*)ncclGetLsaPointer(win, 0, peer))[i];
//!     out[i] = sum;
//!   }
//!   bar.sync(ncclCoopCta(), cuda::memory_order_release);
//! }
//! "#;
//!
//! let stream = CudaContext::new(0)?.new_stream()?;
//! let comm = Comm::init_all(&[stream.clone()])?.pop().unwrap();
//! // nvcc at run time, with the headers of the NCCL this process loaded.
//! let module = Toolchain::find(comm.library())?.build(comm.context(), SOURCE)?;
//! let kernel = module.function("add_peers")?;
//! let n = 1024;
//! let buffer = NcclBuffer::<f32>::alloc_zeros(comm.stream(), 2 * n)?;
//! let mut window = comm.register_window(buffer, WindowFlags::COLL_SYMMETRIC)?;
//! let dev_comm = DevComm::create(&comm, &DevCommRequirements::new().lsa_barriers(1), module.abi())?;
//! let mut win = window.device_window()?;
//! // SAFETY: the kernel's parameters are these three, it stays inside the window, and its
//! // one CTA uses barrier 0 of the one requested.
//! unsafe {
//!     comm.stream()
//!         .launch_builder(&kernel)
//!         .arg(&dev_comm)
//!         .arg(&mut win)
//!         .arg(&n)
//!         .launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })?;
//! }
//! # Ok(()) }
//! ```
//!
//! # Versions
//!
//! * Device communicators need NCCL 2.29.2+ ([`DEV_COMM_SINCE`]): from there the structs carry
//!   a `version` NCCL checks and translates; 2.28's had none (and changed between 2.28.3 and
//!   2.28.9), so a 2.28 library cannot tell which layout a kernel reads. Older libraries give
//!   [`crate::Error::Unsupported`] before NCCL is called.
//! * Device code must be compiled against headers no newer than the loaded library (NCCL
//!   refuses a newer `version`); LSA (and multimem) kernels compiled against 2.29.2+ headers
//!   run on any later library, which lays the device communicator out as they expect. GIN
//!   kernels must be compiled against the loaded library's own headers
//!   ([`DeviceAbi::check`]).

mod agreement;
mod all_reduce;
mod dev_comm;
pub mod kernel;
mod moe;
mod requirements;
mod shipped;
mod team;

pub use all_reduce::{LsaAlgorithm, LsaAllReduce, LsaElem, LsaEpilogue};
pub use dev_comm::DevComm;
pub use moe::{
    Dispatched, ExchangePath, ExpertExchange, ExpertShape, MAX_ENTRIES, MAX_EXPERTS, MAX_RANKS,
};
pub use requirements::{DevCommRequirements, GIN_CONNECTION_SINCE};
pub use team::Team;

use crate::error::{Error, Result};
use crate::release::Version;

/// The first NCCL whose device communicator this crate creates (see the
/// [module docs](self#versions)).
pub const DEV_COMM_SINCE: Version = Version::new(2, 29, 2);

/// The NCCL version whose headers device code was compiled against: the layout of the
/// `ncclDevComm` that code reads, which NCCL writes as the requirements' `version` tells it.
///
/// [`kernel::DeviceModule::abi`] gives it for code built here; for a cubin or PTX built
/// elsewhere, say it with [`DeviceAbi::new`]. A wrong version makes kernels misread the
/// device communicator, which is why launching them stays `unsafe` (as every cudarc launch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceAbi(Version);

impl DeviceAbi {
    /// Device code compiled against the NCCL headers of `version`.
    pub const fn new(version: Version) -> Self {
        Self(version)
    }

    /// The header version.
    pub const fn version(self) -> Version {
        self.0
    }

    /// Whether code of this ABI may run on the library `library`: compiled against 2.29.2+
    /// headers, no newer than the library, and, for `gin` kernels, against exactly the
    /// library's version.
    pub fn check(self, library: Version, gin: bool) -> Result<()> {
        if self.0 < DEV_COMM_SINCE {
            return Err(Error::invalid(format!(
                "device code compiled against NCCL {} headers: device communicators before \
                 {DEV_COMM_SINCE} carry no version, so NCCL cannot lay one out for it; rebuild \
                 against NCCL {DEV_COMM_SINCE}+ headers",
                self.0
            )));
        }
        if self.0 > library {
            return Err(Error::Unsupported {
                api: "device code compiled against these NCCL headers",
                needs: self.0,
                found: library,
            });
        }
        if gin && self.0 != library {
            return Err(Error::invalid(format!(
                "GIN device code must be compiled against the loaded NCCL's own headers: it \
                 was compiled against {}, the library is {library} (NCCL keeps no GIN \
                 compatibility across versions)",
                self.0
            )));
        }
        Ok(())
    }
}

impl std::fmt::Display for DeviceAbi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NCCL {} device ABI", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_code_runs_on_libraries_at_least_as_new() {
        let v = Version::new;
        let abi = DeviceAbi::new(v(2, 30, 7));
        assert!(abi.check(v(2, 30, 7), false).is_ok());
        assert!(abi.check(v(2, 32, 3), false).is_ok());
        assert!(abi.check(v(2, 30, 7), true).is_ok());
        match abi.check(v(2, 29, 7), false) {
            Err(Error::Unsupported { needs, found, .. }) => {
                assert_eq!((needs, found), (v(2, 30, 7), v(2, 29, 7)));
            }
            other => panic!("{other:?}"),
        }
        let err = abi.check(v(2, 32, 3), true).unwrap_err().to_string();
        assert!(err.contains("GIN device code"), "{err}");
        let err = DeviceAbi::new(v(2, 28, 9))
            .check(v(2, 32, 3), false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("carry no version"), "{err}");
    }
}
