//! One process per GPU on a single machine, without a launcher.

use cudarc::driver::{CudaContext, CudaStream};

use crate::comm::Comm;
use std::ffi::OsString;
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use super::launch::LAUNCHER_VAR;
use super::util::{io_error, lookup, process_var, random_u64, Interrupt};
use super::{
    exchange_id_with, timeout_from, vars, BootstrapError, ChildExit, Exchange, Launch, Launcher,
    Result, TcpRendezvous,
};
use crate::UniqueId;

/// How often the supervisor looks at the children.
const SUPERVISION_PERIOD: Duration = Duration::from_millis(20);

/// Makes this program a job of `world_size` ranks on this machine, unless a launcher already
/// started several ranks.
///
/// * When [`Launch::from_env`] finds a job of more than one rank, nothing is spawned: the
///   returned job describes that rank. This includes the ranks started here, which find the
///   variables this function sets for them.
/// * Otherwise (no launcher, or a launcher that started this process alone, like
///   `srun -n 1`), `NCCL_RS_LOCAL_RANKS`, when set, replaces `world_size` (e.g. `1` to debug a
///   single rank). With one rank nothing is spawned. With more, this process becomes rank 0
///   and re-executes [`std::env::current_exe`] with the same arguments for ranks
///   `1..world_size`, setting `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
///   `NCCL_RS_LAUNCHER=torchrun`, `NCCL_RS_ADDR=127.0.0.1:<port>` (a port this process already
///   listens on) and a fresh random `NCCL_RS_JOB_KEY`. The children share this process's
///   stdout and stderr (their lines interleave) and get no stdin.
///
/// Call it first thing in `main`, before any other work, with the number of GPUs to use: the
/// children run `main` again from the start. Then exchange the id with
/// [`LocalJob::exchange_id`] (which knows the rendezvous this function set up) and finish with
/// [`LocalJob::wait`].
///
/// # When a rank fails
///
/// A background thread of this process watches the ranks it started. When one fails
/// (non-zero exit or a signal), it stops (kills) the others, which would otherwise wait
/// forever for the dead rank in NCCL, and records the failure; this process is never ended
/// for it. The program learns of it from:
///
/// * [`LocalJob::exchange_id`] and [`LocalJob::init_comm`], which fail with
///   [`BootstrapError::ChildFailed`] instead of waiting for the dead rank;
/// * [`LocalJob::failure`], a query to call between steps;
/// * [`LocalJob::on_failure`], a hook run on the watching thread as soon as a rank fails,
///   e.g. to abort rank 0's nonblocking communicators with an
///   [`AbortHandle`](crate::AbortHandle), so that calls blocked on the dead rank return;
/// * [`LocalJob::wait`], which fails with [`BootstrapError::ChildFailed`].
///
/// A blocking communicator cannot be aborted from another thread: a rank 0 that waits on one
/// for a dead rank (e.g. in a stream synchronisation after a collective) stays blocked unless
/// the hook ends the process itself, as in
/// `job.on_failure(|e| { eprintln!("{e}"); std::process::exit(1) })`.
///
/// Dropping the job without [`LocalJob::wait`] stops and reaps the ranks it started. The
/// children stay in this process's process group, so Ctrl-C in a terminal stops them all;
/// if rank 0 alone is killed outright (`SIGKILL`), the children are not, and end at their own
/// rendezvous timeout or NCCL error.
///
/// ```no_run
/// use nccl::bootstrap::spawn_local;
///
/// fn main() -> nccl::Result<()> {
///     let gpus = 4; // e.g. the CUDA device count
///     let job = spawn_local(gpus)?;
///     let launch = job.launch().clone();
///     let id = job.exchange_id()?;
///     println!("rank {} of {} has id {:?}", launch.rank, launch.world_size, id);
///     // ... Comm::init_rank(id, launch.rank, launch.world_size) on GPU job.device()? ...
///     job.wait()?;
///     Ok(())
/// }
/// ```
pub fn spawn_local(world_size: usize) -> Result<LocalJob> {
    let launch = Launch::from_env()?;
    if launch.world_size > 1 {
        return Ok(LocalJob::unsupervised(launch));
    }
    let ranks = match lookup(&process_var, vars::LOCAL_RANKS) {
        Some(text) => match text.trim().parse::<usize>() {
            Ok(ranks) if ranks >= 1 => ranks,
            _ => {
                return Err(BootstrapError::Env {
                    var: vars::LOCAL_RANKS.to_owned(),
                    value: text,
                    reason: "expected a number of ranks, at least 1".to_owned(),
                })
            }
        },
        None => world_size,
    };
    match ranks {
        0 => Err(BootstrapError::Config(
            "spawn_local needs at least one rank (no GPU visible?)".to_owned(),
        )),
        1 => Ok(LocalJob::unsupervised(launch)),
        _ => spawn_children(ranks),
    }
}

