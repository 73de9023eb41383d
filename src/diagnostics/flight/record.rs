//! A flight record: the typed copy of a communicator's ring ([`FlightRecord`]), with its
//! entries ([`FlightEntry`]) and their human-readable form (`Display`).

use std::fmt;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::graph::{captured_operations, CapturedGraph, GraphReplay};
use super::op_kind::OpKind;
use super::ring::{GraphRow, RingSnapshot, Slot, NO_GROUP, NO_RANK};
use super::shipped::{ShippedCall, ShippedInstance, ShippedKernel};
use crate::dtype::DataType;

/// The reduction an entry's operation applied, where it has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordedReduction {
    /// `ncclSum`
    Sum,
    /// `ncclProd`
    Prod,
    /// `ncclMax`
    Max,
    /// `ncclMin`
    Min,
    /// `ncclAvg`
    Avg,
    /// A user-defined operator (`ncclRedOpCreatePreMulSum`).
    PreMulSum,
}

impl RecordedReduction {
    const ALL: [RecordedReduction; 6] = [
        RecordedReduction::Sum,
        RecordedReduction::Prod,
        RecordedReduction::Max,
        RecordedReduction::Min,
        RecordedReduction::Avg,
        RecordedReduction::PreMulSum,
    ];

    /// The name in records and dumps (`sum`, `prod`, `max`, `min`, `avg`, `premulsum`).
    pub fn name(self) -> &'static str {
        match self {
            RecordedReduction::Sum => "sum",
            RecordedReduction::Prod => "prod",
            RecordedReduction::Max => "max",
            RecordedReduction::Min => "min",
            RecordedReduction::Avg => "avg",
            RecordedReduction::PreMulSum => "premulsum",
        }
    }

    /// The reduction named `name` (as [`RecordedReduction::name`] writes it).
    pub fn from_name(name: &str) -> Option<RecordedReduction> {
        Self::ALL.into_iter().find(|op| op.name() == name)
    }

    fn from_raw(raw: u8) -> RecordedReduction {
        Self::ALL
            .get(usize::from(raw))
            .copied()
            .unwrap_or(RecordedReduction::PreMulSum)
    }
}

/// What is known of an entry's operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpState {
    /// Handed to NCCL; not (yet) seen complete. Completion is learned from a watchdog's probe
    /// or a synchronize on the communicator's stream, so without either an operation stays
    /// here; an operation on another stream always does.
    Enqueued,
    /// Seen complete: the communicator's stream ran past it.
    Completed,
    /// NCCL returned an error for the call, so it may not have been enqueued.
    Refused,
}

impl OpState {
    /// The name in records and dumps (`enqueued`, `completed`, `refused`).
    pub fn name(self) -> &'static str {
        match self {
            OpState::Enqueued => "enqueued",
            OpState::Completed => "completed",
            OpState::Refused => "refused",
        }
    }

    /// The state named `name` (as [`OpState::name`] writes it).
    pub fn from_name(name: &str) -> Option<OpState> {
        [OpState::Enqueued, OpState::Completed, OpState::Refused]
            .into_iter()
            .find(|state| state.name() == name)
    }
}

