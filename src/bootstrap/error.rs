//! The errors of launcher detection, rendezvous and local jobs.

use std::process::ExitStatus;
use std::time::Duration;

use super::Launcher;
#[cfg(doc)]
use super::{spawn_local, Placement};

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

    /// The encrypted rendezvous could not authenticate a peer or a message: the two sides hold
    /// different rendezvous keys, only one side holds a key, or a message was forged, altered
    /// or replayed from another session.
    #[error(
        "rendezvous authentication failed: {detail}; check NCCL_RS_RENDEZVOUS_KEY on every rank"
    )]
    Authentication {
        /// What could not be authenticated, and the likely cause.
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

    /// Rank 0 hands out another number of unique ids than this rank was set up to expect
    /// ([`IdCount`](super::IdCount): `NCCL_RS_UNIQUE_IDS` or
    /// [`Rendezvous::with_id_count`](super::Rendezvous::with_id_count) differ between ranks,
    /// or one side runs an nccl-rs that hands out a single id).
    #[error(
        "rank 0 hands out {handed_out} unique id(s), this rank expects {expected}; set the same \
         NCCL_RS_UNIQUE_IDS (or id count) on every rank, or leave it on auto"
    )]
    IdCountMismatch {
        /// How many ids rank 0 hands out.
        handed_out: usize,
        /// How many this rank expects.
        expected: usize,
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
    /// ranks on this node (see [`Placement::device_ordinal`]).
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

/// Lets `?` turn a bootstrap error into the crate's [`Error`](crate::Error): the conversion
/// lives here, above the core, so the core's error type never names this module.
impl From<BootstrapError> for crate::Error {
    fn from(error: BootstrapError) -> Self {
        crate::Error::Bootstrap(crate::error::BoxedError::new(error))
    }
}

impl crate::Error {
    /// The bootstrap error inside [`Error::Bootstrap`](crate::Error::Bootstrap), typed; `None`
    /// for every other error.
    pub fn bootstrap(&self) -> Option<&BootstrapError> {
        match self {
            crate::Error::Bootstrap(boxed) => boxed.downcast_ref(),
            _ => None,
        }
    }
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
