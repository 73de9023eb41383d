//! One process driving every visible GPU (N >= 2), or two ranks sharing GPU 0 on a one-GPU
//! host (NCCL 2.30+, see `common::shape`): `Comm::init_all` and `Group`.
//!
//! Run on a GPU host with `cargo test --test gpu_single_process -- --include-ignored`.

mod common;

use std::time::Duration;

use cudarc::driver::CudaSlice;
use nccl::{Comm, Error, Group, Operation, ReduceOp};

use common::{run_all_types, Ranks};

/// One communicator per rank from `Comm::init_all`: every visible GPU, or GPU 0 twice on a
/// one-GPU host (NCCL 2.30+); `None` (the test is skipped, saying why) where neither works.
fn all_gpus(test: &str) -> Option<Ranks> {
    let layout = common::shape::threaded(test)?;
    let comms = Comm::init_all(&layout.streams()).expect("ncclCommInitAll");
    for (i, comm) in comms.iter().enumerate() {
        assert_eq!(comm.rank(), i);
        assert_eq!(comm.size(), layout.size());
        assert_eq!(comm.device(), layout.devices[i]);
    }
    Some(Ranks {
        comms,
        size: layout.size(),
    })
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn every_collective_type_and_op_single_process() {
    let Some(ranks) = all_gpus("every_collective_type_and_op_single_process") else {
        return;
    };
    println!(
        "NCCL {} from {}",
        ranks.comms[0].library().version(),
        ranks.comms[0].library().path().display()
    );
    let checked = run_all_types(&ranks, 257);
    println!(
        "single process, {} ranks: {checked} buffers checked against the host",
        ranks.size
    );
    assert!(checked > 500, "only {checked} buffers checked");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn invalid_calls_are_rejected_and_leave_the_group_usable() {
    let Some(ranks) = all_gpus("invalid_calls_are_rejected_and_leave_the_group_usable") else {
        return;
    };
    let n = ranks.size;
    let s0 = ranks.stream(0).clone();
    let s1 = ranks.stream(1).clone();
    let a: CudaSlice<f32> = s0.clone_htod(&vec![1.0f32; 16]).unwrap();
    let mut short: CudaSlice<f32> = s0.alloc_zeros(15).unwrap();
    // Length mismatch: rejected before NCCL sees it.
    let err = ranks.comms[0]
        .all_reduce(&a, &mut short, ReduceOp::Sum)
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    // A buffer on another GPU (where rank 1 has one of its own).
    if ranks.comms[1].device() != ranks.comms[0].device() {
        let mut other_gpu: CudaSlice<f32> = s1.alloc_zeros(16).unwrap();
        let err = ranks.comms[0]
            .all_reduce(&a, &mut other_gpu, ReduceOp::Sum)
            .unwrap_err();
        assert!(err.to_string().contains("device 1"), "{err}");
    } else {
        println!("ranks share one GPU: no other device for the foreign-buffer case");
    }
    // Root out of range.
    let mut buf: CudaSlice<f32> = s0.alloc_zeros(16).unwrap();
    let err = ranks.comms[0].broadcast_in_place(&mut buf, n).unwrap_err();
    assert!(err.to_string().contains("out of range"), "{err}");
    // all_gather receive buffer too small.
    let mut small: CudaSlice<f32> = s0.alloc_zeros(16 * n - 1).unwrap();
    assert!(ranks.comms[0].all_gather(&a, &mut small).is_err());

    // Inside a group, plain calls are refused; a bad call leaves the group usable.
    let mut bufs: Vec<CudaSlice<f32>> = ranks
        .comms
        .iter()
        .enumerate()
        .map(|(i, c)| c.stream().clone_htod(&vec![(i + 1) as f32; 64]).unwrap())
        .collect();
    let mut stray: CudaSlice<f32> = s0.alloc_zeros(64).unwrap();
    {
        let mut group = Group::start().unwrap();
        assert!(Group::start().is_err(), "groups do not nest");
        let err = ranks.comms[0]
            .all_reduce_in_place(&mut stray, ReduceOp::Sum)
            .unwrap_err();
        assert!(matches!(err, Error::InvalidUsage(_)), "{err}");
        let err = group
            .enqueue(
                &ranks.comms[0],
                Operation::broadcast_in_place(&mut stray, n + 3),
            )
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)));
        for (comm, buf) in ranks.comms.iter().zip(bufs.iter_mut()) {
            group
                .enqueue(comm, Operation::all_reduce_in_place(buf, ReduceOp::Sum))
                .unwrap();
        }
        group.finish().unwrap();
    }
    ranks.sync();
    let want = (n * (n + 1) / 2) as f32;
    for (comm, buf) in ranks.comms.iter().zip(&bufs) {
        let got = comm.stream().clone_dtoh(buf).unwrap();
        assert!(
            got.iter().all(|&v| v == want),
            "rank {}: {:?}",
            comm.rank(),
            &got[..4]
        );
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn split_all_into_even_and_odd_ranks() {
    let Some(ranks) = all_gpus("split_all_into_even_and_odd_ranks") else {
        return;
    };
    let n = ranks.size;
    let colors: Vec<_> = (0..n).map(|r| Some((r % 2) as u32)).collect();
    let keys: Vec<_> = (0..n).map(|r| -(r as i32)).collect(); // reversed order inside each half
    let children = Comm::split_all(&ranks.comms, &colors, &keys).unwrap();
    let children: Vec<Comm> = children
        .into_iter()
        .map(|c| c.expect("every rank has a color"))
        .collect();
    for (r, child) in children.iter().enumerate() {
        let members = (0..n).filter(|q| q % 2 == r % 2).count();
        assert_eq!(child.size(), members, "rank {r}");
        // Keys are descending, so the highest parent rank becomes child rank 0.
        let higher_same_color = (r + 1..n).filter(|q| q % 2 == r % 2).count();
        assert_eq!(child.rank(), higher_same_color, "rank {r}");
    }
    let mut bufs: Vec<CudaSlice<i64>> = children
        .iter()
        .enumerate()
        .map(|(r, c)| {
            c.stream()
                .clone_htod(&vec![(r as i64 + 1) * 10; 33])
                .unwrap()
        })
        .collect();
    let mut group = Group::start().unwrap();
    for (child, buf) in children.iter().zip(bufs.iter_mut()) {
        group
            .enqueue(child, Operation::all_reduce_in_place(buf, ReduceOp::Sum))
            .unwrap();
    }
    group.finish().unwrap();
    for (r, (child, buf)) in children.iter().zip(&bufs).enumerate() {
        child.synchronize_timeout(Duration::from_secs(60)).unwrap();
        let want: i64 = (0..n)
            .filter(|q| q % 2 == r % 2)
            .map(|q| (q as i64 + 1) * 10)
            .sum();
        let got = child.stream().clone_dtoh(buf).unwrap();
        assert!(
            got.iter().all(|&v| v == want),
            "rank {r}: {} != {want}",
            got[0]
        );
    }
    // No color: the rank takes part but gets no communicator.
    let none = vec![None; n];
    let split = Comm::split_all(&ranks.comms, &none, &vec![0; n]).unwrap();
    assert!(split.iter().all(Option::is_none));
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn abort_then_use_is_an_error_and_drop_does_not_hang() {
    let Some(ranks) = all_gpus("abort_then_use_is_an_error_and_drop_does_not_hang") else {
        return;
    };
    let mut comms = ranks.comms;
    assert!(comms[0].async_error().unwrap().is_none());
    let last = comms.pop().unwrap();
    last.abort().unwrap();
    // The others are dropped (abort after a bounded wait) without hanging.
    let start = std::time::Instant::now();
    drop(comms);
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn nccl_memory_registered_all_reduce() {
    use nccl::NcclBuffer;
    let Some(ranks) = all_gpus("nccl_memory_registered_all_reduce") else {
        return;
    };
    let n = ranks.size;
    let len = 1 << 16;
    let mut bufs: Vec<NcclBuffer<f32>> = ranks
        .comms
        .iter()
        .map(|c| NcclBuffer::alloc_zeros(c.stream(), len).unwrap())
        .collect();
    for (r, (comm, buf)) in ranks.comms.iter().zip(bufs.iter_mut()).enumerate() {
        let data: Vec<f32> = (0..len).map(|i| (r * 3 + i % 11) as f32).collect();
        comm.stream().memcpy_htod(&data, buf).unwrap();
    }
    {
        let mut registrations: Vec<_> = ranks
            .comms
            .iter()
            .zip(bufs.iter_mut())
            .map(|(comm, buf)| comm.register(buf).unwrap())
            .collect();
        assert_eq!(registrations.len(), n);
        let mut outs: Vec<CudaSlice<f32>> = ranks
            .comms
            .iter()
            .map(|c| c.stream().alloc_zeros(len).unwrap())
            .collect();
        // A registered buffer as the send buffer...
        let mut group = Group::start().unwrap();
        for ((comm, reg), out) in ranks.comms.iter().zip(&registrations).zip(outs.iter_mut()) {
            group
                .enqueue(comm, Operation::all_reduce(reg, out, ReduceOp::Sum))
                .unwrap();
        }
        group.finish().unwrap();
        ranks.sync();
        let want = |i: usize| -> f32 { (0..n).map(|r| (r * 3 + i % 11) as f32).sum() };
        for (comm, out) in ranks.comms.iter().zip(&outs) {
            let got = comm.stream().clone_dtoh(out).unwrap();
            for (i, v) in got.iter().enumerate() {
                assert_eq!(*v, want(i), "rank {} element {i}", comm.rank());
            }
        }
        // ... and as the receive buffer, in place.
        let mut group = Group::start().unwrap();
        for (comm, reg) in ranks.comms.iter().zip(registrations.iter_mut()) {
            group
                .enqueue(comm, Operation::all_reduce_in_place(reg, ReduceOp::Max))
                .unwrap();
        }
        group.finish().unwrap();
        ranks.sync();
        for (comm, reg) in ranks.comms.iter().zip(&registrations) {
            let got = comm.stream().clone_dtoh(reg).unwrap();
            for (i, v) in got.iter().enumerate() {
                let max = ((n - 1) * 3 + i % 11) as f32;
                assert_eq!(*v, max, "in place, rank {} element {i}", comm.rank());
            }
        }
        for registration in registrations {
            registration
                .deregister()
                .unwrap_or_else(|(_, err)| panic!("deregister: {err}"));
        }
    }
}

/// Tells the child of [`ranks_sharing_a_gpu_with_lazy_loading_are_refused_before_nccl`] the
/// loading mode it was started with.
const LAZY_CHILD_VAR: &str = "NCCL_RS_TEST_LAZY_CHILD";

/// Two ranks of one process on one GPU share a CUDA context: with lazily loaded kernels a
/// kernel's first use can wait for the other rank's collective (hung on one H200), so
/// `init_all` refuses them, typed, before NCCL is called; eagerly it makes them. Each mode in
/// a child process of its own (the driver reads `CUDA_MODULE_LOADING` once).
#[test]
#[ignore = "needs CUDA GPUs"]
fn ranks_sharing_a_gpu_with_lazy_loading_are_refused_before_nccl() {
    const TEST: &str = "ranks_sharing_a_gpu_with_lazy_loading_are_refused_before_nccl";
    if common::shape::gpus(TEST, 1).is_none() {
        return;
    }
    let version = nccl::version().expect("NCCL loads");
    if version < common::shape::SHARED_SINCE {
        common::shape::skip(
            TEST,
            &format!(
                "ranks sharing a GPU need NCCL {}+, loaded {version}",
                common::shape::SHARED_SINCE
            ),
        );
        return;
    }
    for mode in ["LAZY", "EAGER"] {
        let children = common::procs::Children::spawn("child_lazy_loading", &[0], |_| {
            vec![
                common::procs::var(LAZY_CHILD_VAR, mode),
                common::procs::var("CUDA_MODULE_LOADING", mode),
                common::procs::var("NCCL_MULTI_RANK_GPU_ENABLE", 1),
                common::procs::var("NCCL_RUNTIME_CONNECT", 0),
            ]
        });
        let lines = children.finish(Duration::from_secs(120));
        let verdict = lines
            .iter()
            // After the harness's own "test child_lazy_loading ... " on the same line.
            .find_map(|(_, line)| line.split_once("VERDICT ").map(|(_, verdict)| verdict))
            .unwrap_or_else(|| panic!("{mode}: the child printed no verdict"));
        println!("CUDA_MODULE_LOADING={mode}: {verdict}");
        match mode {
            "LAZY" => assert!(
                verdict.starts_with("refused") && verdict.contains("CUDA_MODULE_LOADING=EAGER"),
                "{verdict}"
            ),
            _ => assert!(verdict.starts_with("made"), "{verdict}"),
        }
    }
}

#[test]
#[ignore = "child process of ranks_sharing_a_gpu_with_lazy_loading_are_refused_before_nccl"]
fn child_lazy_loading() {
    let Ok(mode) = std::env::var(LAZY_CHILD_VAR) else {
        return;
    };
    let streams: Vec<_> = (0..2)
        .map(|_| {
            cudarc::driver::CudaContext::new(0)
                .and_then(|ctx| ctx.new_stream())
                .expect("a stream on GPU 0")
        })
        .collect();
    match Comm::init_all(&streams) {
        Err(Error::InvalidArgument(reason)) => println!("VERDICT refused: {reason}"),
        Err(other) => panic!("{mode}: an unexpected error: {other}"),
        Ok(comms) => {
            // They work: a sum over both ranks of random data, against the host's.
            let op = common::Op::Builtin(ReduceOp::Sum);
            let data: Vec<Vec<f32>> = (0..2)
                .map(|r| common::input::<f32>(Some(op), 7 + r, 1024))
                .collect();
            let want = common::reduce_ref(op, &data);
            let mut bufs: Vec<CudaSlice<f32>> = streams
                .iter()
                .zip(&data)
                .map(|(s, d)| s.clone_htod(d).unwrap())
                .collect();
            let mut group = Group::start().unwrap();
            for (comm, buf) in comms.iter().zip(bufs.iter_mut()) {
                group
                    .enqueue(comm, Operation::all_reduce_in_place(buf, ReduceOp::Sum))
                    .unwrap();
            }
            group.finish().unwrap();
            for (s, buf) in streams.iter().zip(&bufs) {
                let got = s.clone_dtoh(buf).unwrap();
                common::assert_close(&format!("{mode}: the sum"), &got, &want);
            }
            println!("VERDICT made {} ranks on GPU 0, sums right", comms.len());
        }
    }
}