/// One recorded operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlightEntry {
    /// Sequence number among all of the communicator's recorded operations, from 1.
    pub seq: u64,
    /// Sequence number among its collectives only, from 1; `None` for send and receive,
    /// for a shipped kernel's call (see [`FlightEntry::shipped`]) and for a CUDA graph's
    /// replay (see [`FlightEntry::replay`]). Ranks issue the same collectives in the same
    /// order, so this is what ranks are compared by (their sends and receives legitimately
    /// differ).
    pub collective_seq: Option<u64>,
    /// For a launch of a shipped kernel (the `Lsa` kinds): its instance, its number among
    /// the instance's calls (what ranks compare it by) and the kernel.
    pub shipped: Option<ShippedCall>,
    /// For a launch of a CUDA graph ([`OpKind::GraphReplay`]): its graph and its number
    /// among the graph's replays (what ranks compare it by). See
    /// [CUDA graphs](super#cuda-graphs).
    pub replay: Option<GraphReplay>,
    /// What NCCL was asked to do.
    pub kind: OpKind,
    /// The element type; `None` for a raw type this crate does not know.
    pub dtype: Option<DataType>,
    /// The element count NCCL was given (per rank where NCCL counts so, as for all-gather).
    pub count: u64,
    /// The root, for broadcast, reduce, gather and scatter.
    pub root: Option<usize>,
    /// The peer, for send and receive.
    pub peer: Option<usize>,
    /// The reduction, for all-reduce, reduce and reduce-scatter.
    pub reduction: Option<RecordedReduction>,
    /// The raw `cudaStream_t` it was enqueued on.
    pub stream: u64,
    /// The communicator's group it was part of (numbered from 1), if any.
    pub group: Option<u32>,
    /// The CUDA graph that captured it, if a recorded one did (its number; see
    /// [`FlightRecord::graphs`]): it runs at each of that graph's replays, not when recorded.
    /// Known while the record keeps the graph's counters.
    pub captured_in: Option<u32>,
    /// When it was handed to NCCL, in microseconds since the Unix epoch (this host's clock).
    pub enqueued_at_us: u64,
    /// What is known of it.
    pub state: OpState,
}

impl FlightEntry {
    /// Whether `other` is the same operation as far as ranks must agree: kind, element
    /// type, count, root and reduction, a shipped call's instance and kernel, and a replay's
    /// graph (whose count is the operations the graph captured). Not the peer, stream,
    /// group, the graph that captured it, times or sequence numbers.
    pub fn same_operation(&self, other: &FlightEntry) -> bool {
        let shipped = |e: &FlightEntry| e.shipped.map(|s| (s.instance, s.kernel));
        let graph = |e: &FlightEntry| e.replay.map(|r| r.graph);
        self.kind == other.kind
            && self.dtype == other.dtype
            && self.count == other.count
            && self.root == other.root
            && self.reduction == other.reduction
            && shipped(self) == shipped(other)
            && graph(self) == graph(other)
    }

    /// The operation in a few words, e.g. `AllReduce ncclFloat32 x 1024 sum`,
    /// `Broadcast ncclInt8 x 16 root 0`, `LsaAllReduce ncclBfloat16 x 4096 two-shot-flags`,
    /// `GraphReplay graph #2 (14 captured operations) replay #117`; an operation a graph
    /// captured ends with `, captured in graph #2`.
    pub fn describe(&self) -> String {
        let mut text = self.describe_operation();
        if let Some(graph) = self.captured_in {
            text.push_str(&format!(", captured in graph #{graph}"));
        }
        text
    }

    fn describe_operation(&self) -> String {
        if let Some(replay) = self.replay {
            let number = replay
                .seq
                .map_or_else(|| "without a number".to_owned(), |n| format!("#{n}"));
            return format!(
                "{} graph #{} ({}) replay {number}",
                self.kind.name(),
                replay.graph,
                captured_operations(self.count)
            );
        }
        let dtype = self.dtype.map_or("unknown type", DataType::name);
        let mut text = format!("{} {dtype} x {}", self.kind.name(), self.count);
        if let Some(op) = self.reduction {
            text.push(' ');
            text.push_str(op.name());
        }
        if let Some(root) = self.root {
            text.push_str(&format!(" root {root}"));
        }
        if let Some(peer) = self.peer {
            let word = if self.kind == OpKind::Send {
                "to"
            } else {
                "from"
            };
            text.push_str(&format!(" {word} {peer}"));
        }
        if let Some(shipped) = self.shipped {
            text.push(' ');
            text.push_str(shipped.kernel.name());
        }
        text
    }
}

