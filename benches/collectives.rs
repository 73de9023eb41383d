//! Bandwidth of all-reduce, all-gather, reduce-scatter, broadcast and send/receive from 8 B to
//! 1 GiB, one process driving every local GPU through a `Group` (`Comm::init_all`).
//!
//! ```text
//! cargo bench --bench collectives                     # everything, a few minutes on 4 GPUs
//! cargo bench --bench collectives -- all_reduce       # criterion's filter
//! NCCL_RS_BENCH_GPUS=2 cargo bench --bench collectives
//! ```
//!
//! The size of a benchmark is nccl-tests' "size", the bytes of the whole buffer: each rank's
//! buffer for all-reduce, broadcast and send/receive; the receive buffer of all-gather (each
//! rank sends size/n); the send buffer of reduce-scatter (each rank receives size/n). Elements
//! are `f32`; reductions sum. Criterion's throughput is that size per operation (algbw); after
//! each benchmark a line gives time, algbw and busbw from the mean of criterion's samples,
//! with nccl-tests' definitions (busbw = algbw × 2(n−1)/n for all-reduce, × (n−1)/n for
//! all-gather and reduce-scatter, × 1 for broadcast and send/receive), and a table of busbw
//! closes the run.
//!
//! Each timed sample issues its iterations back to back (one group call per iteration: one
//! operation on every GPU) and then waits until every stream is idle, nccl-tests' method.
//! Communicator setup, buffer allocation and a warm-up of every size happen outside the timed
//! region. Without GPUs or NCCL the bench prints why and exits successfully.

mod common;

use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DevicePtr};
use nccl::{Group, Operation, ReduceOp};

use common::{fail, wait_all, Gpus, Samples};

/// The operations benchmarked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    SendRecv,
}

