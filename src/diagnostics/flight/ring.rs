//! The ring itself: a fixed array of the communicator's last operations, written on the
//! enqueue path under the communicator's lock, which that path holds anyway for the NCCL
//! call. So recording takes no lock of its own, allocates nothing (the array is made with
//! the communicator) and writes one cache line per operation.
//!
//! Imports nothing above it: the communicator's state owns a ring, never the reverse. The
//! hooks of the shipped kernels (`ring/shipped.rs`) and of CUDA graphs (`ring/graphs.rs`)
//! live beside it, with the tables of counters they keep next to the slots.

mod graphs;
mod shipped;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

pub(crate) use graphs::{GraphRow, RawMark, RawReplay};
pub(crate) use shipped::{InstanceRow, RawEnd, RawShipped};

/// What kind of NCCL operation an entry records, as the enqueue path knows it: the raw tag
/// of [`super::OpKind`] and the root or peer where the operation has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RawKind {
    /// [`super::OpKind`] as a number (its position in [`super::OpKind::ALL`]).
    pub(crate) tag: u8,
    /// The root (broadcast, reduce, gather, scatter) or peer (send, receive); `u32::MAX`
    /// where the operation has neither.
    pub(crate) rank: u32,
}

/// One operation as the enqueue path hands it to [`FlightRing::record`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawOp {
    pub(crate) kind: RawKind,
    /// A collective (numbered among the collectives too), not a send or receive.
    pub(crate) collective: bool,
    pub(crate) count: usize,
    /// The raw `ncclDataType_t`.
    pub(crate) dtype: u8,
    /// The raw `ncclRedOp_t`, saturated at 255.
    pub(crate) op: u8,
    /// The raw `cudaStream_t`.
    pub(crate) stream: u64,
    /// Whether a group is open on the owner's thread.
    pub(crate) in_group: bool,
    /// Whether NCCL returned an error for it.
    pub(crate) refused: bool,
}

/// No root or peer (see [`RawKind::rank`]).
pub(crate) const NO_RANK: u32 = u32::MAX;
/// No group (see [`Slot::group`]).
pub(crate) const NO_GROUP: u32 = 0;

/// One recorded operation, as written on the enqueue path: plain numbers, turned into
/// [`super::FlightEntry`] only when a record is taken. Aligned to (and no larger than) a
/// cache line, so recording writes exactly one line.
///
/// A shipped kernel's launch ([`FlightRing::record_shipped`]) uses the same slot: `kind.tag`
/// is its [`super::OpKind`] (one of the `Lsa` kinds, which tells the two apart), `kind.rank`
/// its instance's number, `coll_seq` its call number among the instance's calls (0: none),
/// `op` its [`super::ShippedKernel`], and `group` is [`NO_GROUP`] (they never join one). So
/// does a CUDA graph's replay ([`FlightRing::record_replay`]): `kind.tag` is
/// [`super::OpKind::GraphReplay`], `kind.rank` the graph's number, `coll_seq` its replay
/// number (0: none), `count` the operations the graph captured, `dtype` and `op` 0.
#[derive(Debug, Clone, Copy)]
#[repr(align(64))]
pub(crate) struct Slot {
    /// Per-communicator sequence number of every recorded operation, from 1; 0: empty.
    pub(crate) seq: u64,
    /// Sequence number among the collectives only, from 1; 0 for send and receive. For a
    /// shipped kernel's launch, its number among its instance's calls; for a graph's replay,
    /// among the graph's replays.
    pub(crate) coll_seq: u64,
    /// Elements, as NCCL was given them.
    pub(crate) count: u64,
    /// The raw `cudaStream_t`, compared and printed, never followed.
    pub(crate) stream: u64,
    pub(crate) enqueued: Instant,
    /// The communicator's group number at the time (from 1); [`NO_GROUP`] outside a group.
    pub(crate) group: u32,
    pub(crate) kind: RawKind,
    /// The raw `ncclDataType_t`.
    pub(crate) dtype: u8,
    /// The raw `ncclRedOp_t`, saturated at 255 (every value from 5 is a PreMulSum).
    pub(crate) op: u8,
    /// Whether NCCL refused the call (it returned an error, not success or in progress).
    pub(crate) refused: bool,
}

