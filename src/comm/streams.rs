//! The streams other than its own that a communicator's operations were enqueued on
//! (`enqueue_on`, a group's `enqueue_on`, `enqueue_v_on`, RMA's `*_on`), so that ending it
//! waits for, or aborts, the work it left there too.
//!
//! Why: NCCL's destroy waits for every kernel of the communicator, whatever stream it runs
//! on (`commDestroySync` synchronises NCCL's device stream, which every launch joins, 2.28
//! to 2.30.7 `src/init.cc`), and only `ncclCommAbort` stops such a kernel. A drop that
//! waited for its own stream alone would hand the destroy to a thread that then waits
//! forever for a kernel on another stream that nothing can abort any more.
//!
//! How, and why so:
//!
//! * After NCCL enqueued an operation on another stream (and, for a nonblocking
//!   communicator, once it is ready again; in a group, once the group has ended and launched
//!   it), an event is recorded on that stream, under the communicator's lock. Ending the
//!   communicator waits for these events as well as for its own stream.
//! * Events, not streams: a user may destroy a stream before the communicator; an event
//!   stays valid and completes once the stream's work has (CUDA lets a destroyed stream's
//!   work finish), where a raw stream handle kept would dangle.
//! * One event per stream, re-recorded: stream order makes the last record cover every
//!   earlier one on that stream, so the set grows with the streams, not with the operations,
//!   and an operation on a stream seen before costs one `cuEventRecord` (plus the capture
//!   check below). Operations on the communicator's own stream cost nothing more than a
//!   pointer comparison.
//! * Keyed by the stream's handle. CUDA frees a destroyed stream only once its work is done,
//!   so a handle comes back for a new stream only after the old one's work finished:
//!   re-recording the event on the new stream loses nothing. The per-thread default stream
//!   has one handle for a different stream on each thread, so it is keyed with the thread.
//! * Bounded: a new stream met when [`PRUNE_AT`] streams are held first drops the entries
//!   whose events completed (nothing of this communicator is left on those streams), reusing
//!   one's event; the set holds at most `PRUNE_AT` streams or those with work in flight,
//!   plus one.
//! * A stream being captured into a CUDA graph is skipped: an event recorded there becomes a
//!   node of the graph (querying it is illegal) and would stop tracking the stream's earlier
//!   work. A graph's kernels run wherever it is launched, which the communicator cannot see;
//!   NCCL's destroy waits until graphs that captured the communicator are destroyed.
//! * A record that fails leaves the set unable to vouch for that stream: the error is kept,
//!   and ending the communicator then aborts it rather than destroying it.

use std::thread::ThreadId;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaEvent, CudaStream, DriverError};

use super::Comm;

/// Streams held before a new one makes the completed ones go.
pub(crate) const PRUNE_AT: usize = 8;

/// CUDA's legacy default stream handle (`CU_STREAM_LEGACY`), the same stream as the null
/// handle.
const LEGACY: usize = 0x1;
/// CUDA's per-thread default stream handle (`CU_STREAM_PER_THREAD`).
const PER_THREAD: usize = 0x2;

/// Refuses the per-thread default stream (`CU_STREAM_PER_THREAD`) as a communicator's own
/// stream: its handle names another stream on each thread, and a communicator moves between
/// threads (it is `Send`), so its drop, its waits and its kernels' stops, run on another
/// thread, would look at a stream its work never ran on. (Per-call streams may be it: their
/// events are keyed with the thread that enqueued.)
pub(crate) fn check_own_stream(stream: &CudaStream) -> crate::error::Result<()> {
    if stream.cu_stream() as usize == PER_THREAD {
        return Err(crate::error::Error::invalid(
            "a communicator's own stream cannot be the per-thread default stream: it names a \
             different stream on each thread the communicator may be used or dropped on; make \
             one with CudaContext::new_stream (or pass it per call)",
        ));
    }
    Ok(())
}

/// Which stream an event stands for: its handle, and for the per-thread default stream the
/// thread too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StreamKey {
    handle: usize,
    thread: Option<ThreadId>,
}

impl StreamKey {
    /// The key of `stream`, as enqueued on from this thread.
    pub(crate) fn of(stream: &CudaStream) -> Self {
        Self::from_handle(stream.cu_stream() as usize)
    }

    fn from_handle(handle: usize) -> Self {
        match handle {
            LEGACY => Self {
                handle: 0,
                thread: None,
            },
            PER_THREAD => Self {
                handle,
                thread: Some(std::thread::current().id()),
            },
            _ => Self {
                handle,
                thread: None,
            },
        }
    }
}

