//! [`VOperation`]: one v-collective with its buffers and layouts, and the constructors that
//! describe it.

use std::time::Duration;

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::super::constructors;
use super::layout::Layout;
use super::rules::{Args, Construction, VKind};
use crate::comm::Comm;
use crate::dtype::NcclType;
use crate::op::Reduction;

/// How long the checked mode waits for the other ranks' counts unless told otherwise
/// ([`VOperation::checked_within`]).
pub const DEFAULT_CHECK_TIMEOUT: Duration = Duration::from_secs(60);

/// One v-collective (variable counts per rank) with its buffers and layouts, ready to be
/// enqueued with [`Comm::enqueue_v`](crate::Comm::enqueue_v) or
/// [`Group::enqueue_v`](crate::Group::enqueue_v); see the [module docs](super).
///
/// The lifetime `'a` covers the buffers (and a [`PreMulSum`](crate::PreMulSum) operator):
/// they stay borrowed until the operation is enqueued, or until the group that holds it ends.
pub struct VOperation<'a, T: NcclType> {
    pub(crate) kind: VKind,
    pub(crate) op: Option<Reduction<'a, T>>,
    pub(crate) send: Option<&'a dyn DevicePtr<T>>,
    pub(crate) send_layout: Option<Layout>,
    pub(crate) recv: Option<&'a mut dyn DevicePtrMut<T>>,
    pub(crate) recv_layout: Option<Layout>,
    pub(crate) in_place: bool,
    pub(crate) construction: Construction,
    /// `Some(timeout)` in the checked mode.
    pub(crate) check: Option<Duration>,
}

impl<T: NcclType> std::fmt::Debug for VOperation<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VOperation")
            .field("kind", &self.kind)
            .field("op", &self.op)
            .field("dtype", &T::DATA_TYPE)
            .field("send_len", &self.send.as_ref().map(|b| b.len()))
            .field("send_layout", &self.send_layout)
            .field("recv_len", &self.recv.as_ref().map(|b| b.len()))
            .field("recv_layout", &self.recv_layout)
            .field("in_place", &self.in_place)
            .field("construction", &self.construction)
            .field("check", &self.check)
            .finish()
    }
}

