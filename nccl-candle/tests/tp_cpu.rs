//! The tensor-parallel layers on CPU tensors, ranks simulated on threads
//! (`ThreadedCollectives`): each layer's output over 1 to 4 ranks equals the host's
//! computation of the whole layer, weights loaded through `ShardedVarBuilder` from a
//! safetensors file written here; the typed refusals come out on every rank. The row-parallel
//! epilogue (sum, residual add, RMSNorm) in its default, unfused form equals the explicit
//! sequence and the host's.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use candle_nn::var_builder::{ShardedSafeTensors, ShardedVarBuilder};
use nccl::ReduceOp;
use nccl_candle::tp::{
    ColumnParallelLinear, RowParallelLinear, ThreadedCollectives, TpGroup, VocabParallelEmbedding,
};
use nccl_candle::Error;

mod common;
use common::{close, columns, data, host_add_rms_norm, host_linear};

/// The shapes of the test layers, and their weights.
const IN: usize = 8;
const OUT: usize = 12;
const ROW_OUT: usize = 6;
const VOCAB: usize = 12;
const HIDDEN: usize = 5;

fn weights() -> HashMap<String, Vec<f32>> {
    HashMap::from([
        ("col.weight".to_string(), data(1, OUT * IN)),
        ("col.bias".to_string(), data(2, OUT)),
        ("row.weight".to_string(), data(3, ROW_OUT * OUT)),
        ("row.bias".to_string(), data(4, ROW_OUT)),
        ("emb.weight".to_string(), data(5, VOCAB * HIDDEN)),
        ("odd.weight".to_string(), data(6, 13 * IN)),
        ("bad.weight".to_string(), data(9, ROW_OUT * OUT)),
        ("bad.bias".to_string(), data(10, ROW_OUT + 1)),
    ])
}

fn shape_of(name: &str) -> Vec<usize> {
    match name {
        "col.weight" => vec![OUT, IN],
        "col.bias" => vec![OUT],
        "row.weight" => vec![ROW_OUT, OUT],
        "row.bias" => vec![ROW_OUT],
        "emb.weight" => vec![VOCAB, HIDDEN],
        "bad.weight" => vec![ROW_OUT, OUT],
        "bad.bias" => vec![ROW_OUT + 1],
        _ => vec![13, IN],
    }
}

fn write_weights(path: &Path) {
    let tensors: HashMap<String, Tensor> = weights()
        .into_iter()
        .map(|(name, values)| {
            let t = Tensor::from_vec(values, shape_of(&name), &Device::Cpu).unwrap();
            (name, t)
        })
        .collect();
    candle_core::safetensors::save(&tensors, path).unwrap();
}

fn var_builder(path: &Path) -> ShardedVarBuilder<'static> {
    // SAFETY: the file is this test's own, in its private directory, unchanged while mapped.
    unsafe { ShardedSafeTensors::var_builder(&[path], DType::F32, &Device::Cpu) }.unwrap()
}

/// Runs `body(group)` on one thread per rank of a simulated group of `n`.
fn on_ranks<T: Send>(n: usize, body: impl Fn(TpGroup) -> T + Sync) -> Vec<T> {
    let ranks = ThreadedCollectives::group(n).unwrap();
    std::thread::scope(|scope| {
        let body = &body;
        let threads: Vec<_> = ranks
            .into_iter()
            .map(|rank| scope.spawn(move || body(TpGroup::new(rank).unwrap())))
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    })
}

