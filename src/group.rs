//! Group calls (`ncclGroupStart` / `ncclGroupEnd`).
//!
//! A [`Group`] fuses the operations enqueued through it into one NCCL launch when it ends.
//! Groups are how one thread drives several GPUs (every rank's operation must be issued
//! before any of them can complete), how point-to-point sends and receives that depend on each
//! other progress together, and how many small operations are aggregated.
//!
//! NCCL's group state belongs to the calling thread, so a `Group` is neither `Send` nor
//! `Sync`, and only one may be open per thread. While it is open, operations must go through
//! it: a plain [`Comm::enqueue`] on the same thread is refused, because its buffers' cudarc
//! events would be recorded before NCCL has actually enqueued the work. The group keeps every
//! buffer borrowed, and records their events, only after `ncclGroupEnd`.

use std::cell::Cell;
use std::marker::PhantomData;

use cudarc::driver::{CudaStream, SyncOnDrop};

use crate::collectives::{dispatch, Operation};
use crate::comm::Comm;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::library::{self, Library};

thread_local! {
    static OPEN_GROUPS: Cell<u32> = const { Cell::new(0) };
}

/// Whether a group opened by this crate is active on the calling thread.
#[inline]
pub fn is_open() -> bool {
    OPEN_GROUPS.with(|open| open.get() > 0)
}

/// Fails if a group is open on this thread; `what` names the refused call.
#[inline]
pub(crate) fn ensure_outside(what: &str) -> Result<()> {
    if is_open() {
        return Err(group_open_error(what));
    }
    Ok(())
}

#[cold]
#[inline(never)]
fn group_open_error(what: &str) -> Error {
    Error::usage(format!(
        "{what} called while a Group is open on this thread: enqueue through the Group (or \
         finish it first)"
    ))
}

/// A started `ncclGroupStart` that is ended exactly once, by `end` or on drop.
pub(crate) struct RawGroup {
    lib: &'static Library,
    open: bool,
    _thread_bound: PhantomData<*const ()>,
}

impl RawGroup {
    pub(crate) fn start(lib: &'static Library) -> Result<Self> {
        if is_open() {
            return Err(Error::usage(
                "a Group is already open on this thread; NCCL groups here do not nest",
            ));
        }
        // SAFETY: ncclGroupStart only updates this thread's group depth.
        let status = unsafe { lib.api().ncclGroupStart() };
        lib.check("ncclGroupStart", status)?;
        OPEN_GROUPS.with(|open| open.set(open.get() + 1));
        Ok(Self {
            lib,
            open: true,
            _thread_bound: PhantomData,
        })
    }

    /// Ends the group; `Ok(true)` means nonblocking communicators are still progressing.
    pub(crate) fn end(&mut self) -> Result<bool> {
        if !self.open {
            return Ok(false);
        }
        self.open = false;
        OPEN_GROUPS.with(|open| open.set(open.get().saturating_sub(1)));
        // SAFETY: matches the ncclGroupStart of `start` on this same thread (the type is
        // neither Send nor Sync).
        let status = unsafe { self.lib.api().ncclGroupEnd() };
        self.lib.check_pending("ncclGroupEnd", status)
    }

    pub(crate) fn end_ignoring_errors(&mut self) {
        let _ = self.end();
    }
}

impl Drop for RawGroup {
    fn drop(&mut self) {
        self.end_ignoring_errors();
    }
}

/// Marks communicators as members of a group open on this thread until [`Membership::leave`]
/// (or drop): an abort or revoke requested from another thread meanwhile is carried out
/// when the group has ended, because NCCL forbids aborting a communicator while a thread is
/// inside a call on it (see [`crate::fault`]).
pub(crate) struct Membership<'c> {
    comms: InlineList<&'c Comm, 8>,
    /// Until `leave`: the communicators are still marked as members.
    entered: bool,
}

impl<'c> Membership<'c> {
    pub(crate) fn enter(comms: impl IntoIterator<Item = &'c Comm>) -> Self {
        let mut membership = Self {
            comms: InlineList::new(),
            entered: true,
        };
        for comm in comms {
            membership.add(comm);
        }
        membership
    }

