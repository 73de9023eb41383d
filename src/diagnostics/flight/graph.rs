//! The flight record of CUDA graphs: the handles through which a graph's owner tells the
//! recorder about it ([`GraphCaptureMark`], [`RecordedGraph`], made by
//! [`Comm::graph_capture_mark`](crate::Comm::graph_capture_mark) and
//! [`Comm::record_graph`](crate::Comm::record_graph)), where a recorded launch stands among
//! its graph's replays ([`GraphReplay`]), and each recorded graph's counters
//! ([`CapturedGraph`]). The rules are in the [flight module docs](super#cuda-graphs).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::op_kind::OpKind;
use super::ring::{FlightRing, GraphRow, RawMark, RawReplay};

/// Where a CUDA stream capture began or ended on a communicator
/// ([`Comm::graph_capture_mark`](crate::Comm::graph_capture_mark)), for
/// [`Comm::record_graph`](crate::Comm::record_graph), one taken as the capture began and one
/// as it ended. Plain counters:
/// taking one and dropping it (a capture that failed) changes nothing.
#[derive(Debug)]
#[must_use = "marks are for `Comm::record_graph`, one as the capture began, one as it ended"]
pub struct GraphCaptureMark {
    /// The ring's counters then; `None` where the recorder is off.
    pub(crate) raw: Option<RawMark>,
}

/// A CUDA graph recorded on its communicator's flight recorder
/// ([`Comm::record_graph`](crate::Comm::record_graph)), through which its owner records
/// each of the graph's launches ([`RecordedGraph::record_replay`]). `Send` and `Sync`: it
/// holds the communicator's shared state, not the communicator, so it may live with the
/// graph wherever that goes, also past the communicator (its records then still reach the
/// ring, which outlives the communicator's handle). Dropping it marks the graph's counters
/// dropped, after which the recorder may forget them (see [CUDA graphs](super#cuda-graphs)).
#[must_use = "dropping it marks the graph dropped: its replays go unrecorded"]
pub struct RecordedGraph {
    /// Where its reports go: the communicator's shared state, whose lock guards the ring.
    pub(crate) holder: Arc<dyn RingHolder>,
    /// Its number on the communicator; `None` where the recorder is off.
    pub(crate) number: Option<u32>,
    /// Its launches that succeeded so far: the replays' numbers are counted here, not in the
    /// ring, so that a report the ring could not take leaves the next ones numbered right.
    pub(crate) launched: AtomicU64,
}

/// Where a recorded graph's reports go: its communicator's flight ring, reached under the
/// communicator's lock (the communicator's shared state implements it, in the `comm` module,
/// which this one does not know).
pub(crate) trait RingHolder: Send + Sync {
    /// Runs `f` on the ring where the lock is had within `wait` and the recorder is on;
    /// otherwise does nothing.
    fn with_ring(&self, wait: Duration, f: &mut dyn FnMut(&mut FlightRing));
}

/// How long a report waits for the communicator's lock. Its holders keep it for microseconds,
/// except an abort (its bounded wait) and a destroy or finalize, which NCCL holds until every
/// graph that captured the communicator is destroyed: a report waiting for those would keep
/// the graph, and so the destroy, waiting forever. Past this the report is left out (the
/// replay keeps its number; the ring just lacks its entry, as one it no longer holds).
const REPORT_WAIT: Duration = Duration::from_millis(100);

impl RecordedGraph {
    /// The graph's number on the communicator (from 1, in the order graphs are recorded;
    /// [`GraphReplay::graph`] in the record); `None` where the recorder is off.
    pub fn number(&self) -> Option<u32> {
        self.number
    }

    /// Records one launch of the graph (`cuGraphLaunch`) on `stream` (the raw
    /// `cudaStream_t`), `refused` where the launch returned an error (so the graph never
    /// runs): one entry in the communicator's ring, numbered with its other operations
    /// ([`FlightEntry::seq`](super::FlightEntry::seq)), of kind [`OpKind::GraphReplay`],
    /// with its number among the graph's replays (from 1; a refused launch takes none) and
    /// the number of operations the graph captured as its count.
    ///
    /// Call it right after each launch, on every rank: a watchdog's probe or a synchronize
    /// that comes after the entry then also comes after the launch on the stream, so it
    /// marks the replay complete only once the replay is (where `stream` is the
    /// communicator's own). Costs what recording an NCCL operation does: under the
    /// communicator's lock, one slot written and one counter found by a binary search among
    /// the kept graphs; no allocation, no CUDA call. The lock is waited for at most 100 ms:
    /// a destroy or finalize of the communicator holds it until every graph that captured it
    /// is destroyed, so a report made meanwhile is left out rather than keep the graph (and
    /// so the destroy) waiting; later replays keep their numbers. Does nothing where the
    /// recorder is off.
    pub fn record_replay(&self, stream: u64, refused: bool) {
        let Some(graph) = self.number else {
            return;
        };
        let launched = if refused {
            0
        } else {
            self.launched.fetch_add(1, Ordering::Relaxed) + 1
        };
        let replay = RawReplay::launch(graph, stream, launched, refused);
        self.holder
            .with_ring(REPORT_WAIT, &mut |ring| ring.record_replay(replay));
    }
}

