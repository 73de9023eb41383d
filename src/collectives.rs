//! Collective operations, and the single path every operation (point-to-point included)
//! takes to NCCL.
//!
//! An operation is first described as a [`Collective`]: which kind, which buffers, which
//! root, peer or reduction. [`Comm::enqueue`], [`Comm::enqueue_on`] and
//! [`Group::enqueue`](crate::Group::enqueue) all hand that description to one function that
//! validates it completely (library version, element type, root or peer, buffer lengths
//! against NCCL's count rules, buffers and stream on the communicator's device) and only then
//! calls NCCL. A rejected operation is an [`Error::InvalidArgument`] and nothing is enqueued.
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

use std::ffi::c_void;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

use crate::comm::Comm;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::group;
use crate::library::Version;
use crate::op::Reduction;

/// What an operation does, independent of its buffers.
pub(crate) enum Kind<'a, T: NcclType> {
    AllReduce(Reduction<'a, T>),
    Broadcast { root: usize },
    Reduce { op: Reduction<'a, T>, root: usize },
    AllGather,
    ReduceScatter(Reduction<'a, T>),
    AllToAll,
    Gather { root: usize },
    Scatter { root: usize },
    Send { peer: usize },
    Recv { peer: usize },
}

impl<T: NcclType> std::fmt::Debug for Kind<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Kind::AllReduce(op) | Kind::ReduceScatter(op) | Kind::Reduce { op, .. } => {
                write!(f, "{:?}({op:?})", self.shape())
            }
            _ => write!(f, "{:?}", self.shape()),
        }
    }
}

impl<T: NcclType> Kind<'_, T> {
    fn shape(&self) -> Shape {
        match *self {
            Kind::AllReduce(_) => Shape::AllReduce,
            Kind::Broadcast { root } => Shape::Broadcast { root },
            Kind::Reduce { root, .. } => Shape::Reduce { root },
            Kind::AllGather => Shape::AllGather,
            Kind::ReduceScatter(_) => Shape::ReduceScatter,
            Kind::AllToAll => Shape::AllToAll,
            Kind::Gather { root } => Shape::Gather { root },
            Kind::Scatter { root } => Shape::Scatter { root },
            Kind::Send { peer } => Shape::Send { peer },
            Kind::Recv { peer } => Shape::Recv { peer },
        }
    }
}

/// One NCCL operation with its buffers, ready to be enqueued; see the [module docs](self).
///
/// The lifetime `'a` covers the buffers (and a [`PreMulSum`](crate::PreMulSum) operator):
/// they stay borrowed until the operation is enqueued, or until the group that holds it ends.
pub struct Collective<'a, T: NcclType> {
    pub(crate) kind: Kind<'a, T>,
    send: Option<&'a dyn DevicePtr<T>>,
    recv: Option<&'a mut dyn DevicePtrMut<T>>,
    in_place: bool,
}

impl<T: NcclType> std::fmt::Debug for Collective<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collective")
            .field("kind", &self.kind)
            .field("dtype", &T::DATA_TYPE)
            .field("send_len", &self.send.as_ref().map(|b| b.len()))
            .field("recv_len", &self.recv.as_ref().map(|b| b.len()))
            .field("in_place", &self.in_place)
            .finish()
    }
}

impl<'a, T: NcclType> Collective<'a, T> {
    fn new(
        kind: Kind<'a, T>,
        send: Option<&'a dyn DevicePtr<T>>,
        recv: Option<&'a mut dyn DevicePtrMut<T>>,
        in_place: bool,
    ) -> Self {
        Self {
            kind,
            send,
            recv,
            in_place,
        }
    }

    /// All-reduce: every rank ends with the reduction of all ranks' `send` in `recv`
    /// (same length on every rank).
    pub fn all_reduce(
        send: &'a impl DevicePtr<T>,
        recv: &'a mut impl DevicePtrMut<T>,
        op: impl Into<Reduction<'a, T>>,
    ) -> Self {
        Self::new(Kind::AllReduce(op.into()), Some(send), Some(recv), false)
    }

    /// All-reduce in place: `buf` is input and output.
    pub fn all_reduce_in_place(
        buf: &'a mut impl DevicePtrMut<T>,
        op: impl Into<Reduction<'a, T>>,
    ) -> Self {
        Self::new(Kind::AllReduce(op.into()), None, Some(buf), true)
    }

    /// Broadcast: `recv` on every rank receives the root's `send`. `send` is required on the
    /// root (same length as `recv`) and ignored elsewhere.
    pub fn broadcast(
        send: Option<&'a dyn DevicePtr<T>>,
        recv: &'a mut impl DevicePtrMut<T>,
        root: usize,
    ) -> Self {
        Self::new(Kind::Broadcast { root }, send, Some(recv), false)
    }

    /// Broadcast in place: the root's `buf` is copied into `buf` on every other rank.
    pub fn broadcast_in_place(buf: &'a mut impl DevicePtrMut<T>, root: usize) -> Self {
        Self::new(Kind::Broadcast { root }, None, Some(buf), true)
    }

    /// Reduce: the root's `recv` receives the reduction of every rank's `send`. `recv` is
    /// required on the root (same length as `send`) and ignored elsewhere.
    pub fn reduce(
        send: &'a impl DevicePtr<T>,
        recv: Option<&'a mut dyn DevicePtrMut<T>>,
        op: impl Into<Reduction<'a, T>>,
        root: usize,
    ) -> Self {
        Self::new(
            Kind::Reduce {
                op: op.into(),
                root,
            },
            Some(send),
            recv,
            false,
        )
    }

