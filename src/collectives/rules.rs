//! NCCL's count and buffer rules, checked on every call before NCCL sees it.
//!
//! Pure functions of the operation's kind, this rank, the communicator size and the buffer
//! lengths: no communicator or GPU is needed to test them.

use super::operation::Kind;
use crate::calls::Call;
use crate::error::Error;

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
pub(crate) enum Broken {
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
    /// A per-collective configuration on a send or receive: NCCL has no configured form of
    /// them.
    ConfigOnPointToPoint,
    /// A gather without a receive buffer off the root, on a communicator whose CTA policy
    /// lets NCCL pick copy engines (see [`check_plan`]).
    CopyEngineGatherWithoutReceive,
    /// An in-place scatter on a call whose CTA policy lets NCCL pick copy engines (see
    /// [`check_plan`]).
    CopyEngineInPlaceScatter,
    /// An in-place gather on a call whose CTA policy lets NCCL pick copy engines (see
    /// [`check_plan`]).
    CopyEngineInPlaceGather,
    /// Off the root of a copy-engine gather, a receive buffer shorter than the root's
    /// (`size` × the send count, see [`check_plan`]).
    CopyEngineGatherShortReceive { send: usize, recv: usize },
}

/// How the send and receive lengths of an operation must relate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LengthRule {
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
    pub(crate) fn to_error(self, kind: Kind, rank: usize, size: usize) -> Error {
        let name = kind.name();
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
            Broken::CopyEngineGatherWithoutReceive => format!(
                "{name} on rank {rank}: this call's CTA policy (per call, the communicator's or \
                 NCCL_CTA_POLICY) includes ZERO, so NCCL decides on each rank whether the gather runs on copy engines, from whether \
                 that rank's receive buffer lies in a symmetric window, and the ranks off the \
                 root write through their receive buffer's window offset into the root's; \
                 pass the receive buffer on every rank (the same window offset as the root's), \
                 or ranks would disagree and wait for each other forever"
            ),
            Broken::CopyEngineInPlaceScatter => format!(
                "{name} in place on rank {rank}: this call's CTA policy (per call, the \
                 communicator's or NCCL_CTA_POLICY) includes ZERO, and NCCL's copy-engine scatter (2.28-2.32) places in-place blocks at the root's \
                 own block offset plus the destination's, not in the destination's buffer \
                 (seen on 2.32.3: wrong data, or writes past the window for the last ranks); \
                 use the out-of-place scatter there"
            ),
            Broken::CopyEngineInPlaceGather => format!(
                "{name} in place on rank {rank}: this call's CTA policy (per call, the \
                 communicator's or NCCL_CTA_POLICY) includes ZERO, and NCCL's copy-engine \
                 gather (2.28-2.32) writes each rank's block into the root's window at that \
                 rank's buffer offset plus rank x count, past a single in-place block; use \
                 the out-of-place gather with a receive view of {size} x count elements at the \
                 root's window offset on every rank"
            ),
            Broken::CopyEngineGatherShortReceive { send, recv } => format!(
                "{name} on rank {rank}: this call's CTA policy (per call, the communicator's or \
                 NCCL_CTA_POLICY) includes ZERO, and NCCL's copy-engine gather writes this \
                 rank's {send} elements into the root's window at this rank's receive offset \
                 plus {rank} x {send}: the receive buffer must hold {size} x {send} elements, \
                 as the root's does, at the root's window offset; it has {recv}"
            ),
            Broken::ConfigOnPointToPoint => format!(
                "{name} on rank {rank} takes no CollConfig: NCCL has configured variants of \
                 the collectives only (ncclAllReduceConfig ... ncclScatterConfig)"
            ),
        };
        Error::invalid(message)
    }
}

/// A point-to-point call to one's own rank completes only when its counterpart is in the
/// same group; alone it would wait forever (NCCL then reports an error that looks fatal).
#[inline]
pub(crate) fn check_self_p2p(
    kind: Kind,
    rank: usize,
    in_group: bool,
) -> std::result::Result<(), Broken> {
    match kind {
        Kind::Send { peer } | Kind::Recv { peer } if peer == rank && !in_group => {
            Err(Broken::SelfOutsideGroup)
        }
        _ => Ok(()),
    }
}

