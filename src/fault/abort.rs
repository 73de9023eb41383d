//! Aborting: by the owner, through an [`AbortHandle`] from any thread, deferred while a
//! group holds the communicator, and when a nonblocking call never completes.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::require_nonblocking;
use crate::comm::state::{Action, Actor, Cause, Failure, FailureState, State};
use crate::comm::{record_of, Comm, Shared};
use crate::diagnostics::flight::{self, FlightRecord, Who};
use crate::error::Result;
use crate::library::Library;

/// The outcome of [`AbortHandle::abort`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AbortOutcome {
    /// `ncclCommAbort` ran; the communicator is gone.
    Aborted,
    /// The communicator is in a [`Group`](crate::Group) still open on its owner's thread: it
    /// is marked aborted now and `ncclCommAbort` runs when that group ends.
    Deferred,
    /// It was already aborted or destroyed (or an abort is already pending); nothing done.
    AlreadyReleased,
}

/// What [`act`] must do, decided from the bookkeeping alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Nothing: already released, or the same action already happened or is pending.
    Nothing,
    /// Recorded; NCCL is called when the owner's open group ends.
    Deferred,
    /// Recorded (a report needs no NCCL call).
    Recorded,
    /// Call NCCL now.
    Run,
}

/// Records `failure` for `action` on `state` and decides whether NCCL must be called now.
fn plan(state: &mut State, action: Action, failure: &Failure) -> Step {
    if state.ptr.is_null() || state.deferred == Some(Action::Abort) {
        return Step::Nothing;
    }
    let recorded = state.failure.as_ref().map(|f| f.state);
    if action == Action::Revoke && recorded >= Some(FailureState::Revoked) {
        return Step::Nothing;
    }
    if action == Action::Report {
        if recorded.is_some() {
            return Step::Nothing;
        }
        state.record(FailureState::Failed, failure.clone());
        return Step::Recorded;
    }
    if state.open_groups > 0 {
        state.record(action.state(), failure.clone());
        state.deferred = state.deferred.max(Some(action));
        return Step::Deferred;
    }
    Step::Run
}

/// Carries out `action` on the communicator behind `state` (its lock held), recording
/// `failure`.
pub(crate) fn act(
    state: &mut State,
    lib: &'static Library,
    ctx: &Arc<CudaContext>,
    who: &Who,
    action: Action,
    failure: Failure,
) -> Result<AbortOutcome> {
    match plan(state, action, &failure) {
        Step::Nothing => Ok(AbortOutcome::AlreadyReleased),
        Step::Deferred => Ok(AbortOutcome::Deferred),
        Step::Recorded => Ok(AbortOutcome::Aborted),
        Step::Run => {
            state.run(lib, ctx, who, action, failure)?;
            Ok(AbortOutcome::Aborted)
        }
    }
}

/// Aborts a nonblocking communicator from any thread; see the [module docs](super).
///
/// Made by [`Comm::abort_handle`]. It keeps the communicator's shared state alive (not the
/// NCCL communicator: once the `Comm` is dropped or destroyed, `abort` does nothing).
#[derive(Clone)]
pub struct AbortHandle {
    shared: Arc<Shared>,
    lib: &'static Library,
    ctx: Arc<CudaContext>,
    rank: usize,
    /// Whose flight record it takes.
    who: Who,
}

impl std::fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AbortHandle")
            .field("rank", &self.rank)
            .field("released", &self.is_released())
            .finish()
    }
}

impl AbortHandle {
    /// Aborts the communicator (`ncclCommAbort`), unless it is already aborted or
    /// destroyed. Safe to call from any thread, at any time, any number of times.
    ///
    /// If its owner has it in a [`Group`](crate::Group) that is still open, the abort is
    /// [deferred](AbortOutcome::Deferred) to the end of that group. An error means NCCL
    /// reported one while aborting; the communicator is released either way. Where CUDA
    /// graphs that captured it are still alive, NCCL's abort goes on past 1 s on a thread of
    /// its own until they are destroyed, its kernels stopped (see
    /// [`Comm::releases_in_flight`]).
    ///
    /// Where `NCCL_RS_FLIGHT_RECORDER_DIR` is set and the communicator was still live, its
    /// flight record (taken just before the abort) is written there after it (see
    /// [`crate::diagnostics::flight`]); the record stays readable afterwards through
    /// [`AbortHandle::flight_record`].
    pub fn abort(&self) -> Result<AbortOutcome> {
        // The record is taken and the communicator aborted under one lock; the file is
        // written after the abort, so a slow or hung file system never delays it (peers may
        // be waiting on this rank).
        let (record, outcome) = {
            let mut state = self.shared.lock();
            let record = if state.ptr.is_null() {
                None
            } else {
                record_of(&state, self.who.clone(), "AbortHandle::abort")
            };
            let outcome = act(
                &mut state,
                self.lib,
                &self.ctx,
                &self.who,
                Action::Abort,
                Failure {
                    state: FailureState::Released,
                    by: Actor::AbortHandle,
                    cause: Cause::Requested,
                },
            );
            (record, outcome)
        };
        // Best effort: the abort is done; the dump only helps find why.
        if let Some(record) = &record {
            let _ = flight::write_to_env_dir(record);
        }
        outcome
    }