    /// Reduce in place: `buf` is every rank's input and, on the root, the output.
    pub fn reduce_in_place(
        buf: &'a mut impl DevicePtrMut<T>,
        op: impl Into<Reduction<'a, T>>,
        root: usize,
    ) -> Self {
        Self::new(
            Kind::Reduce {
                op: op.into(),
                root,
            },
            None,
            Some(buf),
            true,
        )
    }

    /// All-gather: `recv` (`size * send.len()` elements) receives rank `i`'s `send` at
    /// offset `i * send.len()`.
    pub fn all_gather(send: &'a impl DevicePtr<T>, recv: &'a mut impl DevicePtrMut<T>) -> Self {
        Self::new(Kind::AllGather, Some(send), Some(recv), false)
    }

    /// All-gather in place: `buf` holds `size * count` elements and this rank's contribution
    /// at `rank * count`.
    pub fn all_gather_in_place(buf: &'a mut impl DevicePtrMut<T>) -> Self {
        Self::new(Kind::AllGather, None, Some(buf), true)
    }

    /// Reduce-scatter: `send` holds `size * recv.len()` elements; rank `i`'s `recv` receives
    /// block `i` of the reduction.
    pub fn reduce_scatter(
        send: &'a impl DevicePtr<T>,
        recv: &'a mut impl DevicePtrMut<T>,
        op: impl Into<Reduction<'a, T>>,
    ) -> Self {
        Self::new(
            Kind::ReduceScatter(op.into()),
            Some(send),
            Some(recv),
            false,
        )
    }

    /// Reduce-scatter in place: `buf` holds the `size * count` inputs; this rank's block of
    /// the result is written at `rank * count`.
    pub fn reduce_scatter_in_place(
        buf: &'a mut impl DevicePtrMut<T>,
        op: impl Into<Reduction<'a, T>>,
    ) -> Self {
        Self::new(Kind::ReduceScatter(op.into()), None, Some(buf), true)
    }

    /// All-to-all (NCCL 2.28): `send` and `recv` hold `size * count` elements; block `j` of
    /// `send` goes to rank `j`, and block `i` of `recv` comes from rank `i`.
    pub fn all_to_all(send: &'a impl DevicePtr<T>, recv: &'a mut impl DevicePtrMut<T>) -> Self {
        Self::new(Kind::AllToAll, Some(send), Some(recv), false)
    }

    /// Gather (NCCL 2.28): the root's `recv` (`size * send.len()` elements) receives rank
    /// `i`'s `send` at `i * send.len()`. `recv` is required on the root, ignored elsewhere.
    pub fn gather(
        send: &'a impl DevicePtr<T>,
        recv: Option<&'a mut dyn DevicePtrMut<T>>,
        root: usize,
    ) -> Self {
        Self::new(Kind::Gather { root }, Some(send), recv, false)
    }

    /// Gather in place: on the root `buf` holds `size * count` elements with the root's own
    /// part at `root * count`; on other ranks `buf` is the `count` elements they send.
    pub fn gather_in_place(buf: &'a mut impl DevicePtrMut<T>, root: usize) -> Self {
        Self::new(Kind::Gather { root }, None, Some(buf), true)
    }

    /// Scatter (NCCL 2.28): block `i` of the root's `send` (`size * recv.len()` elements)
    /// goes to rank `i`'s `recv`. `send` is required on the root, ignored elsewhere.
    pub fn scatter(
        send: Option<&'a dyn DevicePtr<T>>,
        recv: &'a mut impl DevicePtrMut<T>,
        root: usize,
    ) -> Self {
        Self::new(Kind::Scatter { root }, send, Some(recv), false)
    }

    /// Scatter in place: on the root `buf` holds all `size * count` elements and keeps its
    /// own block at `root * count`; on other ranks `buf` receives `count` elements.
    pub fn scatter_in_place(buf: &'a mut impl DevicePtrMut<T>, root: usize) -> Self {
        Self::new(Kind::Scatter { root }, None, Some(buf), true)
    }

    /// Point-to-point send of `buf` to rank `peer`, which must post a matching receive of
    /// the same length and type (NCCL 2.7). See [`crate::p2p`].
    pub fn send(buf: &'a impl DevicePtr<T>, peer: usize) -> Self {
        Self::new(Kind::Send { peer }, Some(buf), None, false)
    }

    /// Point-to-point receive into `buf` from rank `peer` (NCCL 2.7). See [`crate::p2p`].
    pub fn recv(buf: &'a mut impl DevicePtrMut<T>, peer: usize) -> Self {
        Self::new(Kind::Recv { peer }, None, Some(buf), false)
    }
}

/// The kind of an operation without its reduction, for the length rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    AllReduce,
    Broadcast { root: usize },
    Reduce { root: usize },
    AllGather,
    ReduceScatter,
    AllToAll,
    Gather { root: usize },
    Scatter { root: usize },
    Send { peer: usize },
    Recv { peer: usize },
}

