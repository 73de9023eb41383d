//! The shipped kernels' hooks in the ring (see the
//! [module docs](super::super#shipped-kernels)): each instance's counters, kept in a small
//! table beside the slots, and its launches, written in the slots like NCCL's operations.
//!
//! Imports nothing above the ring.

use std::time::Instant;

use super::{FlightRing, RawKind, Slot, NO_GROUP};

/// One launch of a kernel this crate ships (see [`super::super::shipped`]) as its owner hands
/// it to [`FlightRing::record_shipped`], under the communicator's lock that the launch holds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawShipped {
    /// The instance's number on the communicator ([`FlightRing::new_shipped_instance`]).
    pub(crate) instance: u32,
    /// [`super::super::OpKind`] as a number: which call of the instance.
    pub(crate) tag: u8,
    /// [`super::super::ShippedKernel`] as a number: which kernel it launched.
    pub(crate) kernel: u8,
    /// The raw `ncclDataType_t` of its elements.
    pub(crate) dtype: u8,
    /// Elements per rank.
    pub(crate) count: usize,
    /// The raw `cudaStream_t` it was launched on.
    pub(crate) stream: u64,
    /// Whether the launch failed (so the kernel never runs).
    pub(crate) refused: bool,
}

/// How an instance's kernels ended without doing their work (see
/// [`super::super::ShippedEnd`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RawEnd {
    /// A kernel gave up waiting for its peers.
    GaveUp,
    /// An abort, revoke or the owner's drop stopped its kernels.
    Stopped,
}

/// The counters of one instance of shipped kernels, which outlive what the ring keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InstanceRow {
    /// Its number on the communicator, from 1 in creation order.
    pub(crate) instance: u32,
    /// Calls recorded (launched) so far: the last call number given.
    pub(crate) calls: u64,
    /// How its kernels ended, first mark only, and its calls at the time.
    pub(crate) ended: Option<(RawEnd, u64)>,
    /// Whether its owner was dropped.
    pub(crate) dropped: bool,
}

/// How many instance rows a ring keeps before it forgets the oldest dropped ones (rows of
/// live instances are always kept: each owns far more memory than its row).
pub(crate) const KEPT_INSTANCES: usize = 64;

/// The shipped kernels' hooks (see the [module docs](super::super#shipped-kernels)), called by
/// `LsaAllReduce` under the communicator's lock.
impl FlightRing {
    /// Numbers a new instance of shipped kernels (from 1, in creation order: ranks that
    /// create theirs collectively in the same order number them alike) and keeps its
    /// counters. Allocates at most once (a row); forgets the oldest dropped instance's row
    /// past [`KEPT_INSTANCES`] rows.
    pub(crate) fn new_shipped_instance(&mut self) -> u32 {
        self.instances_created = self.instances_created.saturating_add(1);
        if self.instances.len() >= KEPT_INSTANCES {
            if let Some(oldest) = self.instances.iter().position(|row| row.dropped) {
                self.instances.remove(oldest);
            }
        }
        self.instances.push(InstanceRow {
            instance: self.instances_created,
            calls: 0,
            ended: None,
            dropped: false,
        });
        self.instances_created
    }

    pub(super) fn instance_mut(&mut self, instance: u32) -> Option<&mut InstanceRow> {
        let at = self
            .instances
            .binary_search_by_key(&instance, |row| row.instance)
            .ok()?;
        self.instances.get_mut(at)
    }

    /// Records one launch of a shipped kernel: the same cost as [`FlightRing::record`] and a
    /// binary search among the kept instances (a handful). A launch that failed takes no
    /// call number, as a refused collective takes no collective number.
    #[inline]
    pub(crate) fn record_shipped(&mut self, call: RawShipped) {
        self.recorded += 1;
        let number = match self.instance_mut(call.instance) {
            Some(row) if !call.refused => {
                row.calls += 1;
                row.calls
            }
            _ => 0,
        };
        self.write(Slot {
            seq: self.recorded,
            coll_seq: number,
            count: call.count as u64,
            stream: call.stream,
            enqueued: Instant::now(),
            group: NO_GROUP,
            kind: RawKind {
                tag: call.tag,
                rank: call.instance,
            },
            dtype: call.dtype,
            op: call.kernel,
            refused: call.refused,
        });
    }

    /// A kernel of `instance` gave up waiting for its peers (its owner saw the host-mapped
    /// word set). The first mark of an instance is kept.
    pub(crate) fn shipped_gave_up(&mut self, instance: u32) {
        self.shipped_ended(instance, RawEnd::GaveUp);
    }

    /// An abort, a revoke or its owner's drop stopped `instance`'s kernels. The first mark
    /// of an instance is kept.
    pub(crate) fn shipped_stopped(&mut self, instance: u32) {
        self.shipped_ended(instance, RawEnd::Stopped);
    }

    fn shipped_ended(&mut self, instance: u32, how: RawEnd) {
        if let Some(row) = self.instance_mut(instance) {
            if row.ended.is_none() {
                row.ended = Some((how, row.calls));
            }
        }
    }

    /// `instance`'s owner was dropped: its row may be forgotten once
    /// [`KEPT_INSTANCES`] rows are kept.
    pub(crate) fn shipped_instance_dropped(&mut self, instance: u32) {
        if let Some(row) = self.instance_mut(instance) {
            row.dropped = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{all_reduce, op};
    use super::super::NO_RANK;
    use super::*;

    fn shipped(instance: u32) -> RawShipped {
        RawShipped {
            instance,
            tag: 10,
            kernel: 0,
            dtype: 7,
            count: 4,
            stream: 7,
            refused: false,
        }
    }

    #[test]
    fn shipped_instances_count_their_own_calls_and_only_dropped_rows_are_forgotten() {
        let mut ring = FlightRing::new(4, 7, None).unwrap();
        let first = ring.new_shipped_instance();
        let second = ring.new_shipped_instance();
        ring.record(op(all_reduce(), true, 1, false, false));
        ring.record_shipped(shipped(second));
        ring.record_shipped(shipped(second));
        ring.record_shipped(shipped(first));
        let snap = ring.snapshot();
        // Every operation has a communicator number; each instance numbers its own calls,
        // and collectives keep theirs.
        let seqs: Vec<(u64, u64, u32)> = snap
            .slots
            .iter()
            .map(|s| (s.seq, s.coll_seq, s.kind.rank))
            .collect();
        assert_eq!(
            seqs,
            vec![
                (1, 1, NO_RANK),
                (2, 1, second),
                (3, 2, second),
                (4, 1, first)
            ]
        );
        assert_eq!((snap.recorded, snap.collectives), (4, 1));
        assert_eq!(ring.next_seq(), 5);
        ring.shipped_instance_dropped(first);
        for _ in 2..KEPT_INSTANCES + 5 {
            ring.new_shipped_instance();
        }
        let rows = &ring.snapshot().instances;
        // The dropped row went once the table was full; live rows are all kept.
        assert_eq!(rows.len(), KEPT_INSTANCES + 4);
        assert_eq!(rows[0].instance, second);
        assert_eq!(rows[0].calls, 2);
        assert!(rows.windows(2).all(|w| w[0].instance < w[1].instance));
        // A call of a forgotten instance is still recorded, without a call number.
        ring.record_shipped(shipped(first));
        let last = ring.snapshot().slots.last().copied().unwrap();
        assert_eq!((last.seq, last.coll_seq, last.kind.rank), (5, 0, first));
    }
}