/// The communicator's ring of its last operations, with the counters that outlive what the
/// ring keeps.
#[derive(Debug)]
pub(crate) struct FlightRing {
    slots: Box<[Slot]>,
    /// Where the next operation goes.
    cursor: usize,
    /// Operations recorded so far (the last sequence number given).
    recorded: u64,
    /// Collectives recorded so far.
    collectives: u64,
    /// Every operation on the communicator's own stream with a sequence number below this is
    /// known to have completed (a watchdog probe or a synchronize saw the stream past it).
    completed_before: u64,
    /// Groups opened on the communicator so far (the last group number given).
    groups: u32,
    /// Whether operations now join an open group, and which.
    open_group: u32,
    /// The sequence number of the open group's first operation.
    group_first_seq: u64,
    /// Whether the open group is only simulated (`ncclGroupSimulateEnd`): nothing of it runs,
    /// so nothing of it is recorded.
    simulating: bool,
    /// The communicator's own stream, raw: entries on it complete by `completed_before`.
    own_stream: u64,
    /// This process's number for the communicator (see [`super::FlightRecord::serial`]).
    pub(crate) serial: u64,
    /// The communicator's name, if its configuration gave one.
    name: Option<String>,
    /// Instances of shipped kernels created on the communicator so far (the last number
    /// given).
    instances_created: u32,
    /// Their counters, by ascending number: every live one and the last
    /// [`KEPT_INSTANCES`](shipped::KEPT_INSTANCES) in all. Grows only when an instance is
    /// created.
    instances: Vec<InstanceRow>,
    /// CUDA graphs recorded on the communicator so far (the last number given).
    graphs_created: u32,
    /// Their counters, by ascending number: every live one and the last
    /// [`KEPT_GRAPHS`](graphs::KEPT_GRAPHS) in all. Grows only when a graph is recorded.
    graphs: Vec<GraphRow>,
}

/// The last communicator number given (see [`FlightRing::serial`]).
static SERIALS: AtomicU64 = AtomicU64::new(0);

/// The largest ring a configuration may ask for: about 64 MiB per communicator.
pub const MAX_FLIGHT_ENTRIES: usize = 1 << 20;

impl FlightRing {
    /// A ring of `capacity` entries (at most [`MAX_FLIGHT_ENTRIES`]) for a communicator
    /// whose own stream is `own_stream`; `None` for a capacity of 0 (recording off).
    pub(crate) fn new(
        capacity: usize,
        own_stream: u64,
        name: Option<String>,
    ) -> Option<Box<FlightRing>> {
        if capacity == 0 {
            return None;
        }
        let created = Instant::now();
        let empty = Slot {
            seq: 0,
            coll_seq: 0,
            count: 0,
            stream: 0,
            enqueued: created,
            group: NO_GROUP,
            kind: RawKind {
                tag: 0,
                rank: NO_RANK,
            },
            dtype: 0,
            op: 0,
            refused: false,
        };
        Some(Box::new(FlightRing {
            slots: vec![empty; capacity.min(MAX_FLIGHT_ENTRIES)].into_boxed_slice(),
            cursor: 0,
            recorded: 0,
            collectives: 0,
            completed_before: 1,
            groups: 0,
            open_group: NO_GROUP,
            group_first_seq: 1,
            simulating: false,
            own_stream,
            serial: SERIALS.fetch_add(1, Ordering::Relaxed) + 1,
            name,
            instances_created: 0,
            instances: Vec::new(),
            graphs_created: 0,
            graphs: Vec::new(),
        }))
    }