    /// Adds `comm` unless it is already a member.
    pub(crate) fn add(&mut self, comm: &'c Comm) {
        if !self
            .comms
            .iter()
            .any(|c| c.shared_ptr() == comm.shared_ptr())
        {
            comm.group_enter();
            self.comms.push(comm);
        }
    }

    /// The members, in the order they joined.
    pub(crate) fn comms(&self) -> impl Iterator<Item = &'c Comm> + '_ {
        self.comms.iter().copied()
    }

    /// Ends the membership of every communicator, carrying out deferred aborts; returns the
    /// first failure found on a member (as the error of `call`). Only the first call acts.
    pub(crate) fn leave(&mut self, call: &'static str) -> Option<Error> {
        if !std::mem::replace(&mut self.entered, false) {
            return None;
        }
        let mut first = None;
        for comm in self.comms.iter() {
            if let Some(err) = comm.group_leave(call) {
                first.get_or_insert(err);
            }
        }
        first
    }
}

impl Drop for Membership<'_> {
    fn drop(&mut self) {
        self.leave("Group");
    }
}

/// A list that keeps its first `N` items in place and only spills further ones to the heap:
/// most groups hold a few operations on a few communicators, and allocating for each group
/// would cost more than all of its bookkeeping.
pub(crate) struct InlineList<T, const N: usize> {
    inline: [Option<T>; N],
    len: usize,
    spilled: Vec<T>,
}

impl<T, const N: usize> InlineList<T, N> {
    pub(crate) fn new() -> Self {
        Self {
            inline: std::array::from_fn(|_| None),
            len: 0,
            spilled: Vec::new(),
        }
    }

    pub(crate) fn push(&mut self, item: T) {
        match self.inline.get_mut(self.len) {
            Some(slot) => *slot = Some(item),
            None => self.spilled.push(item),
        }
        self.len += 1;
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The items in the order they were pushed.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.inline.iter().flatten().chain(&self.spilled)
    }

    /// Drops every item, in the order they were pushed.
    pub(crate) fn clear(&mut self) {
        for slot in &mut self.inline {
            *slot = None;
        }
        self.spilled.clear();
        self.len = 0;
    }
}

/// An open NCCL group; see the [module docs](self).
///
/// ```no_run
/// # fn main() -> nccl::Result<()> {
/// use cudarc::driver::CudaContext;
/// use nccl::{Comm, Group, Operation, ReduceOp};
///
/// let streams = (0..2)
///     .map(|i| CudaContext::new(i).map(|ctx| ctx.default_stream()))
///     .collect::<Result<Vec<_>, _>>()?;
/// let comms = Comm::init_all(&streams)?;
/// let mut grads = streams
///     .iter()
///     .map(|s| s.clone_htod(&[1.0f32; 1024]))
///     .collect::<Result<Vec<_>, _>>()?;
/// let mut group = Group::start()?;
/// for (comm, grad) in comms.iter().zip(grads.iter_mut()) {
///     group.enqueue(comm, Operation::all_reduce_in_place(grad, ReduceOp::Avg))?;
/// }
/// group.finish()?;
/// # Ok(())
/// # }
/// ```
pub struct Group<'g> {
    raw: RawGroup,
    /// The communicators in the group.
    membership: Membership<'g>,
    // Dropped after `raw` was ended (see Drop), so the buffers' events are recorded after
    // NCCL has enqueued the fused operation.
    guards: InlineList<SyncOnDrop<'g>, 8>,
}

impl std::fmt::Debug for Group<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("open", &self.raw.open)
            .field("communicators", &self.membership.comms().count())
            .field("buffers", &self.guards.len())
            .finish()
    }
}

impl<'g> Group<'g> {
    /// Starts a group (`ncclGroupStart`). Fails if one is already open on this thread.
    #[inline]
    pub fn start() -> Result<Self> {
        Ok(Self {
            raw: RawGroup::start(library::get()?)?,
            membership: Membership::enter([]),
            guards: InlineList::new(),
        })
    }

    /// Adds `call` on `comm`'s own stream to the group.
    pub fn enqueue<T: NcclType>(&mut self, comm: &'g Comm, call: Operation<'g, T>) -> Result<()> {
        self.enqueue_on(comm, comm.stream(), call)
    }

