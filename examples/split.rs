//! Sub-communicators: split the ranks into even and odd, and reduce within each half.
//!
//! Every rank contributes its parent rank; within the even half the sum is the sum of the even
//! ranks, within the odd half that of the odd ones. Ranks are ordered inside each half by
//! descending parent rank (the split key), to show that keys, not parent ranks, decide.
//!
//! ```text
//! cargo run --release --example split
//! mpirun --allow-run-as-root -np 4 target/release/examples/split
//! ```

use std::process::ExitCode;

use nccl::bootstrap::spawn_local;
use nccl::ReduceOp;

fn run() -> nccl::Result<()> {
    let gpus = nccl::library::cuda_device_count()?;
    let job = spawn_local(gpus)?;
    let (world, stream) = job.init_comm()?;
    let (rank, n) = (world.rank(), world.size());

    let color = (rank % 2) as u32;
    let half = world
        .split(Some(color), -(rank as i32))?
        .ok_or_else(|| nccl::Error::InvalidUsage("a colored rank got no communicator".into()))?;
    let members: Vec<usize> = (0..n).filter(|r| r % 2 == rank % 2).collect();
    let expected_rank = members.iter().filter(|&&r| r > rank).count();
    if half.size() != members.len() || half.rank() != expected_rank {
        return Err(nccl::Error::InvalidUsage(format!(
            "rank {rank}: expected rank {expected_rank} of {}, got {} of {}",
            members.len(),
            half.rank(),
            half.size()
        )));
    }

    let mut value = stream.clone_htod(&vec![rank as i64; 1024])?;
    half.all_reduce_in_place(&mut value, ReduceOp::Sum)?;
    half.synchronize()?;
    let want: i64 = members.iter().map(|&r| r as i64).sum();
    let got = stream.clone_dtoh(&value)?;
    if got.iter().any(|&v| v != want) {
        return Err(nccl::Error::InvalidUsage(format!(
            "rank {rank}: sum in the {} half is {}, expected {want}",
            if color == 0 { "even" } else { "odd" },
            got[0]
        )));
    }
    println!(
        "rank {rank}/{n} -> {} half rank {}/{}: sum {want} verified",
        if color == 0 { "even" } else { "odd" },
        half.rank(),
        half.size()
    );

    // Orderly shutdown, children first: every rank takes part.
    half.finalize()?;
    half.destroy()?;
    world.finalize()?;
    world.destroy()?;
    job.wait()?;
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("split: {err}");
            ExitCode::FAILURE
        }
    }
}
