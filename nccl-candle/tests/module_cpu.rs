//! The tensor-parallel layers as candle modules, on CPU tensors with ranks simulated on
//! threads (`ThreadedCollectives`): through `&dyn Module`, `Tensor::apply` and a
//! `candle_nn::seq()` they give what their own `forward` gives, and this crate's errors pass
//! through a function returning `candle_core::Result` with `?`, their type still reachable.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::var_builder::{ShardedSafeTensors, ShardedVarBuilder};
use nccl_candle::tp::{
    ColumnParallelLinear, RowParallelLinear, ThreadedCollectives, TpGroup, VocabParallelEmbedding,
};
use nccl_candle::Error;

mod common;
use common::{close, data, host_f32, host_linear};

const IN: usize = 8;
const OUT: usize = 12;
const ROW_OUT: usize = 6;
const VOCAB: usize = 12;
const HIDDEN: usize = 8;

/// The layers are candle modules, checked when this compiles.
#[allow(dead_code)]
fn assert_module<M: Module + Clone + 'static>() {}
const _: fn() = || {
    assert_module::<ColumnParallelLinear>();
    assert_module::<RowParallelLinear>();
    assert_module::<VocabParallelEmbedding>();
};

fn write_weights(path: &Path) {
    let shapes: [(&str, Vec<usize>, u64); 6] = [
        ("col.weight", vec![OUT, IN], 1),
        ("col.bias", vec![OUT], 2),
        ("row.weight", vec![ROW_OUT, OUT], 3),
        ("row.bias", vec![ROW_OUT], 4),
        ("emb.weight", vec![VOCAB, HIDDEN], 5),
        ("odd.weight", vec![13, IN], 6),
    ];
    let tensors: HashMap<String, Tensor> = shapes
        .into_iter()
        .map(|(name, shape, seed)| {
            let len = shape.iter().product();
            let t = Tensor::from_vec(data(seed, len), shape, &Device::Cpu).unwrap();
            (name.to_string(), t)
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

/// candle-nn style code: a column- then a row-parallel layer as one `Sequential`, built and
/// run in a function returning candle's `Result`, with `?` on this crate's calls.
fn mlp(vb: &ShardedVarBuilder, group: &TpGroup, x: &Tensor) -> candle_core::Result<Tensor> {
    let up = ColumnParallelLinear::load(&vb.pp("col"), group, IN, OUT, true)?;
    let down = RowParallelLinear::load(&vb.pp("row"), group, OUT, ROW_OUT, true)?;
    let model = candle_nn::seq().add(up).add(down);
    x.apply(&model)
}

#[test]
fn layers_are_modules_that_give_what_forward_gives() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    write_weights(&path);
    let x = data(7, 2 * 3 * IN);
    let col_w = data(1, OUT * IN);
    let col = host_linear(&x, &col_w, &data(2, OUT), IN, OUT);
    let want = host_linear(
        &col,
        &data(3, ROW_OUT * OUT),
        &data(4, ROW_OUT),
        OUT,
        ROW_OUT,
    );
    for n in [1, 2, 3] {
        on_ranks(n, |group| {
            let what = format!("rank {} of {n}", group.rank());
            let vb = var_builder(&path);
            let x = Tensor::from_vec(x.clone(), (2, 3, IN), &Device::Cpu).unwrap();
            close(&mlp(&vb, &group, &x).unwrap(), &want, 1e-5, &what);

            // As trait objects, beside candle-nn's own modules.
            let c = ColumnParallelLinear::load(&vb.pp("col"), &group, IN, OUT, true).unwrap();
            let r = RowParallelLinear::load(&vb.pp("row"), &group, OUT, ROW_OUT, true).unwrap();
            let inherent = r.forward(&c.forward(&x).unwrap()).unwrap();
            let layers: Vec<Box<dyn Module>> = vec![Box::new(c), Box::new(r)];
            let mut h = x.clone();
            for layer in &layers {
                h = layer.forward(&h).unwrap();
            }
            assert_eq!(host_f32(&h), host_f32(&inherent), "{what}");

            // The embedding, then a column-parallel layer, in one `Sequential`.
            let e = VocabParallelEmbedding::load(&vb.pp("emb"), &group, VOCAB, HIDDEN).unwrap();
            let ids = Tensor::new(&[[0u32, 11, 3], [4, 7, 8]], &Device::Cpu).unwrap();
            let looked_up = e.forward(&ids).unwrap();
            let c = ColumnParallelLinear::load(&vb.pp("col"), &group, IN, OUT, true).unwrap();
            let inherent = c.forward(&looked_up).unwrap();
            let embed_up = candle_nn::seq().add(e).add(c);
            let block = ids.apply(&embed_up).unwrap();
            assert_eq!(host_f32(&block), host_f32(&inherent), "{what}");
        });
    }
}

#[test]
fn errors_pass_through_candle_code_with_their_type() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.safetensors");
    write_weights(&path);
    on_ranks(2, |group| {
        let vb = var_builder(&path);
        // Loading: 13 rows do not split over 2 ranks, refused inside a candle function.
        let load = |vb: &ShardedVarBuilder| -> candle_core::Result<ColumnParallelLinear> {
            Ok(ColumnParallelLinear::load(
                &vb.pp("odd"),
                &group,
                IN,
                13,
                false,
            )?)
        };
        let err = load(&vb).unwrap_err();
        assert!(err.to_string().contains("does not split"), "{err}");
        assert!(
            matches!(
                Error::find_in(&err),
                Some(Error::NotDivisible {
                    dim: 0,
                    world_size: 2,
                    ..
                })
            ),
            "{err}"
        );
        // And back into this crate's error, as it was.
        assert!(matches!(Error::from(err), Error::NotDivisible { .. }));

        // Forward: an input of the wrong width, through `Module`.
        let c = ColumnParallelLinear::load(&vb.pp("col"), &group, IN, OUT, true).unwrap();
        let module: &dyn Module = &c;
        let wrong = Tensor::zeros((2, IN + 1), DType::F32, &Device::Cpu).unwrap();
        let err = module.forward(&wrong).unwrap_err();
        assert!(
            matches!(
                Error::find_in(&err),
                Some(Error::Shape {
                    op: "ColumnParallelLinear::forward",
                    ..
                })
            ),
            "{err}"
        );
        // candle's own errors stay candle's: a matmul of mismatched types.
        let ints = Tensor::zeros((2, IN), DType::U32, &Device::Cpu).unwrap();
        let err = module.forward(&ints).unwrap_err();
        assert!(Error::find_in(&err).is_none(), "{err}");
    });
}