/// Marks the graph's counters dropped, unless the communicator's lock stays held past
/// 100 ms (a destroy waiting for this graph): then the row just stays.
impl Drop for RecordedGraph {
    fn drop(&mut self) {
        if let Some(graph) = self.number {
            self.holder
                .with_ring(REPORT_WAIT, &mut |ring| ring.graph_dropped(graph));
        }
    }
}

impl fmt::Debug for RecordedGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RecordedGraph")
            .field("number", &self.number)
            .finish_non_exhaustive()
    }
}

/// Where a recorded launch of a CUDA graph stands among its graph's replays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphReplay {
    /// The graph's number on the communicator, from 1 in the order graphs are recorded
    /// ([`RecordedGraph::number`]): ranks that record their
    /// graphs collectively, in the same order, number them alike.
    pub graph: u32,
    /// Its number among the graph's replays, from 1 (ranks are compared by it); `None` where
    /// the launch failed (the graph never ran, so it takes no number) or the graph's counters
    /// were forgotten.
    pub seq: Option<u64>,
}

/// One CUDA graph recorded on the communicator: its counters, which outlive what the ring
/// keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CapturedGraph {
    /// Its number on the communicator (see [`GraphReplay::graph`]).
    pub graph: u32,
    /// The first operation number ([`FlightEntry::seq`](super::FlightEntry::seq)) after its
    /// capture began. It captured the operations numbered `captured_from` to
    /// `captured_through` that were on `stream` and not refused (each of those the ring
    /// still holds says so: [`FlightEntry::captured_in`](super::FlightEntry::captured_in)).
    pub captured_from: u64,
    /// The last operation number when it was recorded (`captured_from - 1` where none came
    /// between).
    pub captured_through: u64,
    /// The raw `cudaStream_t` that captured it.
    pub stream: u64,
    /// The operations it captured (NCCL's and the shipped kernels'), run at each replay.
    pub operations: u64,
    /// NCCL collectives among them.
    pub collectives: u64,
    /// Its replays recorded so far (its last replay number).
    pub replays: u64,
    /// Whether its owner ([`RecordedGraph`]) was dropped.
    pub dropped: bool,
}

impl CapturedGraph {
    pub(crate) fn from_row(row: &GraphRow) -> CapturedGraph {
        CapturedGraph {
            graph: row.graph,
            captured_from: row.first,
            captured_through: row.last,
            stream: row.stream,
            operations: row.operations,
            collectives: row.collectives,
            replays: row.replays,
            dropped: row.dropped,
        }
    }
}

/// `n captured operations`, in the singular for one.
pub(super) fn captured_operations(n: u64) -> String {
    let s = if n == 1 { "" } else { "s" };
    format!("{n} captured operation{s}")
}

impl fmt::Display for CapturedGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CUDA graph #{}: {}",
            self.graph,
            captured_operations(self.operations)
        )?;
        if self.operations > 0 {
            write!(
                f,
                " ({} collective(s); from #{} to #{} on stream {:#x})",
                self.collectives, self.captured_from, self.captured_through, self.stream
            )?;
        }
        write!(
            f,
            ", {} replay(s){}",
            self.replays,
            if self.dropped { ", dropped" } else { "" }
        )
    }
}

impl RawReplay {
    /// A launch of graph `graph` on the raw stream `stream`, the owner's `launched`-th that
    /// succeeded (0 and `refused` where it failed).
    #[inline(always)]
    pub(crate) fn launch(graph: u32, stream: u64, launched: u64, refused: bool) -> RawReplay {
        RawReplay {
            graph,
            tag: OpKind::GraphReplay.tag(),
            stream,
            launched,
            refused,
        }
    }
}

/// Whether a slot's raw tag is a shipped kernel's call (its `coll_seq` then a call number of
/// its instance), for [`FlightRing::discard_capture`](super::FlightRing::discard_capture).
pub(crate) fn shipped_tag(tag: u8) -> bool {
    OpKind::ALL
        .get(usize::from(tag))
        .is_some_and(|kind| kind.is_shipped())
}

/// Whether a slot's raw tag is an NCCL operation's (its `coll_seq` then a collective number),
/// for [`FlightRing::new_graph`](super::FlightRing::new_graph), which cannot know.
pub(crate) fn nccl_tag(tag: u8) -> bool {
    OpKind::ALL
        .get(usize::from(tag))
        .is_some_and(|kind| kind.is_nccl())
}