    /// Whether the communicator was aborted or destroyed (by anyone).
    pub fn is_released(&self) -> bool {
        self.shared.lock().ptr.is_null()
    }

    /// The rank of the communicator this handle aborts.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The communicator's flight record (see [`Comm::flight_record`]), from any thread, also
    /// after it was aborted; `None` where the recorder is off.
    pub fn flight_record(&self) -> Option<FlightRecord> {
        let state = self.shared.lock();
        record_of(&state, self.who.clone(), "AbortHandle::flight_record")
    }
}

impl Comm {
    /// A handle that aborts this communicator from any thread; see the [module docs](super).
    ///
    /// Only for nonblocking communicators: NCCL does not allow aborting a blocking one from
    /// another thread ([`Error::InvalidUsage`](crate::Error::InvalidUsage)).
    pub fn abort_handle(&self) -> Result<AbortHandle> {
        require_nonblocking(self, "an abort handle")?;
        Ok(AbortHandle {
            shared: self.shared().clone(),
            lib: self.library(),
            ctx: self.context().clone(),
            rank: self.rank(),
            who: self.who(),
        })
    }

    /// `ncclCommAbort` by the owner without giving up the `Comm`: later calls on it fail
    /// with `cause`, and dropping it does nothing.
    pub(crate) fn abort_in_place(&self, cause: Cause) -> Result<AbortOutcome> {
        let mut state = self.shared().lock();
        act(
            &mut state,
            self.library(),
            self.context(),
            &self.who(),
            Action::Abort,
            Failure {
                state: FailureState::Released,
                by: Actor::Owner,
                cause,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calls;
    use crate::comm::state::tests::{live_state, null_state};

    #[test]
    fn actions_are_planned_deferred_and_idempotent() {
        let by = |actor| Failure {
            state: FailureState::Released,
            by: actor,
            cause: Cause::Requested,
        };
        // Outside a group: run now.
        let mut h = live_state();
        assert_eq!(
            plan(&mut h, Action::Abort, &by(Actor::AbortHandle)),
            Step::Run
        );

        // Inside a group: recorded at once, NCCL deferred; the handle stays until then.
        let mut h = live_state();
        h.open_groups = 1;
        assert_eq!(
            plan(&mut h, Action::Abort, &by(Actor::AbortHandle)),
            Step::Deferred
        );
        assert_eq!(h.deferred, Some(Action::Abort));
        assert!(!h.ptr.is_null());
        let text = h
            .usable_for(&calls::ncclAllReduce, 0)
            .unwrap_err()
            .to_string();
        assert!(text.contains("aborted through an AbortHandle"), "{text}");
        // A second abort, or a revoke, while one is pending does nothing.
        assert_eq!(
            plan(&mut h, Action::Abort, &by(Actor::AbortHandle)),
            Step::Nothing
        );
        assert_eq!(
            plan(&mut h, Action::Revoke, &by(Actor::Watchdog)),
            Step::Nothing
        );

        // A deferred revoke is upgraded by a later abort.
        let mut h = live_state();
        h.open_groups = 2;
        assert_eq!(
            plan(&mut h, Action::Revoke, &by(Actor::Watchdog)),
            Step::Deferred
        );
        assert_eq!(
            plan(&mut h, Action::Abort, &by(Actor::AbortHandle)),
            Step::Deferred
        );
        assert_eq!(h.deferred, Some(Action::Abort));
        assert_eq!(h.failure.as_ref().unwrap().by, Actor::Watchdog);
        assert_eq!(h.failure.as_ref().unwrap().state, FailureState::Released);

        // Released: nothing, whatever is asked.
        let mut h = null_state();
        for action in [Action::Abort, Action::Revoke, Action::Report] {
            assert_eq!(plan(&mut h, action, &by(Actor::AbortHandle)), Step::Nothing);
        }

        // A report only records, once; a revoke after it still runs.
        let mut h = live_state();
        assert_eq!(
            plan(&mut h, Action::Report, &by(Actor::Watchdog)),
            Step::Recorded
        );
        assert_eq!(h.failure.as_ref().unwrap().state, FailureState::Failed);
        assert_eq!(
            plan(&mut h, Action::Report, &by(Actor::Watchdog)),
            Step::Nothing
        );
        assert_eq!(plan(&mut h, Action::Revoke, &by(Actor::Owner)), Step::Run);
    }
}