    /// Records one operation handed to NCCL: the whole cost of the recorder on the enqueue
    /// path (a clock read, two counters, one slot written).
    #[inline(always)]
    pub(crate) fn record(&mut self, op: RawOp) {
        let RawOp {
            kind,
            collective,
            count,
            dtype,
            op,
            stream,
            in_group,
            refused,
        } = op;
        if in_group && self.simulating {
            return;
        }
        self.recorded += 1;
        // A collective NCCL refused never ran: it takes no collective number, so the rank's
        // next collective takes it, and the comparison shows this rank one behind the others
        // (skipped) instead of "agreeing" on a collective only its peers ran.
        let coll_seq = if collective && !refused {
            self.collectives += 1;
            self.collectives
        } else {
            0
        };
        let group = if in_group { self.open_group } else { NO_GROUP };
        self.write(Slot {
            seq: self.recorded,
            coll_seq,
            count: count as u64,
            stream,
            enqueued: Instant::now(),
            group,
            kind,
            dtype,
            op,
            refused,
        });
    }

    /// Writes `slot` at the cursor and moves it on.
    #[inline(always)]
    fn write(&mut self, slot: Slot) {
        // `slots` is never empty and `cursor` always below its length.
        if let Some(at) = self.slots.get_mut(self.cursor) {
            *at = slot;
        }
        self.cursor += 1;
        if self.cursor == self.slots.len() {
            self.cursor = 0;
        }
    }
}

impl FlightRing {
    /// A group containing the communicator opened on its owner's thread (the first
    /// membership of a group; nested ones join it). A simulated group records nothing.
    pub(crate) fn group_opened(&mut self, simulated: bool) {
        self.simulating = simulated;
        if simulated {
            self.open_group = NO_GROUP;
        } else {
            self.groups = self.groups.wrapping_add(1).max(1);
            self.open_group = self.groups;
            self.group_first_seq = self.recorded + 1;
        }
    }

    /// The group ended.
    pub(crate) fn group_closed(&mut self) {
        self.open_group = NO_GROUP;
        self.simulating = false;
    }

    /// The sequence number the next operation gets: what a marker recorded on the stream now
    /// (a probe event, a synchronize's event) completes after.
    /// While a group is open, its operations are recorded but not launched until it ends, so
    /// the marker covers only what came before the group.
    pub(crate) fn next_seq(&self) -> u64 {
        if self.open_group != NO_GROUP {
            self.group_first_seq
        } else {
            self.recorded + 1
        }
    }

    /// Every operation on the communicator's own stream numbered below `seq` completed.
    pub(crate) fn completed_before(&mut self, seq: u64) {
        self.completed_before = self.completed_before.max(seq);
    }

    /// The counters and the kept slots, oldest first.
    pub(crate) fn snapshot(&self) -> RingSnapshot {
        let (newer, older) = self.slots.split_at(self.cursor);
        let slots = older
            .iter()
            .chain(newer.iter())
            .filter(|slot| slot.seq != 0)
            .copied()
            .collect();
        RingSnapshot {
            slots,
            capacity: self.slots.len(),
            recorded: self.recorded,
            collectives: self.collectives,
            completed_before: self.completed_before,
            own_stream: self.own_stream,
            serial: self.serial,
            name: self.name.clone(),
            instances: self.instances.clone(),
            graphs: self.graphs.clone(),
            instances_created: self.instances_created,
            graphs_created: self.graphs_created,
        }
    }
}

/// A copy of a ring, taken under the communicator's lock and turned into a
/// [`super::FlightRecord`] after it is released.
#[derive(Debug, Clone)]
pub(crate) struct RingSnapshot {
    pub(crate) slots: Vec<Slot>,
    pub(crate) capacity: usize,
    pub(crate) recorded: u64,
    pub(crate) collectives: u64,
    pub(crate) completed_before: u64,
    pub(crate) own_stream: u64,
    pub(crate) serial: u64,
    pub(crate) name: Option<String>,
    pub(crate) instances: Vec<InstanceRow>,
    pub(crate) graphs: Vec<GraphRow>,
    pub(crate) instances_created: u32,
    pub(crate) graphs_created: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn all_reduce() -> RawKind {
        RawKind {
            tag: 0,
            rank: NO_RANK,
        }
    }