/// Something recorded on a stream that says whether the work before it has finished: a
/// [`CudaEvent`], or a stand-in in the tests.
pub(crate) trait Marker {
    /// Whether the work recorded before it has finished; an error for a failed query (a
    /// sticky error of the context, usually).
    fn is_done(&self) -> Result<bool, DriverError>;
}

impl Marker for CudaEvent {
    fn is_done(&self) -> Result<bool, DriverError> {
        self.try_is_complete()
    }
}

/// One stream and its event.
struct Entry<E> {
    key: StreamKey,
    event: E,
    /// How often the event was recorded: a new record is newer work.
    records: u64,
    /// Since when the watchdog has seen this record pending.
    pending: Option<Pending>,
}

/// The record the watchdog saw pending, and since when.
#[derive(Debug, Clone, Copy)]
struct Pending {
    records: u64,
    since: Instant,
}

/// The streams besides its own that a communicator's operations ran on, each with the event
/// recorded after the last of them; see the [module docs](self).
pub(crate) struct ForeignStreams<E = CudaEvent> {
    entries: Vec<Entry<E>>,
    /// The first failure to track a stream: the set cannot say that everything finished.
    lost: Option<DriverError>,
}

impl<E> Default for ForeignStreams<E> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            lost: None,
        }
    }
}

impl<E: Marker> ForeignStreams<E> {
    /// Records, with `record`, the event of the stream `key`: its own if the stream was seen
    /// before, else a completed one's (past [`PRUNE_AT`] streams) or a new one from
    /// `create`. A failure is kept (see [`ForeignStreams::all_done`]).
    pub(crate) fn note(
        &mut self,
        key: StreamKey,
        create: impl FnOnce() -> Result<E, DriverError>,
        record: impl FnOnce(&E) -> Result<(), DriverError>,
    ) {
        if let Err(err) = self.record_for(key, create, record) {
            self.lost.get_or_insert(err);
        }
    }

    /// Keeps `err`, the failure to learn whether a stream is being captured before recording
    /// on it.
    pub(crate) fn lose(&mut self, err: DriverError) {
        self.lost.get_or_insert(err);
    }

    fn record_for(
        &mut self,
        key: StreamKey,
        create: impl FnOnce() -> Result<E, DriverError>,
        record: impl FnOnce(&E) -> Result<(), DriverError>,
    ) -> Result<(), DriverError> {
        if let Some(entry) = self.entries.iter_mut().find(|e| e.key == key) {
            record(&entry.event)?;
            entry.records += 1;
            return Ok(());
        }
        let event = match self.reclaim() {
            Some(event) => event,
            None => create()?,
        };
        record(&event)?;
        self.entries.push(Entry {
            key,
            event,
            records: 1,
            pending: None,
        });
        Ok(())
    }

    /// At [`PRUNE_AT`] streams: drops the entries whose work has finished, and gives back one
    /// of their events to be recorded again. A query that fails keeps its entry.
    fn reclaim(&mut self) -> Option<E> {
        if self.entries.len() < PRUNE_AT {
            return None;
        }
        let mut spare = None;
        let mut i = 0;
        while i < self.entries.len() {
            if matches!(self.entries[i].event.is_done(), Ok(true)) {
                let entry = self.entries.swap_remove(i);
                spare.get_or_insert(entry.event);
            } else {
                i += 1;
            }
        }
        spare
    }

