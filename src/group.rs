//! Group calls (`ncclGroupStart` / `ncclGroupEnd`).
//!
//! Past 600 lines on purpose: everything NCCL ties to one group (its members, the buffers'
//! events, the once-per-group configuration rules, simulation, the streams noted when it
//! launches) stays with the one type that ends it, next to the tests of those rules.
//!
//! A [`Group`] fuses the operations enqueued through it into one NCCL kernel launch when it
//! ends.
//! Groups are how one thread drives several GPUs (every rank's operation must be issued
//! before any of them can complete), how point-to-point sends and receives that depend on each
//! other progress together, and how many small operations are aggregated.
//!
//! NCCL's group state belongs to the calling thread, so a `Group` is neither `Send` nor
//! `Sync`, and only one may be open per thread. While it is open, operations must go through
//! it: a plain [`Comm::enqueue`] on the same thread is refused, because its buffers' cudarc
//! events would be recorded before NCCL has actually enqueued the work. The group keeps every
//! buffer borrowed, and records their events, only after `ncclGroupEnd`.
//!
//! # Per-collective configurations in a group
//!
//! Operations with a [`CollConfig`] may be grouped, with NCCL's rules
//! (`ncclCollConfig_t` docs, NCCL 2.32):
//!
//! * At most one kernel-started event per communicator per group: a second one on the
//!   same communicator is refused with [`Error::InvalidArgument`]. The event is recorded when
//!   the group's fused launch happens, so wait on it only after [`Group::finish`] returned;
//!   the group keeps it borrowed until then.
//! * `cgaClusterSize` must be the same for every collective of a group; NCCL leaves anything
//!   else undefined. Two configurations of one group that set different sizes are refused
//!   here; an operation without a configuration (or one that leaves the size unset) uses its
//!   communicator's size, which cannot be seen here: keep those consistent yourself.
//!
//! # Simulated groups
//!
//! [`Group::simulate`] opens a group that NCCL plans but does not launch
//! (`ncclGroupSimulateEnd`, NCCL 2.22): [`Simulation::estimate`] returns NCCL's cost-model
//! estimate of the group's time, and no kernel runs, so output buffers are untouched. The
//! buffers are released without recording cudarc events (no work was queued that uses
//! them). What NCCL does and therefore what a simulation accepts (`src/group.cc`,
//! `src/enqueue.cc`, 2.22 to 2.30.7):
//!
//! * Collectives only (all-reduce, broadcast, reduce, all-gather, reduce-scatter). NCCL
//!   builds sends and receives, and the all-to-all, gather and scatter made of them, into
//!   per-peer queues that only a launch empties, so a simulated one would be left behind
//!   for the next group; they are refused ([`Error::InvalidArgument`]), as are
//!   v-collectives.
//! * Broadcasts from one root per communicator, from NCCL 2.29 on: NCCL queues broadcasts
//!   per root, and those of several roots stay queued for a launch (they become one
//!   all-gather-v), so the first root of a communicator's broadcasts in a simulation is its
//!   only one; another is refused ([`Error::InvalidArgument`]).
//! * Blocking communicators of at least two ranks: NCCL runs a one-rank collective at once,
//!   as a copy, when it is enqueued, and ends a nonblocking communicator's group on a
//!   background thread that launches it.
//! * Every rank simulates the same operations, like a real group: NCCL connects the
//!   channels the chosen algorithm needs (with its default runtime connection) before it
//!   estimates, which waits for the peers.
//! * The estimate is NCCL's tuning model, in microseconds, of the last collective it
//!   scheduled (NCCL aggregates similar ones first): for a group of one collective, that
//!   collective's time. It is a model, not a measurement: compare it with a timed run
//!   (the bench's `--simulate`).

use std::time::Duration;

use cudarc::driver::{CudaStream, SyncOnDrop};

