//! [`Operation`]: one NCCL call with its buffers, and the constructors that describe it.

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::constructors;
use crate::coll_config::CollConfig;
use crate::comm::{Comm, ContextId};
use crate::dtype::NcclType;
use crate::op::Reduction;

/// What an operation does, apart from its buffers and reduction: the key to NCCL's count
/// rules and to the functions called (one row each in `dispatch.rs`'s table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
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

impl Kind {
    // `call()` and `config_call()`, the NCCL functions of each kind, are written by the
    // table of entry points in `dispatch.rs`, beside the calls themselves.

    /// The C name of the function the operation calls.
    #[inline]
    pub(crate) fn name(self) -> &'static str {
        self.call().name
    }
}

/// One NCCL operation, a collective or a point-to-point transfer, with its buffers, ready to
/// be enqueued; see the [module docs](super).
///
/// The lifetime `'a` covers the buffers (and a [`PreMulSum`](crate::PreMulSum) operator, and
/// a [`CollConfig`] with its kernel-started event): they stay borrowed until the operation
/// is enqueued, or until the group that holds it ends.
///
/// A collective may carry a per-collective configuration ([`Operation::with_config`], NCCL
/// 2.31), which sends it through NCCL's `*Config` variant of the call:
///
/// ```no_run
/// # fn f(comm: &nccl::Comm, grads: &mut cudarc::driver::CudaSlice<f32>) -> nccl::Result<()> {
/// use nccl::{CollConfig, Operation, ReduceOp};
///
/// let config = CollConfig::new().algorithm("ring").max_ctas(4);
/// comm.enqueue(Operation::all_reduce_in_place(grads, ReduceOp::Sum).with_config(&config))?;
/// # Ok(())
/// # }
/// ```
pub struct Operation<'a, T: NcclType> {
    pub(crate) kind: Kind,
    pub(crate) op: Option<Reduction<'a, T>>,
    pub(crate) send: Option<Held<&'a dyn DevicePtr<T>>>,
    pub(crate) recv: Option<Held<&'a mut dyn DevicePtrMut<T>>>,
    pub(crate) in_place: bool,
    pub(crate) config: Option<&'a CollConfig<'a>>,
}

/// A buffer of an [`Operation`] with the two facts validation needs from it, its length
/// and its CUDA context, read when the operation is built. The constructors are generic
/// over the buffer's type, so these reads are direct there; the enqueue path, which most
/// programs reach cache-cold after their own work, then makes one indirect call per buffer
/// (for its device pointer) instead of three.
pub(crate) struct Held<B> {
    pub(crate) buf: B,
    pub(crate) len: usize,
    pub(crate) context: ContextId,
}

impl<'a, T> Held<&'a dyn DevicePtr<T>> {
    // Inlined into the generic constructors, where the vtable is known and the reads
    // become direct.
    #[inline(always)]
    fn send(buf: &'a dyn DevicePtr<T>) -> Self {
        Self {
            len: buf.len(),
            context: ContextId::of(buf.stream().context()),
            buf,
        }
    }
}

impl<'a, T> Held<&'a mut dyn DevicePtrMut<T>> {
    #[inline(always)]
    fn recv(buf: &'a mut dyn DevicePtrMut<T>) -> Self {
        Self {
            len: buf.len(),
            context: ContextId::of(buf.stream().context()),
            buf,
        }
    }
}

impl<T: NcclType> std::fmt::Debug for Operation<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operation")
            .field("kind", &self.kind)
            .field("op", &self.op)
            .field("dtype", &T::DATA_TYPE)
            .field("send_len", &self.send.as_ref().map(|b| b.len))
            .field("recv_len", &self.recv.as_ref().map(|b| b.len))
            .field("in_place", &self.in_place)
            .field("config", &self.config)
            .finish()
    }
}

impl<'a, T: NcclType> Operation<'a, T> {
    #[inline(always)]
    fn new(
        kind: Kind,
        op: Option<Reduction<'a, T>>,
        send: Option<&'a dyn DevicePtr<T>>,
        recv: Option<&'a mut dyn DevicePtrMut<T>>,
        in_place: bool,
    ) -> Self {
        Self {
            kind,
            op,
            send: send.map(Held::send),
            recv: recv.map(Held::recv),
            in_place,
            config: None,
        }
    }

