//! Timing one operation at one size (host-timed, CUDA graph, per-call latency) and checking
//! its result.

use std::time::{Duration, Instant};

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaEvent, DriverError};

use crate::coll::{Coll, Expect, Pattern};
use crate::elem::Elem;
use crate::ops::{Api, Buffers, Issuer};
use crate::rank::Rank;
use crate::BenchResult;

/// One rank's timing of one measurement, per operation.
#[derive(Debug, Clone, Copy, Default)]
pub struct Timing {
    /// Time per operation in µs: host-timed mean, or the median in latency mode.
    pub time_us: f64,
    /// 99th percentile in µs (latency mode).
    pub p99_us: Option<f64>,
    /// Host time spent issuing, per operation, in µs.
    pub cpu_us: f64,
}

/// The offset of iteration `iter`'s buffers, as nccl-tests moves them through the whole
/// allocation to avoid cache effects: `total * (iter % (buffer / total))`, `total` being
/// the elements one operation touches (`Layout::span`).
fn shift(buffer_len: usize, total: usize, iter: usize) -> usize {
    if total == 0 {
        return 0;
    }
    let steps = (buffer_len / total).max(1);
    total * (iter % steps)
}

/// One API issuing one placement (out of place or in place) of one operation on `bufs`:
/// what the timing methods and the check run.
pub struct Op<'a, 'c, T: Elem> {
    /// This rank.
    pub rank: &'a Rank,
    /// The operation at one size.
    pub issuer: &'a Issuer,
    /// The API that issues it.
    pub api: Api,
    /// The buffers it runs on.
    pub bufs: &'a mut Buffers<'c, T>,
    /// In place or out of place.
    pub in_place: bool,
}

impl<T: Elem> Op<'_, '_, T> {
    /// Issues one operation on the buffers' elements from `offset`.
    fn issue(&mut self, offset: usize) -> BenchResult<()> {
        let Op {
            rank,
            issuer,
            api,
            bufs,
            in_place,
        } = self;
        issuer.issue(*api, &rank.comm, bufs, *in_place, offset)
    }

    /// Issues `count` operations back to back, on buffers shifted as nccl-tests shifts them.
    fn issue_shifted(&mut self, count: usize) -> BenchResult<()> {
        let (len, total) = (self.bufs.len(), self.issuer.layout.span);
        (0..count).try_for_each(|iter| self.issue(shift(len, total, iter)))
    }

    /// One operation and a wait: what precedes every measurement.
    fn settle(&mut self) -> BenchResult<()> {
        self.issue(0)?;
        self.rank.wait()
    }

    /// After a barrier, times `issue`, which enqueues `ops` operations, on the host until the
    /// stream is idle. Returns µs per operation: to completion, and spent issuing.
    fn timed(
        &mut self,
        ops: usize,
        issue: impl FnOnce(&mut Self) -> BenchResult<()>,
    ) -> BenchResult<(f64, f64)> {
        self.rank.barrier()?;
        let start = Instant::now();
        issue(self)?;
        let issued = start.elapsed();
        self.rank.wait()?;
        let done = start.elapsed();
        let per_op = |elapsed: Duration| elapsed.as_secs_f64() * 1e6 / ops as f64;
        Ok((per_op(done), per_op(issued)))
    }

    /// Issues `count` operations back to back (warm-up), then waits.
    pub fn warm_up(&mut self, count: usize) -> BenchResult<()> {
        self.issue_shifted(count)?;
        self.rank.wait()
    }

    /// nccl-tests' default method: one operation and a wait, a barrier, then `iters`
    /// operations issued back to back and timed on the host until the stream is idle.
    pub fn host(&mut self, iters: usize) -> BenchResult<Timing> {
        self.settle()?;
        let (time_us, cpu_us) = self.timed(iters, |op| op.issue_shifted(iters))?;
        Ok(Timing {
            time_us,
            p99_us: None,
            cpu_us,
        })
    }

