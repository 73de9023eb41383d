//! Collective operations, and the single path every operation (point-to-point included)
//! takes to NCCL.
//!
//! One room per layer: [`Operation`] and its constructors describe a call
//! (`operation.rs`), `rules.rs` holds NCCL's count and buffer rules, `dispatch.rs` validates
//! and calls NCCL, and each constructor and its `Comm` method are written once, from one
//! table row (`constructors!`).
//!
//! An operation is first described as a [`Operation`]: which kind, which buffers, which
//! root, peer or reduction. [`Comm::enqueue`], [`Comm::enqueue_on`] and
//! [`Group::enqueue`](crate::Group::enqueue) all hand that description to one function that
//! validates it completely (library version, element type, root or peer, buffer lengths
//! against NCCL's count rules, buffers and stream on the communicator's device) and only then
//! calls NCCL. A rejected operation is an [`Error::InvalidArgument`](crate::Error::InvalidArgument) and nothing is enqueued.
//!
//! The convenience methods on [`Comm`] (`all_reduce`, `broadcast`, ...) build the description
//! and enqueue it on the communicator's stream.
//!
//! # Buffers and streams
//!
//! Buffers are any cudarc [`DevicePtr`](cudarc::driver::DevicePtr) (read) or
//! [`DevicePtrMut`](cudarc::driver::DevicePtrMut) (written): `CudaSlice`,
//! `CudaView`, `CudaViewMut`. cudarc's event tracking is honoured: the stream waits for
//! earlier writes (and, for written buffers, reads) of each buffer, and the buffer's events
//! are recorded after NCCL enqueued its work (inside a group, after the group ends).
//!
//! # In place
//!
//! NCCL has no in-place flag: it works in place when the pointers line up. The `*_in_place`
//! constructors take one buffer and compute those pointers: for all-gather the buffer holds
//! `size * count` elements and this rank's contribution sits at `rank * count`; for
//! reduce-scatter the buffer holds the whole input and the result lands at `rank * count`;
//! for gather and scatter the root's buffer holds `size * count` elements and its own part
//! sits at `root * count`, while other ranks pass just their `count` elements. All-to-all has
//! no in-place form in NCCL.

mod dispatch;
mod operation;
mod rules;
pub mod vector;

use cudarc::driver::CudaStream;

pub(crate) use dispatch::dispatch;
pub(crate) use operation::Kind;
pub use operation::Operation;
pub(crate) use vector::{dispatch_v, verify as verify_counts};
pub use vector::{Construction, Layout, VOperation};

use crate::comm::Comm;
use crate::dtype::NcclType;
use crate::error::Result;
use crate::thread_group;

impl Comm {
    /// Enqueues `call` on the communicator's stream.
    #[inline]
    pub fn enqueue<T: NcclType>(&self, call: Operation<'_, T>) -> Result<()> {
        self.enqueue_on(self.stream(), call)
    }

    /// Enqueues `call` on `stream` (in the communicator's CUDA context) instead of the
    /// communicator's own stream.
    ///
    /// The communicator then records an event on `stream` after the operation (one event
    /// per stream, recorded again by each operation there: one `cuEventRecord`), so that
    /// ending it waits for the work there too, or aborts it (see
    /// [End of life](crate::comm#end-of-life)); [`Comm::synchronize_all_timeout`] waits for
    /// it. Not while `stream` is being captured into a CUDA graph: that work runs where the
    /// graph is launched.
    #[inline]
    pub fn enqueue_on<T: NcclType>(
        &self,
        stream: &CudaStream,
        call: Operation<'_, T>,
    ) -> Result<()> {
        self.enqueue_inline_on(stream, call)
    }

    /// [`Comm::enqueue`], always inlined: the `Comm` methods written by `constructors!`
    /// build their operation right here, so its kind is a constant and [`dispatch`] folds
    /// to that kind's checks.
    #[inline(always)]
    fn enqueue_inline<T: NcclType>(&self, call: Operation<'_, T>) -> Result<()> {
        self.enqueue_inline_on(self.stream(), call)
    }

    #[inline(always)]
    fn enqueue_inline_on<T: NcclType>(
        &self,
        stream: &CudaStream,
        call: Operation<'_, T>,
    ) -> Result<()> {
        thread_group::ensure_outside(call.kind.name())?;
        dispatch(self, stream, call, false, drop)
    }
}

/// Writes, from one row per constructor of `$call` ([`Operation`] or [`VOperation`]), the
/// constructor (`Self::new` with the row's arguments) and the `Comm` method that hands what
/// it builds to `$enqueue` on the communicator's stream: each signature written once.
macro_rules! constructors {
    (
        $call:ident => $enqueue:ident, #[$inline:meta];
        $(
            $(#[$doc:meta])*
            $name:ident($($arg:ident: $ty:ty),*) = ($($new:expr),* $(,)?);
        )*
    ) => {
        impl<'a, T: NcclType> $call<'a, T> {
            $(
                $(#[$doc])*
                #[$inline]
                pub fn $name($($arg: $ty),*) -> Self {
                    Self::new($($new),*)
                }
            )*
        }

        impl Comm {
            $(
                #[doc = concat!(
                    "Enqueues [`", stringify!($call), "::", stringify!($name),
                    "`] on the communicator's stream."
                )]
                #[allow(clippy::extra_unused_lifetimes)]
                #[inline]
                pub fn $name<'a, T: NcclType>(&self, $($arg: $ty),*) -> $crate::error::Result<()> {
                    self.$enqueue($call::$name($($arg),*))
                }
            )*
        }
    };
}
pub(crate) use constructors;