#[test]
fn layers_over_ranks_match_the_whole_layer() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    write_weights(&path);
    let w = weights();
    let rows = 6; // x is [2, 3, IN]
    let x = data(7, rows * IN);
    let col = host_linear(&x, &w["col.weight"], &w["col.bias"], IN, OUT);
    let row = host_linear(&col, &w["row.weight"], &w["row.bias"], OUT, ROW_OUT);
    let ids = [0u32, 11, 3, 4, 7, 8, 5, 6];
    for n in [1, 2, 3, 4] {
        on_ranks(n, |group| {
            let (r, what) = (group.rank(), format!("rank {} of {n}", group.rank()));
            let vb = var_builder(&path);
            let x = Tensor::from_vec(x.clone(), (2, 3, IN), &Device::Cpu).unwrap();
            let c = ColumnParallelLinear::load(&vb.pp("col"), &group, IN, OUT, true).unwrap();
            assert_eq!(c.local_out_features(), OUT / n);
            let block = c.forward(&x).unwrap();
            assert_eq!(block.dims(), &[2, 3, OUT / n], "{what}");
            let want = columns(&col, OUT, r * OUT / n..(r + 1) * OUT / n);
            close(&block, &want, 1e-5, &format!("{what}: column block"));
            close(
                &c.forward_gathered(&x).unwrap(),
                &col,
                1e-5,
                &format!("{what}: gathered"),
            );
            // The row-parallel layer takes the column layer's block, as in an MLP.
            let rp = RowParallelLinear::load(&vb.pp("row"), &group, OUT, ROW_OUT, true).unwrap();
            let y = rp.forward(&block).unwrap();
            assert_eq!(y.dims(), &[2, 3, ROW_OUT]);
            close(&y, &row, 1e-5, &format!("{what}: row"));
            let e = VocabParallelEmbedding::load(&vb.pp("emb"), &group, VOCAB, HIDDEN).unwrap();
            let ids = Tensor::new(&ids, &Device::Cpu)
                .unwrap()
                .reshape((2, 4))
                .unwrap();
            let want: Vec<f32> = ids
                .flatten_all()
                .unwrap()
                .to_vec1::<u32>()
                .unwrap()
                .iter()
                .flat_map(|&id| w["emb.weight"][id as usize * HIDDEN..][..HIDDEN].to_vec())
                .collect();
            let got = e.forward(&ids).unwrap();
            assert_eq!(got.dims(), &[2, 4, HIDDEN]);
            close(&got, &want, 1e-5, &format!("{what}: embedding"));
        });
    }
    // The one-rank world without collectives gives the same.
    let group = TpGroup::single();
    let vb = var_builder(&path);
    let x = Tensor::from_vec(x.clone(), (rows, IN), &Device::Cpu).unwrap();
    let c = ColumnParallelLinear::load(&vb.pp("col"), &group, IN, OUT, true).unwrap();
    close(&c.forward_gathered(&x).unwrap(), &col, 1e-5, "single");
}

#[test]
fn skip_mode_leaves_the_sums_out() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    write_weights(&path);
    let w = weights();
    let x = data(8, 2 * OUT);
    on_ranks(2, |group| {
        let r = group.rank();
        let vb = var_builder(&path);
        let rp = RowParallelLinear::load(&vb.pp("row"), &group, OUT, ROW_OUT, true).unwrap();
        let mine = columns(&x, OUT, r * OUT / 2..(r + 1) * OUT / 2);
        let weight = columns(&w["row.weight"], OUT, r * OUT / 2..(r + 1) * OUT / 2);
        let partial = host_linear(&mine, &weight, &w["row.bias"], OUT / 2, ROW_OUT);
        let block = Tensor::from_vec(mine, (2, OUT / 2), &Device::Cpu).unwrap();
        group.set_skip_collectives(true);
        assert!(group.skips_collectives());
        close(&rp.forward(&block).unwrap(), &partial, 1e-5, "skipped sum");
        group.set_skip_collectives(false);
        let whole = host_linear(&x, &w["row.weight"], &w["row.bias"], OUT, ROW_OUT);
        close(&rp.forward(&block).unwrap(), &whole, 1e-5, "summed");
    });
}