use crate::calls;
use crate::coll_config::CollConfig;
use crate::collectives::{dispatch, dispatch_v, verify_counts, Kind, Operation, VOperation};
use crate::comm::{Comm, Membership};
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::inline_list::InlineList;
use crate::library;
use crate::release::Version;
pub use crate::thread_group::is_open;
use crate::thread_group::{self, RawGroup};

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
    /// What NCCL allows once per group among the operations' configurations.
    configs: GroupConfigs,
    /// How the group ends: run, or simulated ([`Group::simulate`]).
    ending: Ending,
    /// The streams other than their communicator's own that operations were added on, noted
    /// on the communicator once the group has launched them (see [`Comm::enqueue_on`]'s
    /// streams in `comm/streams.rs`). Empty, without an allocation, where none was.
    streams: Vec<(&'g Comm, &'g CudaStream)>,
}

/// How a group ends.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Ending {
    /// `ncclGroupEnd`: everything in it runs.
    Run,
    /// `ncclGroupSimulateEnd`: planned, not run; NCCL's estimate (microseconds) once ended.
    Simulate { estimate: Option<f32> },
}

/// The per-group rules of [`CollConfig`]s: which communicators already carry a
/// kernel-started event, and the first explicit `cgaClusterSize`. Empty (and without an
/// allocation) in groups without configurations.
#[derive(Debug, Default)]
struct GroupConfigs {
    /// Communicators (by their shared state's address) with a kernel-started event.
    events: Vec<usize>,
    cga_cluster_size: Option<u32>,
}

/// What the group rules look at in one configuration: whether it has a kernel-started
/// event, and its `cgaClusterSize`.
#[derive(Debug, Clone, Copy)]
struct ConfigKey {
    event: bool,
    cga_cluster_size: Option<u32>,
}

impl From<&CollConfig<'_>> for ConfigKey {
    fn from(config: &CollConfig<'_>) -> Self {
        ConfigKey {
            event: config.started_event().is_some(),
            cga_cluster_size: config.cga(),
        }
    }
}

impl GroupConfigs {
    /// Checks a configuration for an operation on the communicator `comm_id` against what
    /// the group already holds.
    #[cold]
    #[inline(never)]
    fn check(&self, comm_id: usize, rank: usize, config: ConfigKey) -> Result<()> {
        if config.event && self.events.contains(&comm_id) {
            return Err(Error::invalid(format!(
                "the group already holds a kernel-started event (launchCompletionEvent) for \
                 rank {rank}'s communicator; NCCL allows one per communicator per group"
            )));
        }
        if let (Some(first), Some(this)) = (self.cga_cluster_size, config.cga_cluster_size) {
            if first != this {
                return Err(Error::invalid(format!(
                    "cgaClusterSize {this} differs from the {first} of an earlier collective in \
                     the group; NCCL leaves differing sizes within a group undefined"
                )));
            }
        }
        Ok(())
    }

