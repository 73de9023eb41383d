//! Windows, one-sided RMA and communicator properties on real GPUs: every visible GPU is a
//! rank (at least 2), each driven by its own thread (or, for registration in a group, all by
//! one thread), checked against host references on random data.
//!
//! Run on a GPU host with `cargo test --test gpu_windows -- --include-ignored --test-threads=1`
//! (or `.gpu/run tests`). Tests that need a fresh NCCL environment (a NULL window forced with
//! `NCCL_WIN_ENABLE=0`, graph capture with cudarc's event tracking off) re-execute this binary.
//! Every test runs under a deadline that aborts the process with a message instead of hanging.
//!
//! Longer than 600 lines: it is one harness (ranks in threads, deadline, child processes,
//! reference data) shared by every window test; split, each part would repeat it.

mod common;

use std::ops::Range;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::threaded::{gpu_test, init_threaded, per_rank, Deadline};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use nccl::config::CtaPolicy;
use nccl::{
    Comm, CommConfig, Error, Group, NcclBuffer, NcclType, Operation, ReduceOp, Signal, SignalWait,
    Version, Window, WindowFlags,
};

const CHILD_ENV: &str = "NCCL_RS_WINDOWS_CHILD";
const SYNC: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------

/// The GPU of each rank: every GPU, or GPU 0 twice on a one-GPU host (see `common::shape`).
fn devices() -> Vec<usize> {
    common::threaded::devices()
}

fn version() -> Version {
    nccl::version().expect("NCCL loads")
}

fn stream(device: usize) -> Arc<CudaStream> {
    CudaContext::new(device)
        .and_then(|ctx| ctx.new_stream())
        .expect("stream")
}

/// One communicator per GPU, each created by its own thread with `config`.
fn comms(config: &CommConfig) -> Vec<Comm> {
    init_threaded(devices().into_iter().map(stream).collect(), config)
}

/// Re-executes this binary to run `test` with `env` added, and fails if it fails.
fn run_child(test: &str, env: &[(&str, &str)]) {
    let exe = std::env::current_exe().expect("current_exe");
    let mut child = Command::new(exe)
        .args([
            test,
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env("NCCL_NVLS_ENABLE", "0")
        .envs(env.iter().copied())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if start.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{test}: the child process did not finish in 300 s and was killed");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{test} (child process) failed: {status}");
}

fn is_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

/// Registers a zeroed buffer of `len` elements, or fails the test saying why.
fn window<T: NcclType>(comm: &Comm, len: usize, flags: WindowFlags) -> Window<'_, T> {
    let buffer = NcclBuffer::<T>::alloc_zeros(comm.stream(), len).expect("ncclMemAlloc");
    comm.register_window(buffer, flags).unwrap_or_else(|e| {
        panic!(
            "rank {}: registering a window of {len} elements ({flags:?}) on NCCL {}: {e}",
            comm.rank(),
            version()
        )
    })
}

// ---------------------------------------------------------------------------------------
// Reference data
// ---------------------------------------------------------------------------------------

/// Element types of the tests: small integers, exact in every type and every sum.
trait Elem: NcclType + std::fmt::Debug + PartialEq {
    fn from_i64(v: i64) -> Self;
}

impl Elem for f32 {
    fn from_i64(v: i64) -> Self {
        v as f32
    }
}

impl Elem for i32 {
    fn from_i64(v: i64) -> Self {
        v as i32
    }
}

/// Random integers in [-8, 8], the same on every thread for a given (seed, rank, len).
fn data(seed: u64, rank: usize, len: usize) -> Vec<i64> {
    let mut x = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add((rank as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9))
        | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 17) as i64 - 8
        })
        .collect()
}

fn cast<T: Elem>(values: &[i64]) -> Vec<T> {
    values.iter().map(|&v| T::from_i64(v)).collect()
}

const SENTINEL: i64 = 999;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Gather,
    Scatter,
}

const OPS: [Op; 8] = [
    Op::AllReduce,
    Op::Broadcast,
    Op::Reduce,
    Op::AllGather,
    Op::ReduceScatter,
    Op::AllToAll,
    Op::Gather,
    Op::Scatter,
];

impl Op {
    fn since(self) -> Version {
        match self {
            Op::AllToAll | Op::Gather | Op::Scatter => Version::new(2, 28, 0),
            _ => Version::new(2, 0, 0),
        }
    }

    /// Elements of rank `rank`'s input (out of place) or single buffer (in place).
    fn input_len(self, in_place: bool, rank: usize, root: usize, n: usize, c: usize) -> usize {
        match (self, in_place) {
            (Op::ReduceScatter | Op::AllToAll, _) => n * c,
            (Op::Scatter, false) => n * c,
            (Op::AllGather, true) => n * c,
            (Op::Gather | Op::Scatter, true) if rank == root => n * c,
            _ => c,
        }
    }

    fn output_len(self, n: usize, c: usize) -> usize {
        match self {
            Op::AllGather | Op::AllToAll | Op::Gather => n * c,
            _ => c,
        }
    }
}

/// What rank `r` must hold afterwards: the range of its output buffer to check (in the
/// single buffer, in place) and the values, or `None` when nothing is defined there.
fn expected(
    op: Op,
    in_place: bool,
    r: usize,
    root: usize,
    n: usize,
    c: usize,
    input: &dyn Fn(usize) -> Vec<i64>,
) -> Option<(Range<usize>, Vec<i64>)> {
    let sum = |range: Range<usize>| -> Vec<i64> {
        let mut acc = vec![0; range.len()];
        for q in 0..n {
            for (a, v) in acc.iter_mut().zip(&input(q)[range.clone()]) {
                *a += v;
            }
        }
        acc
    };
    let blocks = |f: &dyn Fn(usize) -> Vec<i64>| -> Vec<i64> { (0..n).flat_map(f).collect() };
    match op {
        Op::AllReduce => Some((0..c, sum(0..c))),
        Op::Broadcast => Some((0..c, input(root))),
        Op::Reduce => (r == root).then(|| (0..c, sum(0..c))),
        Op::AllGather => Some((0..n * c, blocks(&|q| input(q)[..c].to_vec()))),
        Op::ReduceScatter => {
            let block = r * c..(r + 1) * c;
            let at = if in_place { block.clone() } else { 0..c };
            Some((at, sum(block)))
        }
        Op::AllToAll => Some((0..n * c, blocks(&|q| input(q)[r * c..(r + 1) * c].to_vec()))),
        Op::Gather => (r == root).then(|| (0..n * c, blocks(&|q| input(q)[..c].to_vec()))),
        Op::Scatter => {
            let at = if in_place && r == root {
                root * c..(root + 1) * c
            } else {
                0..c
            };
            Some((at, input(root)[r * c..(r + 1) * c].to_vec()))
        }
    }
}

/// The single buffer of an in-place operation on rank `r`, from its input `mine`: the input
/// itself, except for all-gather and the root of a gather, whose buffer holds only this
/// rank's block (the first `c` input values, at block `r`) and must have the rest written.
fn in_place_init(op: Op, r: usize, root: usize, n: usize, c: usize, mine: &[i64]) -> Vec<i64> {
    if op == Op::AllGather || (op == Op::Gather && r == root) {
        let mut init = vec![SENTINEL; n * c];
        init[r * c..(r + 1) * c].copy_from_slice(&mine[..c]);
        init
    } else {
        mine.to_vec()
    }
}

