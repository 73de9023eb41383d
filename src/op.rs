//! Reduction operators.
//!
//! The built-in operators are a plain enum, [`ReduceOp`]. NCCL's pre-multiplied sum is a value
//! created on one communicator for one element type, [`PreMulSum`]: it borrows the
//! communicator, so it cannot outlive it, and it is destroyed when dropped. Collectives take
//! either as a [`Reduction`]: write `ReduceOp::Sum` or `&pre_mul_sum`.

use std::marker::PhantomData;

use cudarc::driver::{CudaStream, DevicePtr, SyncOnDrop};
use nccl_sys::{ncclRedOp_t, ncclScalarResidence_t};

use crate::calls;
use crate::comm::{comm_call, Comm, Lease};
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::release::Version;

/// NCCL's built-in reduction operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (`ncclSum`).
    Sum,
    /// Product (`ncclProd`).
    Prod,
    /// Maximum (`ncclMax`).
    Max,
    /// Minimum (`ncclMin`).
    Min,
    /// Average (`ncclAvg`, NCCL 2.10): the sum divided by the number of ranks. For integer
    /// types the division truncates.
    Avg,
}

impl ReduceOp {
    /// Every built-in operator.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// The raw `ncclRedOp_t`.
    #[inline]
    pub fn raw(self) -> ncclRedOp_t {
        match self {
            ReduceOp::Sum => ncclRedOp_t::ncclSum,
            ReduceOp::Prod => ncclRedOp_t::ncclProd,
            ReduceOp::Max => ncclRedOp_t::ncclMax,
            ReduceOp::Min => ncclRedOp_t::ncclMin,
            ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        }
    }

    /// The first NCCL release that has the operator.
    #[inline]
    pub fn min_version(self) -> Version {
        match self {
            ReduceOp::Avg => Version::new(2, 10, 0),
            _ => Version::new(2, 0, 0),
        }
    }

    /// The name nccl-tests uses (`sum`, `prod`, `max`, `min`, `avg`).
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
        }
    }
}

/// A pre-multiplied sum (`ncclRedOpCreatePreMulSum`, NCCL 2.11): every rank multiplies its
/// input by a scalar, then the products are summed. With the scalar `1/n` it averages.
///
/// It belongs to one communicator and one element type `T`, and is destroyed
/// (`ncclRedOpDestroy`) when dropped.
pub struct PreMulSum<'c, T: NcclType> {
    /// The operator, destroyed (`ncclRedOpDestroy`) on the communicator it was made on.
    lease: Lease<'c, ncclRedOp_t>,
    /// For a device scalar: keeps the scalar borrowed, and records the read on the
    /// communicator's stream when the operator goes away, after every use was enqueued.
    device_scalar: Option<SyncOnDrop<'c>>,
    _type: PhantomData<T>,
}

impl<T: NcclType> std::fmt::Debug for PreMulSum<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreMulSum")
            .field("op", &self.lease.handle().0)
            .field("dtype", &T::DATA_TYPE)
            .field("device_scalar", &self.device_scalar.is_some())
            .finish()
    }
}

impl<'c, T: NcclType> PreMulSum<'c, T> {
    /// An operator whose scalar is read once, now, from the host.
    pub fn with_host_scalar(comm: &'c Comm, scalar: T) -> Result<Self> {
        let mut value = scalar;
        let ptr = (&mut value as *mut T).cast();
        Self::create(
            comm,
            ptr,
            ncclScalarResidence_t::ncclScalarHostImmediate,
            None,
        )
    }

    /// An operator whose scalar is read from device memory (one element) each time a
    /// collective using it runs; the scalar stays borrowed as long as the operator lives.
    ///
    /// Collectives using it must run on the communicator's own stream: that is the stream
    /// the scalar's read is recorded on.
    pub fn with_device_scalar(comm: &'c Comm, scalar: &'c impl DevicePtr<T>) -> Result<Self> {
        if scalar.len() != 1 {
            return Err(Error::invalid(format!(
                "a device scalar is one element, got a buffer of {}",
                scalar.len()
            )));
        }
        comm.check_context(scalar.stream().context(), "the scalar")?;
        let (ptr, guard) = scalar.device_ptr(comm.stream());
        Self::create(
            comm,
            ptr as *mut std::ffi::c_void,
            ncclScalarResidence_t::ncclScalarDevice,
            Some(guard),
        )
    }