    /// Records a configuration, checked by [`GroupConfigs::check`] and enqueued.
    #[cold]
    #[inline(never)]
    fn record(&mut self, comm_id: usize, config: ConfigKey) {
        if config.event {
            self.events.push(comm_id);
        }
        if self.cga_cluster_size.is_none() {
            self.cga_cluster_size = config.cga_cluster_size;
        }
    }
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
            configs: GroupConfigs::default(),
            ending: Ending::Run,
            streams: Vec::new(),
        })
    }

    /// Opens a group that NCCL plans without launching, for its estimate of the group's time
    /// (`ncclGroupSimulateEnd`, NCCL 2.22); see [Simulated groups](self#simulated-groups).
    /// [`Error::Unsupported`] before NCCL 2.22.
    ///
    /// ```no_run
    /// # fn estimate(comm: &nccl::Comm) -> nccl::Result<()> {
    /// # let mut grads = comm.stream().alloc_zeros::<f32>(1 << 20)?;
    /// use nccl::{Group, Operation, ReduceOp};
    /// let mut simulation = Group::simulate()?;
    /// simulation.enqueue(comm, Operation::all_reduce_in_place(&mut grads, ReduceOp::Sum))?;
    /// let estimate = simulation.estimate()?; // nothing ran; `grads` is as it was
    /// println!("NCCL expects {estimate:?}");
    /// # Ok(())
    /// # }
    /// ```
    pub fn simulate() -> Result<Simulation<'g>> {
        library::get()?.require_call(&calls::ncclGroupSimulateEnd)?;
        let mut group = Group::start()?;
        group.ending = Ending::Simulate { estimate: None };
        group.membership.simulate();
        Ok(Simulation {
            group,
            broadcast_roots: Vec::new(),
        })
    }

    /// Adds `call` on `comm`'s own stream to the group.
    pub fn enqueue<T: NcclType>(&mut self, comm: &'g Comm, call: Operation<'g, T>) -> Result<()> {
        self.enqueue_on(comm, comm.stream(), call)
    }

    /// Adds `call` on `stream` (on `comm`'s device) to the group.
    ///
    /// A stream other than `comm`'s own is noted on `comm` once the group has ended (launched
    /// the work), as for [`Comm::enqueue_on`]: ending `comm` waits for the work there too.
    ///
    /// A call rejected by validation leaves the group as it was, and the group can go on.
    /// Operations with a [`CollConfig`] follow the group rules in the [module docs](self).
    pub fn enqueue_on<T: NcclType>(
        &mut self,
        comm: &'g Comm,
        stream: &'g CudaStream,
        call: Operation<'g, T>,
    ) -> Result<()> {
        let config = call.config().map(ConfigKey::from);
        let comm_id = comm.shared_ptr() as usize;
        if let Some(config) = config {
            self.configs.check(comm_id, comm.rank(), config)?;
        }
        self.admit(comm)?;
        let guards = &mut self.guards;
        let added = dispatch(comm, stream, call, true, |new| {
            for guard in new.into_iter().flatten() {
                guards.push(guard);
            }
        });
        // Also after a failure part-way: what NCCL took stays in the group and runs.
        self.note_stream(comm, stream);
        added?;
        if let Some(config) = config {
            self.configs.record(comm_id, config);
        }
        Ok(())
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
        let added = dispatch_v(comm, stream, call, |guard| guards.push(guard));
        self.note_stream(comm, stream);
        added
    }

    /// Remembers `stream` for `comm` until the group has launched, unless it is the
    /// communicator's own or already remembered.
    #[inline(always)]
    fn note_stream(&mut self, comm: &'g Comm, stream: &'g CudaStream) {
        if !std::ptr::eq(stream, &**comm.stream()) {
            self.note_foreign_stream(comm, stream);
        }
    }

    #[cold]
    #[inline(never)]
    fn note_foreign_stream(&mut self, comm: &'g Comm, stream: &'g CudaStream) {
        let known = self.streams.iter().any(|(c, s)| {
            c.shared_ptr() == comm.shared_ptr() && s.cu_stream() == stream.cu_stream()
        });
        if !known {
            self.streams.push((comm, stream));
        }
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
        let ended = match &mut self.ending {
            // Nothing runs, so nothing is left in progress (only blocking members).
            Ending::Simulate { estimate } => self.raw.simulate_end().map(|time| {
                *estimate = Some(time);
                false
            }),
            Ending::Run => self.raw.end(),
        };
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
        // Launched (or failed, possibly part-way): ending the communicators must wait for,
        // or abort, what runs on their other streams. Simulated groups launched nothing.
        if matches!(self.ending, Ending::Run) {
            for (comm, stream) in self.streams.drain(..) {
                comm.note_stream(stream);
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
        if matches!(self.ending, Ending::Simulate { .. }) {
            // Nothing was launched: no work uses the buffers, so no event is recorded.
            for guard in self.guards.iter_mut() {
                match guard {
                    SyncOnDrop::Record(target) => *target = None,
                    SyncOnDrop::Sync(target) => *target = None,
                }
            }
        }
        self.guards.clear();
    }
}

/// A group that NCCL plans without launching ([`Group::simulate`]); see
/// [Simulated groups](self#simulated-groups). Dropped without [`Simulation::estimate`], it
/// is still only simulated.
pub struct Simulation<'g> {
    group: Group<'g>,
    /// The root of each communicator's broadcasts so far (by its shared state's address).
    broadcast_roots: Vec<(usize, usize)>,
}