fn spawn_children(ranks: usize) -> Result<LocalJob> {
    // Bind before the children learn the port, so nothing else can take it in between.
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| io_error("binding a rendezvous port on 127.0.0.1", e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| io_error("reading the rendezvous port", e))?
        .to_string();
    let job_key = format!("local-{}-{:016x}", std::process::id(), random_u64());
    let timeout = timeout_from(&process_var)?;
    let exe = std::env::current_exe().map_err(|e| {
        io_error(
            "finding this program's executable to start the other ranks",
            e,
        )
    })?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();

    let mut children: Vec<(usize, Child)> = Vec::with_capacity(ranks - 1);
    for rank in 1..ranks {
        let spawned = Command::new(&exe)
            .args(&args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", ranks.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", ranks.to_string())
            .env(LAUNCHER_VAR, "torchrun")
            .env(vars::ADDR, &addr)
            .env(vars::JOB_KEY, &job_key)
            .stdin(Stdio::null())
            .spawn();
        match spawned {
            Ok(child) => children.push((rank, child)),
            Err(e) => {
                stop_all(&mut children);
                return Err(io_error(
                    format!("starting rank {rank} ({})", exe.display()),
                    e,
                ));
            }
        }
    }

    let supervisor = Supervisor::start(children)?;
    let launch = Launch {
        rank: 0,
        world_size: ranks,
        local_rank: 0,
        local_world_size: Some(ranks),
        launcher: Launcher::None,
    };
    let watched = Arc::clone(&supervisor.shared);
    let rendezvous = TcpRendezvous::new(addr, 0, ranks)
        .with_job_key(job_key)
        .with_timeout(timeout)
        .with_prebound(listener)
        .with_interrupt(Interrupt::new(move || watched.failure()));
    Ok(LocalJob {
        #[cfg(feature = "mpi")]
        mpi: None,
        launch,
        exchange: Exchange::Tcp(rendezvous),
        supervisor: Some(supervisor),
    })
}

/// This process's place in a job set up by [`spawn_local`].
#[derive(Debug)]
pub struct LocalJob {
    launch: Launch,
    exchange: Exchange,
    /// Present on the process that spawned the other ranks.
    supervisor: Option<Supervisor>,
    /// With the `mpi` feature, under an MPI launcher: MPI, initialised for the id broadcast
    /// and finalised when the job is dropped.
    #[cfg(feature = "mpi")]
    mpi: Option<MpiUniverse>,
}

/// MPI's universe, kept alive (MPI initialised) as long as the job.
#[cfg(feature = "mpi")]
struct MpiUniverse(::mpi::environment::Universe);

#[cfg(feature = "mpi")]
impl std::fmt::Debug for MpiUniverse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MpiUniverse")
    }
}

impl LocalJob {
    fn unsupervised(launch: Launch) -> Self {
        // With the `mpi` feature, a job started by an MPI launcher broadcasts the id over MPI
        // (`MPI_Init` happens here, once; `None` if the program already initialised MPI).
        #[cfg(feature = "mpi")]
        let mpi = match launch.launcher {
            Launcher::OpenMpi | Launcher::MpichOrPmi | Launcher::Pmix => {
                ::mpi::initialize().map(MpiUniverse)
            }
            _ => None,
        };
        LocalJob {
            launch,
            exchange: Exchange::Auto,
            supervisor: None,
            #[cfg(feature = "mpi")]
            mpi,
        }
    }

    /// This process's rank, world size and local rank.
    pub fn launch(&self) -> &Launch {
        &self.launch
    }

    /// How this process must exchange the unique id: the TCP rendezvous set up for the spawned
    /// ranks on the spawning process, [`Exchange::Auto`] everywhere else.
    pub fn exchange(&self) -> Exchange {
        self.exchange.clone()
    }

