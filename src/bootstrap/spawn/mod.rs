//! One process per GPU on a single machine, without a launcher: [`spawn_local`] and the
//! [`LocalJob`] it returns. The watching of the started ranks is in [`supervisor`].

mod supervisor;

use std::ffi::OsString;
use std::net::{Ipv4Addr, TcpListener};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use cudarc::driver::CudaStream;

use self::supervisor::{stop_all, Supervisor};
use super::env::{lookup, process_var, timeout_from, vars};
use super::ids::id_count_from;
use super::join::{device_of, init_comm, join_on, Sharing};
use super::sharing::GpuSharing;
use super::util::{io_error, random_u64};
use super::{
    exchange_id_with, BootstrapError, Exchange, Launcher, Placement, RendezvousKey, Result,
    TcpRendezvous,
};
use crate::comm::Comm;
use crate::diagnostics::ras::{self, RAS_ADDR_VAR};
use crate::UniqueId;

/// Makes this program a job of `world_size` ranks on this machine, unless a launcher already
/// started several ranks.
///
/// * When [`Placement::from_env`] finds a job of more than one rank, nothing is spawned: the
///   returned job describes that rank. This includes the ranks started here, which find the
///   variables this function sets for them.
/// * Otherwise (no launcher, or a launcher that started this process alone, like
///   `srun -n 1`), `NCCL_RS_LOCAL_RANKS`, when set, replaces `world_size` (e.g. `1` to debug a
///   single rank). With one rank nothing is spawned. With more, this process becomes rank 0
///   and re-executes [`std::env::current_exe`] with the same arguments for ranks
///   `1..world_size`, setting `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
///   `NCCL_RS_LAUNCHER=torchrun`, `NCCL_RS_ADDR=127.0.0.1:<port>` (a port this process already
///   listens on), a fresh random `NCCL_RS_JOB_KEY` and a fresh random
///   `NCCL_RS_RENDEZVOUS_KEY`, so that the id travels encrypted and only these ranks can
///   fetch it (other users' processes on the machine cannot; see
///   [`TcpTransport`](super::TcpTransport)). The children share this process's stdout and
///   stderr (their lines interleave) and get no stdin.
/// * Unless `NCCL_RAS_ADDR` is set, the children also get `NCCL_RAS_ADDR=127.0.0.1:<port>`,
///   a port free when the job starts, so NCCL's RAS of this job listens apart from other
///   jobs on the machine (every NCCL process binds that address with `SO_REUSEPORT`, so
///   jobs sharing one would answer each other's queries; see
///   [`crate::diagnostics::ras`]). This process's own NCCL keeps its address (the crate
///   does not change its environment), but its RAS queries
///   ([`ras::default_addr`](crate::diagnostics::ras::default_addr)) go to the job's.
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
///     let placement = job.placement().clone();
///     let id = job.exchange_id()?;
///     println!("rank {} of {} has id {:?}", placement.rank, placement.world_size, id);
///     // ... Comm::init_rank(id, placement.rank, placement.world_size) on GPU job.device()? ...
///     job.wait()?;
///     Ok(())
/// }
/// ```
pub fn spawn_local(world_size: usize) -> Result<LocalJob> {
    let placement = Placement::from_env()?;
    if placement.world_size > 1 {
        return LocalJob::unsupervised(placement);
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
        1 => LocalJob::unsupervised(placement),
        _ => spawn_children(ranks, sharing_for(ranks)?),
    }
}

/// How `ranks` ranks share this machine's GPUs: not at all when there are enough GPUs (or
/// none is visible: every rank then fails alike when it picks its device), else the shape
/// [`GpuSharing::for_spawn`] picks, checked and announced on standard error, since a job
/// that time-slices one GPU must not be mistaken for a fast one.
fn sharing_for(ranks: usize) -> Result<GpuSharing> {
    let visible = match crate::library::cuda_device_count() {
        Ok(visible) if visible < ranks => visible,
        _ => return Ok(GpuSharing::Off),
    };
    let sharing = GpuSharing::for_spawn(&process_var)?;
    let version = crate::library::get().ok().map(|lib| lib.version());
    sharing.check(ranks, visible, version, &process_var)?;
    eprintln!(
        "nccl-rs: {ranks} ranks on {visible} GPU(s): {}. The ranks time-slice the GPU: for \
         developing and testing, not for speed ({}=hosts|shared|off chooses).",
        sharing.describe(),
        vars::GPU_SHARING
    );
    Ok(sharing)
}