/// The name of NCCL's `*Config` variant of `kind`, for an operation that carries a
/// [`CollConfig`](crate::CollConfig); send and receive have none.
#[inline]
pub(crate) fn check_config_kind(kind: Kind) -> std::result::Result<&'static Call, Broken> {
    kind.config_call().ok_or(Broken::ConfigOnPointToPoint)
}

/// Applies NCCL's count and buffer rules to one rank's view of an operation.
///
/// `send_len`/`recv_len` are the lengths of the buffers given (in place, only `recv_len`:
/// the single buffer). Everything NCCL would read or write must lie inside them. A broken
/// rule comes back as a [`Broken`], which becomes an error message only when it happens.
///
/// Off the root, NCCL ignores a gather's receive and a scatter's send buffer, except for one
/// decision: with `NCCL_CTA_POLICY_ZERO` (`copy_engine`), each rank picks the copy-engine
/// path (2.28+) from whether *its own* send and receive pointers lie in symmetric windows
/// (`ncclGetSymRegType`/`ncclCeAvailable` in NCCL's enqueue.cc; 2.28 wants both, 2.29+ the
/// receive one), and a copy-engine gather off the root writes into the root's window at its
/// own receive pointer's window offset (`ncclCeGather`). Ranks that decide differently wait
/// for each other forever. So off the root a scatter passes its receive buffer as the send
/// pointer too (never read there, and then every rank decides as its receive buffer says);
/// a gather passes the receive buffer when one is given, and must be given one when
/// `copy_engine`. NCCL's copy-engine in-place scatter writes block `d` at the root's
/// receive pointer plus `d` blocks (`ncclCeScatter`), which for a root other than 0 lies
/// `root` blocks past the destination's buffer: refused when `copy_engine`.
///
/// A copy-engine gather off the root copies its `count` elements to the root's window at
/// (its own receive pointer's window offset) + `rank` × `count` (`ncclCeGather`, NCCL
/// 2.28-2.30.7 `src/ce_coll.cc`; NCCL checks only that the start lies in the window). So
/// with `copy_engine` the receive buffer off the root must hold `size` × `count` elements
/// like the root's (with windows of equal size on every rank, which registration checks,
/// the write then stays inside the root's window), and an in-place gather, whose single
/// block cannot say so, is refused on every rank. That the off-root receive buffer sits at
/// the root's window offset is the caller's rule: only its own side is visible here.
///
/// `copy_engine` is the decision for this call: the per-call CTA policy where NCCL lets it
/// win (see `CollConfig::copy_engine`), else the communicator's.
// Inlined (see `dispatch`), like every step below: with a known kind, only that kind's
// rules remain.
#[inline(always)]
pub(crate) fn check_plan(
    kind: Kind,
    rank: usize,
    size: usize,
    send_len: Option<usize>,
    recv_len: Option<usize>,
    in_place: bool,
    copy_engine: bool,
) -> std::result::Result<Plan, Broken> {
    let view = View {
        rank,
        size,
        send_len,
        recv_len,
    };
    match (kind, in_place) {
        (Kind::AllReduce, false) => view.all_reduce(),
        (Kind::Broadcast { root }, false) => view.broadcast(root),
        (Kind::Reduce { root }, false) => view.reduce(root),
        // In place, these three read and write the one buffer whole.
        (Kind::AllReduce, true) => view.whole_in_place(),
        (Kind::Broadcast { root } | Kind::Reduce { root }, true) => {
            view.check_rank(root, "root")?;
            view.whole_in_place()
        }
        (Kind::AllGather, false) => view.all_gather(),
        (Kind::AllGather, true) => view.all_gather_in_place(),
        (Kind::ReduceScatter, false) => view.reduce_scatter(),
        (Kind::ReduceScatter, true) => view.reduce_scatter_in_place(),
        (Kind::AllToAll, false) => view.all_to_all(),
        (Kind::AllToAll, true) => Err(Broken::InPlaceAllToAll),
        (Kind::Gather { root }, false) => view.gather(root, copy_engine),
        (Kind::Gather { .. }, true) if copy_engine => Err(Broken::CopyEngineInPlaceGather),
        (Kind::Gather { root }, true) => {
            view.rooted_in_place(root, |count| (Ptr::Recv(root * count), Ptr::Recv(0)))
        }
        (Kind::Scatter { root }, false) => view.scatter(root),
        (Kind::Scatter { .. }, true) if copy_engine => Err(Broken::CopyEngineInPlaceScatter),
        (Kind::Scatter { root }, true) => {
            view.rooted_in_place(root, |count| (Ptr::Recv(0), Ptr::Recv(root * count)))
        }
        (Kind::Send { peer }, _) => {
            view.check_rank(peer, "peer")?;
            plan(view.need(send_len, "send")?, Ptr::Send(0), Ptr::Null)
        }
        (Kind::Recv { peer }, _) => {
            view.check_rank(peer, "peer")?;
            plan(view.need(recv_len, "receive")?, Ptr::Null, Ptr::Recv(0))
        }
    }
}

