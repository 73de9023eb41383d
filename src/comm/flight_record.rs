//! A communicator's flight record on demand ([`Comm::flight_record`]), the record of the
//! communicator behind a locked state, as the watchdog and abort handles take it, and the
//! hooks through which the owner of a CUDA graph tells the recorder about the graph
//! ([`Comm::graph_capture_mark`], [`Comm::record_graph`]; see
//! [CUDA graphs](crate::diagnostics::flight#cuda-graphs)).

use std::sync::atomic::AtomicU64;
use std::time::{Instant, SystemTime};

use super::{Comm, State};
use crate::diagnostics::flight::{
    nccl_tag, shipped_tag, FlightRecord, GraphCaptureMark, RecordedGraph, Who,
};

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

    /// Marks the recorder's counters at one end of a CUDA stream capture that may take this
    /// communicator's operations: on every rank, right before the capture begins
    /// (`cuStreamBeginCapture`) and right after it ends (`cuStreamEndCapture`), then
    /// [`Comm::record_graph`] with both once the ranks agreed on the capture. Records
    /// nothing; briefly takes the communicator's lock. Where the recorder is off the mark
    /// holds nothing and the graph recorded with it gets no number.
    pub fn graph_capture_mark(&self) -> GraphCaptureMark {
        let state = self.shared().lock();
        GraphCaptureMark {
            raw: state.flight.as_deref().map(|ring| ring.graph_mark()),
        }
    }

    /// Records a CUDA graph captured on `stream` (the raw `cudaStream_t` that was capturing)
    /// between the marks `began` and `ended` ([`Comm::graph_capture_mark`]): it gets the next
    /// graph number on the communicator (from 1, in the order graphs are recorded), and the
    /// operations recorded on `stream` between the marks (NCCL's and the shipped kernels',
    /// refused ones excepted) are its captured operations, run at each of its replays; what
    /// came after `ended` (the ranks' agreement on the capture, say) is not. Returns the
    /// handle that records the graph's launches ([`RecordedGraph::record_replay`]); keep it
    /// as long as the graph (its drop marks the graph's counters dropped). Where the recorder
    /// is off the handle has no number and records nothing. Briefly takes the communicator's
    /// lock, and reads the ring's entries recorded between the marks.
    ///
    /// The caller's rule: record a graph only once every rank's capture succeeded and the
    /// ranks agreed on it, on every rank, in the same order, so that the same number is the
    /// same graph on every rank (as creating shipped-kernel instances collectively numbers
    /// them alike). A capture that failed on one rank is recorded on none: every rank gives
    /// its numbers back with [`Comm::discard_capture`] instead.
    /// A graph that captured operations of several communicators is recorded on each, with
    /// marks of each. A `began` of another communicator captures nothing here (the graph is
    /// still numbered); an `ended` of another means now.
    pub fn record_graph(
        &self,
        began: GraphCaptureMark,
        ended: GraphCaptureMark,
        stream: u64,
    ) -> RecordedGraph {
        let number = self
            .shared()
            .lock()
            .flight
            .as_deref_mut()
            .map(|ring| ring.new_graph(began.raw, ended.raw, stream, nccl_tag));
        RecordedGraph {
            holder: self.shared().clone(),
            number,
            launched: AtomicU64::new(0),
        }
    }

    /// Takes back what a capture on `stream` between `began` and `ended` numbered in the
    /// flight recorder, for a capture the ranks refused after it ended (one rank's failed,
    /// say): on every rank, alike, instead of [`Comm::record_graph`]. What it captured never
    /// runs, and a rank whose capture failed partway numbered fewer collectives (and shipped
    /// calls) than its peers, which would leave every later one compared a number or more
    /// off; so the captured ones lose their numbers (their entries stay), the ones recorded
    /// since are renumbered, and the counters go back to where they were at `began`. Briefly
    /// takes the communicator's lock; marks of another communicator give back nothing.
    pub fn discard_capture(&self, began: GraphCaptureMark, ended: GraphCaptureMark, stream: u64) {
        if let Some(ring) = self.shared().lock().flight.as_deref_mut() {
            ring.discard_capture(began.raw, ended.raw, stream, nccl_tag, shipped_tag);
        }
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

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::comm::Shared;
    use crate::diagnostics::flight::{FlightRing, RingHolder};

    /// A recorded graph's reports reach the ring through the communicator's shared state:
    /// under its lock, not at all while the lock stays held past the wait, and never where
    /// the recorder is off.
    #[test]
    fn the_shared_state_holds_the_ring_for_recorded_graphs() {
        let mut ring = FlightRing::new(8, 7, None).unwrap();
        let mark = ring.graph_mark();
        let number = ring.new_graph(Some(mark), None, 7, nccl_tag);
        let shared = Arc::new(Shared::new(std::ptr::null_mut(), true, Some(ring)));
        let graph = RecordedGraph {
            holder: shared.clone(),
            number: Some(number),
            launched: AtomicU64::new(0),
        };
        graph.record_replay(7, false); // replay 1, recorded
        {
            let _held = shared.lock();
            let start = Instant::now();
            let mut reached = false;
            shared.with_ring(Duration::from_millis(20), &mut |_| reached = true);
            assert!(!reached);
            assert!(start.elapsed() >= Duration::from_millis(20));
        }
        let mut reached = 0;
        shared.with_ring(Duration::ZERO, &mut |ring| {
            reached += 1;
            assert_eq!(ring.snapshot().graphs[0].replays, 1);
        });
        assert_eq!(reached, 1);
        assert_eq!(graph.launched.load(Ordering::Relaxed), 1);
        drop(graph);
        let snap = shared.lock().flight.as_deref().unwrap().snapshot();
        assert_eq!(snap.recorded, 1);
        assert!(snap.graphs[0].dropped);
        // Recorder off: the ring is never reached.
        let off = Shared::new(std::ptr::null_mut(), true, None);
        off.with_ring(Duration::ZERO, &mut |_| {
            panic!("no ring where the recorder is off")
        });
    }
}