impl std::fmt::Debug for Simulation<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Simulation")
            .field("group", &self.group)
            .finish()
    }
}

impl<'g> Simulation<'g> {
    /// Adds the collective `call` on `comm`'s own stream.
    pub fn enqueue<T: NcclType>(&mut self, comm: &'g Comm, call: Operation<'g, T>) -> Result<()> {
        self.enqueue_on(comm, comm.stream(), call)
    }

    /// Adds the collective `call` on `stream` (on `comm`'s device). Refused with
    /// [`Error::InvalidArgument`], the simulation going on as it was: point-to-point
    /// operations (and all-to-all, gather, scatter), nonblocking communicators and one-rank
    /// communicators, which NCCL would run or leave queued (see the
    /// [module docs](self#simulated-groups)), and a [`CollConfig`] with a kernel-started
    /// event (no kernel starts to record it); otherwise validated as [`Group::enqueue_on`].
    pub fn enqueue_on<T: NcclType>(
        &mut self,
        comm: &'g Comm,
        stream: &'g CudaStream,
        call: Operation<'g, T>,
    ) -> Result<()> {
        check_simulable(call.kind, comm.is_blocking(), comm.size())?;
        let comm_id = comm.shared_ptr() as usize;
        if let Kind::Broadcast { root } = call.kind {
            let first = first_root(&self.broadcast_roots, comm_id);
            check_broadcast_root(first, root, comm.library_version())?;
        }
        if call
            .config()
            .is_some_and(|config| config.started_event().is_some())
        {
            return Err(Error::invalid(
                "a simulated collective starts no kernel, so its kernel-started event \
                 (launchCompletionEvent) would never be recorded; simulate it without one",
            ));
        }
        let kind = call.kind;
        self.group.enqueue_on(comm, stream, call)?;
        if let Kind::Broadcast { root } = kind {
            if first_root(&self.broadcast_roots, comm_id).is_none() {
                self.broadcast_roots.push((comm_id, root));
            }
        }
        Ok(())
    }

    /// Ends the simulation (`ncclGroupSimulateEnd`) and returns NCCL's estimate of the
    /// group's time. Nothing runs. [`Error::Unavailable`] where NCCL planned nothing to
    /// estimate (an empty simulation).
    pub fn estimate(mut self) -> Result<Duration> {
        self.group.end()?;
        let micros = match self.group.ending {
            Ending::Simulate {
                estimate: Some(micros),
            } => micros,
            _ => nccl_sys::NCCL_UNDEF_FLOAT,
        };
        if !(micros >= 0.0 && micros.is_finite()) {
            return Err(Error::Unavailable {
                api: calls::ncclGroupSimulateEnd.name,
                reason: format!(
                    "NCCL gave no estimate ({micros}): the simulated group held no collective \
                     it planned"
                ),
            });
        }
        Ok(Duration::from_secs_f64(f64::from(micros) * 1e-6))
    }

    /// The number of buffers the simulation holds borrowed.
    pub fn buffer_count(&self) -> usize {
        self.group.buffer_count()
    }
}

