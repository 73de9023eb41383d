//! Starting a multi-process job: which rank am I, and how do the ranks agree on a
//! [`UniqueId`]?
//!
//! NCCL leaves both questions to the application. Rank 0 creates the id with
//! [`UniqueId::new`]; every other rank must receive those 128 bytes before calling
//! `Comm::init_rank`. This module answers them without MPI:
//!
//! 1. [`Launch::from_env`] reads the rank, world size and local rank exported by the launcher
//!    (Open MPI, MPICH/Hydra/PMI, PMIx, Slurm's `srun`, `torchrun`, or none at all).
//! 2. [`exchange_id`] hands rank 0's id to every rank over TCP ([`TcpRendezvous`]) or, when all
//!    ranks share one machine, through a file ([`FileRendezvous`]).
//! 3. [`spawn_local`] turns a plain `cargo run` into a job of one process per GPU.
//!
//! With the `mpi` feature, `mpi::exchange_id_mpi` broadcasts the id over an existing MPI
//! communicator instead.
//!
//! ```no_run
//! use nccl::bootstrap::{exchange_id, Exchange, Launch};
//!
//! # fn main() -> nccl::Result<()> {
//! let launch = Launch::from_env()?;
//! let id = exchange_id(&launch, Exchange::Auto)?;
//! // Pick the GPU with `launch.device_ordinal(device_count)?` (one visible GPU: that one;
//! // otherwise the local rank), then
//! // `Comm::init_rank(id, launch.rank, launch.world_size)`.
//! # let _ = id;
//! # Ok(())
//! # }
//! ```
//!
//! # Ways to start a job
//!
//! * **`mpirun -n 8 ./app`** (Open MPI, MPICH, Intel MPI): the rank comes from the MPI
//!   variables. Set `NCCL_RS_ADDR=<host of rank 0>:<port>` (or `MASTER_ADDR`/`MASTER_PORT`)
//!   for a job on several nodes, e.g. `mpirun -x NCCL_RS_ADDR=node0:29500 ...`; on one node no
//!   address is needed (file rendezvous), provided the launcher exports the local size.
//! * **`srun -n 8 ./app`** (Slurm): the rank comes from the step variables and the job key
//!   from `SLURM_JOB_ID`; set `NCCL_RS_ADDR` or `MASTER_ADDR`/`MASTER_PORT` as for MPI when
//!   the step spans nodes.
//! * **`torchrun --nproc-per-node 8 --no-python ./app`**, or any tool exporting `RANK`,
//!   `WORLD_SIZE`, `LOCAL_RANK` and `MASTER_ADDR`/`MASTER_PORT` (as torchrun does).
//! * **No launcher**: `cargo run --example x` is rank 0 of 1, unless the program calls
//!   [`spawn_local`] with its GPU count: then the process becomes rank 0 and re-executes
//!   itself once per other rank, so `cargo run` on a 4-GPU machine runs 4 ranks.
//!
//! # Environment variables
//!
//! Launch detection ([`Launch::from_vars`]):
//!
//! | variable | meaning |
//! | --- | --- |
//! | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` | Open MPI rank and size |
//! | `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE` | Open MPI rank and ranks on this node |
//! | `PMI_RANK`, `PMI_SIZE` | MPICH/Hydra/Intel MPI/PMI-2 rank and size |
//! | `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` | Hydra's rank and ranks on this node |
//! | `PMIX_RANK` | PMIx rank; the size is taken from `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE` or Slurm |
//! | `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` (else `SLURM_NTASKS`), `SLURM_LOCALID` | Slurm step rank, size, local rank |
//! | `SLURM_STEP_TASKS_PER_NODE` with `SLURM_NODEID`, else `SLURM_NTASKS_PER_NODE` | Slurm ranks on this node (optional) |
//! | `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE` | torchrun-style rank, size, local rank, local size |
//! | `NCCL_RS_LAUNCHER` | read only this launcher's variables: `openmpi`, `mpich`, `pmix`, `slurm`, `torchrun` or `none` |
//!
//! A launcher counts as present when its rank or size variable is set; it must then set both.
//! Empty values count as unset. No launcher at all means rank 0 of 1.
//!
//! Slurm variables are used only inside a job step, that is when `SLURM_STEP_ID`,
//! `SLURM_STEPID` or `SLURM_STEP_NUM_TASKS` is set. A batch script or an `salloc` shell also
//! carries `SLURM_PROCID=0` and the allocation's `SLURM_NTASKS`, but a program started there
//! directly is not one of those tasks: reading them would make it wait forever for ranks that
//! `srun` never started. `NCCL_RS_LAUNCHER=slurm` reads them anyway.
//!
//! Rendezvous ([`Exchange::from_vars`]):
//!
//! | variable | meaning |
//! | --- | --- |
//! | `NCCL_RS_ADDR` | `host:port` where rank 0 listens for the TCP rendezvous (`[v6]:port` for IPv6) |
//! | `MASTER_ADDR`, `MASTER_PORT` | used when `NCCL_RS_ADDR` is unset, as torchrun exports them; when `TORCHELASTIC_USE_AGENT_STORE=True` (torchrun's agent already listens on `MASTER_PORT`), the port after it |
//! | `NCCL_RS_JOB_KEY` | names the job, so that two jobs on one address or one directory cannot mix |
//! | `NCCL_RS_RENDEZVOUS_DIR` | directory of the file rendezvous (default: [`std::env::temp_dir`]) |
//! | `NCCL_RS_BOOTSTRAP_TIMEOUT` | seconds every rank waits for the others (default 300) |
//! | `NCCL_RS_LOCAL_RANKS` | overrides the rank count given to [`spawn_local`] |
//!
//! Without `NCCL_RS_JOB_KEY`, the key is derived from, in order: `SLURM_JOB_ID` (with
//! `SLURM_STEP_ID` when set), `OMPI_MCA_ess_base_jobid`, `PMIX_NAMESPACE`,
//! `TORCHELASTIC_RUN_ID`; failing all, the fixed key `nccl-rs-default`, which is only safe
//! while one job at a time runs on a rendezvous address or directory. The key is sent as a
//! 64-bit hash; it tells jobs apart and is not a secret.
//!
//! Several exchanges under one key (e.g. one per communicator) must run one after the other,
//! in the same order on every rank; both methods keep them apart (TCP by counting rounds, the
//! file rendezvous by skipping a publication the rank already used). A distinct key per
//! exchange, or splitting an existing communicator, avoids the question.
//!
//! # Several launchers at once
//!
//! Launchers nest: `srun` may start `torchrun` agents, which start the ranks, or start Open
//! MPI's daemons, which start the ranks. The innermost launcher is believed, in this order:
//! torchrun-style, Open MPI, MPICH/PMI, PMIx, Slurm. Every other launcher present must either
//! agree (same rank and size, as when `srun --mpi=pmix` exports PMIx and Slurm variables) or
//! describe fewer processes than the innermost one (it counted per-node agents). Anything else
//! — same size but another rank, or more processes — is a [`BootstrapError::Conflict`];
//! `NCCL_RS_LAUNCHER` settles it.
//!
//! # TCP protocol, version 1
//!
//! Rank 0 listens on the port of the rendezvous address: on that exact address when it is a
//! loopback address (`127.0.0.1`, `::1`, `localhost`), else on every interface (the name other
//! nodes use for rank 0 may resolve differently on rank 0 itself). Each other rank connects,
//! retrying refused connections until its deadline since rank 0 may start later. All integers
//! are big-endian.
//!
//! | message | bytes |
//! | --- | --- |
//! | request (rank → rank 0), 32 bytes | magic `NRSB`, version `u16`, kind `u16` = 1, job-key hash `u64`, world size `u32`, rank `u32`, round `u32`, reserved `u32` |
//! | reply (rank 0 → rank), 16 bytes | magic `NRSB`, version `u16`, kind `u16` = 2, status `u16`, reserved `u16`, detail `u32`; then the 128-byte id when status is 0 |
//! | ack (rank → rank 0), 24 bytes | magic `NRSB`, version `u16`, kind `u16` = 3, rank `u32`, reserved `u32`, id fingerprint `u64` |
//!
//! Status codes: 0 ok, 1 bad magic, 2 unsupported version (detail: rank 0's version), 3
//! malformed request, 4 wrong job key, 5 world-size mismatch (detail: rank 0's size), 6 rank
//! out of range (detail: world size), 7 rank already taken (detail 1: another connection is
//! still fetching it, retry; 2: it has acked), 8 timed out (retry), 9 busy (retry), 10 early
//! (rank 0 still serves an earlier round, retry; detail: rank 0's round), 11 late (rank 0
//! already serves a later round). The round counts the exchanges this process made under the
//! job key before, from 0, on every rank alike. Later
//! versions keep the first 16 bytes of a reply as they are, so a peer of any version can read
//! why it was turned away.
//!
//! Rank 0 serves connections concurrently, each under its own deadline, so a peer that sends
//! garbage, stops half-way or never speaks gets its error code and is closed without holding
//! up the others. A rank counts as served once its ack arrives; rank 0 returns when every rank
//! has acked, so it *knows* all ranks hold the id, and fails with [`BootstrapError::Timeout`]
//! naming the missing ranks when the deadline passes first.
//!
//! # File protocol, version 1
//!
//! Rank 0 writes `nccl-rs-<uid>-<job-key hash>.id` in the rendezvous directory: a 192-byte
//! record (magic `NRSF`, version, job-key hash, world size, a random nonce, rank 0's pid, its
//! start time and pid namespace, the id, and a checksum), written to a unique temporary name,
//! synced and renamed into place so readers never see a partial file. Each rank validates the
//! record, writes `<name>.ack.<rank>` the same way (naming the nonce it read), and returns;
//! rank 0 removes the id file and the acks once all ranks acked, or at its deadline.
//!
//! A file left by a job that crashed is recognised as stale when its writer process is gone
//! (or its pid now belongs to a newer process), and ignored; the new rank 0 replaces it. Ack
//! files carry the nonce, so leftovers of an old job are never counted. Files are created
//! readable by their owner only, and a file owned by another user is never trusted. A rank that
//! exchanges twice under one key skips the publication it already used.