    /// The number of ranks this process started (0 unless it is the spawning rank 0).
    pub fn spawned(&self) -> usize {
        self.supervisor.as_ref().map_or(0, |s| s.count)
    }

    /// On the spawning process, once a rank it started has failed:
    /// [`BootstrapError::ChildFailed`] naming it (and any other rank that failed on its own
    /// before it could be stopped). `None` while all is well, and always on the other ranks.
    ///
    /// Does not block: call it between steps to notice a failure early.
    pub fn failure(&self) -> Option<BootstrapError> {
        self.supervisor.as_ref().and_then(|s| s.shared.failure())
    }

    /// Runs `hook` once, on the thread watching the spawned ranks, as soon as one of them
    /// fails, with the error [`LocalJob::failure`] returns then; at once, on this thread, if
    /// one has already failed. Hooks run in the order they were added; a hook that panics is
    /// contained (the others still run).
    ///
    /// Use it to unblock rank 0, e.g. by aborting its nonblocking communicators:
    ///
    /// ```no_run
    /// use nccl::{bootstrap::LocalJob, Comm};
    ///
    /// fn abort_when_a_rank_fails(job: &LocalJob, comm: &Comm) -> nccl::Result<()> {
    ///     let abort = comm.abort_handle()?; // a nonblocking communicator
    ///     job.on_failure(move |error| {
    ///         eprintln!("{error}; aborting rank {}", abort.rank());
    ///         let _ = abort.abort();
    ///     });
    ///     Ok(())
    /// }
    /// ```
    ///
    /// Never runs on a process that spawned no ranks (there, the launcher watches the job).
    pub fn on_failure(&self, hook: impl FnOnce(&BootstrapError) + Send + 'static) {
        if let Some(supervisor) = &self.supervisor {
            supervisor.shared.add_hook(Box::new(hook));
        }
    }

    /// Exchanges the unique id among the job's ranks; rank 0 creates it with
    /// [`UniqueId::new`].
    pub fn exchange_id(&self) -> crate::Result<UniqueId> {
        self.exchange_id_with(UniqueId::new)
    }

    /// Exchanges the unique id among the job's ranks; rank 0 creates it by calling `make_id`.
    ///
    /// On the spawning process this fails with [`BootstrapError::ChildFailed`] as soon as a
    /// spawned rank fails, instead of waiting for it.
    pub fn exchange_id_with(
        &self,
        make_id: impl FnOnce() -> crate::Result<UniqueId>,
    ) -> crate::Result<UniqueId> {
        self.fail_if_a_rank_failed()?;
        #[cfg(feature = "mpi")]
        if let Some(universe) = &self.mpi {
            return super::mpi::exchange_id_mpi_with(&universe.0.world(), make_id);
        }
        exchange_id_with(&self.launch, self.exchange.clone(), make_id)
    }

    fn fail_if_a_rank_failed(&self) -> Result<()> {
        self.failure().map_or(Ok(()), Err)
    }

    /// Whether the id is exchanged over MPI (feature `mpi`, under an MPI launcher).
    pub fn uses_mpi(&self) -> bool {
        #[cfg(feature = "mpi")]
        if self.mpi.is_some() {
            return true;
        }
        false
    }

    /// The common case in one call: picks this rank's GPU ([`LocalJob::device`]), takes
    /// that GPU's default stream, exchanges the unique id and joins the communicator.
    ///
    /// The default stream is deliberate: while a CUDA context has no stream of its own,
    /// cudarc keeps no per-buffer events, so handing buffers to NCCL costs nothing. A program
    /// that creates more streams (say, to overlap communication with compute) switches
    /// cudarc's event tracking on for the whole context; it can join on a stream of its own
    /// with [`LocalJob::init_comm_on`].
    pub fn init_comm(&self) -> crate::Result<(Comm, Arc<CudaStream>)> {
        init_comm(&self.launch, || self.exchange_checked())
    }

    /// The CUDA device of this rank, from the GPUs this process sees: the only one when it
    /// sees one, else its local rank ([`Launch::device_ordinal`] has the rule).
    pub fn device(&self) -> crate::Result<usize> {
        device_of(&self.launch)
    }

    /// Like [`LocalJob::init_comm`], on a stream the caller chose. The stream must be on
    /// [`LocalJob::device`].
    pub fn init_comm_on(&self, stream: Arc<CudaStream>) -> crate::Result<Comm> {
        join_on(&self.launch, stream, || self.exchange_checked())
    }