    /// Adds `call` on `stream` (on `comm`'s device) to the group.
    ///
    /// A call rejected by validation leaves the group as it was, and the group can go on.
    pub fn enqueue_on<T: NcclType>(
        &mut self,
        comm: &'g Comm,
        stream: &'g CudaStream,
        call: Operation<'g, T>,
    ) -> Result<()> {
        if !self.raw.open {
            return Err(Error::usage("the group has already ended"));
        }
        if let Some(first) = self.membership.comms().next() {
            if first.is_blocking() != comm.is_blocking() {
                return Err(Error::invalid(
                    "NCCL does not allow blocking and nonblocking communicators in one group",
                ));
            }
        }
        // Membership starts before NCCL sees the communicator, so no abort from another
        // thread can free it while it sits in this thread's NCCL group.
        self.membership.add(comm);
        let guards = &mut self.guards;
        dispatch(comm, stream, call, true, |new| {
            for guard in new.into_iter().flatten() {
                guards.push(guard);
            }
        })
    }

    /// Ends the group (`ncclGroupEnd`), launching everything in it, and returns its error.
    ///
    /// For nonblocking communicators it also waits until each is ready again. After an error
    /// every communicator in the group should be aborted, as NCCL documents.
    ///
    /// Every communicator is waited for, also after one of them failed, so the buffers'
    /// events are recorded (when the group is dropped) only once NCCL has finished
    /// enqueueing, or has given up, on all of them. A communicator still in progress when its
    /// [`ready_timeout`](Comm::ready_timeout) runs out is aborted before that (NCCL allows no
    /// CUDA work on its streams while it is in progress), and its error says so.
    pub fn finish(mut self) -> Result<()> {
        self.end()
    }

    /// Ends the group once; see [`Group::finish`]. Dropping an unfinished group ends it the
    /// same way, so the guards never record events on a stream NCCL still owns.
    fn end(&mut self) -> Result<()> {
        if !self.raw.open {
            return Ok(());
        }
        let ended = self.raw.end();
        // An abort deferred while the group was open runs in `leave`: the fused operation
        // was cut short, which is this group's failure.
        let failure = self.membership.leave("Group::finish");
        // Nonblocking members may still be in progress, after `ncclInProgress` and after an
        // error alike.
        let mut settled = Ok(());
        if !matches!(ended, Ok(false)) {
            for comm in self.membership.comms().filter(|comm| !comm.is_blocking()) {
                if let Err(err) = comm.wait_ready(comm.ready_timeout()) {
                    let err = comm.abandon_in_progress(err);
                    if settled.is_ok() {
                        settled = Err(err);
                    }
                }
            }
        }
        ended?;
        settled?;
        match failure {
            Some(err) => Err(err),
            None => Ok(()),
        }
    }

    /// The number of buffers the group holds borrowed.
    pub fn buffer_count(&self) -> usize {
        self.guards.len()
    }
}

impl Drop for Group<'_> {
    fn drop(&mut self) {
        // A group dropped without `finish` (an early return with `?`) still has to end, or
        // this thread's NCCL group state would stay open; its error has nowhere to go.
        let _ = self.end();
        self.guards.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_list_keeps_order_past_its_inline_room() {
        let mut list: InlineList<String, 2> = InlineList::new();
        for i in 0..5 {
            list.push(i.to_string());
        }
        assert_eq!(list.len(), 5);
        assert_eq!(
            list.iter().cloned().collect::<Vec<_>>(),
            ["0", "1", "2", "3", "4"]
        );
        list.clear();
        assert_eq!(list.len(), 0);
        assert_eq!(list.iter().count(), 0);
        list.push("again".into());
        assert_eq!(list.iter().collect::<Vec<_>>(), ["again"]);
    }

    #[test]
    fn outside_check_reflects_open_groups() {
        assert!(!is_open());
        assert!(ensure_outside("x").is_ok());
        OPEN_GROUPS.with(|open| open.set(1));
        let err = ensure_outside("ncclAllReduce").unwrap_err().to_string();
        assert!(
            err.contains("ncclAllReduce called while a Group is open"),
            "{err}"
        );
        OPEN_GROUPS.with(|open| open.set(0));
        // Other threads have their own state.
        OPEN_GROUPS.with(|open| open.set(1));
        std::thread::spawn(|| assert!(!is_open())).join().unwrap();
        OPEN_GROUPS.with(|open| open.set(0));
    }
}
