//! The `llama_tp` example's model on CPU tensors, ranks simulated on threads
//! (`ThreadedCollectives`): split over 2 and 4 ranks, it decodes the same tokens as the whole
//! model, with the same logits, loaded through `ShardedVarBuilder` from the example's own
//! weights file; arranged for the fused epilogue (`Llama::set_fused`), too. Everything of the
//! example but NCCL and the CUDA kernels.

#[allow(dead_code)]
#[path = "../examples/llama_tp/decode.rs"]
mod decode;
#[allow(dead_code)]
#[path = "../examples/llama_tp/model.rs"]
mod model;
#[allow(dead_code)]
#[path = "../examples/llama_tp/weights.rs"]
mod weights;

use std::path::Path;

use candle_core::{DType, Device};
use candle_nn::var_builder::{ShardedSafeTensors, ShardedVarBuilder};
use nccl_candle::tp::{ThreadedCollectives, TpGroup};

use decode::{compare, decode, prompt, Feed, Run};
use model::{Config, Llama};

fn var_builder(path: &Path, dtype: DType) -> ShardedVarBuilder<'static> {
    // SAFETY: the file is this test's own, in its private directory, unchanged while mapped.
    unsafe { ShardedSafeTensors::var_builder(&[path], dtype, &Device::Cpu) }.unwrap()
}

/// Grouped-query (8 query heads, 4 key/value heads), small enough for a debug build.
fn tiny() -> Config {
    Config {
        vocab: 64,
        hidden: 64,
        intermediate: 96,
        layers: 2,
        heads: 8,
        kv_heads: 4,
    }
}

struct Case {
    cfg: Config,
    dtype: DType,
    batch: usize,
    prompt_len: usize,
    new_tokens: usize,
}

impl Case {
    fn max_seq(&self) -> usize {
        self.prompt_len + self.new_tokens
    }

    fn prompt(&self) -> Vec<u32> {
        prompt(self.cfg.vocab, self.batch, self.prompt_len, 3)
    }

    /// The whole model's greedy decode, logits recorded.
    fn reference(&self, path: &Path) -> Run {
        let vb = var_builder(path, self.dtype);
        let mut model = Llama::load(&vb, &TpGroup::single(), &self.cfg, self.max_seq()).unwrap();
        let ids = self.prompt();
        decode(
            &mut model,
            &ids,
            self.batch,
            self.new_tokens,
            Feed::Greedy,
            true,
            &Device::Cpu,
        )
        .unwrap()
    }

