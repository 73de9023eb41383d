//! Ending a communicator while CUDA graphs that captured its operations are alive.
//!
//! NCCL's release of a communicator (`ncclCommAbort` and `ncclCommDestroy`) waits until every
//! CUDA graph that captured its operations is destroyed, and with several ranks in one
//! process the last rank to end it waits for every rank's graphs (`commDestroySync` in
//! `src/init.cc`, 2.28 to 2.32). A program that ends the communicator before dropping such a
//! graph, on the graph owner's thread, would wait forever; nccl-rs runs every abort on a
//! thread of its own, waited for at most a second (its kernels are stopped by then), and a
//! drop bounds its destroy by its timeout. This test ends communicators that way on purpose
//! (`Comm::abort`, an `AbortHandle`, a drop) and checks that every ending returns within
//! seconds, that the last rank's release is listed while NCCL still waits, and that it
//! finishes once the graphs are dropped. The ranks are threads of this process (one GPU each
//! where there are 2+, else two sharing GPU 0): a communicator of one rank would not do, since
//! NCCL runs its collectives without a plan, so its graphs hold nothing.
//!
//! Every graph's all-reduce is checked against the host first. A regression hangs: each
//! ending runs on a helper thread and the test fails after 30 s instead.
//!
//! Run on a GPU host: `cargo test --release --test gpu_captured_release -- --include-ignored`.

mod common;

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::threaded::{devices, gpu_test, init_threaded, per_rank};
use common::Rng;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaGraph, CudaSlice, CudaStream};
use nccl::{Comm, CommConfig, ReduceOp, Release};

/// Elements per all-reduce.
const LEN: usize = 4096;
/// How long an ending may take with a graph alive: the abort's wait (1 s) or the drop's
/// timeout set below (2 s), plus slack.
const ENDS_WITHIN: Duration = Duration::from_secs(8);
/// How long a test waits for an ending before calling it hung.
const HUNG: Duration = Duration::from_secs(30);

/// A stream on `device` whose context orders buffers by hand (cudarc's cross-stream events
/// would be recorded into the capture).
fn stream(device: usize) -> Arc<CudaStream> {
    let ctx = CudaContext::new(device).expect("CUDA context");
    // SAFETY: every buffer below is used on this one stream, in its order, and read back
    // only after the stream is synchronised.
    unsafe { ctx.disable_event_tracking() };
    ctx.new_stream().expect("stream")
}

/// Exactly summable values for `rank`.
fn values(seed: u64, rank: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed * 131 + rank as u64);
    (0..LEN).map(|_| rng.range(-1000, 1000) as f32).collect()
}

/// A graph of one all-reduce (sum) of `send` into `recv` on `comm`, captured on its stream,
/// after one run eagerly: NCCL connects to peers at a communicator's first collective, which
/// a capture does not allow ("operation not permitted when stream is capturing").
fn capture(comm: &Comm, send: &CudaSlice<f32>, recv: &mut CudaSlice<f32>) -> CudaGraph {
    let stream = comm.stream().clone();
    comm.all_reduce(send, recv, ReduceOp::Sum)
        .unwrap_or_else(|e| panic!("rank {}: all-reduce: {e}", comm.rank()));
    stream.synchronize().unwrap();
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .expect("begin capture");
    let captured = comm.all_reduce(send, recv, ReduceOp::Sum);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0));
    captured.unwrap_or_else(|e| panic!("rank {}: all-reduce in a capture: {e}", comm.rank()));
    graph
        .expect("end capture")
        .expect("a graph with the all-reduce")
}

/// Runs `end` on a thread of its own and returns how long it took; fails the test if it
/// has not returned after [`HUNG`] (the thread is left behind).
fn timed<F: FnOnce() + Send + 'static>(what: &str, end: F) -> Duration {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        end();
        let _ = tx.send(start.elapsed());
    });
    match rx.recv_timeout(HUNG) {
        Ok(took) => took,
        Err(_) => panic!(
            "{what} did not return within {HUNG:?} while a graph that captured the \
             communicator is alive (NCCL's release waits for such graphs)"
        ),
    }
}

