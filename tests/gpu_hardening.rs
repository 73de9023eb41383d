//! Edge cases of a communicator's life on real GPUs: a nonblocking call that never completes,
//! a destroy that fails, dropping stuck communicators together, point-to-point with oneself,
//! streams of another device, a kernel left hanging on a side stream when the communicator
//! ends. Every test uses all GPUs present (at least 2), or two ranks sharing GPU 0 on a
//! one-GPU host (NCCL 2.30+; see `common::shape`).
//!
//! Past 600 lines on purpose: one binary for the end-of-life edge cases, each a few dozen
//! lines of set-up that a reader checks next to its assertions; splitting them would only
//! duplicate the helpers above.
//!
//! Run on a GPU host with `cargo test --test gpu_hardening -- --include-ignored`.

mod common;

use common::procs::{fields, var, Children};
use common::shape::{processes, Shape};

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use nccl::{Comm, CommConfig, Error, Group, Operation, ReduceOp, UniqueId};

/// The GPU of each rank: every GPU of the host, or GPU 0 twice (NCCL 2.30+); `None` (the
/// test then passes, having said why) where neither is possible (see `common::shape`).
fn gpus(test: &str) -> Option<Vec<usize>> {
    common::shape::threaded(test).map(|layout| layout.devices)
}

/// A stream of its own on `device` (two ranks sharing a GPU need one each).
fn stream_on(device: usize) -> Arc<CudaStream> {
    CudaContext::new(device)
        .and_then(|ctx| ctx.new_stream())
        .expect("CUDA context")
}

/// Random values from a fixed seed (xorshift), small integers so sums are exact in f32.
fn random(seed: u64, len: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 64) as f32 - 32.0
        })
        .collect()
}

