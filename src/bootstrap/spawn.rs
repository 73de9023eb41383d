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
use super::util::{io_error, lookup, process_var, random_u64};
use super::{
    exchange_id_with, timeout_from, vars, BootstrapError, Exchange, Launch, Launcher, Result,
    TcpRendezvous,
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
/// Supervision: if a child fails (non-zero exit or signal), the others are killed. If rank 0
/// is in [`LocalJob::wait`] by then, `wait` returns [`BootstrapError::ChildFailed`];
/// otherwise rank 0 would block forever in NCCL calls waiting for the dead rank, so the
/// supervisor prints the failure to stderr and exits this process with the child's exit code
/// (128 + signal when it was killed). Dropping the job without `wait` kills the children.
/// The children stay in this process's process group, so Ctrl-C in a terminal stops them all;
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
///     // ... Comm::init_rank(id, launch.rank, launch.world_size) on GPU launch.local_rank ...
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
                for (_, mut child) in children {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(io_error(
                    format!("starting rank {rank} ({})", exe.display()),
                    e,
                ));
            }
        }
    }

    let launch = Launch {
        rank: 0,
        world_size: ranks,
        local_rank: 0,
        local_world_size: Some(ranks),
        launcher: Launcher::None,
    };
    let rendezvous = TcpRendezvous::new(addr, 0, ranks)
        .with_job_key(job_key)
        .with_timeout(timeout)
        .with_prebound(listener);
    Ok(LocalJob {
        #[cfg(feature = "mpi")]
        mpi: None,
        launch,
        exchange: Exchange::Tcp(rendezvous),
        supervisor: Some(Supervisor::start(children)),
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

    /// Exchanges the unique id among the job's ranks; rank 0 creates it with
    /// [`UniqueId::new`].
    pub fn exchange_id(&self) -> crate::Result<UniqueId> {
        self.exchange_id_with(UniqueId::new)
    }

    /// Exchanges the unique id among the job's ranks; rank 0 creates it by calling `make_id`.
    pub fn exchange_id_with(
        &self,
        make_id: impl FnOnce() -> crate::Result<UniqueId>,
    ) -> crate::Result<UniqueId> {
        #[cfg(feature = "mpi")]
        if let Some(universe) = &self.mpi {
            return super::mpi::exchange_id_mpi_with(&universe.0.world(), make_id);
        }
        exchange_id_with(&self.launch, self.exchange.clone(), make_id)
    }

    /// Whether the id is exchanged over MPI (feature `mpi`, under an MPI launcher).
    pub fn uses_mpi(&self) -> bool {
        #[cfg(feature = "mpi")]
        if self.mpi.is_some() {
            return true;
        }
        false
    }

    /// The common case in one call: picks this rank's GPU from its local rank, takes that
    /// GPU's default stream, exchanges the unique id and joins the communicator.
    ///
    /// The default stream is deliberate: while a CUDA context has no stream of its own,
    /// cudarc keeps no per-buffer events, so handing buffers to NCCL costs nothing. A program
    /// that creates more streams (say, to overlap communication with compute) switches
    /// cudarc's event tracking on for the whole context; it can join on a stream of its own
    /// with [`LocalJob::init_comm_on`].
    pub fn init_comm(&self) -> crate::Result<(Comm, Arc<CudaStream>)> {
        init_comm(&self.launch, || self.exchange_id())
    }

    /// The CUDA device of this rank: its local rank, which must be below the number of
    /// visible GPUs.
    pub fn device(&self) -> crate::Result<usize> {
        let gpus = crate::library::cuda_device_count()?;
        Ok(self.launch.device_ordinal(gpus)?)
    }

    /// Like [`LocalJob::init_comm`], on a stream the caller chose. The stream must be on
    /// [`LocalJob::device`].
    pub fn init_comm_on(&self, stream: Arc<CudaStream>) -> crate::Result<Comm> {
        join_on(&self.launch, stream, || self.exchange_id())
    }

    /// On the spawning process: waits for every spawned rank to exit, and fails with
    /// [`BootstrapError::ChildFailed`] for the first one that failed (the others were killed
    /// then). Elsewhere returns at once.
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

#[derive(Debug)]
struct Failure {
    rank: usize,
    pid: u32,
    status: ExitStatus,
}

impl Failure {
    fn into_error(self) -> BootstrapError {
        BootstrapError::ChildFailed {
            rank: self.rank,
            pid: self.pid,
            exit_code: exit_code(&self.status),
            status: self.status,
        }
    }
}

#[derive(Debug, Default)]
struct SupervisorState {
    /// Rank 0 is blocked in `wait` and will report a failure itself.
    parent_waiting: bool,
    /// Rank 0 dropped the job: kill everything.
    stop_requested: bool,
    all_exited: bool,
    failure: Option<Failure>,
}

#[derive(Debug, Default)]
struct SupervisorShared {
    state: Mutex<SupervisorState>,
    changed: Condvar,
}

impl SupervisorShared {
    fn lock(&self) -> MutexGuard<'_, SupervisorState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
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
    fn start(children: Vec<(usize, Child)>) -> Self {
        let shared = Arc::new(SupervisorShared::default());
        let count = children.len();
        let watcher = Arc::clone(&shared);
        let spawned = thread::Builder::new()
            .name("nccl-rs-local-ranks".to_owned())
            .spawn(move || supervise(&watcher, children));
        let thread = match spawned {
            Ok(handle) => Some(handle),
            Err(_) => {
                // Without a watcher nobody would reap or kill the children; say so, and let
                // `wait` return at once rather than hang.
                eprintln!("nccl-rs: could not start the thread supervising the local ranks");
                shared.lock().all_exited = true;
                None
            }
        };
        Supervisor {
            shared,
            thread,
            count,
        }
    }

    fn wait(mut self) -> Result<()> {
        let failure = {
            let mut state = self.shared.lock();
            state.parent_waiting = true;
            while !state.all_exited {
                state = self
                    .shared
                    .changed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
            }
            state.failure.take()
        };
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        failure.map_or(Ok(()), |failure| Err(failure.into_error()))
    }

    fn stop(mut self) {
        self.shared.lock().stop_requested = true;
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn kill_all(children: &mut Vec<(usize, Child)>) {
    for (_, child) in children.iter_mut() {
        let _ = child.kill();
    }
    for (_, child) in children.iter_mut() {
        let _ = child.wait();
    }
    children.clear();
}

fn supervise(shared: &SupervisorShared, mut children: Vec<(usize, Child)>) {
    let mut failure: Option<Failure> = None;
    loop {
        let mut index = 0;
        while index < children.len() {
            let (rank, child) = &mut children[index];
            let status = match child.try_wait() {
                Ok(Some(status)) => Some(status),
                Ok(None) => None,
                // The child can no longer be watched: stop it rather than lose track of it.
                Err(_) => {
                    let _ = child.kill();
                    child.wait().ok()
                }
            };
            match status {
                Some(status) => {
                    if !status.success() && failure.is_none() {
                        failure = Some(Failure {
                            rank: *rank,
                            pid: child.id(),
                            status,
                        });
                    }
                    children.swap_remove(index);
                }
                None => index += 1,
            }
        }
        let stop_requested = shared.lock().stop_requested;
        if failure.is_some() || stop_requested {
            kill_all(&mut children);
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

    let mut state = shared.lock();
    state.all_exited = true;
    let parent_waiting = state.parent_waiting;
    let stop_requested = state.stop_requested;
    if let Some(failure) = failure {
        if !parent_waiting && !stop_requested {
            // Rank 0 is still working and would wait forever on the dead rank in NCCL.
            let code = exit_code(&failure.status);
            eprintln!(
                "nccl-rs: local rank {} (pid {}) failed ({}); stopped the other ranks, exiting \
                 with code {code}",
                failure.rank, failure.pid, failure.status
            );
            std::process::exit(code);
        }
        state.failure = Some(failure);
    }
    drop(state);
    shared.changed.notify_all();
}

/// Joins the communicator described by `launch` on the GPU of its local rank.
pub(crate) fn init_comm(
    launch: &Launch,
    exchange: impl FnOnce() -> crate::Result<UniqueId>,
) -> crate::Result<(Comm, Arc<CudaStream>)> {
    let gpus = crate::library::cuda_device_count()?;
    let device = launch.device_ordinal(gpus)?;
    // The default stream: see `LocalJob::init_comm`.
    let stream = CudaContext::new(device)?.default_stream();
    let comm = join_on(launch, stream.clone(), exchange)?;
    Ok((comm, stream))
}

/// Joins the communicator described by `launch` on `stream`, which must be on the GPU of
/// its local rank.
fn join_on(
    launch: &Launch,
    stream: Arc<CudaStream>,
    exchange: impl FnOnce() -> crate::Result<UniqueId>,
) -> crate::Result<Comm> {
    let device = launch.device_ordinal(crate::library::cuda_device_count()?)?;
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
    /// picks the GPU of the local rank, takes its default stream (see
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