mod file;
mod launch;
#[cfg(feature = "mpi")]
pub mod mpi;
mod spawn;
mod tcp;
mod util;

use std::process::ExitStatus;
use std::time::Duration;

pub use file::FileRendezvous;
pub use launch::{Launch, Launcher};
pub use spawn::{spawn_local, LocalJob};
pub use tcp::{RejectedPeer, ServeReport, TcpRendezvous, TcpServer};

use crate::UniqueId;
use util::{lookup, process_var};

/// Result alias of this module.
pub type Result<T, E = BootstrapError> = std::result::Result<T, E>;

/// Everything that can go wrong while detecting the launch or exchanging the unique id.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// An environment variable holds a value that cannot be used.
    #[error("environment variable {var}={value:?} cannot be used: {reason}")]
    Env {
        /// The variable.
        var: String,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A launcher's variables are only partly set (e.g. a rank without a world size).
    #[error("{launcher} variables are incomplete: {present} is set but {missing} is not")]
    Incomplete {
        /// The launcher whose variables were found.
        launcher: Launcher,
        /// The variable that is set.
        present: String,
        /// The variable (or variables) that should accompany it.
        missing: String,
    },

    /// Two launchers' variables disagree about this process.
    #[error(
        "launchers disagree: {first}, but {second}; set NCCL_RS_LAUNCHER to the launcher that \
         started this process"
    )]
    Conflict {
        /// What the believed launcher says.
        first: String,
        /// What the other launcher says.
        second: String,
    },

    /// The settings do not allow a rendezvous (e.g. ranks on several nodes and no address), or
    /// a rendezvous was used in a way that cannot work.
    #[error("bootstrap configuration: {0}")]
    Config(String),

    /// A wait ran past its deadline.
    #[error("timed out after {after:?} {stage}")]
    Timeout {
        /// What was being waited for.
        stage: String,
        /// How long the wait lasted.
        after: Duration,
        /// Ranks that never completed the exchange (empty when not applicable).
        missing_ranks: Vec<usize>,
    },

    /// A message or file was garbled, truncated or of another protocol.
    #[error("bootstrap protocol error: {0}")]
    Protocol(String),

    /// The two sides speak different protocol versions.
    #[error(
        "bootstrap protocol version mismatch: this side speaks version {local}, the peer {peer}"
    )]
    VersionMismatch {
        /// The version this side speaks.
        local: u16,
        /// The version the peer announced.
        peer: u16,
    },

    /// The peer or file belongs to another job (its job key differs).
    #[error("the rendezvous belongs to another job: {detail}; check NCCL_RS_JOB_KEY")]
    WrongJob {
        /// Which keys or files were involved.
        detail: String,
    },

    /// Rank 0 and a joining rank were started with different world sizes.
    #[error("world size mismatch: rank 0 has {expected} ranks, the joining rank {got}")]
    WorldSizeMismatch {
        /// Rank 0's world size.
        expected: usize,
        /// The joining rank's world size.
        got: usize,
    },

    /// A second process claimed a rank that another process already holds.
    #[error("rank {0} joined twice: another process already claimed it")]
    DuplicateRank(usize),

    /// A rank is not below the world size.
    #[error("rank {rank} is out of range for a world of {world_size} ranks")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The world size.
        world_size: usize,
    },

    /// This rank has no GPU of its own: no GPU is visible, or several are but fewer than the
    /// ranks on this node (see [`Launch::device_ordinal`]).
    #[error("{}", no_device_message(*local_rank, *local_ranks, *visible))]
    NoDevice {
        /// The local rank.
        local_rank: usize,
        /// The number of ranks on this node, when the launcher says.
        local_ranks: Option<usize>,
        /// The number of GPUs visible to this process (`CUDA_VISIBLE_DEVICES` applied).
        visible: usize,
    },

    /// A rank started by [`spawn_local`] ended unsuccessfully; the spawning process stopped
    /// the others. The fields describe the first failure seen.
    #[error(
        "local rank {rank} (pid {pid}) failed: {status}{}",
        also_failed_message(also_failed)
    )]
    ChildFailed {
        /// The failed rank.
        rank: usize,
        /// Its process id.
        pid: u32,
        /// How it ended.
        status: ExitStatus,
        /// The exit code to propagate: its own, or 128 + signal number when it was killed.
        exit_code: i32,
        /// Other ranks that failed on their own before they could be stopped, in the order
        /// they were seen to end (ranks stopped by the spawning process are not listed).
        also_failed: Vec<ChildExit>,
    },

    /// An I/O operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// How a rank started by [`spawn_local`] ended.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ChildExit {
    /// Its rank.
    pub rank: usize,
    /// Its process id.
    pub pid: u32,
    /// How it ended.
    pub status: ExitStatus,
}

