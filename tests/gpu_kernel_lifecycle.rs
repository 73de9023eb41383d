//! The shipped kernels' lifecycle on real GPUs: no path lets go of a kernel it has not
//! stopped, and a call that fails leaves NaN, never stale memory, in its outputs.
//!
//! * a dropped `LsaAllReduce` whose kernel still waits for a peer stops it before anything
//!   else can unmap what it uses: an abort after the drop leaves the context working;
//! * a revoke, and a shrink with abort, behind a kernel that waits for a peer that never
//!   comes return at once (they stop the kernel first) instead of after its timeout;
//! * the barrier kernel meets every peer with fewer threads in a CTA than ranks;
//! * every kernel that starts after the instance gave up, or gives up itself, writes NaN over
//!   its outputs;
//! * a communicator's own stream is never the per-thread default stream;
//! * the expert exchange's kernels too: a dropped `ExpertExchange` whose dispatch waits for a
//!   peer stops it before an abort, and a revoke behind that dispatch returns at once and
//!   leaves the instance refusing its next call.
//!
//! Ranks are threads of one process: one GPU each, or two sharing GPU 0 (NCCL 2.30+), with
//! host copies through page-locked memory (see `gpu_lsa_all_reduce`). Run on a GPU host with
//! `cargo test --test gpu_kernel_lifecycle -- --include-ignored --test-threads=1` (or
//! `.gpu/run tests`), with NCCL 2.32.3 and the system's 2.28.3 (where every test but the
//! stream one skips: the kernels need 2.29.2).

mod common;

use std::time::{Duration, Instant};

use common::shape::skip;
use common::threaded::{init_threaded, per_rank, Deadline, Staging};
use common::Rng;
use nccl::device::{
    ExchangePath, ExpertExchange, ExpertShape, LsaAlgorithm, LsaAllReduce, LsaEpilogue,
    DEV_COMM_SINCE,
};
use nccl::{Comm, CommConfig, Error, ReduceOp, ShrinkMode};

const LIMIT: Duration = Duration::from_secs(240);
/// Far past what each test allows for the path it checks: only a stop ends the kernel in time.
const KERNEL_TIMEOUT: Duration = Duration::from_secs(60);

/// Nonblocking communicators (abort handles need them) of a threaded layout where the shipped
/// kernels can run, with the deadline that bounds the test; `None`, said, elsewhere.
fn ranks(test: &'static str) -> Option<(Vec<Comm>, Deadline)> {
    let lib = nccl::library::get().expect("NCCL loads");
    if lib.version() < DEV_COMM_SINCE {
        skip(
            test,
            &format!(
                "the shipped kernels need NCCL {DEV_COMM_SINCE}+, loaded {}",
                lib.version()
            ),
        );
        return None;
    }
    common::shape::setup();
    let layout = common::shape::threaded(test)?;
    let config = CommConfig::new()
        .blocking(false)
        .ready_timeout(Duration::from_secs(60));
    let comms = init_threaded(layout.streams(), &config);
    Some((comms, Deadline::new(test, LIMIT)))
}

