//! A communicator's flight record on demand ([`Comm::flight_record`]), and the record of the
//! communicator behind a locked state, as the watchdog and abort handles take it
//! (see [`crate::diagnostics::flight`]).

use std::time::{Instant, SystemTime};

use super::{Comm, State};
use crate::diagnostics::flight::{FlightRecord, Who};

/// The flight record of the communicator behind `state` (its lock held), taken because of
/// `reason`; `None` where its recorder is off.
pub(crate) fn record_of(state: &State, who: Who, reason: &str) -> Option<FlightRecord> {
    let snapshot = state.flight.as_deref()?.snapshot();
    Some(FlightRecord::from_snapshot(
        snapshot,
        who,
        reason.to_owned(),
        Instant::now(),
        SystemTime::now(),
    ))
}

impl Comm {
    /// The communicator's flight record: its last operations, oldest first, and what is
    /// known of each (see [`flight`](crate::diagnostics::flight)); `None` where the recorder
    /// is off ([`CommConfig::flight_recorder`](crate::CommConfig::flight_recorder)`(0)` or
    /// `NCCL_RS_FLIGHT_RECORDER=0`). Works at any time, also after the communicator failed
    /// or was aborted; briefly takes the communicator's lock to copy the ring.
    pub fn flight_record(&self) -> Option<FlightRecord> {
        let state = self.shared().lock();
        record_of(&state, self.who(), "on demand")
    }

    /// Whose records this communicator's are.
    pub(crate) fn who(&self) -> Who {
        Who {
            rank: self.rank(),
            size: self.size(),
            device: self.device(),
        }
    }
}