impl Shape {
    fn name(self) -> &'static str {
        match self {
            Shape::AllReduce => "ncclAllReduce",
            Shape::Broadcast { .. } => "ncclBroadcast",
            Shape::Reduce { .. } => "ncclReduce",
            Shape::AllGather => "ncclAllGather",
            Shape::ReduceScatter => "ncclReduceScatter",
            Shape::AllToAll => "ncclAlltoAll",
            Shape::Gather { .. } => "ncclGather",
            Shape::Scatter { .. } => "ncclScatter",
            Shape::Send { .. } => "ncclSend",
            Shape::Recv { .. } => "ncclRecv",
        }
    }

    fn min_version(self) -> Version {
        match self {
            Shape::AllToAll | Shape::Gather { .. } | Shape::Scatter { .. } => {
                Version::new(2, 28, 0)
            }
            Shape::Send { .. } | Shape::Recv { .. } => Version::new(2, 7, 0),
            Shape::Broadcast { .. } => Version::new(2, 2, 0),
            _ => Version::new(2, 0, 0),
        }
    }
}

/// Where a pointer handed to NCCL comes from: nothing, or a buffer plus an element offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ptr {
    Null,
    Send(usize),
    Recv(usize),
}

/// The validated arguments of one NCCL call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) count: usize,
    pub(crate) send: Ptr,
    pub(crate) recv: Ptr,
}

