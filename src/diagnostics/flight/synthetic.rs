//! Synthetic flight records for the tests: ranks that issue all-reduces of given sizes,
//! shipped kernels' calls and CUDA graphs' replays.

use super::graph::{CapturedGraph, GraphReplay};
use super::op_kind::OpKind;
use super::record::{FlightEntry, FlightRecord, OpState, RecordedReduction};
use super::shipped::{ShippedCall, ShippedEnd, ShippedInstance, ShippedKernel};
use crate::dtype::DataType;

/// Rank `rank` of `size` issued one f32 sum all-reduce per `(collective number, count)` of
/// `ops`, on its own stream, one millisecond apart; those up to `completed_through` were seen
/// complete.
pub(crate) fn record(
    rank: usize,
    size: usize,
    ops: &[(u64, u64)],
    completed_through: u64,
) -> FlightRecord {
    record_with(rank, size, ops, completed_through, |_| {})
}

/// [`record`], with `edit` applied to every entry.
pub(crate) fn record_with(
    rank: usize,
    size: usize,
    ops: &[(u64, u64)],
    completed_through: u64,
    edit: impl Fn(&mut FlightEntry),
) -> FlightRecord {
    let start_us = 1_767_225_600_000_000 + rank as u64 * 17;
    let entries: Vec<FlightEntry> = ops
        .iter()
        .map(|&(seq, count)| {
            let mut entry = FlightEntry {
                seq,
                collective_seq: Some(seq),
                shipped: None,
                replay: None,
                kind: OpKind::AllReduce,
                dtype: Some(DataType::Float32),
                count,
                root: None,
                peer: None,
                reduction: Some(RecordedReduction::Sum),
                stream: 0x5000 + rank as u64,
                group: None,
                captured_in: None,
                enqueued_at_us: start_us + seq * 1000,
                state: if seq <= completed_through {
                    OpState::Completed
                } else {
                    OpState::Enqueued
                },
            };
            edit(&mut entry);
            entry
        })
        .collect();
    let last = ops.iter().map(|(seq, _)| *seq).max().unwrap_or(0);
    FlightRecord {
        rank,
        size,
        device: rank,
        name: None,
        pid: 1000 + rank as u32,
        serial: 1,
        capacity: 1024,
        recorded: last,
        collectives: last,
        completed_through: completed_through.min(last),
        shipped: Vec::new(),
        graphs: Vec::new(),
        shipped_created: None,
        graphs_recorded: None,
        taken_at_us: start_us + 60_000_000,
        reason: "synthetic".into(),
        entries,
    }
}

/// `rec` with calls of shipped instance `instance` appended: one f32 one-shot all-reduce per
/// `(call number, count)` of `calls`, those up to call `completed_through` seen complete, and
/// the instance's counters (its last call the largest number of `calls`), ending as `ended`.
pub(crate) fn with_shipped(
    mut rec: FlightRecord,
    instance: u32,
    calls: &[(u64, u64)],
    completed_through: u64,
    ended: Option<ShippedEnd>,
) -> FlightRecord {
    let start_us = 1_767_225_600_000_000 + rec.rank as u64 * 17 + 500;
    for &(seq, count) in calls {
        rec.recorded += 1;
        rec.entries.push(FlightEntry {
            seq: rec.recorded,
            collective_seq: None,
            shipped: Some(ShippedCall {
                instance,
                seq: Some(seq),
                kernel: ShippedKernel::OneShotFlags,
            }),
            replay: None,
            kind: OpKind::LsaAllReduce,
            dtype: Some(DataType::Float32),
            count,
            root: None,
            peer: None,
            reduction: None,
            stream: 0x5000 + rec.rank as u64,
            group: None,
            captured_in: None,
            enqueued_at_us: start_us + rec.recorded * 1000,
            state: if seq <= completed_through {
                OpState::Completed
            } else {
                OpState::Enqueued
            },
        });
    }
    rec.shipped.push(ShippedInstance {
        instance,
        calls: calls.iter().map(|(seq, _)| *seq).max().unwrap_or(0),
        ended,
        dropped: false,
    });
    rec.shipped.sort_by_key(|i| i.instance);
    rec
}

/// `rec` with graph `graph` recorded (having captured `operations` shipped kernels' calls,
/// none of them in the ring any more) and its replays `replays` appended, one entry per
/// replay number, on the rank's own stream; those up to replay `completed_through` seen
/// complete. The graph's counters say it was replayed as often as the largest number of
/// `replays`.
pub(crate) fn with_graph(
    mut rec: FlightRecord,
    graph: u32,
    operations: u64,
    replays: &[u64],
    completed_through: u64,
) -> FlightRecord {
    let start_us = 1_767_225_600_000_000 + rec.rank as u64 * 17 + 700;
    let stream = 0x5000 + rec.rank as u64;
    rec.graphs.push(CapturedGraph {
        graph,
        captured_from: rec.recorded + 1,
        captured_through: rec.recorded + operations,
        stream,
        operations,
        collectives: 0,
        replays: replays.iter().copied().max().unwrap_or(0),
        dropped: false,
    });
    rec.graphs.sort_by_key(|g| g.graph);
    // The captured operations were recorded once, and the ring has since let them go.
    rec.recorded += operations;
    for &seq in replays {
        rec.recorded += 1;
        rec.entries.push(FlightEntry {
            seq: rec.recorded,
            collective_seq: None,
            shipped: None,
            replay: Some(GraphReplay {
                graph,
                seq: Some(seq),
            }),
            kind: OpKind::GraphReplay,
            dtype: None,
            count: operations,
            root: None,
            peer: None,
            reduction: None,
            stream,
            group: None,
            captured_in: None,
            enqueued_at_us: start_us + rec.recorded * 1000,
            state: if seq <= completed_through {
                OpState::Completed
            } else {
                OpState::Enqueued
            },
        });
    }
    rec
}