#[test]
fn shards_that_do_not_fit_are_typed_errors_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    write_weights(&path);
    // 12 output features over 5 ranks.
    for err in on_ranks(5, |group| {
        let vb = var_builder(&path);
        ColumnParallelLinear::load(&vb.pp("col"), &group, IN, OUT, false).unwrap_err()
    }) {
        assert!(
            matches!(
                err,
                Error::NotDivisible {
                    world_size: 5,
                    dim: 0,
                    ..
                }
            ),
            "{err}"
        );
    }
    // The caller says 12 rows, the file has 13: the file's split fails.
    for err in on_ranks(2, |group| {
        let vb = var_builder(&path);
        ColumnParallelLinear::load(&vb.pp("odd"), &group, IN, OUT, false).unwrap_err()
    }) {
        match err {
            Error::NotDivisible { shape, .. } => assert_eq!(shape, [13, IN]),
            other => panic!("{other}"),
        }
    }
    // The caller says 9 input features, the file has 8: the shard's shape is wrong.
    for n in [1, 2] {
        for err in on_ranks(n, |group| {
            let vb = var_builder(&path);
            ColumnParallelLinear::load(&vb.pp("col"), &group, IN + 1, OUT, false).unwrap_err()
        }) {
            match err {
                Error::ShardShape { expected, got, .. } => {
                    assert_eq!(expected, [OUT / n, IN + 1]);
                    assert_eq!(got, [OUT / n, IN]);
                }
                other => panic!("{n} ranks: {other}"),
            }
        }
    }
    // A row-parallel bias is whole: its shape is checked as such.
    for err in on_ranks(2, |group| {
        let vb = var_builder(&path);
        RowParallelLinear::load(&vb.pp("bad"), &group, OUT, ROW_OUT, true).unwrap_err()
    }) {
        match err {
            Error::ShardShape {
                name,
                expected,
                got,
            } => {
                assert_eq!(name, "bad.bias");
                assert_eq!((expected, got), (vec![ROW_OUT], vec![ROW_OUT + 1]));
            }
            other => panic!("{other}"),
        }
    }
}

#[test]
fn ranks_with_different_fingerprints_all_fail() {
    let results = on_ranks(3, |group| {
        let same = group.agree("same", 42, &Device::Cpu);
        let differs = group.agree("differs", group.rank() as u64 % 2, &Device::Cpu);
        let gathered = group
            .all_gather_dim(
                &Tensor::new(&[[group.rank() as f32]], &Device::Cpu).unwrap(),
                1,
            )
            .unwrap();
        let total = group
            .all_reduce(&Tensor::new(&[1u32], &Device::Cpu).unwrap(), ReduceOp::Sum)
            .unwrap();
        (same, differs, gathered, total)
    });
    for (same, differs, gathered, total) in results {
        same.unwrap();
        match differs.unwrap_err() {
            Error::Mismatch { what, ranks } => {
                assert_eq!(what, "differs");
                assert_eq!(ranks, [1]);
            }
            other => panic!("{other}"),
        }
        assert_eq!(gathered.to_vec2::<f32>().unwrap(), [[0.0, 1.0, 2.0]]);
        assert_eq!(total.to_vec1::<u32>().unwrap(), [3]);
    }
}

/// RMSNorm's epsilon in the epilogue tests.
const EPS: f32 = 1e-5;

/// The elements of `t` as f32, in order.
fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all()
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.to_vec1::<f32>())
        .unwrap()
}