    /// Runs the collective with a per-collective configuration (`ncclAllReduceConfig` ...
    /// `ncclScatterConfig`, NCCL 2.31; a kernel-started event needs 2.32): algorithm
    /// selection, CTA limits and policy, profiler tag. See [`CollConfig`] for NCCL's rules.
    ///
    /// The configuration (and its event) stays borrowed until the operation is enqueued, or
    /// until the group holding it ends. Checked when the operation is enqueued: on an older
    /// library the call is [`Error::Unsupported`](crate::Error::Unsupported); on a send or
    /// receive, which NCCL has no configured form of, it is
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument). Nothing is enqueued then.
    pub fn with_config(mut self, config: &'a CollConfig<'a>) -> Self {
        self.config = Some(config);
        self
    }

    /// The configuration set by [`Operation::with_config`], if any.
    pub fn config(&self) -> Option<&'a CollConfig<'a>> {
        self.config
    }
}

// The constructors, one row each, and their `Comm` methods (point-to-point included). They
// are always inlined: where an operation is built next to its enqueue (the `Comm` methods),
// its kind is then a constant and the dispatch folds to that kind's checks.
constructors! {
    Operation => enqueue_inline, #[inline(always)];

    /// All-reduce: every rank ends with the reduction of all ranks' `send` in `recv`
    /// (same length on every rank).
    all_reduce(send: &'a impl DevicePtr<T>, recv: &'a mut impl DevicePtrMut<T>, op: impl Into<Reduction<'a, T>>)
        = (Kind::AllReduce, Some(op.into()), Some(send), Some(recv), false);

    /// All-reduce in place: `buf` is input and output.
    all_reduce_in_place(buf: &'a mut impl DevicePtrMut<T>, op: impl Into<Reduction<'a, T>>)
        = (Kind::AllReduce, Some(op.into()), None, Some(buf), true);

    /// Broadcast: `recv` on every rank receives the root's `send`. `send` is required on the
    /// root (same length as `recv`) and ignored elsewhere.
    broadcast(send: Option<&'a dyn DevicePtr<T>>, recv: &'a mut impl DevicePtrMut<T>, root: usize)
        = (Kind::Broadcast { root }, None, send, Some(recv), false);

    /// Broadcast in place: the root's `buf` is copied into `buf` on every other rank.
    broadcast_in_place(buf: &'a mut impl DevicePtrMut<T>, root: usize)
        = (Kind::Broadcast { root }, None, None, Some(buf), true);

    /// Reduce: the root's `recv` receives the reduction of every rank's `send`. `recv` is
    /// required on the root (same length as `send`) and ignored elsewhere.
    reduce(send: &'a impl DevicePtr<T>, recv: Option<&'a mut dyn DevicePtrMut<T>>, op: impl Into<Reduction<'a, T>>, root: usize)
        = (Kind::Reduce { root }, Some(op.into()), Some(send), recv, false);

    /// Reduce in place: `buf` is every rank's input and, on the root, the output.
    reduce_in_place(buf: &'a mut impl DevicePtrMut<T>, op: impl Into<Reduction<'a, T>>, root: usize)
        = (Kind::Reduce { root }, Some(op.into()), None, Some(buf), true);

    /// All-gather: `recv` (`size * send.len()` elements) receives rank `i`'s `send` at
    /// offset `i * send.len()`.
    all_gather(send: &'a impl DevicePtr<T>, recv: &'a mut impl DevicePtrMut<T>)
        = (Kind::AllGather, None, Some(send), Some(recv), false);

    /// All-gather in place: `buf` holds `size * count` elements and this rank's contribution
    /// at `rank * count`.
    all_gather_in_place(buf: &'a mut impl DevicePtrMut<T>)
        = (Kind::AllGather, None, None, Some(buf), true);

    /// Reduce-scatter: `send` holds `size * recv.len()` elements; rank `i`'s `recv` receives
    /// block `i` of the reduction.
    reduce_scatter(send: &'a impl DevicePtr<T>, recv: &'a mut impl DevicePtrMut<T>, op: impl Into<Reduction<'a, T>>)
        = (Kind::ReduceScatter, Some(op.into()), Some(send), Some(recv), false);

    /// Reduce-scatter in place: `buf` holds the `size * count` inputs; this rank's block of
    /// the result is written at `rank * count`.
    reduce_scatter_in_place(buf: &'a mut impl DevicePtrMut<T>, op: impl Into<Reduction<'a, T>>)
        = (Kind::ReduceScatter, Some(op.into()), None, Some(buf), true);

    /// All-to-all (NCCL 2.28): `send` and `recv` hold `size * count` elements; block `j` of
    /// `send` goes to rank `j`, and block `i` of `recv` comes from rank `i`.
    all_to_all(send: &'a impl DevicePtr<T>, recv: &'a mut impl DevicePtrMut<T>)
        = (Kind::AllToAll, None, Some(send), Some(recv), false);

    /// Gather (NCCL 2.28): the root's `recv` (`size * send.len()` elements) receives rank
    /// `i`'s `send` at `i * send.len()`. `recv` is required on the root; elsewhere NCCL
    /// writes nothing into it, and it may be `None` unless the call may use copy engines
    /// (a CTA policy with `ZERO`: the communicator's, [`Comm::copy_engine`](crate::Comm::copy_engine),
    /// or from NCCL 2.31 the call's own [`CollConfig`](crate::CollConfig), with
    /// `NCCL_CTA_POLICY` over both): there NCCL picks the path per rank from whether `recv`
    /// lies in a symmetric window, and rank `i` off the root writes its block into the
    /// root's window at its own `recv`'s window offset plus `i * send.len()`. So there every
    /// rank passes a `recv` of `size * send.len()` elements, like the root's (a missing or
    /// shorter one is refused, not left to hang or write past the window), at the root's
    /// window offset (the caller's rule: only this rank's side is visible here).
    gather(send: &'a impl DevicePtr<T>, recv: Option<&'a mut dyn DevicePtrMut<T>>, root: usize)
        = (Kind::Gather { root }, None, Some(send), recv, false);

    /// Gather in place: on the root `buf` holds `size * count` elements with the root's own
    /// part at `root * count`; on other ranks `buf` is the `count` elements they send.
    /// Refused on every rank where the call may use copy engines (see [`Operation::gather`]):
    /// NCCL's copy-engine gather writes each block at its rank's offset in the root's
    /// window, past a single block; use the out-of-place form there.
    gather_in_place(buf: &'a mut impl DevicePtrMut<T>, root: usize)
        = (Kind::Gather { root }, None, None, Some(buf), true);

    /// Scatter (NCCL 2.28): block `i` of the root's `send` (`size * recv.len()` elements)
    /// goes to rank `i`'s `recv`. `send` is required on the root, ignored elsewhere (there
    /// `recv` is handed to NCCL in its place, so that on a copy-engine communicator every
    /// rank's choice of path follows its receive buffer).
    scatter(send: Option<&'a dyn DevicePtr<T>>, recv: &'a mut impl DevicePtrMut<T>, root: usize)
        = (Kind::Scatter { root }, None, send, Some(recv), false);

    /// Scatter in place: on the root `buf` holds all `size * count` elements and keeps its
    /// own block at `root * count`; on other ranks `buf` receives `count` elements. Refused
    /// where the call may use copy engines (see [`Operation::gather`]): NCCL's copy-engine
    /// in-place scatter misplaces the blocks there (see the error).
    scatter_in_place(buf: &'a mut impl DevicePtrMut<T>, root: usize)
        = (Kind::Scatter { root }, None, None, Some(buf), true);

    /// Point-to-point send of `buf` to rank `peer`, which must post a matching receive of
    /// the same length and type (NCCL 2.7). See [`crate::p2p`].
    send(buf: &'a impl DevicePtr<T>, peer: usize)
        = (Kind::Send { peer }, None, Some(buf), None, false);

    /// Point-to-point receive into `buf` from rank `peer` (NCCL 2.7). See [`crate::p2p`].
    recv(buf: &'a mut impl DevicePtrMut<T>, peer: usize)
        = (Kind::Recv { peer }, None, None, Some(buf), false);
}