/// A copy of one communicator's flight recorder: its last operations (oldest first) and the
/// counters that outlive the ring. See the [module docs](super).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlightRecord {
    /// The communicator's rank.
    pub rank: usize,
    /// The number of ranks in the communicator.
    pub size: usize,
    /// Its CUDA device ordinal (as this process numbers them).
    pub device: usize,
    /// Its name ([`CommConfig::comm_name`](crate::CommConfig::comm_name)), if it was given one.
    pub name: Option<String>,
    /// The process that wrote it.
    pub pid: u32,
    /// This process's number for the communicator: communicators get one from 1 in the
    /// order they are created, so ranks that create theirs in the same order (the usual
    /// program) number them alike.
    pub serial: u64,
    /// How many entries the ring holds at most.
    pub capacity: usize,
    /// Operations recorded since the communicator was created (the last sequence number).
    pub recorded: u64,
    /// Collectives recorded since the communicator was created (the last collective
    /// sequence number).
    pub collectives: u64,
    /// Every operation on the communicator's own stream up to this sequence number was seen
    /// complete (0: none was).
    pub completed_through: u64,
    /// The counters of the instances of shipped kernels created on the communicator, by
    /// ascending number: every live one, and the last dropped ones (see the
    /// [module docs](super#shipped-kernels)). Empty where none was created.
    pub shipped: Vec<ShippedInstance>,
    /// The counters of the CUDA graphs recorded on the communicator, by ascending number:
    /// every live one, and the last dropped ones (see the [module docs](super#cuda-graphs)).
    /// Empty where none was recorded.
    pub graphs: Vec<CapturedGraph>,
    /// How many instances of shipped kernels the communicator numbered, forgotten ones
    /// included: an instance up to this number without counters in [`FlightRecord::shipped`]
    /// was forgotten, not never made. `None` in records written before it was kept.
    pub shipped_created: Option<u32>,
    /// How many CUDA graphs the communicator recorded, forgotten ones included (see
    /// [`FlightRecord::shipped_created`]). `None` in records written before it was kept.
    pub graphs_recorded: Option<u32>,
    /// When the record was taken, in microseconds since the Unix epoch.
    pub taken_at_us: u64,
    /// Why it was taken: `"on demand"`, the watchdog's reason, `"AbortHandle::abort"`...
    pub reason: String,
    /// The entries the ring still holds, oldest first.
    pub entries: Vec<FlightEntry>,
}

impl FlightRecord {
    /// The entries of collectives, oldest first.
    pub fn collectives(&self) -> impl Iterator<Item = &FlightEntry> {
        self.entries.iter().filter(|e| e.collective_seq.is_some())
    }

    /// The entry of collective number `seq`, if the ring still holds it.
    pub fn collective(&self, seq: u64) -> Option<&FlightEntry> {
        self.collectives().find(|e| e.collective_seq == Some(seq))
    }

    /// The entries of instance `instance`'s shipped calls, oldest first.
    pub fn shipped_calls(&self, instance: u32) -> impl Iterator<Item = &FlightEntry> {
        self.entries
            .iter()
            .filter(move |e| e.shipped.is_some_and(|s| s.instance == instance))
    }

    /// The counters of instance `instance`, if the record keeps them.
    pub fn shipped_instance(&self, instance: u32) -> Option<&ShippedInstance> {
        self.shipped.iter().find(|i| i.instance == instance)
    }

    /// The entries of graph `graph`'s replays, oldest first.
    pub fn graph_replays(&self, graph: u32) -> impl Iterator<Item = &FlightEntry> {
        self.entries
            .iter()
            .filter(move |e| e.replay.is_some_and(|r| r.graph == graph))
    }

    /// The counters of graph `graph`, if the record keeps them.
    pub fn captured_graph(&self, graph: u32) -> Option<&CapturedGraph> {
        self.graphs.iter().find(|g| g.graph == graph)
    }

