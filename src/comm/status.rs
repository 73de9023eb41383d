//! What a communicator is, for people: [`CommStatus`], and `Debug` and `Display` of
//! [`Comm`] with rank, size, device, NCCL version, blocking mode, status and, where the
//! library reports them, NCCL's memory figures.
//!
//! Describing never panics and never waits: the communicator's lock is only tried (another
//! thread aborting it, say, holds it, and the description then says so), and NCCL is asked
//! for its memory figures under that same lock, only where NCCL has them (2.29.7) and the
//! communicator is neither released nor still in progress.

use std::fmt;

use nccl_sys::{ncclCommMemStat_t, ncclResult_t};

use super::state::{FailureState, State};
use super::suspend::MemStats;
use super::Comm;
use crate::calls;

/// Where a communicator stands ([`Comm::status`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CommStatus {
    /// Usable.
    Ok,
    /// Its dynamic memory is released ([`Comm::suspend`]) until [`Comm::resume`].
    Suspended,
    /// Marked failed (by a [`Watchdog`](crate::Watchdog)): still allocated, operations are
    /// refused.
    Failed,
    /// Revoked ([`Comm::revoke`](crate::Comm::revoke)): only shrink, split, abort and
    /// destroy remain.
    Revoked,
    /// Aborted (by its owner, an [`AbortHandle`](crate::AbortHandle), a watchdog, or a call
    /// that could not complete): the handle is gone.
    Aborted,
}

impl CommStatus {
    fn of(state: &State) -> Self {
        if state.ptr.is_null() {
            return CommStatus::Aborted;
        }
        match state.failure.as_deref().map(|failure| failure.state) {
            Some(FailureState::Released) => CommStatus::Aborted,
            Some(FailureState::Revoked) => CommStatus::Revoked,
            Some(FailureState::Failed) => CommStatus::Failed,
            None if state.suspended => CommStatus::Suspended,
            None => CommStatus::Ok,
        }
    }

    /// The lowercase word for it, e.g. `"suspended"`.
    pub fn as_str(self) -> &'static str {
        match self {
            CommStatus::Ok => "ok",
            CommStatus::Suspended => "suspended",
            CommStatus::Failed => "failed",
            CommStatus::Revoked => "revoked",
            CommStatus::Aborted => "aborted",
        }
    }
}

impl fmt::Display for CommStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a description shows, read once without waiting.
struct Snapshot {
    /// `None`: another thread held the lock.
    status: Option<CommStatus>,
    /// `None` where the library or the communicator's state gives none.
    memory: Option<MemStats>,
}

impl Comm {
    /// Where the communicator stands: usable, suspended, failed, revoked or aborted.
    pub fn status(&self) -> CommStatus {
        CommStatus::of(&self.shared.lock())
    }

    fn snapshot(&self) -> Snapshot {
        let Some(state) = self.shared.try_lock() else {
            return Snapshot {
                status: None,
                memory: None,
            };
        };
        let status = CommStatus::of(&state);
        let memory = match status {
            CommStatus::Ok | CommStatus::Suspended => self.memory_under(&state),
            _ => None,
        };
        Snapshot {
            status: Some(status),
            memory,
        }
    }

    /// NCCL's memory figures, asked under the lock the caller holds; `None` where NCCL has
    /// none to give (older library, a call still in progress, any error).
    fn memory_under(&self, state: &State) -> Option<MemStats> {
        let lib = self.lib;
        if lib.require_call(&calls::ncclCommMemStats).is_err()
            || !lib.api().has_symbol(calls::ncclCommMemStats.name)
        {
            return None;
        }
        // A nonblocking communicator still in progress would make NCCL refuse (and log).
        let mut code = ncclResult_t::ncclSuccess;
        // SAFETY: live handle (checked by the caller) under its lock; `code` is a valid
        // out-pointer.
        let status = unsafe { lib.api().ncclCommGetAsyncError(state.ptr, &mut code) };
        if status != Ok(ncclResult_t::ncclSuccess) || code != ncclResult_t::ncclSuccess {
            return None;
        }
        let stat = |which: ncclCommMemStat_t| {
            let mut value = 0u64;
            // SAFETY: live handle under its lock; `which` is one of NCCL's four values and
            // `value` a valid out-pointer.
            let status = unsafe { lib.api().ncclCommMemStats(state.ptr, which, &mut value) };
            (status == Ok(ncclResult_t::ncclSuccess)).then_some(value)
        };
        Some(MemStats {
            suspendable: stat(ncclCommMemStat_t::ncclStatGpuMemSuspend)?,
            suspended: stat(ncclCommMemStat_t::ncclStatGpuMemSuspended)? != 0,
            persistent: stat(ncclCommMemStat_t::ncclStatGpuMemPersist)?,
            total: stat(ncclCommMemStat_t::ncclStatGpuMemTotal)?,
        })
    }
}

/// `Comm { rank, size, device, nccl, blocking, status, memory }`; `status` is `None` while
/// another thread holds the communicator's lock, `memory` where NCCL reports none.
impl fmt::Debug for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let snapshot = self.snapshot();
        f.debug_struct("Comm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.device)
            .field("nccl", &self.lib.version())
            .field("blocking", &self.shared.blocking)
            .field("status", &snapshot.status)
            .field("memory", &snapshot.memory)
            .finish()
    }
}

/// One line, e.g. `rank 1 of 2 on CUDA device 0, NCCL 2.32.3, blocking, ok, memory: 12.0 MiB
/// suspendable, 2.0 MiB persistent, 14.0 MiB total`.
impl fmt::Display for Comm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let snapshot = self.snapshot();
        write!(
            f,
            "rank {} of {} on CUDA device {}, NCCL {}, {}, ",
            self.rank,
            self.size,
            self.device,
            self.lib.version(),
            if self.shared.blocking {
                "blocking"
            } else {
                "nonblocking"
            }
        )?;
        match snapshot.status {
            Some(status) => write!(f, "{status}")?,
            None => f.write_str("status unknown (another thread holds the communicator)")?,
        }
        if let Some(memory) = snapshot.memory {
            write!(f, ", memory: {memory}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::state::tests::live_state;
    use super::super::state::{Actor, Cause, Failure};
    use super::*;

    #[test]
    fn status_follows_the_state() {
        let mut state = live_state();
        assert_eq!(CommStatus::of(&state), CommStatus::Ok);
        state.suspended = true;
        assert_eq!(CommStatus::of(&state), CommStatus::Suspended);
        assert_eq!(CommStatus::Suspended.to_string(), "suspended");
        state.record(
            FailureState::Failed,
            Failure {
                state: FailureState::Failed,
                by: Actor::Watchdog,
                cause: Cause::Requested,
            },
        );
        assert_eq!(CommStatus::of(&state), CommStatus::Failed);
        state.record(FailureState::Revoked, Failure::owner(FailureState::Revoked));
        assert_eq!(CommStatus::of(&state), CommStatus::Revoked);
        state.take(Failure::owner(FailureState::Released));
        assert_eq!(CommStatus::of(&state), CommStatus::Aborted);
        assert_eq!(CommStatus::Aborted.as_str(), "aborted");
    }
}