impl Op {
    const ALL: [Op; 5] = [
        Op::AllReduce,
        Op::AllGather,
        Op::ReduceScatter,
        Op::Broadcast,
        Op::SendRecv,
    ];

    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
            Op::SendRecv => "send_recv",
        }
    }

    /// `(send elements, receive elements, bytes)` per rank for a size of `bytes`, or `None`
    /// when the size leaves no element per rank.
    fn lengths(self, bytes: u64, n: usize) -> Option<(usize, usize, u64)> {
        let elements = (bytes / 4) as usize;
        let per_rank = elements / n;
        let (send, recv) = match self {
            Op::AllReduce | Op::Broadcast | Op::SendRecv => (elements, elements),
            Op::AllGather => (per_rank, per_rank * n),
            Op::ReduceScatter => (per_rank * n, per_rank),
        };
        let total = send.max(recv);
        (send > 0 && recv > 0).then_some((send, recv, total as u64 * 4))
    }

    /// Issues the operation on every GPU, in one group.
    fn issue(
        self,
        gpus: &Gpus,
        sends: &[CudaView<'_, f32>],
        recvs: &mut [CudaViewMut<'_, f32>],
    ) -> nccl::Result<()> {
        let n = gpus.len();
        let mut group = Group::start()?;
        for (i, (comm, recv)) in gpus.comms.iter().zip(recvs.iter_mut()).enumerate() {
            let send = &sends[i];
            match self {
                Op::AllReduce => {
                    group.enqueue(comm, Operation::all_reduce(send, recv, ReduceOp::Sum))?
                }
                Op::AllGather => group.enqueue(comm, Operation::all_gather(send, recv))?,
                Op::ReduceScatter => {
                    group.enqueue(comm, Operation::reduce_scatter(send, recv, ReduceOp::Sum))?
                }
                Op::Broadcast => group.enqueue(
                    comm,
                    Operation::broadcast(Some(send as &dyn DevicePtr<f32>), recv, 0),
                )?,
                Op::SendRecv => {
                    group.enqueue(comm, Operation::send(send, (i + 1) % n))?;
                    group.enqueue(comm, Operation::recv(recv, (i + n - 1) % n))?;
                }
            }
        }
        group.finish()
    }
}

/// 8 B, then 16 B × 4^k up to `max` (1 GiB by default).
fn sizes(max: u64) -> Vec<u64> {
    let mut sizes = vec![8];
    let mut size = 16;
    while size <= max {
        sizes.push(size);
        size *= 4;
    }
    sizes
}

fn max_bytes(gpus: &Gpus) -> u64 {
    let wanted = std::env::var("NCCL_RS_BENCH_MAX_BYTES")
        .ok()
        .and_then(|text| text.trim().parse::<u64>().ok())
        .unwrap_or(1 << 30);
    // Two buffers per GPU, and a GiB left for NCCL and the rest.
    let memory = gpus
        .streams
        .iter()
        .filter_map(|s| s.context().total_mem().ok())
        .min()
        .unwrap_or(0) as u64;
    let limit = memory.saturating_sub(1 << 30) / 2;
    let mut max = 8;
    while max * 2 <= wanted.min(limit) {
        max *= 2;
    }
    max
}

fn main() {
    let Some(gpus) = common::setup("collectives") else {
        return;
    };
    const SAMPLES: usize = 10;
    let mut criterion = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(700))
        .sample_size(SAMPLES)
        .nresamples(10_000)
        .configure_from_args();
    let samples_taken = common::sample_size(SAMPLES);
    let n = gpus.len();
    let max = max_bytes(&gpus);
    let sizes = sizes(max);

    let elements = (max / 4) as usize;
    let alloc = |stream: &std::sync::Arc<cudarc::driver::CudaStream>| {
        stream
            .alloc_zeros::<f32>(elements)
            .unwrap_or_else(|e| fail("allocating the buffers", e))
    };
    let send_bufs: Vec<CudaSlice<f32>> = gpus.streams.iter().map(alloc).collect();
    let mut recv_bufs: Vec<CudaSlice<f32>> = gpus.streams.iter().map(alloc).collect();

    // (operation, size, busbw) for the closing table.
    let mut table: Vec<(Op, u64, f64)> = Vec::new();
    let samples = Samples::default();
    for op in Op::ALL {
        let mut group = criterion.benchmark_group(format!("{}_{n}gpu", op.name()));
        for &size in &sizes {
            let Some((send_len, recv_len, bytes)) = op.lengths(size, n) else {
                continue;
            };
            let sends: Vec<CudaView<'_, f32>> =
                send_bufs.iter().map(|b| b.slice(..send_len)).collect();
            let mut recvs: Vec<CudaViewMut<'_, f32>> = recv_bufs
                .iter_mut()
                .map(|b| b.slice_mut(..recv_len))
                .collect();
            // Warm-up outside the timed region: connections, buffers, kernels.
            for _ in 0..3 {
                op.issue(&gpus, &sends, &mut recvs)
                    .unwrap_or_else(|e| fail(op.name(), e));
            }
            wait_all(&gpus).unwrap_or_else(|e| fail(op.name(), e));

            samples.clear();
            group.throughput(Throughput::Bytes(bytes));
            group.bench_function(BenchmarkId::from_parameter(common::human(bytes)), |b| {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    for _ in 0..iters {
                        op.issue(&gpus, &sends, &mut recvs)
                            .unwrap_or_else(|e| fail(op.name(), e));
                    }
                    wait_all(&gpus).unwrap_or_else(|e| fail(op.name(), e));
                    let elapsed = start.elapsed();
                    samples.record(iters, elapsed);
                    elapsed
                })
            });
            if let Some(mean) = samples.mean(samples_taken) {
                let (algbw, busbw) = common::bandwidth(op.name(), n, bytes, mean);
                println!(
                    "{:>14} {:>8}: {:>10.2} us  algbw {:>7.2} GB/s  busbw {:>7.2} GB/s  ({n} GPUs, nccl-tests definitions)",
                    op.name(),
                    common::human(bytes),
                    mean.as_secs_f64() * 1e6,
                    algbw,
                    busbw
                );
                table.push((op, bytes, busbw));
            }
        }
        group.finish();
    }
    criterion.final_summary();
    print_table(&table, n);
}

/// busbw in GB/s: one line per size, one column per operation.
fn print_table(table: &[(Op, u64, f64)], n: usize) {
    if table.is_empty() {
        return;
    }
    let mut sizes: Vec<u64> = table.iter().map(|&(_, size, _)| size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    println!("\nbusbw (GB/s), {n} GPUs in one process, nccl-tests definitions:");
    print!("{:>8}", "size");
    for op in Op::ALL {
        print!("  {:>14}", op.name());
    }
    println!();
    for size in sizes {
        print!("{:>8}", common::human(size));
        for op in Op::ALL {
            match table.iter().find(|&&(o, s, _)| o == op && s == size) {
                Some(&(_, _, busbw)) => print!("  {busbw:>14.2}"),
                None => print!("  {:>14}", "-"),
            }
        }
        println!();
    }
}
