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

use cudarc::driver::{CudaStream, SyncOnDrop};

use crate::collectives::{dispatch, dispatch_v, Operation, VOperation};
use crate::comm::{Comm, Membership};
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::inline_list::InlineList;
use crate::library;
pub use crate::thread_group::is_open;
use crate::thread_group::RawGroup;

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
            .field("open", &self.raw.is_open())
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
        self.admit(comm)?;
        let guards = &mut self.guards;
        dispatch(comm, stream, call, true, |new| {
            for guard in new.into_iter().flatten() {
                guards.push(guard);
            }
        })
    }

    /// Adds the v-collective `call` on `comm`'s own stream to the group; see
    /// [`crate::collectives::vector`].
    pub fn enqueue_v<'c: 'g, T: NcclType>(
        &mut self,
        comm: &'g Comm,
        call: VOperation<'c, T>,
    ) -> Result<()> {
        self.enqueue_v_on(comm, comm.stream(), call)
    }

    /// Adds the v-collective `call` on `stream` (on `comm`'s device) to the group: its NCCL
    /// calls join the group, and its buffers stay borrowed until the group ends.
    ///
    /// A call rejected by validation leaves the group as it was. The checked mode
    /// ([`VOperation::checked`]) synchronises with the other ranks, so it is refused here.
    pub fn enqueue_v_on<'c: 'g, T: NcclType>(
        &mut self,
        comm: &'g Comm,
        stream: &'g CudaStream,
        call: VOperation<'c, T>,
    ) -> Result<()> {
        self.admit(comm)?;
        let guards = &mut self.guards;
        dispatch_v(comm, stream, call, |guard| guards.push(guard))
    }

    /// Admits `comm` to the group before anything is enqueued on it.
    #[inline]
    fn admit(&mut self, comm: &'g Comm) -> Result<()> {
        if !self.raw.is_open() {
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
        Ok(())
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
        if !self.raw.is_open() {
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