/// Waits for everything enqueued on `stream` so far, for at most `limit`: a test that would
/// hang here fails, saying `what` did not end.
fn sync_within(stream: &cudarc::driver::CudaStream, limit: Duration, what: &str) {
    let done = stream.record_event(None).expect("an event");
    let start = Instant::now();
    while !done.try_is_complete().expect("the context works") {
        assert!(start.elapsed() < limit, "{what}: not ended after {limit:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Says where a test is (stderr, outside the harness's capture), so a hang can be located.
fn step(test: &str, rank: usize, what: &str) {
    eprintln!("STEP {test} rank {rank}: {what}");
}

fn all_nan(what: &str, rank: usize, got: &[f32]) {
    if let Some((i, x)) = got.iter().enumerate().find(|(_, x)| !x.is_nan()) {
        panic!("rank {rank}: {what}: element {i} is {x}, not NaN");
    }
}

/// C1 of the review: rank 0 drops an instance whose two-shot kernel waits for rank 1, which
/// never calls; an abort follows (as a watchdog's would). Before, the drop let go of the
/// kernel unstopped, and the abort unmapped the peers' scratch under it:
/// `CUDA_ERROR_ILLEGAL_ADDRESS`, a dead context.
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_dropped_instance_stops_its_kernel_before_the_abort() {
    const TEST: &str = "a_dropped_instance_stops_its_kernel_before_the_abort";
    let Some((comms, _deadline)) = ranks(TEST) else {
        return;
    };
    const DROP_TIMEOUT: Duration = Duration::from_secs(1);
    per_rank(comms, |mut comm, barrier| {
        let rank = comm.rank();
        comm.set_drop_timeout(DROP_TIMEOUT);
        let stream = comm.stream().clone();
        let mut buf = stream.alloc_zeros::<f32>(1024).expect("buf");
        let mut staging = Staging::new(&stream, 1024);
        let handle = comm.abort_handle().expect("abort handle");
        let mut ar = LsaAllReduce::<f32>::new(&comm, 1024).expect("new");
        ar.set_timeout(KERNEL_TIMEOUT);
        let mut ar = Some(ar);
        staging.upload(&[1.0f32; 1024], &mut buf);
        let _ = staging.download(&buf);
        barrier.wait();
        if rank == 0 {
            let mut ar = ar.take().expect("made above");
            // Two-shot: after its wait it would store sums into the peers' scratch.
            ar.all_reduce_in_place(&mut buf, LsaAlgorithm::TwoShotFlags)
                .expect("launch");
            std::thread::sleep(Duration::from_millis(300));
            let t = Instant::now();
            drop(ar);
            let dropped = t.elapsed();
            std::thread::sleep(Duration::from_millis(500));
            handle.abort().expect("abort");
            stream
                .synchronize()
                .expect("the stream ends without a CUDA error");
            let ended = t.elapsed();
            println!("NOTE {TEST}: drop took {dropped:?}; the stream ended {ended:?} after it");
            assert!(
                dropped < DROP_TIMEOUT + Duration::from_secs(4),
                "the drop took {dropped:?}"
            );
            assert!(ended < Duration::from_secs(10), "the kernel ran {ended:?}");
            // The stopped call left NaN, and the context still works.
            all_nan("the stopped call's output", rank, &staging.download(&buf));
            staging.upload(&[2.0f32; 1024], &mut buf);
            assert!(staging.download(&buf).iter().all(|&x| x == 2.0));
        }
        barrier.wait();
        if rank != 0 {
            drop(ar);
            handle.abort().expect("abort");
        }
        barrier.wait();
    });
}

/// M1 of the review: rank 0's one-shot kernel waits for rank 1, which never calls, and an
/// NCCL all-reduce is queued behind it; NCCL's revoke waits for the stream work queued before
/// its last launch, so before, rank 0's revoke took the kernel's whole timeout (every rank
/// revokes, as after a failure: NCCL's revoke of a communicator with a device communicator
/// and windows needs its peers). Then a shrink that aborts, after rank 1 died (aborted its
/// communicator), with nothing of NCCL's behind the kernel: the child inherits the stream,
/// which must not stay blocked by it.
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_revoke_or_shrink_behind_a_waiting_kernel_returns_at_once() {
    const TEST: &str = "a_revoke_or_shrink_behind_a_waiting_kernel_returns_at_once";
    if nccl::library::get()
        .map(|lib| lib.version() < nccl::fault::REVOKE_SINCE)
        .unwrap_or(true)
    {
        skip(TEST, "ncclCommRevoke needs NCCL 2.28.7");
        return;
    }
    for shrink in [false, true] {
        let Some((comms, _deadline)) = ranks(TEST) else {
            return;
        };
        per_rank(comms, |comm, barrier| {
            let (rank, size) = (comm.rank(), comm.size());
            let what = if shrink { "shrink" } else { "revoke" };
            let stream = comm.stream().clone();
            let mut buf = stream.alloc_zeros::<f32>(1024).expect("buf");
            let mut other = stream.alloc_zeros::<f32>(1024).expect("other");
            let mut staging = Staging::new(&stream, 1024);
            let handle = comm.abort_handle().expect("abort handle");
            let mut ar = Some(LsaAllReduce::<f32>::new(&comm, 1024).expect("new"));
            if let Some(ar) = ar.as_mut() {
                ar.set_timeout(KERNEL_TIMEOUT);
            }
            // A second instance, idle when its kernels are stopped: it must refuse its next
            // call too, though no kernel of it was running to notice the stop.
            let mut idle = Some(LsaAllReduce::<f32>::new(&comm, 1024).expect("new"));
            barrier.wait();
            let launched = Instant::now();
            if rank == 0 {
                let kernels = ar.as_mut().expect("made above");
                kernels
                    .all_reduce_in_place(&mut buf, LsaAlgorithm::OneShotFlags)
                    .expect("launch");
                if !shrink {
                    comm.all_reduce_in_place(&mut other, ReduceOp::Sum)
                        .expect("NCCL behind it");
                }
                step(TEST, rank, &format!("{what}: launched"));
            }
            std::thread::sleep(Duration::from_millis(300));
            if shrink && rank != 0 {
                // Rank 1 dies.
                drop(idle.take());
                drop(ar.take());
                handle.abort().expect("abort");
                step(TEST, rank, "died");
                barrier.wait();
                // Freeing page-locked memory (the staging's drop, on return) waits for the
                // whole CUDA context, which ranks sharing a GPU share, and where rank 0's
                // kernel spins until its shrink stops it: held until the shrink returned (a
                // dead rank frees nothing; before, this wait hid a shrink that only ended when
                // the kernel gave up).
                barrier.wait();
                return;
            }
            if shrink {
                barrier.wait();
            }
            let t = Instant::now();
            if shrink {
                let excluded: Vec<usize> = (1..size).collect();
                // The kernel still waits (far from giving up on its own) when the shrink
                // stops it.
                assert!(launched.elapsed() < KERNEL_TIMEOUT / 2);
                let child = comm
                    .shrink(&excluded, ShrinkMode::Abort, None)
                    .expect("shrink");
                let took = t.elapsed();
                barrier.wait();
                step(TEST, rank, &format!("shrunk in {took:?}"));
                // The child runs on the inherited stream.
                staging.upload(&[3.0f32; 1024], &mut other);
                child
                    .all_reduce_in_place(&mut other, ReduceOp::Sum)
                    .expect("the child's all-reduce");
                sync_within(&stream, Duration::from_secs(10), "the child's all-reduce");
                let ended = t.elapsed();
                println!("NOTE {TEST}: shrink took {took:?}, the child's call ended {ended:?}");
                assert!(staging.download(&other).iter().all(|&x| x == 3.0));
                assert!(ended < Duration::from_secs(5), "{ended:?}");
                drop(child);
            } else {
                comm.revoke().expect("revoke");
                let took = t.elapsed();
                step(TEST, rank, &format!("revoked in {took:?}"));
                sync_within(
                    &stream,
                    Duration::from_secs(10),
                    "the stream after the revoke",
                );
                println!("NOTE {TEST}: rank {rank}'s revoke took {took:?}");
                assert!(took < Duration::from_secs(1), "the revoke took {took:?}");
            }
            if rank == 0 {
                all_nan("the stopped call's output", rank, &staging.download(&buf));
                // Said as a stop, though the kernel left through its give-up path.
                let kernels = ar.as_mut().expect("made above");
                match kernels.all_reduce_in_place(&mut buf, LsaAlgorithm::OneShotFlags) {
                    Err(Error::InvalidUsage(msg)) => {
                        assert!(msg.contains("stopped"), "{what}: {msg}")
                    }
                    other => panic!("{what}: the stopped instance's next call: {other:?}"),
                }
                let idle = idle.as_mut().expect("made above");
                match idle.all_reduce_in_place(&mut buf, LsaAlgorithm::OneShotFlags) {
                    Err(Error::InvalidUsage(msg)) => {
                        assert!(msg.contains("stopped"), "{what}: {msg}")
                    }
                    other => panic!("{what}: the idle instance's next call: {other:?}"),
                }
            }
            if !shrink {
                barrier.wait();
            }
            drop(idle.take());
            drop(ar.take());
            drop(handle.abort());
            step(TEST, rank, &format!("{what}: done"));
        });
    }
}

/// C2 of the review: the barrier kernel's CTAs meet every peer. Before, thread p of a CTA met
/// peer p, so ranks at or past the CTA's thread count were never waited for; here every
/// barrier CTA has one thread, fewer than the ranks, and the last rank comes late, so a rank
/// that did not wait for it would read its slot before it was written.
#[test]
#[ignore = "needs CUDA GPUs"]
fn the_barrier_meets_every_peer_with_fewer_threads_than_ranks() {
    const TEST: &str = "the_barrier_meets_every_peer_with_fewer_threads_than_ranks";
    let Some((comms, _deadline)) = ranks(TEST) else {
        return;
    };
    const MAX: usize = 4099;
    per_rank(comms, |comm, barrier| {
        let (rank, size) = (comm.rank(), comm.size());
        let stream = comm.stream().clone();
        let mut send = stream.alloc_zeros::<f32>(MAX).expect("send");
        let mut recv = stream.alloc_zeros::<f32>(MAX).expect("recv");
        let mut staging = Staging::new(&stream, MAX);
        let mut ar = LsaAllReduce::<f32>::new(&comm, MAX).expect("new");
        ar.set_timeout(Duration::from_secs(20));
        // SAFETY: every rank sets the same count before its first call.
        unsafe { ar.set_barrier_threads(1) }.expect("one thread a CTA");
        for (call, count) in [1usize, 7, 1000, MAX].into_iter().enumerate() {
            let input = |r: usize| -> Vec<f32> {
                let mut rng = Rng::new(0x5eed ^ (((call * 64 + r) as u64 + 1) * 0x9e37_79b9));
                (0..count).map(|_| rng.range(-64, 64) as f32).collect()
            };
            let want: Vec<f32> = (0..count)
                .map(|i| (0..size).map(|r| input(r)[i]).sum())
                .collect();
            staging.upload(&input(rank), &mut send);
            let _ = staging.download(&recv);
            barrier.wait();
            if rank == size - 1 {
                std::thread::sleep(Duration::from_millis(200));
            }
            let mut out = recv.slice_mut(..count);
            let ran = ar
                .all_reduce(&send.slice(..count), &mut out, LsaAlgorithm::OneShotBarrier)
                .expect("all-reduce");
            assert_eq!(ran, LsaAlgorithm::OneShotBarrier);
            let got = staging.download(&recv.slice(..count));
            ar.check().expect("every rank met");
            if let Some(i) = (0..count).find(|&i| got[i] != want[i]) {
                panic!(
                    "rank {rank}, {count} elements: element {i} is {} not {}",
                    got[i], want[i]
                );
            }
            barrier.wait();
        }
    });
}

/// m4 of the review: a kernel that gives up, and every kernel of the instance queued behind
/// it (which starts after it gave up), write NaN over their outputs: nothing returned to a
/// caller holds another buffer's stale data. Rank 1 never calls; rank 0 queues one call of
/// every kernel, all on outputs that held 7.
#[test]
#[ignore = "needs CUDA GPUs"]
fn failed_calls_leave_nan_in_every_output() {
    const TEST: &str = "failed_calls_leave_nan_in_every_output";
    let Some((comms, _deadline)) = ranks(TEST) else {
        return;
    };
    const N: usize = 4096;
    const HIDDEN: usize = 512;
    per_rank(comms, |comm, barrier| {
        let (rank, size) = (comm.rank(), comm.size());
        let stream = comm.stream().clone();
        let mut staging = Staging::new(&stream, N * size);
        let mut seven = |len: usize| {
            let mut b = stream.alloc_zeros::<f32>(len).expect("buffer");
            staging.upload(&vec![7.0f32; len], &mut b);
            let _ = staging.download(&b);
            b
        };
        let (mut one, two_in, mut two_out, mut barrier_buf) =
            (seven(N), seven(N), seven(N), seven(N));
        let (gather_in, mut gather_out) = (seven(N / 2), seven(N / 2 * size));
        let (mut x, residual, weight) = (seven(N), seven(N), seven(HIDDEN));
        let (mut residual_out, mut normed) = (seven(N), seven(N));
        let mut ar = LsaAllReduce::<f32>::new(&comm, N).expect("new");
        ar.set_timeout(Duration::from_secs(1));
        barrier.wait();
        if rank == 0 {
            ar.all_reduce_in_place(&mut one, LsaAlgorithm::OneShotFlags)
                .expect("one-shot");
            ar.all_reduce(&two_in, &mut two_out, LsaAlgorithm::TwoShotFlags)
                .expect("two-shot");
            ar.all_reduce_in_place(&mut barrier_buf, LsaAlgorithm::OneShotBarrier)
                .expect("barrier");
            ar.all_gather(&gather_in, &mut gather_out)
                .expect("all-gather");
            ar.all_reduce_add_rms_norm_to(
                &mut x,
                &residual,
                &weight,
                1e-6,
                &mut residual_out,
                &mut normed,
                LsaEpilogue::Fused,
            )
            .expect("fused epilogue");
            match ar.check() {
                Err(Error::Timeout { .. }) => {}
                other => panic!("rank 0: its peer never came: {other:?}"),
            }
            for (what, buf) in [
                ("one-shot", &one),
                ("two-shot", &two_out),
                ("barrier", &barrier_buf),
                ("all-gather", &gather_out),
                ("epilogue residual", &residual_out),
                ("epilogue output", &normed),
            ] {
                all_nan(what, rank, &staging.download(buf));
            }
        }
        barrier.wait();
    });
}

/// m6 of the review: the per-thread default stream names another stream on each thread, and a
/// communicator is used, waited for and dropped from any thread: refused as its own stream.
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_communicators_own_stream_is_never_the_per_thread_default_stream() {
    const TEST: &str = "a_communicators_own_stream_is_never_the_per_thread_default_stream";
    if common::shape::gpus(TEST, 1).is_none() {
        return;
    }
    let ctx = cudarc::driver::CudaContext::new(0).expect("GPU 0");
    let stream = ctx.per_thread_stream();
    let refused = |r: nccl::Result<()>, what: &str| match r {
        Err(Error::InvalidArgument(msg)) => assert!(msg.contains("per-thread"), "{what}: {msg}"),
        other => panic!("{what}: {other:?}"),
    };
    refused(
        Comm::init_all(std::slice::from_ref(&stream)).map(drop),
        "init_all",
    );
    let id = nccl::UniqueId::new().expect("id");
    refused(Comm::init_rank(stream, &id, 0, 1).map(drop), "init_rank");
}

/// m7 of the review: the flight recorder sees inside the shipped kernels' calls. Rank 1 skips
/// one all-reduce of an instance (its next call, of another size, pairs with rank 0's next);
/// the kernels that find no partner give up. The records, compared, name rank 1 as having
/// skipped that instance's call 4, and show the instance's give-up.
#[test]
#[ignore = "needs CUDA GPUs"]
fn the_flight_record_names_a_rank_that_skipped_a_shipped_call() {
    use nccl::diagnostics::flight::{compare, Finding};
    const TEST: &str = "the_flight_record_names_a_rank_that_skipped_a_shipped_call";
    let Some((comms, _deadline)) = ranks(TEST) else {
        return;
    };
    if comms.len() != 2 {
        // The skip below pairs rank 1's next call with rank 0's: two ranks make that exact.
        skip(
            TEST,
            &format!("written for 2 ranks, the layout has {}", comms.len()),
        );
        return;
    }
    let records = per_rank(comms, |comm, barrier| {
        let rank = comm.rank();
        let stream = comm.stream().clone();
        let mut buf = stream.alloc_zeros::<f32>(256).expect("buf");
        let mut staging = Staging::new(&stream, 256);
        let mut ar = LsaAllReduce::<f32>::new(&comm, 256).expect("new");
        ar.set_timeout(Duration::from_secs(1));
        for _ in 0..3 {
            ar.all_reduce_in_place(&mut buf, LsaAlgorithm::OneShotFlags)
                .expect("in step");
        }
        let _ = staging.download(&buf);
        ar.check().expect("three calls in step");
        barrier.wait();
        let mut small = buf.slice_mut(..100);
        if rank == 0 {
            ar.all_reduce_in_place(&mut small, LsaAlgorithm::OneShotFlags)
                .expect("call 4");
        }
        ar.all_reduce_in_place(&mut buf, LsaAlgorithm::OneShotFlags)
            .expect("call 5 (rank 1's 4)");
        match ar.check() {
            Err(Error::Timeout { .. }) => {}
            other => panic!("rank {rank}: a kernel without its partner: {other:?}"),
        }
        barrier.wait();
        let record = comm.flight_record().expect("the recorder is on by default");
        drop(ar);
        record
    });
    for record in &records {
        let calls: Vec<u64> = record.shipped_calls(1).map(|e| e.count).collect();
        println!(
            "NOTE {TEST}: rank {}: instance 1's counts {calls:?}",
            record.rank
        );
    }
    let comparison = compare(&records).expect("comparable");
    println!("NOTE {TEST}: {comparison:?}");
    let shipped = comparison
        .shipped
        .iter()
        .find(|c| c.instance == 1)
        .expect("instance 1 compared");
    assert_eq!(shipped.diverged_at, Some(4), "{shipped:?}");
    assert!(
        shipped.findings.iter().any(|f| matches!(
            f,
            Finding::Skipped {
                rank: 1,
                seq: 4,
                count: 1,
                ..
            }
        )),
        "{shipped:?}"
    );
    assert!(
        shipped
            .findings
            .iter()
            .any(|f| matches!(f, Finding::GaveUp { .. })),
        "{shipped:?}"
    );
}

/// The expert exchange's lifecycle, as C1 and M1 for the all-reduce: rank 0's dispatch waits
/// for rank 1's rows, which never come. Dropped, the instance stops the kernel (within the
/// communicator's drop timeout and a second) before it frees the scratch window the kernel
/// stores into, and the abort after it leaves the context working; revoked (every rank, as
/// after a failure), the revoke returns at once and the instance refuses its next call.
#[test]
#[ignore = "needs CUDA GPUs"]
fn an_exchange_dropped_or_revoked_behind_a_waiting_dispatch_stops_it() {
    const TEST: &str = "an_exchange_dropped_or_revoked_behind_a_waiting_dispatch_stops_it";
    const DROP_TIMEOUT: Duration = Duration::from_secs(1);
    let revoke_since = nccl::fault::REVOKE_SINCE;
    for revoke in [false, true] {
        if revoke
            && nccl::library::get()
                .map(|lib| lib.version() < revoke_since)
                .unwrap_or(true)
        {
            skip(TEST, "ncclCommRevoke needs NCCL 2.28.7");
            return;
        }
        let Some((comms, _deadline)) = ranks(TEST) else {
            return;
        };
        per_rank(comms, |mut comm, barrier| {
            let (rank, ranks) = (comm.rank(), comm.size());
            let what = if revoke { "revoke" } else { "drop" };
            comm.set_drop_timeout(DROP_TIMEOUT);
            let stream = comm.stream().clone();
            let handle = comm.abort_handle().expect("abort handle");
            let shape = ExpertShape::new(2 * ranks, 2, 256, 4);
            let mut exchange =
                Some(ExpertExchange::<f32>::new(&comm, shape, ExchangePath::Lsa).expect("new"));
            if let Some(exchange) = exchange.as_mut() {
                exchange.set_timeout(KERNEL_TIMEOUT);
            }
            let x = stream.alloc_zeros::<f32>(4 * 256).expect("x");
            // Token t to experts 0 and the last: rows for rank 0 and the last rank.
            let routing: Vec<i32> = (0..4).flat_map(|_| [0, 2 * ranks as i32 - 1]).collect();
            let routing = stream.clone_htod(&routing).expect("routing");
            let mut recv = stream
                .alloc_zeros::<f32>(shape.received_rows(ranks) * 256)
                .expect("recv");
            let mut counts = stream.alloc_zeros::<i32>(2).expect("counts");
            sync_within(&stream, Duration::from_secs(10), "the setup");
            barrier.wait();
            if rank == 0 {
                let e = exchange.as_mut().expect("made above");
                let _pending = e
                    .dispatch(&x, &routing, &mut recv, &mut counts)
                    .expect("launch");
                step(TEST, rank, &format!("{what}: dispatched"));
                std::thread::sleep(Duration::from_millis(300));
                let t = Instant::now();
                if revoke {
                    barrier.wait();
                    comm.revoke().expect("revoke");
                    let took = t.elapsed();
                    sync_within(
                        &stream,
                        Duration::from_secs(10),
                        "the stream after the revoke",
                    );
                    println!("NOTE {TEST}: rank 0's revoke behind the dispatch took {took:?}");
                    assert!(took < Duration::from_secs(1), "the revoke took {took:?}");
                    let e = exchange.as_mut().expect("made above");
                    match e.dispatch(&x, &routing, &mut recv, &mut counts) {
                        Err(Error::InvalidUsage(msg)) => assert!(msg.contains("stopped"), "{msg}"),
                        other => panic!("the next dispatch after the revoke: {other:?}"),
                    }
                } else {
                    drop(exchange.take());
                    let dropped = t.elapsed();
                    std::thread::sleep(Duration::from_millis(300));
                    handle.abort().expect("abort");
                    stream
                        .synchronize()
                        .expect("the stream ends without a CUDA error");
                    println!("NOTE {TEST}: the drop behind the dispatch took {dropped:?}");
                    assert!(
                        dropped < DROP_TIMEOUT + Duration::from_secs(4),
                        "the drop took {dropped:?}"
                    );
                    // The context still works.
                    let back = stream.clone_dtoh(&counts).expect("a copy after the abort");
                    assert_eq!(back.len(), 2);
                }
            } else if revoke {
                barrier.wait();
                comm.revoke().expect("revoke");
            }
            barrier.wait();
            drop(exchange.take());
            drop(handle.abort());
            step(TEST, rank, &format!("{what}: done"));
        });
    }
}
