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
use nccl::{Collective, Group};

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

    let start = Instant::now();
    for step in 1..=n {
        let mut group = Group::start()?;
        group.enqueue(&comm, Collective::send(&current, next))?;
        group.enqueue(&comm, Collective::recv(&mut incoming, prev))?;
        group.finish()?;
        std::mem::swap(&mut current, &mut incoming);
        // After `step` steps this rank holds the block of rank - step.
        if step == 1 || step == n {
            comm.synchronize()?;
            let origin = (rank + n * step - step) % n;
            if stream.clone_dtoh(&current)? != block(origin) {
                return Err(nccl::Error::InvalidUsage(format!(
                    "rank {rank}: after {step} steps the block is not rank {origin}'s"
                )));
            }
        }
    }
    comm.synchronize()?;
    let per_step = start.elapsed().as_secs_f64() / n as f64;
    println!(
        "rank {rank}/{n}: ring of {n} steps verified; {:.1} us per step, {:.1} GB/s per link",
        per_step * 1e6,
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
