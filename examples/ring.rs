//! Point-to-point: pass every rank's block once around the ring with `send`/`recv`.
//!
//! Each step, every rank sends its current block to the next rank and receives the previous
//! rank's block, both in one group (a send and the receive it depends on must progress
//! together). After `n` steps every block is back where it started.
//!
//! ```text
//! cargo run --release --example ring
//! mpirun --allow-run-as-root -np 4 target/release/examples/ring
//! ```

use std::process::ExitCode;
use std::time::Instant;

use nccl::bootstrap::spawn_local;
use nccl::{Group, Operation};

const ELEMENTS: usize = 1 << 20;

fn run() -> nccl::Result<()> {
    let gpus = nccl::library::cuda_device_count()?;
    let job = spawn_local(gpus)?;
    let (comm, stream) = job.init_comm()?;
    let (rank, n) = (comm.rank(), comm.size());
    let next = (rank + 1) % n;
    let prev = (rank + n - 1) % n;

    // Block of rank r: r * 1_000_000 + i, distinct everywhere.
    let block = |r: usize| -> Vec<u64> {
        (0..ELEMENTS as u64)
            .map(|i| r as u64 * 1_000_000 + i)
            .collect()
    };
    let mut current = stream.clone_htod(&block(rank))?;
    let mut incoming = stream.alloc_zeros::<u64>(ELEMENTS)?;

    // One pass around the ring: each step sends the current block on and receives the
    // previous rank's; after `n` steps every block is home again.
    let pass = |current: &mut cudarc::driver::CudaSlice<u64>,
                incoming: &mut cudarc::driver::CudaSlice<u64>|
     -> nccl::Result<()> {
        for _ in 0..n {
            let mut group = Group::start()?;
            group.enqueue(&comm, Operation::send(&*current, next))?;
            group.enqueue(&comm, Operation::recv(&mut *incoming, prev))?;
            group.finish()?;
            std::mem::swap(current, incoming);
        }
        Ok(())
    };

    // Check one step: this rank now holds its predecessor's block.
    let mut group = Group::start()?;
    group.enqueue(&comm, Operation::send(&current, next))?;
    group.enqueue(&comm, Operation::recv(&mut incoming, prev))?;
    group.finish()?;
    comm.synchronize()?;
    if stream.clone_dtoh(&incoming)? != block(prev) {
        return Err(nccl::Error::InvalidUsage(format!(
            "rank {rank}: after one step the block is not rank {prev}'s"
        )));
    }
    // A full pass (which also warms up the connections), then timed passes.
    pass(&mut current, &mut incoming)?;
    comm.synchronize()?;
    if stream.clone_dtoh(&current)? != block(rank) {
        return Err(nccl::Error::InvalidUsage(format!(
            "rank {rank}: after a full pass the block is not back home"
        )));
    }
    let passes = 10;
    let start = Instant::now();
    for _ in 0..passes {
        pass(&mut current, &mut incoming)?;
    }
    comm.synchronize()?;
    let per_step = start.elapsed().as_secs_f64() / (passes * n) as f64;
    if stream.clone_dtoh(&current)? != block(rank) {
        return Err(nccl::Error::InvalidUsage(format!(
            "rank {rank}: after {passes} timed passes the block is not back home"
        )));
    }
    println!(
        "rank {rank}/{n}: ring verified; {:.1} us per step ({} KiB to the next rank), {:.1} GB/s",
        per_step * 1e6,
        ELEMENTS * 8 / 1024,
        (ELEMENTS * 8) as f64 / per_step / 1e9
    );
    drop(comm);
    job.wait()?;
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("ring: {err}");
            ExitCode::FAILURE
        }
    }
}