fn spawn_children(ranks: usize, sharing: GpuSharing) -> Result<LocalJob> {
    // Bind before the children learn the port, so nothing else can take it in between.
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(|e| io_error("binding a rendezvous port on 127.0.0.1", e))?;
    let addr = listener
        .local_addr()
        .map_err(|e| io_error("reading the rendezvous port", e))?
        .to_string();
    let job_key = format!("local-{}-{:016x}", std::process::id(), random_u64());
    let timeout = timeout_from(&process_var)?;
    // The children inherit NCCL_RS_UNIQUE_IDS and read it themselves.
    let id_count = id_count_from(&process_var)?;
    // A fresh key per job: whatever NCCL_RS_RENDEZVOUS_KEY this process has is not needed,
    // and a key of our own cannot be one another job shares.
    let (secret, secret_hex) = RendezvousKey::generate_hex()?;
    let ras_addr = job_ras_addr();
    let children = start_ranks(
        ranks,
        &addr,
        &job_key,
        &secret_hex,
        sharing,
        ras_addr.as_deref(),
    )?;
    let supervisor = Supervisor::start(children)?;
    let placement = Placement {
        rank: 0,
        world_size: ranks,
        local_rank: 0,
        local_world_size: Some(ranks),
        launcher: Launcher::None,
    };
    let rendezvous = TcpRendezvous::new(addr, 0, ranks)
        .with_job_key(job_key)
        .with_timeout(timeout)
        .with_id_count(id_count)
        .with_prebound(listener)
        .with_interrupt(supervisor.interrupt())
        .with_secret(secret);
    Ok(LocalJob {
        #[cfg(feature = "mpi")]
        mpi: None,
        placement,
        exchange: Exchange::Tcp(rendezvous),
        supervisor: Some(supervisor),
        sharing: Sharing {
            sharing,
            own_host: true,
        },
    })
}

/// A RAS address of this job's own (see [`spawn_local`]), recorded as this process's
/// default for queries; `None` where `NCCL_RAS_ADDR` is set already, or no port is free.
fn job_ras_addr() -> Option<String> {
    if lookup(&process_var, RAS_ADDR_VAR).is_some() {
        return None;
    }
    // Released at once: NCCL's processes bind it themselves (with SO_REUSEADDR).
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|listener| listener.local_addr())
        .ok()?
        .port();
    let addr = format!("127.0.0.1:{port}");
    ras::set_job_addr(addr.clone());
    Some(addr)
}

/// Re-executes this program as ranks `1..ranks`, told to fetch the id from `addr` under
/// `job_key` with the rendezvous key `secret_hex`, sharing GPUs as `sharing` says, with
/// NCCL's RAS at `ras_addr` where given; if one cannot start, stops those already started.
fn start_ranks(
    ranks: usize,
    addr: &str,
    job_key: &str,
    secret_hex: &str,
    sharing: GpuSharing,
    ras_addr: Option<&str>,
) -> Result<Vec<(usize, Child)>> {
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
            .env(vars::LAUNCHER, "torchrun")
            .env(vars::ADDR, addr)
            .env(vars::JOB_KEY, job_key)
            .env(vars::RENDEZVOUS_KEY, secret_hex)
            .envs(ras_addr.map(|ras| (RAS_ADDR_VAR, ras)))
            .envs(match sharing {
                GpuSharing::Off => Vec::new(),
                shared => shared.child_vars(rank, job_key, &process_var),
            })
            .stdin(Stdio::null())
            .spawn();
        match spawned {
            Ok(child) => children.push((rank, child)),
            Err(e) => {
                stop_all(&mut children);
                let what = format!("starting rank {rank} ({})", exe.display());
                return Err(io_error(what, e));
            }
        }
    }
    Ok(children)
}

/// This process's place in a job set up by [`spawn_local`].
#[derive(Debug)]
pub struct LocalJob {
    placement: Placement,
    exchange: Exchange,
    /// Present on the process that spawned the other ranks.
    supervisor: Option<Supervisor>,
    /// How this rank shares its GPU with others, if it must.
    sharing: Sharing,
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
    fn unsupervised(placement: Placement) -> Result<Self> {
        // With the `mpi` feature, a job started by an MPI launcher broadcasts the id over MPI
        // (`MPI_Init` happens here, once; `None` if the program already initialised MPI).
        #[cfg(feature = "mpi")]
        let mpi = match placement.launcher {
            Launcher::OpenMpi | Launcher::MpichOrPmi | Launcher::Pmix => {
                ::mpi::initialize().map(MpiUniverse)
            }
            _ => None,
        };
        Ok(LocalJob {
            placement,
            exchange: Exchange::Auto,
            supervisor: None,
            sharing: Sharing::from_env()?,
            #[cfg(feature = "mpi")]
            mpi,
        })
    }

