//! `nccl_candle::models` on the CPU, through the real loading code, on checkpoints the
//! `hf_checkpoint` example writes (every preset: four families, GQA, an odd vocabulary,
//! tied and untied heads, bf16 and f32 files, one file and shards):
//!
//! * one rank against candle-transformers 0.11.1's own model of the family, in f32: the same
//!   greedy tokens and every logit within [`F32_TOLERANCE`] of candle's;
//! * 2, 3 and 4 ranks (threads, `ThreadedCollectives`) against one rank: the same tokens
//!   under the near-tie rule, logits within the same tolerance; a rank count a shape does not
//!   split into is refused alike on every rank;
//! * Mistral's window over a prompt longer than it, step by step against all at once;
//! * bad checkpoints refused with typed errors on every rank, before any other collective.

#[path = "support/greedy.rs"]
mod greedy;
#[path = "support/reference.rs"]
mod reference;
#[path = "../examples/hf_checkpoint/writer.rs"]
mod writer;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use nccl_candle::models::{CausalLm, Checkpoint};
use nccl_candle::tp::{ThreadedCollectives, TpGroup};
use nccl_candle::{CheckpointFault, Error};

use greedy::{compare, compare_within, decode, last_logits, written};
use reference::Reference;
use writer::{Family, Spec};

/// Greedy steps after the prompt.
const STEPS: usize = 8;
const PROMPT: &str = "The quick brown fox jumps over the lazy dog, and then";

fn prompt(checkpoint: &Checkpoint, max: usize) -> Vec<u32> {
    let tokenizer = checkpoint.tokenizer().unwrap();
    let mut ids = tokenizer.encode(PROMPT, true).unwrap().get_ids().to_vec();
    ids.truncate(max);
    ids
}

fn ours(checkpoint: &Checkpoint, group: &TpGroup, max_seq: usize) -> CausalLm {
    ours_as(checkpoint, group, max_seq, DType::F32)
}

fn ours_as(checkpoint: &Checkpoint, group: &TpGroup, max_seq: usize, dtype: DType) -> CausalLm {
    CausalLm::load(checkpoint, group, dtype, &Device::Cpu, max_seq)
        .unwrap_or_else(|e| panic!("rank {}: {e}", group.rank()))
}