    fn create(
        comm: &'c Comm,
        scalar: *mut std::ffi::c_void,
        residence: ncclScalarResidence_t,
        device_scalar: Option<SyncOnDrop<'c>>,
    ) -> Result<Self> {
        let lib = comm.library();
        lib.require_call(&calls::ncclRedOpCreatePreMulSum)?;
        lib.require(T::DATA_TYPE.name(), T::DATA_TYPE.min_version())?;
        let mut raw = ncclRedOp_t::ncclSum;
        let datatype = T::DATA_TYPE.raw();
        // SAFETY: `raw` is a valid out-pointer; `scalar` points to one `T`, on the host
        // (read before the call returns) or on the comm's device (kept borrowed by the
        // returned operator); the handle is live under the comm's lock.
        unsafe {
            comm_call!(comm, |comm_raw| ncclRedOpCreatePreMulSum(
                &mut raw, scalar, datatype, residence, comm_raw
            ))
        }?;
        Ok(Self {
            lease: Lease::new(comm, raw, &calls::ncclRedOpDestroy, |lib, comm_raw, op| {
                // SAFETY: `GiveBack`'s contract: the operator was made on this live
                // communicator, and every call that used it has returned (they borrowed it).
                unsafe { lib.api().ncclRedOpDestroy(op, comm_raw) }
            }),
            device_scalar,
            _type: PhantomData,
        })
    }

    /// The communicator the operator belongs to.
    #[inline]
    pub fn comm(&self) -> &'c Comm {
        self.lease.comm()
    }

    /// The raw operator id.
    #[inline]
    pub fn raw(&self) -> ncclRedOp_t {
        self.lease.handle()
    }

    /// Destroys the operator now, reporting an error instead of ignoring it as `Drop` does.
    /// A communicator that was aborted or destroyed freed its operators with itself: that
    /// is `Ok`, as for [`Window::close`](crate::Window::close).
    pub fn destroy(mut self) -> Result<()> {
        self.lease.give_back(|| Ok(()))
    }
}

impl<T: NcclType> Drop for PreMulSum<'_, T> {
    fn drop(&mut self) {
        // Destroying can only fail for a communicator that is already gone or broken, when
        // nothing is left to free; there is nobody to report to here.
        let _ = self.lease.give_back(|| Ok(()));
    }
}

/// The reduction a collective applies: a built-in [`ReduceOp`] or a [`PreMulSum`].
pub enum Reduction<'a, T: NcclType> {
    /// A built-in operator.
    Builtin(ReduceOp),
    /// A pre-multiplied sum created on the same communicator.
    PreMulSum(&'a PreMulSum<'a, T>),
}

impl<T: NcclType> Clone for Reduction<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: NcclType> Copy for Reduction<'_, T> {}

impl<T: NcclType> std::fmt::Debug for Reduction<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reduction::Builtin(op) => write!(f, "{op:?}"),
            Reduction::PreMulSum(op) => write!(f, "{op:?}"),
        }
    }
}

impl<T: NcclType> From<ReduceOp> for Reduction<'_, T> {
    fn from(op: ReduceOp) -> Self {
        Reduction::Builtin(op)
    }
}

impl<'a, 'c: 'a, T: NcclType> From<&'a PreMulSum<'c, T>> for Reduction<'a, T> {
    fn from(op: &'a PreMulSum<'c, T>) -> Self {
        Reduction::PreMulSum(op)
    }
}

impl<T: NcclType> Reduction<'_, T> {
    /// The raw operator for a call on `comm` and `stream`, after checking it belongs there.
    #[inline(always)]
    pub(crate) fn raw_for(&self, comm: &Comm, stream: &CudaStream) -> Result<ncclRedOp_t> {
        match self {
            Reduction::Builtin(op) => {
                comm.library().require("ncclAvg", op.min_version())?;
                Ok(op.raw())
            }
            Reduction::PreMulSum(op) => Self::premulsum_for(op, comm, stream),
        }
    }

    /// Checks that a user-defined operator may be used on `comm` and `stream`.
    fn premulsum_for(
        op: &PreMulSum<'_, T>,
        comm: &Comm,
        stream: &CudaStream,
    ) -> Result<ncclRedOp_t> {
        if op.comm().shared_ptr() != comm.shared_ptr() {
            return Err(Error::invalid(format!(
                "the PreMulSum operator was created on another communicator (rank {} of {}), \
                 not on this one (rank {} of {})",
                op.comm().rank(),
                op.comm().size(),
                comm.rank(),
                comm.size()
            )));
        }
        if op.device_scalar.is_some() && stream.cu_stream() != comm.stream().cu_stream() {
            return Err(Error::invalid(
                "a PreMulSum with a device scalar can only be used on the communicator's own \
                 stream",
            ));
        }
        Ok(op.raw())
    }

    /// Short name for logs and tables.
    pub fn name(&self) -> &'static str {
        match self {
            Reduction::Builtin(op) => op.name(),
            Reduction::PreMulSum(_) => "premulsum",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_values_follow_the_header() {
        let raws: Vec<_> = ReduceOp::ALL.iter().map(|op| op.raw().0).collect();
        assert_eq!(raws, vec![0, 1, 2, 3, 4]);
        assert_eq!(ReduceOp::Avg.min_version(), Version::new(2, 10, 0));
        assert_eq!(ReduceOp::Prod.name(), "prod");
    }

    #[test]
    fn builtin_converts_into_a_reduction() {
        let r: Reduction<'_, f32> = ReduceOp::Max.into();
        assert!(matches!(r, Reduction::Builtin(ReduceOp::Max)));
        assert_eq!(r.name(), "max");
    }
}
