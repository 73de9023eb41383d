//! Ending communicators over the network: a rank that ends its communicator right after a
//! collective completed on it must not make the peer's same collective fail.
//!
//! Over NCCL's network transport a collective completes on a rank once its GPU kernel has
//! handed its last sends to NCCL's proxy thread, which puts them on the wire afterwards. An
//! `ncclCommAbort` right then stops the proxy and closes the sockets, and the peer, still
//! receiving, fails with `ncclRemoteError` ("Connection closed by remote peer"). nccl-rs's
//! ways of ending a communicator (Drop, `finalize` then drop, `finalize` then `destroy`) end
//! a healthy one with `ncclCommDestroy`, which lets the proxy drain first (see
//! `nccl::comm`'s "End of life").
//!
//! The ranks run as simulated hosts (each its own `NCCL_HOSTID`, NET/Socket over loopback),
//! also on a multi-GPU host: that is the path where the proxy carries the data. Each rank, in
//! a loop: split a child from the parent communicator, all-reduce 1 MiB on it, synchronize,
//! end the child at once, then check the result; every failure of either rank counts. One job
//! of two ranks (one per GPU where there are more) per way of ending (drop; finalize, drop;
//! finalize, destroy), 40 iterations each by default, all jobs at once: about 40 s of a suite
//! run on 4 GPUs (4 ranks took 0.86 s per iteration there). The proof the crate's Drop was
//! judged by is 300 iterations (about 4.5 minutes on 4 GPUs), run with the variables below. A control job, run alone before them, ends the child with
//! `abort()` (what Drop did before) and only reports its count: how often the race is lost.
//!
//! ```text
//! NCCL_RS_TEARDOWN_ITERS=300 NCCL_RS_TEARDOWN_CONTROL_ITERS=100 cargo test --release --test gpu_teardown -- --include-ignored --nocapture
//! ```

mod common;

use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice};
use nccl::{Comm, ReduceOp, UniqueId};

use common::procs::{fields, var, Children};
use common::shape::{child_device, processes, Shape};

const CHILD_ENV: &str = "NCCL_RS_TEARDOWN_CHILD";
const END_ENV: &str = "NCCL_RS_TEARDOWN_END";
/// Iterations per way of ending of the crate's, unless set.
const ITERS_ENV: &str = "NCCL_RS_TEARDOWN_ITERS";
const DEFAULT_ITERS: usize = 40;
/// Iterations of the control (`abort()`), unless set.
const CONTROL_ITERS_ENV: &str = "NCCL_RS_TEARDOWN_CONTROL_ITERS";
const DEFAULT_CONTROL_ITERS: usize = 20;
/// Elements per all-reduce: 1 MiB of f32, several chunks on the socket transport.
const LEN: usize = 1 << 18;

/// How a child communicator is ended right after its collective.
#[derive(Debug, Clone, Copy, PartialEq)]
enum End {
    /// `drop`.
    Drop,
    /// `finalize()`, then `drop`.
    FinalizeDrop,
    /// `finalize()`, then `destroy()`.
    FinalizeDestroy,
    /// `abort()` after the stream is done: what Drop did before; the control.
    Abort,
}

const ENDS: [End; 4] = [
    End::Drop,
    End::FinalizeDrop,
    End::FinalizeDestroy,
    End::Abort,
];