/// Which count rule an operation breaks. Kept small and free of text so that checking stays
/// a few comparisons on every call; [`Broken::to_error`] writes the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broken {
    /// A buffer the operation needs is missing.
    Missing(&'static str),
    /// A root or peer is not a rank of the communicator.
    OutOfRange { what: &'static str, value: usize },
    /// Two buffer lengths do not fit together.
    Mismatch {
        rule: LengthRule,
        send: usize,
        recv: usize,
    },
    /// A buffer that is split among the ranks does not split evenly.
    NotMultiple { what: &'static str, len: usize },
    /// All-to-all was asked for in place.
    InPlaceAllToAll,
    /// A send or receive to this rank itself outside a group: it waits for its own
    /// counterpart, which can only come in the same group.
    SelfOutsideGroup,
}

/// How the send and receive lengths of an operation must relate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LengthRule {
    /// Equal lengths.
    Equal,
    /// Equal lengths, on the root of a broadcast.
    RootSendsWhatItReceives,
    /// Equal lengths, on the root of a reduce.
    RootReceivesWhatItSends,
    /// The receive buffer holds `size` send buffers (all-gather).
    RecvHoldsAll,
    /// The send buffer holds `size` receive buffers (reduce-scatter).
    SendHoldsAll,
    /// The root's receive buffer holds `size` send buffers (gather).
    RootRecvHoldsAll,
    /// The root's send buffer holds `size` receive buffers (scatter).
    RootSendHoldsAll,
}

impl Broken {
    #[cold]
    #[inline(never)]
    fn to_error(self, shape: Shape, rank: usize, size: usize) -> Error {
        let name = shape.name();
        let message = match self {
            Broken::Missing(what) => format!("{name} on rank {rank} needs a {what} buffer"),
            Broken::OutOfRange { what, value } => {
                format!("{name}: {what} {value} is out of range for a communicator of {size} ranks")
            }
            Broken::Mismatch {
                rule,
                send: s,
                recv: r,
            } => {
                let detail = match rule {
                    LengthRule::Equal => format!("send has {s} elements but receive has {r}"),
                    LengthRule::RootSendsWhatItReceives => {
                        format!("the root sends {s} elements but receives {r}")
                    }
                    LengthRule::RootReceivesWhatItSends => {
                        format!("send has {s} elements but the root receives {r}")
                    }
                    LengthRule::RecvHoldsAll => {
                        format!("the receive buffer must hold {size} x {s} elements, it has {r}")
                    }
                    LengthRule::SendHoldsAll => {
                        format!("the send buffer must hold {size} x {r} elements, it has {s}")
                    }
                    LengthRule::RootRecvHoldsAll => format!(
                        "the root's receive buffer must hold {size} x {s} elements, it has {r}"
                    ),
                    LengthRule::RootSendHoldsAll => format!(
                        "the root's send buffer must hold {size} x {r} elements, it has {s}"
                    ),
                };
                format!("{name} on rank {rank}: {detail}")
            }
            Broken::NotMultiple { what, len } => format!(
                "{name} on rank {rank}: the {what} buffer has {len} elements, not a multiple \
                 of the {size} ranks"
            ),
            Broken::InPlaceAllToAll => "NCCL has no in-place all-to-all".to_string(),
            Broken::SelfOutsideGroup => format!(
                "{name} on rank {rank} to its own rank can never complete outside a group: \
                 issue the send and the matching receive in one Group"
            ),
        };
        Error::invalid(message)
    }
}

/// A point-to-point call to one's own rank completes only when its counterpart is in the
/// same group; alone it would wait forever (NCCL then reports an error that looks fatal).
#[inline]
fn check_self_p2p(shape: Shape, rank: usize, in_group: bool) -> std::result::Result<(), Broken> {
    match shape {
        Shape::Send { peer } | Shape::Recv { peer } if peer == rank && !in_group => {
            Err(Broken::SelfOutsideGroup)
        }
        _ => Ok(()),
    }
}

/// Applies NCCL's count and buffer rules to one rank's view of an operation.
///
/// `send_len`/`recv_len` are the lengths of the buffers given (in place, only `recv_len`:
/// the single buffer). Everything NCCL would read or write must lie inside them. A broken
/// rule comes back as a [`Broken`], which becomes an error message only when it happens.
#[inline]
fn check_plan(
    shape: Shape,
    rank: usize,
    size: usize,
    send_len: Option<usize>,
    recv_len: Option<usize>,
    in_place: bool,
) -> std::result::Result<Plan, Broken> {
    let need = |len: Option<usize>, what: &'static str| len.ok_or(Broken::Missing(what));
    let check_rank = |value: usize, what: &'static str| {
        if value < size {
            Ok(())
        } else {
            Err(Broken::OutOfRange { what, value })
        }
    };
    let same = |rule, send: usize, recv: usize| {
        if send == recv {
            Ok(())
        } else {
            Err(Broken::Mismatch { rule, send, recv })
        }
    };
    // `whole` must be exactly `size` times `part`.
    let holds_all = |rule, whole: usize, part: usize, send: usize, recv: usize| {
        if part.checked_mul(size) == Some(whole) {
            Ok(())
        } else {
            Err(Broken::Mismatch { rule, send, recv })
        }
    };
    let divisible = |len: usize, what: &'static str| {
        if len % size == 0 {
            Ok(len / size)
        } else {
            Err(Broken::NotMultiple { what, len })
        }
    };
    let plan = |count, send, recv| Ok(Plan { count, send, recv });

    match (shape, in_place) {
        (Shape::AllReduce, false) => {
            let (s, r) = (need(send_len, "send")?, need(recv_len, "receive")?);
            same(LengthRule::Equal, s, r)?;
            plan(r, Ptr::Send(0), Ptr::Recv(0))
        }
        (Shape::AllReduce, true) => plan(need(recv_len, "in-place")?, Ptr::Recv(0), Ptr::Recv(0)),
        (Shape::Broadcast { root }, false) => {
            check_rank(root, "root")?;
            let r = need(recv_len, "receive")?;
            if rank != root {
                // NCCL ignores the send buffer off the root; pass the receive buffer.
                return plan(r, Ptr::Recv(0), Ptr::Recv(0));
            }
            let s = need(send_len, "send (root)")?;
            same(LengthRule::RootSendsWhatItReceives, s, r)?;
            plan(r, Ptr::Send(0), Ptr::Recv(0))
        }
        (Shape::Broadcast { root }, true) => {
            check_rank(root, "root")?;
            plan(need(recv_len, "in-place")?, Ptr::Recv(0), Ptr::Recv(0))
        }
        (Shape::Reduce { root }, false) => {
            check_rank(root, "root")?;
            let s = need(send_len, "send")?;
            if rank != root {
                return plan(s, Ptr::Send(0), Ptr::Null);
            }
            let r = need(recv_len, "receive (root)")?;
            same(LengthRule::RootReceivesWhatItSends, s, r)?;
            plan(s, Ptr::Send(0), Ptr::Recv(0))
        }
        (Shape::Reduce { root }, true) => {
            check_rank(root, "root")?;
            plan(need(recv_len, "in-place")?, Ptr::Recv(0), Ptr::Recv(0))
        }
        (Shape::AllGather, false) => {
            let (s, r) = (need(send_len, "send")?, need(recv_len, "receive")?);
            holds_all(LengthRule::RecvHoldsAll, r, s, s, r)?;
            plan(s, Ptr::Send(0), Ptr::Recv(0))
        }
        (Shape::AllGather, true) => {
            let count = divisible(need(recv_len, "in-place")?, "in-place")?;
            plan(count, Ptr::Recv(rank * count), Ptr::Recv(0))
        }
        (Shape::ReduceScatter, false) => {
            let (s, r) = (need(send_len, "send")?, need(recv_len, "receive")?);
            holds_all(LengthRule::SendHoldsAll, s, r, s, r)?;
            plan(r, Ptr::Send(0), Ptr::Recv(0))
        }
        (Shape::ReduceScatter, true) => {
            let count = divisible(need(recv_len, "in-place")?, "in-place")?;
            plan(count, Ptr::Recv(0), Ptr::Recv(rank * count))
        }
        (Shape::AllToAll, false) => {
            let (s, r) = (need(send_len, "send")?, need(recv_len, "receive")?);
            same(LengthRule::Equal, s, r)?;
            let count = divisible(s, "send")?;
            plan(count, Ptr::Send(0), Ptr::Recv(0))
        }
        (Shape::AllToAll, true) => Err(Broken::InPlaceAllToAll),
        (Shape::Gather { root }, false) => {
            check_rank(root, "root")?;
            let s = need(send_len, "send")?;
            if rank != root {
                return plan(s, Ptr::Send(0), Ptr::Null);
            }
            let r = need(recv_len, "receive (root)")?;
            holds_all(LengthRule::RootRecvHoldsAll, r, s, s, r)?;
            plan(s, Ptr::Send(0), Ptr::Recv(0))
        }
        (Shape::Gather { root }, true) => {
            check_rank(root, "root")?;
            let len = need(recv_len, "in-place")?;
            if rank != root {
                return plan(len, Ptr::Recv(0), Ptr::Null);
            }
            let count = divisible(len, "root's in-place")?;
            plan(count, Ptr::Recv(root * count), Ptr::Recv(0))
        }
        (Shape::Scatter { root }, false) => {
            check_rank(root, "root")?;
            let r = need(recv_len, "receive")?;
            if rank != root {
                return plan(r, Ptr::Null, Ptr::Recv(0));
            }
            let s = need(send_len, "send (root)")?;
            holds_all(LengthRule::RootSendHoldsAll, s, r, s, r)?;
            plan(r, Ptr::Send(0), Ptr::Recv(0))
        }
        (Shape::Scatter { root }, true) => {
            check_rank(root, "root")?;
            let len = need(recv_len, "in-place")?;
            if rank != root {
                return plan(len, Ptr::Null, Ptr::Recv(0));
            }
            let count = divisible(len, "root's in-place")?;
            plan(count, Ptr::Recv(0), Ptr::Recv(root * count))
        }
        (Shape::Send { peer }, _) => {
            check_rank(peer, "peer")?;
            plan(need(send_len, "send")?, Ptr::Send(0), Ptr::Null)
        }
        (Shape::Recv { peer }, _) => {
            check_rank(peer, "peer")?;
            plan(need(recv_len, "receive")?, Ptr::Null, Ptr::Recv(0))
        }
    }
}

