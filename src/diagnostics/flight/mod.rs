//! The flight recorder: every communicator keeps a bounded ring of its last operations, and
//! the rings of the ranks of one communicator, compared, say where the ranks diverged.
//!
//! # What is recorded
//!
//! Every operation the crate hands to NCCL (collectives, sends and receives, each step of a
//! v-collective; in a group or not, on any stream) is recorded once, in the one place they
//! all pass (`collectives/dispatch.rs`, right after the NCCL call, under the communicator's
//! lock that the call holds anyway): a per-communicator sequence number, a second one among
//! the collectives only, the kind, element type, count, root or peer, reduction, the raw
//! stream, the communicator's group number when a group is open, the time, and whether NCCL
//! refused the call. Operations of a simulated group ([`Group::simulate`](crate::Group::simulate))
//! run nothing and are not recorded; calls refused by this crate's validation never reach
//! NCCL and are not recorded either. The kernels this crate ships are recorded too, with
//! their own numbering (see [Shipped kernels](#shipped-kernels)), and so is each launch of a
//! CUDA graph that captured the communicator's operations, which its owner reports (see
//! [CUDA graphs](#cuda-graphs)).
//!
//! # Cost
//!
//! A ring of slots is allocated with the communicator; recording writes one
//! 64-byte slot and two counters and reads the clock once (`Instant::now`, a vDSO call of
//! about 20 ns on x86-64 Linux). No allocation, no lock of its own, no CUDA call. The ring
//! is on by default with [`DEFAULT_FLIGHT_ENTRIES`] entries (64 KiB per communicator).
//!
//! # Completion
//!
//! Knowing an operation completed would take a CUDA event per operation, which the enqueue
//! path does not pay for. Completion is learned where the crate already looks at the
//! communicator's stream: a [`Watchdog`](crate::Watchdog)'s progress probe (an event it
//! records on the stream when the stream is idle or its last probe completed) marks every
//! operation recorded before that probe complete once the probe is, and a successful
//! [`Comm::synchronize`](crate::Comm::synchronize) (or its `_timeout` and `_all` forms)
//! marks every operation before it. Operations on other streams stay
//! [`OpState::Enqueued`]. An operation captured into a CUDA graph is recorded once, when
//! captured, and a later probe marks it complete though nothing of it ran: its state says
//! only that the capture passed it. What runs is the graph's replays: each is an entry of its
//! own ([`OpKind::GraphReplay`]), completed by the probes and synchronizes like any other
//! entry on the communicator's stream (see [CUDA graphs](#cuda-graphs)).
//!
//! # Size and off-switch
//!
//! [`CommConfig::flight_recorder`](crate::CommConfig::flight_recorder) sets the entries per
//! communicator (0 turns the recorder off); the environment variable
//! `NCCL_RS_FLIGHT_RECORDER=<entries>` overrides it (`0` off), as NCCL's own variables
//! override its configuration. A value that is not a number is ignored (the configured size
//! applies): a diagnostics switch should never stop a job from starting. At most
//! [`MAX_FLIGHT_ENTRIES`].
//!
//! # Dumps
//!
//! [`Comm::flight_record`](crate::Comm::flight_record) takes a [`FlightRecord`] on demand,
//! also after the communicator failed or was aborted;
//! [`AbortHandle::flight_record`](crate::AbortHandle::flight_record) does from any thread.
//! A [`Watchdog`](crate::Watchdog) that trips puts one in its
//! [`WatchdogTrip`](crate::WatchdogTrip), and an [`AbortHandle::abort`](crate::AbortHandle::abort)
//! takes one before aborting. Where `NCCL_RS_FLIGHT_RECORDER_DIR` is set, both are also
//! written there as JSON, one file per communicator and process
//! ([`FlightRecord::write_to`]). A record prints as text (`Display`) and as JSON
//! ([`FlightRecord::to_json`], read back by [`FlightRecord::from_json`]).
//!
//! # Comparing ranks
//!
//! [`compare`] takes the records of the ranks of one communicator and names the first
//! collective where they diverge and what each odd rank did; `examples/flight_compare.rs` is
//! a command that compares dump files. The shipped kernels' calls and the CUDA graphs'
//! replays are compared apart, by the same rules (see [Shipped kernels](#shipped-kernels)
//! and [CUDA graphs](#cuda-graphs)).
//!
//! Ranks are compared by their collectives, in order ([`FlightEntry::collective_seq`]):
//! every rank must issue the same collectives in the same order, while sends and receives
//! legitimately differ between ranks and are not compared. At the first collective number
//! `n` where the ranks do not all hold the same operation, the ranks are split by what they
//! hold there; the largest group is the reference (on a tie, the group whose later
//! operations explain the other's: see below), and every other rank gets a [`Finding`]:
//!
//! * its collective `n` is the reference's `n + k`, and its later ones follow shifted alike:
//!   it **skipped** `k` collectives ([`Finding::Skipped`]);
//! * the reference's `n` is its `n + k`: it issued `k` **extra** collectives
//!   ([`Finding::Extra`]);
//! * it never issued a collective `n` at all, while others did: it **stalled**
//!   ([`Finding::Stalled`]), stuck outside NCCL if all it issued completed, or inside its
//!   last collective if that did not — unless most ranks never issued `n` and the few that
//!   did agree on it: then, where everything the many issued completed, by majority the few
//!   are **ahead** ([`Finding::Ahead`]), having issued extra collectives at the end (the
//!   records cannot tell that from the many stalling, and the finding says so); where it did
//!   not, everyone is still inside an earlier collective, and the first one not seen complete
//!   is reported ([`Finding::NotCompleted`]);
//! * anything else is a plain **mismatch** ([`Finding::Mismatch`]).
//!
//! A rank whose last collective comes before the first one every ring still holds is
//! behind by more than the rings keep: it is reported **stalled** at its next collective and
//! nothing else is compared.
//!
//! Where all ranks agree on every collective, the first one not seen complete on some rank
//! is reported ([`Finding::NotCompleted`]): a hang inside NCCL with no rank out of step (a
//! dead peer, a network failure).
//!
//! A skip is only visible when the skipped collective differs from the ones after it (in
//! kind, type, count, root or reduction): a rank that skips one of several identical
//! all-reduces looks, in every record, exactly like a rank that stalled before the last of
//! them, since NCCL pairs its later all-reduces with the others' earlier ones.
//!
//! # Shipped kernels
//!
//! NCCL's own records (and torch's flight recorder) cannot see inside a kernel that is not
//! NCCL's. The kernels this crate ships ([`LsaAllReduce`](crate::device::LsaAllReduce)'s
//! all-reduce, all-gather and residual-add-RMSNorm epilogue) are recorded by the crate
//! itself, so a rank that skipped or stalled in one is named like one that did in an NCCL
//! collective.
//!
//! * **Instances.** Each `LsaAllReduce` gets a number on its communicator when it is
//!   created, from 1 in creation order ([`ShippedCall::instance`]). Instances are created
//!   collectively, in the same order on every rank (creation agrees among the ranks before
//!   the number is taken, so a creation refused on one rank is refused on all and numbers
//!   none), so the same number is the same instance on every rank.
//! * **Calls.** Every kernel launch is one entry, in the same ring and the same
//!   per-communicator numbering ([`FlightEntry::seq`]) as NCCL's operations, of kind
//!   [`OpKind::LsaAllReduce`], [`OpKind::LsaAllGather`] or [`OpKind::LsaAddRmsNorm`], with
//!   the kernel that ran ([`ShippedKernel`]), the element type and the count per rank, and
//!   its own number among its instance's calls ([`ShippedCall::seq`], from 1), never among
//!   NCCL's collectives. A launch that failed takes no number (it never ran, so it pairs with
//!   nothing); a call that launches nothing (no elements) is not recorded; an epilogue is
//!   its all-reduce's entry (where a shipped all-reduce ran; an NCCL one is an NCCL
//!   collective) and then its norm's, or one fused entry. Calls that went to NCCL
//!   ([`LsaAlgorithm::Nccl`](crate::device::LsaAlgorithm::Nccl)) are NCCL collectives.
//! * **Cost.** As for an NCCL operation: under the communicator's lock that the launch
//!   holds, one slot written, one counter of the instance found by a binary search among
//!   the kept instances (a handful) and incremented, one clock read; no allocation, no CUDA
//!   call, no lock of its own. Creating an instance adds one row to its communicator's table
//!   of instances; the table keeps every live instance and forgets the oldest dropped ones
//!   past 64 rows (their entries in the ring remain).
//! * **Completion.** The kernels run on the communicator's own stream, so the watchdog's
//!   probes and synchronizes mark them complete as they do NCCL's operations.
//! * **Ends.** A kernel whose peers do not come gives up after the instance's timeout and
//!   sets a host-mapped word; the instance then refuses every call. It cannot tell which of
//!   its calls gave up (the kernel returns either way, so the stream's completion covers it
//!   too, and an entry seen complete may be the one that gave up). So the record keeps it
//!   per instance ([`ShippedInstance::ended`]): [`ShippedEnd::GaveUp`] once the instance saw
//!   the word (at its next call or check), with its calls then ("a kernel of calls #1 to #n
//!   gave up"), or [`ShippedEnd::Stopped`] once an abort, revoke or shrink of the
//!   communicator, or the instance's drop, stopped its kernels; the first mark is kept.
//!   [`FlightRecord::shipped`] holds every instance's counters (calls, end, dropped), which
//!   outlive what the ring keeps.
//!
//! [`compare`] compares each instance's calls across the ranks by their own numbers, by the
//! same rules as NCCL's collectives (skipped, extra, mismatch by kind, element type, count
//! and kernel, stalled, ahead, not completed), apart from the collectives and from the
//! other instances ([`FlightComparison::shipped`], one [`ShippedComparison`] per instance
//! some rank called). Each instance that ended adds a [`Finding::GaveUp`] for its rank,
//! which blames no one: it waited for a peer that the other findings name, or that died or
//! was descheduled past the timeout. A rank whose kernel gave up refuses the instance's later
//! calls, so it is not also named stalled before them; a stop, being an abort's doing after
//! a hang, excuses nothing.
//!
//! # CUDA graphs
//!
//! An operation captured into a CUDA graph is recorded once, when captured; what a hang
//! needs is which graph ran how often, and a decode job replays one captured step thousands
//! of times. The graph is launched outside this crate (`cuGraphLaunch`, cudarc's
//! `CudaGraph::launch`), so its owner tells the communicator, on every rank:
//!
//! 1. right before the stream capture begins and right after it ends,
//!    [`Comm::graph_capture_mark`](crate::Comm::graph_capture_mark) (it remembers the ring's
//!    counters and records nothing);
//! 2. once the capture succeeded on every rank and the ranks agreed on it,
//!    [`Comm::record_graph`](crate::Comm::record_graph) with both marks and the stream that
//!    captured; it returns the graph's [`RecordedGraph`], kept as long as the graph;
//! 3. right after each launch, [`RecordedGraph::record_replay`] with the stream and whether
//!    the launch failed.
//!
//! * **Graphs.** Each recorded graph gets a number on its communicator, from 1 in the order
//!   graphs are recorded ([`RecordedGraph::number`]): ranks that record theirs collectively,
//!   in the same order, number them alike, so the same number is the same graph on every
//!   rank (a capture that failed on one rank must be recorded on none). Its captured
//!   operations are those recorded on the capturing stream between the two marks
//!   (NCCL's and the shipped kernels'; refused ones excepted): each that the ring still holds
//!   says so ([`FlightEntry::captured_in`]), and [`FlightRecord::graphs`] keeps each graph's
//!   counters ([`CapturedGraph`]: the operations and collectives it captured, its replays,
//!   whether its owner dropped it), which outlive what the ring keeps. A graph that captured
//!   operations of several communicators is recorded on each.
//! * **Replays.** Every launch is one entry, in the same ring and the same per-communicator
//!   numbering ([`FlightEntry::seq`]) as everything else, of kind [`OpKind::GraphReplay`],
//!   with its graph and its own number among the graph's replays
//!   ([`FlightEntry::replay`], [`GraphReplay::seq`], from 1), never among NCCL's
//!   collectives, and the number of operations the graph captured as its count. A launch
//!   that failed takes no number (it never ran, so it pairs with nothing). A launch not
//!   reported is not seen.
//! * **Cost.** Recording a replay costs what an NCCL operation does, under the
//!   communicator's lock (which the report takes, the launch being outside the crate): one
//!   slot written, one counter of the graph found by a binary search among the kept graphs
//!   and incremented, one clock read; no allocation, no CUDA call. A mark copies three
//!   counters; recording a graph adds a row to the communicator's table of graphs and reads
//!   the ring's entries between the marks. The table keeps every live graph and forgets the
//!   oldest dropped ones past 64 rows (their entries in the ring remain).
//! * **Completion.** A replay launched on the communicator's own stream is marked complete
//!   by the watchdog's probes and synchronizes as any operation is, once they pass it (so
//!   report a launch after making it, never before); one on another stream stays
//!   [`OpState::Enqueued`].
//!
//! [`compare`](compare()) compares each graph's replays across the ranks by their own
//! numbers, by the same rules as NCCL's collectives, apart from the collectives, the shipped
//! instances and the other graphs ([`FlightComparison::graphs`], one [`GraphComparison`] per
//! graph some rank replayed): a rank that replayed a graph fewer times than the others is
//! **stalled** (stuck inside its last replay if that was not seen complete, else before
//! launching the next), a few ranks that replayed it more while the many are idle are
//! **ahead**, ranks whose graph captured other operations (another count) **mismatch**, and
//! a last replay not seen complete everywhere is **not completed**. Every replay of a graph
//! is the same operation, so a rank that skipped a replay looks like one that stalled
//! before the last.
//!
//! * **A refused capture.** What a capture took is numbered as it is captured; a capture the
//!   ranks refuse after it ended (one rank's failed partway, having numbered fewer
//!   collectives than its peers) is given back on every rank with
//!   [`Comm::discard_capture`](crate::Comm::discard_capture), so later collectives and
//!   shipped calls are numbered alike again.
//! * **Limits.** Graph numbers agree across ranks only as long as every rank records (or
//!   discards) every capture alike: a rank that skips one compares its later graphs with its
//!   peers' next ones, which the comparison sees only where their captured counts differ. A
//!   graph's captured count is what each ring saw: ranks whose rings differ in size and saw
//!   other streams' operations during a long capture may count differently (a mismatch at
//!   the first replay). Only the capturing stream counts: operations forked onto other
//!   streams inside a capture are recorded as eager ones. A record that forgot a dropped
//!   graph's counters (past 64 rows) is left out of that graph's comparison, never blamed
//!   ([`FlightRecord::forgot_graph`], and [`FlightRecord::forgot_shipped_instance`] alike for
//!   shipped instances); records written before the counts of graphs and instances were
//!   kept cannot tell a forgotten one from one never made.