/// Whether NCCL can simulate an operation of `kind` on a communicator that is `blocking`
/// and has `size` ranks, without running it or leaving it queued.
fn check_simulable(kind: Kind, blocking: bool, size: usize) -> Result<()> {
    let why = match kind {
        Kind::Send { .. }
        | Kind::Recv { .. }
        | Kind::AllToAll
        | Kind::Gather { .. }
        | Kind::Scatter { .. } => {
            "NCCL queues point-to-point transfers (and the all-to-all, gather and scatter built \
             from them) per peer until a launch, so a simulated one would stay queued"
        }
        _ if !blocking => {
            "NCCL ends a nonblocking communicator's group on a thread that launches it"
        }
        _ if size < 2 => "NCCL runs a one-rank collective at once, as a copy, when it is enqueued",
        _ => return Ok(()),
    };
    Err(Error::invalid(format!(
        "{} cannot be simulated: {why}",
        kind.call().name
    )))
}

/// The first NCCL whose broadcasts from several roots become one all-gather-v.
const BROADCASTS_AS_ALL_GATHER_V_SINCE: Version = Version::new(2, 29, 0);

/// The root of the broadcasts already simulated on the communicator `comm_id`, if any.
fn first_root(roots: &[(usize, usize)], comm_id: usize) -> Option<usize> {
    roots
        .iter()
        .find(|&&(id, _)| id == comm_id)
        .map(|&(_, root)| root)
}

/// Whether a broadcast from `root` may join a simulation whose earlier broadcasts on the same
/// communicator came from `first` (none: it is the first), with NCCL `version` loaded.
///
/// From NCCL 2.29 on (`collTaskAppend`, `src/enqueue.cc`), broadcasts wait in per-root queues
/// of the communicator's planner (`bcastQueue`), which outlive a group: when a group holds
/// broadcasts from exactly one root, planning moves them into the ordinary collective list
/// (`ncclPrepareTasks`), which every group starts afresh, so a simulation leaves nothing;
/// from several roots they stay queued to run as one all-gather-v, which only a launch
/// empties. A simulation leaves them there: the next real group of that communicator runs
/// the stale broadcast into the simulation's (by then released) receive buffer, and a
/// broadcast of that group waits for a later one. Refused whatever `NCCL_ALLGATHERV_ENABLE`
/// says (NCCL also reads it from its configuration files, which this crate cannot see).
fn check_broadcast_root(first: Option<usize>, root: usize, version: Version) -> Result<()> {
    match first {
        Some(first) if first != root && version >= BROADCASTS_AS_ALL_GATHER_V_SINCE => {
            Err(Error::invalid(format!(
                "ncclBroadcast from root {root} cannot be simulated beside the broadcasts from \
                 root {first} on the same communicator: NCCL {version} queues broadcasts from \
                 several roots as one all-gather-v that only a launch runs, so a simulated one \
                 would run, stale, in the communicator's next group; simulate each root's \
                 broadcasts in a simulation of their own"
            )))
        }
        _ => Ok(()),
    }
}

/// The blocking v-collective: its NCCL calls are issued in a group of their own, which is why
/// it lives here rather than with the operation it runs.
impl Comm {
    /// Runs `call` on the communicator's stream: its NCCL calls are issued in one group of
    /// their own (after the checked mode's exchange, if asked for).
    pub fn enqueue_v<T: NcclType>(&self, call: VOperation<'_, T>) -> Result<()> {
        self.enqueue_v_on(self.stream(), call)
    }