/// The cudarc guards of the buffers of one enqueued operation. Dropping them records the
/// buffers' events on the stream, so they must outlive the enqueue (and the group end).
pub(crate) type Guards<'b> = [Option<SyncOnDrop<'b>>; 2];

/// Validates `call` completely and enqueues it on `stream`, then hands the buffers' guards
/// to `keep` (which drops them, or holds them until the group ends). Inside a group, an
/// in-progress result is left for the group's end to complete.
///
/// The guards go to a closure rather than out as a return value so that the common path
/// (no group: drop them at once) does not move them around.
#[inline]
pub(crate) fn launch<'b, 'a: 'b, T: NcclType>(
    comm: &'b Comm,
    stream: &'b CudaStream,
    call: Collective<'a, T>,
    in_group: bool,
    keep: impl FnOnce(Guards<'b>),
) -> Result<()> {
    let lib = comm.library();
    let shape = call.kind.shape();
    let name = shape.name();
    lib.require(name, shape.min_version())?;
    let dtype = T::DATA_TYPE;
    lib.require(dtype.name(), dtype.min_version())?;
    comm.check_stream(stream, "the stream")?;

    let (rank, size) = (comm.rank(), comm.size());
    let plan = check_plan(
        shape,
        rank,
        size,
        call.send.as_ref().map(|b| b.len()),
        call.recv.as_ref().map(|b| b.len()),
        call.in_place,
    )
    .and_then(|plan| check_self_p2p(shape, rank, in_group).map(|()| plan))
    .map_err(|broken| broken.to_error(shape, rank, size))?;
    let uses = |ptr: Ptr, send: bool| match ptr {
        Ptr::Send(_) => send,
        Ptr::Recv(_) => !send,
        Ptr::Null => false,
    };
    let send_used = uses(plan.send, true) || uses(plan.recv, true);
    let recv_used = uses(plan.send, false) || uses(plan.recv, false);
    if send_used {
        if let Some(buf) = &call.send {
            comm.check_context(buf.stream().context(), "the send buffer")?;
        }
    }
    if recv_used {
        if let Some(buf) = &call.recv {
            comm.check_context(buf.stream().context(), "the receive buffer")?;
        }
    }
    let op = match &call.kind {
        Kind::AllReduce(op) | Kind::Reduce { op, .. } | Kind::ReduceScatter(op) => {
            Some(op.raw_for(comm, stream)?)
        }
        _ => None,
    };

    // Validation is over: take the device pointers (this orders the stream after earlier
    // work on the buffers) and call NCCL.
    let (send_base, send_guard) = match (send_used, call.send) {
        (true, Some(buf)) => {
            let (ptr, guard) = buf.device_ptr(stream);
            (ptr, Some(guard))
        }
        _ => (0, None),
    };
    let (recv_base, recv_guard) = match (recv_used, call.recv) {
        (true, Some(buf)) => {
            let (ptr, guard) = buf.device_ptr_mut(stream);
            (ptr, Some(guard))
        }
        _ => (0, None),
    };
    let elem = std::mem::size_of::<T>() as u64;
    let address = |ptr: Ptr| -> *mut c_void {
        match ptr {
            Ptr::Null => std::ptr::null_mut(),
            Ptr::Send(offset) => (send_base + offset as u64 * elem) as *mut c_void,
            Ptr::Recv(offset) => (recv_base + offset as u64 * elem) as *mut c_void,
        }
    };
    let (send, recv) = (address(plan.send) as *const c_void, address(plan.recv));
    let count = plan.count;
    let datatype = dtype.raw();
    let cu_stream = stream.cu_stream() as nccl_sys::cudaStream_t;
    let api = lib.api();
    // Roots and peers were checked against the communicator size, which fits a C int.
    let int = |value: usize| value as std::os::raw::c_int;

    let status = comm.with_raw(name, |raw| {
        // SAFETY: every pointer lies inside a buffer on the communicator's device whose
        // length was checked against `count` and the rank/root offsets above; the buffers
        // stay borrowed (and alive) at least until the work is enqueued, and their events are
        // recorded afterwards by the guards; the handle is live under the comm's lock.
        unsafe {
            match &call.kind {
                Kind::AllReduce(_) => api.ncclAllReduce(
                    send,
                    recv,
                    count,
                    datatype,
                    op.unwrap_or(nccl_sys::ncclRedOp_t::ncclSum),
                    raw,
                    cu_stream,
                ),
                Kind::Broadcast { root } => {
                    api.ncclBroadcast(send, recv, count, datatype, int(*root), raw, cu_stream)
                }
                Kind::Reduce { root, .. } => api.ncclReduce(
                    send,
                    recv,
                    count,
                    datatype,
                    op.unwrap_or(nccl_sys::ncclRedOp_t::ncclSum),
                    int(*root),
                    raw,
                    cu_stream,
                ),
                Kind::AllGather => api.ncclAllGather(send, recv, count, datatype, raw, cu_stream),
                Kind::ReduceScatter(_) => api.ncclReduceScatter(
                    send,
                    recv,
                    count,
                    datatype,
                    op.unwrap_or(nccl_sys::ncclRedOp_t::ncclSum),
                    raw,
                    cu_stream,
                ),
                Kind::AllToAll => api.ncclAlltoAll(send, recv, count, datatype, raw, cu_stream),
                Kind::Gather { root } => {
                    api.ncclGather(send, recv, count, datatype, int(*root), raw, cu_stream)
                }
                Kind::Scatter { root } => {
                    api.ncclScatter(send, recv, count, datatype, int(*root), raw, cu_stream)
                }
                Kind::Send { peer } => {
                    api.ncclSend(send, count, datatype, int(*peer), raw, cu_stream)
                }
                Kind::Recv { peer } => {
                    api.ncclRecv(recv, count, datatype, int(*peer), raw, cu_stream)
                }
            }
        }
    })?;
    if in_group {
        lib.check_pending(name, status)?;
    } else {
        comm.complete(name, status)?;
    }
    keep([send_guard, recv_guard]);
    Ok(())
}