/// One communicator per rank from `Comm::init_all`.
fn all_comms(devices: &[usize]) -> Vec<Comm> {
    let streams: Vec<_> = devices.iter().map(|&d| stream_on(d)).collect();
    Comm::init_all(&streams).expect("ncclCommInitAll")
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn stuck_nonblocking_call_aborts_before_its_buffers_are_released() {
    let test = "stuck_nonblocking_call_aborts_before_its_buffers_are_released";
    if gpus(test).is_none() {
        return;
    }
    // Connections are made by the first collective that needs them; while rank 0 is alone
    // in it, that setup (and so the call) stays in progress. NCCL reads the switch once per
    // process (and the shared-GPU shape turns it off), so in a process of its own.
    let children = Children::spawn("child_stuck_nonblocking_call", &[0], |_| {
        vec![var(STUCK_CHILD_ENV, 1), var("NCCL_RUNTIME_CONNECT", 1)]
    });
    let lines = children.finish(Duration::from_secs(240));
    assert!(
        lines.iter().any(|(_, l)| l.contains("STUCK_CALL_OK")),
        "the child reports: {lines:?}"
    );
}

/// Marks the child process of `stuck_nonblocking_call_aborts_before_its_buffers_are_released`.
const STUCK_CHILD_ENV: &str = "NCCL_RS_STUCK_CHILD";

#[test]
#[ignore = "child process of stuck_nonblocking_call_aborts_before_its_buffers_are_released"]
fn child_stuck_nonblocking_call() {
    if std::env::var_os(STUCK_CHILD_ENV).is_none() {
        return;
    }
    let devices = common::threaded::devices();
    let n = devices.len();
    let id = UniqueId::new().unwrap();
    let rank0_done = Barrier::new(n);
    std::thread::scope(|scope| {
        for rank in 0..n {
            let (id, rank0_done, devices) = (&id, &rank0_done, &devices);
            scope.spawn(move || {
                let stream = stream_on(devices[rank]);
                let config = CommConfig::new()
                    .blocking(false)
                    .ready_timeout(Duration::from_secs(120));
                let mut comm = Comm::init_rank_with_config(stream.clone(), id, rank, n, &config)
                    .unwrap_or_else(|e| panic!("rank {rank}: init: {e}"));
                if rank == 0 {
                    let data = random(7, 1 << 20);
                    let mut buf: CudaSlice<f32> = stream.clone_htod(&data).unwrap();
                    comm.set_ready_timeout(Duration::from_secs(3));
                    let start = Instant::now();
                    let result = comm.all_reduce_in_place(&mut buf, ReduceOp::Sum);
                    let waited = start.elapsed();
                    println!("rank 0: lone all_reduce returned after {waited:?}: {result:?}");
                    let err = result.expect_err("an all-reduce no peer joins cannot complete");
                    assert!(matches!(err, Error::Timeout { .. }), "{err}");
                    assert!(
                        err.to_string().contains("the communicator was aborted"),
                        "{err}"
                    );
                    assert!(waited < Duration::from_secs(10), "{waited:?}");
                    // The communicator is gone, and says why; the stream and the buffer are
                    // still usable (no CUDA error from work recorded while NCCL owned it).
                    let failure = comm.failure().expect("a failure is recorded");
                    assert!(failure.to_string().contains("aborted"), "{failure}");
                    let err = comm
                        .all_reduce_in_place(&mut buf, ReduceOp::Sum)
                        .unwrap_err();
                    assert!(err.to_string().contains("aborted"), "{err}");
                    stream.synchronize().expect("stream usable after the abort");
                    let back = stream.clone_dtoh(&buf).expect("buffer readable");
                    assert_eq!(back.len(), data.len());
                    let start = Instant::now();
                    drop(comm);
                    assert!(start.elapsed() < Duration::from_secs(2));
                    println!("STUCK_CALL_OK rank=0 waited_ms={}", waited.as_millis());
                    rank0_done.wait();
                } else {
                    rank0_done.wait();
                    let start = Instant::now();
                    drop(comm);
                    println!("rank {rank}: dropped in {:?}", start.elapsed());
                }
            });
        }
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn destroy_gives_the_communicator_back_when_it_fails() {
    let Some(devices) = gpus("destroy_gives_the_communicator_back_when_it_fails") else {
        return;
    };
    let n = devices.len();
    let id = UniqueId::new().unwrap();
    std::thread::scope(|scope| {
        for rank in 0..n {
            let (id, devices) = (&id, &devices);
            scope.spawn(move || {
                let stream = stream_on(devices[rank]);
                let config = CommConfig::new().blocking(false);
                let comm = Comm::init_rank_with_config(stream.clone(), id, rank, n, &config)
                    .unwrap_or_else(|e| panic!("rank {rank}: init: {e}"));
                let data = random(rank as u64, 4096);
                let mut buf = stream.clone_htod(&data).unwrap();
                comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
                comm.synchronize_timeout(Duration::from_secs(60)).unwrap();
                let got = stream.clone_dtoh(&buf).unwrap();
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| random(r as u64, 4096)).collect();
                let want: Vec<f32> = (0..4096)
                    .map(|i| inputs.iter().map(|input| input[i]).sum())
                    .collect();
                assert_eq!(got, want, "rank {rank}");
                // Finalize is collective; destroy afterwards is local.
                comm.finalize().unwrap();
                if rank == 0 {
                    // Aborted behind the owner's back: destroy fails and hands it back.
                    comm.abort_handle().unwrap().abort().unwrap();
                    let (back, err) = comm.destroy().expect_err("already aborted");
                    assert!(err.to_string().contains("AbortHandle"), "{err}");
                    assert_eq!(back.rank(), 0);
                    // `?` turns the pair into the error alone.
                    let as_error: Error = (back, err).into();
                    assert!(as_error.to_string().contains("AbortHandle"), "{as_error}");
                } else {
                    comm.destroy()
                        .unwrap_or_else(|(_, e)| panic!("rank {rank}: destroy: {e}"));
                }
                println!("DESTROY_OK rank={rank}");
            });
        }
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn dropping_stuck_sibling_communicators_takes_one_drop_timeout() {
    let Some(devices) = gpus("dropping_stuck_sibling_communicators_takes_one_drop_timeout") else {
        return;
    };
    let n = devices.len();
    let mut comms = all_comms(&devices);
    // Larger than NCCL's per-peer buffers, so a send without its receive cannot finish.
    let len = 16 << 20;
    let send: Vec<CudaSlice<f32>> = comms
        .iter()
        .map(|c| {
            c.stream()
                .clone_htod(&random(c.rank() as u64, len))
                .unwrap()
        })
        .collect();
    let mut recv: Vec<CudaSlice<f32>> = comms
        .iter()
        .map(|c| c.stream().alloc_zeros(len).unwrap())
        .collect();
    // A full ring first, so every connection exists and the stuck round below launches.
    {
        let mut group = Group::start().unwrap();
        for ((comm, s), r) in comms.iter().zip(&send).zip(recv.iter_mut()) {
            let rank = comm.rank();
            group
                .enqueue(comm, nccl::Operation::send(s, (rank + 1) % n))
                .unwrap();
            group
                .enqueue(comm, nccl::Operation::recv(r, (rank + n - 1) % n))
                .unwrap();
        }
        group.finish().unwrap();
    }
    for (comm, r) in comms.iter().zip(&recv) {
        comm.synchronize_timeout(Duration::from_secs(60)).unwrap();
        let from = (comm.rank() + n - 1) % n;
        let got = comm.stream().clone_dtoh(r).unwrap();
        assert_eq!(
            got,
            random(from as u64, len),
            "ring into rank {}",
            comm.rank()
        );
    }
    // Now receives only: every communicator's kernels wait for data that never comes.
    {
        let mut group = Group::start().unwrap();
        for (comm, r) in comms.iter().zip(recv.iter_mut()) {
            let rank = comm.rank();
            group
                .enqueue(comm, nccl::Operation::recv(r, (rank + n - 1) % n))
                .unwrap();
        }
        group.finish().unwrap();
    }
    let timeout = Duration::from_secs(2);
    for comm in &mut comms {
        comm.set_drop_timeout(timeout);
    }
    let start = Instant::now();
    let mut each = Vec::new();
    for comm in comms {
        let one = Instant::now();
        drop(comm);
        each.push(one.elapsed().as_millis());
    }
    let took = start.elapsed();
    println!(
        "SIBLINGS_DROP n={n} took_ms={} each_ms={each:?}",
        took.as_millis()
    );
    assert!(
        took >= timeout,
        "the first drop waits its timeout: {took:?}"
    );
    // Each abort takes a moment; N full timeouts (the old behaviour) are well above this.
    assert!(
        took < timeout + Duration::from_millis(1500),
        "{n} stuck communicators took {took:?} to drop"
    );
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn point_to_point_with_oneself_needs_a_group() {
    let Some(devices) = gpus("point_to_point_with_oneself_needs_a_group") else {
        return;
    };
    let n = devices.len();
    let comms = all_comms(&devices);
    let len = 1 << 16;
    for comm in &comms {
        let rank = comm.rank();
        let stream = comm.stream();
        let data = random(100 + rank as u64, len);
        let src = stream.clone_htod(&data).unwrap();
        let mut dst: CudaSlice<f32> = stream.alloc_zeros(len).unwrap();
        // Alone, it would wait for itself forever: refused before NCCL sees it.
        let err = comm.send(&src, rank).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        assert!(err.to_string().contains("own rank"), "{err}");
        let err = comm.recv(&mut dst, rank).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        // The communicator is untouched, and in a group the pair works.
        assert!(comm.failure().is_none());
        {
            let mut group = Group::start().unwrap();
            group
                .enqueue(comm, nccl::Operation::send(&src, rank))
                .unwrap();
            group
                .enqueue(comm, nccl::Operation::recv(&mut dst, rank))
                .unwrap();
            group.finish().unwrap();
        }
        comm.synchronize_timeout(Duration::from_secs(60)).unwrap();
        assert_eq!(stream.clone_dtoh(&dst).unwrap(), data, "rank {rank}");
    }
    // A stream of another device is refused with the same rule as a buffer of one.
    if devices[1] == devices[0] {
        println!(
            "ranks share GPU {}: no other device for the foreign-stream case",
            devices[0]
        );
    } else {
        let other = comms[1].stream().clone();
        let src = comms[0].stream().clone_htod(&random(1, len)).unwrap();
        let mut dst: CudaSlice<f32> = comms[0].stream().alloc_zeros(len).unwrap();
        let err = comms[0]
            .enqueue_on(
                &other,
                nccl::Operation::all_reduce(&src, &mut dst, ReduceOp::Sum),
            )
            .unwrap_err();
        assert!(
            err.to_string().contains("the stream is on device 1"),
            "{err}"
        );
        let foreign: CudaSlice<f32> = other.alloc_zeros(len).unwrap();
        let err = comms[0]
            .all_reduce(&foreign, &mut dst, ReduceOp::Sum)
            .unwrap_err();
        assert!(
            err.to_string().contains("the send buffer is on device 1"),
            "{err}"
        );
    }
    println!("SELF_P2P_OK n={n}");
}

/// C3: a nonblocking window registration that only rank 0 makes stays in progress (NCCL's
/// job waits in its bootstrap all-gather for the others). When its `ready_timeout` runs out,
/// the communicator must be aborted before anything else touches it: before the fix it was
/// left in progress, and dropping the earlier window then deregistered it on this thread
/// while NCCL's job still registered the new one. The earlier window's all-reduce is checked
/// against the host reference first, and dropping it after the abort makes no NCCL call.
#[test]
#[ignore = "needs CUDA GPUs"]
fn c3_timed_out_nonblocking_registration_aborts_the_communicator() {
    const TEST: &str = "c3_timed_out_nonblocking_registration_aborts_the_communicator";
    let Some(_deadline) = common::threaded::gpu_test(TEST, Duration::from_secs(240)) else {
        return;
    };
    let devices = common::threaded::devices();
    let n = devices.len();
    let version = nccl::version().unwrap();
    let id = UniqueId::new().unwrap();
    let rank0_done = Barrier::new(n);
    let registered = Barrier::new(n);
    let len = 4096;
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| random(31 + r as u64, len)).collect();
    let want: Vec<f32> = (0..len)
        .map(|i| inputs.iter().map(|x| x[i]).sum())
        .collect();
    let skipped = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        for rank in 0..n {
            let (id, rank0_done, registered, devices) = (&id, &rank0_done, &registered, &devices);
            let (inputs, want, skipped) = (&inputs, &want, &skipped);
            scope.spawn(move || {
                let stream = stream_on(devices[rank]);
                let config = CommConfig::new()
                    .blocking(false)
                    .ready_timeout(Duration::from_secs(120));
                let mut comm = Comm::init_rank_with_config(stream.clone(), id, rank, n, &config)
                    .unwrap_or_else(|e| panic!("rank {rank}: init: {e}"));
                // The window borrows the communicator, so rank 0's shorter timeout is set
                // now: long enough for the registration both ranks make.
                if rank == 0 {
                    comm.set_ready_timeout(Duration::from_secs(20));
                }
                let buffer = nccl::NcclBuffer::<f32>::alloc_zeros(&stream, len).unwrap();
                let mut first = match comm.register_window(buffer, nccl::WindowFlags::DEFAULT) {
                    Ok(window) => window,
                    Err(err) if err.error().is_unsupported() => {
                        // Every rank sees the same answer (NULL window or too old).
                        skipped.store(true, std::sync::atomic::Ordering::Relaxed);
                        println!("rank {rank}: no windows on NCCL {version}: {err}");
                        return;
                    }
                    Err(err) => panic!("rank {rank}: register: {err}"),
                };
                stream.memcpy_htod(&inputs[rank], &mut first).unwrap();
                comm.all_reduce_in_place(&mut first, ReduceOp::Sum).unwrap();
                comm.synchronize_timeout(Duration::from_secs(60)).unwrap();
                assert_eq!(&stream.clone_dtoh(&first).unwrap(), want, "rank {rank}");
                registered.wait();
                if rank == 0 {
                    let lone = nccl::NcclBuffer::<f32>::alloc_zeros(&stream, len).unwrap();
                    let start = Instant::now();
                    let err = comm
                        .register_window(lone, nccl::WindowFlags::DEFAULT)
                        .expect_err("a registration no peer joins cannot complete")
                        .into_error();
                    println!(
                        "rank 0: lone registration after {:?}: {err}",
                        start.elapsed()
                    );
                    assert!(matches!(err, Error::Timeout { .. }), "{err}");
                    assert!(err.to_string().contains("aborted"), "{err}");
                    let failure = comm.failure().expect("a failure is recorded");
                    assert!(failure.to_string().contains("aborted"), "{failure}");
                    // The earlier window: NCCL freed it with the communicator, so dropping it
                    // makes no call and comes back at once.
                    let start = Instant::now();
                    drop(first);
                    assert!(start.elapsed() < Duration::from_secs(5));
                    stream.synchronize().expect("stream usable after the abort");
                    drop(comm);
                    rank0_done.wait();
                } else {
                    rank0_done.wait();
                    drop(first);
                    drop(comm);
                }
            });
        }
    });
    if skipped.load(std::sync::atomic::Ordering::Relaxed) {
        common::shape::skip(TEST, &format!("NCCL {version} registers no windows here"));
    } else {
        common::shape::ran(TEST, &format!("NCCL {version}, {n} ranks"));
    }
}

/// C3 for split: a nonblocking split only rank 0 makes stays in progress; when its timeout
/// runs out the parent must be aborted (before the fix it was left in progress). The parent
/// first does a checked all-reduce, so the communicator is known to work before.
#[test]
#[ignore = "needs CUDA GPUs"]
fn c3_timed_out_nonblocking_split_aborts_the_parent() {
    const TEST: &str = "c3_timed_out_nonblocking_split_aborts_the_parent";
    let Some(_deadline) = common::threaded::gpu_test(TEST, Duration::from_secs(240)) else {
        return;
    };
    let devices = common::threaded::devices();
    let n = devices.len();
    let id = UniqueId::new().unwrap();
    let rank0_done = Barrier::new(n);
    let len = 1024;
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| random(57 + r as u64, len)).collect();
    let want: Vec<f32> = (0..len)
        .map(|i| inputs.iter().map(|x| x[i]).sum())
        .collect();
    std::thread::scope(|scope| {
        for rank in 0..n {
            let (id, rank0_done, devices, inputs, want) =
                (&id, &rank0_done, &devices, &inputs, &want);
            scope.spawn(move || {
                let stream = stream_on(devices[rank]);
                let config = CommConfig::new()
                    .blocking(false)
                    .ready_timeout(Duration::from_secs(120));
                let mut comm = Comm::init_rank_with_config(stream.clone(), id, rank, n, &config)
                    .unwrap_or_else(|e| panic!("rank {rank}: init: {e}"));
                let mut buf: CudaSlice<f32> = stream.clone_htod(&inputs[rank]).unwrap();
                comm.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
                comm.synchronize_timeout(Duration::from_secs(60)).unwrap();
                assert_eq!(&stream.clone_dtoh(&buf).unwrap(), want, "rank {rank}");
                if rank == 0 {
                    // The child's timeout is the parent's (no config given).
                    comm.set_ready_timeout(Duration::from_secs(3));
                    let err = comm
                        .split(Some(0), 0)
                        .expect_err("a lone split cannot complete");
                    println!("rank 0: lone split: {err}");
                    assert!(matches!(err, Error::Timeout { .. }), "{err}");
                    assert!(err.to_string().contains("aborted"), "{err}");
                    assert!(comm.failure().is_some(), "a failure is recorded");
                    stream.synchronize().expect("stream usable after the abort");
                    drop(comm);
                    rank0_done.wait();
                } else {
                    rank0_done.wait();
                    drop(comm);
                }
            });
        }
    });
    common::shape::ran(TEST, &format!("{n} ranks"));
}

/// How rank 0 leaves its lone all-reduce on the side stream, and how every rank then ends
/// the communicator, in [`side_stream_kernel_case`].
#[derive(Debug, Clone, Copy, PartialEq)]
enum SideStreamEnd {
    /// `Comm::enqueue_on`, then `drop`.
    Drop,
    /// `Group::enqueue_on`, then `drop`.
    DropAfterGroup,
    /// `Comm::enqueue_on`, then `destroy()`: rank 0's fails (given back), then `abort()`.
    Destroy,
}

/// Polls `event` until it completes, for at most `limit`; whether it did.
fn completes_within(event: &cudarc::driver::CudaEvent, limit: Duration) -> bool {
    let start = Instant::now();
    loop {
        if event.try_is_complete().expect("event query") {
            return true;
        }
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The child of [`side_stream_kernel_case`]: `rank,n,id,end`.
const SIDE_CHILD_ENV: &str = "NCCL_RS_SIDE_STREAM_CHILD";

/// The program, one process per rank (as it was found: separate processes, so no
/// rank's end waits for another's in NCCL's in-process clean-up): a split communicator, a
/// matched all-reduce on a side stream, then on rank 0 alone an all-reduce no peer matches,
/// and every rank ends its communicator (`end`) with a 3 s drop timeout. Rank 0's end must
/// take about the timeout, and its side stream must then complete: the kernel was stopped.
fn side_stream_kernel_case(test: &'static str, end: SideStreamEnd) {
    let Some(layout) = processes(test, &[Shape::Gpus, Shape::Shared, Shape::Hosts], 2) else {
        return;
    };
    let n = layout.size();
    let id = UniqueId::new().unwrap();
    let ranks: Vec<usize> = (0..n).collect();
    let children = Children::spawn("child_side_stream_kernel", &ranks, |rank| {
        let mut vars = layout.env(rank);
        vars.push(var(SIDE_CHILD_ENV, format!("{rank},{n},{id},{end:?}")));
        vars
    });
    let lines = children.finish(Duration::from_secs(120));
    let took = fields(&lines, "ENDED", "took_ms");
    let freed = fields(&lines, "FREED", "rank");
    let timeout = SIDE_DROP_TIMEOUT.as_millis();
    assert_eq!(took.len(), n, "{end:?}: every rank ends: {took:?}");
    assert_eq!(
        freed,
        vec![(0, 0)],
        "{end:?}: rank 0's side stream completes: {lines:?}"
    );
    for &(rank, ms) in &took {
        assert!(
            ms < timeout + 3000,
            "{end:?}: rank {rank} ended after {ms} ms, well past its drop timeout"
        );
        if rank == 0 {
            assert!(
                ms >= timeout,
                "{end:?}: rank 0 ended after {ms} ms, before its timeout"
            );
        }
    }
}

/// The drop timeout of [`side_stream_kernel_case`].
const SIDE_DROP_TIMEOUT: Duration = Duration::from_secs(3);

#[test]
#[ignore = "child process of the side-stream tests"]
fn child_side_stream_kernel() {
    let Ok(spec) = std::env::var(SIDE_CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split(',').collect();
    let (rank, n): (usize, usize) = (parts[0].parse().unwrap(), parts[1].parse().unwrap());
    let id: UniqueId = parts[2].parse().unwrap();
    let end = match parts[3] {
        "Drop" => SideStreamEnd::Drop,
        "DropAfterGroup" => SideStreamEnd::DropAfterGroup,
        _ => SideStreamEnd::Destroy,
    };
    let timeout = SIDE_DROP_TIMEOUT;
    let len = 1 << 18;
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| random(300 + r as u64, len)).collect();
    let want: Vec<f32> = (0..len)
        .map(|i| inputs.iter().map(|x| x[i]).sum())
        .collect();
    let stream = stream_on(common::shape::child_device(rank));
    let parent = Comm::init_rank(stream.clone(), &id, rank, n)
        .unwrap_or_else(|e| panic!("rank {rank}: init: {e}"));
    let mut child = parent
        .split(Some(0), rank as i32)
        .unwrap_or_else(|e| panic!("rank {rank}: split: {e}"))
        .expect("every rank has a color");
    child.set_drop_timeout(timeout);
    let side = stream.context().new_stream().unwrap();
    // One matched all-reduce on the side stream, waited for through the communicator (every
    // stream it used) and checked.
    let mut buf: CudaSlice<f32> = side.clone_htod(&inputs[rank]).unwrap();
    child
        .enqueue_on(
            &side,
            Operation::all_reduce_in_place(&mut buf, ReduceOp::Sum),
        )
        .unwrap();
    child
        .synchronize_all_timeout(Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("rank {rank}: matched all-reduce: {e}"));
    assert_eq!(side.clone_dtoh(&buf).unwrap(), want, "rank {rank}");
    // Rank 0 alone: an all-reduce no peer matches, on the side stream.
    let hung = (rank == 0).then(|| {
        let mut lone: CudaSlice<f32> = side.clone_htod(&inputs[0]).unwrap();
        let op = Operation::all_reduce_in_place(&mut lone, ReduceOp::Sum);
        match end {
            SideStreamEnd::DropAfterGroup => {
                let mut group = Group::start().unwrap();
                group.enqueue_on(&child, &side, op).unwrap();
                group.finish().unwrap();
            }
            SideStreamEnd::Drop | SideStreamEnd::Destroy => child.enqueue_on(&side, op).unwrap(),
        }
        let after = side.record_event(None).unwrap();
        // The kernel really waits, while the communicator's own stream is idle.
        assert!(
            !completes_within(&after, Duration::from_secs(1)),
            "the lone all-reduce completed"
        );
        child
            .synchronize_timeout(Duration::from_secs(10))
            .expect("the communicator's own stream is idle");
        let err = child
            .synchronize_all_timeout(Duration::from_millis(200))
            .expect_err("the side stream is busy");
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        (after, lone)
    });
    // Rank 0 ends first, then every rank meets on the parent communicator, and only then do
    // the others end theirs: over the network (simulated hosts) a peer's end closes its
    // connections, which rank 0 would otherwise see as a remote error before its own end.
    let end_child = |child: Comm| {
        let start = Instant::now();
        match end {
            SideStreamEnd::Drop | SideStreamEnd::DropAfterGroup => drop(child),
            // Rank 0's destroy refuses (its kernel runs), and it aborts. The other ranks
            // drop: their plain `destroy()` would wait in NCCL for rank 0's orderly destroy,
            // which never comes (seen on 4xH100, NCCL 2.32.3: killed after 120 s; see
            // Comm::destroy).
            SideStreamEnd::Destroy if rank != 0 => drop(child),
            SideStreamEnd::Destroy => match child.destroy() {
                Ok(()) => panic!("rank 0's destroy must refuse"),
                Err((back, err)) => {
                    assert!(matches!(err, Error::Timeout { .. }), "{err}");
                    assert!(err.to_string().contains("streams of rank 0"), "{err}");
                    back.abort().expect("abort after the refused destroy");
                }
            },
        }
        start.elapsed()
    };
    let meet = || {
        let mut one = stream.clone_htod(&[1.0f32]).unwrap();
        parent
            .all_reduce_in_place(&mut one, ReduceOp::Sum)
            .and_then(|()| parent.synchronize_timeout(Duration::from_secs(60)))
            .unwrap_or_else(|e| panic!("rank {rank}: meeting on the parent: {e}"));
    };
    if let Some((after, lone)) = hung {
        let took = end_child(child);
        println!("ENDED rank={rank} took_ms={} end={end:?}", took.as_millis());
        // Rank 0's side stream: free within seconds once its kernel is stopped.
        if completes_within(&after, Duration::from_secs(10)) {
            println!("FREED rank=0");
            drop(lone);
        } else {
            // Still in use by the kernel: never freed under it.
            std::mem::forget(lone);
            println!("STILL_BUSY rank=0 after 10 s");
        }
        meet();
    } else {
        meet();
        let took = end_child(child);
        println!("ENDED rank={rank} took_ms={} end={end:?}", took.as_millis());
    }
    drop(parent);
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn drop_aborts_a_kernel_left_on_a_side_stream() {
    const TEST: &str = "drop_aborts_a_kernel_left_on_a_side_stream";
    side_stream_kernel_case(TEST, SideStreamEnd::Drop);
    side_stream_kernel_case(TEST, SideStreamEnd::DropAfterGroup);
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn destroy_refuses_while_a_kernel_runs_on_a_side_stream() {
    side_stream_kernel_case(
        "destroy_refuses_while_a_kernel_runs_on_a_side_stream",
        SideStreamEnd::Destroy,
    );
}