/// The tail of [`BootstrapError::ChildFailed`]'s message naming the other failed ranks.
fn also_failed_message(also_failed: &[ChildExit]) -> String {
    let list: Vec<String> = also_failed
        .iter()
        .map(|exit| {
            format!(
                "local rank {} (pid {}): {}",
                exit.rank, exit.pid, exit.status
            )
        })
        .collect();
    if list.is_empty() {
        return String::new();
    }
    format!("; failed too: {}", list.join(", "))
}

/// The message of [`BootstrapError::NoDevice`]: both counts, and how to fix the launch.
fn no_device_message(local_rank: usize, local_ranks: Option<usize>, visible: usize) -> String {
    let ranks = match local_ranks {
        Some(n) => format!("{n} ranks run on this node"),
        None => "the launcher does not say how many ranks run on this node".to_owned(),
    };
    if visible == 0 {
        return format!(
            "local rank {local_rank} sees no GPU ({ranks}); check CUDA_VISIBLE_DEVICES and the \
             launcher's GPU binding"
        );
    }
    format!(
        "local rank {local_rank} has no GPU of its own: this process sees {visible} GPUs \
         (CUDA_VISIBLE_DEVICES applied) and {ranks}; give each rank one GPU \
         (CUDA_VISIBLE_DEVICES per rank, or srun --gpus-per-task=1), or start one rank per \
         visible GPU"
    )
}