    /// Graph mode: `iters` operations captured into a CUDA graph (thread-local capture, as
    /// nccl-tests does), instantiated and uploaded, then replayed `launches` times back to
    /// back and timed on the host until the stream is idle.
    pub fn graph(&mut self, iters: usize, launches: usize) -> BenchResult<Timing> {
        self.settle()?;
        let stream = self.rank.stream.clone();
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let issued = self.issue_shifted(iters);
        // The capture must end even when an issue failed.
        let captured = stream.end_capture(CUgraphInstantiate_flags(0));
        issued?;
        let graph = captured?.ok_or("stream capture produced no graph")?;
        graph.upload()?;
        self.rank.wait()?;
        let (time_us, cpu_us) = self.timed(iters * launches, |_| {
            (0..launches).try_for_each(|_| graph.launch().map_err(Into::into))
        })?;
        drop(graph);
        Ok(Timing {
            time_us,
            p99_us: None,
            cpu_us,
        })
    }

    /// Latency mode: `iters` operations back to back, each between two CUDA events; reports
    /// the median and the 99th percentile of the per-call device times.
    pub fn latency(&mut self, iters: usize) -> BenchResult<Timing> {
        let ctx = self.rank.context().clone();
        let events = (0..iters)
            .map(|_| {
                let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
                Ok((ctx.new_event(flags)?, ctx.new_event(flags)?))
            })
            .collect::<Result<Vec<(CudaEvent, CudaEvent)>, DriverError>>()?;
        self.settle()?;
        let (len, total) = (self.bufs.len(), self.issuer.layout.span);
        let (_, cpu_us) = self.timed(iters, |op| {
            for (iter, (before, after)) in events.iter().enumerate() {
                before.record(&op.rank.stream)?;
                op.issue(shift(len, total, iter))?;
                after.record(&op.rank.stream)?;
            }
            Ok(())
        })?;
        let mut times = events
            .iter()
            .map(|(before, after)| Ok(f64::from(before.elapsed_ms(after)?) * 1e3))
            .collect::<Result<Vec<f64>, DriverError>>()?;
        times.sort_by(f64::total_cmp);
        Ok(Timing {
            time_us: median(&times),
            p99_us: Some(percentile(&times, 0.99)),
            cpu_us,
        })
    }

    /// Cold mode: before each of `iters` operations, `traffic_bytes` of unrelated host memory
    /// are written and read (the work a program does between calls, which evicts the
    /// binding's code and data from the caches); only the calls themselves are timed.
    /// `cpu_us` is the median host time of one call (a median, because a call that the
    /// machine interrupts would otherwise weigh on the mean like hundreds of calls),
    /// `time_us` the time per operation to completion, the traffic included.
    pub fn cold(&mut self, iters: usize, traffic_bytes: usize) -> BenchResult<Timing> {
        let mut scratch = vec![0u64; traffic_bytes.div_ceil(8).max(1)];
        self.settle()?;
        let (len, total) = (self.bufs.len(), self.issuer.layout.span);
        let mut in_calls = Vec::with_capacity(iters);
        let (time_us, _) = self.timed(iters, |op| {
            for iter in 0..iters {
                other_work(&mut scratch);
                let start = Instant::now();
                op.issue(shift(len, total, iter))?;
                in_calls.push(start.elapsed().as_secs_f64() * 1e6);
            }
            Ok(())
        })?;
        in_calls.sort_by(f64::total_cmp);
        Ok(Timing {
            time_us,
            p99_us: None,
            cpu_us: median(&in_calls),
        })
    }

