//! The CUDA graphs' hooks in the ring (see the [module docs](super::super#cuda-graphs)): a
//! mark of the counters before a capture, each recorded graph's counters, kept in a small
//! table beside the slots, and its replays, written in the slots like NCCL's operations.
//!
//! Imports nothing above the ring.

use std::time::Instant;

use super::{FlightRing, RawKind, Slot, NO_GROUP};

/// The ring's counters when a stream capture began ([`FlightRing::graph_mark`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawMark {
    /// The ring's communicator ([`FlightRing::serial`]): a mark of another ring captures
    /// nothing in this one.
    serial: u64,
    /// Operations recorded before the capture began: it captured those numbered after.
    recorded: u64,
    /// Collectives recorded before it.
    collectives: u64,
}

/// One launch of a recorded graph as its owner hands it to [`FlightRing::record_replay`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawReplay {
    /// The graph's number on the communicator ([`FlightRing::new_graph`]).
    pub(crate) graph: u32,
    /// [`super::super::OpKind::GraphReplay`] as a number.
    pub(crate) tag: u8,
    /// The raw `cudaStream_t` it was launched on.
    pub(crate) stream: u64,
    /// The owner's count of the graph's launches that succeeded, this one included: its
    /// number among the replays (0 where it failed). Counted by the owner, so that a report
    /// the ring could not take leaves the next ones numbered right.
    pub(crate) launched: u64,
    /// Whether the launch failed (so the graph never runs).
    pub(crate) refused: bool,
}

/// The counters of one recorded graph, which outlive what the ring keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GraphRow {
    /// Its number on the communicator, from 1 in the order graphs are recorded.
    pub(crate) graph: u32,
    /// The first operation number after the capture began. It captured the operations
    /// numbered `first` to `last` that were on `stream` and not refused.
    pub(crate) first: u64,
    /// The last operation number when the graph was recorded (`first - 1`: none).
    pub(crate) last: u64,
    /// The raw `cudaStream_t` that captured it.
    pub(crate) stream: u64,
    /// Operations it captured.
    pub(crate) operations: u64,
    /// NCCL collectives among them.
    pub(crate) collectives: u64,
    /// Replays recorded (launched) so far: the last replay number given.
    pub(crate) replays: u64,
    /// Whether its owner was dropped.
    pub(crate) dropped: bool,
}

impl GraphRow {
    /// Whether the operation of `seq` on `stream` is among those the graph captured (one
    /// NCCL refused was never captured: the caller checks that).
    pub(crate) fn holds(&self, seq: u64, stream: u64) -> bool {
        stream == self.stream && (self.first..=self.last).contains(&seq)
    }
}

/// How many graph rows a ring keeps before it forgets the oldest dropped ones (rows of live
/// graphs are always kept: each graph holds far more memory than its row).
pub(crate) const KEPT_GRAPHS: usize = 64;

/// The CUDA graphs' hooks, called by the communicator (`Comm::graph_capture_mark`,
/// `Comm::record_graph`) and by a recorded graph (`RecordedGraph`) under the communicator's
/// lock.
impl FlightRing {
    /// The counters now, for a stream capture about to begin.
    pub(crate) fn graph_mark(&self) -> RawMark {
        RawMark {
            serial: self.serial,
            recorded: self.recorded,
            collectives: self.collectives,
        }
    }

