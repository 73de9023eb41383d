//! The binding's cost per call: the same 8-byte all-reduce (2 × f32, sum) on every local GPU,
//! issued through the safe API (`Group` + `Operation::all_reduce`) and through raw nccl-sys
//! calls (`ncclGroupStart`, `ncclAllReduce` per GPU, `ncclGroupEnd` on `Comm::as_raw`), in
//! the same process, on the same buffers and streams.
//!
//! ```text
//! cargo bench --bench overhead
//! ```
//!
//! Two criterion groups, one function per API in each:
//!
//! * `all_reduce_8B_end_to_end`: iterations issued back to back, then a wait for every
//!   stream (nccl-tests' method): the time per operation a program sees, where GPU work and
//!   host work overlap.
//! * `all_reduce_8B_issue`: only the host time spent in the calls, in batches of 32 with a
//!   wait (not timed) in between: the binding's own per-call cost.
//!
//! The GPUs' default streams are used unless `NCCL_RS_BENCH_STREAM=own`: with streams of its
//! own a context switches cudarc's event tracking on (unless `NCCL_RS_BENCH_EVENT_TRACKING=0`),
//! and then `safe_untracked` repeats the safe calls with tracking switched off, which
//! separates cudarc's event bookkeeping from the binding itself.
//! The run ends with the ratios safe/raw computed from criterion's samples.

mod common;

use std::ffi::c_void;
use std::time::{Duration, Instant};

use criterion::{BenchmarkGroup, Criterion};
use cudarc::driver::{CudaSlice, DevicePtr};
use nccl::sys::{self, ncclResult_t};
use nccl::{Group, Operation, ReduceOp};

use common::{fail, wait_all, Gpus, Samples};

/// Elements per all-reduce: 8 bytes of f32.
const COUNT: usize = 2;
/// Calls per timed batch of the issue-only group.
const BATCH: u64 = 32;
/// Criterion samples per function.
const SAMPLES: usize = 50;

/// One rank's raw handles, taken once outside the timed regions.
struct RawRank {
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
    send: *const c_void,
    recv: *mut c_void,
}

struct Bench<'a> {
    gpus: &'a Gpus,
    sends: Vec<CudaSlice<f32>>,
    recvs: Vec<CudaSlice<f32>>,
    raw: Vec<RawRank>,
}

impl Bench<'_> {
    fn safe(&mut self) -> nccl::Result<()> {
        let mut group = Group::start()?;
        for ((comm, send), recv) in self
            .gpus
            .comms
            .iter()
            .zip(&self.sends)
            .zip(self.recvs.iter_mut())
        {
            group.enqueue(comm, Operation::all_reduce(send, recv, ReduceOp::Sum))?;
        }
        group.finish()
    }

    fn raw(&self) -> Result<(), String> {
        let lib = self.gpus.comms[0].library().api();
        let check = |call: &str, status: Result<ncclResult_t, sys::MissingSymbol>| match status {
            Ok(ncclResult_t::ncclSuccess) => Ok(()),
            other => Err(format!("{call}: {other:?}")),
        };
        // SAFETY: every handle, stream and pointer in `self.raw` belongs to a live
        // communicator, stream or buffer of `self` (alive for the whole bench), each buffer
        // holds COUNT f32 on its rank's GPU, and this thread is the only one using them.
        unsafe {
            check("ncclGroupStart", lib.ncclGroupStart())?;
            let mut first_err = Ok(());
            for rank in &self.raw {
                let status = lib.ncclAllReduce(
                    rank.send,
                    rank.recv,
                    COUNT,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    rank.comm,
                    rank.stream,
                );
                if first_err.is_ok() {
                    first_err = check("ncclAllReduce", status);
                }
            }
            // The group ends whatever happened inside it.
            let ended = check("ncclGroupEnd", lib.ncclGroupEnd());
            first_err.and(ended)
        }
    }

    fn issue(&mut self, api: &str) {
        let result = match api {
            "raw" => self.raw(),
            _ => self.safe().map_err(|e| e.to_string()),
        };
        result.unwrap_or_else(|e| fail(api, e));
    }

    fn set_event_tracking(&self, on: bool) {
        for stream in &self.gpus.streams {
            // SAFETY: every buffer here is used on its GPU's one stream only; switching the
            // tracking between timed regions (with the streams idle) loses no ordering.
            unsafe {
                if on {
                    stream.context().enable_event_tracking();
                } else {
                    stream.context().disable_event_tracking();
                }
            }
        }
    }
}