    /// Runs the operation once on known inputs and counts the wrong elements of this rank's
    /// output (0 for a rank whose output is not defined, off the root of a reduce).
    pub fn check(&mut self, pattern: &Pattern) -> BenchResult<u64> {
        let (issuer, in_place) = (self.issuer, self.in_place);
        let layout = &issuer.layout;
        let (me, n, count) = (issuer.rank, issuer.n, layout.count);
        let stream = self.rank.stream.clone();
        let bufs = &mut *self.bufs;
        // This rank's own segment of an in-place v-collective's buffer.
        let own = layout
            .v
            .as_deref()
            .and_then(|v| match issuer.coll {
                Coll::AllGatherV => v.recv.segment(me),
                _ => v.send.segment(me),
            })
            .unwrap_or(0..0);
        // Inputs where the operation reads them; zeros where it writes, so that an output it
        // never wrote cannot pass (no input or result value is 0).
        if in_place {
            match issuer.coll {
                Coll::AllGatherV => {
                    stream.memset_zeros(&mut bufs.recv.part_mut(0, layout.recv_len)?)?;
                    let input = pattern.host_input::<T>(me, own.len());
                    if !input.is_empty() {
                        let mut part = bufs.recv.part_mut(own.start, own.len())?;
                        stream.memcpy_htod(&input, &mut part)?;
                    }
                }
                Coll::ReduceScatterV => {
                    let input = pattern.host_input::<T>(me, layout.send_len);
                    stream.memcpy_htod(&input, &mut bufs.recv.part_mut(0, layout.send_len)?)?;
                }
                Coll::AllGather => {
                    stream.memset_zeros(&mut bufs.recv.part_mut(0, layout.recv_len)?)?;
                    let input = pattern.host_input::<T>(me, count);
                    stream.memcpy_htod(&input, &mut bufs.recv.part_mut(me * count, count)?)?;
                }
                Coll::ReduceScatter => {
                    let input = pattern.host_input::<T>(me, layout.send_len);
                    stream.memcpy_htod(&input, &mut bufs.recv.part_mut(0, layout.send_len)?)?;
                }
                _ => {
                    let input = pattern.host_input::<T>(me, count);
                    stream.memcpy_htod(&input, &mut bufs.recv.part_mut(0, count)?)?;
                }
            }
        } else {
            // A v-collective's rank may send or receive nothing.
            if layout.send_len > 0 {
                let input = pattern.host_input::<T>(me, layout.send_len);
                stream.memcpy_htod(&input, &mut bufs.send.part_mut(0, layout.send_len)?)?;
            }
            if layout.recv_len > 0 {
                stream.memset_zeros(&mut bufs.recv.part_mut(0, layout.recv_len)?)?;
            }
        }
        self.rank.wait()?;
        if issuer.coll == Coll::PutSignal {
            // The previous rank's put lands in this rank's window without this rank's
            // stream ordering it: every rank must have zeroed its output first.
            self.rank.barrier()?;
        }
        self.settle()?;

        if issuer.coll == Coll::Reduce && me != issuer.root {
            return Ok(0);
        }
        let (offset, len) = match (issuer.coll, in_place) {
            (Coll::ReduceScatterV, true) => (own.start, own.len()),
            (Coll::AllGatherV, true) => (0, layout.recv_len),
            (Coll::ReduceScatter, true) => (me * count, count),
            (Coll::AllGather, true) => (0, layout.recv_len),
            (_, true) => (0, count),
            (_, false) => (0, layout.recv_len),
        };
        if len == 0 {
            return Ok(0);
        }
        let got = stream.clone_dtoh(&self.bufs.recv.part(offset, len)?)?;
        let expect = Expect {
            pattern,
            coll: issuer.coll,
            op: issuer.op,
            root: issuer.root,
            rank: me,
            n,
            layout,
        };
        Ok(expect.count_wrong(&got))
    }
}

/// A program's own work between two calls, as far as the caches see it: every word of
/// `scratch` read and written.
fn other_work(scratch: &mut [u64]) {
    let mut carry = 0u64;
    for word in scratch.iter_mut() {
        carry = carry
            .wrapping_mul(0x5851_F42D_4C95_7F2D)
            .wrapping_add(*word | 1);
        *word = carry;
    }
    std::hint::black_box(scratch);
}

/// The median of sorted values.
pub fn median(sorted: &[f64]) -> f64 {
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The nearest-rank percentile `p` (0..=1) of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Fills both buffers with plausible data (the sum pattern) for the timed runs, in chunks so
/// that large buffers need no host copy of their full size.
pub fn fill<T: Elem>(rank: &Rank, bufs: &mut Buffers<'_, T>, pattern: &Pattern) -> BenchResult<()> {
    const CHUNK: usize = 1 << 22;
    let len = bufs.len();
    let chunk = pattern.host_input::<T>(rank.rank(), CHUNK.min(len));
    let mut offset = 0;
    while offset < len {
        let part = chunk.len().min(len - offset);
        rank.stream
            .memcpy_htod(&chunk[..part], &mut bufs.send.part_mut(offset, part)?)?;
        rank.stream
            .memcpy_htod(&chunk[..part], &mut bufs.recv.part_mut(offset, part)?)?;
        offset += part;
    }
    rank.wait()
}
