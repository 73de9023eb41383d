//! The tensor-parallel layers on real GPUs: one rank per visible GPU (at least 2), each on a
//! thread of its own with a candle device and a communicator of `Comm::init_all` on that
//! device's stream. Each layer's output over the ranks equals the host's computation of the
//! whole layer (f32, random weights and inputs), weights loaded through `ShardedVarBuilder`
//! from a safetensors file written here; the typed refusals come out on every rank.
//!
//! Run on a GPU host: `cargo test --test gpu_tp -- --include-ignored --test-threads=1`.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::var_builder::{ShardedSafeTensors, ShardedVarBuilder};
use nccl::{Comm, ReduceOp};
use nccl_candle::tp::{
    ColumnParallelLinear, LsaCollectives, RowParallelLinear, TpGroup, VocabParallelEmbedding,
};
use nccl_candle::Error;

mod common;
use common::{close, columns, data, host_linear};

/// f32 on the GPU against f64 on the host, sums of at most 64 products of values in [-1, 1).
const TOLERANCE: f32 = 1e-4;

/// Runs `body(group, device)` on one thread per visible GPU, or says why not.
fn on_every_gpu(test: &str, body: impl Fn(TpGroup, &Device) + Sync) {
    on_every_gpu_with(test, None, body)
}

/// [`on_every_gpu`], the group's bf16 sums through nccl-rs's shipped kernels for up to
/// `lsa` elements where given ([`LsaCollectives`]).
fn on_every_gpu_with(test: &str, lsa: Option<usize>, body: impl Fn(TpGroup, &Device) + Sync) {
    let gpus = match nccl::library::cuda_device_count() {
        Ok(n) if n >= 2 => n,
        Ok(n) => {
            eprintln!("SKIPPED {test}: {n} GPU(s), tensor parallelism needs 2");
            return;
        }
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            return;
        }
    };
    eprintln!("RUNS {test}: {gpus} ranks, one GPU each");
    let devices: Vec<Device> = (0..gpus)
        .map(|i| Device::new_cuda_with_stream(i).expect("a candle CUDA device"))
        .collect();
    let streams: Vec<_> = devices
        .iter()
        .map(|d| d.as_cuda_device().unwrap().cuda_stream())
        .collect();
    let comms = Comm::init_all(&streams).expect("ncclCommInitAll");
    std::thread::scope(|scope| {
        for (comm, device) in comms.into_iter().zip(devices) {
            let body = &body;
            scope.spawn(move || {
                let rank = comm.rank();
                let group = match lsa {
                    Some(max) => TpGroup::new(LsaCollectives::new(comm, max).expect("kernels")),
                    None => TpGroup::new(comm),
                }
                .expect("a group");
                body(group, &device);
                device
                    .synchronize()
                    .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            });
        }
    });
}

/// Shapes for `n` ranks: every split dimension a multiple of `n`.
struct Shapes {
    inp: usize,
    out: usize,
    row_out: usize,
    vocab: usize,
    hidden: usize,
}

fn shapes(n: usize) -> Shapes {
    Shapes {
        inp: 48,
        out: 8 * n,
        row_out: 24,
        vocab: 16 * n,
        hidden: 40,
    }
}

fn weights(s: &Shapes) -> HashMap<&'static str, (Vec<f32>, Vec<usize>)> {
    HashMap::from([
        ("col.weight", (data(1, s.out * s.inp), vec![s.out, s.inp])),
        ("col.bias", (data(2, s.out), vec![s.out])),
        (
            "row.weight",
            (data(3, s.row_out * s.out), vec![s.row_out, s.out]),
        ),
        ("row.bias", (data(4, s.row_out), vec![s.row_out])),
        (
            "emb.weight",
            (data(5, s.vocab * s.hidden), vec![s.vocab, s.hidden]),
        ),
        (
            "odd.weight",
            (data(6, (s.out + 1) * s.inp), vec![s.out + 1, s.inp]),
        ),
    ])
}

fn write_weights(path: &Path, s: &Shapes) {
    let tensors: HashMap<String, Tensor> = weights(s)
        .into_iter()
        .map(|(name, (values, shape))| {
            let t = Tensor::from_vec(values, shape, &Device::Cpu).unwrap();
            (name.to_string(), t)
        })
        .collect();
    candle_core::safetensors::save(&tensors, path).unwrap();
}

