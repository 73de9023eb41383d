//! Collective operations, and the single path every operation (point-to-point included)
//! takes to NCCL.
//!
//! One room per layer: [`Operation`] and its constructors describe a call
//! (`operation.rs`), `rules.rs` holds NCCL's count and buffer rules, `dispatch.rs` validates
//! and calls NCCL, and the `Comm` methods below are written once, from a table.
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
//! Buffers are any cudarc [`DevicePtr`] (read) or [`DevicePtrMut`] (written): `CudaSlice`,
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

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};

pub(crate) use dispatch::dispatch;
pub(crate) use operation::Kind;
pub use operation::Operation;
pub(crate) use vector::{dispatch_v, verify as verify_counts};
pub use vector::{Construction, Layout, VOperation};

use crate::comm::Comm;
use crate::dtype::NcclType;
use crate::error::Result;
use crate::op::Reduction;
use crate::thread_group;

impl Comm {
    /// Enqueues `call` on the communicator's stream.
    #[inline]
    pub fn enqueue<T: NcclType>(&self, call: Operation<'_, T>) -> Result<()> {
        self.enqueue_on(self.stream(), call)
    }

    /// Enqueues `call` on `stream` (in the communicator's CUDA context) instead of the
    /// communicator's own stream.
    #[inline]
    pub fn enqueue_on<T: NcclType>(
        &self,
        stream: &CudaStream,
        call: Operation<'_, T>,
    ) -> Result<()> {
        self.enqueue_inline_on(stream, call)
    }

    /// [`Comm::enqueue`], always inlined: the `Comm` methods below build their operation
    /// right here, so its kind is a constant and [`dispatch`] folds to that kind's checks.
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

/// Writes, for each constructor of `$call` ([`Operation`] or [`VOperation`]) named, the
/// `Comm` method that hands it to `$enqueue` on the communicator's stream: one table instead
/// of a hand-written copy of every signature.
macro_rules! enqueue_methods {
    ($call:ident => $enqueue:ident; $($name:ident($($arg:ident: $ty:ty),*);)*) => {
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
pub(crate) use enqueue_methods;

enqueue_methods! {
    Operation => enqueue_inline;
    all_reduce(send: &'a impl DevicePtr<T>, recv: &'a mut impl DevicePtrMut<T>, op: impl Into<Reduction<'a, T>>);
    all_reduce_in_place(buf: &'a mut impl DevicePtrMut<T>, op: impl Into<Reduction<'a, T>>);
    broadcast(send: Option<&'a dyn DevicePtr<T>>, recv: &'a mut impl DevicePtrMut<T>, root: usize);
    broadcast_in_place(buf: &'a mut impl DevicePtrMut<T>, root: usize);
    reduce(send: &'a impl DevicePtr<T>, recv: Option<&'a mut dyn DevicePtrMut<T>>, op: impl Into<Reduction<'a, T>>, root: usize);
    reduce_in_place(buf: &'a mut impl DevicePtrMut<T>, op: impl Into<Reduction<'a, T>>, root: usize);
    all_gather(send: &'a impl DevicePtr<T>, recv: &'a mut impl DevicePtrMut<T>);
    all_gather_in_place(buf: &'a mut impl DevicePtrMut<T>);
    reduce_scatter(send: &'a impl DevicePtr<T>, recv: &'a mut impl DevicePtrMut<T>, op: impl Into<Reduction<'a, T>>);
    reduce_scatter_in_place(buf: &'a mut impl DevicePtrMut<T>, op: impl Into<Reduction<'a, T>>);
    all_to_all(send: &'a impl DevicePtr<T>, recv: &'a mut impl DevicePtrMut<T>);
    gather(send: &'a impl DevicePtr<T>, recv: Option<&'a mut dyn DevicePtrMut<T>>, root: usize);
    gather_in_place(buf: &'a mut impl DevicePtrMut<T>, root: usize);
    scatter(send: Option<&'a dyn DevicePtr<T>>, recv: &'a mut impl DevicePtrMut<T>, root: usize);
    scatter_in_place(buf: &'a mut impl DevicePtrMut<T>, root: usize);
}