    /// Numbers a new graph (from 1, in the order graphs are recorded: ranks that record
    /// theirs collectively in the same order number them alike) that captured the operations
    /// on `stream` recorded between `began` and `ended` (none where `began` is of another
    /// ring, or of a ring that was off; up to now where `ended` is), and keeps its counters.
    /// `nccl` says whether a slot's tag is an NCCL operation's (its `coll_seq` a collective
    /// number), which the ring cannot know.
    ///
    /// Reads the slots recorded between the marks (once per capture, not per operation);
    /// operations the ring no longer holds (a capture of more than it keeps) count as
    /// captured. Allocates at most once (a row); forgets the oldest dropped graph's row past
    /// [`KEPT_GRAPHS`] rows.
    pub(crate) fn new_graph(
        &mut self,
        began: Option<RawMark>,
        ended: Option<RawMark>,
        stream: u64,
        nccl: fn(u8) -> bool,
    ) -> u32 {
        let now = self.graph_mark();
        let ours = |m: &RawMark| m.serial == self.serial;
        let ended = ended.filter(ours).unwrap_or(now);
        let began = began.filter(ours).unwrap_or(ended);
        let last = ended.recorded.min(self.recorded);
        let first = began.recorded.min(last) + 1;
        let mut operations = last + 1 - first;
        let mut collectives = ended.collectives.saturating_sub(began.collectives);
        // What the ring still holds of them that the capture did not take: other streams'
        // operations, and refused ones (never enqueued; they hold no collective number).
        // Operation `seq` sits `recorded - seq + 1` slots behind the cursor.
        let len = self.slots.len() as u64;
        // Only the operations the ring still holds: the oldest is `len` slots behind.
        let oldest_held = self.recorded.saturating_sub(len) + 1;
        for seq in first.max(oldest_held)..=last {
            let back = self.recorded - seq + 1;
            let at = ((self.cursor as u64 + len - back) % len) as usize;
            let Some(slot) = self.slots.get(at) else {
                continue;
            };
            if slot.stream != stream || slot.refused {
                operations -= 1;
                if slot.coll_seq != 0 && nccl(slot.kind.tag) {
                    collectives = collectives.saturating_sub(1);
                }
            }
        }
        self.graphs_created = self.graphs_created.saturating_add(1);
        if self.graphs.len() >= KEPT_GRAPHS {
            if let Some(oldest) = self.graphs.iter().position(|row| row.dropped) {
                self.graphs.remove(oldest);
            }
        }
        self.graphs.push(GraphRow {
            graph: self.graphs_created,
            first,
            last,
            stream,
            operations,
            collectives,
            replays: 0,
            dropped: false,
        });
        self.graphs_created
    }

    fn graph_mut(&mut self, graph: u32) -> Option<&mut GraphRow> {
        let at = self
            .graphs
            .binary_search_by_key(&graph, |row| row.graph)
            .ok()?;
        self.graphs.get_mut(at)
    }

    /// Records one launch of a recorded graph: the same cost as [`FlightRing::record`] and a
    /// binary search among the kept graphs (a handful). A launch that failed takes no replay
    /// number, as a refused collective takes no collective number.
    #[inline]
    pub(crate) fn record_replay(&mut self, replay: RawReplay) {
        self.recorded += 1;
        let (number, operations) = match self.graph_mut(replay.graph) {
            Some(row) if !replay.refused => {
                row.replays = row.replays.max(replay.launched);
                (replay.launched, row.operations)
            }
            Some(row) => (0, row.operations),
            None => (0, 0),
        };
        self.write(Slot {
            seq: self.recorded,
            coll_seq: number,
            count: operations,
            stream: replay.stream,
            enqueued: Instant::now(),
            group: NO_GROUP,
            kind: RawKind {
                tag: replay.tag,
                rank: replay.graph,
            },
            dtype: 0,
            op: 0,
            refused: replay.refused,
        });
    }

    /// `graph`'s owner was dropped: its row may be forgotten once [`KEPT_GRAPHS`] rows are
    /// kept.
    pub(crate) fn graph_dropped(&mut self, graph: u32) {
        if let Some(row) = self.graph_mut(graph) {
            row.dropped = true;
        }
    }