    /// Whether the work recorded on every stream has finished. An error where a stream
    /// could not be tracked, or a query failed: then nobody can say.
    pub(crate) fn all_done(&self) -> Result<bool, DriverError> {
        if let Some(err) = self.lost {
            return Err(err);
        }
        for entry in &self.entries {
            if !entry.event.is_done()? {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The number of streams held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }

    /// The watchdog's look at `now`: how long the longest-pending record has been seen
    /// pending, if that is `timeout` or more. A record is timed from the first poll that saw
    /// it pending; a newer record on the same stream (newer work) starts its clock again,
    /// since the communicator cannot tell whether the older one finished in between.
    pub(crate) fn stalled(
        &mut self,
        now: Instant,
        timeout: Duration,
    ) -> Result<Option<Duration>, DriverError> {
        let mut longest: Option<Duration> = None;
        for entry in &mut self.entries {
            if entry.event.is_done()? {
                entry.pending = None;
                continue;
            }
            match entry.pending {
                Some(seen) if seen.records == entry.records => {
                    let waited = now.saturating_duration_since(seen.since);
                    if waited >= timeout && longest.is_none_or(|l| waited > l) {
                        longest = Some(waited);
                    }
                }
                _ => {
                    entry.pending = Some(Pending {
                        records: entry.records,
                        since: now,
                    });
                }
            }
        }
        Ok(longest)
    }
}

impl Comm {
    /// Notes that an operation of this communicator was just enqueued on `stream` (and is
    /// launched: outside a group, once NCCL returned and a nonblocking communicator is ready
    /// again; in a group, once the group ended). The communicator's own stream costs one
    /// pointer comparison; another stream gets its event recorded (see the
    /// [module docs](self)).
    #[inline(always)]
    pub(crate) fn note_stream(&self, stream: &CudaStream) {
        if !std::ptr::eq(stream, &*self.stream) {
            self.note_foreign_stream(stream);
        }
    }

    #[cold]
    #[inline(never)]
    fn note_foreign_stream(&self, stream: &CudaStream) {
        let key = StreamKey::of(stream);
        // Another `CudaStream` of the same CUDA stream (two `default_stream()`s).
        if key == StreamKey::of(&self.stream) {
            return;
        }
        let mut state = self.shared.lock();
        if state.ptr.is_null() {
            // Released: an abort stopped its kernels, a destroy waited for them.
            return;
        }
        let streams = state.foreign.get_or_insert_with(Default::default);
        match stream.capture_status() {
            Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE) => {}
            // Captured into a graph: nothing to record (see the module docs).
            Ok(_) => return,
            Err(err) => return streams.lose(err),
        }
        streams.note(
            key,
            || stream.context().new_event(None),
            |event| event.record(stream),
        );
    }

    /// Whether the work recorded on the other streams this communicator used has finished
    /// (`true` when there are none); [`Error::Cuda`](crate::Error::Cuda) where a stream
    /// could not be tracked.
    pub(crate) fn foreign_streams_done(&self) -> crate::error::Result<bool> {
        let state = self.shared.lock();
        match state.foreign.as_deref() {
            None => Ok(true),
            Some(streams) => Ok(streams.all_done()?),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;

    /// A stand-in event: done or not as the test says, counting its records.
    #[derive(Clone)]
    struct Fake {
        id: u32,
        done: Rc<Cell<bool>>,
        records: Rc<Cell<u32>>,
    }

    impl Marker for Fake {
        fn is_done(&self) -> Result<bool, DriverError> {
            Ok(self.done.get())
        }
    }

    fn fake(id: u32) -> Fake {
        Fake {
            id,
            done: Rc::new(Cell::new(false)),
            records: Rc::new(Cell::new(0)),
        }
    }

    fn key(handle: usize) -> StreamKey {
        StreamKey {
            handle,
            thread: None,
        }
    }

    /// Notes an operation on `handle`, creating `new` if an event is needed; returns the
    /// event that was recorded.
    fn note(streams: &mut ForeignStreams<Fake>, handle: usize, new: &Fake) -> u32 {
        let recorded = Cell::new(None);
        streams.note(
            key(handle),
            || Ok(new.clone()),
            |event| {
                event.records.set(event.records.get() + 1);
                event.done.set(false);
                recorded.set(Some(event.id));
                Ok(())
            },
        );
        recorded.get().expect("an event was recorded")
    }

    fn ids(streams: &ForeignStreams<Fake>) -> Vec<u32> {
        streams.entries.iter().map(|e| e.event.id).collect()
    }

    #[test]
    fn one_event_per_stream_re_recorded() {
        let mut streams = ForeignStreams::default();
        assert_eq!(streams.all_done(), Ok(true), "nothing tracked: done");
        let a = fake(1);
        assert_eq!(note(&mut streams, 0x100, &a), 1);
        // The same stream again: the same event, recorded again, nothing created.
        assert_eq!(note(&mut streams, 0x100, &fake(99)), 1);
        assert_eq!(a.records.get(), 2);
        assert_eq!(streams.len(), 1);
        assert_eq!(streams.all_done(), Ok(false));
        let b = fake(2);
        assert_eq!(note(&mut streams, 0x200, &b), 2);
        assert_eq!(ids(&streams), [1, 2]);
        a.done.set(true);
        assert_eq!(streams.all_done(), Ok(false), "stream 0x200 still runs");
        b.done.set(true);
        assert_eq!(streams.all_done(), Ok(true));
    }

    #[test]
    fn completed_streams_go_once_the_set_is_full() {
        let mut streams = ForeignStreams::default();
        let events: Vec<Fake> = (0..PRUNE_AT as u32).map(fake).collect();
        for (i, event) in events.iter().enumerate() {
            note(&mut streams, 0x1000 + i, event);
        }
        assert_eq!(streams.len(), PRUNE_AT);
        // All still running: a new stream gets a new event, and nothing goes.
        assert_eq!(note(&mut streams, 0x9000, &fake(100)), 100);
        assert_eq!(streams.len(), PRUNE_AT + 1);
        // Three finished: the next new stream drops them and reuses one's event.
        for i in [1, 4, 6] {
            events[i].done.set(true);
        }
        let reused = note(&mut streams, 0x9001, &fake(101));
        assert!([1, 4, 6].contains(&reused), "reused {reused}");
        assert_eq!(streams.len(), PRUNE_AT + 1 - 3 + 1);
        assert!(!ids(&streams).contains(&101), "nothing created");
        for gone in [1, 4, 6].into_iter().filter(|&i| i != reused) {
            assert!(!ids(&streams).contains(&gone), "{gone} dropped");
        }
        // Below the limit nothing is queried or dropped.
        let mut small = ForeignStreams::default();
        let done = fake(7);
        note(&mut small, 0x1, &done);
        done.done.set(true);
        note(&mut small, 0x2, &fake(8));
        assert_eq!(ids(&small), [7, 8]);
    }

    #[test]
    fn a_stream_that_could_not_be_tracked_makes_the_set_unsure() {
        let mut streams: ForeignStreams<Fake> = ForeignStreams::default();
        let failure = DriverError(sys::cudaError_enum::CUDA_ERROR_INVALID_CONTEXT);
        streams.note(key(0x10), || Err(failure), |_| Ok(()));
        assert_eq!(streams.len(), 0);
        assert_eq!(streams.all_done(), Err(failure));
        // A record that fails on a known stream too, and the first failure is kept.
        let mut streams = ForeignStreams::default();
        note(&mut streams, 0x10, &fake(1));
        let other = DriverError(sys::cudaError_enum::CUDA_ERROR_LAUNCH_FAILED);
        streams.note(key(0x10), || Ok(fake(2)), |_| Err(failure));
        streams.lose(other);
        assert_eq!(streams.all_done(), Err(failure));
    }

    #[test]
    fn stream_keys_tell_per_thread_streams_apart() {
        assert_eq!(StreamKey::from_handle(0), StreamKey::from_handle(LEGACY));
        assert_ne!(
            StreamKey::from_handle(0x1000),
            StreamKey::from_handle(0x2000)
        );
        let here = StreamKey::from_handle(PER_THREAD);
        assert_eq!(here, StreamKey::from_handle(PER_THREAD));
        let there = std::thread::spawn(|| StreamKey::from_handle(PER_THREAD))
            .join()
            .unwrap();
        assert_ne!(here, there, "each thread's per-thread stream is its own");
    }

    #[test]
    fn the_watchdog_times_a_record_from_when_it_saw_it_pending() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let timeout = Duration::from_secs(5);
        let mut streams = ForeignStreams::default();
        let a = fake(1);
        note(&mut streams, 0x100, &a);
        assert_eq!(streams.stalled(at(0), timeout), Ok(None));
        assert_eq!(streams.stalled(at(4_999), timeout), Ok(None));
        assert_eq!(
            streams.stalled(at(5_000), timeout),
            Ok(Some(Duration::from_secs(5)))
        );
        // Finished: the clock stops; a newer record starts it again.
        a.done.set(true);
        assert_eq!(streams.stalled(at(6_000), timeout), Ok(None));
        note(&mut streams, 0x100, &fake(9));
        assert_eq!(streams.stalled(at(7_000), timeout), Ok(None));
        assert_eq!(streams.stalled(at(11_000), timeout), Ok(None));
        note(&mut streams, 0x100, &fake(9));
        assert_eq!(streams.stalled(at(12_000), timeout), Ok(None));
        assert_eq!(streams.stalled(at(16_999), timeout), Ok(None));
        // The longest of several.
        let b = fake(2);
        note(&mut streams, 0x200, &b);
        assert_eq!(
            streams.stalled(at(17_000), timeout),
            Ok(Some(Duration::from_secs(5)))
        );
        assert_eq!(
            streams.stalled(at(23_000), timeout),
            Ok(Some(Duration::from_secs(11)))
        );
    }
}
