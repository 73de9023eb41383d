//! The tensor-parallel layers on real GPUs, in the shapes of nccl-rs's GPU suite: one rank
//! per visible GPU where there are 2+, else two ranks sharing GPU 0 as one LSA team (NCCL
//! 2.30+), each rank on a thread of its own with a candle device and a communicator of
//! `Comm::init_all` on that device's stream (`common::on_ranks`). Each layer's output over the
//! ranks equals the host's computation of the whole layer (f32, random weights and inputs),
//! weights loaded through `ShardedVarBuilder` from a safetensors file written here; the typed
//! refusals come out on every rank. With `LsaCollectives`, the fused row-parallel epilogue
//! (one shipped kernel) gives what the unfused sequence gives, on random bf16 data, and a
//! call refused on one rank alone leaves every rank refusing instead of pairing with a stale
//! call. What ran and what was skipped (and why) is said on stderr and in the suite's ledger.
//!
//! Run on a GPU host: `cargo test --test gpu_tp -- --include-ignored --test-threads=1`.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use candle_core::{DType, Device, DeviceLocation, Tensor};
use candle_nn::var_builder::{ShardedSafeTensors, ShardedVarBuilder};
use nccl::{Comm, ReduceOp};
use nccl_candle::tp::{
    Collectives, ColumnParallelLinear, LsaCollectives, RowParallelLinear, TpGroup,
    VocabParallelEmbedding,
};
use nccl_candle::Error;

mod common;
use common::{close, columns, data, host_f32, host_linear};

/// f32 on the GPU against f64 on the host, sums of at most 64 products of values in [-1, 1).
const TOLERANCE: f32 = 1e-4;

/// Runs `body(group, device)` on every rank of this host's layout, or says why not.
fn on_every_gpu(test: &'static str, body: impl Fn(TpGroup, &Device) + Sync) {
    on_every_gpu_comm(test, |comm, device| {
        body(TpGroup::new(comm).expect("a group"), device)
    });
}

/// Runs `body(comm, device)` on every rank of this host's layout (`common::on_ranks`), the
/// communicator on the candle device's stream, or says why not.
fn on_every_gpu_comm(test: &'static str, body: impl Fn(Comm, &Device) + Sync) {
    common::on_ranks(test, body);
}