    /// Runs `call` on `stream` (in the communicator's CUDA context) instead of the
    /// communicator's own stream; `stream` is then noted as for [`Comm::enqueue_on`].
    pub fn enqueue_v_on<T: NcclType>(
        &self,
        stream: &CudaStream,
        mut call: VOperation<'_, T>,
    ) -> Result<()> {
        thread_group::ensure_outside(call.kind.name())?;
        if let Some(timeout) = call.check.take() {
            verify_counts(self, stream, &call, timeout)?;
        }
        let mut group = Group::start()?;
        group.enqueue_v_on(self, stream, call)?;
        group.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(event: bool, cga_cluster_size: Option<u32>) -> ConfigKey {
        ConfigKey {
            event,
            cga_cluster_size,
        }
    }

    fn refused(configs: &GroupConfigs, comm: usize, config: ConfigKey) -> String {
        match configs.check(comm, 3, config) {
            Err(Error::InvalidArgument(text)) => text,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn one_kernel_started_event_per_communicator() {
        let mut configs = GroupConfigs::default();
        let (a, b) = (0x1000, 0x2000);
        assert!(configs.check(a, 0, key(true, None)).is_ok());
        configs.record(a, key(true, None));
        // A second event on the same communicator is refused ...
        let text = refused(&configs, a, key(true, None));
        assert!(
            text.contains("rank 3") && text.contains("one per communicator"),
            "{text}"
        );
        // ... while configurations without one, and events on other communicators, pass.
        assert!(configs.check(a, 0, key(false, None)).is_ok());
        assert!(configs.check(b, 0, key(true, None)).is_ok());
        configs.record(b, key(true, None));
        assert!(configs.check(b, 0, key(true, None)).is_err());
    }

    #[test]
    fn cga_cluster_sizes_agree_within_a_group() {
        let mut configs = GroupConfigs::default();
        configs.record(1, key(false, None));
        assert!(configs.check(1, 0, key(false, Some(2))).is_ok());
        configs.record(1, key(false, Some(2)));
        assert!(configs.check(2, 0, key(false, Some(2))).is_ok());
        assert!(configs.check(2, 0, key(false, None)).is_ok());
        let text = refused(&configs, 2, key(false, Some(4)));
        assert!(
            text.contains("cgaClusterSize 4 differs from the 2"),
            "{text}"
        );
        // The first explicit size stays the reference.
        configs.record(2, key(false, Some(2)));
        assert_eq!(configs.cga_cluster_size, Some(2));
    }

    #[test]
    fn broadcasts_from_a_second_root_are_not_simulated_from_nccl_2_29() {
        let (v228, v229) = (Version::new(2, 28, 9), Version::new(2, 29, 2));
        // The first root, and more broadcasts from it, pass everywhere.
        assert!(check_broadcast_root(None, 1, v229).is_ok());
        assert!(check_broadcast_root(Some(1), 1, v229).is_ok());
        // Before 2.29 broadcasts are ordinary collectives: any root.
        assert!(check_broadcast_root(Some(0), 1, v228).is_ok());
        let text = check_broadcast_root(Some(0), 1, v229)
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("root 1") && text.contains("root 0") && text.contains("2.29.2"),
            "{text}"
        );
        // The roots are kept per communicator.
        let roots = [(0x10, 0), (0x20, 3)];
        assert_eq!(first_root(&roots, 0x10), Some(0));
        assert_eq!(first_root(&roots, 0x20), Some(3));
        assert_eq!(first_root(&roots, 0x30), None);
    }

    #[test]
    fn only_collectives_of_blocking_multi_rank_communicators_simulate() {
        for kind in [
            Kind::AllReduce,
            Kind::Broadcast { root: 1 },
            Kind::Reduce { root: 0 },
            Kind::AllGather,
            Kind::ReduceScatter,
        ] {
            assert!(check_simulable(kind, true, 2).is_ok(), "{kind:?}");
            let text = match check_simulable(kind, false, 2) {
                Err(Error::InvalidArgument(text)) => text,
                other => panic!("{other:?}"),
            };
            assert!(text.contains("nonblocking"), "{text}");
            let text = check_simulable(kind, true, 1).unwrap_err().to_string();
            assert!(text.contains("one-rank"), "{text}");
        }
        for kind in [
            Kind::Send { peer: 1 },
            Kind::Recv { peer: 0 },
            Kind::AllToAll,
            Kind::Gather { root: 0 },
            Kind::Scatter { root: 0 },
        ] {
            let text = check_simulable(kind, true, 4).unwrap_err().to_string();
            assert!(text.contains("point-to-point"), "{kind:?}: {text}");
            assert!(text.contains(kind.call().name), "{text}");
        }
    }
}