impl End {
    /// The iterations of this way: `NCCL_RS_TEARDOWN_ITERS` (40) for the crate's,
    /// `NCCL_RS_TEARDOWN_CONTROL_ITERS` (20) for the control.
    fn iterations(self) -> usize {
        let (var, default) = match self {
            End::Abort => (CONTROL_ITERS_ENV, DEFAULT_CONTROL_ITERS),
            _ => (ITERS_ENV, DEFAULT_ITERS),
        };
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn ending_a_communicator_never_fails_a_peer_s_completed_collective() {
    let test = "ending_a_communicator_never_fails_a_peer_s_completed_collective";
    let Some(layout) = processes(test, &[Shape::Hosts], 2) else {
        return;
    };
    let start = Instant::now();
    // The control alone first (as the race was first seen), then one job per way of ending
    // of the crate's, all at once (the time goes to sockets, not to the GPU).
    let control = ENDS
        .iter()
        .position(|&e| e == End::Abort)
        .expect("a control");
    let waves: [&[End]; 2] = [&ENDS[control..=control], &ENDS[..control]];
    let version = nccl::version().unwrap();
    for wave in waves {
        run_wave(test, &layout, wave, version, start);
    }
}

/// Runs one job of two ranks per way of ending in `wave`, all at once, and checks them.
fn run_wave(
    test: &str,
    layout: &common::shape::Layout,
    wave: &[End],
    version: nccl::Version,
    start: Instant,
) {
    let n = layout.size();
    let ranks: Vec<usize> = (0..n).collect();
    let jobs: Vec<(End, usize, Children)> = wave
        .iter()
        .map(|&end| {
            let iters = end.iterations();
            let id = UniqueId::new().expect("ncclGetUniqueId");
            let children = Children::spawn("child_teardown", &ranks, |rank| {
                let mut vars = layout.env(rank);
                // Hosts of their own per job, too.
                vars.push(var("NCCL_HOSTID", format!("teardown-{end:?}-{rank}")));
                vars.push(var(CHILD_ENV, format!("{rank},{n},{id}")));
                vars.push(var(END_ENV, format!("{end:?}")));
                vars.push(var(ITERS_ENV, iters));
                vars
            });
            (end, iters, children)
        })
        .collect();
    for (end, iters, children) in jobs {
        let lines = children.finish(Duration::from_secs(1200));
        let failed = fields(&lines, "TEARDOWN", "failed");
        let done = fields(&lines, "TEARDOWN", "iters");
        assert_eq!(failed.len(), n, "{end:?}: every rank reports: {failed:?}");
        assert!(
            done.iter().all(|(_, d)| *d == iters as u128),
            "{end:?}: iterations run per rank: {done:?}"
        );
        let total: u128 = failed.iter().map(|(_, f)| f).sum();
        println!(
            "[{test}] NCCL {version}, {n} simulated hosts, {end:?}: {total} failed collectives of \
             {} ({iters} iterations, {:.0} s)",
            iters * n,
            start.elapsed().as_secs_f64()
        );
        if end != End::Abort {
            assert_eq!(total, 0, "{end:?}: a peer's collective failed: {failed:?}");
        }
    }
}

#[test]
#[ignore = "child process of ending_a_communicator_never_fails_a_peer_s_completed_collective"]
fn child_teardown() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.splitn(3, ',');
    let rank: usize = parts.next().unwrap().parse().unwrap();
    let size: usize = parts.next().unwrap().parse().unwrap();
    let id: UniqueId = parts.next().unwrap().parse().expect("id hex");
    let end_name = std::env::var(END_ENV).expect("the way of ending");
    let end = ENDS
        .into_iter()
        .find(|e| format!("{e:?}") == end_name)
        .expect("a known way of ending");
    let iters: usize = std::env::var(ITERS_ENV).unwrap().parse().unwrap();
    let device = child_device(rank);
    let stream = CudaContext::new(device).unwrap().new_stream().unwrap();
    let parent = Comm::init_rank(stream.clone(), &id, rank, size)
        .unwrap_or_else(|e| panic!("rank {rank}: init: {e}"));
    let sync = Duration::from_secs(60);
    let mut failed = 0;
    let mut first: Option<String> = None;
    let took = Instant::now();
    for iter in 0..iters {
        let child = parent
            .split(Some(0), rank as i32)
            .unwrap_or_else(|e| panic!("rank {rank}: {end:?} iteration {iter}: split: {e}"))
            .expect("every rank has a color");
        // Integers, so the sum is exact.
        let value = |r: usize| ((r + iter) % 7) as f32;
        let mut buf: CudaSlice<f32> = stream.clone_htod(&vec![value(rank); LEN]).unwrap();
        let outcome = child
            .all_reduce_in_place(&mut buf, ReduceOp::Sum)
            .and_then(|()| child.synchronize_timeout(sync));
        // At once, as a program that is done with it would (the result is checked after).
        match end {
            End::Drop => drop(child),
            End::FinalizeDrop => {
                let _ = child.finalize();
                drop(child);
            }
            End::FinalizeDestroy => {
                let _ = child.finalize();
                if let Err((child, _)) = child.destroy() {
                    drop(child);
                }
            }
            End::Abort => {
                let _ = child.abort();
            }
        }
        match outcome {
            Ok(()) => {
                let got = stream.clone_dtoh(&buf).unwrap();
                let want: f32 = (0..size).map(value).sum();
                assert!(
                    got.iter().all(|&v| v == want),
                    "rank {rank}: {end:?} iteration {iter}: wrong sum"
                );
            }
            Err(err) => {
                failed += 1;
                first.get_or_insert_with(|| format!("iteration {iter}: {err}"));
            }
        }
    }
    println!(
        "TEARDOWN rank={rank} end={end:?} iters={iters} failed={failed} took_ms={} first={}",
        took.elapsed().as_millis(),
        first.unwrap_or_else(|| "-".to_owned())
    );
    drop(parent);
}