/// One rank's view of an operation, what [`check_plan`]'s steps read.
#[derive(Clone, Copy)]
struct View {
    rank: usize,
    size: usize,
    send_len: Option<usize>,
    recv_len: Option<usize>,
}

type Checked<T> = std::result::Result<T, Broken>;

#[inline(always)]
fn plan(count: usize, send: Ptr, recv: Ptr) -> Checked<Plan> {
    Ok(Plan { count, send, recv })
}

/// The small checks the rules are made of.
impl View {
    #[inline(always)]
    fn need(&self, len: Option<usize>, what: &'static str) -> Checked<usize> {
        len.ok_or(Broken::Missing(what))
    }

    /// Both buffers of an out-of-place operation.
    #[inline(always)]
    fn both(&self) -> Checked<(usize, usize)> {
        Ok((
            self.need(self.send_len, "send")?,
            self.need(self.recv_len, "receive")?,
        ))
    }

    /// A root or peer is a rank of the communicator.
    #[inline(always)]
    fn check_rank(&self, value: usize, what: &'static str) -> Checked<()> {
        if value < self.size {
            Ok(())
        } else {
            Err(Broken::OutOfRange { what, value })
        }
    }

    #[inline(always)]
    fn same(&self, rule: LengthRule, send: usize, recv: usize) -> Checked<()> {
        if send == recv {
            Ok(())
        } else {
            Err(Broken::Mismatch { rule, send, recv })
        }
    }

    /// `whole` is exactly `size` times `part`.
    #[inline(always)]
    fn holds_all(
        &self,
        rule: LengthRule,
        whole: usize,
        part: usize,
        lens: (usize, usize),
    ) -> Checked<()> {
        if part.checked_mul(self.size) == Some(whole) {
            Ok(())
        } else {
            let (send, recv) = lens;
            Err(Broken::Mismatch { rule, send, recv })
        }
    }

    /// `len` splits evenly among the ranks: the count per rank.
    #[inline(always)]
    fn divisible(&self, len: usize, what: &'static str) -> Checked<usize> {
        if len.is_multiple_of(self.size) {
            Ok(len / self.size)
        } else {
            Err(Broken::NotMultiple { what, len })
        }
    }
}

/// The rules, one collective each.
impl View {
    #[inline(always)]
    fn all_reduce(&self) -> Checked<Plan> {
        let (s, r) = self.both()?;
        self.same(LengthRule::Equal, s, r)?;
        plan(r, Ptr::Send(0), Ptr::Recv(0))
    }

    /// The single buffer, read and written whole.
    #[inline(always)]
    fn whole_in_place(&self) -> Checked<Plan> {
        plan(
            self.need(self.recv_len, "in-place")?,
            Ptr::Recv(0),
            Ptr::Recv(0),
        )
    }

    #[inline(always)]
    fn broadcast(&self, root: usize) -> Checked<Plan> {
        self.check_rank(root, "root")?;
        let r = self.need(self.recv_len, "receive")?;
        if self.rank != root {
            // NCCL ignores the send buffer off the root; pass the receive buffer.
            return plan(r, Ptr::Recv(0), Ptr::Recv(0));
        }
        let s = self.need(self.send_len, "send (root)")?;
        self.same(LengthRule::RootSendsWhatItReceives, s, r)?;
        plan(r, Ptr::Send(0), Ptr::Recv(0))
    }

    #[inline(always)]
    fn reduce(&self, root: usize) -> Checked<Plan> {
        self.check_rank(root, "root")?;
        let s = self.need(self.send_len, "send")?;
        if self.rank != root {
            return plan(s, Ptr::Send(0), Ptr::Null);
        }
        let r = self.need(self.recv_len, "receive (root)")?;
        self.same(LengthRule::RootReceivesWhatItSends, s, r)?;
        plan(s, Ptr::Send(0), Ptr::Recv(0))
    }