#[test]
fn the_epilogue_defaults_to_sum_add_norm() {
    const HIDDEN: usize = 16;
    let shape = (1, 3, HIDDEN);
    let len = 3 * HIDDEN;
    let (residual, weight) = (data(40, len), data(41, HIDDEN));
    for n in [1, 2, 3] {
        let everyone: Vec<Vec<f32>> = (0..n).map(|r| data(20 + r as u64, len)).collect();
        let sum: Vec<f32> = (0..len)
            .map(|i| everyone.iter().map(|p| p[i]).sum())
            .collect();
        let (want_residual, want_normed) = host_add_rms_norm(&sum, &residual, &weight, EPS);
        on_ranks(n, |group| {
            let r = group.rank();
            let what = format!("rank {r} of {n}");
            for dtype in [DType::F32, DType::BF16] {
                let tensor = |v: &[f32], shape: &[usize]| {
                    Tensor::from_slice(v, shape, &Device::Cpu)
                        .and_then(|t| t.to_dtype(dtype))
                        .unwrap()
                };
                let partial = tensor(&everyone[r], &[1, 3, HIDDEN]);
                let residual = tensor(&residual, &[1, 3, HIDDEN]);
                let weight = tensor(&weight, &[HIDDEN]);
                let (got_residual, got_normed) = group
                    .all_reduce_add_rms_norm(&partial, &residual, &weight, EPS)
                    .unwrap();
                assert_eq!(got_residual.dims(), &[1, 3, HIDDEN]);
                assert_eq!(got_normed.dtype(), dtype);
                // The explicit sequence, bit for bit.
                let sum = group.all_reduce(&partial, ReduceOp::Sum).unwrap();
                let explicit = (&sum + &residual).unwrap();
                let normed = candle_nn::ops::rms_norm(&explicit, &weight, EPS).unwrap();
                assert_eq!(
                    values(&got_residual),
                    values(&explicit),
                    "{what}, {dtype:?}"
                );
                assert_eq!(values(&got_normed), values(&normed), "{what}, {dtype:?}");
                if dtype == DType::F32 {
                    let what = format!("{what}: against the host");
                    close(&got_residual, &want_residual, 1e-5, &what);
                    close(&got_normed, &want_normed, 1e-5, &what);
                }
            }
            // Skip mode: this rank's partial output stands for the sum.
            let partial = Tensor::from_slice(&everyone[r], shape, &Device::Cpu).unwrap();
            let residual = Tensor::from_slice(&residual, shape, &Device::Cpu).unwrap();
            let weight = Tensor::from_slice(&weight, HIDDEN, &Device::Cpu).unwrap();
            group.set_skip_collectives(true);
            let skipped = group.all_reduce_add_rms_norm(&partial, &residual, &weight, EPS);
            group.set_skip_collectives(false);
            let (skipped_residual, skipped_normed) = skipped.unwrap();
            let mine = host_add_rms_norm(&everyone[r], &values(&residual), &values(&weight), EPS);
            close(
                &skipped_residual,
                &mine.0,
                1e-5,
                &format!("{what}: skipped"),
            );
            close(&skipped_normed, &mine.1, 1e-5, &format!("{what}: skipped"));
            // Refused before the sum, alike on every rank; the ranks stay in step.
            let other = Tensor::zeros((3, HIDDEN), DType::F32, &Device::Cpu).unwrap();
            let long = Tensor::ones(HIDDEN + 1, DType::F32, &Device::Cpu).unwrap();
            let wide = weight.to_dtype(DType::F64).unwrap();
            for (residual, weight, shape_error) in [
                (&other, &weight, true),
                (&residual, &long, true),
                (&residual, &wide, false),
            ] {
                match group.all_reduce_add_rms_norm(&partial, residual, weight, EPS) {
                    Err(Error::Shape { .. }) if shape_error => {}
                    Err(Error::Argument { .. }) if !shape_error => {}
                    other => panic!("{what}: {other:?}"),
                }
            }
            let one = Tensor::new(&[1u32], &Device::Cpu).unwrap();
            let count = group.all_reduce(&one, ReduceOp::Sum).unwrap();
            assert_eq!(count.to_vec1::<u32>().unwrap(), [n as u32]);
        });
    }
}

#[test]
fn a_row_parallel_layer_adds_and_normalises_after_its_sum() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    write_weights(&path);
    let w = weights();
    let x = data(60, 2 * OUT);
    let residual = data(61, 2 * ROW_OUT);
    let norm = data(62, ROW_OUT);
    let zeros = vec![0.0; ROW_OUT];
    for bias in [false, true] {
        let b = if bias { &w["row.bias"] } else { &zeros };
        let y = host_linear(&x, &w["row.weight"], b, OUT, ROW_OUT);
        let (want_residual, want_normed) = host_add_rms_norm(&y, &residual, &norm, EPS);
        for n in [1, 2, 3] {
            on_ranks(n, |group| {
                let r = group.rank();
                let what = format!("rank {r} of {n}, bias {bias}");
                let vb = var_builder(&path);
                let rp =
                    RowParallelLinear::load(&vb.pp("row"), &group, OUT, ROW_OUT, bias).unwrap();
                let mine = columns(&x, OUT, r * OUT / n..(r + 1) * OUT / n);
                let block = Tensor::from_vec(mine, (2, OUT / n), &Device::Cpu).unwrap();
                let residual = Tensor::from_slice(&residual, (2, ROW_OUT), &Device::Cpu).unwrap();
                let norm = Tensor::from_slice(&norm, ROW_OUT, &Device::Cpu).unwrap();
                let (got_residual, got_normed) = rp
                    .forward_add_rms_norm(&block, &residual, &norm, EPS)
                    .unwrap();
                close(&got_residual, &want_residual, 1e-5, &what);
                close(&got_normed, &want_normed, 1e-5, &what);
                // The norm's weight must fit the layer's output.
                let long = Tensor::ones(ROW_OUT + 1, DType::F32, &Device::Cpu).unwrap();
                let err = rp
                    .forward_add_rms_norm(&block, &residual, &long, EPS)
                    .unwrap_err();
                assert!(matches!(err, Error::Shape { .. }), "{what}: {err}");
            });
        }
    }
}