impl Comm {
    /// Enqueues `call` on the communicator's stream.
    pub fn enqueue<T: NcclType>(&self, call: Collective<'_, T>) -> Result<()> {
        self.enqueue_on(self.stream(), call)
    }

    /// Enqueues `call` on `stream` (on the communicator's device) instead of the
    /// communicator's own stream.
    pub fn enqueue_on<T: NcclType>(
        &self,
        stream: &CudaStream,
        call: Collective<'_, T>,
    ) -> Result<()> {
        group::ensure_outside(call.kind.shape().name())?;
        launch(self, stream, call, false, drop)
    }

    /// All-reduce; see [`Collective::all_reduce`].
    pub fn all_reduce<'a, T: NcclType>(
        &self,
        send: &'a impl DevicePtr<T>,
        recv: &'a mut impl DevicePtrMut<T>,
        op: impl Into<Reduction<'a, T>>,
    ) -> Result<()> {
        self.enqueue(Collective::all_reduce(send, recv, op))
    }

    /// In-place all-reduce; see [`Collective::all_reduce_in_place`].
    pub fn all_reduce_in_place<'a, T: NcclType>(
        &self,
        buf: &'a mut impl DevicePtrMut<T>,
        op: impl Into<Reduction<'a, T>>,
    ) -> Result<()> {
        self.enqueue(Collective::all_reduce_in_place(buf, op))
    }

    /// Broadcast; see [`Collective::broadcast`].
    pub fn broadcast<'a, T: NcclType>(
        &self,
        send: Option<&'a dyn DevicePtr<T>>,
        recv: &'a mut impl DevicePtrMut<T>,
        root: usize,
    ) -> Result<()> {
        self.enqueue(Collective::broadcast(send, recv, root))
    }

    /// In-place broadcast; see [`Collective::broadcast_in_place`].
    pub fn broadcast_in_place<T: NcclType>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        root: usize,
    ) -> Result<()> {
        self.enqueue(Collective::broadcast_in_place(buf, root))
    }

    /// Reduce; see [`Collective::reduce`].
    pub fn reduce<'a, T: NcclType>(
        &self,
        send: &'a impl DevicePtr<T>,
        recv: Option<&'a mut dyn DevicePtrMut<T>>,
        op: impl Into<Reduction<'a, T>>,
        root: usize,
    ) -> Result<()> {
        self.enqueue(Collective::reduce(send, recv, op, root))
    }

    /// In-place reduce; see [`Collective::reduce_in_place`].
    pub fn reduce_in_place<'a, T: NcclType>(
        &self,
        buf: &'a mut impl DevicePtrMut<T>,
        op: impl Into<Reduction<'a, T>>,
        root: usize,
    ) -> Result<()> {
        self.enqueue(Collective::reduce_in_place(buf, op, root))
    }

    /// All-gather; see [`Collective::all_gather`].
    pub fn all_gather<T: NcclType>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.enqueue(Collective::all_gather(send, recv))
    }

    /// In-place all-gather; see [`Collective::all_gather_in_place`].
    pub fn all_gather_in_place<T: NcclType>(&self, buf: &mut impl DevicePtrMut<T>) -> Result<()> {
        self.enqueue(Collective::all_gather_in_place(buf))
    }

    /// Reduce-scatter; see [`Collective::reduce_scatter`].
    pub fn reduce_scatter<'a, T: NcclType>(
        &self,
        send: &'a impl DevicePtr<T>,
        recv: &'a mut impl DevicePtrMut<T>,
        op: impl Into<Reduction<'a, T>>,
    ) -> Result<()> {
        self.enqueue(Collective::reduce_scatter(send, recv, op))
    }

    /// In-place reduce-scatter; see [`Collective::reduce_scatter_in_place`].
    pub fn reduce_scatter_in_place<'a, T: NcclType>(
        &self,
        buf: &'a mut impl DevicePtrMut<T>,
        op: impl Into<Reduction<'a, T>>,
    ) -> Result<()> {
        self.enqueue(Collective::reduce_scatter_in_place(buf, op))
    }

    /// All-to-all (NCCL 2.28); see [`Collective::all_to_all`].
    pub fn all_to_all<T: NcclType>(
        &self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.enqueue(Collective::all_to_all(send, recv))
    }

    /// Gather (NCCL 2.28); see [`Collective::gather`].
    pub fn gather<'a, T: NcclType>(
        &self,
        send: &'a impl DevicePtr<T>,
        recv: Option<&'a mut dyn DevicePtrMut<T>>,
        root: usize,
    ) -> Result<()> {
        self.enqueue(Collective::gather(send, recv, root))
    }

    /// In-place gather (NCCL 2.28); see [`Collective::gather_in_place`].
    pub fn gather_in_place<T: NcclType>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        root: usize,
    ) -> Result<()> {
        self.enqueue(Collective::gather_in_place(buf, root))
    }

    /// Scatter (NCCL 2.28); see [`Collective::scatter`].
    pub fn scatter<'a, T: NcclType>(
        &self,
        send: Option<&'a dyn DevicePtr<T>>,
        recv: &'a mut impl DevicePtrMut<T>,
        root: usize,
    ) -> Result<()> {
        self.enqueue(Collective::scatter(send, recv, root))
    }

    /// In-place scatter (NCCL 2.28); see [`Collective::scatter_in_place`].
    pub fn scatter_in_place<T: NcclType>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
        root: usize,
    ) -> Result<()> {
        self.enqueue(Collective::scatter_in_place(buf, root))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(
        shape: Shape,
        rank: usize,
        size: usize,
        s: Option<usize>,
        r: Option<usize>,
        ip: bool,
    ) -> Plan {
        check_plan(shape, rank, size, s, r, ip).unwrap()
    }

    fn err(
        shape: Shape,
        rank: usize,
        size: usize,
        s: Option<usize>,
        r: Option<usize>,
        ip: bool,
    ) -> String {
        match check_plan(shape, rank, size, s, r, ip).map_err(|b| b.to_error(shape, rank, size)) {
            Err(Error::InvalidArgument(msg)) => msg,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn all_reduce_rules() {
        assert_eq!(
            ok(Shape::AllReduce, 0, 4, Some(8), Some(8), false),
            Plan {
                count: 8,
                send: Ptr::Send(0),
                recv: Ptr::Recv(0)
            }
        );
        assert!(err(Shape::AllReduce, 0, 4, Some(8), Some(7), false)
            .contains("send has 8 elements but receive has 7"));
        assert!(err(Shape::AllReduce, 2, 4, None, Some(7), false)
            .contains("rank 2 needs a send buffer"));
        assert_eq!(
            ok(Shape::AllReduce, 1, 4, None, Some(5), true),
            Plan {
                count: 5,
                send: Ptr::Recv(0),
                recv: Ptr::Recv(0)
            }
        );
    }

    #[test]
    fn broadcast_rules() {
        let root = Shape::Broadcast { root: 1 };
        assert_eq!(ok(root, 1, 2, Some(6), Some(6), false).send, Ptr::Send(0));
        assert!(err(root, 1, 2, None, Some(6), false).contains("needs a send (root) buffer"));
        assert!(err(root, 1, 2, Some(5), Some(6), false)
            .contains("root sends 5 elements but receives 6"));
        // Off the root the send buffer is not needed, and not used even when given.
        assert_eq!(
            ok(root, 0, 2, None, Some(6), false),
            Plan {
                count: 6,
                send: Ptr::Recv(0),
                recv: Ptr::Recv(0)
            }
        );
        assert_eq!(ok(root, 0, 2, Some(1), Some(6), false).send, Ptr::Recv(0));
        assert!(
            err(Shape::Broadcast { root: 2 }, 0, 2, None, Some(6), false)
                .contains("root 2 is out of range")
        );
        assert_eq!(ok(root, 0, 2, None, Some(3), true).count, 3);
    }

    #[test]
    fn reduce_rules() {
        let shape = Shape::Reduce { root: 0 };
        assert_eq!(
            ok(shape, 0, 3, Some(4), Some(4), false),
            Plan {
                count: 4,
                send: Ptr::Send(0),
                recv: Ptr::Recv(0)
            }
        );
        assert!(err(shape, 0, 3, Some(4), None, false).contains("needs a receive (root) buffer"));
        assert!(err(shape, 0, 3, Some(4), Some(3), false).contains("the root receives 3"));
        assert_eq!(
            ok(shape, 2, 3, Some(4), None, false),
            Plan {
                count: 4,
                send: Ptr::Send(0),
                recv: Ptr::Null
            }
        );
        assert!(
            err(Shape::Reduce { root: 3 }, 0, 3, Some(4), Some(4), false).contains("out of range")
        );
    }

    #[test]
    fn all_gather_rules() {
        assert_eq!(
            ok(Shape::AllGather, 2, 4, Some(3), Some(12), false),
            Plan {
                count: 3,
                send: Ptr::Send(0),
                recv: Ptr::Recv(0)
            }
        );
        assert!(err(Shape::AllGather, 2, 4, Some(3), Some(11), false)
            .contains("must hold 4 x 3 elements, it has 11"));
        assert!(
            err(Shape::AllGather, 2, 4, Some(usize::MAX), Some(11), false).contains("must hold")
        );
        assert_eq!(
            ok(Shape::AllGather, 2, 4, None, Some(12), true),
            Plan {
                count: 3,
                send: Ptr::Recv(6),
                recv: Ptr::Recv(0)
            }
        );
        assert!(err(Shape::AllGather, 2, 4, None, Some(10), true)
            .contains("not a multiple of the 4 ranks"));
    }

    #[test]
    fn reduce_scatter_rules() {
        assert_eq!(
            ok(Shape::ReduceScatter, 1, 4, Some(8), Some(2), false),
            Plan {
                count: 2,
                send: Ptr::Send(0),
                recv: Ptr::Recv(0)
            }
        );
        assert!(err(Shape::ReduceScatter, 1, 4, Some(7), Some(2), false)
            .contains("send buffer must hold 4 x 2"));
        assert_eq!(
            ok(Shape::ReduceScatter, 3, 4, None, Some(8), true),
            Plan {
                count: 2,
                send: Ptr::Recv(0),
                recv: Ptr::Recv(6)
            }
        );
    }

    #[test]
    fn all_to_all_rules() {
        assert_eq!(ok(Shape::AllToAll, 0, 4, Some(8), Some(8), false).count, 2);
        assert!(err(Shape::AllToAll, 0, 4, Some(8), Some(12), false)
            .contains("send has 8 elements but receive has 12"));
        assert!(err(Shape::AllToAll, 0, 4, Some(6), Some(6), false).contains("not a multiple"));
        assert!(err(Shape::AllToAll, 0, 4, None, Some(8), true).contains("no in-place all-to-all"));
    }

    #[test]
    fn gather_and_scatter_rules() {
        let gather = Shape::Gather { root: 1 };
        assert_eq!(
            ok(gather, 1, 3, Some(2), Some(6), false),
            Plan {
                count: 2,
                send: Ptr::Send(0),
                recv: Ptr::Recv(0)
            }
        );
        assert!(err(gather, 1, 3, Some(2), Some(5), false)
            .contains("root's receive buffer must hold 3 x 2"));
        assert!(err(gather, 1, 3, Some(2), None, false).contains("needs a receive (root) buffer"));
        assert_eq!(ok(gather, 0, 3, Some(2), None, false).recv, Ptr::Null);
        assert_eq!(
            ok(gather, 1, 3, None, Some(6), true),
            Plan {
                count: 2,
                send: Ptr::Recv(2),
                recv: Ptr::Recv(0)
            }
        );
        assert_eq!(
            ok(gather, 2, 3, None, Some(2), true),
            Plan {
                count: 2,
                send: Ptr::Recv(0),
                recv: Ptr::Null
            }
        );

        let scatter = Shape::Scatter { root: 2 };
        assert_eq!(
            ok(scatter, 2, 3, Some(9), Some(3), false),
            Plan {
                count: 3,
                send: Ptr::Send(0),
                recv: Ptr::Recv(0)
            }
        );
        assert!(err(scatter, 2, 3, Some(8), Some(3), false)
            .contains("root's send buffer must hold 3 x 3"));
        assert!(err(scatter, 2, 3, None, Some(3), false).contains("needs a send (root) buffer"));
        assert_eq!(ok(scatter, 0, 3, None, Some(3), false).send, Ptr::Null);
        assert_eq!(
            ok(scatter, 2, 3, None, Some(9), true),
            Plan {
                count: 3,
                send: Ptr::Recv(0),
                recv: Ptr::Recv(6)
            }
        );
        assert!(err(scatter, 2, 3, None, Some(8), true).contains("not a multiple"));
        assert!(err(Shape::Scatter { root: 5 }, 0, 3, None, Some(3), false)
            .contains("root 5 is out of range"));
    }

    #[test]
    fn point_to_point_rules() {
        assert_eq!(
            ok(Shape::Send { peer: 1 }, 0, 2, Some(4), None, false),
            Plan {
                count: 4,
                send: Ptr::Send(0),
                recv: Ptr::Null
            }
        );
        assert_eq!(
            ok(Shape::Recv { peer: 0 }, 1, 2, None, Some(4), false),
            Plan {
                count: 4,
                send: Ptr::Null,
                recv: Ptr::Recv(0)
            }
        );
        assert!(err(Shape::Send { peer: 2 }, 0, 2, Some(4), None, false)
            .contains("peer 2 is out of range"));
        // Sending to oneself is allowed by NCCL (inside a group).
        assert_eq!(
            ok(Shape::Recv { peer: 1 }, 1, 2, None, Some(1), false).count,
            1
        );
        assert_eq!(check_self_p2p(Shape::Send { peer: 1 }, 1, true), Ok(()));
        assert_eq!(check_self_p2p(Shape::Recv { peer: 0 }, 1, false), Ok(()));
        // ... but alone it would wait for itself forever.
        for shape in [Shape::Send { peer: 1 }, Shape::Recv { peer: 1 }] {
            let broken = check_self_p2p(shape, 1, false).unwrap_err();
            assert_eq!(broken, Broken::SelfOutsideGroup);
            let text = broken.to_error(shape, 1, 2).to_string();
            assert!(text.contains("to its own rank"), "{text}");
            assert!(text.contains("one Group"), "{text}");
        }
        assert_eq!(check_self_p2p(Shape::AllGather, 0, false), Ok(()));
    }

    #[test]
    fn offsets_never_leave_the_buffer() {
        // Exhaustive over small sizes: every pointer + count stays inside its buffer.
        for size in 1..=5 {
            for rank in 0..size {
                for len in 0..=12 {
                    let shapes = [
                        Shape::AllGather,
                        Shape::ReduceScatter,
                        Shape::Gather { root: size - 1 },
                        Shape::Scatter { root: 0 },
                    ];
                    for shape in shapes {
                        let Ok(p) = check_plan(shape, rank, size, None, Some(len), true) else {
                            continue;
                        };
                        for ptr in [p.send, p.recv] {
                            if let Ptr::Recv(offset) = ptr {
                                assert!(
                                    offset + p.count <= len,
                                    "{shape:?} {rank}/{size} len {len}: {p:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