    #[inline(always)]
    fn all_gather(&self) -> Checked<Plan> {
        let (s, r) = self.both()?;
        self.holds_all(LengthRule::RecvHoldsAll, r, s, (s, r))?;
        plan(s, Ptr::Send(0), Ptr::Recv(0))
    }

    /// This rank's block sits at `rank * count` of the whole.
    #[inline(always)]
    fn all_gather_in_place(&self) -> Checked<Plan> {
        let count = self.divisible(self.need(self.recv_len, "in-place")?, "in-place")?;
        plan(count, Ptr::Recv(self.rank * count), Ptr::Recv(0))
    }

    #[inline(always)]
    fn reduce_scatter(&self) -> Checked<Plan> {
        let (s, r) = self.both()?;
        self.holds_all(LengthRule::SendHoldsAll, s, r, (s, r))?;
        plan(r, Ptr::Send(0), Ptr::Recv(0))
    }

    /// This rank's block of the result lands at `rank * count` of the whole.
    #[inline(always)]
    fn reduce_scatter_in_place(&self) -> Checked<Plan> {
        let count = self.divisible(self.need(self.recv_len, "in-place")?, "in-place")?;
        plan(count, Ptr::Recv(0), Ptr::Recv(self.rank * count))
    }

    #[inline(always)]
    fn all_to_all(&self) -> Checked<Plan> {
        let (s, r) = self.both()?;
        self.same(LengthRule::Equal, s, r)?;
        let count = self.divisible(s, "send")?;
        plan(count, Ptr::Send(0), Ptr::Recv(0))
    }

    /// Off the root, what a copy-engine gather needs (see [`check_plan`]).
    #[inline(always)]
    fn gather(&self, root: usize, copy_engine: bool) -> Checked<Plan> {
        self.check_rank(root, "root")?;
        let s = self.need(self.send_len, "send")?;
        if self.rank != root {
            return match self.recv_len {
                // What `ncclCeGather` writes (`recv + rank x count` in the root's window)
                // lies inside a buffer as long as the root's.
                Some(r) if copy_engine && s.checked_mul(self.size).is_none_or(|all| r < all) => {
                    Err(Broken::CopyEngineGatherShortReceive { send: s, recv: r })
                }
                Some(_) => plan(s, Ptr::Send(0), Ptr::Recv(0)),
                None if copy_engine => Err(Broken::CopyEngineGatherWithoutReceive),
                None => plan(s, Ptr::Send(0), Ptr::Null),
            };
        }
        let r = self.need(self.recv_len, "receive (root)")?;
        self.holds_all(LengthRule::RootRecvHoldsAll, r, s, (s, r))?;
        plan(s, Ptr::Send(0), Ptr::Recv(0))
    }

    /// Off the root, the receive buffer stands in for the send buffer (see [`check_plan`]).
    #[inline(always)]
    fn scatter(&self, root: usize) -> Checked<Plan> {
        self.check_rank(root, "root")?;
        let r = self.need(self.recv_len, "receive")?;
        if self.rank != root {
            return plan(r, Ptr::Recv(0), Ptr::Recv(0));
        }
        let s = self.need(self.send_len, "send (root)")?;
        self.holds_all(LengthRule::RootSendHoldsAll, s, r, (s, r))?;
        plan(r, Ptr::Send(0), Ptr::Recv(0))
    }

    /// An in-place gather or scatter: off the root the single buffer is the rank's block;
    /// on the root it holds every block, and `pointers` places the root's own.
    #[inline(always)]
    fn rooted_in_place(
        &self,
        root: usize,
        pointers: impl FnOnce(usize) -> (Ptr, Ptr),
    ) -> Checked<Plan> {
        self.check_rank(root, "root")?;
        let len = self.need(self.recv_len, "in-place")?;
        if self.rank != root {
            return plan(len, Ptr::Recv(0), Ptr::Recv(0));
        }
        let count = self.divisible(len, "root's in-place")?;
        let (send, recv) = pointers(count);
        plan(count, send, recv)
    }
}

#[cfg(test)]
mod tests;
