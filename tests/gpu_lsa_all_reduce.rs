//! The all-reduce kernels nccl-rs ships (`nccl::device::LsaAllReduce`) on real GPUs: each
//! scheme (one- and two-shot flags, LSA barrier, NCCL, chosen by size), f32/bf16/f16, sizes from one element to
//! the scratch's capacity, aligned and unaligned, in and out of place, checked exactly against
//! a host reference on random integer-valued data (with negative zeros, the flags scheme's
//! sentinel, among the inputs) on every rank; calls of differing sizes and schemes in a row
//! (the flags buffers' rotation and clearing); CUDA-graph replay (the call counters live on
//! the device); the ranks' agreement at creation; typed refusals; a rank that skips a call
//! (the peers' flags kernel gives up, `check` says so); NCCL before 2.29.2 refused on every
//! rank; the all-gather kernel, bit for bit on random bit patterns (NaNs, negative zeros),
//! between all-reduces of the same rotation.
//!
//! Ranks are threads of one process: one GPU each, or two sharing GPU 0 (NCCL 2.30+), where
//! host copies go through page-locked memory (`Staging`; why in
//! `two_ranks_on_one_gpu_read_back_through_page_locked_memory`). Run on
//! a GPU host with `cargo test --test gpu_lsa_all_reduce -- --include-ignored
//! --test-threads=1` (or `.gpu/run tests`), with NCCL 2.32.3 and the system's 2.28.3.
//! One file past 600 lines: the tests share the shape set-up, the page-locked staging and
//! the per-rank harness, and each test file is one GPU binary to carry.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::shape::skip;
use common::threaded::{per_rank, Deadline, Staging};
use common::Rng;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream};
use nccl::device::{LsaAlgorithm, LsaAllReduce, LsaElem, DEV_COMM_SINCE};
use nccl::{Comm, Error};

const LIMIT: Duration = Duration::from_secs(240);
/// How long the tests' kernels wait for their peers: a failure shows in seconds.
const TIMEOUT: Duration = Duration::from_secs(20);
/// The scratch's capacity in the tests: past 16 CTAs of 512 threads of one vector each, so
/// the threads loop over vectors (400 KiB of f32).
const MAX: usize = 100_003;