/// Runs every collective on views of two windows at `offset`, out of place and in place,
/// and checks rank `comm.rank()`'s results. Returns the number of buffers checked.
fn collectives_on_windows<T: Elem>(
    comm: &Comm,
    send: &mut Window<'_, T>,
    recv: &mut Window<'_, T>,
    counts: &[usize],
    offsets: &[usize],
) -> usize {
    let (r, n) = (comm.rank(), comm.size());
    let root = n - 1;
    let stream = comm.stream().clone();
    let mut checked = 0;
    let mut seed = 1;
    for &c in counts {
        for &off in offsets {
            for op in OPS {
                if version() < op.since() {
                    continue;
                }
                for in_place in [false, true] {
                    seed += 1;
                    let what = format!(
                        "{op:?} {} of {c} x {} at offset {off} on rank {r}/{n}",
                        if in_place { "in place" } else { "out of place" },
                        std::any::type_name::<T>()
                    );
                    if in_place && op == Op::AllToAll {
                        // NCCL has no in-place all-to-all, and neither has the API.
                        continue;
                    }
                    // Shown with --nocapture: where a stalled run stopped.
                    println!("step: {what}");
                    if in_place && matches!(op, Op::Scatter | Op::Gather) && comm.copy_engine() {
                        // NCCL's copy-engine in-place scatter and gather place blocks at the
                        // root's offset plus the rank's: refused on every rank, before NCCL.
                        let mut buf = send.view_mut(off..off + n * c).unwrap();
                        let err = if op == Op::Scatter {
                            comm.scatter_in_place(&mut buf, root).unwrap_err()
                        } else {
                            comm.enqueue(Operation::gather_in_place(&mut buf, root))
                                .unwrap_err()
                        };
                        assert!(
                            matches!(&err, Error::InvalidArgument(m) if m.contains("out-of-place")),
                            "{what}: {err}"
                        );
                        checked += 1;
                        continue;
                    }
                    let input = |q: usize| data(seed, q, op.input_len(in_place, q, root, n, c));
                    let mine = input(r);
                    let out_len = if in_place {
                        mine.len()
                    } else {
                        op.output_len(n, c)
                    };
                    if in_place {
                        let init = in_place_init(op, r, root, n, c, &mine);
                        let mut buf = send.view_mut(off..off + init.len()).unwrap();
                        stream.memcpy_htod(&cast::<T>(&init), &mut buf).unwrap();
                        let call = match op {
                            Op::AllReduce => {
                                Operation::all_reduce_in_place(&mut buf, ReduceOp::Sum)
                            }
                            Op::Broadcast => Operation::broadcast_in_place(&mut buf, root),
                            Op::Reduce => Operation::reduce_in_place(&mut buf, ReduceOp::Sum, root),
                            Op::AllGather => Operation::all_gather_in_place(&mut buf),
                            Op::ReduceScatter => {
                                Operation::reduce_scatter_in_place(&mut buf, ReduceOp::Sum)
                            }
                            Op::Gather => Operation::gather_in_place(&mut buf, root),
                            Op::Scatter => Operation::scatter_in_place(&mut buf, root),
                            Op::AllToAll => unreachable!(),
                        };
                        comm.enqueue(call).unwrap_or_else(|e| panic!("{what}: {e}"));
                    } else {
                        let mut src = send.view_mut(off..off + mine.len()).unwrap();
                        stream.memcpy_htod(&cast::<T>(&mine), &mut src).unwrap();
                        let mut dst = recv.view_mut(off..off + out_len).unwrap();
                        stream
                            .memcpy_htod(&cast::<T>(&vec![SENTINEL; out_len]), &mut dst)
                            .unwrap();
                        let src = send.view(off..off + mine.len()).unwrap();
                        let call = match op {
                            Op::AllReduce => Operation::all_reduce(&src, &mut dst, ReduceOp::Sum),
                            Op::Broadcast => Operation::broadcast(
                                Some(&src as &dyn DevicePtr<T>),
                                &mut dst,
                                root,
                            ),
                            Op::Reduce => Operation::reduce(
                                &src,
                                Some(&mut dst as &mut dyn DevicePtrMut<T>),
                                ReduceOp::Sum,
                                root,
                            ),
                            Op::AllGather => Operation::all_gather(&src, &mut dst),
                            Op::ReduceScatter => {
                                Operation::reduce_scatter(&src, &mut dst, ReduceOp::Sum)
                            }
                            Op::AllToAll => Operation::all_to_all(&src, &mut dst),
                            Op::Gather => Operation::gather(
                                &src,
                                Some(&mut dst as &mut dyn DevicePtrMut<T>),
                                root,
                            ),
                            Op::Scatter => {
                                Operation::scatter(Some(&src as &dyn DevicePtr<T>), &mut dst, root)
                            }
                        };
                        comm.enqueue(call).unwrap_or_else(|e| panic!("{what}: {e}"));
                    }
                    comm.synchronize_timeout(SYNC)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let Some((range, want)) = expected(op, in_place, r, root, n, c, &input) else {
                        continue;
                    };
                    let window = if in_place { &*send } else { &*recv };
                    let got = stream
                        .clone_dtoh(&window.view(off + range.start..off + range.end).unwrap())
                        .unwrap();
                    let want = cast::<T>(&want);
                    if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
                        panic!(
                            "{what}: element {} is {:?}, expected {:?}",
                            range.start + i,
                            got[i],
                            want[i]
                        );
                    }
                    checked += 1;
                }
            }
        }
    }
    checked
}