    /// Whether the record numbered shipped instance `instance` but keeps nothing of its
    /// calls: neither its counters (dropped and forgotten) nor a numbered call in the ring.
    /// Its calls cannot then be told from none, so it is left out of the instance's
    /// comparison.
    pub fn forgot_shipped_instance(&self, instance: u32) -> bool {
        self.shipped_instance(instance).is_none()
            && self
                .shipped_created
                .is_some_and(|n| (1..=n).contains(&instance))
            && !self
                .shipped_calls(instance)
                .any(|e| e.shipped.is_some_and(|s| s.seq.is_some()))
    }

    /// Whether the record numbered graph `graph` but keeps nothing of its replays: neither
    /// its counters (dropped and forgotten) nor a numbered replay in the ring (see
    /// [`FlightRecord::forgot_shipped_instance`]).
    pub fn forgot_graph(&self, graph: u32) -> bool {
        self.captured_graph(graph).is_none()
            && self
                .graphs_recorded
                .is_some_and(|n| (1..=n).contains(&graph))
            && !self
                .graph_replays(graph)
                .any(|e| e.replay.is_some_and(|r| r.seq.is_some()))
    }

    /// The last collective seen complete, by collective sequence number (0 if none).
    pub fn last_completed_collective(&self) -> u64 {
        self.collectives()
            .filter(|e| e.state == OpState::Completed)
            .filter_map(|e| e.collective_seq)
            .max()
            .unwrap_or(0)
    }

    /// Builds the record of a ring snapshot; `now` and `wall_now` are the same moment on
    /// both clocks.
    pub(crate) fn from_snapshot(
        snapshot: RingSnapshot,
        who: Who,
        reason: String,
        now: Instant,
        wall_now: SystemTime,
    ) -> FlightRecord {
        let wall_us = |at: Instant| -> u64 {
            let wall = wall_now
                .checked_sub(now.saturating_duration_since(at))
                .unwrap_or(UNIX_EPOCH);
            micros_since_epoch(wall)
        };
        let completed_before = snapshot.completed_before;
        let serial = snapshot.serial;
        let own_stream = snapshot.own_stream;
        let entries = snapshot
            .slots
            .iter()
            .map(|slot| {
                let mut entry = entry_of(slot, completed_before, own_stream, &wall_us);
                entry.captured_in = captured_in(&snapshot.graphs, &entry);
                entry
            })
            .collect();
        FlightRecord {
            rank: who.rank,
            size: who.size,
            device: who.device,
            name: snapshot.name.clone(),
            pid: std::process::id(),
            serial,
            capacity: snapshot.capacity,
            recorded: snapshot.recorded,
            collectives: snapshot.collectives,
            completed_through: completed_before.saturating_sub(1).min(snapshot.recorded),
            shipped: snapshot
                .instances
                .iter()
                .map(ShippedInstance::from_row)
                .collect(),
            graphs: snapshot
                .graphs
                .iter()
                .map(CapturedGraph::from_row)
                .collect(),
            shipped_created: Some(snapshot.instances_created),
            graphs_recorded: Some(snapshot.graphs_created),
            taken_at_us: micros_since_epoch(wall_now),
            reason,
            entries,
        }
    }
}

/// Whose ring a snapshot is.
#[derive(Debug, Clone)]
pub(crate) struct Who {
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) device: usize,
}

fn micros_since_epoch(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO)
        .as_micros()
        .try_into()
        .unwrap_or(u64::MAX)
}

/// The first of the kept graphs that captured `entry` (one NCCL refused was never captured).
fn captured_in(graphs: &[GraphRow], entry: &FlightEntry) -> Option<u32> {
    if entry.state == OpState::Refused {
        return None;
    }
    graphs
        .iter()
        .find(|row| row.holds(entry.seq, entry.stream))
        .map(|row| row.graph)
}