    /// Rank 0's decode over `n` simulated ranks, the forward pass `fused` or not.
    fn split(&self, path: &Path, n: usize, feed: Feed<'_>, fused: bool) -> Run {
        let ranks = ThreadedCollectives::group(n).unwrap();
        let ids = self.prompt();
        let mut runs: Vec<Run> = std::thread::scope(|scope| {
            let threads: Vec<_> = ranks
                .into_iter()
                .map(|rank| {
                    let ids = &ids;
                    scope.spawn(move || {
                        let group = TpGroup::new(rank).unwrap();
                        let vb = var_builder(path, self.dtype);
                        let mut model =
                            Llama::load(&vb, &group, &self.cfg, self.max_seq()).unwrap();
                        model.set_fused(fused);
                        let device = Device::Cpu;
                        decode(
                            &mut model,
                            ids,
                            self.batch,
                            self.new_tokens,
                            feed,
                            true,
                            &device,
                        )
                        .unwrap()
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        // Every rank has the same logits (all-gathered).
        for other in &runs[1..] {
            assert_eq!(other.tokens, runs[0].tokens);
            assert_eq!(other.logits, runs[0].logits);
        }
        runs.swap_remove(0)
    }
}

#[test]
fn the_split_model_decodes_like_the_whole_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.safetensors");
    let case = Case {
        cfg: tiny(),
        dtype: DType::F32,
        batch: 2,
        prompt_len: 5,
        new_tokens: 6,
    };
    weights::write(&case.cfg, 11, &path, 2).unwrap();
    let reference = case.reference(&path);
    assert_eq!(reference.tokens.len(), 6);
    assert_eq!(reference.logits[0].len(), 2 * 64);
    for n in [2, 4] {
        let forced = case.split(&path, n, Feed::Forced(&reference.tokens), false);
        let verdict = compare(&reference, &forced, case.cfg.vocab, 1e-5);
        assert!(verdict.passed(1e-5), "{n} ranks: {verdict:?}");
        assert_eq!(verdict.near_ties, 0, "{n} ranks: {verdict:?}");
        assert_eq!(verdict.compared, 12);
        let greedy = case.split(&path, n, Feed::Greedy, false);
        assert_eq!(greedy.tokens, reference.tokens, "{n} ranks, greedy");
    }
}

/// The forward pass arranged for the fused epilogue (each row-parallel sum with the next
/// norm, the first layer's input norm alone, the final norm after the last down_proj) is
/// the same model: here the epilogue runs its default, unfused sequence, so any difference
/// is the arrangement's.
#[test]
fn the_fused_arrangement_decodes_like_the_whole_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.safetensors");
    let case = Case {
        cfg: tiny(),
        dtype: DType::F32,
        batch: 2,
        prompt_len: 5,
        new_tokens: 6,
    };
    weights::write(&case.cfg, 12, &path, 2).unwrap();
    let reference = case.reference(&path);
    for n in [1, 2, 4] {
        let forced = case.split(&path, n, Feed::Forced(&reference.tokens), true);
        let verdict = compare(&reference, &forced, case.cfg.vocab, 1e-5);
        assert!(verdict.passed(1e-5), "{n} ranks, fused: {verdict:?}");
        assert_eq!(verdict.near_ties, 0, "{n} ranks, fused: {verdict:?}");
        assert_eq!(verdict.compared, 12);
        let greedy = case.split(&path, n, Feed::Greedy, true);
        assert_eq!(greedy.tokens, reference.tokens, "{n} ranks, fused, greedy");
    }
}

#[test]
fn the_weights_file_is_the_same_from_any_number_of_threads() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny();
    let (one, four) = (dir.path().join("1"), dir.path().join("4"));
    weights::write(&cfg, 5, &one, 1).unwrap();
    weights::write(&cfg, 5, &four, 4).unwrap();
    assert_eq!(std::fs::read(&one).unwrap(), std::fs::read(&four).unwrap());
    assert_eq!(
        weights::file_fingerprint(&one).unwrap(),
        weights::file_fingerprint(&four).unwrap()
    );
    let other = dir.path().join("other");
    weights::write(&cfg, 6, &other, 1).unwrap();
    assert_ne!(
        weights::file_fingerprint(&one).unwrap(),
        weights::file_fingerprint(&other).unwrap()
    );
}

#[test]
fn sizes_that_do_not_split_into_heads_are_refused() {
    let cfg = tiny();
    cfg.check(4).unwrap();
    assert!(cfg.check(8).is_err(), "4 key/value heads over 8 ranks");
    assert!(cfg.check(3).is_err());
    Config::small().check(8).unwrap();
    Config::large().check(8).unwrap();
    let params = Config::large().parameters() as f64 / 1e9;
    assert!((1.8..2.0).contains(&params), "{params}");
}

/// How far bf16 logits of the split model stray from the whole model's, against the
/// example's tolerance: `cargo test --test llama_tp_cpu -- --ignored --nocapture`. Seen
/// here (debug build, CPU, this commit): max |logit diff| 1.3% of the largest |logit|
/// with the small model, 1.7% with 8 layers of width 1024; and near-ties do happen.
#[test]
#[ignore = "slow in a debug build; prints the bf16 logit differences"]
fn bf16_logit_differences() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.safetensors");
    let case = Case {
        cfg: Config::small(),
        dtype: DType::BF16,
        batch: 2,
        prompt_len: 8,
        new_tokens: 8,
    };
    weights::write(&case.cfg, 42, &path, 2).unwrap();
    let reference = case.reference(&path);
    let tolerance = decode::tolerance(&reference, decode::relative_tolerance(DType::BF16));
    for n in [2, 4] {
        for fused in [false, true] {
            let forced = case.split(&path, n, Feed::Forced(&reference.tokens), fused);
            let verdict = compare(&reference, &forced, case.cfg.vocab, tolerance);
            println!("bf16, {n} ranks, fused {fused}: tolerance {tolerance}, {verdict:?}");
            assert!(verdict.passed(tolerance), "{verdict:?}");
        }
    }
}