/// Variables read by the rendezvous methods.
pub(crate) mod vars {
    pub const ADDR: &str = "NCCL_RS_ADDR";
    pub const MASTER_ADDR: &str = "MASTER_ADDR";
    pub const MASTER_PORT: &str = "MASTER_PORT";
    pub const JOB_KEY: &str = "NCCL_RS_JOB_KEY";
    pub const RENDEZVOUS_DIR: &str = "NCCL_RS_RENDEZVOUS_DIR";
    pub const TIMEOUT: &str = "NCCL_RS_BOOTSTRAP_TIMEOUT";
    pub const LOCAL_RANKS: &str = "NCCL_RS_LOCAL_RANKS";
}

/// The rank-wide deadline used when `NCCL_RS_BOOTSTRAP_TIMEOUT` is unset. Generous, because
/// ranks of a large job can start minutes apart.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The job key used when neither `NCCL_RS_JOB_KEY` nor a launcher's job id is set.
pub const DEFAULT_JOB_KEY: &str = "nccl-rs-default";

type Vars<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The job key: `NCCL_RS_JOB_KEY`, else a launcher's job id, else [`DEFAULT_JOB_KEY`].
fn job_key_from(vars: Vars<'_>) -> String {
    if let Some(key) = lookup(vars, vars::JOB_KEY) {
        return key;
    }
    if let Some(job) = lookup(vars, "SLURM_JOB_ID") {
        return match lookup(vars, "SLURM_STEP_ID") {
            Some(step) => format!("slurm-{}.{}", job.trim(), step.trim()),
            None => format!("slurm-{}", job.trim()),
        };
    }
    for (var, prefix) in [
        ("OMPI_MCA_ess_base_jobid", "ompi"),
        ("PMIX_NAMESPACE", "pmix"),
        ("TORCHELASTIC_RUN_ID", "torchelastic"),
    ] {
        if let Some(id) = lookup(vars, var) {
            return format!("{prefix}-{}", id.trim());
        }
    }
    DEFAULT_JOB_KEY.to_owned()
}