mod compare;
mod compare_graph;
mod compare_shipped;
mod finding;
mod graph;
mod json;
mod op_kind;
mod record;
pub(crate) mod ring;
mod sequence;
mod shipped;
#[cfg(test)]
pub(crate) mod synthetic;

use std::path::{Path, PathBuf};

pub use compare::{compare, read_flight_records, FlightComparison};
pub use compare_graph::GraphComparison;
pub use compare_shipped::ShippedComparison;
pub use finding::Finding;
pub(crate) use graph::{nccl_tag, shipped_tag, RingHolder};
pub use graph::{CapturedGraph, GraphCaptureMark, GraphReplay, RecordedGraph};
pub use json::FLIGHT_RECORD_FORMAT;
pub use op_kind::OpKind;
pub(crate) use record::Who;
pub use record::{FlightEntry, FlightRecord, OpState, RecordedReduction};
pub use ring::MAX_FLIGHT_ENTRIES;
pub(crate) use ring::{FlightRing, RawKind, RawOp, RawShipped, NO_RANK};
pub use shipped::{ShippedCall, ShippedEnd, ShippedInstance, ShippedKernel};

use crate::error::{Error, Result};

/// Entries per communicator unless configured otherwise (64 KiB of ring).
pub const DEFAULT_FLIGHT_ENTRIES: usize = 1024;
/// Overrides the entries per communicator (`0`: off).
pub const FLIGHT_RECORDER_VAR: &str = "NCCL_RS_FLIGHT_RECORDER";
/// Where watchdog trips and abort handles write flight records, when set.
pub const FLIGHT_RECORDER_DIR_VAR: &str = "NCCL_RS_FLIGHT_RECORDER_DIR";

