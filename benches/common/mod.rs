//! Shared setup of the criterion benches: one process driving every local GPU through a
//! `Group`, stream waits in nccl-tests' style, bus bandwidth, and the samples criterion took.
//!
//! Environment:
//!
//! | variable | meaning |
//! | --- | --- |
//! | `NCCL_RS_BENCH_GPUS` | use only the first N visible GPUs (default: all) |
//! | `NCCL_RS_BENCH_STREAM` | `default`: each GPU's default stream (the default, as `LocalJob::init_comm`); `own`: a stream of the bench's own per GPU, which activates cudarc's event tracking |
//! | `NCCL_RS_BENCH_EVENT_TRACKING` | `0` turns cudarc's event tracking off (default: on, cudarc's default; it only acts on `own` streams) |
//! | `NCCL_RS_BENCH_MAX_BYTES` | largest size of the collectives bench (default 1 GiB) |

#![allow(dead_code)]

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{sys, CudaContext, CudaStream};
use nccl::Comm;

/// Every GPU of this machine, one communicator each, all driven from this thread.
pub struct Gpus {
    /// One stream per GPU, in rank order.
    pub streams: Vec<Arc<CudaStream>>,
    /// One communicator per GPU (`Comm::init_all`), in rank order.
    pub comms: Vec<Comm>,
    /// Whether cudarc's event tracking acts on the buffers (tracking on and a stream of
    /// the bench's own: cudarc tracks nothing while a context has only its default stream).
    pub event_tracking: bool,
    /// Whether the streams are the bench's own rather than the default streams.
    pub own_streams: bool,
}

impl Gpus {
    /// The number of ranks.
    pub fn len(&self) -> usize {
        self.comms.len()
    }
}

/// Sets up every GPU, or explains on stderr why the benches cannot run here and returns
/// `None` (the caller then exits successfully: a machine without GPUs is not a failure).
pub fn setup(bench: &str) -> Option<Gpus> {
    match try_setup() {
        Ok(gpus) => {
            let lib = gpus.comms[0].library();
            println!(
                "{bench}: {} GPUs in one process, NCCL {} ({}), {} streams, cudarc event tracking {}",
                gpus.len(),
                lib.version(),
                lib.path().display(),
                if gpus.own_streams { "own" } else { "default" },
                if gpus.event_tracking { "active" } else { "inactive" }
            );
            Some(gpus)
        }
        Err(reason) => {
            eprintln!("{bench}: skipped, no GPU benchmark possible here: {reason}");
            None
        }
    }
}

fn try_setup() -> Result<Gpus, String> {
    let visible = nccl::library::cuda_device_count().map_err(|e| e.to_string())?;
    nccl::library::get().map_err(|e| e.to_string())?;
    let wanted = match std::env::var("NCCL_RS_BENCH_GPUS") {
        Ok(text) => text
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| format!("NCCL_RS_BENCH_GPUS={text:?} is not a GPU count"))?,
        Err(_) => visible,
    };
    let count = wanted.min(visible);
    let event_tracking = std::env::var("NCCL_RS_BENCH_EVENT_TRACKING")
        .map(|v| v.trim() != "0")
        .unwrap_or(true);
    let own_streams = match std::env::var("NCCL_RS_BENCH_STREAM")
        .as_deref()
        .map(str::trim)
    {
        Err(_) | Ok("default") => false,
        Ok("own") => true,
        Ok(other) => {
            return Err(format!(
                "NCCL_RS_BENCH_STREAM={other:?}: expected default or own"
            ))
        }
    };
    let mut streams = Vec::with_capacity(count);
    for ordinal in 0..count {
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("GPU {ordinal}: {e}"))?;
        if !event_tracking {
            // SAFETY: every buffer of the benches is used on its GPU's one stream only, and
            // freed in that stream's order, so the events have no cross-stream order to keep.
            unsafe { ctx.disable_event_tracking() };
        }
        streams.push(if own_streams {
            ctx.new_stream().map_err(|e| e.to_string())?
        } else {
            ctx.default_stream()
        });
    }
    let comms = Comm::init_all(&streams).map_err(|e| e.to_string())?;
    let event_tracking = streams
        .first()
        .is_some_and(|s| s.context().is_managing_stream_synchronization());
    Ok(Gpus {
        streams,
        comms,
        event_tracking,
        own_streams,
    })
}