/// The release listed for this rank, if one is in flight.
fn listed(comm_rank: usize, size: usize, device: usize) -> Option<Release> {
    Comm::releases_in_flight()
        .into_iter()
        .find(|r| (r.rank, r.size, r.device) == (comm_rank, size, device))
        .map(|r| r.release)
}

/// How the ranks end their communicators.
#[derive(Debug, Clone, Copy)]
enum End {
    Abort,
    AbortHandle,
    Drop,
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn ranks_end_while_their_graphs_live() {
    const TEST: &str = "ranks_end_while_their_graphs_live";
    let Some(_deadline) = gpu_test(TEST, Duration::from_secs(300)) else {
        return;
    };
    let devices = devices();
    let n = devices.len();
    let streams: Vec<_> = devices.iter().map(|&device| stream(device)).collect();
    for (round, end) in [End::Abort, End::AbortHandle, End::Drop]
        .into_iter()
        .enumerate()
    {
        let seed = round as u64;
        // Abort handles need nonblocking communicators.
        let config = CommConfig::new().blocking(!matches!(end, End::AbortHandle));
        let took = per_rank(
            init_threaded(streams.clone(), &config),
            |mut comm, barrier| {
                let rank = comm.rank();
                let device = devices[rank];
                comm.set_drop_timeout(Duration::from_secs(2));
                let stream = comm.stream().clone();
                let send = stream.clone_htod(&values(seed, rank)).unwrap();
                let mut recv = stream.alloc_zeros::<f32>(LEN).unwrap();
                let graph = capture(&comm, &send, &mut recv);
                stream.synchronize().unwrap();
                barrier.wait();
                graph.launch().unwrap();
                stream.synchronize().unwrap();
                let want: Vec<f32> = (0..LEN)
                    .map(|i| (0..n).map(|r| values(seed, r)[i]).sum())
                    .collect();
                assert_eq!(
                    stream.clone_dtoh(&recv).unwrap(),
                    want,
                    "{end:?}: rank {rank}: the replayed sum"
                );
                barrier.wait();
                // One rank after the other, so that the last is known: NCCL makes it wait for
                // every rank's graph.
                let mut comm = Some(comm);
                let mut took = Duration::ZERO;
                for turn in 0..n {
                    if turn == rank {
                        let comm = comm.take().unwrap();
                        took = match end {
                            End::Abort => timed("Comm::abort", move || comm.abort().unwrap()),
                            End::AbortHandle => {
                                let handle = comm.abort_handle().unwrap();
                                let took = timed("AbortHandle::abort", move || {
                                    handle.abort().unwrap();
                                });
                                drop(comm);
                                took
                            }
                            End::Drop => timed("a drop", move || drop(comm)),
                        };
                    }
                    barrier.wait();
                }
                if rank == n - 1 {
                    let want = match end {
                        End::Drop => Release::Destroy,
                        _ => Release::Abort,
                    };
                    assert_eq!(
                        listed(rank, n, device),
                        Some(want),
                        "{end:?}: the last rank's release waits for the graphs: {:?}",
                        Comm::releases_in_flight()
                    );
                }
                barrier.wait();
                drop(graph);
                barrier.wait();
                if rank == 0 {
                    Comm::wait_for_releases(Duration::from_secs(20))
                        .unwrap_or_else(|e| panic!("{end:?}: after every graph was dropped: {e}"));
                }
                barrier.wait();
                drop((send, recv));
                took
            },
        );
        for (rank, took) in took.iter().enumerate() {
            assert!(*took < ENDS_WITHIN, "{end:?}: rank {rank} took {took:?}");
        }
        eprintln!(
            "NOTE {TEST}: {end:?}: {n} ranks on devices {devices:?} ended with their graphs \
             alive, in {took:?}; every release finished once the graphs were dropped"
        );
    }
}