/// A test element: conversions from the small integers the data holds.
trait TestElem: LsaElem + Default + std::fmt::Debug {
    fn from_i64(v: i64) -> Self;
    fn to_f64(self) -> f64;
    fn negative_zero() -> Self;
}
impl TestElem for f32 {
    fn from_i64(v: i64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn negative_zero() -> Self {
        -0.0
    }
}
impl TestElem for half::bf16 {
    fn from_i64(v: i64) -> Self {
        half::bf16::from_f64(v as f64)
    }
    fn to_f64(self) -> f64 {
        half::bf16::to_f64(self)
    }
    fn negative_zero() -> Self {
        half::bf16::NEG_ZERO
    }
}
impl TestElem for half::f16 {
    fn from_i64(v: i64) -> Self {
        half::f16::from_f64(v as f64)
    }
    fn to_f64(self) -> f64 {
        half::f16::to_f64(self)
    }
    fn negative_zero() -> Self {
        half::f16::NEG_ZERO
    }
}

/// Rank `rank`'s input: integers in [-16, 16] (every sum of up to 8 ranks is exact in bf16),
/// one in eight a negative zero.
fn input<T: TestElem>(rank: usize, len: usize, seed: u64) -> Vec<T> {
    let mut rng = Rng::new(seed ^ ((rank as u64 + 1) * 0x9e37_79b9));
    (0..len)
        .map(|_| match rng.range(0, 7) {
            0 => T::negative_zero(),
            _ => T::from_i64(rng.range(-16, 16)),
        })
        .collect()
}

/// Asserts that `result` says the instance is out of step (every refusal puts it there).
fn out_of_step(result: nccl::Result<()>) {
    match result {
        Err(Error::InvalidUsage(msg)) => assert!(msg.contains("out of step"), "{msg}"),
        other => panic!("expected the instance out of step: {other:?}"),
    }
}

fn skip_before_device_api(test: &str) -> bool {
    let lib = nccl::library::get().expect("NCCL loads");
    if lib.version() < DEV_COMM_SINCE {
        skip(
            test,
            &format!(
                "the shipped kernels need NCCL {DEV_COMM_SINCE}+, loaded {} (see \
                 refused_before_2_29_2)",
                lib.version()
            ),
        );
        return true;
    }
    false
}

/// A test's threaded layout where the shipped kernels can run (else `None`, said through
/// `skip`).
fn device_api_layout(test: &str) -> Option<common::shape::Layout> {
    if skip_before_device_api(test) {
        return None;
    }
    common::shape::setup();
    common::shape::threaded(test)
}

/// The communicators of a threaded layout (one GPU per rank, or two ranks on GPU 0).
fn comms(test: &str) -> Option<Vec<Comm>> {
    common::shape::setup();
    let layout = common::shape::threaded(test)?;
    Some(Comm::init_all(&layout.streams()).expect("ncclCommInitAll"))
}

/// A test's ranks where the shipped kernels can run (else `None`, said through `skip`), and
/// the deadline that bounds it.
fn start(test: &'static str) -> Option<(Vec<Comm>, Deadline)> {
    if skip_before_device_api(test) {
        return None;
    }
    let comms = comms(test)?;
    Some((comms, Deadline::new(test, LIMIT)))
}

/// One all-reduce of `count` elements starting `shift` elements into the buffers, checked
/// against the host's sum of every rank's input; returns the algorithm run.
#[allow(clippy::too_many_arguments)]
fn check_one<T: TestElem>(
    ar: &mut LsaAllReduce<'_, T>,
    stream: &Arc<CudaStream>,
    staging: &mut Staging<T>,
    send: &mut CudaSlice<T>,
    recv: &mut CudaSlice<T>,
    count: usize,
    shift: usize,
    in_place: bool,
    algorithm: LsaAlgorithm,
    seed: u64,
) -> LsaAlgorithm {
    let (rank, size) = (ar.comm().rank(), ar.comm().size());
    let inputs: Vec<Vec<T>> = (0..size).map(|r| input::<T>(r, count, seed)).collect();
    let mine = &inputs[rank];
    let want: Vec<f64> = (0..count)
        .map(|i| inputs.iter().map(|x| x[i].to_f64()).sum())
        .collect();
    let target = if in_place { &mut *recv } else { &mut *send };
    staging.upload(mine, &mut target.slice_mut(shift..shift + count));
    if !in_place {
        stream.memset_zeros(recv).expect("zero the output");
    }
    let ran = if in_place {
        ar.all_reduce_in_place(&mut recv.slice_mut(shift..shift + count), algorithm)
    } else {
        ar.all_reduce(
            &send.slice(shift..shift + count),
            &mut recv.slice_mut(shift..shift + count),
            algorithm,
        )
    }
    .unwrap_or_else(|e| panic!("rank {rank}: {count} elements {algorithm:?}: {e}"));
    let got = staging.download(&recv.slice(shift..shift + count));
    ar.check().unwrap_or_else(|e| {
        panic!(
            "rank {rank}: {count} {} elements (shift {shift}, in place {in_place}, {algorithm:?} \
             ran {ran:?}): a kernel gave up: {e}",
            std::any::type_name::<T>()
        )
    });
    let wrong: Vec<usize> = (0..count).filter(|&i| got[i].to_f64() != want[i]).collect();
    assert!(
        wrong.is_empty(),
        "rank {rank}: {count} elements (shift {shift}, in place {in_place}, {algorithm:?} ran \
         {ran:?}): {} wrong, first at {}: {:?} want {}",
        wrong.len(),
        wrong[0],
        got[wrong[0]],
        want[wrong[0]]
    );
    ran
}

fn exact_for<T: TestElem>(comm: Comm) {
    let stream = comm.stream().clone();
    // Buffers first: with two ranks on one GPU an allocation can wait for the GPU while the
    // other rank's kernel spins there.
    let mut send = stream.alloc_zeros::<T>(MAX + 8).expect("send");
    let mut recv = stream.alloc_zeros::<T>(MAX + 8).expect("recv");
    let mut big = stream.alloc_zeros::<T>(MAX + 1).expect("big");
    let mut staging = Staging::new(&stream, MAX + 8);
    let mut ar = LsaAllReduce::<T>::new(&comm, MAX).expect("LsaAllReduce::new");
    // A failure shows within seconds, not the default's minutes.
    ar.set_timeout(TIMEOUT);
    let mut seed = 1;
    for algorithm in [
        LsaAlgorithm::OneShotFlags,
        LsaAlgorithm::TwoShotFlags,
        LsaAlgorithm::OneShotBarrier,
        LsaAlgorithm::Auto,
    ] {
        for count in [1, 2, 3, 7, 8, 9, 64, 1000, 2048, 4096, 40_000, MAX] {
            for (shift, in_place) in [(0, false), (1, false), (0, true), (3, true)] {
                seed += 1;
                let ran = check_one(
                    &mut ar,
                    &stream,
                    &mut staging,
                    &mut send,
                    &mut recv,
                    count,
                    shift,
                    in_place,
                    algorithm,
                    seed,
                );
                assert_ne!(ran, LsaAlgorithm::Auto);
            }
        }
    }
    // Sizes and schemes mixed call after call: each flags call (one- or two-shot) clears
    // the buffer its predecessor used, of that predecessor's size and layout.
    for (i, count) in [MAX, 5, 4096, 1, 333, MAX, 2, 2, 40_000]
        .into_iter()
        .enumerate()
    {
        let algorithm = match i % 4 {
            1 => LsaAlgorithm::TwoShotFlags,
            2 => LsaAlgorithm::OneShotBarrier,
            _ => LsaAlgorithm::OneShotFlags,
        };
        seed += 1;
        check_one(
            &mut ar,
            &stream,
            &mut staging,
            &mut send,
            &mut recv,
            count,
            0,
            false,
            algorithm,
            seed,
        );
    }
    // Past the scratch: Auto goes to NCCL, a forced kernel is refused (on every rank alike,
    // but no rank can know that: the instance is out of step afterwards).
    assert_eq!(
        ar.all_reduce_in_place(&mut big, LsaAlgorithm::Auto)
            .expect("auto past max"),
        LsaAlgorithm::Nccl
    );
    match ar.all_reduce_in_place(&mut big, LsaAlgorithm::OneShotFlags) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("max_count"), "{msg}"),
        other => panic!("a forced kernel past max_count: {other:?}"),
    }
    match ar.all_reduce(
        &send.slice(0..4),
        &mut recv.slice_mut(0..5),
        LsaAlgorithm::Auto,
    ) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("holds 5"), "{msg}"),
        other => panic!("lengths that differ: {other:?}"),
    }
    out_of_step(ar.check());
    stream.synchronize().expect("sync");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn sums_are_exact_for_every_scheme_type_and_size() {
    const TEST: &str = "sums_are_exact_for_every_scheme_type_and_size";
    if skip_before_device_api(TEST) {
        return;
    }
    let _deadline = Deadline::new(TEST, LIMIT);
    // Each type on communicators of its own (per_rank takes them).
    for name in ["f32", "bf16", "f16"] {
        let Some(comms) = comms(TEST) else {
            return;
        };
        per_rank(comms, |comm, _| match name {
            "f32" => exact_for::<f32>(comm),
            "bf16" => exact_for::<half::bf16>(comm),
            _ => exact_for::<half::f16>(comm),
        });
    }
}