fn main() {
    let Some(gpus) = common::setup("overhead") else {
        return;
    };
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(SAMPLES)
        .nresamples(10_000)
        .configure_from_args();
    let n = gpus.len();

    let alloc = |stream: &std::sync::Arc<cudarc::driver::CudaStream>| {
        stream
            .clone_htod(&[1.0f32; COUNT])
            .unwrap_or_else(|e| fail("allocating the buffers", e))
    };
    let sends: Vec<CudaSlice<f32>> = gpus.streams.iter().map(alloc).collect();
    let recvs: Vec<CudaSlice<f32>> = gpus.streams.iter().map(alloc).collect();
    let mut raw = Vec::with_capacity(n);
    for i in 0..n {
        let stream = &gpus.streams[i];
        let send = sends[i].device_ptr(stream).0 as *const c_void;
        let recv = recvs[i].device_ptr(stream).0 as *mut c_void;
        raw.push(RawRank {
            // SAFETY: the handle is used only while `gpus` keeps the communicator alive,
            // from this thread, never to destroy or abort it.
            comm: unsafe { gpus.comms[i].as_raw() },
            stream: stream.cu_stream() as sys::cudaStream_t,
            send,
            recv,
        });
    }
    let mut bench = Bench {
        gpus: &gpus,
        sends,
        recvs,
        raw,
    };
    // Warm-up outside the timed regions.
    for _ in 0..100 {
        bench.issue("safe");
        bench.issue("raw");
    }
    wait_all(&gpus).unwrap_or_else(|e| fail("warm-up", e));

    let mut apis = vec!["safe"];
    if gpus.event_tracking {
        apis.push("safe_untracked");
    }
    apis.push("raw");
    let samples_taken = common::sample_size(SAMPLES);
    let samples = Samples::default();
    let mut end_to_end = Vec::new();
    let mut issue = Vec::new();

    let mut group = criterion.benchmark_group(format!("all_reduce_8B_end_to_end_{n}gpu"));
    for &api in &apis {
        end_to_end.push((
            api,
            measure(&mut group, &mut bench, api, &samples, samples_taken, false),
        ));
    }
    group.finish();
    let mut group = criterion.benchmark_group(format!("all_reduce_8B_issue_{n}gpu"));
    for &api in &apis {
        issue.push((
            api,
            measure(&mut group, &mut bench, api, &samples, samples_taken, true),
        ));
    }
    group.finish();
    criterion.final_summary();

    println!("\noverhead of the safe API, 8-byte all-reduce on {n} GPUs (one group call = {n} ncclAllReduce):");
    report("end to end (back to back, then wait)", &end_to_end, n);
    report("issue only (host time in the calls) ", &issue, n);
    interleaved(&mut bench);
}

/// Rounds of this many back-to-back operations per API in the interleaved comparison.
const INTERLEAVED_ITERS: u32 = 2000;
/// Rounds per API in the interleaved comparison.
const INTERLEAVED_ROUNDS: usize = 15;

/// Safe and raw alternate round by round (the order flips every round), so that clock and
/// thermal drift over the run hits both alike; prints the median of the per-round ratios.
fn interleaved(bench: &mut Bench<'_>) {
    let mut round_time = |api: &str| {
        let start = Instant::now();
        for _ in 0..INTERLEAVED_ITERS {
            bench.issue(api);
        }
        wait_all(bench.gpus).unwrap_or_else(|e| fail(api, e));
        start.elapsed().as_secs_f64() * 1e6 / f64::from(INTERLEAVED_ITERS)
    };
    let mut ratios = Vec::with_capacity(INTERLEAVED_ROUNDS);
    let (mut safe_all, mut raw_all) = (Vec::new(), Vec::new());
    for round in 0..INTERLEAVED_ROUNDS {
        let (safe, raw) = if round % 2 == 0 {
            let safe = round_time("safe");
            (safe, round_time("raw"))
        } else {
            let raw = round_time("raw");
            (round_time("safe"), raw)
        };
        ratios.push(safe / raw);
        safe_all.push(safe);
        raw_all.push(raw);
    }
    let median = |values: &mut Vec<f64>| {
        values.sort_by(f64::total_cmp);
        values[values.len() / 2]
    };
    println!(
        "  interleaved ({INTERLEAVED_ROUNDS} rounds of {INTERLEAVED_ITERS}, end to end): raw {:8.3} us   \
         safe {:8.3} us   median safe/raw x{:.3}",
        median(&mut raw_all),
        median(&mut safe_all),
        median(&mut ratios)
    );
}

/// Runs one criterion function and returns the mean time per iteration of its samples.
fn measure(
    group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    bench: &mut Bench<'_>,
    api: &'static str,
    samples: &Samples,
    samples_taken: usize,
    issue_only: bool,
) -> Option<Duration> {
    let untracked = api == "safe_untracked";
    if untracked {
        bench.set_event_tracking(false);
    }
    let call = if api == "raw" { "raw" } else { "safe" };
    samples.clear();
    group.bench_function(api, |b| {
        b.iter_custom(|iters| {
            let elapsed = if issue_only {
                let mut total = Duration::ZERO;
                let mut left = iters;
                while left > 0 {
                    let batch = left.min(BATCH);
                    let start = Instant::now();
                    for _ in 0..batch {
                        bench.issue(call);
                    }
                    total += start.elapsed();
                    wait_all(bench.gpus).unwrap_or_else(|e| fail(api, e));
                    left -= batch;
                }
                total
            } else {
                let start = Instant::now();
                for _ in 0..iters {
                    bench.issue(call);
                }
                wait_all(bench.gpus).unwrap_or_else(|e| fail(api, e));
                start.elapsed()
            };
            samples.record(iters, elapsed);
            elapsed
        })
    });
    if untracked {
        bench.set_event_tracking(true);
    }
    samples.mean(samples_taken)
}

fn report(what: &str, results: &[(&str, Option<Duration>)], n: usize) {
    let us = |api: &str| {
        results
            .iter()
            .find(|(a, _)| *a == api)
            .and_then(|(_, d)| d.map(|d| d.as_secs_f64() * 1e6))
    };
    let Some(raw) = us("raw") else {
        return;
    };
    let mut line = format!("  {what}: raw {raw:8.3} us");
    for api in ["safe", "safe_untracked"] {
        if let Some(t) = us(api) {
            line.push_str(&format!(
                "   {api} {t:8.3} us (x{:.3}, {:+.3} us per call, {:+.3} us per rank)",
                t / raw,
                t - raw,
                (t - raw) / n as f64
            ));
        }
    }
    println!("{line}");
}
