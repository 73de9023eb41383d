//! Which communicators sit in a group open on this thread: while they do, an abort or
//! revoke requested from another thread is deferred until the group has ended.

use super::state::Failure;
use super::Comm;
use crate::error::Error;
use crate::inline_list::InlineList;

/// Marks communicators as members of a group open on this thread until [`Membership::leave`]
/// (or drop): an abort or revoke requested from another thread meanwhile is carried out
/// when the group has ended, because NCCL forbids aborting a communicator while a thread is
/// inside a call on it (see [`crate::fault`]).
pub(crate) struct Membership<'c> {
    comms: InlineList<&'c Comm, 8>,
    /// Until `leave`: the communicators are still marked as members.
    entered: bool,
    /// The group is only simulated (`ncclGroupSimulateEnd`): its members' flight recorders
    /// record nothing of it.
    simulated: bool,
}

impl<'c> Membership<'c> {
    pub(crate) fn enter(comms: impl IntoIterator<Item = &'c Comm>) -> Self {
        let mut membership = Self {
            comms: InlineList::new(),
            entered: true,
            simulated: false,
        };
        for comm in comms {
            membership.add(comm);
        }
        membership
    }

    /// Marks the group as simulated, before any communicator joins it.
    pub(crate) fn simulate(&mut self) {
        self.simulated = true;
    }

    /// Adds `comm` unless it is already a member.
    pub(crate) fn add(&mut self, comm: &'c Comm) {
        if !self
            .comms
            .iter()
            .any(|c| c.shared_ptr() == comm.shared_ptr())
        {
            comm.group_enter(self.simulated);
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

impl Comm {
    /// Marks this communicator as part of a group open on this thread (`simulated`: one
    /// that runs nothing); the first such group starts a group in its flight recorder.
    pub(crate) fn group_enter(&self, simulated: bool) {
        let mut state = self.shared.lock();
        state.open_groups = state.open_groups.saturating_add(1);
        if state.open_groups == 1 {
            if let Some(ring) = state.flight.as_deref_mut() {
                ring.group_opened(simulated);
            }
        }
    }

    /// Ends a group membership; runs an abort or revoke deferred meanwhile. Returns the
    /// communicator's failure, if it has one now, as the error of `call`.
    pub(crate) fn group_leave(&self, call: &'static str) -> Option<Error> {
        let mut state = self.shared.lock();
        state.open_groups = state.open_groups.saturating_sub(1);
        if state.open_groups == 0 {
            if let Some(ring) = state.flight.as_deref_mut() {
                ring.group_closed();
            }
            if let Some(action) = state.deferred.take() {
                // The failure was recorded when the action was requested; keep it.
                let failure = state
                    .failure
                    .as_deref()
                    .cloned()
                    .unwrap_or_else(|| Failure::owner(action.state()));
                // Errors have nowhere to go: the communicator is marked failed either way.
                let _ = state.run(self.library(), self.context(), &self.who(), action, failure);
            }
        }
        state.check_failure(call, self.rank()).err()
    }
}
