//! nccl-candle's collectives on real GPUs, in the shapes of nccl-rs's GPU suite: one rank
//! per visible GPU where there are 2+, else two ranks sharing GPU 0 (NCCL 2.30+), each on a
//! thread of its own with a candle device and a communicator on that device's stream
//! (`common::on_ranks`), every result checked against the host's reduction of the same
//! random (integer-valued) data. What ran and what was skipped (and why) is said on stderr
//! and in the suite's ledger.
//!
//! Run on a GPU host: `cargo test --test gpu -- --include-ignored --test-threads=1`.

use candle_core::{DType, Device, Tensor};
use nccl::{Comm, ReduceOp};
use nccl_candle::Error;

mod common;
use common::host_f32;

/// Integer-valued f32 in [-8, 8) from a seed (xorshift), so sums are exact.
fn data(seed: u64, len: usize) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % 16) as f32 - 8.0
        })
        .collect()
}

/// Runs `body(rank, size, comm, device)` on every rank of this host's layout
/// (`common::on_ranks`), or says why not.
fn on_every_gpu(test: &'static str, body: impl Fn(usize, usize, &Comm, &Device) + Sync) {
    common::on_ranks(test, |comm, device| {
        body(comm.rank(), comm.size(), &comm, device);
        comm.synchronize().expect("synchronize");
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn collectives_on_tensors_match_the_host() {
    let len = 4096;
    on_every_gpu(
        "collectives_on_tensors_match_the_host",
        |rank, size, comm, device| {
            let mine = |seed: u64| data(seed * 100 + rank as u64, len);
            let sum = |seed: u64| {
                (0..size).fold(vec![0f32; len], |mut acc, r| {
                    for (a, x) in acc.iter_mut().zip(data(seed * 100 + r as u64, len)) {
                        *a += x;
                    }
                    acc
                })
            };
            // In place, f32 and bf16 (integer values stay exact in bf16 at these sizes).
            let t = Tensor::from_vec(mine(1), (len / 64, 64), device).unwrap();
            nccl_candle::all_reduce_in_place(comm, &t, ReduceOp::Sum).unwrap();
            assert_eq!(host_f32(&t), sum(1), "rank {rank}");
            let t = Tensor::from_vec(mine(2), len, device)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            nccl_candle::all_reduce_in_place(comm, &t, ReduceOp::Sum).unwrap();
            let got = host_f32(&t);
            assert_eq!(got, sum(2), "rank {rank}: bf16");
            // Out of place, from a view that starts inside its storage.
            let whole =
                Tensor::from_vec(data(300 + rank as u64, 2 * len), 2 * len, device).unwrap();
            let view = whole.narrow(0, len, len).unwrap();
            let out = nccl_candle::all_reduce(comm, &view, ReduceOp::Sum).unwrap();
            let want: Vec<f32> = (0..size).fold(vec![0f32; len], |mut acc, r| {
                for (a, x) in acc.iter_mut().zip(&data(300 + r as u64, 2 * len)[len..]) {
                    *a += x;
                }
                acc
            });
            assert_eq!(host_f32(&out), want, "rank {rank}: out of place");
            // All-gather along dimension 0, reduce-scatter back to this rank's block.
            let t = Tensor::from_vec(mine(4), (2, len / 2), device).unwrap();
            let gathered = nccl_candle::all_gather(comm, &t).unwrap();
            assert_eq!(gathered.dims(), &[2 * size, len / 2]);
            let want: Vec<f32> = (0..size).flat_map(|r| data(400 + r as u64, len)).collect();
            assert_eq!(host_f32(&gathered), want);
            let t =
                Tensor::from_vec(data(500 + rank as u64, size * len), (size, len), device).unwrap();
            let block = nccl_candle::reduce_scatter(comm, &t, ReduceOp::Sum).unwrap();
            assert_eq!(block.dims(), &[1, len]);
            let full: Vec<f32> = (0..size).fold(vec![0f32; size * len], |mut acc, r| {
                for (a, x) in acc.iter_mut().zip(data(500 + r as u64, size * len)) {
                    *a += x;
                }
                acc
            });
            assert_eq!(
                host_f32(&block),
                &full[rank * len..(rank + 1) * len],
                "rank {rank}: reduce-scatter"
            );
            // Broadcast from the last rank.
            let root = size - 1;
            let t = Tensor::from_vec(mine(6), len, device).unwrap();
            nccl_candle::broadcast_in_place(comm, &t, root).unwrap();
            assert_eq!(host_f32(&t), data(600 + root as u64, len));
        },
    );
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn tensors_nccl_cannot_take_are_refused_before_nccl() {
    on_every_gpu(
        "tensors_nccl_cannot_take_are_refused_before_nccl",
        |rank, size, comm, device| {
            let cpu = Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap();
            let err = nccl_candle::all_reduce_in_place(comm, &cpu, ReduceOp::Sum).unwrap_err();
            assert!(matches!(err, Error::NotCuda { .. }), "rank {rank}: {err}");
            let t = Tensor::zeros((4, 8), DType::F32, device)
                .unwrap()
                .t()
                .unwrap();
            let err = nccl_candle::all_reduce(comm, &t, ReduceOp::Sum).unwrap_err();
            assert!(
                matches!(err, Error::NotContiguous { .. }),
                "rank {rank}: {err}"
            );
            // candle has no CUDA cast to i16: made on the CPU and copied over.
            let t = Tensor::zeros(8, DType::I16, &Device::Cpu)
                .unwrap()
                .to_device(device)
                .unwrap();
            let err = nccl_candle::all_gather(comm, &t).unwrap_err();
            assert!(
                matches!(err, Error::UnsupportedDType { .. }),
                "rank {rank}: {err}"
            );
            if size > 1 {
                let t = Tensor::zeros((size + 1, 2), DType::F32, device).unwrap();
                let err = nccl_candle::reduce_scatter(comm, &t, ReduceOp::Sum).unwrap_err();
                assert!(matches!(err, Error::Shape { .. }), "rank {rank}: {err}");
            }
            // A root past the ranks: nccl-rs's own typed refusal, through candle's op machinery.
            let t = Tensor::zeros(8, DType::F32, device).unwrap();
            let err = nccl_candle::broadcast_in_place(comm, &t, size).unwrap_err();
            assert!(matches!(err, Error::Nccl(_)), "rank {rank}: {err}");
        },
    );
}