/// Waits (bounded) for the work enqueued so far on `stream`.
fn drain(stream: &CudaStream, what: &str) {
    let done = stream.record_event(None).expect("record");
    let start = Instant::now();
    while !done.try_is_complete().expect("event query") {
        assert!(
            start.elapsed() < SYNC,
            "{what}: the stream did not drain in {SYNC:?}"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn assert_same<T: Elem>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..want.len()).find(|&i| got[i] != want[i]) {
        panic!(
            "{what}: element {i} is {:?}, expected {:?}",
            got[i], want[i]
        );
    }
}

fn unsupported(result: Result<(), Error>, what: &str) {
    match result {
        Err(err @ Error::Unsupported { .. }) => println!("{what}: {err}"),
        other => panic!("{what}: expected Error::Unsupported, got {other:?}"),
    }
}

/// Symmetric windows: NCCL 2.27, accepted by the crate from 2.28.7 (earlier symmetric
/// kernels could corrupt data; see `nccl::window::SYMMETRIC_SINCE`).
const SYMMETRIC: Version = nccl::window::SYMMETRIC_SINCE;
const V2_29: Version = Version::new(2, 29, 0);
const V2_29_4: Version = Version::new(2, 29, 4);
const V2_30_3: Version = Version::new(2, 30, 3);
const V2_31: Version = Version::new(2, 31, 0);
const V2_32: Version = Version::new(2, 32, 0);

// ---------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------

#[test]
#[ignore = "needs CUDA GPUs"]
fn every_collective_on_windows_at_offsets_in_and_out_of_place() {
    let Some(_deadline) = gpu_test(
        "every_collective_on_windows_at_offsets_in_and_out_of_place",
        Duration::from_secs(600),
    ) else {
        return;
    };
    let comms = comms(&CommConfig::new());
    let n = comms.len();
    if version() < SYMMETRIC {
        per_rank(comms, |comm, _| {
            let buffer = NcclBuffer::<f32>::alloc_zeros(comm.stream(), 4096).unwrap();
            let err = comm.register_window(buffer, WindowFlags::COLL_SYMMETRIC);
            unsupported(err.map(drop).map_err(Error::from), "ncclCommWindowRegister");
        });
        return;
    }
    let counts = [1, 1023, 1 << 16];
    let offsets = [0, 1, 1024];
    let cap = n * (1 << 16) + 1024;
    let checked = per_rank(comms, |comm, _| {
        let mut a = window::<f32>(&comm, cap, WindowFlags::COLL_SYMMETRIC);
        let mut b = window::<f32>(&comm, cap, WindowFlags::COLL_SYMMETRIC);
        let mut checked = collectives_on_windows(&comm, &mut a, &mut b, &counts, &offsets);
        // Plain (not symmetric) windows take the registered-buffer paths instead.
        let mut c = window::<i32>(&comm, cap, WindowFlags::DEFAULT);
        let mut d = window::<i32>(&comm, cap, WindowFlags::DEFAULT);
        checked += collectives_on_windows(&comm, &mut c, &mut d, &counts[..2], &offsets);
        // Windows go before their communicator: closing gives the buffers back.
        for window in [a, b] {
            let buffer = window.close().map_err(|(_, e)| e).expect("close");
            assert_eq!(buffer.len(), cap);
        }
        checked
    });
    println!(
        "NCCL {}: {n} ranks, {} results checked against the host",
        version(),
        checked.iter().sum::<usize>()
    );
    assert!(checked.iter().all(|&c| c >= 60), "{checked:?}");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn rma_ring_with_contexts_and_signals() {
    let Some(_deadline) = gpu_test(
        "rma_ring_with_contexts_and_signals",
        Duration::from_secs(300),
    ) else {
        return;
    };
    let v = version();
    let multi = v >= V2_31;
    let config = if multi {
        CommConfig::new().num_rma_ctx(2).num_rma_sig(2)
    } else {
        CommConfig::new()
    };
    let comms = comms(&config);
    if v < V2_29 {
        per_rank(comms, |comm, _| {
            if v < SYMMETRIC {
                return;
            }
            let mut win = window::<f32>(&comm, 4096, WindowFlags::COLL_SYMMETRIC);
            let next = (comm.rank() + 1) % comm.size();
            let view = win.view(0..16).unwrap();
            unsupported(
                win.put_signal(&view, next, 16, Signal::default()),
                "ncclPutSignal",
            );
            unsupported(win.signal(next, Signal::default()), "ncclSignal");
            unsupported(
                win.wait_signal(&[SignalWait::new(next, 1)]),
                "ncclWaitSignal",
            );
        });
        return;
    }
    let (contexts, signals) = if multi { (2, 2) } else { (1, 1) };
    let pairs = contexts * signals;
    let m = 4097;
    per_rank(comms, |comm, barrier| {
        let (r, n) = (comm.rank(), comm.size());
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let mut win = window::<f32>(&comm, 2 * pairs * m, WindowFlags::COLL_SYMMETRIC);
        assert_ne!(
            win.host_rma_support(),
            Some(false),
            "NCCL {v} reports no host RMA support on this host: {:?}",
            comm.properties()
        );
        let stream = comm.stream().clone();
        let signal_of = |k: usize| Signal::new((k % signals) as u32, (k / signals) as u32);
        for round in 0..3u64 {
            let values = |rank: usize| data(100 + round, rank, pairs * m);
            let mut slots = win.view_mut(0..pairs * m).unwrap();
            stream
                .memcpy_htod(&cast::<f32>(&values(r)), &mut slots)
                .unwrap();
            for k in 0..pairs {
                let source = win.view(k * m..(k + 1) * m).unwrap();
                win.put_signal(&source, next, pairs * m + k * m, signal_of(k))
                    .unwrap_or_else(|e| panic!("rank {r}: put_signal {k}: {e}"));
            }
            // One more signal without data on signal 0 of every context.
            for ctx in 0..contexts {
                win.signal(next, Signal::new(0, ctx as u32))
                    .unwrap_or_else(|e| panic!("rank {r}: signal on context {ctx}: {e}"));
            }
            let waits: Vec<SignalWait> = (0..pairs)
                .map(|k| {
                    let count = if k % signals == 0 { 2 } else { 1 };
                    SignalWait::new(prev, count).on(signal_of(k))
                })
                .collect();
            win.wait_signal(&waits)
                .unwrap_or_else(|e| panic!("rank {r}: wait_signal: {e}"));
            comm.synchronize_timeout(SYNC)
                .unwrap_or_else(|e| panic!("rank {r}, round {round}: {e}"));
            let got = stream
                .clone_dtoh(&win.view(pairs * m..2 * pairs * m).unwrap())
                .unwrap();
            assert_same(
                &got,
                &cast::<f32>(&values(prev)),
                &format!("rank {r}, round {round}: data put by rank {prev}"),
            );
            // Nobody overwrites a window before its owner has read this round.
            barrier.wait();
        }
        if !multi {
            unsupported(
                win.signal(next, Signal::new(1, 0)),
                "signal index 1 before NCCL 2.31",
            );
        }
    });
    println!("NCCL {v}: RMA ring over {contexts} contexts x {signals} signals checked");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn rma_mismatched_counts_time_out_instead_of_hanging() {
    let Some(_deadline) = gpu_test(
        "rma_mismatched_counts_time_out_instead_of_hanging",
        Duration::from_secs(300),
    ) else {
        return;
    };
    let v = version();
    if v < V2_29 {
        println!("NCCL {v} has no one-sided RMA: nothing to time out");
        return;
    }
    per_rank(comms(&CommConfig::new()), |comm, barrier| {
        let mut win = window::<f32>(&comm, 1024, WindowFlags::COLL_SYMMETRIC);
        let r = comm.rank();
        if r == 0 {
            // Two signals expected, one sent: the stream waits.
            win.wait_signal(&[SignalWait::new(1, 2)]).unwrap();
        }
        if r == 1 {
            win.signal(0, Signal::default()).unwrap();
            comm.synchronize_timeout(SYNC).unwrap();
        }
        if r == 0 {
            let start = Instant::now();
            match comm.synchronize_timeout(Duration::from_secs(3)) {
                Err(Error::Timeout { what, .. }) => println!("rank 0 timed out waiting for {what}"),
                other => panic!("a wait for a signal never sent must time out, got {other:?}"),
            }
            assert!(start.elapsed() < Duration::from_secs(30));
        }
        barrier.wait();
        if r == 1 {
            win.signal(0, Signal::default()).unwrap();
            comm.synchronize_timeout(SYNC).unwrap();
        }
        if r == 0 {
            comm.synchronize_timeout(SYNC)
                .expect("the missing signal, sent late, releases the stream");
        }
        barrier.wait();
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn null_window_is_unavailable_and_gives_the_buffer_back() {
    if common::shape::threaded("null_window_is_unavailable_and_gives_the_buffer_back").is_none() {
        return;
    }
    // NCCL reads its parameters once per process: a fresh one, with windows disabled.
    run_child(
        "child_null_window",
        &[("NCCL_WIN_ENABLE", "0"), ("NCCL_LOCAL_REGISTER", "0")],
    );
}

#[test]
#[ignore = "child process of null_window_is_unavailable_and_gives_the_buffer_back"]
fn child_null_window() {
    if !is_child() {
        return;
    }
    let _deadline = Deadline::new("child_null_window", Duration::from_secs(240));
    let v = version();
    let devices = devices();
    let n = devices.len();
    let expect_no_window = |err: &Error, what: &str| {
        if v < SYMMETRIC {
            assert!(matches!(err, Error::Unsupported { .. }), "{what}: {err}");
        } else {
            assert!(
                matches!(err, Error::Unavailable { .. }),
                "{what}: NCCL {v} with NCCL_WIN_ENABLE=0 must give no window, got {err}"
            );
        }
        println!("{what}: {err}");
    };
    per_rank(comms(&CommConfig::new()), |comm, _| {
        let buffer = NcclBuffer::<f32>::alloc_zeros(comm.stream(), 4096).unwrap();
        let err = comm
            .register_window(buffer, WindowFlags::COLL_SYMMETRIC)
            .expect_err("no window without symmetric memory");
        expect_no_window(err.error(), "register_window");
        let mut buffer = err.into_buffer().expect("the buffer comes back");
        assert_eq!(buffer.len(), 4096);
        // It is an ordinary buffer again.
        comm.all_reduce_in_place(&mut buffer, ReduceOp::Sum)
            .unwrap();
        comm.synchronize_timeout(SYNC).unwrap();
    });
    // The same in one NCCL group, from one thread.
    let streams: Vec<_> = devices.into_iter().map(stream).collect();
    let all = Comm::init_all(&streams).unwrap();
    let buffers = all
        .iter()
        .map(|comm| NcclBuffer::<f32>::alloc_zeros(comm.stream(), 4096))
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let err = Comm::register_windows(&all, buffers, WindowFlags::COLL_SYMMETRIC)
        .expect_err("no windows without symmetric memory");
    expect_no_window(err.error(), "register_windows");
    let back = err.into_buffers();
    assert_eq!(back.len(), n);
    assert!(back.iter().all(Option::is_some), "every buffer comes back");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn registration_in_a_group_and_on_nonblocking_communicators() {
    let Some(_deadline) = gpu_test(
        "registration_in_a_group_and_on_nonblocking_communicators",
        Duration::from_secs(300),
    ) else {
        return;
    };
    let v = version();
    if v < SYMMETRIC {
        println!("NCCL {v} has no windows");
        return;
    }
    let devices = devices();
    let n = devices.len();
    let c = 1 << 12;
    let sum: Vec<i64> = (0..c)
        .map(|i| (0..n).map(|q| data(7, q, c)[i]).sum())
        .collect();

    // One thread drives every communicator: registration goes through one NCCL group.
    let streams: Vec<_> = devices.into_iter().map(stream).collect();
    let all = Comm::init_all(&streams).unwrap();
    {
        // Inside a caller's Group a registration would not be valid until the group ends:
        // refused, with the buffer back.
        let group = Group::start().unwrap();
        let buffer = NcclBuffer::<f32>::alloc_zeros(all[0].stream(), 1024).unwrap();
        let err = all[0]
            .register_window(buffer, WindowFlags::COLL_SYMMETRIC)
            .unwrap_err();
        assert!(
            matches!(err.error(), Error::InvalidUsage(_)),
            "{}",
            err.error()
        );
        assert!(err.into_buffer().is_some());
        group.finish().unwrap();
    }
    let buffers = all
        .iter()
        .map(|comm| NcclBuffer::<f32>::alloc_zeros(comm.stream(), c))
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let mut windows = Comm::register_windows(&all, buffers, WindowFlags::COLL_SYMMETRIC)
        .unwrap_or_else(|e| panic!("register_windows on NCCL {v}: {e}"));
    for (r, window) in windows.iter_mut().enumerate() {
        streams[r]
            .memcpy_htod(&cast::<f32>(&data(7, r, c)), window)
            .unwrap();
    }
    let mut group = Group::start().unwrap();
    for (comm, window) in all.iter().zip(windows.iter_mut()) {
        group
            .enqueue(comm, Operation::all_reduce_in_place(window, ReduceOp::Sum))
            .unwrap();
    }
    group.finish().unwrap();
    for (r, (comm, window)) in all.iter().zip(&windows).enumerate() {
        comm.synchronize_timeout(SYNC).unwrap();
        let got = streams[r].clone_dtoh(window).unwrap();
        assert_same(
            &got,
            &cast::<f32>(&sum),
            &format!("grouped windows, rank {r}"),
        );
    }
    drop(windows);
    drop(all);

    // Nonblocking communicators, one thread each: registration waits until NCCL is done.
    let config = CommConfig::new().blocking(false);
    per_rank(comms(&config), |comm, _| {
        let r = comm.rank();
        assert!(!comm.is_blocking());
        let mut win = window::<f32>(&comm, c, WindowFlags::COLL_SYMMETRIC);
        if v >= V2_29 {
            let (base, _read) = win.device_ptr(comm.stream());
            assert_eq!(win.user_ptr().unwrap(), base, "ncclWinGetUserPtr");
        }
        let stream = comm.stream().clone();
        stream
            .memcpy_htod(&cast::<f32>(&data(7, r, c)), &mut win)
            .unwrap();
        comm.all_reduce_in_place(&mut win, ReduceOp::Sum).unwrap();
        comm.synchronize_timeout(SYNC).unwrap();
        let got = stream.clone_dtoh(&win).unwrap();
        assert_same(&got, &cast::<f32>(&sum), &format!("nonblocking rank {r}"));
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn windows_outlive_an_abort_of_their_communicator() {
    let Some(_deadline) = gpu_test(
        "windows_outlive_an_abort_of_their_communicator",
        Duration::from_secs(300),
    ) else {
        return;
    };
    let v = version();
    if v < SYMMETRIC {
        println!("NCCL {v} has no windows");
        return;
    }
    let config = CommConfig::new().blocking(false);
    per_rank(comms(&config), |comm, barrier| {
        let mut a = window::<f32>(&comm, 4096, WindowFlags::COLL_SYMMETRIC);
        let b = window::<f32>(&comm, 4096, WindowFlags::COLL_SYMMETRIC);
        comm.all_reduce_in_place(&mut a, ReduceOp::Sum).unwrap();
        comm.synchronize_timeout(SYNC).unwrap();
        barrier.wait();
        // Aborted from a handle (as a watchdog would, from another thread), windows alive.
        let handle = comm.abort_handle().unwrap();
        assert_eq!(handle.abort().unwrap(), nccl::AbortOutcome::Aborted);
        // NCCL freed the windows with the communicator: no deregistration, buffers back.
        let mut buffer = a
            .close()
            .map_err(|(_, e)| e)
            .expect("closing a window of an aborted communicator");
        let stream = comm.stream().clone();
        stream.memset_zeros(&mut buffer).unwrap();
        assert!(stream
            .clone_dtoh(&buffer)
            .unwrap()
            .iter()
            .all(|&x| x == 0.0));
        if v >= V2_29 {
            let err = b.user_ptr().unwrap_err();
            assert!(!err.to_string().is_empty());
        }
        // Dropping one after the abort frees its buffer without calling NCCL.
        drop(b);
        drop(buffer);
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn rma_captured_in_a_cuda_graph_replays() {
    if common::shape::threaded("rma_captured_in_a_cuda_graph_replays").is_none() {
        return;
    }
    // Captured work must not wait for events recorded outside the capture: the child turns
    // cudarc's event tracking off, which must not leak into other tests.
    run_child("child_rma_graph", &[]);
}

#[test]
#[ignore = "child process of rma_captured_in_a_cuda_graph_replays"]
fn child_rma_graph() {
    if !is_child() {
        return;
    }
    let _deadline = Deadline::new("child_rma_graph", Duration::from_secs(240));
    let v = version();
    if v < V2_29 {
        println!("NCCL {v} has no one-sided RMA");
        return;
    }
    let streams = devices()
        .into_iter()
        .map(|device| {
            let ctx = CudaContext::new(device).unwrap();
            // SAFETY: nothing was allocated on this context yet, and every stream below is
            // ordered by hand (the capture stream drains before the results are read).
            unsafe { ctx.disable_event_tracking() };
            ctx.new_stream().unwrap()
        })
        .collect();
    per_rank(
        init_threaded(streams, &CommConfig::new()),
        |comm, barrier| {
            let (r, n) = (comm.rank(), comm.size());
            let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
            let m = 8192;
            let mut win = window::<f32>(&comm, 2 * m, WindowFlags::COLL_SYMMETRIC);
            let capture = comm.context().new_stream().unwrap();
            comm.synchronize_timeout(SYNC).unwrap();
            capture
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .unwrap();
            let source = win.view(0..m).unwrap();
            let put = win.put_signal_on(&capture, &source, next, m, Signal::default());
            let captured =
                put.and_then(|()| win.wait_signal_on(&capture, &[SignalWait::new(prev, 1)]));
            let graph = capture.end_capture(CUgraphInstantiate_flags(0));
            if v < V2_30_3 {
                unsupported(captured, "RMA during graph capture");
                return;
            }
            captured.unwrap_or_else(|e| panic!("rank {r}: capturing RMA on NCCL {v}: {e}"));
            let graph = graph.unwrap().expect("a captured graph");
            for round in 0..4u64 {
                let values = |rank: usize| cast::<f32>(&data(1000 + round, rank, m));
                capture
                    .memcpy_htod(&values(r), &mut win.view_mut(0..m).unwrap())
                    .unwrap();
                drain(&capture, "upload");
                barrier.wait();
                graph.launch().unwrap();
                drain(&capture, &format!("rank {r}: replay {round}"));
                let got = capture.clone_dtoh(&win.view(m..2 * m).unwrap()).unwrap();
                assert_same(&got, &values(prev), &format!("rank {r}, replay {round}"));
                barrier.wait();
            }
        },
    );
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn properties_and_version_gates_follow_the_library() {
    let Some(_deadline) = gpu_test(
        "properties_and_version_gates_follow_the_library",
        Duration::from_secs(300),
    ) else {
        return;
    };
    let v = version();
    per_rank(comms(&CommConfig::new()), |comm, _| {
        match comm.properties() {
            Ok(props) => {
                assert!(v >= V2_29, "{v}");
                assert_eq!(
                    (props.rank, props.size, props.cuda_device),
                    (comm.rank(), comm.size(), comm.device())
                );
                if v >= V2_29_4 {
                    assert!(props.host_rma_support.is_some() && props.lsa_teams.is_some());
                }
                assert_eq!(props.comm_hash.is_some(), v >= V2_31);
                assert_eq!(props.cft_support.is_some(), v >= V2_32);
                if comm.rank() == 0 {
                    println!("NCCL {v}: {props:#?}");
                }
            }
            Err(err) => {
                assert!(v < V2_29, "{err}");
                unsupported(Err(err), "ncclCommQueryProperties");
            }
        }
        if v < SYMMETRIC {
            let buffer = NcclBuffer::<f32>::alloc_zeros(comm.stream(), 1024).unwrap();
            let err = comm.register_window(buffer, WindowFlags::COLL_SYMMETRIC);
            unsupported(err.map(drop).map_err(Error::from), "ncclCommWindowRegister");
            return;
        }
        // Flags newer than the library are refused before NCCL sees them, buffer back.
        for (flag, name, since) in WindowFlags::KNOWN {
            if v < since {
                let buffer = NcclBuffer::<f32>::alloc_zeros(comm.stream(), 1024).unwrap();
                let err = comm
                    .register_window(buffer, WindowFlags::COLL_SYMMETRIC | flag)
                    .unwrap_err();
                assert!(matches!(err.error(), Error::Unsupported { .. }), "{name}");
                assert!(err.into_buffer().is_some(), "{name}");
            }
        }
        let mut win = window::<f32>(&comm, 1024, WindowFlags::COLL_SYMMETRIC);
        match win.user_ptr() {
            Ok(ptr) => {
                assert!(v >= V2_29);
                let (base, _read) = win.device_ptr(comm.stream());
                assert_eq!(ptr, base);
            }
            Err(err) => unsupported(Err(err), "ncclWinGetUserPtr"),
        }
        if v < V2_29 {
            let next = (comm.rank() + 1) % comm.size();
            let view = win.view(0..8).unwrap();
            unsupported(
                win.put_signal(&view, next, 8, Signal::default()),
                "ncclPutSignal",
            );
            unsupported(win.signal(next, Signal::default()), "ncclSignal");
            unsupported(
                win.wait_signal(&[SignalWait::new(next, 1)]),
                "ncclWaitSignal",
            );
        }
        match nccl::CollConfig::new().to_raw(&comm) {
            Ok(raw) => assert!(v >= V2_31 && raw.get().size > 0),
            Err(err) => unsupported(Err(err), "ncclCollConfig_t"),
        }
        let event = comm.context().new_event(None).unwrap();
        match nccl::CollConfig::new()
            .kernel_started_event(&event)
            .to_raw(&comm)
        {
            Ok(raw) => assert!(v >= V2_32 && !raw.get().launchCompletionEvent.is_null()),
            Err(err) => unsupported(Err(err), "launchCompletionEvent"),
        }
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn misuse_is_rejected_with_typed_errors_and_leaves_the_communicator_usable() {
    let Some(_deadline) = gpu_test(
        "misuse_is_rejected_with_typed_errors_and_leaves_the_communicator_usable",
        Duration::from_secs(300),
    ) else {
        return;
    };
    let v = version();
    if v < SYMMETRIC {
        println!("NCCL {v} has no windows");
        return;
    }
    let devices = devices();
    per_rank(comms(&CommConfig::new()), |comm, barrier| {
        let (r, n) = (comm.rank(), comm.size());
        let next = (r + 1) % n;
        let invalid = |err: &Error, what: &str| {
            assert!(matches!(err, Error::InvalidArgument(_)), "{what}: {err}");
        };
        // A buffer on another GPU, an empty one, undefined flag bits: refused, buffer back.
        match devices.iter().find(|&&d| d != comm.device()) {
            Some(&other) => {
                let foreign = NcclBuffer::<f32>::alloc_zeros(&stream(other), 64).unwrap();
                let err = comm
                    .register_window(foreign, WindowFlags::COLL_SYMMETRIC)
                    .unwrap_err();
                invalid(err.error(), "buffer on another device");
                assert_eq!(err.into_buffer().map(|b| b.len()), Some(64));
            }
            None => println!("rank {r}: no other GPU here for the foreign-buffer case"),
        }
        let empty = NcclBuffer::<f32>::alloc_zeros(comm.stream(), 0).unwrap();
        let err = comm
            .register_window(empty, WindowFlags::COLL_SYMMETRIC)
            .unwrap_err();
        invalid(err.error(), "empty buffer");
        let odd = NcclBuffer::<f32>::alloc_zeros(comm.stream(), 64).unwrap();
        let err = comm
            .register_window(odd, WindowFlags::from_bits(0x100))
            .unwrap_err();
        invalid(err.error(), "undefined flag");

        eprintln!("misuse rank {r}: registering sym");
        let mut sym = window::<f32>(&comm, 1024, WindowFlags::COLL_SYMMETRIC);
        eprintln!("misuse rank {r}: registering plain");
        let plain = window::<f32>(&comm, 1024, WindowFlags::DEFAULT);
        invalid(&sym.view(1000..1025).unwrap_err(), "view past the end");
        invalid(&sym.split_at_mut(1025).unwrap_err(), "split past the end");
        if v >= V2_29 {
            eprintln!("misuse rank {r}: splitting");
            let child = comm
                .split(Some(0), r as i32)
                .unwrap()
                .expect("every rank joins the child");
            eprintln!("misuse rank {r}: registering on the child");
            let other = window::<f32>(&child, 64, WindowFlags::COLL_SYMMETRIC);
            let from_other = other.view(0..4).unwrap();
            let err = sym
                .put_signal(&from_other, next, 0, Signal::default())
                .unwrap_err();
            invalid(&err, "source in another communicator's window");
            let err = sym
                .put_signal(&plain.view(0..4).unwrap(), next, 0, Signal::default())
                .unwrap_err();
            invalid(&err, "source in a window that is not symmetric");
            let err = sym
                .put_signal(&sym.view(0..8).unwrap(), next, 1020, Signal::default())
                .unwrap_err();
            invalid(&err, "put past the end of the target");
            invalid(
                &sym.signal(n, Signal::default()).unwrap_err(),
                "peer out of range",
            );
            invalid(&sym.wait_signal(&[]).unwrap_err(), "no waits");
            invalid(
                &sym.wait_signal(&[SignalWait::new(next, 0)]).unwrap_err(),
                "a wait for zero signals",
            );
            if v < V2_31 {
                unsupported(
                    sym.signal(next, Signal::new(0, 1)),
                    "context 1 before NCCL 2.31",
                );
            }
            eprintln!("misuse rank {r}: dropping the child's window");
            // Deregistration is local (no bootstrap call in `ncclCommWindowDeregister`).
            drop(other);
            eprintln!("misuse rank {r}: finalizing the child");
            child.finalize().unwrap();
            child
                .destroy()
                .unwrap_or_else(|(_, e)| panic!("rank {r}: destroying the child: {e}"));
            // Ending a communicator is collective over the ranks in this process: NCCL's
            // `commReclaim` returns at once on every rank but the last to end it, which then
            // frees every rank's child (windows included) with device-synchronising frees.
            // Without this barrier a rank that ended first enqueues the all-reduce below,
            // whose kernel waits for the last rank, while that rank's cleanup waits for the
            // kernel: the stall seen on NCCL 2.32.3 (with drop/abort as well as destroy).
            barrier.wait();
        }
        eprintln!("misuse rank {r}: all-reduce on sym");
        // None of that touched the communicator.
        let stream = comm.stream().clone();
        stream.memcpy_htod(&vec![1.0f32; 1024], &mut sym).unwrap();
        comm.all_reduce_in_place(&mut sym, ReduceOp::Sum).unwrap();
        comm.synchronize_timeout(SYNC).unwrap();
        let got = stream.clone_dtoh(&sym).unwrap();
        assert!(got.iter().all(|&x| x == n as f32), "rank {r}: {}", got[0]);
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn zero_cta_policy_collectives_on_symmetric_windows() {
    let Some(_deadline) = gpu_test(
        "zero_cta_policy_collectives_on_symmetric_windows",
        Duration::from_secs(300),
    ) else {
        return;
    };
    let v = version();
    if v < SYMMETRIC {
        println!("NCCL {v}: no symmetric windows here (CtaPolicy::ZERO needs them)");
        return;
    }
    // Copy-engine all-gather, all-to-all, gather and scatter need symmetric windows, a CUDA
    // 12.5 driver and this policy (NCCL's buffer registration docs); NCCL_DEBUG=INFO shows
    // which path each collective took.
    let config = CommConfig::new().cta_policy(CtaPolicy::ZERO);
    println!("step: creating communicators with CtaPolicy::ZERO");
    let comms = comms(&config);
    let n = comms.len();
    let c = 1 << 18;
    let checked = per_rank(comms, |comm, _| {
        println!("step: registering windows on rank {}", comm.rank());
        let mut a = window::<f32>(&comm, n * c, WindowFlags::COLL_SYMMETRIC);
        let mut b = window::<f32>(&comm, n * c, WindowFlags::COLL_SYMMETRIC);
        assert!(comm.copy_engine(), "CtaPolicy::ZERO on NCCL {v}");
        // Off the root a gather without a receive buffer would take the kernel path while
        // the root takes the copy engines, and both would wait forever: refused up front.
        let root = n - 1;
        if comm.rank() != root {
            let src = a.view(0..c).unwrap();
            let err = comm.gather(&src, None, root).unwrap_err();
            assert!(
                matches!(&err, Error::InvalidArgument(m) if m.contains("pass the receive buffer")),
                "{err}"
            );
        }
        collectives_on_windows(&comm, &mut a, &mut b, &[c], &[0])
    });
    println!(
        "NCCL {v}: CtaPolicy::ZERO on symmetric windows, {} results checked",
        checked.iter().sum::<usize>()
    );
    assert!(checked.iter().all(|&k| k >= 8), "{checked:?}");
}

/// C1 and M2 on real GPUs (NCCL 2.31+, symmetric windows, communicators with the default CTA
/// policy): a per-call `CtaPolicy::ZERO` must bring the copy-engine guards with it. Before
/// the fix `scatter_in_place` with root 1 and a per-call ZERO was accepted, and NCCL's
/// copy-engine scatter left misplaced blocks (2 ranks sharing one H100, NCCL 2.32.3). Now:
/// the in-place forms are refused on every rank, an off-root gather without (or with a
/// short) receive view is refused, and the out-of-place forms with a per-call ZERO give the
/// host reference's results, with the window tail past the collective untouched.
#[test]
#[ignore = "needs CUDA GPUs"]
fn c1_per_call_zero_policy_keeps_the_copy_engine_guards() {
    const TEST: &str = "c1_per_call_zero_policy_keeps_the_copy_engine_guards";
    let Some(_deadline) = gpu_test(TEST, Duration::from_secs(300)) else {
        return;
    };
    let v = version();
    if v < V2_31 {
        common::shape::skip(TEST, &format!("NCCL {v} has no per-call CTA policy (2.31)"));
        return;
    }
    let comms = comms(&CommConfig::new());
    if comms.iter().any(|comm| comm.copy_engine()) {
        common::shape::skip(
            TEST,
            "NCCL_CTA_POLICY asks for ZERO on every communicator here",
        );
        return;
    }
    let n = comms.len();
    let c = 256;
    // As in the report: a window of 2 x 256 + 1024 elements, collectives on its start.
    let len = n * c + 1024;
    let config = nccl::CollConfig::new().cta_policy(CtaPolicy::ZERO);
    let checked = per_rank(comms, |comm, barrier| {
        let r = comm.rank();
        let root = 1 % n;
        let stream = comm.stream().clone();
        let mut a = window::<f32>(&comm, len, WindowFlags::COLL_SYMMETRIC);
        let mut b = window::<f32>(&comm, len, WindowFlags::COLL_SYMMETRIC);
        let tail = vec![SENTINEL as f32; len];
        stream.memcpy_htod(&tail, &mut a).unwrap();
        stream.memcpy_htod(&tail, &mut b).unwrap();
        // In place, scatter and gather: refused on every rank before NCCL sees them.
        {
            let mut buf = a.view_mut(0..n * c).unwrap();
            let err = comm
                .enqueue(Operation::scatter_in_place(&mut buf, root).with_config(&config))
                .unwrap_err();
            assert!(
                matches!(&err, Error::InvalidArgument(m) if m.contains("out-of-place scatter")),
                "rank {r}: {err}"
            );
            let err = comm
                .enqueue(Operation::gather_in_place(&mut buf, root).with_config(&config))
                .unwrap_err();
            assert!(
                matches!(&err, Error::InvalidArgument(m) if m.contains("out-of-place gather")),
                "rank {r}: {err}"
            );
        }
        // Off the root, a gather without a receive view or with a short one: refused
        // (the root does not call, or it would wait for them).
        if r != root {
            let src = a.view(0..c).unwrap();
            let err = comm
                .enqueue(Operation::gather(&src, None, root).with_config(&config))
                .unwrap_err();
            assert!(
                matches!(&err, Error::InvalidArgument(m) if m.contains("pass the receive buffer")),
                "rank {r}: {err}"
            );
            let mut short = b.view_mut(0..c).unwrap();
            let err = comm
                .enqueue(
                    Operation::gather(&src, Some(&mut short as &mut dyn DevicePtrMut<f32>), root)
                        .with_config(&config),
                )
                .unwrap_err();
            assert!(
                matches!(&err, Error::InvalidArgument(m) if m.contains("must hold")),
                "rank {r}: {err}"
            );
        }
        barrier.wait();
        // Out of place with the per-call ZERO: real results against the host reference.
        let mut checked = 0;
        for op in [Op::Scatter, Op::Gather] {
            let seed = 77 + op as u64;
            let input = |q: usize| data(seed, q, op.input_len(false, q, root, n, c));
            let mine = input(r);
            stream.memcpy_htod(&tail, &mut b).unwrap();
            {
                let mut src = a.view_mut(0..mine.len()).unwrap();
                stream.memcpy_htod(&cast::<f32>(&mine), &mut src).unwrap();
            }
            let src = a.view(0..mine.len()).unwrap();
            let out_len = if op == Op::Scatter { c } else { n * c };
            let mut dst = b.view_mut(0..out_len).unwrap();
            let call = if op == Op::Scatter {
                Operation::scatter(Some(&src as &dyn DevicePtr<f32>), &mut dst, root)
            } else {
                Operation::gather(&src, Some(&mut dst as &mut dyn DevicePtrMut<f32>), root)
            };
            comm.enqueue(call.with_config(&config))
                .unwrap_or_else(|e| panic!("{op:?} on rank {r}: {e}"));
            comm.synchronize_timeout(SYNC).unwrap();
            let got = stream.clone_dtoh(&b).unwrap();
            if let Some((range, want)) = expected(op, false, r, root, n, c, &input) {
                assert_eq!(
                    &got[range.clone()],
                    &cast::<f32>(&want)[..],
                    "{op:?} rank {r}"
                );
                checked += 1;
            }
            // Nothing past the collective's own extent was written (a misplaced copy-engine
            // block would land there).
            assert!(
                got[out_len..].iter().all(|&x| x == SENTINEL as f32),
                "{op:?} rank {r}: the window past the collective was written"
            );
            barrier.wait();
        }
        checked
    });
    common::shape::ran(TEST, &format!("NCCL {v}, {n} ranks"));
    assert!(checked.iter().sum::<usize>() > n, "{checked:?}");
}

/// What NCCL does, element by element, to the buffers the test hands it (the single buffers
/// in place, the send buffers otherwise); returns each rank's output buffer. Written apart
/// from [`expected`] so that the two check each other.
fn simulate(
    op: Op,
    in_place: bool,
    n: usize,
    c: usize,
    root: usize,
    bufs: &[Vec<i64>],
) -> Vec<Vec<i64>> {
    let mut out: Vec<Vec<i64>> = if in_place {
        bufs.to_vec()
    } else {
        vec![vec![SENTINEL; op.output_len(n, c)]; n]
    };
    // What rank `q` contributes, where NCCL reads it.
    let send = |q: usize| -> &[i64] {
        match op {
            Op::AllGather if in_place => &bufs[q][q * c..(q + 1) * c],
            Op::Gather if in_place && q == root => &bufs[q][q * c..(q + 1) * c],
            _ => &bufs[q],
        }
    };
    let sum = |i: usize| (0..n).map(|q| send(q)[i]).sum::<i64>();
    for (r, out) in out.iter_mut().enumerate() {
        for i in 0..c {
            match op {
                Op::AllReduce => out[i] = sum(i),
                Op::Broadcast => out[i] = send(root)[i],
                Op::Reduce if r == root => out[i] = sum(i),
                Op::Reduce => {}
                Op::AllGather => {
                    for q in 0..n {
                        out[q * c + i] = send(q)[i];
                    }
                }
                Op::ReduceScatter => {
                    let at = if in_place { r * c } else { 0 };
                    out[at + i] = sum(r * c + i);
                }
                Op::AllToAll => {
                    for q in 0..n {
                        out[q * c + i] = send(q)[r * c + i];
                    }
                }
                Op::Gather if r == root => {
                    for q in 0..n {
                        out[q * c + i] = send(q)[i];
                    }
                }
                Op::Gather => {}
                Op::Scatter => {
                    let at = if in_place && r == root { root * c } else { 0 };
                    out[at + i] = send(root)[r * c + i];
                }
            }
        }
    }
    out
}

/// Checks the test's reference (`expected`) and in-place layouts (`in_place_init`) against
/// `simulate`: runs on the CPU.
#[test]
fn reference_model_agrees_with_a_direct_simulation() {
    let mut compared = 0;
    for n in 2..=4 {
        for c in 1..=3 {
            for root in [0, n - 1] {
                for op in OPS {
                    for in_place in [false, true] {
                        if in_place && op == Op::AllToAll {
                            continue;
                        }
                        let seed = (n * 100 + c * 10 + root) as u64;
                        let input = |q: usize| data(seed, q, op.input_len(in_place, q, root, n, c));
                        let bufs: Vec<Vec<i64>> = (0..n)
                            .map(|q| {
                                if in_place {
                                    in_place_init(op, q, root, n, c, &input(q))
                                } else {
                                    input(q)
                                }
                            })
                            .collect();
                        let outs = simulate(op, in_place, n, c, root, &bufs);
                        for (r, out) in outs.iter().enumerate() {
                            let Some((range, want)) = expected(op, in_place, r, root, n, c, &input)
                            else {
                                continue;
                            };
                            assert_eq!(
                                &out[range.clone()],
                                &want[..],
                                "{op:?} in_place={in_place} n={n} c={c} root={root} rank {r}"
                            );
                            compared += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(compared > 500, "{compared}");
}

/// M5 on real GPUs: ranks registering windows of different sizes. Before NCCL 2.30.7 that
/// is refused on every rank (NCCL sized the peers' mappings by the local registration);
/// from 2.30.7 it is accepted, and a put that fits this rank's window but not the smaller
/// target's is refused, while one that fits both moves real data (checked against the
/// host). Different flags are refused on every version. Before the fix nothing compared.
#[test]
#[ignore = "needs CUDA GPUs"]
fn m5_window_sizes_and_flags_are_agreed_across_ranks() {
    const TEST: &str = "m5_window_sizes_and_flags_are_agreed_across_ranks";
    let Some(_deadline) = gpu_test(TEST, Duration::from_secs(300)) else {
        return;
    };
    let v = version();
    if v < SYMMETRIC {
        common::shape::skip(TEST, &format!("NCCL {v}: no symmetric windows (2.28.7)"));
        return;
    }
    let differ_ok = v >= Version::new(2, 30, 7);
    per_rank(comms(&CommConfig::new()), |comm, barrier| {
        let (r, n) = (comm.rank(), comm.size());
        // Flags differing across ranks: refused everywhere, buffer back.
        let flags = if r == 0 {
            WindowFlags::COLL_SYMMETRIC
        } else {
            WindowFlags::DEFAULT
        };
        let buffer = NcclBuffer::<f32>::alloc_zeros(comm.stream(), 1024).unwrap();
        let err = comm.register_window(buffer, flags).unwrap_err();
        assert!(
            matches!(err.error(), Error::InvalidArgument(m) if m.contains("flags")),
            "rank {r}: {}",
            err.error()
        );
        assert!(err.into_buffer().is_some());
        // Sizes differing: rank 0 has the smallest window.
        let len = if r == 0 { 1024 } else { 2048 };
        let buffer = NcclBuffer::<f32>::alloc_zeros(comm.stream(), len).unwrap();
        let outcome = comm.register_window(buffer, WindowFlags::COLL_SYMMETRIC);
        if !differ_ok {
            let err = outcome.unwrap_err();
            assert!(
                matches!(err.error(), Error::InvalidArgument(m) if m.contains("same size")),
                "rank {r} on NCCL {v}: {}",
                err.error()
            );
            return;
        }
        let mut win = outcome.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        if v < V2_29 || win.host_rma_support() == Some(false) {
            return;
        }
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let stream = comm.stream().clone();
        let payload: Vec<f32> = data(91, r, 64).iter().map(|&x| x as f32).collect();
        stream
            .memcpy_htod(&payload, &mut win.view_mut(0..64).unwrap())
            .unwrap();
        if next == 0 {
            // Fits this rank's window of 2048 but not rank 0's of 1024: refused here.
            let err = win
                .put_signal(&win.view(0..64).unwrap(), next, 1000, Signal::default())
                .unwrap_err();
            assert!(
                matches!(&err, Error::InvalidArgument(m) if m.contains("window of 1024")),
                "rank {r}: {err}"
            );
        }
        barrier.wait();
        // Fits every window: real data through the ring.
        win.put_signal(&win.view(0..64).unwrap(), next, 512, Signal::default())
            .unwrap_or_else(|e| panic!("rank {r}: put: {e}"));
        win.wait_signal(&[SignalWait::new(prev, 1)]).unwrap();
        comm.synchronize_timeout(SYNC).unwrap();
        let got = stream.clone_dtoh(&win.view(512..576).unwrap()).unwrap();
        let want: Vec<f32> = data(91, prev, 64).iter().map(|&x| x as f32).collect();
        assert_eq!(got, want, "rank {r}: the put from rank {prev}");
        barrier.wait();
    });
    common::shape::ran(TEST, &format!("NCCL {v}"));
}

/// M4 on real GPUs: one rank refuses its own registration (an empty buffer), the others
/// register a good one. Before the fix the refusing rank returned alone while the others
/// waited in NCCL's bootstrap all-gather forever (the deadline ends such a run); now every
/// rank returns the refusal, and a registration after it works and carries a checked
/// all-reduce.
#[test]
#[ignore = "needs CUDA GPUs"]
fn m4_a_refused_registration_is_reported_on_every_rank() {
    const TEST: &str = "m4_a_refused_registration_is_reported_on_every_rank";
    let Some(_deadline) = gpu_test(TEST, Duration::from_secs(180)) else {
        return;
    };
    let v = version();
    if v < SYMMETRIC {
        common::shape::skip(TEST, &format!("NCCL {v}: no symmetric windows (2.28.7)"));
        return;
    }
    per_rank(comms(&CommConfig::new()), |comm, _| {
        let (r, n) = (comm.rank(), comm.size());
        let len = if r == n - 1 { 0 } else { 1024 };
        let buffer = NcclBuffer::<f32>::alloc_zeros(comm.stream(), len).unwrap();
        let err = comm
            .register_window(buffer, WindowFlags::COLL_SYMMETRIC)
            .unwrap_err();
        let text = err.error().to_string();
        if r == n - 1 {
            assert!(text.contains("at least one element"), "rank {r}: {text}");
        } else {
            assert!(
                text.contains(&format!("rank {} refused its own window", n - 1)),
                "rank {r}: {text}"
            );
        }
        assert_eq!(err.into_buffer().map(|b| b.len()), Some(len));
        // The communicator is unharmed: a registration on every rank, and a collective on it.
        let mut win = window::<f32>(&comm, 1024, WindowFlags::COLL_SYMMETRIC);
        let stream = comm.stream().clone();
        let mine: Vec<f32> = data(5, r, 1024).iter().map(|&x| x as f32).collect();
        stream.memcpy_htod(&mine, &mut win).unwrap();
        comm.all_reduce_in_place(&mut win, ReduceOp::Sum).unwrap();
        comm.synchronize_timeout(SYNC).unwrap();
        let want: Vec<f32> = (0..1024)
            .map(|i| (0..n).map(|q| data(5, q, 1024)[i]).sum::<i64>() as f32)
            .collect();
        assert_eq!(stream.clone_dtoh(&win).unwrap(), want, "rank {r}");
    });
    common::shape::ran(TEST, &format!("NCCL {v}"));
}

/// C2: on NCCL 2.29 and 2.30 the first RMA call on a rank sets RMA up with a step every rank
/// must take (a bootstrap all-gather and barrier). Rank 0 puts into rank 1's window and
/// waits for its stream to finish before rank 1 makes any RMA call: before the fix rank 0's
/// put waited in NCCL's set-up for ranks that were waiting for rank 0 (the deadline ends
/// that run); now the step was taken at registration, and rank 1's wait then finds the
/// data, checked against the host. Ranks past 1 never touch RMA. On 2.31+ NCCL sets up at
/// registration itself, and the same test must pass.
#[test]
#[ignore = "needs CUDA GPUs"]
fn c2_rma_between_two_ranks_does_not_wait_for_the_others() {
    const TEST: &str = "c2_rma_between_two_ranks_does_not_wait_for_the_others";
    let Some(_deadline) = gpu_test(TEST, Duration::from_secs(180)) else {
        return;
    };
    let v = version();
    if v < V2_29 {
        common::shape::skip(TEST, &format!("NCCL {v} has no one-sided RMA (2.29)"));
        return;
    }
    let c = 1000;
    let outcomes = per_rank(comms(&CommConfig::new()), |comm, barrier| {
        let r = comm.rank();
        let stream = comm.stream().clone();
        let mut win = window::<f32>(&comm, 4096, WindowFlags::COLL_SYMMETRIC);
        if win.host_rma_support() == Some(false) {
            return false;
        }
        let payload: Vec<f32> = data(23, 0, c).iter().map(|&x| x as f32).collect();
        if r == 0 {
            stream
                .memcpy_htod(&payload, &mut win.view_mut(0..c).unwrap())
                .unwrap();
            win.put_signal(&win.view(0..c).unwrap(), 1, 2048, Signal::default())
                .unwrap_or_else(|e| panic!("rank 0: put: {e}"));
            comm.synchronize_timeout(SYNC)
                .unwrap_or_else(|e| panic!("rank 0: the put did not finish alone: {e}"));
        }
        barrier.wait();
        if r == 1 {
            win.wait_signal(&[SignalWait::new(0, 1)]).unwrap();
            comm.synchronize_timeout(SYNC).unwrap();
            let got = stream
                .clone_dtoh(&win.view(2048..2048 + c).unwrap())
                .unwrap();
            assert_eq!(got, payload, "rank 1: the put from rank 0");
        }
        barrier.wait();
        true
    });
    if outcomes.iter().all(|&ran| ran) {
        common::shape::ran(TEST, &format!("NCCL {v}"));
    } else {
        common::shape::skip(TEST, &format!("NCCL {v}: no host RMA support here"));
    }
}