fn entry_of(
    slot: &Slot,
    completed_before: u64,
    own_stream: u64,
    wall_us: &impl Fn(Instant) -> u64,
) -> FlightEntry {
    let kind = OpKind::ALL
        .get(usize::from(slot.kind.tag))
        .copied()
        .unwrap_or(OpKind::AllReduce);
    let own_number = (slot.coll_seq != 0).then_some(slot.coll_seq);
    let shipped = kind.is_shipped().then(|| ShippedCall {
        instance: slot.kind.rank,
        seq: own_number,
        kernel: ShippedKernel::from_raw(slot.op).unwrap_or(ShippedKernel::OneShotFlags),
    });
    let replay = (kind == OpKind::GraphReplay).then_some(GraphReplay {
        graph: slot.kind.rank,
        seq: own_number,
    });
    // A shipped call's `rank` is its instance's number, a replay's its graph's.
    let rank = (slot.kind.rank != NO_RANK && kind.is_nccl()).then_some(slot.kind.rank as usize);
    let reduces = matches!(
        kind,
        OpKind::AllReduce | OpKind::Reduce | OpKind::ReduceScatter
    );
    let state = if slot.refused {
        OpState::Refused
    } else if slot.stream == own_stream && slot.seq < completed_before {
        OpState::Completed
    } else {
        OpState::Enqueued
    };
    FlightEntry {
        seq: slot.seq,
        collective_seq: own_number.filter(|_| kind.is_nccl()),
        shipped,
        replay,
        kind,
        // A replay has no element type: its count is of operations.
        dtype: DataType::ALL
            .get(usize::from(slot.dtype))
            .copied()
            .filter(|_| replay.is_none()),
        count: slot.count,
        root: rank.filter(|_| kind.has_root()),
        peer: rank.filter(|_| !kind.is_collective()),
        reduction: reduces.then(|| RecordedReduction::from_raw(slot.op)),
        stream: slot.stream,
        group: (slot.group != NO_GROUP).then_some(slot.group),
        // Filled by the caller, which holds the graphs' counters.
        captured_in: None,
        enqueued_at_us: wall_us(slot.enqueued),
        state,
    }
}

impl fmt::Display for FlightEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let number = |n: Option<u64>| n.map_or_else(|| "-".to_owned(), |n| n.to_string());
        let coll = match (self.shipped, self.replay, self.collective_seq) {
            // Instance 2's call 3: `L2.3`; a launch that failed: `L2.-`.
            (Some(s), _, _) => format!("L{}.{}", s.instance, number(s.seq)),
            // Graph 2's replay 117: `G2.117`; a launch that failed: `G2.-`.
            (None, Some(r), _) => format!("G{}.{}", r.graph, number(r.seq)),
            (None, None, Some(c)) => format!("c{c}"),
            (None, None, None) => "p2p".to_owned(),
        };
        let group = self
            .group
            .map_or_else(|| "-".to_owned(), |g| format!("g{g}"));
        write!(
            f,
            "#{:<6} {:<7} {:<48} {:<9} stream {:#x} group {group}",
            self.seq,
            coll,
            self.describe(),
            self.state.name(),
            self.stream
        )
    }
}

impl fmt::Display for FlightRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self
            .name
            .as_deref()
            .map_or_else(String::new, |n| format!(" \"{n}\""));
        writeln!(
            f,
            "flight record of rank {} of {}{name} (GPU {}, pid {}): {} operations ({} \
             collectives) recorded, the last {} kept (ring of {}), completed through #{}; \
             taken because: {}",
            self.rank,
            self.size,
            self.device,
            self.pid,
            self.recorded,
            self.collectives,
            self.entries.len(),
            self.capacity,
            self.completed_through,
            self.reason
        )?;
        for instance in &self.shipped {
            writeln!(f, "  {instance}")?;
        }
        for graph in &self.graphs {
            writeln!(f, "  {graph}")?;
        }
        let start = self.entries.first().map_or(0, |e| e.enqueued_at_us);
        for entry in &self.entries {
            let ms = entry.enqueued_at_us.saturating_sub(start) as f64 / 1000.0;
            writeln!(f, "  {entry} +{ms:.3} ms")?;
        }
        Ok(())
    }
}