/// Waits until every stream is idle, as nccl-tests does: `cuStreamQuery` polls with a
/// yield in between, no sleeps that would overshoot the end of a timed region.
pub fn wait_all(gpus: &Gpus) -> Result<(), String> {
    for (comm, stream) in gpus.comms.iter().zip(&gpus.streams) {
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| format!("GPU {}: {e}", stream.context().ordinal()))?;
        let mut polls: u64 = 0;
        loop {
            // SAFETY: the stream handle is owned by `stream`, alive for this call.
            match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
                sys::CUresult::CUDA_SUCCESS => break,
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                error => return Err(format!("cuStreamQuery: {error:?}")),
            }
            polls += 1;
            if polls.is_multiple_of(1024) {
                if let Some(err) = comm.async_error().map_err(|e| e.to_string())? {
                    return Err(err.to_string());
                }
            }
            std::thread::yield_now();
        }
    }
    Ok(())
}

/// Ends the bench with a message (and no backtrace) after an error in a timed region, where
/// criterion gives no way to return it.
pub fn fail(what: &str, err: impl std::fmt::Display) -> ! {
    eprintln!("error: {what}: {err}");
    std::process::exit(1);
}

/// The (iterations, elapsed) pairs criterion measured, to report bus bandwidth from the same
/// samples criterion's own figures come from.
#[derive(Default)]
pub struct Samples {
    taken: RefCell<Vec<(u64, Duration)>>,
}

impl Samples {
    /// Forgets earlier samples.
    pub fn clear(&self) {
        self.taken.borrow_mut().clear();
    }

    /// Records one call of the timing routine.
    pub fn record(&self, iters: u64, elapsed: Duration) {
        self.taken.borrow_mut().push((iters, elapsed));
    }

    /// Mean time per iteration over the last `samples` calls (criterion's measurement phase
    /// follows its warm-up, so those are its samples), criterion's "mean" estimate.
    pub fn mean(&self, samples: usize) -> Option<Duration> {
        let taken = self.taken.borrow();
        let last = &taken[taken.len().saturating_sub(samples)..];
        if last.is_empty() {
            return None;
        }
        let per_iter: f64 = last
            .iter()
            .map(|&(iters, elapsed)| elapsed.as_secs_f64() / iters.max(1) as f64)
            .sum::<f64>()
            / last.len() as f64;
        Some(Duration::from_secs_f64(per_iter))
    }
}

/// nccl-tests' bus bandwidth factor of an operation over `n` ranks.
pub fn bus_factor(coll: &str, n: usize) -> f64 {
    let n = n as f64;
    match coll {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" | "alltoall" => (n - 1.0) / n,
        _ => 1.0,
    }
}

/// `(algbw, busbw)` in GB/s for `bytes` moved in `time`.
pub fn bandwidth(coll: &str, n: usize, bytes: u64, time: Duration) -> (f64, f64) {
    let algbw = bytes as f64 / time.as_secs_f64() / 1e9;
    (algbw, algbw * bus_factor(coll, n))
}

/// A byte count the short way: 8B, 64KiB, 1GiB.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024 && value.is_multiple_of(1024) && unit + 1 < UNITS.len() {
        value /= 1024;
        unit += 1;
    }
    format!("{value}{}", UNITS[unit])
}

/// The sample count criterion uses: `default`, unless `--sample-size` says otherwise.
pub fn sample_size(default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.windows(2)
        .find(|pair| pair[0] == "--sample-size")
        .and_then(|pair| pair[1].parse().ok())
        .unwrap_or(default)
}