/// The shipped kernels on `comm` for up to `max` elements, or `None` where these ranks
/// cannot have them (said once, through the suite's ledger: the test is skipped).
fn lsa(test: &str, comm: Comm, max: usize) -> Option<LsaCollectives> {
    let rank = comm.rank();
    match LsaCollectives::new(comm, max) {
        Ok(lsa) => Some(lsa),
        Err(e) if common::kernels_unavailable(test, rank, &e) => None,
        Err(e) => panic!("rank {rank}: the shipped kernels: {e}"),
    }
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
    const TEST: &str = "layers_over_gpus_match_the_host";
    let Some(layout) = common::layout(TEST) else {
        return;
    };
    let s = shapes(layout.size());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    write_weights(&path, &s);
    let w = weights(&s);
    let x = data(7, 6 * s.inp);
    let col = host_linear(&x, &w["col.weight"].0, &w["col.bias"].0, s.inp, s.out);
    let row = host_linear(&col, &w["row.weight"].0, &w["row.bias"].0, s.out, s.row_out);
    let ids: Vec<u32> = (0..s.vocab as u32).rev().step_by(3).collect();
    common::run(TEST, &layout, |comm, device, _| {
        let group = TpGroup::new(comm).expect("a group");
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
            device.synchronize().unwrap();
            assert_eq!(count.to_vec1::<u32>().unwrap(), [n as u32]);
        },
    );
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn a_shard_that_does_not_split_is_a_typed_error_on_every_rank() {
    const TEST: &str = "a_shard_that_does_not_split_is_a_typed_error_on_every_rank";
    let Some(layout) = common::layout(TEST) else {
        return;
    };
    let s = shapes(layout.size());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    write_weights(&path, &s);
    common::run(TEST, &layout, |comm, device, _| {
        let group = TpGroup::new(comm).expect("a group");
        let vb = var_builder(&path, device);
        let err =
            ColumnParallelLinear::load(&vb.pp("odd"), &group, s.inp, s.out + 1, false).unwrap_err();
        assert!(matches!(err, Error::NotDivisible { dim: 0, .. }), "{err}");
        let err =
            ColumnParallelLinear::load(&vb.pp("col"), &group, s.inp + 1, s.out, false).unwrap_err();
        assert!(matches!(err, Error::ShardShape { .. }), "{err}");
        // The ranks are still in step: a collective after the refusals completes.
        group.agree("after the refusals", 1, device).unwrap();
    });
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn shipped_kernels_sum_like_nccl() {
    const TEST: &str = "shipped_kernels_sum_like_nccl";
    const MAX: usize = 4096;
    if !common::shipped_kernels_or_skip(TEST) {
        return;
    }
    on_every_gpu_comm(TEST, |comm, device| {
        let Some(lsa) = lsa(TEST, comm, MAX) else {
            return;
        };
        let group = TpGroup::new(lsa).expect("a group");
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
    });
}

/// The bf16 unit in the last place at `v`'s magnitude (of the smallest normal for zero).
fn bf16_ulp(v: f32) -> f32 {
    let magnitude = f32::from_bits(v.abs().to_bits() & 0x7f80_0000).max(f32::MIN_POSITIVE);
    magnitude / 128.0
}

/// Asserts that `got` and `want` (bf16 tensors of one shape) differ by at most `ulps` bf16
/// units in the last place of `want`'s elements.
fn within_ulps(got: &Tensor, want: &Tensor, ulps: f32, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let (got, want) = (host_f32(got), host_f32(want));
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let off = (g - w).abs() / bf16_ulp(*w);
        assert!(off <= ulps, "{what}: element {i}: {g} vs {w} ({off} ulps)");
        worst = worst.max(off);
    }
    eprintln!("{what}: at most {worst} ulp(s) apart");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn fused_epilogue_matches_the_unfused_sequence() {
    const TEST: &str = "fused_epilogue_matches_the_unfused_sequence";
    const MAX: usize = 8 * 1024;
    const EPS: f32 = 1e-5;
    if !common::shipped_kernels_or_skip(TEST) {
        return;
    }
    // (rows, hidden, whether the fused kernel takes it): one row split over CTAs, a decode
    // batch, rows of an odd number of vectors; then past MAX elements and rows not of
    // whole 16-byte vectors, which run the unfused sequence.
    let cases = [
        (1, 8192, true),
        (8, 1024, true),
        (3, 520, true),
        (2, 8192, false),
        (4, 36, false),
    ];
    // Rank `rank`'s partial output of case `i`, the residual and the weight (alike on all).
    let partial_of =
        |i: usize, rank: usize, len: usize| data(100 * i as u64 + 1 + rank as u64, len);
    let residual_of = |i: usize, len: usize| data(100 * i as u64 + 50, len);
    let weight_of = |i: usize, hidden: usize| data(100 * i as u64 + 60, hidden);
    on_every_gpu_comm(TEST, |comm, device| {
        let Some(lsa) = lsa(TEST, comm, MAX) else {
            return;
        };
        let (r, n) = (lsa.rank(), lsa.size());
        let bf16 = |values: Vec<f32>, shape: &[usize]| {
            Tensor::from_vec(values, shape, device)
                .and_then(|t| t.to_dtype(DType::BF16))
                .unwrap()
        };
        let inputs: Vec<[Tensor; 3]> = cases
            .iter()
            .enumerate()
            .map(|(i, &(rows, hidden, _))| {
                let len = rows * hidden;
                [
                    bf16(partial_of(i, r, len), &[rows, hidden]),
                    bf16(residual_of(i, len), &[rows, hidden]),
                    bf16(weight_of(i, hidden), &[hidden]),
                ]
            })
            .collect();
        for ((rows, hidden, fits), [partial, residual, weight]) in cases.iter().zip(&inputs) {
            let fuses = lsa.fuses(partial, residual, weight, EPS);
            assert_eq!(fuses, *fits, "rank {r}: {rows} x {hidden}");
        }
        // A view of another tensor's storage is not fused either (candle would refuse to
        // write the storage it reads).
        let [partial, _, weight] = &inputs[0];
        assert!(!lsa.fuses(partial, &partial.clone(), weight, EPS));
        let group = TpGroup::new(lsa).expect("a group");
        for (i, ((rows, hidden, fits), [partial, residual, weight])) in
            cases.iter().zip(&inputs).enumerate()
        {
            let what = format!("rank {r} of {n}, {rows} x {hidden}, fused {fits}");
            let before = host_f32(partial);
            let (got_residual, got_normed) = group
                .all_reduce_add_rms_norm(partial, residual, weight, EPS)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            // The unfused sequence, through the same group (its bf16 sums through the
            // shipped all-reduce, or NCCL past MAX).
            let sum = group.all_reduce(partial, ReduceOp::Sum).unwrap();
            let want_residual = (&sum + residual).unwrap();
            let want_normed = candle_nn::ops::rms_norm(&want_residual, weight, EPS).unwrap();
            // Before any read-back: with ranks sharing GPU 0 a read-back waiting on this
            // rank's collective holds the context's staging buffer, which the peer's own
            // read-back before its call then waits for (see `common::on_ranks`). Hung on
            // one H200 until the kernels' 300 s timeout.
            device.synchronize().unwrap();
            let after = host_f32(partial);
            assert_eq!(before, after, "{what}: the partial output changed");
            if !fits {
                // The unfused sequence itself, the same kernels in the same order.
                within_ulps(
                    &got_residual,
                    &want_residual,
                    0.0,
                    &format!("{what}: residual"),
                );
                within_ulps(&got_normed, &want_normed, 0.0, &format!("{what}: normed"));
                continue;
            }
            // Two ranks' sum is one rounding whatever the kernel. With more, the fused kernel
            // sums in f32 and rounds the sum once, where an all-reduce that rounds at each step
            // (NCCL's, which the unfused sequence takes at some sizes) can lie several units in
            // the last place away after cancellation: so against the host's sum of the rounded
            // inputs, rounded once (1 unit for a rounding of the kernel's f32 sum).
            if n == 2 {
                within_ulps(
                    &got_residual,
                    &want_residual,
                    0.0,
                    &format!("{what}: residual"),
                );
            } else {
                let len = rows * hidden;
                // Through f32: half's conversion from f64 drops bits before it rounds.
                let round = |v: f64| f64::from(half::bf16::from_f32(v as f32));
                let everyone: Vec<Vec<f32>> = (0..n).map(|rank| partial_of(i, rank, len)).collect();
                let host: Vec<f32> = residual_of(i, len)
                    .into_iter()
                    .enumerate()
                    .map(|(e, res)| {
                        let sum: f64 = everyone.iter().map(|p| round(p[e].into())).sum();
                        round(round(sum) + round(res.into())) as f32
                    })
                    .collect();
                let host = bf16(host, &[*rows, *hidden]);
                within_ulps(
                    &got_residual,
                    &host,
                    1.0,
                    &format!("{what}: residual (host)"),
                );
            }
            // The norm against candle's of the same residual: only the order of the sum
            // of squares differs.
            let own_norm = candle_nn::ops::rms_norm(&got_residual, weight, EPS).unwrap();
            within_ulps(&got_normed, &own_norm, 1.0, &format!("{what}: normed"));
        }
        // Skip mode leaves the sum out: this rank's partial output added and normalised.
        let [partial, residual, weight] = &inputs[0];
        group.set_skip_collectives(true);
        let (skipped, _) = group
            .all_reduce_add_rms_norm(partial, residual, weight, EPS)
            .unwrap();
        group.set_skip_collectives(false);
        let alone = (partial + residual).unwrap();
        within_ulps(&skipped, &alone, 0.0, &format!("rank {r}: skipped"));
    });
}

/// Issue 41, M2: a bf16 sum that one rank refuses alone (here a tensor of another stream of
/// the same GPU) while its peers launched the shipped kernel must leave every rank refusing
/// from then on, never pairing the refusing rank's next call with its peers' previous one
/// (which returned `Ok` with a wrong sum before the fix).
#[test]
#[ignore = "needs CUDA GPUs"]
fn a_rank_refusing_alone_leaves_every_rank_refusing() {
    const TEST: &str = "a_rank_refusing_alone_leaves_every_rank_refusing";
    const LEN: usize = 3 * 1000;
    const ROWS: usize = 2;
    const HIDDEN: usize = 1024;
    if !common::shipped_kernels_or_skip(TEST) {
        return;
    }
    let Some(layout) = common::layout(TEST) else {
        return;
    };
    // Rank `rank`'s input of call `call`: random values in [-1, 1).
    let input = |call: u64, rank: usize| data(1000 * call + rank as u64, LEN);
    common::run(TEST, &layout, |comm, device, barrier| {
        let (r, n) = (comm.rank(), comm.size());
        let Some(lsa) = lsa(TEST, comm, LEN.max(ROWS * HIDDEN)) else {
            return;
        };
        lsa.set_kernel_timeout(Duration::from_secs(3));
        assert_eq!(lsa.kernel_timeout(), Duration::from_secs(3));
        let bf16 = |values: Vec<f32>, shape: &[usize], device: &Device| {
            Tensor::from_vec(values, shape, device)
                .and_then(|t| t.to_dtype(DType::BF16))
                .unwrap()
        };
        // Every upload before the first launch: nothing waits for a peer while it copies.
        let first = bf16(input(1, r), &[LEN], device);
        let second = bf16(input(2, r), &[LEN], device);
        let third = bf16(input(3, r), &[LEN], device);
        let epilogue = [
            bf16(data(40 + r as u64, ROWS * HIDDEN), &[ROWS, HIDDEN], device),
            bf16(data(50, ROWS * HIDDEN), &[ROWS, HIDDEN], device),
            bf16(data(60, HIDDEN), &[HIDDEN], device),
        ];
        // Rank 1's second input: on another stream of the same GPU (a second candle device).
        let elsewhere = (r == 1).then(|| {
            let DeviceLocation::Cuda { gpu_id } = device.location() else {
                unreachable!("a CUDA device")
            };
            let other = Device::new_cuda_with_stream(gpu_id).expect("another stream");
            let t = bf16(input(2, r), &[LEN], &other);
            other.synchronize().unwrap();
            t
        });
        device.synchronize().unwrap();
        barrier.wait();

        // A good call first: the host's sum, in f32 in rank order and rounded once.
        let got = lsa
            .all_reduce(&first, ReduceOp::Sum)
            .expect("the first call");
        lsa.check().expect("the first call completes on every rank");
        let want: Vec<f32> = (0..LEN)
            .map(|i| {
                let sum = (0..n)
                    .map(|rank| half::bf16::from_f32(input(1, rank)[i]).to_f32())
                    .fold(0f32, |acc, v| acc + v);
                half::bf16::from_f32(sum).to_f32()
            })
            .collect();
        close(
            &got,
            &want,
            0.0,
            &format!("rank {r} of {n}: the first call"),
        );
        barrier.wait();

        // Rank 1 refuses its second call alone; the others launch theirs, which give up.
        if let Some(elsewhere) = &elsewhere {
            match lsa.all_reduce(elsewhere, ReduceOp::Sum) {
                Err(Error::Nccl(nccl::Error::InvalidArgument(msg))) => {
                    assert!(msg.contains("stream"), "rank {r}: {msg}")
                }
                other => panic!("rank {r}: a tensor of another stream: {other:?}"),
            }
            match lsa.status() {
                Err(Error::Nccl(nccl::Error::InvalidUsage(msg))) => {
                    assert!(msg.contains("out of step"), "rank {r}: {msg}")
                }
                other => panic!("rank {r}: status after the refusal: {other:?}"),
            }
        } else {
            let launched = lsa
                .all_reduce(&second, ReduceOp::Sum)
                .expect("launched: the refusal is rank 1's alone");
            // The kernel waits for rank 1 for the 3 s set above, then gives up.
            device.synchronize().unwrap();
            match lsa.check() {
                Err(Error::Nccl(nccl::Error::Timeout { .. })) => {}
                other => panic!("rank {r}: rank 1 never came: {other:?}"),
            }
            drop(launched);
        }
        barrier.wait();

        // The next call, on every rank: an error, never a sum (rank 1's used to pair with
        // its peers' second call and return Ok with a wrong sum).
        let next = lsa.all_reduce(&third, ReduceOp::Sum);
        let fused = lsa.all_reduce_add_rms_norm(&epilogue[0], &epilogue[1], &epilogue[2], 1e-5);
        device.synchronize().unwrap();
        for (what, result) in [
            ("the next sum", next.map(|t| vec![t])),
            ("the next epilogue", fused.map(|(a, b)| vec![a, b])),
        ] {
            match (r, result) {
                (1, Err(Error::Nccl(nccl::Error::InvalidUsage(msg)))) => {
                    assert!(msg.contains("out of step"), "rank {r}: {what}: {msg}")
                }
                (r, Err(Error::Nccl(nccl::Error::Timeout { .. }))) if r != 1 => {}
                (r, Ok(tensors)) => panic!(
                    "rank {r}: {what} returned Ok ({:?}...) after rank 1 refused a call alone",
                    &host_f32(&tensors[0])[..4]
                ),
                (r, Err(e)) => panic!("rank {r}: {what}: unexpected error {e}"),
            }
        }
        assert!(lsa.status().is_err(), "rank {r}: status");
        barrier.wait();
        // Dropped on every rank: nothing of theirs still runs.
        drop(lsa);
        barrier.wait();
    });
}