fn var_builder(path: &Path, device: &Device) -> ShardedVarBuilder<'static> {
    // SAFETY: the file is this test's own, in its private directory, unchanged while mapped.
    unsafe { ShardedSafeTensors::var_builder(&[path], DType::F32, device) }.unwrap()
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn layers_over_gpus_match_the_host() {
    let gpus = nccl::library::cuda_device_count().unwrap_or(0);
    let s = shapes(gpus.max(1));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    write_weights(&path, &s);
    let w = weights(&s);
    let x = data(7, 6 * s.inp);
    let col = host_linear(&x, &w["col.weight"].0, &w["col.bias"].0, s.inp, s.out);
    let row = host_linear(&col, &w["row.weight"].0, &w["row.bias"].0, s.out, s.row_out);
    let ids: Vec<u32> = (0..s.vocab as u32).rev().step_by(3).collect();
    on_every_gpu("layers_over_gpus_match_the_host", |group, device| {
        let (r, n) = (group.rank(), group.size());
        let what = format!("rank {r} of {n}");
        let vb = var_builder(&path, device);
        let x = Tensor::from_vec(x.clone(), (2, 3, s.inp), device).unwrap();
        let c = ColumnParallelLinear::load(&vb.pp("col"), &group, s.inp, s.out, true).unwrap();
        let block = c.forward(&x).unwrap();
        assert_eq!(block.dims(), &[2, 3, s.out / n], "{what}");
        let mine = columns(&col, s.out, r * s.out / n..(r + 1) * s.out / n);
        close(&block, &mine, TOLERANCE, &format!("{what}: column block"));
        let gathered = c.forward_gathered(&x).unwrap();
        close(&gathered, &col, TOLERANCE, &format!("{what}: gathered"));
        let rp = RowParallelLinear::load(&vb.pp("row"), &group, s.out, s.row_out, true).unwrap();
        let y = rp.forward(&block).unwrap();
        assert_eq!(y.dims(), &[2, 3, s.row_out]);
        close(&y, &row, TOLERANCE, &format!("{what}: row"));
        let e = VocabParallelEmbedding::load(&vb.pp("emb"), &group, s.vocab, s.hidden).unwrap();
        let table = &w["emb.weight"].0;
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&id| table[id as usize * s.hidden..][..s.hidden].to_vec())
            .collect();
        let got = e
            .forward(&Tensor::new(ids.as_slice(), device).unwrap())
            .unwrap();
        assert_eq!(got.dims(), &[ids.len(), s.hidden]);
        close(&got, &want, 0.0, &format!("{what}: embedding (exact)"));
        // Skip mode: the row-parallel layer's own partial product, plus the bias.
        group.set_skip_collectives(true);
        let weight = columns(
            &w["row.weight"].0,
            s.out,
            r * s.out / n..(r + 1) * s.out / n,
        );
        let partial = host_linear(&mine, &weight, &w["row.bias"].0, s.out / n, s.row_out);
        close(
            &rp.forward(&block).unwrap(),
            &partial,
            TOLERANCE,
            &format!("{what}: skipped"),
        );
        group.set_skip_collectives(false);
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn gathers_along_any_dimension_and_agreement() {
    on_every_gpu(
        "gathers_along_any_dimension_and_agreement",
        |group, device| {
            let (r, n) = (group.rank(), group.size());
            let mine =
                |r: usize| Tensor::from_vec(data(10 + r as u64, 24), (2, 3, 4), &Device::Cpu);
            let all: Vec<Tensor> = (0..n).map(|r| mine(r).unwrap()).collect();
            for dim in 0..3 {
                let want = Tensor::cat(&all, dim).unwrap();
                let t = mine(r).unwrap().to_device(device).unwrap();
                let got = group.all_gather_dim(&t, dim).unwrap();
                assert_eq!(got.dims(), want.dims(), "rank {r}, dim {dim}");
                let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                close(
                    &got,
                    &want,
                    0.0,
                    &format!("rank {r}: all_gather_dim({dim})"),
                );
            }
            group.agree("same", 7, device).unwrap();
            match group.agree("differs", r as u64, device) {
                Err(Error::Mismatch { ranks, .. }) => {
                    assert_eq!(ranks, (1..n).collect::<Vec<_>>())
                }
                other => panic!("rank {r}: {other:?}"),
            }
            let one = Tensor::new(&[1u32], device).unwrap();
            let count = group.all_reduce(&one, ReduceOp::Sum).unwrap();
            assert_eq!(count.to_vec1::<u32>().unwrap(), [n as u32]);
        },
    );
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn a_shard_that_does_not_split_is_a_typed_error_on_every_rank() {
    let gpus = nccl::library::cuda_device_count().unwrap_or(0);
    let s = shapes(gpus.max(1));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    write_weights(&path, &s);
    on_every_gpu(
        "a_shard_that_does_not_split_is_a_typed_error_on_every_rank",
        |group, device| {
            let vb = var_builder(&path, device);
            let err = ColumnParallelLinear::load(&vb.pp("odd"), &group, s.inp, s.out + 1, false)
                .unwrap_err();
            assert!(matches!(err, Error::NotDivisible { dim: 0, .. }), "{err}");
            let err = ColumnParallelLinear::load(&vb.pp("col"), &group, s.inp + 1, s.out, false)
                .unwrap_err();
            assert!(matches!(err, Error::ShardShape { .. }), "{err}");
            // The ranks are still in step: a collective after the refusals completes.
            group.agree("after the refusals", 1, device).unwrap();
        },
    );
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn shipped_kernels_sum_like_nccl() {
    const MAX: usize = 4096;
    let lib = nccl::library::get().expect("NCCL loads");
    if lib.version() < nccl::device::DEV_COMM_SINCE {
        eprintln!(
            "SKIPPED shipped_kernels_sum_like_nccl: the shipped kernels need NCCL {}+, loaded {}",
            nccl::device::DEV_COMM_SINCE,
            lib.version()
        );
        return;
    }
    on_every_gpu_with(
        "shipped_kernels_sum_like_nccl",
        Some(MAX),
        |group, device| {
            let (r, n) = (group.rank(), group.size());
            // Small integers: every sum exact in bf16. Within the kernels' size, past it (NCCL),
            // and f32 (NCCL), all the same sums.
            for (len, dtype) in [
                (3 * 1000, DType::BF16),
                (MAX + 8, DType::BF16),
                (64, DType::F32),
            ] {
                let values = |rank: usize| -> Vec<f32> {
                    (0..len)
                        .map(|i| ((i * 7 + rank * 3) % 17) as f32 - 8.0)
                        .collect()
                };
                let want: Vec<f32> = (0..len)
                    .map(|i| (0..n).map(|rank| values(rank)[i]).sum())
                    .collect();
                let t = Tensor::from_vec(values(r), len, device)
                    .and_then(|t| t.to_dtype(dtype))
                    .unwrap();
                let got = group.all_reduce(&t, ReduceOp::Sum).unwrap();
                let got = got.to_dtype(DType::F32).unwrap();
                close(&got, &want, 0.0, &format!("rank {r}: {len} x {dtype:?}"));
            }
        },
    );
}