/// The rank-wide timeout: `NCCL_RS_BOOTSTRAP_TIMEOUT` seconds, else [`DEFAULT_TIMEOUT`].
fn timeout_from(vars: Vars<'_>) -> Result<Duration> {
    match lookup(vars, vars::TIMEOUT) {
        Some(text) => util::parse_seconds(vars::TIMEOUT, &text),
        None => Ok(DEFAULT_TIMEOUT),
    }
}

/// Checks a `host:port` value from variable `var`.
fn parse_address(var: &str, value: &str) -> Result<String> {
    let value = value.trim();
    let invalid = |reason: &str| BootstrapError::Env {
        var: var.to_owned(),
        value: value.to_owned(),
        reason: reason.to_owned(),
    };
    let (host, port) = value
        .rsplit_once(':')
        .ok_or_else(|| invalid("expected host:port, e.g. node0:29500 or [::1]:29500"))?;
    if host.is_empty() || host == "[]" {
        return Err(invalid("the host is empty"));
    }
    match port.parse::<u16>() {
        Ok(0) => Err(invalid("port 0 cannot be shared with the other ranks")),
        Ok(_) => Ok(value.to_owned()),
        Err(_) => Err(invalid("the port is not a number from 1 to 65535")),
    }
}

/// The TCP rendezvous address from `NCCL_RS_ADDR`, else `MASTER_ADDR` and `MASTER_PORT`.
fn address_from(vars: Vars<'_>) -> Result<Option<String>> {
    if let Some(addr) = lookup(vars, vars::ADDR) {
        return parse_address(vars::ADDR, &addr).map(Some);
    }
    let host = lookup(vars, vars::MASTER_ADDR);
    let port = lookup(vars, vars::MASTER_PORT);
    match (host, port) {
        (None, None) => Ok(None),
        (Some(_), None) => Err(BootstrapError::Config(format!(
            "{} is set but {} is not",
            vars::MASTER_ADDR,
            vars::MASTER_PORT
        ))),
        (None, Some(_)) => Err(BootstrapError::Config(format!(
            "{} is set but {} is not",
            vars::MASTER_PORT,
            vars::MASTER_ADDR
        ))),
        (Some(host), Some(port_text)) => {
            let port = match port_text.trim().parse::<u16>() {
                Ok(port) if port > 0 => port,
                _ => {
                    return Err(BootstrapError::Env {
                        var: vars::MASTER_PORT.to_owned(),
                        value: port_text,
                        reason: "expected a port number from 1 to 65535".to_owned(),
                    })
                }
            };
            // torchrun's agent hosts its own store on MASTER_PORT when it says so: rank 0
            // cannot listen there, so every rank uses the next port instead.
            let agent_holds_port = lookup(vars, TORCHELASTIC_AGENT_STORE)
                .is_some_and(|v| matches!(v.trim(), "True" | "true" | "1"));
            let port = if agent_holds_port {
                port.checked_add(1).ok_or_else(|| BootstrapError::Env {
                    var: vars::MASTER_PORT.to_owned(),
                    value: port_text.clone(),
                    reason: format!(
                        "{TORCHELASTIC_AGENT_STORE} is set, so the rendezvous would use the \
                         next port, but there is none; set {} instead",
                        vars::ADDR
                    ),
                })?
            } else {
                port
            };
            let host = host.trim();
            // A bare IPv6 literal needs brackets before a port can follow it.
            let joined = if host.contains(':') && !host.starts_with('[') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            };
            parse_address(vars::MASTER_ADDR, &joined).map(Some)
        }
    }
}