#[cfg(test)]
mod tests {
    use std::time::{Instant, SystemTime};

    use parking_lot::{Mutex, MutexGuard};

    use super::super::record::{FlightRecord, OpState, Who};
    use super::super::ring::{RawKind, RawOp, NO_RANK};
    use super::*;
    use crate::dtype::DataType;

    /// A stand-in for the communicator's shared state: its ring (none: the recorder is off)
    /// behind a lock of the same kind (parking_lot's, waited for with `try_lock_for`), so
    /// that a report while the lock is held is left out as it is on a communicator.
    struct Held(Mutex<Option<Box<FlightRing>>>);

    impl Held {
        fn new(ring: Option<Box<FlightRing>>) -> Arc<Held> {
            Arc::new(Held(Mutex::new(ring)))
        }

        fn lock(&self) -> MutexGuard<'_, Option<Box<FlightRing>>> {
            self.0.lock()
        }
    }

    impl RingHolder for Held {
        fn with_ring(&self, wait: Duration, f: &mut dyn FnMut(&mut FlightRing)) {
            if let Some(mut ring) = self.0.try_lock_for(wait) {
                if let Some(ring) = ring.as_deref_mut() {
                    f(ring);
                }
            }
        }
    }

    fn all_reduce(count: usize, stream: u64) -> RawOp {
        RawOp {
            kind: RawKind {
                tag: OpKind::AllReduce.tag(),
                rank: NO_RANK,
            },
            collective: true,
            count,
            dtype: 7,
            op: 0,
            stream,
            in_group: false,
            refused: false,
        }
    }

    fn record_of(shared: &Held) -> FlightRecord {
        let snap = shared.lock().as_deref().unwrap().snapshot();
        let who = Who {
            rank: 0,
            size: 2,
            device: 0,
        };
        let now = (Instant::now(), SystemTime::now());
        FlightRecord::from_snapshot(snap, who, "test".into(), now.0, now.1)
    }

    /// The whole path: the ring, the handle, the record, its text and its JSON.
    #[test]
    fn replays_and_captured_operations_reach_the_record_its_text_and_json() {
        let mut ring = FlightRing::new(16, 7, None).unwrap();
        ring.record(all_reduce(1, 7)); // #1, before the capture
        let mark = GraphCaptureMark {
            raw: Some(ring.graph_mark()),
        };
        ring.record(all_reduce(2, 7)); // #2, captured
        ring.record(all_reduce(3, 9)); // #3, another stream: not captured
        let number = ring.new_graph(mark.raw, None, 7, nccl_tag);
        let shared = Held::new(Some(ring));
        let graph = RecordedGraph {
            holder: shared.clone(),
            number: Some(number),
            launched: AtomicU64::new(0),
        };
        assert_eq!(graph.number(), Some(1));
        graph.record_replay(7, false); // #4, G1.1
        graph.record_replay(7, true); // #5, G1.-
        graph.record_replay(7, false); // #6, G1.2
        graph.record_replay(9, false); // #7, G1.3 on another stream
        if let Some(ring) = shared.lock().as_deref_mut() {
            ring.completed_before(8);
        }
        drop(graph);
        let rec = record_of(&shared);
        let replay = |seq| Some(GraphReplay { graph: 1, seq });
        use OpState::{Completed, Enqueued, Refused};
        let seen: Vec<_> = rec
            .entries
            .iter()
            .map(|e| (e.kind, e.collective_seq, e.replay, e.captured_in, e.state))
            .collect();
        assert_eq!(
            seen,
            vec![
                (OpKind::AllReduce, Some(1), None, None, Completed),
                (OpKind::AllReduce, Some(2), None, Some(1), Completed),
                (OpKind::AllReduce, Some(3), None, None, Enqueued),
                (OpKind::GraphReplay, None, replay(Some(1)), None, Completed),
                (OpKind::GraphReplay, None, replay(None), None, Refused),
                (OpKind::GraphReplay, None, replay(Some(2)), None, Completed),
                // Only the communicator's own stream is seen complete.
                (OpKind::GraphReplay, None, replay(Some(3)), None, Enqueued),
            ]
        );
        let last = &rec.entries[5];
        assert_eq!(
            (last.count, last.dtype, last.root, last.peer),
            (1, None, None, None)
        );
        assert_eq!(
            last.describe(),
            "GraphReplay graph #1 (1 captured operation) replay #2"
        );
        assert_eq!(
            rec.entries[1].describe(),
            "AllReduce ncclFloat32 x 2 sum, captured in graph #1"
        );
        assert_eq!(rec.entries[1].dtype, Some(DataType::Float32));
        assert_eq!(
            rec.graphs,
            vec![CapturedGraph {
                graph: 1,
                captured_from: 2,
                captured_through: 3,
                stream: 7,
                operations: 1,
                collectives: 1,
                replays: 3,
                dropped: true,
            }]
        );
        assert_eq!(rec.graph_replays(1).count(), 4);
        assert_eq!(rec.captured_graph(1).map(|g| g.replays), Some(3));
        // A replay is the same operation only as a replay of the same graph.
        let mut other = rec.entries[3].clone();
        assert!(other.same_operation(&rec.entries[5]));
        other.replay = Some(GraphReplay {
            graph: 2,
            seq: Some(1),
        });
        assert!(!other.same_operation(&rec.entries[5]));
        let text = rec.to_string();
        for needle in [
            "G1.1 ",
            "G1.- ",
            "G1.3 ",
            "c2 ",
            "captured in graph #1",
            "CUDA graph #1: 1 captured operation (1 collective(s); from #2 to #3 on stream \
             0x7), 3 replay(s), dropped",
        ] {
            assert!(text.contains(needle), "{needle:?} in\n{text}");
        }
        assert_eq!(FlightRecord::from_json(&rec.to_json()).unwrap(), rec);
    }

    #[test]
    fn a_graph_recorded_with_the_recorder_off_records_nothing() {
        // Compiles only where the handles may move to and be shared with other threads.
        fn send_and_sync<T: Send + Sync>(value: T) -> T {
            value
        }
        let mark = send_and_sync(GraphCaptureMark { raw: None });
        assert_eq!(mark.raw, None);
        // Recorder off: no ring, no number; replays and the drop do nothing.
        let off = Held::new(None);
        let graph = send_and_sync(RecordedGraph {
            holder: off.clone(),
            number: None,
            launched: AtomicU64::new(0),
        });
        graph.record_replay(7, false);
        assert_eq!(graph.number(), None);
        assert_eq!(format!("{graph:?}"), "RecordedGraph { number: None, .. }");
        drop(graph);
        assert!(off.lock().is_none());
        // A ring whose graph was numbered: a replay of a number it never gave is recorded
        // without a replay number.
        let ring = FlightRing::new(4, 7, None);
        let on = Held::new(ring);
        let stray = RecordedGraph {
            holder: on.clone(),
            number: Some(5),
            launched: AtomicU64::new(0),
        };
        stray.record_replay(7, false);
        drop(stray);
        let rec = record_of(&on);
        assert_eq!(rec.recorded, 1);
        assert_eq!(
            rec.entries[0].replay,
            Some(GraphReplay {
                graph: 5,
                seq: None
            })
        );
        assert!(rec.graphs.is_empty());
    }

    #[test]
    fn nccl_tags_are_those_numbered_among_the_collectives() {
        for kind in OpKind::ALL {
            assert_eq!(nccl_tag(kind.tag()), kind.is_nccl(), "{kind:?}");
        }
        assert!(!nccl_tag(OpKind::GraphReplay.tag()));
        assert!(!nccl_tag(OpKind::LsaAllGather.tag()));
        assert!(nccl_tag(OpKind::Send.tag()));
        assert!(!nccl_tag(200));
        assert_eq!(OpKind::from_name("GraphReplay"), Some(OpKind::GraphReplay));
    }

    /// A report while the communicator's lock is held (a destroy waiting for this graph)
    /// gives up after `REPORT_WAIT` instead of waiting for ever, and the next report still
    /// carries the right replay number.
    #[test]
    fn a_report_never_waits_for_a_held_lock_and_numbers_stay_right() {
        let mut ring = FlightRing::new(16, 7, None).unwrap();
        let mark = ring.graph_mark();
        ring.record(all_reduce(1, 7));
        let number = ring.new_graph(Some(mark), None, 7, nccl_tag);
        let shared = Held::new(Some(ring));
        let graph = RecordedGraph {
            holder: shared.clone(),
            number: Some(number),
            launched: AtomicU64::new(0),
        };
        graph.record_replay(7, false); // replay 1, recorded
        {
            let _held = shared.lock();
            let start = std::time::Instant::now();
            graph.record_replay(7, false); // replay 2, left out
            let waited = start.elapsed();
            assert!(
                waited >= REPORT_WAIT && waited < REPORT_WAIT * 20,
                "{waited:?}"
            );
        }
        graph.record_replay(7, false); // replay 3, recorded
        let replays: Vec<Option<u64>> = {
            let state = shared.lock();
            let snap = state.as_deref().unwrap().snapshot();
            snap.slots
                .iter()
                .filter(|slot| slot.kind.tag == OpKind::GraphReplay.tag())
                .map(|slot| Some(slot.coll_seq))
                .collect()
        };
        assert_eq!(replays, vec![Some(1), Some(3)]);
        assert_eq!(
            shared.lock().as_deref().unwrap().snapshot().graphs[0].replays,
            3
        );
    }
}