/// One rank alone (a one-rank communicator on GPU 0): every scheme, size and type gives the
/// rank's own input back exactly, as the sum over one rank.
#[test]
#[ignore = "needs CUDA GPUs"]
fn one_rank_alone_gets_its_own_input_back() {
    const TEST: &str = "one_rank_alone_gets_its_own_input_back";
    if skip_before_device_api(TEST) {
        return;
    }
    // The harness's settings before this process's first use of CUDA.
    common::shape::setup();
    if nccl::library::cuda_device_count().unwrap_or(0) == 0 {
        skip(TEST, "no CUDA GPU");
        return;
    }
    let _deadline = Deadline::new(TEST, LIMIT);
    common::shape::ran(TEST, "1 rank on GPU 0");
    for name in ["f32", "bf16", "f16"] {
        let stream = cudarc::driver::CudaContext::new(0)
            .and_then(|ctx| ctx.new_stream())
            .expect("GPU 0");
        let comm = Comm::init_all(&[stream])
            .expect("a one-rank communicator")
            .pop()
            .expect("one");
        match name {
            "f32" => exact_for::<f32>(comm),
            "bf16" => exact_for::<half::bf16>(comm),
            _ => exact_for::<half::f16>(comm),
        }
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn graph_replays_advance_the_device_counters() {
    const TEST: &str = "graph_replays_advance_the_device_counters";
    let Some((comms, _deadline)) = start(TEST) else {
        return;
    };
    per_rank(comms, |comm, barrier| {
        let stream = comm.stream().clone();
        // Capture needs no cross-stream events: this test's work is all on this stream.
        // SAFETY: every buffer below is used on `stream` only.
        unsafe { stream.context().disable_event_tracking() };
        let (rank, size) = (comm.rank(), comm.size());
        let count = 1000;
        let mut send = stream.alloc_zeros::<f32>(count).expect("send");
        let mut recv = stream.alloc_zeros::<f32>(count).expect("recv");
        let mut staging = Staging::new(&stream, count);
        let mut ar = LsaAllReduce::<f32>::new(&comm, 1024).expect("new");
        ar.set_timeout(TIMEOUT);
        for algorithm in [
            LsaAlgorithm::OneShotFlags,
            LsaAlgorithm::TwoShotFlags,
            LsaAlgorithm::OneShotBarrier,
        ] {
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .expect("begin capture");
            let issued = ar.all_reduce(&send, &mut recv, algorithm);
            let graph = stream
                .end_capture(CUgraphInstantiate_flags(0))
                .expect("end capture")
                .expect("a graph");
            issued.expect("captured all-reduce");
            // Both ranks' graphs instantiated before either replays: with two ranks on one
            // GPU, instantiation can wait for the GPU while the other rank's kernel spins.
            barrier.wait();
            // Five replays, each on new data: the rotation advances on the device.
            for replay in 0..5u64 {
                let seed = 100 + replay;
                staging.upload(&input::<f32>(rank, count, seed), &mut send);
                graph.launch().expect("replay");
                let got = staging.download(&recv);
                for (i, g) in got.iter().enumerate() {
                    let want: f64 = (0..size)
                        .map(|r| input::<f32>(r, count, seed)[i] as f64)
                        .sum();
                    assert_eq!(
                        *g as f64, want,
                        "rank {rank} {algorithm:?} replay {replay} at {i}"
                    );
                }
            }
            barrier.wait();
            drop(graph);
            barrier.wait();
        }
        ar.check().expect("in step");
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn creation_is_agreed_on_every_rank() {
    const TEST: &str = "creation_is_agreed_on_every_rank";
    let Some((comms, _deadline)) = start(TEST) else {
        return;
    };
    per_rank(comms, |comm, barrier| {
        let rank = comm.rank();
        // Between attempts every rank waits for the others: with two ranks of one process on
        // one GPU, a rank freeing the scratch of a refused attempt can wait for the GPU while
        // the other rank's next agreement already spins there (seen on a one-GPU host).
        // Rank 1 asks for nothing: it refuses alone, the others hear so.
        let max = if rank == 1 { 0 } else { 64 };
        match LsaAllReduce::<f32>::new(&comm, max) {
            Err(Error::InvalidArgument(msg)) if rank == 1 => assert!(msg.contains("max_count")),
            Err(Error::RankRefused { rank: 1, .. }) if rank != 1 => {}
            other => panic!("rank {rank}: one rank refusing: {other:?}"),
        }
        barrier.wait();
        // Sizes that differ: a mismatch everywhere.
        match LsaAllReduce::<f32>::new(&comm, 64 + rank) {
            Err(Error::RankMismatch {
                field: "max_count",
                rank: 1,
                ..
            }) => {}
            other => panic!("rank {rank}: differing max_count: {other:?}"),
        }
        barrier.wait();
        // Element types that differ: f32 on rank 0, bf16 elsewhere.
        let mixed = if rank == 0 {
            LsaAllReduce::<f32>::new(&comm, 64).map(drop)
        } else {
            LsaAllReduce::<half::bf16>::new(&comm, 64).map(drop)
        };
        match mixed {
            Err(Error::RankMismatch {
                field: "element size",
                ..
            }) => {}
            other => panic!("rank {rank}: differing element types: {other:?}"),
        }
        barrier.wait();
        // And then one that works (read back through page-locked memory: a rank still in
        // `new`'s last agreement while its peer already waits for its kernel in a pageable
        // read-back would be held up there, see
        // two_ranks_on_one_gpu_read_back_through_page_locked_memory).
        let stream = comm.stream().clone();
        let mut buf = stream.alloc_zeros::<f32>(64).expect("buf");
        let mut staging = Staging::new(&stream, 64);
        staging.upload(&[rank as f32 + 1.0; 64], &mut buf);
        let mut ar = LsaAllReduce::<f32>::new(&comm, 64).expect("agreed");
        ar.all_reduce_in_place(&mut buf, LsaAlgorithm::OneShotFlags)
            .expect("sum");
        let got = staging.download(&buf);
        let n = comm.size() as f32;
        assert!(
            got.iter().all(|&g| g == n * (n + 1.0) / 2.0),
            "rank {rank}: {got:?}"
        );
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn a_rank_that_skips_a_call_makes_its_peers_give_up() {
    const TEST: &str = "a_rank_that_skips_a_call_makes_its_peers_give_up";
    let Some((comms, _deadline)) = start(TEST) else {
        return;
    };
    per_rank(comms, |comm, barrier| {
        let (rank, size) = (comm.rank(), comm.size() as f32);
        let stream = comm.stream().clone();
        let mut buf = stream.alloc_zeros::<f32>(256).expect("buf");
        for algorithm in [LsaAlgorithm::OneShotFlags, LsaAlgorithm::OneShotBarrier] {
            let mut ar = LsaAllReduce::<f32>::new(&comm, 256).expect("new");
            ar.set_timeout(Duration::from_millis(300));
            let timed_out = |r: nccl::Result<()>, what: &str| match r {
                Err(Error::Timeout { .. }) => {}
                other => panic!("rank {rank} {algorithm:?} {what}: expected a timeout: {other:?}"),
            };
            stream.memcpy_htod(&[1.0f32; 256], &mut buf).expect("ones");
            ar.all_reduce_in_place(&mut buf, algorithm).expect("first");
            ar.check().expect("the first call completes");
            barrier.wait();
            if rank != 0 {
                // Everyone but rank 0 makes a second call; rank 0 makes it only later.
                ar.all_reduce_in_place(&mut buf, algorithm).expect("second");
                timed_out(ar.check(), "second call");
                // Refused at once from now on, without waiting for the GPU.
                timed_out(ar.status(), "status");
                let third = ar.all_reduce_in_place(&mut buf, algorithm).map(drop);
                timed_out(third, "third call");
            }
            barrier.wait();
            if rank == 0 {
                // Rank 0's late second call finds what its peers sent before they gave up
                // (flags: data pushed into its buffer; barrier: their arrival and their
                // slots), a correct sum: their buffers held their first call's sum, `size`.
                // Its third call finds no peer and gives up.
                stream.memcpy_htod(&[1.0f32; 256], &mut buf).expect("ones");
                ar.all_reduce_in_place(&mut buf, algorithm)
                    .expect("late second");
                ar.check().expect("the late call has every rank's data");
                let got = stream.clone_dtoh(&buf).expect("read");
                let want = 1.0 + (size - 1.0) * size;
                assert!(
                    got.iter().all(|&g| g == want),
                    "rank 0 late: {:?}",
                    &got[..4]
                );
                let third = ar.all_reduce_in_place(&mut buf, algorithm).map(drop);
                timed_out(third.and_then(|()| ar.check()), "third call");
                timed_out(ar.status(), "status");
            }
            barrier.wait();
            // Dropping the out-of-step instances on every rank frees everything.
            drop(ar);
            barrier.wait();
        }
        // A call refused on one rank alone (a group open there) puts that rank out of step:
        // its peers give up, and its own later calls are refused.
        let mut ar = LsaAllReduce::<f32>::new(&comm, 256).expect("new");
        ar.set_timeout(Duration::from_millis(300));
        if rank == 1 {
            let group = nccl::Group::start().expect("group");
            let refused = ar.all_reduce_in_place(&mut buf, LsaAlgorithm::OneShotFlags);
            drop(group);
            assert!(
                matches!(refused, Err(Error::InvalidUsage(_))),
                "in a group: {refused:?}"
            );
            match ar.all_reduce_in_place(&mut buf, LsaAlgorithm::OneShotFlags) {
                Err(Error::InvalidUsage(msg)) => assert!(msg.contains("out of step"), "{msg}"),
                other => panic!("after a refusal: {other:?}"),
            }
        } else {
            ar.all_reduce_in_place(&mut buf, LsaAlgorithm::OneShotFlags)
                .expect("enqueued");
            match ar.check() {
                Err(Error::Timeout { .. }) => {}
                other => panic!("rank {rank}: its peer never came: {other:?}"),
            }
        }
        barrier.wait();
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn refused_before_2_29_2() {
    const TEST: &str = "refused_before_2_29_2";
    let lib = nccl::library::get().expect("NCCL loads");
    if lib.version() >= DEV_COMM_SINCE {
        skip(
            TEST,
            &format!(
                "needs an NCCL older than {DEV_COMM_SINCE}, loaded {}",
                lib.version()
            ),
        );
        return;
    }
    let Some(comms) = comms(TEST) else {
        return;
    };
    let _deadline = Deadline::new(TEST, LIMIT);
    per_rank(comms, |comm, _| {
        let rank = comm.rank();
        match LsaAllReduce::<f32>::new(&comm, 64) {
            Err(Error::Unsupported { needs, .. }) => assert_eq!(needs, DEV_COMM_SINCE),
            // Every rank refuses on its own here; a rank may hear of a lower one's first.
            Err(Error::RankRefused {
                reason: nccl::Refusal::Unsupported,
                ..
            }) => {}
            other => panic!("rank {rank}: {other:?}"),
        }
    });
}

/// The host's epilogue of rank-order sums, rounding where the kernels do: the residual
/// exactly, the normalised output as `f32` (the device's block sum may differ in order).
fn epilogue_reference(
    xs: &[Vec<half::bf16>],
    residual: &[half::bf16],
    weight: &[half::bf16],
    hidden: usize,
) -> (Vec<half::bf16>, Vec<f32>) {
    let round = |v: f32| half::bf16::from_f32(v).to_f32();
    let h: Vec<f32> = (0..residual.len())
        .map(|i| {
            let sum: f32 = xs.iter().map(|x| x[i].to_f32()).sum();
            round(round(sum) + residual[i].to_f32())
        })
        .collect();
    let mut out = vec![0f32; h.len()];
    for (row, chunk) in h.chunks(hidden).enumerate() {
        let mean = chunk.iter().map(|v| v * v).sum::<f32>() / hidden as f32;
        let inv = 1.0 / (mean + 1e-5).sqrt();
        for (j, v) in chunk.iter().enumerate() {
            out[row * hidden + j] = v * inv * weight[j].to_f32();
        }
    }
    (h.iter().map(|&v| half::bf16::from_f32(v)).collect(), out)
}

/// A fused call whose row is split over CTAs as an instance's first call, with the row
/// exactly the instance's capacity and well inside it: nccl-candle's fused test (capacity
/// 8192, first call 1 × 8192) hung on one H200 with two ranks sharing it in one process.
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_split_row_fused_call_first_and_at_capacity() {
    const TEST: &str = "a_split_row_fused_call_first_and_at_capacity";
    let Some((comms, _deadline)) = start(TEST) else {
        return;
    };
    per_rank(comms, |comm, _| {
        use nccl::device::LsaEpilogue;
        let stream = comm.stream().clone();
        let (rank, size) = (comm.rank(), comm.size());
        let (rows, hidden) = (1usize, 8192usize);
        let len = rows * hidden;
        let mut staging = Staging::new(&stream, len);
        let small = |seed: u64, rank: usize, len: usize| -> Vec<half::bf16> {
            let mut rng = Rng::new(seed ^ ((rank as u64 + 7) << 20));
            (0..len)
                .map(|_| half::bf16::from_f32(rng.range(-64, 64) as f32 / 16.0))
                .collect()
        };
        let xs: Vec<Vec<half::bf16>> = (0..size).map(|r| small(5, r, len)).collect();
        let res0 = small(6, 99, len);
        let w = small(7, 98, hidden);
        let (want_res, want_out) = epilogue_reference(&xs, &res0, &w, hidden);
        let mut verdicts = Vec::new();
        for capacity in [len, 16 * len] {
            let mut x = stream.alloc_zeros::<half::bf16>(len).expect("x");
            let mut residual = stream.alloc_zeros::<half::bf16>(len).expect("residual");
            let mut out = stream.alloc_zeros::<half::bf16>(len).expect("out");
            let mut weight = stream.alloc_zeros::<half::bf16>(hidden).expect("weight");
            staging.upload(&xs[rank], &mut x);
            staging.upload(&res0, &mut residual);
            staging.upload(&w, &mut weight);
            let mut ar = LsaAllReduce::<half::bf16>::new(&comm, capacity).expect("new");
            ar.set_timeout(Duration::from_secs(5));
            let called = ar.all_reduce_add_rms_norm(
                &mut x,
                &mut residual,
                &weight,
                1e-5,
                &mut out,
                LsaEpilogue::Fused,
            );
            let got_res = staging.download(&residual);
            let got_out = staging.download(&out);
            let checked = ar.check();
            let res_wrong = (0..len).filter(|&j| got_res[j] != want_res[j]).count();
            let out_wrong = (0..len)
                .filter(|&j| {
                    let (g, w) = (got_out[j].to_f32(), want_out[j]);
                    // NaN counts as wrong.
                    (g - w).abs().is_nan() || (g - w).abs() > 0.01 * w.abs() + 1e-3
                })
                .count();
            let verdict = format!(
                "capacity {capacity}: call {:?}, check {:?}, {res_wrong} residuals and {out_wrong} outputs wrong",
                called.map(|_| ()),
                checked.map(|_| ())
            );
            eprintln!("NOTE {TEST}: rank {rank}: {verdict}");
            verdicts.push((res_wrong == 0 && out_wrong == 0, verdict));
        }
        for (ok, verdict) in verdicts {
            assert!(ok, "rank {rank}: {verdict}");
        }
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn fused_epilogue_matches_the_separate_one_and_the_host() {
    const TEST: &str = "fused_epilogue_matches_the_separate_one_and_the_host";
    let Some((comms, _deadline)) = start(TEST) else {
        return;
    };
    // Rows split over CTAs (3 × 4096: four a row; 1 × 8192: eight; 2 × 16384), one CTA a row
    // (17 × 1024, 40 × 4096), and rows too many and too long to fuse (9 × 16384: the
    // all-reduce into `out`, then the norm).
    // Ragged splits too: rows whose length is no multiple of the split (2 × 8200: seven
    // parts of 160 vectors, the last of 65; 1 × 1288: a partial last chunk) and five splits a
    // row (3 × 16384).
    const SHAPES: [(usize, usize); 10] = [
        (1, 8),
        (3, 4096),
        (1, 8192),
        (17, 1024),
        (2, 16384),
        (40, 4096),
        (9, 16384),
        (2, 8200),
        (3, 16384),
        (1, 1288),
    ];
    per_rank(comms, |comm, _| {
        use nccl::device::LsaEpilogue;
        let stream = comm.stream().clone();
        let (rank, size) = (comm.rank(), comm.size());
        let most = SHAPES.iter().map(|(r, h)| r * h).max().unwrap();
        let mut x = stream.alloc_zeros::<half::bf16>(most).expect("x");
        let mut residual = stream.alloc_zeros::<half::bf16>(most).expect("residual");
        let mut out = stream.alloc_zeros::<half::bf16>(most).expect("out");
        let mut residual_out = stream
            .alloc_zeros::<half::bf16>(most)
            .expect("residual out");
        let mut weight = stream.alloc_zeros::<half::bf16>(16384).expect("weight");
        let mut staging = Staging::new(&stream, most);
        let mut ar = LsaAllReduce::<half::bf16>::new(&comm, most).expect("new");
        ar.set_timeout(TIMEOUT);
        let small = |seed: u64, rank: usize, len: usize| -> Vec<half::bf16> {
            let mut rng = Rng::new(seed ^ ((rank as u64 + 7) << 20));
            (0..len)
                .map(|_| half::bf16::from_f32(rng.range(-64, 64) as f32 / 16.0))
                .collect()
        };
        for (i, &(rows, hidden)) in SHAPES.iter().enumerate() {
            let len = rows * hidden;
            let seed = 1000 + i as u64;
            let xs: Vec<Vec<half::bf16>> = (0..size).map(|r| small(seed, r, len)).collect();
            let res0 = small(seed + 1, 99, len);
            let w = small(seed + 2, 98, hidden);
            let (want_res, want_out) = epilogue_reference(&xs, &res0, &w, hidden);
            let mut results = Vec::new();
            for how in [
                LsaEpilogue::Fused,
                LsaEpilogue::Separate(LsaAlgorithm::OneShotFlags),
                LsaEpilogue::Separate(LsaAlgorithm::Nccl),
            ] {
                staging.upload(&xs[rank], &mut x.slice_mut(0..len));
                staging.upload(&res0, &mut residual.slice_mut(0..len));
                staging.upload(&w, &mut weight.slice_mut(0..hidden));
                let wv = weight.slice(0..hidden);
                ar.all_reduce_add_rms_norm(
                    &mut x.slice_mut(0..len),
                    &mut residual.slice_mut(0..len),
                    &wv,
                    1e-5,
                    &mut out.slice_mut(0..len),
                    how,
                )
                .unwrap_or_else(|e| panic!("rank {rank} {rows}x{hidden} {how:?}: {e}"));
                let got_res = staging.download(&residual.slice(0..len));
                let got_out = staging.download(&out.slice(0..len));
                ar.check().expect("in step");
                // NCCL sums bf16 in its own order: exact against the rank-order f32 sum for
                // these small multiples of 1/16 up to 4 ranks, not always past that.
                let exact = size <= 4 || !matches!(how, LsaEpilogue::Separate(LsaAlgorithm::Nccl));
                let res_wrong = (0..len)
                    .filter(|&j| {
                        let (g, w) = (got_res[j].to_f32(), want_res[j].to_f32());
                        if exact {
                            g != w
                        } else {
                            (g - w).abs() > 0.01 * w.abs() + 1e-2
                        }
                    })
                    .count();
                assert_eq!(
                    res_wrong, 0,
                    "rank {rank} {rows}x{hidden} {how:?}: residual"
                );
                let out_wrong = (0..len)
                    .filter(|&j| {
                        let (g, w) = (got_out[j].to_f32(), want_out[j]);
                        (g - w).abs() > 0.01 * w.abs() + 1e-3
                    })
                    .count();
                assert_eq!(out_wrong, 0, "rank {rank} {rows}x{hidden} {how:?}: output");
                results.push(got_out);
            }
            assert_eq!(
                results[0], results[1],
                "rank {rank} {rows}x{hidden}: fused vs separate"
            );
            // The new residual into a buffer of its own: the old one stays as it was (and x
            // too, fused; separate, the all-reduce runs in place on it).
            for how in [
                LsaEpilogue::Fused,
                LsaEpilogue::Separate(LsaAlgorithm::OneShotFlags),
            ] {
                staging.upload(&xs[rank], &mut x.slice_mut(0..len));
                staging.upload(&res0, &mut residual.slice_mut(0..len));
                staging.upload(&res0, &mut residual_out.slice_mut(0..len));
                ar.all_reduce_add_rms_norm_to(
                    &mut x.slice_mut(0..len),
                    &residual.slice(0..len),
                    &weight.slice(0..hidden),
                    1e-5,
                    &mut residual_out.slice_mut(0..len),
                    &mut out.slice_mut(0..len),
                    how,
                )
                .unwrap_or_else(|e| panic!("rank {rank} {rows}x{hidden} to, {how:?}: {e}"));
                let what = |part: &str| format!("rank {rank} {rows}x{hidden} to, {how:?}: {part}");
                let got = staging.download(&residual_out.slice(0..len));
                assert_eq!(got, want_res, "{}", what("residual out"));
                let got = staging.download(&residual.slice(0..len));
                assert_eq!(got, res0, "{}", what("residual kept"));
                if how == LsaEpilogue::Fused {
                    let got = staging.download(&x.slice(0..len));
                    assert_eq!(got, xs[rank], "{}", what("x kept"));
                }
                let got = staging.download(&out.slice(0..len));
                assert_eq!(got, results[0], "{}", what("out"));
            }
            ar.check().expect("in step");
        }
        // No rows: nothing runs, on every rank alike.
        ar.all_reduce_add_rms_norm(
            &mut x.slice_mut(0..0),
            &mut residual.slice_mut(0..0),
            &weight.slice(0..64),
            1e-5,
            &mut out.slice_mut(0..0),
            LsaEpilogue::Fused,
        )
        .expect("no rows");
        // Unaligned buffers take the element-wise path: the same results.
        let (rows, hidden, len) = (3, 64, 192);
        let xs: Vec<Vec<half::bf16>> = (0..size).map(|r| small(77, r, len)).collect();
        let res0 = small(78, 99, len);
        let w = small(79, 98, hidden);
        let (want_res, _) = epilogue_reference(&xs, &res0, &w, hidden);
        staging.upload(&xs[rank], &mut x.slice_mut(1..1 + len));
        staging.upload(&res0, &mut residual.slice_mut(3..3 + len));
        staging.upload(&w, &mut weight.slice_mut(5..5 + hidden));
        ar.all_reduce_add_rms_norm(
            &mut x.slice_mut(1..1 + len),
            &mut residual.slice_mut(3..3 + len),
            &weight.slice(5..5 + hidden),
            1e-5,
            &mut out.slice_mut(7..7 + len),
            LsaEpilogue::Fused,
        )
        .expect("unaligned");
        let got = staging.download(&residual.slice(3..3 + len));
        ar.check().expect("in step");
        assert_eq!(got, want_res, "rank {rank}: unaligned {rows}x{hidden}");
        // A refusal (alike on every rank, which no rank can know) puts the instance out of
        // step.
        let refused = ar.all_reduce_add_rms_norm(
            &mut x.slice_mut(0..24),
            &mut residual.slice_mut(0..24),
            &weight.slice(0..12),
            1e-5,
            &mut out.slice_mut(0..24),
            LsaEpilogue::Fused,
        );
        assert!(
            matches!(refused, Err(Error::InvalidArgument(_))),
            "hidden 12: {refused:?}"
        );
        out_of_step(ar.check());
    });
}

/// Two ranks of one process sharing a GPU (one CUDA context): rank 1 drops its instance and
/// enqueues an NCCL all-reduce, which waits for rank 0; rank 0 drops its instance only then
/// (its peer's kernel already waiting for it) and joins. Freeing page-locked memory waits for
/// the whole context, so a drop that freed the instance's give-up word would wait for the
/// peer's all-reduce, which waits for this rank: the words are pooled instead. Rank 0's drop
/// returns within a second and both sums arrive.
#[test]
#[ignore = "needs CUDA GPUs"]
fn dropping_an_instance_while_the_peer_waits_in_the_next_collective() {
    const TEST: &str = "dropping_an_instance_while_the_peer_waits_in_the_next_collective";
    let Some(layout) = device_api_layout(TEST) else {
        return;
    };
    if layout.shape != common::shape::Shape::Shared {
        skip(TEST, "only ranks sharing one GPU share one CUDA context");
        return;
    }
    let comms = Comm::init_all(&layout.streams()).expect("ncclCommInitAll");
    let _deadline = Deadline::new(TEST, LIMIT);
    per_rank(comms, |comm, barrier| {
        let rank = comm.rank();
        let size = comm.size() as f32;
        let stream = comm.stream().clone();
        let mut buf = stream.alloc_zeros::<f32>(64).expect("buf");
        let mut staging = Staging::new(&stream, 64);
        let mut ar = LsaAllReduce::<f32>::new(&comm, 64).expect("new");
        staging.upload(&[rank as f32 + 1.0; 64], &mut buf);
        ar.all_reduce_in_place(&mut buf, LsaAlgorithm::OneShotFlags)
            .expect("launch");
        let got = staging.download(&buf);
        let first = size * (size + 1.0) / 2.0;
        assert!(
            got.iter().all(|&g| g == first),
            "rank {rank}: {:?}",
            &got[..4]
        );
        ar.check().expect("the shipped call completes");
        barrier.wait();
        if rank != 0 {
            drop(ar);
            let input = buf.clone();
            comm.all_reduce(&input, &mut buf, nccl::ReduceOp::Sum)
                .expect("enqueue");
            // Rank 0 drops its instance once this rank's all-reduce is enqueued.
            barrier.wait();
        } else {
            barrier.wait();
            std::thread::sleep(Duration::from_millis(200));
            let t = std::time::Instant::now();
            drop(ar);
            let dropped = t.elapsed();
            println!(
                "NOTE {TEST}: rank 0 dropped its instance in {dropped:?} while its peer waited in \
                 an NCCL all-reduce"
            );
            assert!(
                dropped < Duration::from_secs(1),
                "the drop took {dropped:?}"
            );
            let input = buf.clone();
            comm.all_reduce(&input, &mut buf, nccl::ReduceOp::Sum)
                .expect("enqueue");
        }
        let got = staging.download(&buf);
        let want = first * size;
        assert!(
            got.iter().all(|&g| g == want),
            "rank {rank}: {:?}",
            &got[..4]
        );
    });
}

/// Two ranks of one process on one GPU (one CUDA context). Rank 1 launches first and its
/// thread waits for the result while rank 0, later, copies, waits for an event on its own
/// stream (as `check` does) and launches its half:
/// * rank 1 waiting in a page-locked read-back (a stream synchronisation): rank 0's copies
///   and event wait take microseconds and both ranks get the sum (asserted);
/// * rank 1 waiting in a pageable read-back: rank 0's pageable copies still take
///   microseconds, but its event wait lasts until rank 1's kernel gives up (reported, not
///   asserted: the CUDA driver's behaviour, seen on driver 580). That is how the tests here
///   timed out before they read back through [`Staging`].
#[test]
#[ignore = "needs CUDA GPUs"]
fn two_ranks_on_one_gpu_read_back_through_page_locked_memory() {
    const TEST: &str = "two_ranks_on_one_gpu_read_back_through_page_locked_memory";
    let Some(layout) = device_api_layout(TEST) else {
        return;
    };
    if layout.shape != common::shape::Shape::Shared {
        skip(TEST, "only ranks sharing one GPU share one CUDA context");
        return;
    }
    let comms = Comm::init_all(&layout.streams()).expect("ncclCommInitAll");
    let _deadline = Deadline::new(TEST, LIMIT);
    const WAIT: Duration = Duration::from_secs(2);
    const PAUSE: Duration = Duration::from_millis(300);
    per_rank(comms, |comm, barrier| {
        let rank = comm.rank();
        let stream = comm.stream().clone();
        let mut buf = stream.alloc_zeros::<f32>(64).expect("buf");
        let mut staging = Staging::new(&stream, 64);
        for page_locked in [true, false] {
            let mut ar = LsaAllReduce::<f32>::new(&comm, 64).expect("new");
            ar.set_timeout(WAIT);
            staging.upload(&[rank as f32 + 1.0; 64], &mut buf);
            stream.synchronize().expect("sync");
            barrier.wait();
            if rank == 1 {
                ar.all_reduce_in_place(&mut buf, LsaAlgorithm::OneShotFlags)
                    .expect("launch");
                let got = if page_locked {
                    staging.download(&buf)
                } else {
                    stream.clone_dtoh(&buf).expect("read")
                };
                if page_locked {
                    ar.check().expect("rank 1's call completes");
                    assert!(got.iter().all(|&g| g == 3.0), "rank 1: {:?}", &got[..4]);
                }
            } else {
                std::thread::sleep(PAUSE);
                let t = std::time::Instant::now();
                if page_locked {
                    staging.upload(&[1.0f32; 64], &mut buf);
                    let _ = staging.download(&buf);
                } else {
                    stream.memcpy_htod(&[1.0f32; 64], &mut buf).expect("copy");
                    let _ = stream.clone_dtoh(&buf).expect("read");
                }
                let copies = t.elapsed();
                let t = std::time::Instant::now();
                stream
                    .record_event(None)
                    .and_then(|e| e.synchronize())
                    .expect("event");
                let event = t.elapsed();
                let how = if page_locked {
                    "page-locked"
                } else {
                    "pageable"
                };
                println!(
                    "NOTE {TEST}: rank 1 waiting in a {how} read-back for its kernel (which \
                     gives up after {WAIT:?}): rank 0's {how} copies took {copies:?}, its event \
                     wait {event:?}"
                );
                if page_locked {
                    assert!(copies < WAIT / 4 && event < WAIT / 4, "rank 0 was held up");
                    ar.all_reduce_in_place(&mut buf, LsaAlgorithm::OneShotFlags)
                        .expect("launch");
                    let got = staging.download(&buf);
                    ar.check().expect("rank 0's call completes");
                    assert!(got.iter().all(|&g| g == 3.0), "rank 0: {:?}", &got[..4]);
                }
            }
            barrier.wait();
            stream.synchronize().expect("sync");
            barrier.wait();
        }
    });
}

/// Random bit patterns for the all-gather: any `u32` as an `f32` (negative zeros, NaNs with
/// payloads, infinities among them), any `u16` as a `bf16`.
trait Bits: TestElem + Copy {
    fn random(rng: &mut Rng) -> Self;
    fn bits(self) -> u32;
}
impl Bits for f32 {
    fn random(rng: &mut Rng) -> Self {
        match rng.range(0, 7) {
            0 => -0.0,
            1 => f32::from_bits(0x7fc0_0000 | (rng.next_u64() as u32 & 0x3f_ffff)),
            _ => f32::from_bits(rng.next_u64() as u32),
        }
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}
impl Bits for half::bf16 {
    fn random(rng: &mut Rng) -> Self {
        match rng.range(0, 7) {
            0 => half::bf16::NEG_ZERO,
            _ => half::bf16::from_bits(rng.next_u64() as u16),
        }
    }
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
}

fn gather_for<T: Bits>(comm: Comm, barrier: &std::sync::Barrier) {
    let (rank, size) = (comm.rank(), comm.size());
    let stream = comm.stream().clone();
    const MAX_COUNT: usize = 20_011;
    let most = MAX_COUNT / 2;
    let mut send = stream.alloc_zeros::<T>(most + 4).expect("send");
    let mut recv = stream.alloc_zeros::<T>(most * size + 4).expect("recv");
    let mut sums = stream.alloc_zeros::<T>(64).expect("sums");
    let mut staging = Staging::new(&stream, most * size + 4);
    let mut ar = LsaAllReduce::<T>::new(&comm, MAX_COUNT).expect("new");
    ar.set_timeout(TIMEOUT);
    assert_eq!(ar.max_gather_count(), most);
    let data = |r: usize, n: usize, seed: u64| -> Vec<T> {
        let mut rng = Rng::new(seed ^ ((r as u64 + 3) << 32));
        (0..n).map(|_| T::random(&mut rng)).collect()
    };
    let mut seed = 7;
    for n in [1, 2, 3, 4, 5, 7, 1000, 4097, most] {
        for (s_shift, r_shift) in [(0, 0), (1, 3)] {
            seed += 1;
            staging.upload(
                &data(rank, n, seed),
                &mut send.slice_mut(s_shift..s_shift + n),
            );
            ar.all_gather(
                &send.slice(s_shift..s_shift + n),
                &mut recv.slice_mut(r_shift..r_shift + n * size),
            )
            .unwrap_or_else(|e| panic!("rank {rank}: all-gather of {n}: {e}"));
            let got = staging.download(&recv.slice(r_shift..r_shift + n * size));
            ar.check()
                .unwrap_or_else(|e| panic!("rank {rank}: all-gather of {n}: {e}"));
            for r in 0..size {
                let want = data(r, n, seed);
                let wrong = (0..n)
                    .filter(|&i| got[r * n + i].bits() != want[i].bits())
                    .count();
                assert_eq!(
                    wrong, 0,
                    "rank {rank}: all-gather of {n} (shifts {s_shift}/{r_shift}): rank {r}'s \
                     part has {wrong} wrong"
                );
            }
            // An all-reduce between all-gathers: the rotation and the clearing of an
            // all-gather's buffer (its lines, not a sentinel) by the call after it.
            let algorithm = if n % 2 == 0 {
                LsaAlgorithm::OneShotFlags
            } else {
                LsaAlgorithm::TwoShotFlags
            };
            let ones: Vec<T> = (0..64).map(|_| T::from_i64(rank as i64 + 1)).collect();
            staging.upload(&ones, &mut sums);
            ar.all_reduce_in_place(&mut sums, algorithm).expect("sum");
            let got = staging.download(&sums);
            let want = (size * (size + 1) / 2) as f64;
            assert!(
                got.iter().all(|g| g.to_f64() == want),
                "rank {rank}: the sum after an all-gather of {n} ({algorithm:?})"
            );
        }
    }
    // Refused (alike on every rank, which no rank can know: out of step afterwards): too long
    // a message, a receive buffer of the wrong size.
    match ar.all_gather(
        &send.slice(0..most + 1),
        &mut recv.slice_mut(0..(most + 1) * size),
    ) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("max_gather_count"), "{msg}"),
        other => panic!("rank {rank}: past max_gather_count: {other:?}"),
    }
    match ar.all_gather(&send.slice(0..4), &mut recv.slice_mut(0..4 * size + 1)) {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("receive buffer"), "{msg}"),
        other => panic!("rank {rank}: a receive buffer of the wrong size: {other:?}"),
    }
    out_of_step(ar.check());
    barrier.wait();
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn all_gather_moves_every_bit() {
    const TEST: &str = "all_gather_moves_every_bit";
    if skip_before_device_api(TEST) {
        return;
    }
    let _deadline = Deadline::new(TEST, LIMIT);
    for name in ["f32", "bf16"] {
        let Some(comms) = comms(TEST) else {
            return;
        };
        per_rank(comms, |comm, barrier| match name {
            "f32" => gather_for::<f32>(comm, barrier),
            _ => gather_for::<half::bf16>(comm, barrier),
        });
    }
}

/// An abort from another thread stops a kernel that waits for a peer which never comes, at
/// once rather than at its timeout, and leaves the CUDA context working: the kernel returns
/// before NCCL unmaps the peers' scratch it would write to. Nonblocking communicators (an
/// abort handle needs one).
#[test]
#[ignore = "needs CUDA GPUs"]
fn an_abort_stops_a_waiting_kernel_first() {
    const TEST: &str = "an_abort_stops_a_waiting_kernel_first";
    let Some(layout) = device_api_layout(TEST) else {
        return;
    };
    let config = nccl::CommConfig::new()
        .blocking(false)
        .ready_timeout(Duration::from_secs(60));
    let comms = common::threaded::init_threaded(layout.streams(), &config);
    let _deadline = Deadline::new(TEST, LIMIT);
    // Far past the test's bound: only the abort can end the kernel in time.
    const KERNEL_TIMEOUT: Duration = Duration::from_secs(120);
    per_rank(comms, |comm, barrier| {
        let rank = comm.rank();
        let stream = comm.stream().clone();
        let mut buf = stream.alloc_zeros::<f32>(1024).expect("buf");
        let mut staging = Staging::new(&stream, 1024);
        let handle = comm.abort_handle().expect("abort handle");
        let mut ar = LsaAllReduce::<f32>::new(&comm, 1024).expect("new");
        ar.set_timeout(KERNEL_TIMEOUT);
        barrier.wait();
        if rank == 0 {
            // Two-shot: after its wait it would store sums into the peers' scratch.
            ar.all_reduce_in_place(&mut buf, LsaAlgorithm::TwoShotFlags)
                .expect("launch");
            std::thread::sleep(Duration::from_millis(300));
            let t = std::time::Instant::now();
            std::thread::scope(|s| {
                s.spawn(|| handle.abort().expect("abort"));
            });
            let aborted = t.elapsed();
            stream
                .synchronize()
                .expect("the kernel ended without a CUDA error");
            let ended = t.elapsed();
            println!(
                "NOTE {TEST}: abort took {aborted:?}, the kernel had ended {ended:?} after it"
            );
            assert!(
                ended < Duration::from_secs(10),
                "the kernel ran on for {ended:?}"
            );
            // The context still works, and the instance refuses further calls.
            staging.upload(&[2.0f32; 1024], &mut buf);
            assert!(staging.download(&buf).iter().all(|&x| x == 2.0));
            assert!(ar
                .all_reduce_in_place(&mut buf, LsaAlgorithm::OneShotFlags)
                .is_err());
        }
        barrier.wait();
        if rank != 0 {
            handle.abort().expect("abort");
        }
        drop(ar);
        barrier.wait();
    });
}