/// Every rank's result of `body` on a group of `n` ranks simulated on threads.
fn on_threads<T: Send>(n: usize, body: impl Fn(TpGroup) -> T + Sync) -> Vec<T> {
    let ranks = ThreadedCollectives::group(n).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                let body = &body;
                scope.spawn(move || body(TpGroup::new(rank).unwrap()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Whether `n` ranks split `spec` (query heads, MLP features; key/value heads split or
/// replicate).
fn splits(spec: &Spec, n: usize) -> bool {
    spec.heads.is_multiple_of(n)
        && spec.intermediate.is_multiple_of(n)
        && (spec.kv_heads.is_multiple_of(n) || n.is_multiple_of(spec.kv_heads))
}

#[test]
fn one_rank_matches_candle_transformers_and_ranks_match_one_rank() {
    let mut compared = Vec::new();
    for spec in writer::presets() {
        let dir = written(&spec);
        let checkpoint = Checkpoint::open(dir.path()).unwrap();
        // candle-transformers' Mistral applies its window only to a prompt, and one key
        // wider than Hugging Face's; within the window the two are the same model.
        let (max_prompt, steps) = match spec.sliding_window {
            Some(w) if spec.family == Family::Mistral => (w - w / 2, w / 2),
            _ => (usize::MAX, STEPS),
        };
        let prompt = prompt(&checkpoint, max_prompt);
        let max_seq = prompt.len() + steps;
        let mut single = ours(&checkpoint, &TpGroup::single(), max_seq);
        // One rank reads every tensor whole, nothing else.
        assert_eq!(
            single.shard_bytes(),
            checkpoint.weight_bytes(),
            "{}",
            spec.name
        );
        let one = decode(
            |ids, at| last_logits(&mut single, ids, at),
            &prompt,
            steps,
            None,
        );
        // candle-transformers' Llama has no attention biases (it would ignore them).
        if !(spec.family == Family::Llama && spec.attention_bias) {
            let mut candle = Reference::load(&spec, dir.path());
            let want = decode(
                |ids, at| candle.forward(ids, at),
                &prompt,
                steps,
                Some(&one.tokens),
            );
            compare(
                &format!("{} vs candle-transformers", spec.name),
                &want,
                &one,
            );
            assert_eq!(want.tokens, one.tokens, "{}: greedy tokens", spec.name);
        }
        for n in 2..=4 {
            let results = on_threads(n, |group| {
                let rank = group.rank();
                match CausalLm::load(&checkpoint, &group, DType::F32, &Device::Cpu, max_seq) {
                    Ok(mut model) => {
                        let run = decode(
                            |ids, at| last_logits(&mut model, ids, at),
                            &prompt,
                            steps,
                            Some(&one.tokens),
                        );
                        Ok((run, model.shard_bytes()))
                    }
                    Err(e) => Err(format!("rank {rank}: {e}")),
                }
            });
            if splits(&spec, n) {
                let mut read = 0;
                for (rank, result) in results.into_iter().enumerate() {
                    let (run, bytes) = result.unwrap_or_else(|e| panic!("{}: {e}", spec.name));
                    compare(&format!("{}, rank {rank} of {n}", spec.name), &one, &run);
                    // Each rank reads its part: less than the whole, and together at least
                    // the whole (norms and replicated key/value heads on several).
                    assert!(
                        bytes < checkpoint.weight_bytes(),
                        "{}: rank {rank} read {bytes}",
                        spec.name
                    );
                    read += bytes;
                }
                assert!(
                    read >= checkpoint.weight_bytes(),
                    "{} x{n}: {read} bytes read",
                    spec.name
                );
                compared.push(format!("{} x{n}", spec.name));
            } else {
                for result in results {
                    let err = result
                        .err()
                        .unwrap_or_else(|| panic!("{}: {n} ranks loaded", spec.name));
                    assert!(err.contains("does not split"), "{}: {err}", spec.name);
                }
            }
        }
    }
    println!("compared with one rank: {compared:?}");
    // The presets cover each rank count somewhere.
    for n in 2..=4 {
        assert!(
            compared.iter().any(|c| c.ends_with(&format!("x{n}"))),
            "{n} ranks never ran"
        );
    }
}

/// Largest |logit difference| allowed in bf16 against candle-transformers in bf16, relative
/// to the largest |logit|: both round every activation to bf16's 8 bits (2^-8 relative) but
/// in other places (this model's scores and softmax in f32, its rotary tables from f64, each
/// side's own matmul blocking), differences that compound through the layers; 5e-2 is the
/// bound `llama_tp` and `generate --check` use for bf16.
const BF16_TOLERANCE: f32 = 5e-2;

#[test]
fn one_rank_in_bf16_matches_candle_transformers_in_bf16() {
    let mut compared = 0;
    for spec in writer::presets() {
        if spec.dtype != DType::BF16 {
            continue;
        }
        let dir = written(&spec);
        let checkpoint = Checkpoint::open(dir.path()).unwrap();
        let prompt = prompt(&checkpoint, usize::MAX);
        let max_seq = prompt.len() + STEPS;
        let mut model = ours_as(&checkpoint, &TpGroup::single(), max_seq, DType::BF16);
        let one = decode(
            |ids, at| last_logits(&mut model, ids, at),
            &prompt,
            STEPS,
            None,
        );
        let mut candle = Reference::load_as(&spec, dir.path(), DType::BF16);
        let want = decode(
            |ids, at| candle.forward(ids, at),
            &prompt,
            STEPS,
            Some(&one.tokens),
        );
        let what = format!("{} bf16 vs candle-transformers bf16", spec.name);
        let worst = compare_within(&what, &want, &one, BF16_TOLERANCE);
        println!("{what}: worst |logit difference| {worst:.2e} of the largest |logit|");
        compared += 1;
    }
    assert!(compared >= 3, "{compared} bf16 presets");
}

#[test]
fn a_window_shorter_than_the_prompt_gives_the_same_logits_step_by_step() {
    let spec = writer::preset("mistral-window-f32").unwrap();
    let window = spec.sliding_window.unwrap();
    let dir = written(&spec);
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    let ids = prompt(&checkpoint, usize::MAX);
    assert!(ids.len() > 2 * window, "a prompt of {} tokens", ids.len());
    let mut all_at_once = ours(&checkpoint, &TpGroup::single(), ids.len());
    let whole = last_logits(&mut all_at_once, &ids, 0);
    let mut stepped = ours(&checkpoint, &TpGroup::single(), ids.len());
    let mut last = Vec::new();
    for (at, id) in ids.iter().enumerate() {
        last = last_logits(&mut stepped, &[*id], at);
    }
    let worst = whole
        .iter()
        .zip(&last)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst < 1e-4,
        "window: all at once vs step by step differ by {worst}"
    );
    // The window matters: the first token is out of the last query's sight, so changing it
    // changes nothing, while changing a token inside the window does.
    let mut changed = ids.clone();
    changed[0] = (changed[0] + 1) % 300;
    let mut model = ours(&checkpoint, &TpGroup::single(), ids.len());
    let far = last_logits(&mut model, &changed, 0);
    // Layers widen the sight: 2 layers see 2 * (window - 1) back.
    assert_eq!(
        far, whole,
        "a token outside every layer's window changed the logits"
    );
    let mut near = ids.clone();
    let at = ids.len() - 2;
    near[at] = (near[at] + 1) % 300;
    model.reset().unwrap();
    let close = last_logits(&mut model, &near, 0);
    assert_ne!(close, whole, "a token inside the window changed nothing");
}

/// Every rank's error of loading `dirs[rank]`'s checkpoint.
fn load_errors(dirs: &[&Path], max_seq: usize) -> Vec<Error> {
    on_threads(dirs.len(), |group| {
        let dir = dirs[group.rank()];
        let err = CausalLm::load_dir(dir, &group, DType::F32, &Device::Cpu, max_seq).err();
        err.unwrap_or_else(|| panic!("rank {} loaded", group.rank()))
    })
}

fn fault_of(err: &Error) -> Option<CheckpointFault> {
    match err {
        Error::Checkpoint { fault, .. } => Some(*fault),
        _ => None,
    }
}

/// Rewrites `file` (a safetensors file) through `edit` of its tensors.
fn rewrite(file: &Path, edit: impl FnOnce(&mut std::collections::HashMap<String, Tensor>)) {
    let mut tensors = candle_core::safetensors::load(file, &Device::Cpu).unwrap();
    edit(&mut tensors);
    candle_core::safetensors::save(&tensors, file).unwrap();
}

/// A weights file cut short after the checkpoint was opened (its headers read): the load is a
/// typed error on every rank, not a crash (a mapping of the file would fault past its end).
#[test]
fn a_file_cut_short_after_opening_is_an_error_on_every_rank() {
    let spec = writer::preset("llama-gqa-bf16").unwrap();
    let dir = written(&spec);
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    let file = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let results = on_threads(2, |group| {
        CausalLm::load(&checkpoint, &group, DType::F32, &Device::Cpu, 16).err()
    });
    let faults: Vec<String> = results
        .into_iter()
        .map(|err| err.expect("a load of a file cut short").to_string())
        .collect();
    // The rank whose bytes are gone says why; every rank refuses.
    assert!(
        faults.iter().any(|f| f.contains("cannot read")),
        "{faults:?}"
    );
}

#[test]
fn bad_checkpoints_are_typed_errors_on_every_rank() {
    let spec = writer::preset("llama-gqa-bf16").unwrap();
    let good = written(&spec);
    let weights = |dir: &Path| dir.join("model.safetensors");
    let copy = |edit: &dyn Fn(&Path)| {
        let dir = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(good.path()).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
        }
        edit(dir.path());
        dir
    };
    let set_config = |dir: &Path, edit: &dyn Fn(&mut serde_json::Value)| {
        let path = dir.join("config.json");
        let mut value: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(&mut value);
        std::fs::write(path, value.to_string()).unwrap();
    };
    // (what, the directory, the fault every rank sees, what the message names)
    let cases: Vec<(&str, tempfile::TempDir, CheckpointFault, &str)> = vec![
        (
            "no config",
            copy(&|d| std::fs::remove_file(d.join("config.json")).unwrap()),
            CheckpointFault::Missing,
            "config.json",
        ),
        (
            "config not JSON",
            copy(&|d| std::fs::write(d.join("config.json"), "{ hidden_size: 1").unwrap()),
            CheckpointFault::Malformed,
            "config.json",
        ),
        (
            "a required field missing",
            copy(&|d| {
                set_config(d, &|v| {
                    v.as_object_mut().unwrap().remove("num_hidden_layers");
                })
            }),
            CheckpointFault::Malformed,
            "num_hidden_layers",
        ),
        (
            "another architecture",
            copy(&|d| {
                set_config(d, &|v| {
                    v["model_type"] = "gemma".into();
                    v["architectures"] = serde_json::json!(["GemmaForCausalLM"]);
                })
            }),
            CheckpointFault::Unsupported,
            "gemma",
        ),
        (
            "no weights",
            copy(&|d| std::fs::remove_file(weights(d)).unwrap()),
            CheckpointFault::Missing,
            "model.safetensors",
        ),
        (
            "weights not safetensors",
            copy(&|d| std::fs::write(weights(d), b"not a safetensors file at all").unwrap()),
            CheckpointFault::Malformed,
            "model.safetensors",
        ),
        (
            "a tensor missing",
            copy(&|d| {
                rewrite(&weights(d), |t| {
                    t.remove("model.layers.1.mlp.up_proj.weight");
                })
            }),
            CheckpointFault::Tensor,
            "model.layers.1.mlp.up_proj.weight",
        ),
        (
            "a tensor of the wrong shape",
            copy(&|d| {
                rewrite(&weights(d), |t| {
                    let k = t["model.layers.0.self_attn.k_proj.weight"]
                        .narrow(0, 0, 16)
                        .unwrap();
                    t.insert("model.layers.0.self_attn.k_proj.weight".into(), k);
                })
            }),
            CheckpointFault::Tensor,
            "model.layers.0.self_attn.k_proj.weight",
        ),
    ];
    for (what, dir, fault, named) in &cases {
        let errors = load_errors(&[dir.path(), dir.path()], 32);
        for (rank, err) in errors.iter().enumerate() {
            assert_eq!(fault_of(err), Some(*fault), "{what}: rank {rank}: {err}");
            assert!(
                err.to_string().contains(named),
                "{what}: rank {rank}: {err} does not name {named}"
            );
        }
    }
    // One rank's checkpoint bad, the other's good: the bad one's own error there, the
    // other refused by its peer, before any collective of the model.
    let broken = &cases[6].1;
    let errors = load_errors(&[good.path(), broken.path()], 32);
    assert!(
        matches!(errors[0], Error::PeerRefused { ref ranks, .. } if ranks == &[1]),
        "{}",
        errors[0]
    );
    assert_eq!(
        fault_of(&errors[1]),
        Some(CheckpointFault::Tensor),
        "{}",
        errors[1]
    );
    // One rank cannot even open its copy (no config.json there): its own error there, a
    // refusal on the other, no rank left waiting.
    let errors = load_errors(&[good.path(), cases[0].1.path()], 32);
    assert!(
        matches!(errors[0], Error::PeerRefused { ref ranks, .. } if ranks == &[1]),
        "{}",
        errors[0]
    );
    assert_eq!(
        fault_of(&errors[1]),
        Some(CheckpointFault::Missing),
        "{}",
        errors[1]
    );
    // Two good checkpoints that differ (another seed): a mismatch on every rank.
    let other = written(&Spec {
        seed: spec.seed + 1,
        ..spec.clone()
    });
    for err in load_errors(&[good.path(), other.path()], 32) {
        assert!(
            matches!(err, Error::Mismatch { ref ranks, .. } if ranks == &[1]),
            "{err}"
        );
    }
    // Arguments that differ: a mismatch too.
    let errors = on_threads(2, |group| {
        let checkpoint = Checkpoint::open(good.path()).unwrap();
        let max_seq = 16 + group.rank();
        CausalLm::load(&checkpoint, &group, DType::F32, &Device::Cpu, max_seq)
            .err()
            .unwrap()
    });
    for err in errors {
        assert!(matches!(err, Error::Mismatch { .. }), "{err}");
    }
    // A dimension that does not split (8 query heads over 3 ranks), on every rank alike.
    for err in load_errors(&[good.path(), good.path(), good.path()], 32) {
        assert!(
            matches!(err, Error::NotDivisible { ref name, .. } if name == "num_attention_heads"),
            "{err}"
        );
    }
    // A tokenizer that cannot be read.
    let dir = copy(&|d| std::fs::write(d.join("tokenizer.json"), "{\"model\": 3}").unwrap());
    let err = Checkpoint::open(dir.path())
        .unwrap()
        .tokenizer()
        .unwrap_err();
    assert_eq!(fault_of(&err), Some(CheckpointFault::Malformed), "{err}");
    let dir = copy(&|d| std::fs::remove_file(d.join("tokenizer.json")).unwrap());
    let err = Checkpoint::open(dir.path())
        .unwrap()
        .tokenizer()
        .unwrap_err();
    assert_eq!(fault_of(&err), Some(CheckpointFault::Missing), "{err}");
}

#[test]
fn a_stale_offset_is_refused_and_reset_starts_over() {
    let spec = writer::preset("qwen3-headdim-f32").unwrap();
    let dir = written(&spec);
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    let ids = prompt(&checkpoint, 6);
    let mut model = ours(&checkpoint, &TpGroup::single(), 16);
    let first = last_logits(&mut model, &ids, 0);
    let input = Tensor::new(&ids[..1], &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    assert!(matches!(
        model.forward(&input, 0),
        Err(Error::Argument { .. })
    ));
    assert_eq!(model.cached(), ids.len());
    model.reset().unwrap();
    assert_eq!(last_logits(&mut model, &ids, 0), first);
    let long = Tensor::zeros((1, 17), DType::U32, &Device::Cpu).unwrap();
    model.reset().unwrap();
    assert!(matches!(
        model.forward(&long, 0),
        Err(Error::Argument { .. })
    ));
}
