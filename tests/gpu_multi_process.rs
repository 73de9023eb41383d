//! One process per rank, as under mpirun: the test re-executes its own binary once per rank,
//! passing the unique id as hex in the environment. N = every GPU present (N >= 2); on a
//! one-GPU host two ranks share GPU 0 as one LSA team (NCCL 2.30+), else three simulated
//! hosts share it over NCCL's socket transport (see `common::shape`).
//!
//! Run on a GPU host with `cargo test --test gpu_multi_process -- --include-ignored`.

mod common;

use std::time::Duration;

use cudarc::driver::{CudaContext, CudaSlice};
use nccl::{Comm, PreMulSum, ReduceOp, UniqueId};

use common::procs::{fields, var, Children};
use common::shape::{child_device, processes, Shape};
use common::{run_all_types, Ranks};

const CHILD_ENV: &str = "NCCL_RS_TEST_CHILD";

/// Starts one child per rank running `test`, waits (bounded) for all of them, and checks that
/// every rank printed `DONE rank=...` (a child that found no marker would pass doing nothing).
fn run_children(parent: &str, test: &str) {
    let Some(layout) = processes(parent, &[Shape::Gpus, Shape::Shared, Shape::Hosts], 3) else {
        return;
    };
    let size = layout.size();
    let id = UniqueId::new().expect("ncclGetUniqueId");
    let ranks: Vec<usize> = (0..size).collect();
    let children = Children::spawn(test, &ranks, |rank| {
        let mut vars = layout.env(rank);
        vars.push(var(CHILD_ENV, format!("{rank},{size},{id}")));
        vars
    });
    let lines = children.finish(Duration::from_secs(600));
    let mut done: Vec<usize> = fields(&lines, "DONE", "rank")
        .into_iter()
        .map(|(_, rank)| rank as usize)
        .collect();
    done.sort_unstable();
    assert_eq!(done, ranks, "{test}: ranks that finished");
}

/// In a child: this rank's communicator; `None` when not started as a child.
fn child_comm() -> Option<Comm> {
    let spec = std::env::var(CHILD_ENV).ok()?;
    let mut parts = spec.splitn(3, ',');
    let rank: usize = parts.next()?.parse().ok()?;
    let size: usize = parts.next()?.parse().ok()?;
    let id: UniqueId = parts.next()?.parse().expect("id hex");
    let device = child_device(rank);
    let stream = CudaContext::new(device)
        .and_then(|ctx| ctx.new_stream())
        .unwrap_or_else(|e| panic!("rank {rank}: a stream on GPU {device}: {e}"));
    let comm = Comm::init_rank(stream, &id, rank, size)
        .unwrap_or_else(|e| panic!("rank {rank}: ncclCommInitRank: {e}"));
    assert_eq!(
        (comm.rank(), comm.size(), comm.device()),
        (rank, size, device)
    );
    Some(comm)
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn every_collective_type_and_op_one_process_per_gpu() {
    run_children(
        "every_collective_type_and_op_one_process_per_gpu",
        "child_full_matrix",
    );
}

#[test]
#[ignore = "child process of every_collective_type_and_op_one_process_per_gpu"]
fn child_full_matrix() {
    let Some(comm) = child_comm() else { return };
    let size = comm.size();
    let ranks = Ranks {
        comms: vec![comm],
        size,
    };
    let checked = run_all_types(&ranks, 129);
    let rank = ranks.comms[0].rank();
    println!(
        "rank {rank} of {size} (NCCL {}): {checked} buffers checked against the host",
        nccl::version().unwrap()
    );
    assert!(checked > 200, "rank {rank}: only {checked} buffers checked");
    println!("DONE rank={rank} checked={checked}");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn split_premulsum_device_scalar_and_orderly_shutdown() {
    run_children(
        "split_premulsum_device_scalar_and_orderly_shutdown",
        "child_split_and_shutdown",
    );
}

#[test]
#[ignore = "child process of split_premulsum_device_scalar_and_orderly_shutdown"]
fn child_split_and_shutdown() {
    let Some(comm) = child_comm() else { return };
    let (rank, size) = (comm.rank(), comm.size());
    let stream = comm.stream().clone();

    // Split into even and odd ranks and reduce in each half.
    let half = comm
        .split(Some((rank % 2) as u32), rank as i32)
        .unwrap()
        .unwrap();
    assert_eq!(half.rank(), rank / 2);
    let mut buf: CudaSlice<i32> = stream.clone_htod(&vec![rank as i32 + 1; 100]).unwrap();
    half.all_reduce_in_place(&mut buf, ReduceOp::Sum).unwrap();
    half.synchronize_timeout(Duration::from_secs(60)).unwrap();
    let want: i32 = (0..size)
        .filter(|q| q % 2 == rank % 2)
        .map(|q| q as i32 + 1)
        .sum();
    let got = stream.clone_dtoh(&buf).unwrap();
    assert!(
        got.iter().all(|&v| v == want),
        "rank {rank}: half all-reduce gave {:?}..., want {want}",
        &got[..4]
    );
    // A rank without color gets no communicator.
    let none = comm.split((rank != 0).then_some(0), 0).unwrap();
    assert_eq!(none.is_none(), rank == 0);
    if let Some(rest) = none {
        assert_eq!(rest.size(), size - 1);
        rest.finalize().unwrap();
        rest.destroy().unwrap();
    }

    // PreMulSum with a device scalar: average by multiplying with 1/size on the device.
    let scalar: CudaSlice<f64> = stream.clone_htod(&[1.0 / size as f64]).unwrap();
    let avg = PreMulSum::with_device_scalar(&comm, &scalar).unwrap();
    let data: Vec<f64> = (0..1000).map(|i| (i * (rank + 1)) as f64).collect();
    let send = stream.clone_htod(&data).unwrap();
    let mut recv: CudaSlice<f64> = stream.alloc_zeros(1000).unwrap();
    comm.all_reduce(&send, &mut recv, &avg).unwrap();
    drop(avg);
    comm.synchronize_timeout(Duration::from_secs(60)).unwrap();
    let got = stream.clone_dtoh(&recv).unwrap();
    let ranks_sum: f64 = (1..=size).map(|r| r as f64).sum();
    for (i, v) in got.iter().enumerate() {
        let want = i as f64 * ranks_sum / size as f64;
        assert!(
            (v - want).abs() <= 1e-9 * want.abs().max(1.0),
            "rank {rank}: PreMulSum average, element {i}: {v} != {want}"
        );
    }

    // Orderly shutdown: every rank finalizes, then destroys.
    half.finalize().unwrap();
    half.destroy().unwrap();
    comm.finalize().unwrap();
    comm.destroy().unwrap();
    println!("DONE rank={rank}");
}