    /// Gives back the numbers a capture on `stream` between `began` and `ended` took, for a
    /// capture the ranks refused (every rank calls this alike): what it captured never runs,
    /// and a rank whose capture failed partway numbered fewer operations than its peers, so
    /// every later collective and shipped call would be compared one or more numbers off.
    /// The captured NCCL collectives and shipped calls lose their numbers (their entries
    /// stay), the ones recorded after `ended` are renumbered, and the counters go back.
    /// Marks of another ring (or none) give back nothing. `nccl` and `shipped` say which
    /// tags number collectives and shipped calls, which the ring cannot know. Rare (a refused
    /// capture): reads the slots recorded since `began` and allocates a little.
    pub(crate) fn discard_capture(
        &mut self,
        began: Option<RawMark>,
        ended: Option<RawMark>,
        stream: u64,
        nccl: fn(u8) -> bool,
        shipped: fn(u8) -> bool,
    ) {
        let ours = |m: &Option<RawMark>| m.filter(|m| m.serial == self.serial);
        let (Some(began), Some(ended)) = (ours(&began), ours(&ended)) else {
            return;
        };
        let last = ended.recorded.min(self.recorded);
        let first = began.recorded.min(last) + 1;
        // Collectives numbered between the marks, less those the ring shows were not
        // captured (other streams; refused ones took no number).
        let mut collectives = ended.collectives.saturating_sub(began.collectives);
        // Shipped calls given back, per instance.
        let mut calls: Vec<(u32, u64)> = Vec::new();
        let len = self.slots.len() as u64;
        let oldest_held = self.recorded.saturating_sub(len) + 1;
        let cursor = self.cursor as u64;
        let at = |seq: u64, recorded: u64| ((cursor + len - (recorded - seq + 1)) % len) as usize;
        for seq in first.max(oldest_held)..=self.recorded {
            let index = at(seq, self.recorded);
            let Some(slot) = self.slots.get_mut(index) else {
                continue;
            };
            if slot.coll_seq == 0 {
                continue;
            }
            let tag = slot.kind.tag;
            if seq <= last {
                let captured = slot.stream == stream && !slot.refused;
                if nccl(tag) {
                    if captured {
                        slot.coll_seq = 0;
                    } else {
                        collectives = collectives.saturating_sub(1);
                    }
                } else if shipped(tag) && captured {
                    slot.coll_seq = 0;
                    let instance = slot.kind.rank;
                    match calls.iter_mut().find(|(i, _)| *i == instance) {
                        Some((_, n)) => *n += 1,
                        None => calls.push((instance, 1)),
                    }
                }
            } else if nccl(tag) {
                slot.coll_seq = slot.coll_seq.saturating_sub(collectives).max(1);
            } else if shipped(tag) {
                let instance = slot.kind.rank;
                if let Some((_, n)) = calls.iter().find(|(i, _)| *i == instance) {
                    slot.coll_seq = slot.coll_seq.saturating_sub(*n).max(1);
                }
            }
        }
        self.collectives = self.collectives.saturating_sub(collectives);
        for (instance, n) in calls {
            if let Some(row) = self.instance_mut(instance) {
                row.calls = row.calls.saturating_sub(n);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{all_reduce, op};
    use super::super::{RawKind, RawShipped};
    use super::*;

    /// Tags as the flight module numbers them: 0 an all-reduce, 10 a shipped all-reduce,
    /// 13 a replay.
    const REPLAY: u8 = 13;

    fn nccl(tag: u8) -> bool {
        tag < 10
    }

    fn shipped(tag: u8) -> bool {
        (10..13).contains(&tag)
    }

    /// A capture refused after one rank's failed partway: rank 0 captured four all-reduces
    /// and a shipped call, rank 1 two all-reduces; both give the numbers back, and what comes
    /// after (the agreement's all-gather, more collectives and shipped calls, on both ranks
    /// alike) is numbered alike, the captured entries left unnumbered.
    #[test]
    fn a_refused_capture_gives_its_numbers_back_on_every_rank() {
        let call = |instance: u32| RawShipped {
            instance,
            tag: 10,
            kernel: 0,
            dtype: 7,
            count: 4,
            stream: 7,
            refused: false,
        };
        let ranks: Vec<Vec<(u64, u64, u8)>> = [(4, 1), (2, 0)]
            .into_iter()
            .map(|(captured, calls)| {
                let mut ring = FlightRing::new(64, 7, None).unwrap();
                let instance = ring.new_shipped_instance();
                ring.record(op(all_reduce(), true, 1, false, false)); // eager
                ring.record_shipped(call(instance)); // eager call #1
                let began = ring.graph_mark();
                for _ in 0..captured {
                    ring.record(op(all_reduce(), true, 2, false, false));
                }
                for _ in 0..calls {
                    ring.record_shipped(call(instance));
                }
                let ended = ring.graph_mark();
                ring.record(op(all_reduce(), true, 3, false, false)); // the agreement
                ring.discard_capture(Some(began), Some(ended), 7, nccl, shipped);
                ring.record(op(all_reduce(), true, 4, false, false));
                ring.record_shipped(call(instance));
                let snap = ring.snapshot();
                assert_eq!(snap.collectives, 3);
                assert_eq!(snap.instances[0].calls, 2);
                snap.slots
                    .iter()
                    .map(|s| (s.count, s.coll_seq, s.kind.tag))
                    .collect()
            })
            .collect();
        // Numbered entries agree; the captured ones (count 2, or shipped between the marks)
        // hold no number.
        let numbered = |r: &Vec<(u64, u64, u8)>| -> Vec<(u64, u64, u8)> {
            r.iter().copied().filter(|&(_, n, _)| n != 0).collect()
        };
        assert_eq!(numbered(&ranks[0]), numbered(&ranks[1]));
        assert_eq!(
            numbered(&ranks[0]),
            vec![(1, 1, 0), (4, 1, 10), (3, 2, 0), (4, 3, 0), (4, 2, 10)]
        );
        assert!(ranks[0].iter().filter(|s| s.0 == 2).all(|s| s.1 == 0));
        assert_eq!(ranks[0].len() - numbered(&ranks[0]).len(), 5);
    }

    fn replay(graph: u32, stream: u64, launched: u64) -> RawReplay {
        RawReplay {
            graph,
            tag: REPLAY,
            stream,
            launched,
            refused: launched == 0,
        }
    }

    #[test]
    fn graphs_number_their_replays_and_a_refused_launch_takes_no_number() {
        let mut ring = FlightRing::new(32, 7, None).unwrap();
        ring.record(op(all_reduce(), true, 1, false, false)); // #1, outside any capture
        let mark = ring.graph_mark();
        ring.record(op(all_reduce(), true, 2, false, false)); // #2, captured
        let shipped = RawShipped {
            instance: 1,
            tag: 10,
            kernel: 0,
            dtype: 7,
            count: 4,
            stream: 7,
            refused: false,
        };
        ring.record_shipped(shipped); // #3, captured (a kernel, not a collective)
        let mut elsewhere = op(all_reduce(), true, 3, false, false);
        elsewhere.stream = 9;
        ring.record(elsewhere); // #4, another stream: not captured
        ring.record(op(all_reduce(), true, 4, false, true)); // #5, refused: not captured
        let send = RawKind { tag: 8, rank: 1 };
        ring.record(op(send, false, 5, false, false)); // #6, captured
        let first = ring.new_graph(Some(mark), None, 7, nccl);
        // A mark of no ring (recorder off) or another one captures nothing, but numbers.
        let empty = ring.new_graph(None, None, 7, nccl);
        let other = FlightRing::new(4, 7, None).unwrap().graph_mark();
        let foreign = ring.new_graph(Some(other), None, 7, nccl);
        assert_eq!((first, empty, foreign), (1, 2, 3));
        let rows = ring.snapshot().graphs;
        assert_eq!(
            rows[0],
            GraphRow {
                graph: 1,
                first: 2,
                last: 6,
                stream: 7,
                operations: 3,
                collectives: 1,
                replays: 0,
                dropped: false,
            }
        );
        assert!(rows[0].holds(2, 7) && rows[0].holds(6, 7));
        assert!(!rows[0].holds(1, 7) && !rows[0].holds(7, 7) && !rows[0].holds(4, 9));
        assert_eq!((rows[1].operations, rows[1].first, rows[1].last), (0, 7, 6));
        assert_eq!(rows[2].operations, 0);

        ring.record_replay(replay(first, 7, 1)); // #7: replay 1
        ring.record_replay(replay(first, 7, 0)); // #8: refused, no number
        ring.record_replay(replay(first, 7, 2)); // #9: replay 2
        ring.record_replay(replay(empty, 7, 1)); // #10: graph 2's replay 1
        ring.record_replay(replay(9, 7, 1)); // #11: no such graph: no number
        let snap = ring.snapshot();
        let seen: Vec<(u64, u64, u32, u64, bool)> = snap.slots[6..]
            .iter()
            .map(|s| (s.seq, s.coll_seq, s.kind.rank, s.count, s.refused))
            .collect();
        assert_eq!(
            seen,
            vec![
                (7, 1, 1, 3, false),
                (8, 0, 1, 3, true),
                (9, 2, 1, 3, false),
                (10, 1, 2, 0, false),
                (11, 0, 9, 0, false),
            ]
        );
        assert!(snap.slots[6..].iter().all(|s| s.kind.tag == REPLAY));
        // Replays are numbered among all operations, never among the collectives.
        assert_eq!((snap.recorded, snap.collectives), (11, 3));
        assert_eq!(snap.graphs[0].replays, 2);
        assert_eq!(snap.graphs[1].replays, 1);
        assert_eq!(ring.next_seq(), 12);
    }

    #[test]
    fn operations_after_the_end_mark_are_not_captured() {
        let mut ring = FlightRing::new(16, 7, None).unwrap();
        let began = ring.graph_mark();
        ring.record(op(all_reduce(), true, 1, false, false)); // #1, captured
        ring.record(op(all_reduce(), true, 2, false, false)); // #2, captured
        let ended = ring.graph_mark();
        // The ranks' agreement on the capture, on the same stream, after it ended.
        ring.record(op(all_reduce(), true, 3, false, false)); // #3
        let graph = ring.new_graph(Some(began), Some(ended), 7, nccl);
        let row = ring.snapshot().graphs[0];
        assert_eq!(graph, 1);
        assert_eq!(
            (row.first, row.last, row.operations, row.collectives),
            (1, 2, 2, 2)
        );
        assert!(!row.holds(3, 7));
        // An end mark of another ring means "now".
        let other = FlightRing::new(4, 7, None).unwrap().graph_mark();
        ring.new_graph(Some(began), Some(other), 7, nccl);
        let row = ring.snapshot().graphs[1];
        assert_eq!(
            (row.first, row.last, row.operations, row.collectives),
            (1, 3, 3, 3)
        );
    }

    #[test]
    fn a_capture_longer_than_the_ring_counts_what_it_lost_as_captured() {
        let mut ring = FlightRing::new(4, 7, None).unwrap();
        let mark = ring.graph_mark();
        for count in 0..10 {
            ring.record(op(all_reduce(), true, count, false, false));
        }
        let mut elsewhere = op(all_reduce(), true, 99, false, false);
        elsewhere.stream = 9;
        ring.record(elsewhere);
        ring.new_graph(Some(mark), None, 7, nccl);
        let row = ring.snapshot().graphs[0];
        // 11 recorded, the one on stream 9 still held: 10 captured, all collectives.
        assert_eq!((row.first, row.last), (1, 11));
        assert_eq!((row.operations, row.collectives), (10, 10));
    }

    #[test]
    fn only_dropped_graph_rows_are_forgotten() {
        let mut ring = FlightRing::new(4, 7, None).unwrap();
        let first = ring.new_graph(None, None, 7, nccl);
        let second = ring.new_graph(None, None, 7, nccl);
        ring.graph_dropped(first);
        for _ in 2..KEPT_GRAPHS + 5 {
            ring.new_graph(None, None, 7, nccl);
        }
        let rows = ring.snapshot().graphs;
        // The dropped row went once the table was full; live rows are all kept.
        assert_eq!(rows.len(), KEPT_GRAPHS + 4);
        assert_eq!(rows[0].graph, second);
        assert!(rows.windows(2).all(|w| w[0].graph < w[1].graph));
        // A replay of a forgotten graph is still recorded, without a replay number.
        ring.record_replay(replay(first, 7, 1));
        let last = ring.snapshot().slots.last().copied().unwrap();
        assert_eq!((last.coll_seq, last.kind.rank), (0, first));
        // Dropped rows beyond the bound go one per new graph, oldest first.
        for graph in 2..=6 {
            ring.graph_dropped(graph);
        }
        ring.new_graph(None, None, 7, nccl);
        let rows = ring.snapshot().graphs;
        assert_eq!(rows.len(), KEPT_GRAPHS + 4);
        assert_eq!(rows[0].graph, 3);
    }
}