/// The ring size a new communicator gets: `NCCL_RS_FLIGHT_RECORDER` if it is a number, else
/// the configured size, else the default.
pub(crate) fn capacity(configured: Option<usize>) -> usize {
    let from_env = std::env::var(FLIGHT_RECORDER_VAR)
        .ok()
        .and_then(|text| text.trim().parse::<usize>().ok());
    from_env
        .or(configured)
        .unwrap_or(DEFAULT_FLIGHT_ENTRIES)
        .min(MAX_FLIGHT_ENTRIES)
}

impl FlightRecord {
    /// The file name of this record in a dump directory: one per communicator and process,
    /// so a later dump of the same communicator replaces the earlier one.
    pub fn file_name(&self) -> String {
        format!(
            "flight-rank{}-of{}-pid{}-comm{}.json",
            self.rank, self.size, self.pid, self.serial
        )
    }

    /// Writes the record as JSON into `dir` (created if missing) under
    /// [`FlightRecord::file_name`], through a temporary file renamed into place, so a reader
    /// never sees half a record. Returns the path.
    pub fn write_to(&self, dir: impl AsRef<Path>) -> Result<PathBuf> {
        use std::io::Write;
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let dir = dir.as_ref();
        let io = |what: String| move |source| Error::Io { what, source };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io(format!("creating {}", dir.display())))?;
        let path = dir.join(self.file_name());
        // A fresh, randomly named file made with O_EXCL (never a file or symlink planted
        // there), readable by this user only, renamed over the final name once complete:
        // a reader sees a whole record or none, and two writers never share a file.
        let mut partial = tempfile::Builder::new()
            .prefix(".flight-")
            .suffix(".partial")
            .permissions(std::fs::Permissions::from_mode(0o600))
            .tempfile_in(dir)
            .map_err(io(format!("creating a file in {}", dir.display())))?;
        partial
            .write_all(self.to_json().as_bytes())
            .map_err(io(format!("writing {}", partial.path().display())))?;
        partial.persist(&path).map_err(|e| Error::Io {
            what: format!("renaming to {}", path.display()),
            source: e.error,
        })?;
        Ok(path)
    }
}

/// Writes `record` into `NCCL_RS_FLIGHT_RECORDER_DIR`, where that is set: `None` where it is
/// not, else where it went or why it could not.
pub(crate) fn write_to_env_dir(
    record: &FlightRecord,
) -> Option<std::result::Result<PathBuf, String>> {
    let dir = std::env::var_os(FLIGHT_RECORDER_DIR_VAR).filter(|d| !d.is_empty())?;
    Some(record.write_to(Path::new(&dir)).map_err(|e| e.to_string()))
}