    /// Exchanges the id, then makes sure no spawned rank failed meanwhile: joining waits for
    /// every rank, and a blocking join cannot be interrupted.
    fn exchange_checked(&self) -> crate::Result<UniqueId> {
        let id = self.exchange_id()?;
        self.fail_if_a_rank_failed()?;
        Ok(id)
    }

    /// On the spawning process: waits for every spawned rank to exit, and fails with
    /// [`BootstrapError::ChildFailed`] if one failed (the others were stopped then).
    /// Elsewhere returns at once.
    pub fn wait(mut self) -> Result<()> {
        match self.supervisor.take() {
            Some(supervisor) => supervisor.wait(),
            None => Ok(()),
        }
    }
}

impl Drop for LocalJob {
    fn drop(&mut self) {
        if let Some(supervisor) = self.supervisor.take() {
            supervisor.stop();
        }
    }
}

/// The exit code that reports `status` to a shell: the child's own code, or 128 + signal.
pub(crate) fn exit_code(status: &ExitStatus) -> i32 {
    if let Some(code) = status.code() {
        return code;
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            return 128 + signal;
        }
    }
    1
}

/// Whether `status` is that of a process ended by our own kill (`SIGKILL`).
fn ended_by_kill(status: &ExitStatus) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        status.signal() == Some(9)
    }
    #[cfg(not(unix))]
    {
        let _ = status;
        true
    }
}

/// The error for the failed ranks, first failure first.
fn child_failed(failed: &[ChildExit]) -> Option<BootstrapError> {
    let (first, others) = failed.split_first()?;
    Some(BootstrapError::ChildFailed {
        rank: first.rank,
        pid: first.pid,
        status: first.status,
        exit_code: exit_code(&first.status),
        also_failed: others.to_vec(),
    })
}

/// A hook of [`LocalJob::on_failure`].
type Hook = Box<dyn FnOnce(&BootstrapError) + Send>;

#[derive(Default)]
struct SupervisorState {
    /// Rank 0 dropped the job: stop everything.
    stop_requested: bool,
    all_exited: bool,
    /// Ranks that failed on their own, in the order they were seen to end.
    failed: Vec<ChildExit>,
    /// Hooks still to run at the first failure.
    hooks: Vec<Hook>,
}

#[derive(Default)]
struct SupervisorShared {
    state: Mutex<SupervisorState>,
    changed: Condvar,
}

impl SupervisorShared {
    fn lock(&self) -> MutexGuard<'_, SupervisorState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn failure(&self) -> Option<BootstrapError> {
        child_failed(&self.lock().failed)
    }

    fn add_hook(&self, hook: Hook) {
        let mut state = self.lock();
        match child_failed(&state.failed) {
            Some(error) => {
                drop(state);
                run_hooks(vec![hook], &error);
            }
            None => state.hooks.push(hook),
        }
    }

    /// Records ranks that failed; at the first failure, runs the hooks.
    fn record_failures(&self, failed: Vec<ChildExit>) {
        if failed.is_empty() {
            return;
        }
        let mut state = self.lock();
        let first = state.failed.is_empty();
        state.failed.extend(failed);
        let hooks = std::mem::take(&mut state.hooks);
        let error = child_failed(&state.failed);
        drop(state);
        self.changed.notify_all();
        if let (true, Some(error)) = (first, error) {
            run_hooks(hooks, &error);
        }
    }
}

/// Runs failure hooks, containing their panics: the watching thread must go on to reap the
/// ranks.
fn run_hooks(hooks: Vec<Hook>, error: &BootstrapError) {
    for hook in hooks {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| hook(error)));
    }
}

impl std::fmt::Debug for SupervisorShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.lock();
        f.debug_struct("SupervisorShared")
            .field("failed", &state.failed)
            .field("all_exited", &state.all_exited)
            .finish_non_exhaustive()
    }
}

/// Watches the spawned ranks from a background thread.
#[derive(Debug)]
struct Supervisor {
    shared: Arc<SupervisorShared>,
    thread: Option<JoinHandle<()>>,
    count: usize,
}