/// Set by torchrun in its workers' environment when its agent hosts the store on MASTER_PORT.
const TORCHELASTIC_AGENT_STORE: &str = "TORCHELASTIC_USE_AGENT_STORE";

/// How the ranks exchange the unique id.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Exchange {
    /// Choose from the environment, see [`Exchange::from_vars`].
    Auto,
    /// Over TCP, rank 0 serving.
    Tcp(TcpRendezvous),
    /// Through a file, all ranks on one machine.
    File(FileRendezvous),
}

impl Exchange {
    /// Resolves [`Exchange::Auto`] from this process's environment.
    pub fn from_env(launch: &Launch) -> Result<Exchange> {
        Self::from_vars(launch, process_var)
    }

    /// Resolves [`Exchange::Auto`] from the variables `vars` returns: TCP when `NCCL_RS_ADDR`
    /// or `MASTER_ADDR`/`MASTER_PORT` is set; else the file rendezvous when every rank is on
    /// this node ([`Launch::is_single_node`], or no launcher); else an error asking for an
    /// address.
    pub fn from_vars(launch: &Launch, vars: impl Fn(&str) -> Option<String>) -> Result<Exchange> {
        let vars: Vars<'_> = &vars;
        if address_from(vars)?.is_some() {
            return TcpRendezvous::from_vars(launch, vars).map(Exchange::Tcp);
        }
        if launch.is_single_node() || launch.launcher == Launcher::None {
            return FileRendezvous::from_vars(launch, vars).map(Exchange::File);
        }
        Err(BootstrapError::Config(format!(
            "the {} ranks of this {} launch may span several nodes (ranks on this node: {}), \
             so the file rendezvous cannot be used; set {} to host:port of rank 0, or {} and {}",
            launch.world_size,
            launch.launcher,
            launch
                .local_world_size
                .map_or_else(|| "unknown".to_owned(), |n| n.to_string()),
            vars::ADDR,
            vars::MASTER_ADDR,
            vars::MASTER_PORT,
        )))
    }
}

/// Gives every rank the same [`UniqueId`]; rank 0 creates it with [`UniqueId::new`].
///
/// See [`exchange_id_with`].
pub fn exchange_id(launch: &Launch, method: Exchange) -> crate::Result<UniqueId> {
    exchange_id_with(launch, method, UniqueId::new)
}