    /// This process's rank, world size and local rank.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// How this process must exchange the unique id: the TCP rendezvous set up for the spawned
    /// ranks on the spawning process, [`Exchange::Auto`] everywhere else.
    pub fn exchange(&self) -> Exchange {
        self.exchange.clone()
    }

    /// The number of ranks this process started (0 unless it is the spawning rank 0).
    pub fn spawned(&self) -> usize {
        self.supervisor.as_ref().map_or(0, Supervisor::count)
    }

    /// On the spawning process, once a rank it started has failed:
    /// [`BootstrapError::ChildFailed`] naming it (and any other rank that failed on its own
    /// before it could be stopped). `None` while all is well, and always on the other ranks.
    ///
    /// Does not block: call it between steps to notice a failure early.
    pub fn failure(&self) -> Option<BootstrapError> {
        self.supervisor.as_ref().and_then(Supervisor::failure)
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
            supervisor.on_failure(Box::new(hook));
        }
    }

    /// Exchanges the unique ids among the job's ranks, as many as `NCCL_RS_UNIQUE_IDS` says
    /// ([`IdCount`](super::IdCount); by default one, or one per
    /// [`SCALABLE_RANKS_PER_ID`](super::SCALABLE_RANKS_PER_ID) ranks on NCCL 2.23+), for
    /// [`Comm::init_rank_scalable`]; rank 0 creates them with [`UniqueId::new`].
    /// [`LocalJob::init_comm`] joins with them.
    pub fn exchange_ids(&self) -> crate::Result<Vec<UniqueId>> {
        self.exchange_ids_with(UniqueId::new)
    }

    /// Like [`LocalJob::exchange_ids`], with each id created by calling `make_id` (on rank 0;
    /// under MPI, on the ranks NCCL's guide names, see
    /// [`rank_has_root`](super::rank_has_root)).
    pub fn exchange_ids_with(
        &self,
        make_id: impl FnMut() -> crate::Result<UniqueId>,
    ) -> crate::Result<Vec<UniqueId>> {
        self.fail_if_a_rank_failed()?;
        #[cfg(feature = "mpi")]
        if let Some(universe) = &self.mpi {
            let count = super::IdCount::from_vars(process_var)?;
            return super::mpi::exchange_ids_mpi_with(&universe.0.world(), count, make_id);
        }
        super::exchange_ids_with(&self.placement, self.exchange.clone(), make_id)
    }

    /// Exchanges the unique id among the job's ranks; rank 0 creates it with
    /// [`UniqueId::new`].
    pub fn exchange_id(&self) -> crate::Result<UniqueId> {
        self.exchange_id_with(UniqueId::new)
    }

    /// Exchanges the unique id among the job's ranks; rank 0 creates it by calling `make_id`.
    ///
    /// On the spawning process this fails with [`BootstrapError::ChildFailed`] as soon as a
    /// spawned rank fails, instead of waiting for it; an exchange that every rank completed
    /// before the failure (the failed rank included) still succeeds, and
    /// [`LocalJob::failure`] and [`LocalJob::wait`] report the failure.
    pub fn exchange_id_with(
        &self,
        make_id: impl FnOnce() -> crate::Result<UniqueId>,
    ) -> crate::Result<UniqueId> {
        self.fail_if_a_rank_failed()?;
        #[cfg(feature = "mpi")]
        if let Some(universe) = &self.mpi {
            return super::mpi::exchange_id_mpi_with(&universe.0.world(), make_id);
        }
        exchange_id_with(&self.placement, self.exchange.clone(), make_id)
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
        init_comm(&self.placement, self.sharing, || self.exchange_checked())
    }

    /// The CUDA device of this rank, from the GPUs this process sees: the only one when it
    /// sees one, else its local rank ([`Placement::device_ordinal`] has the rule); in a job
    /// with more ranks than GPUs, the one it shares ([`Placement::device_ordinal_sharing`]).
    pub fn device(&self) -> crate::Result<usize> {
        device_of(&self.placement, self.sharing)
    }

    /// Like [`LocalJob::init_comm`], on a stream the caller chose. The stream must be on
    /// [`LocalJob::device`].
    pub fn init_comm_on(&self, stream: Arc<CudaStream>) -> crate::Result<Comm> {
        join_on(&self.placement, self.sharing, stream, || {
            self.exchange_checked()
        })
    }

    /// Exchanges the ids, then makes sure no spawned rank failed meanwhile: joining waits for
    /// every rank, and a blocking join cannot be interrupted.
    fn exchange_checked(&self) -> crate::Result<Vec<UniqueId>> {
        let ids = self.exchange_ids()?;
        self.fail_if_a_rank_failed()?;
        Ok(ids)
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