impl Supervisor {
    /// Starts watching `children`; if no thread can be started, stops them and fails.
    fn start(children: Vec<(usize, Child)>) -> Result<Self> {
        let shared = Arc::new(SupervisorShared::default());
        let count = children.len();
        let watcher = Arc::clone(&shared);
        // The children move into the thread only once it runs; keep them here until then.
        let handoff = Arc::new(Mutex::new(Some(children)));
        let taken = Arc::clone(&handoff);
        let spawned = thread::Builder::new()
            .name("nccl-rs-local-ranks".to_owned())
            .spawn(move || {
                let children = taken
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take()
                    .unwrap_or_default();
                supervise(&watcher, children);
            });
        match spawned {
            Ok(thread) => Ok(Supervisor {
                shared,
                thread: Some(thread),
                count,
            }),
            Err(e) => {
                let mut children = handoff
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .take()
                    .unwrap_or_default();
                stop_all(&mut children);
                Err(io_error(
                    "starting the thread that watches the local ranks",
                    e,
                ))
            }
        }
    }

    fn wait(mut self) -> Result<()> {
        {
            let mut state = self.shared.lock();
            while !state.all_exited {
                state = self
                    .shared
                    .changed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
        self.join();
        self.shared.failure().map_or(Ok(()), Err)
    }

    fn stop(mut self) {
        self.shared.lock().stop_requested = true;
        self.shared.changed.notify_all();
        self.join();
    }

    fn join(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Kills every child and reaps it; returns the exits that were failures of their own (a
/// child that ended unsuccessfully before the kill reached it).
fn stop_all(children: &mut Vec<(usize, Child)>) -> Vec<ChildExit> {
    for (_, child) in children.iter_mut() {
        let _ = child.kill();
    }
    let mut failed = Vec::new();
    for (rank, mut child) in children.drain(..) {
        if let Ok(status) = child.wait() {
            if !status.success() && !ended_by_kill(&status) {
                failed.push(ChildExit {
                    rank,
                    pid: child.id(),
                    status,
                });
            }
        }
    }
    failed
}

/// Reaps the children that have exited; returns those that failed.
fn reap_exited(children: &mut Vec<(usize, Child)>) -> Vec<ChildExit> {
    let mut failed = Vec::new();
    let mut index = 0;
    while index < children.len() {
        let (rank, child) = &mut children[index];
        let status = match child.try_wait() {
            Ok(status) => status,
            // The child can no longer be watched: stop it rather than lose track of it.
            Err(_) => {
                let _ = child.kill();
                child.wait().ok()
            }
        };
        let Some(status) = status else {
            index += 1;
            continue;
        };
        if !status.success() {
            failed.push(ChildExit {
                rank: *rank,
                pid: child.id(),
                status,
            });
        }
        children.swap_remove(index);
    }
    failed
}

/// The watching thread: reaps children as they exit; at the first failure, records it, runs
/// the hooks and stops the others; at rank 0's request, stops them all.
fn supervise(shared: &SupervisorShared, mut children: Vec<(usize, Child)>) {
    while !children.is_empty() {
        let failed = reap_exited(&mut children);
        let failing = !failed.is_empty();
        shared.record_failures(failed);
        if failing {
            shared.record_failures(stop_all(&mut children));
        }
        if shared.lock().stop_requested {
            stop_all(&mut children);
        }
        if children.is_empty() {
            break;
        }
        // Sleep until the next look, waking early when rank 0 drops the job.
        let state = shared.lock();
        if !state.stop_requested {
            let _ = shared
                .changed
                .wait_timeout(state, SUPERVISION_PERIOD)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }
    shared.lock().all_exited = true;
    shared.changed.notify_all();
}

/// The GPU of the rank `launch` describes, from the GPUs this process sees.
fn device_of(launch: &Launch) -> crate::Result<usize> {
    let visible = crate::library::cuda_device_count()?;
    Ok(launch.device_ordinal(visible)?)
}

/// Joins the communicator described by `launch` on its GPU ([`device_of`]).
pub(crate) fn init_comm(
    launch: &Launch,
    exchange: impl FnOnce() -> crate::Result<UniqueId>,
) -> crate::Result<(Comm, Arc<CudaStream>)> {
    // The default stream: see `LocalJob::init_comm`.
    let stream = CudaContext::new(device_of(launch)?)?.default_stream();
    let comm = join_on(launch, stream.clone(), exchange)?;
    Ok((comm, stream))
}

/// Joins the communicator described by `launch` on `stream`, which must be on its GPU
/// ([`device_of`]).
fn join_on(
    launch: &Launch,
    stream: Arc<CudaStream>,
    exchange: impl FnOnce() -> crate::Result<UniqueId>,
) -> crate::Result<Comm> {
    let device = device_of(launch)?;
    let on = stream.context().ordinal();
    if on != device {
        return Err(crate::Error::invalid(format!(
            "rank {} runs on device {device}, but the stream is on device {on}",
            launch.rank
        )));
    }
    let id = exchange()?;
    Comm::init_rank(stream, &id, launch.rank, launch.world_size)
}

impl Comm {
    /// The common case in one call, for programs started by a launcher (`mpirun`, `srun`,
    /// torchrun-style): reads rank and size from the environment ([`Launch::from_env`]),
    /// picks its GPU ([`Launch::device_ordinal`]: the only one this process sees, else the
    /// local rank), takes its default stream (see
    /// [`LocalJob::init_comm`] for why), exchanges the unique id
    /// ([`Exchange::Auto`]: TCP when an address is set, else a file on one node) and joins.
    ///
    /// Without a launcher this is a single rank on GPU 0; to start one process per GPU
    /// instead, use [`spawn_local`] and [`LocalJob::init_comm`].
    pub fn from_env() -> crate::Result<(Comm, Arc<CudaStream>)> {
        let launch = Launch::from_env()?;
        init_comm(&launch, || super::exchange_id(&launch, Exchange::Auto))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Child {
        Command::new("sh")
            .args(["-c", script])
            .spawn()
            .expect("spawn sh")
    }

    #[test]
    fn stopping_lists_own_failures_but_not_the_ranks_it_killed() {
        let mut children = vec![
            (1, sh("exit 3")),
            (2, sh("sleep 30")),
            (3, sh("exit 0")),
            (4, sh("exit 5")),
        ];
        // Let the short ones end (unreaped) before the kill.
        thread::sleep(Duration::from_millis(300));
        let failed = stop_all(&mut children);
        assert!(children.is_empty());
        let ranks: Vec<(usize, i32)> = failed
            .iter()
            .map(|exit| (exit.rank, exit_code(&exit.status)))
            .collect();
        assert_eq!(ranks, vec![(1, 3), (4, 5)]);
    }

    #[test]
    fn reaping_reports_failed_children_and_keeps_running_ones() {
        let mut children = vec![(1, sh("exit 4")), (2, sh("sleep 30")), (3, sh("exit 0"))];
        thread::sleep(Duration::from_millis(300));
        let failed = reap_exited(&mut children);
        assert_eq!(failed.len(), 1);
        assert_eq!((failed[0].rank, exit_code(&failed[0].status)), (1, 4));
        assert_eq!(children.len(), 1);
        assert_eq!(children[0].0, 2);
        assert!(stop_all(&mut children).is_empty());
    }

    #[test]
    fn failures_run_hooks_once_and_late_hooks_at_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let shared = SupervisorShared::default();
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&calls);
        shared.add_hook(Box::new(move |error| {
            assert!(error.to_string().contains("local rank 2"), "{error}");
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        shared.add_hook(Box::new(|_| panic!("a panicking hook is contained")));
        assert!(shared.failure().is_none());
        let status = Command::new("sh")
            .args(["-c", "exit 7"])
            .status()
            .expect("sh");
        shared.record_failures(vec![ChildExit {
            rank: 2,
            pid: 1,
            status,
        }]);
        shared.record_failures(vec![ChildExit {
            rank: 1,
            pid: 2,
            status,
        }]);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        let error = shared.failure().expect("failure recorded");
        assert!(
            matches!(
                &error,
                BootstrapError::ChildFailed { rank: 2, exit_code: 7, also_failed, .. }
                    if also_failed.len() == 1 && also_failed[0].rank == 1
            ),
            "{error:?}"
        );
        assert!(
            error.to_string().contains("failed too: local rank 1"),
            "{error}"
        );
        let counter = Arc::clone(&calls);
        shared.add_hook(Box::new(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn exit_codes() {
        let ok = Command::new("sh").args(["-c", "exit 3"]).status();
        if let Ok(status) = ok {
            assert_eq!(exit_code(&status), 3);
        }
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(exit_code(&ExitStatus::from_raw(9)), 128 + 9);
        }
    }
}