/// Gives every rank the same [`UniqueId`]; rank 0 creates it by calling `make_id`, the others
/// never call it.
///
/// A job of one rank needs no exchange: `make_id` is called and its id returned. Otherwise
/// [`Exchange::Auto`] is resolved with [`Exchange::from_env`], and an explicit rendezvous must
/// agree with `launch` on rank and world size. Returns on rank 0 once every rank holds the id.
pub fn exchange_id_with(
    launch: &Launch,
    method: Exchange,
    make_id: impl FnOnce() -> crate::Result<UniqueId>,
) -> crate::Result<UniqueId> {
    if launch.world_size == 1 && launch.rank == 0 {
        return make_id();
    }
    let method = match method {
        Exchange::Auto => Exchange::from_env(launch)?,
        other => other,
    };
    let (rank, world_size) = match &method {
        Exchange::Tcp(tcp) => (tcp.rank(), tcp.world_size()),
        Exchange::File(file) => (file.rank(), file.world_size()),
        Exchange::Auto => (launch.rank, launch.world_size),
    };
    if (rank, world_size) != (launch.rank, launch.world_size) {
        return Err(BootstrapError::Config(format!(
            "the rendezvous is set up for rank {rank} of {world_size}, but the launch says rank \
             {} of {}",
            launch.rank, launch.world_size
        ))
        .into());
    }
    match method {
        Exchange::Tcp(tcp) => tcp.exchange_with(make_id),
        Exchange::File(file) => file.exchange_with(make_id),
        // `from_env` never returns Auto.
        Exchange::Auto => {
            Err(BootstrapError::Config("Exchange::Auto could not be resolved".to_owned()).into())
        }
    }
}

/// Checks rank and world size before any rendezvous starts.
fn check_rank(rank: usize, world_size: usize) -> Result<()> {
    if world_size == 0 {
        return Err(BootstrapError::Config(
            "the world size must be at least 1".to_owned(),
        ));
    }
    if rank >= world_size {
        return Err(BootstrapError::RankOutOfRange { rank, world_size });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| (*value).to_owned())
        }
    }

    #[test]
    fn job_key_sources_in_order() {
        assert_eq!(job_key_from(&vars(&[])), DEFAULT_JOB_KEY);
        assert_eq!(
            job_key_from(&vars(&[
                ("SLURM_JOB_ID", "42"),
                ("OMPI_MCA_ess_base_jobid", "7")
            ])),
            "slurm-42"
        );
        assert_eq!(
            job_key_from(&vars(&[("SLURM_JOB_ID", "42"), ("SLURM_STEP_ID", "3")])),
            "slurm-42.3"
        );
        assert_eq!(
            job_key_from(&vars(&[("OMPI_MCA_ess_base_jobid", "7")])),
            "ompi-7"
        );
        assert_eq!(
            job_key_from(&vars(&[
                ("NCCL_RS_JOB_KEY", "mine"),
                ("SLURM_JOB_ID", "42")
            ])),
            "mine"
        );
    }

    #[test]
    fn addresses_parse() {
        assert_eq!(
            address_from(&vars(&[("NCCL_RS_ADDR", "node0:29500")])).unwrap(),
            Some("node0:29500".to_owned())
        );
        assert_eq!(
            address_from(&vars(&[("MASTER_ADDR", "::1"), ("MASTER_PORT", "29500")])).unwrap(),
            Some("[::1]:29500".to_owned())
        );
        assert_eq!(address_from(&vars(&[])).unwrap(), None);
        for bad in ["node0", "node0:", "node0:0", "node0:70000", ":29500"] {
            let err = address_from(&vars(&[("NCCL_RS_ADDR", bad)])).unwrap_err();
            assert!(
                matches!(err, BootstrapError::Env { ref var, .. } if var == "NCCL_RS_ADDR"),
                "{bad}: {err}"
            );
        }
        let err = address_from(&vars(&[("MASTER_ADDR", "node0")])).unwrap_err();
        assert!(err.to_string().contains("MASTER_PORT"), "{err}");
        let err =
            address_from(&vars(&[("MASTER_ADDR", "node0"), ("MASTER_PORT", "http")])).unwrap_err();
        assert!(
            matches!(err, BootstrapError::Env { ref var, .. } if var == "MASTER_PORT"),
            "{err}"
        );
        // Under torchrun's agent store, MASTER_PORT is taken: the next port is used.
        assert_eq!(
            address_from(&vars(&[
                ("MASTER_ADDR", "node0"),
                ("MASTER_PORT", "29500"),
                ("TORCHELASTIC_USE_AGENT_STORE", "True"),
            ]))
            .unwrap(),
            Some("node0:29501".to_owned())
        );
    }
}