    pub(super) fn op(
        kind: RawKind,
        collective: bool,
        count: usize,
        in_group: bool,
        refused: bool,
    ) -> RawOp {
        RawOp {
            kind,
            collective,
            count,
            dtype: 7,
            op: 0,
            stream: 7,
            in_group,
            refused,
        }
    }

    #[test]
    fn slots_are_one_cache_line() {
        assert_eq!(std::mem::size_of::<Slot>(), 64);
        assert_eq!(std::mem::align_of::<Slot>(), 64);
    }

    #[test]
    fn the_ring_keeps_the_last_entries_in_order_and_counts_all() {
        assert!(FlightRing::new(0, 7, None).is_none());
        let mut ring = FlightRing::new(3, 7, None).unwrap();
        for i in 0..5u64 {
            ring.record(op(all_reduce(), true, 10 + i as usize, false, false));
        }
        let send = RawKind { tag: 8, rank: 1 };
        ring.record(op(send, false, 4, false, false));
        let snap = ring.snapshot();
        assert_eq!((snap.recorded, snap.collectives, snap.capacity), (6, 5, 3));
        let seqs: Vec<(u64, u64, u64)> = snap
            .slots
            .iter()
            .map(|s| (s.seq, s.coll_seq, s.count))
            .collect();
        assert_eq!(seqs, vec![(4, 4, 13), (5, 5, 14), (6, 0, 4)]);
    }

    #[test]
    fn markers_do_not_cover_an_open_groups_operations() {
        let mut ring = FlightRing::new(8, 7, None).unwrap();
        ring.record(op(all_reduce(), true, 1, false, false));
        assert_eq!(ring.next_seq(), 2);
        ring.group_opened(false);
        ring.record(op(all_reduce(), true, 2, true, false));
        ring.record(op(all_reduce(), true, 3, true, false));
        // Not launched before the group ends: a synchronize now covers #1 only.
        assert_eq!(ring.next_seq(), 2);
        ring.group_closed();
        assert_eq!(ring.next_seq(), 4);
    }

    #[test]
    fn a_refused_collective_takes_no_collective_number() {
        let mut ring = FlightRing::new(8, 7, None).unwrap();
        ring.record(op(all_reduce(), true, 1, false, false));
        ring.record(op(all_reduce(), true, 2, false, true));
        ring.record(op(all_reduce(), true, 3, false, false));
        let snap = ring.snapshot();
        assert_eq!((snap.recorded, snap.collectives), (3, 2));
        let seqs: Vec<(u64, u64)> = snap.slots.iter().map(|s| (s.count, s.coll_seq)).collect();
        assert_eq!(seqs, vec![(1, 1), (2, 0), (3, 2)]);
    }

    #[test]
    fn groups_are_numbered_and_simulations_not_recorded() {
        let mut ring = FlightRing::new(8, 7, None).unwrap();
        ring.record(op(all_reduce(), true, 1, false, false));
        ring.group_opened(false);
        ring.record(op(all_reduce(), true, 2, true, false));
        ring.record(op(all_reduce(), true, 3, true, false));
        ring.group_closed();
        ring.group_opened(true);
        ring.record(op(all_reduce(), true, 4, true, false));
        ring.group_closed();
        ring.group_opened(false);
        ring.record(op(all_reduce(), true, 5, true, true));
        ring.group_closed();
        let snap = ring.snapshot();
        let groups: Vec<(u64, u32, bool)> = snap
            .slots
            .iter()
            .map(|s| (s.count, s.group, s.refused))
            .collect();
        assert_eq!(
            groups,
            vec![(1, 0, false), (2, 1, false), (3, 1, false), (5, 2, true)]
        );
        assert_eq!(ring.next_seq(), 5);
        ring.completed_before(3);
        ring.completed_before(2);
        assert_eq!(ring.snapshot().completed_before, 3);
    }
}