impl<'a, T: NcclType> VOperation<'a, T> {
    fn new(
        kind: VKind,
        op: Option<Reduction<'a, T>>,
        (send, send_layout): (Option<&'a dyn DevicePtr<T>>, Option<Layout>),
        (recv, recv_layout): (Option<&'a mut dyn DevicePtrMut<T>>, Option<Layout>),
        in_place: bool,
    ) -> Self {
        Self {
            kind,
            op,
            send,
            send_layout,
            recv,
            recv_layout,
            in_place,
            construction: Construction::Auto,
            check: None,
        }
    }

    /// Builds the operation from these NCCL calls (see [`Construction`]); every rank must
    /// choose the same.
    pub fn construction(mut self, construction: Construction) -> Self {
        self.construction = construction;
        self
    }

    /// The checked mode: before enqueueing, every rank's counts are compared with one extra
    /// exchange (an all-gather of every rank's per-peer counts, on the device, waited for),
    /// and a disagreement is returned on every rank as
    /// [`Error::CountMismatch`](crate::Error::CountMismatch) naming the first mismatching
    /// pair; nothing is enqueued then, on any rank. A rank whose own arguments are invalid
    /// still takes part in the exchange, so the others learn about it instead of waiting.
    ///
    /// Every rank must ask for it (a rank that does not would never join the exchange), and
    /// the wait for the others is bounded by [`DEFAULT_CHECK_TIMEOUT`]; when it runs out, the
    /// communicator is aborted ([`Error::Timeout`](crate::Error::Timeout) says so), since the
    /// exchange stays queued and a late rank would pair with it. It synchronises, so
    /// it cannot run inside a [`Group`](crate::Group), and costs a round trip: use it while
    /// debugging, or where counts come from untrusted input.
    pub fn checked(self) -> Self {
        self.checked_within(DEFAULT_CHECK_TIMEOUT)
    }

    /// The checked mode ([`VOperation::checked`]) waiting at most `timeout` for the other
    /// ranks' counts.
    pub fn checked_within(mut self, timeout: Duration) -> Self {
        self.check = Some(timeout);
        self
    }

    /// This rank's arguments, for the rules.
    pub(crate) fn args(&self, rank: usize, size: usize) -> Args<'_> {
        Args {
            rank,
            size,
            send_len: self.send.as_ref().map(|b| b.len()),
            send_layout: self.send_layout.as_ref(),
            recv_len: self.recv.as_ref().map(|b| b.len()),
            recv_layout: self.recv_layout.as_ref(),
            in_place: self.in_place,
        }
    }
}

// The constructors, one row each, and their `Comm` methods.
constructors! {
    VOperation => enqueue_v, #[inline];

    /// All-to-all with variable counts: segment `j` of `send` (per `send_layout`) goes to
    /// rank `j`, and segment `i` of `recv` (per `recv_layout`) comes from rank `i`.
    ///
    /// Rank `i`'s send count for `j` must equal rank `j`'s receive count for `i`; when each
    /// rank knows only what it sends, [`Comm::exchange_counts`](crate::Comm::exchange_counts)
    /// gives the receive layout. There is no in-place form.
    all_to_all_v(send: &'a impl DevicePtr<T>, send_layout: impl Into<Layout>, recv: &'a mut impl DevicePtrMut<T>, recv_layout: impl Into<Layout>)
        = (VKind::AllToAll, None, (Some(send), Some(send_layout.into())), (Some(recv), Some(recv_layout.into())), false);

    /// All-gather with variable counts: every rank's `send` (rank `i`'s has
    /// `recv_layout.counts()[i]` elements) lands in segment `i` of every rank's `recv`.
    all_gather_v(send: &'a impl DevicePtr<T>, recv: &'a mut impl DevicePtrMut<T>, recv_layout: impl Into<Layout>)
        = (VKind::AllGather, None, (Some(send), None), (Some(recv), Some(recv_layout.into())), false);

    /// All-gather with variable counts, in place: this rank's contribution already sits in
    /// its own segment of `buf`, and the other segments are filled in.
    all_gather_v_in_place(buf: &'a mut impl DevicePtrMut<T>, layout: impl Into<Layout>)
        = (VKind::AllGather, None, (None, None), (Some(buf), Some(layout.into())), true);

    /// Reduce-scatter with variable counts: segment `i` of every rank's `send` (same layout
    /// counts on every rank) is reduced into rank `i`'s `recv`, which has
    /// `send_layout.counts()[i]` elements. Any reduction, [`PreMulSum`](crate::PreMulSum)
    /// included.
    reduce_scatter_v(send: &'a impl DevicePtr<T>, send_layout: impl Into<Layout>, recv: &'a mut impl DevicePtrMut<T>, op: impl Into<Reduction<'a, T>>)
        = (VKind::ReduceScatter, Some(op.into()), (Some(send), Some(send_layout.into())), (Some(recv), None), false);

    /// Reduce-scatter with variable counts, in place: `buf` holds every segment's input, and
    /// this rank's segment receives its result (the other segments keep their inputs).
    reduce_scatter_v_in_place(buf: &'a mut impl DevicePtrMut<T>, layout: impl Into<Layout>, op: impl Into<Reduction<'a, T>>)
        = (VKind::ReduceScatter, Some(op.into()), (None, Some(layout.into())), (Some(buf), None), true);

    /// Gather with variable counts: rank `i`'s whole `send` lands in segment `i` of the
    /// root's `recv`. `recv` and `recv_layout` are required on the root and ignored
    /// elsewhere.
    gather_v(send: &'a impl DevicePtr<T>, recv: Option<&'a mut dyn DevicePtrMut<T>>, recv_layout: Option<Layout>, root: usize)
        = (VKind::Gather { root }, None, (Some(send), None), (recv, recv_layout), false);

    /// Gather with variable counts, in place: on the root `buf` holds every segment (its own
    /// contribution already in its own one) and `layout` is required; elsewhere `buf` is
    /// what the rank sends and `layout` is ignored.
    gather_v_in_place(buf: &'a mut impl DevicePtrMut<T>, layout: Option<Layout>, root: usize)
        = (VKind::Gather { root }, None, (None, None), (Some(buf), layout), true);

    /// Scatter with variable counts: segment `i` of the root's `send` goes to rank `i`'s
    /// whole `recv`. `send` and `send_layout` are required on the root and ignored
    /// elsewhere.
    scatter_v(send: Option<&'a dyn DevicePtr<T>>, send_layout: Option<Layout>, recv: &'a mut impl DevicePtrMut<T>, root: usize)
        = (VKind::Scatter { root }, None, (send, send_layout), (Some(recv), None), false);

    /// Scatter with variable counts, in place: on the root `buf` holds every segment and
    /// keeps its own, and `layout` is required; elsewhere `buf` receives the rank's segment
    /// and `layout` is ignored.
    scatter_v_in_place(buf: &'a mut impl DevicePtrMut<T>, layout: Option<Layout>, root: usize)
        = (VKind::Scatter { root }, None, (None, layout), (Some(buf), None), true);
}
