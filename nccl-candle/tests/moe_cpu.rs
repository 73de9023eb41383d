//! Mixture-of-experts models (Mixtral, Qwen3-MoE) of `nccl_candle::models` on the CPU, through
//! the real loading code, on checkpoints the `hf_checkpoint` example writes (its
//! [`moe_presets`](writer::moe_presets): experts in every layer or every other one, top 2 or
//! 4, weights renormalised or not, bf16 and f32 files, one file and shards, tied and untied):
//!
//! * the writer's checkpoints are complete: config.json has the fields `transformers` writes
//!   for the family, the files hold exactly the tensors named here from the spec, and
//!   candle-transformers 0.11.1's own model of the family reads every one of them and no
//!   other, and gives finite, varied logits;
//! * one rank against candle-transformers' model in f32: the same greedy tokens and every
//!   logit within `models_cpu`'s f32 tolerance of candle's (routing is a discrete choice of
//!   the activations, but the routers' logits are O(1) and a token's top-k apart by far more
//!   than f32 rounding, so both sides pick the same experts);
//! * 2 and 3 ranks (threads, `ThreadedCollectives`) against one rank, under the same rule;
//! * a rank count that does not split the experts is refused on every rank with
//!   [`Error::NotDivisible`] naming them, at the load's first agreement (no other collective).

#[path = "support/greedy.rs"]
mod greedy;
#[path = "support/reference.rs"]
mod reference;
#[path = "../examples/hf_checkpoint/writer.rs"]
mod writer;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use nccl::ReduceOp;
use nccl_candle::models::{CausalLm, Checkpoint};
use nccl_candle::tp::{Collectives, ThreadedCollectives, TpGroup};
use nccl_candle::Error;
use serde_json::{json, Value};

use greedy::{compare, decode, last_logits, top2, written};
use reference::Reference;
use writer::{Family, Spec};

/// Greedy steps after the prompt.
const STEPS: usize = 8;
const PROMPT: &str = "The quick brown fox jumps over the lazy dog, and then";

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The prompt's ids, from the checkpoint's tokenizer as the models' users load it.
fn prompt(checkpoint: &Checkpoint) -> Vec<u32> {
    let tokenizer = checkpoint.tokenizer().unwrap();
    tokenizer.encode(PROMPT, true).unwrap().get_ids().to_vec()
}

/// The prompt's ids from `tokenizer.json` alone (for the reference, without our loader).
fn prompt_of(dir: &Path) -> Vec<u32> {
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    tokenizer.encode(PROMPT, true).unwrap().get_ids().to_vec()
}

fn ours(checkpoint: &Checkpoint, group: &TpGroup, max_seq: usize) -> CausalLm {
    CausalLm::load(checkpoint, group, DType::F32, &Device::Cpu, max_seq)
        .unwrap_or_else(|e| panic!("rank {}: {e}", group.rank()))
}

/// Every rank's result of `body` on a group of `n` ranks simulated on threads.
fn on_threads<T: Send>(n: usize, body: impl Fn(TpGroup) -> T + Sync) -> Vec<T> {
    on_threads_counted(n, body)
        .into_iter()
        .map(|(result, _)| result)
        .collect()
}

/// [`on_threads`], with the number of collectives each rank ran.
fn on_threads_counted<T: Send>(n: usize, body: impl Fn(TpGroup) -> T + Sync) -> Vec<(T, usize)> {
    let ranks = ThreadedCollectives::group(n).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                let body = &body;
                scope.spawn(move || {
                    let calls = Arc::new(AtomicUsize::new(0));
                    let counted = Counted {
                        inner: rank,
                        calls: calls.clone(),
                    };
                    let result = body(TpGroup::new(counted).unwrap());
                    (result, calls.load(Ordering::SeqCst))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A rank's collectives, counted (the fused epilogue's provided method runs through
/// `all_reduce`, so it counts too).
struct Counted {
    inner: ThreadedCollectives,
    calls: Arc<AtomicUsize>,
}

impl Collectives for Counted {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> nccl_candle::Result<Tensor> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.all_reduce(tensor, op)
    }

    fn all_gather(&self, tensor: &Tensor) -> nccl_candle::Result<Tensor> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.all_gather(tensor)
    }
}

/// Whether `n` ranks split `spec`'s attention and dense MLPs (query heads, MLP features;
/// key/value heads split or replicate), whatever its experts.
fn splits_dense(spec: &Spec, n: usize) -> bool {
    spec.heads.is_multiple_of(n)
        && spec.intermediate.is_multiple_of(n)
        && spec.expert_intermediate.is_multiple_of(n)
        && (spec.kv_heads.is_multiple_of(n) || n.is_multiple_of(spec.kv_heads))
}

/// Whether `n` ranks split `spec`: its attention and MLPs, and its experts.
fn splits(spec: &Spec, n: usize) -> bool {
    splits_dense(spec, n) && spec.experts.is_multiple_of(n)
}

/// Every tensor a `transformers` save of `spec` holds, name and shape, worked out here from the
/// spec (apart from the writer's own list): Mistral's attention with Mixtral's
/// `block_sparse_moe`, Qwen3's (q/k norms) with Qwen3-MoE's `mlp.gate` and `mlp.experts` in
/// its sparse layers and Qwen3's MLP in the others.
fn hf_moe_tensors(spec: &Spec) -> BTreeMap<String, Vec<usize>> {
    assert!(!spec.attention_bias, "{}: no biases here", spec.name);
    let (h, hd) = (spec.hidden, spec.head_size());
    let (q, kv) = (spec.heads * hd, spec.kv_heads * hd);
    let (e_inter, inter) = (spec.expert_intermediate, spec.intermediate);
    let mut t = BTreeMap::new();
    let mut add = |name: String, shape: &[usize]| {
        assert!(t.insert(name, shape.to_vec()).is_none());
    };
    add("model.embed_tokens.weight".into(), &[spec.vocab, h]);
    for i in 0..spec.layers {
        let p = format!("model.layers.{i}");
        add(format!("{p}.self_attn.q_proj.weight"), &[q, h]);
        add(format!("{p}.self_attn.k_proj.weight"), &[kv, h]);
        add(format!("{p}.self_attn.v_proj.weight"), &[kv, h]);
        add(format!("{p}.self_attn.o_proj.weight"), &[h, q]);
        add(format!("{p}.input_layernorm.weight"), &[h]);
        add(format!("{p}.post_attention_layernorm.weight"), &[h]);
        match spec.family {
            Family::Mixtral => {
                let m = format!("{p}.block_sparse_moe");
                add(format!("{m}.gate.weight"), &[spec.experts, h]);
                for e in 0..spec.experts {
                    add(format!("{m}.experts.{e}.w1.weight"), &[inter, h]);
                    add(format!("{m}.experts.{e}.w3.weight"), &[inter, h]);
                    add(format!("{m}.experts.{e}.w2.weight"), &[h, inter]);
                }
            }
            Family::Qwen3Moe => {
                add(format!("{p}.self_attn.q_norm.weight"), &[hd]);
                add(format!("{p}.self_attn.k_norm.weight"), &[hd]);
                if (i + 1) % spec.sparse_step == 0 {
                    add(format!("{p}.mlp.gate.weight"), &[spec.experts, h]);
                    for e in 0..spec.experts {
                        let x = format!("{p}.mlp.experts.{e}");
                        add(format!("{x}.gate_proj.weight"), &[e_inter, h]);
                        add(format!("{x}.up_proj.weight"), &[e_inter, h]);
                        add(format!("{x}.down_proj.weight"), &[h, e_inter]);
                    }
                } else {
                    add(format!("{p}.mlp.gate_proj.weight"), &[inter, h]);
                    add(format!("{p}.mlp.up_proj.weight"), &[inter, h]);
                    add(format!("{p}.mlp.down_proj.weight"), &[h, inter]);
                }
            }
            other => panic!("{}: {other:?} has no experts", spec.name),
        }
    }
    add("model.norm.weight".into(), &[h]);
    if !spec.tie_embeddings {
        add("lm_head.weight".into(), &[spec.vocab, h]);
    }
    t
}

/// config.json: the fields every family has (as `hf_checkpoint_cpu` checks them for the dense
/// ones), then the family's: Mistral's attention fields and Mixtral's experts; Qwen3's
/// attention fields and Qwen3-MoE's experts.
fn check_config(spec: &Spec, dir: &Path) {
    let c = read_json(&dir.join("config.json"));
    let name = spec.name;
    let torch_dtype = if spec.dtype == DType::BF16 {
        "bfloat16"
    } else {
        "float32"
    };
    let common = json!({
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "max_position_embeddings": 512,
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "num_experts_per_tok": spec.experts_per_token,
        "output_router_logits": false,
        "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": torch_dtype,
        "use_cache": true,
        "vocab_size": spec.vocab,
    });
    let own = match spec.family {
        Family::Mixtral => json!({
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "head_dim": spec.head_dim,
            "num_local_experts": spec.experts,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.02,
            "router_jitter_noise": 0.0,
            "sliding_window": spec.sliding_window,
        }),
        Family::Qwen3Moe => json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "attention_bias": spec.attention_bias,
            "decoder_sparse_step": spec.sparse_step,
            "head_dim": spec.head_size(),
            "max_window_layers": spec.layers,
            "mlp_only_layers": [],
            "moe_intermediate_size": spec.expert_intermediate,
            "norm_topk_prob": spec.norm_topk_prob,
            "num_experts": spec.experts,
            "rms_norm_eps": 1e-6,
            "rope_scaling": null,
            "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001,
            "sliding_window": null,
            "use_sliding_window": false,
        }),
        other => panic!("{name}: {other:?} has no experts"),
    };
    for (key, want) in common
        .as_object()
        .unwrap()
        .iter()
        .chain(own.as_object().unwrap())
    {
        assert_eq!(c.get(key), Some(want), "{name}: {key}");
    }
    let fields = c.as_object().unwrap();
    let written: BTreeSet<&str> = fields.keys().map(String::as_str).collect();
    let known: BTreeSet<&str> = common
        .as_object()
        .unwrap()
        .keys()
        .chain(own.as_object().unwrap().keys())
        .map(String::as_str)
        .chain(["initializer_range", "transformers_version"])
        .collect();
    // Nothing else: no field of candle's (use_flash_attn), none of the other family's.
    assert_eq!(written, known, "{name}: config.json's fields");
    if spec.family == Family::Mixtral {
        // candle-transformers' Mixtral reads the window as an integer.
        assert!(c["sliding_window"].is_u64(), "{name}: sliding_window");
        assert_eq!(spec.expert_intermediate, spec.intermediate, "{name}");
    }
}

/// The weights: exactly [`hf_moe_tensors`] (and the writer's own list), in the spec's dtype,
/// the index naming every tensor's file when sharded.
fn check_weights(spec: &Spec, dir: &Path) {
    let name = spec.name;
    let mut found: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    let mut owner: BTreeMap<String, String> = BTreeMap::new();
    for file in spec.weight_files() {
        let tensors = candle_core::safetensors::load(dir.join(&file), &Device::Cpu).unwrap();
        assert!(!tensors.is_empty(), "{name}: {file} is empty");
        for (tensor, t) in tensors {
            assert_eq!(t.dtype(), spec.dtype, "{name}: {tensor}");
            let v: Vec<f32> = t
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{name}: {tensor}");
            assert!(v.iter().any(|x| *x != 0.0), "{name}: {tensor} is all zeros");
            assert!(
                found.insert(tensor.clone(), t.dims().to_vec()).is_none(),
                "{name}: {tensor} twice"
            );
            owner.insert(tensor, file.clone());
        }
    }
    assert_eq!(found, hf_moe_tensors(spec), "{name}: the tensors");
    let listed: BTreeMap<String, Vec<usize>> =
        writer::tensor_names_and_shapes(spec).into_iter().collect();
    assert_eq!(found, listed, "{name}: the writer's list");
    if spec.shards > 1 {
        let index = read_json(&dir.join("model.safetensors.index.json"));
        let map: BTreeMap<String, String> =
            serde_json::from_value(index["weight_map"].clone()).unwrap();
        assert_eq!(map, owner, "{name}: the index's weight_map");
    }
}

/// The first sparse layer's router sends different tokens to different experts: on the
/// prompt's embeddings normalised as that layer's experts' input is (its
/// `post_attention_layernorm`; a stand-in for the hidden states), the top-k sets are not all
/// the same and more than half of the experts are someone's choice.
fn check_routing_varies(spec: &Spec, dir: &Path, ids: &[u32]) {
    let layer = (0..spec.layers).find(|&i| spec.is_moe_layer(i)).unwrap();
    let gate = match spec.family {
        Family::Mixtral => format!("model.layers.{layer}.block_sparse_moe.gate.weight"),
        _ => format!("model.layers.{layer}.mlp.gate.weight"),
    };
    let mut tensors = std::collections::HashMap::new();
    for file in spec.weight_files() {
        tensors.extend(candle_core::safetensors::load(dir.join(file), &Device::Cpu).unwrap());
    }
    let f32_of = |name: &str| tensors[name].to_dtype(DType::F32).unwrap();
    let embed = f32_of("model.embed_tokens.weight");
    let ids_t = Tensor::new(ids, &Device::Cpu).unwrap();
    let x = embed.index_select(&ids_t, 0).unwrap();
    let norm = f32_of(&format!(
        "model.layers.{layer}.post_attention_layernorm.weight"
    ));
    let x = candle_nn::ops::rms_norm(&x, &norm, 1e-6).unwrap();
    let logits: Vec<Vec<f32>> = x
        .matmul(&f32_of(&gate).t().unwrap())
        .unwrap()
        .to_vec2()
        .unwrap();
    let mut choices = BTreeSet::new();
    let mut chosen = BTreeSet::new();
    for row in &logits {
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let top: BTreeSet<usize> = order[..spec.experts_per_token].iter().copied().collect();
        chosen.extend(top.iter().copied());
        choices.insert(top);
    }
    assert!(choices.len() > 1, "{}: every token routed alike", spec.name);
    assert!(
        chosen.len() > spec.experts / 2,
        "{}: only experts {chosen:?} chosen",
        spec.name
    );
}

#[test]
fn moe_presets_are_complete_checkpoints_that_candle_transformers_runs() {
    let dense: Vec<&str> = writer::presets().iter().map(|s| s.name).collect();
    let presets = writer::moe_presets();
    assert!(presets.len() >= 3);
    let mut families = BTreeSet::new();
    for spec in &presets {
        let name = spec.name;
        assert_eq!(writer::preset(name).as_ref(), Some(spec));
        assert!(!dense.contains(&name), "{name} among the dense presets");
        assert!(spec.family.is_moe(), "{name}");
        families.insert(format!("{:?}", spec.family));
        // Splits over 1, 2 and 3 ranks (the tests below count on it).
        for n in 1..=3 {
            assert!(splits(spec, n), "{name}: {n} ranks");
        }
        let dir = written(spec);
        check_config(spec, dir.path());
        check_weights(spec, dir.path());
        // candle-transformers' model reads every tensor written, and nothing else.
        let read = Reference::tensors_read(spec, dir.path());
        let all: BTreeSet<String> = hf_moe_tensors(spec).into_keys().collect();
        assert_eq!(read, all, "{name}: the tensors candle-transformers reads");

        let ids = prompt_of(dir.path());
        check_routing_varies(spec, dir.path(), &ids);
        let mut candle = Reference::load(spec, dir.path());
        let run = decode(|ids, at| candle.forward(ids, at), &ids, STEPS, None);
        let first = &run.logits[0];
        let spread = {
            let mean = first.iter().sum::<f32>() / first.len() as f32;
            (first.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / first.len() as f32).sqrt()
        };
        for logits in &run.logits {
            assert_eq!(logits.len(), spec.vocab, "{name}");
            assert!(logits.iter().all(|x| x.is_finite()), "{name}");
        }
        let distinct = run.tokens.iter().collect::<BTreeSet<_>>().len();
        let gaps: Vec<f32> = run.logits.iter().map(|l| top2(l).1).collect();
        let min_gap = gaps.iter().copied().fold(f32::INFINITY, f32::min);
        println!(
            "{name:<18} logit std {spread:5.2}, min top-2 gap {min_gap:.4}, tokens {:?}",
            run.tokens
        );
        assert!(spread >= 1.0, "{name}: flat logits (std {spread})");
        assert!(distinct >= 2, "{name}: one token over and over");
        assert!(
            run.tokens
                .iter()
                .all(|&t| (t as usize) < writer::TOKENIZER_VOCAB),
            "{name}: a padding id predicted"
        );
        // In the files' own dtype too (bf16: candle computing in bf16).
        if spec.dtype == DType::BF16 {
            let mut candle = Reference::load_as(spec, dir.path(), DType::BF16);
            let logits = candle.forward(&ids, 0);
            assert!(logits.iter().all(|x| x.is_finite()), "{name}: bf16");
        }
        // The same spec, the same bytes; another seed, other weights, the same config.
        let again = written(spec);
        for file in spec.weight_files().iter().map(String::as_str).chain([
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]) {
            let (a, b) = (dir.path().join(file), again.path().join(file));
            assert!(
                std::fs::read(a).unwrap() == std::fs::read(b).unwrap(),
                "{name}: {file} differs"
            );
        }
        let reseeded = written(&Spec {
            seed: spec.seed + 1,
            ..spec.clone()
        });
        let file = &spec.weight_files()[0];
        assert!(
            std::fs::read(dir.path().join(file)).unwrap()
                != std::fs::read(reseeded.path().join(file)).unwrap(),
            "{name}: the seed is not used"
        );
    }
    assert_eq!(families.len(), 2, "{families:?}");
    // Both kinds of layer of Qwen3-MoE, both routing-weight rules, both dtypes.
    assert!(presets.iter().any(|s| s.sparse_step > 1));
    assert!(presets
        .iter()
        .any(|s| s.family == Family::Qwen3Moe && !s.norm_topk_prob));
    assert!(presets.iter().any(|s| s.dtype == DType::BF16));
    assert!(presets.iter().any(|s| s.dtype == DType::F32));
}

#[test]
fn bad_moe_specs_are_refused() {
    let mixtral = writer::preset("mixtral-tiny").unwrap();
    let qwen = writer::preset("qwen3-moe-sparse").unwrap();
    let dense = writer::preset("llama-gqa-bf16").unwrap();
    let bad = [
        Spec {
            experts_per_token: 0,
            ..mixtral.clone()
        },
        Spec {
            experts_per_token: mixtral.experts + 1,
            ..mixtral.clone()
        },
        Spec {
            experts: 0,
            ..qwen.clone()
        },
        Spec {
            expert_intermediate: 0,
            ..qwen.clone()
        },
        Spec {
            sparse_step: 0,
            ..qwen.clone()
        },
        // Mixtral: experts of intermediate_size, in every layer, always renormalised.
        Spec {
            expert_intermediate: mixtral.intermediate / 2,
            ..mixtral.clone()
        },
        Spec {
            sparse_step: 2,
            ..mixtral.clone()
        },
        Spec {
            norm_topk_prob: false,
            ..mixtral.clone()
        },
        // A dense family with experts.
        Spec {
            experts: 4,
            experts_per_token: 2,
            ..dense.clone()
        },
        Spec {
            norm_topk_prob: true,
            ..dense.clone()
        },
    ];
    let dir = tempfile::tempdir().unwrap();
    for spec in bad {
        let err = writer::write(&spec, &dir.path().join("x")).unwrap_err();
        assert_eq!(
            err.kind(),
            std::io::ErrorKind::InvalidInput,
            "{spec:?}: {err}"
        );
    }
}

#[test]
fn one_rank_matches_candle_transformers_and_ranks_match_one_rank() {
    for spec in writer::moe_presets() {
        let name = spec.name;
        let dir = written(&spec);
        let checkpoint =
            Checkpoint::open(dir.path()).unwrap_or_else(|e| panic!("{name}: opening: {e}"));
        let prompt = prompt(&checkpoint);
        assert_eq!(prompt, prompt_of(dir.path()), "{name}: the prompt");
        let max_seq = prompt.len() + STEPS;
        let mut single = ours(&checkpoint, &TpGroup::single(), max_seq);
        // One rank reads every tensor whole, nothing else.
        assert_eq!(single.shard_bytes(), checkpoint.weight_bytes(), "{name}");
        let one = decode(
            |ids, at| last_logits(&mut single, ids, at),
            &prompt,
            STEPS,
            None,
        );
        let mut candle = Reference::load(&spec, dir.path());
        let want = decode(
            |ids, at| candle.forward(ids, at),
            &prompt,
            STEPS,
            Some(&one.tokens),
        );
        compare(&format!("{name} vs candle-transformers"), &want, &one);
        assert_eq!(want.tokens, one.tokens, "{name}: greedy tokens");
        for n in [2, 3] {
            assert!(splits(&spec, n), "{name}: {n} ranks");
            let results = on_threads(n, |group| {
                let rank = group.rank();
                match CausalLm::load(&checkpoint, &group, DType::F32, &Device::Cpu, max_seq) {
                    Ok(mut model) => {
                        let run = decode(
                            |ids, at| last_logits(&mut model, ids, at),
                            &prompt,
                            STEPS,
                            Some(&one.tokens),
                        );
                        Ok((run, model.shard_bytes()))
                    }
                    Err(e) => Err(format!("rank {rank}: {e}")),
                }
            });
            let mut read = 0;
            for (rank, result) in results.into_iter().enumerate() {
                let (run, bytes) = result.unwrap_or_else(|e| panic!("{name} x{n}: {e}"));
                compare(&format!("{name}, rank {rank} of {n}"), &one, &run);
                // Each rank reads its part (its experts among them): less than the whole, and
                // together at least the whole (norms, routers, replicated key/value heads).
                assert!(
                    bytes < checkpoint.weight_bytes(),
                    "{name}: rank {rank} of {n} read {bytes}"
                );
                read += bytes;
            }
            assert!(
                read >= checkpoint.weight_bytes(),
                "{name} x{n}: {read} bytes read"
            );
        }
    }
}

#[test]
fn experts_that_do_not_split_are_refused_on_every_rank_before_any_other_collective() {
    // What the load's agreement costs: a load every rank's checks pass, refused there for
    // arguments that differ (max_seq), so that no collective of the model runs.
    let dense = writer::preset("llama-bias-f32").unwrap();
    let dense_dir = written(&dense);
    let agreement = {
        let counted = on_threads_counted(3, |group| {
            let checkpoint = Checkpoint::open(dense_dir.path()).unwrap();
            let max_seq = 16 + group.rank();
            CausalLm::load(&checkpoint, &group, DType::F32, &Device::Cpu, max_seq).err()
        });
        let calls: Vec<usize> = counted
            .into_iter()
            .map(|(err, calls)| {
                let err = err.expect("a load with other arguments on each rank");
                assert!(matches!(err, Error::Mismatch { .. }), "{err}");
                calls
            })
            .collect();
        assert!(calls.iter().all(|&c| c == calls[0] && c > 0), "{calls:?}");
        calls[0]
    };
    // Every preset with one expert more (7 or 13: over 2 or 3 ranks, whose heads and
    // features split), and `qwen3-moe-sparse` as it is over 4 ranks (its 12 query heads,
    // one key/value head and features all split, its 6 experts do not).
    let mut cases: Vec<(Spec, usize)> = Vec::new();
    for spec in writer::moe_presets() {
        let more = Spec {
            experts: spec.experts + 1,
            ..spec.clone()
        };
        for n in [2, 3] {
            cases.push((more.clone(), n));
        }
    }
    cases.push((writer::preset("qwen3-moe-sparse").unwrap(), 4));
    for (spec, n) in &cases {
        let (name, n) = (spec.name, *n);
        let what = format!("{name} with {} experts over {n} ranks", spec.experts);
        assert!(
            splits_dense(spec, n) && !splits(spec, n),
            "{what}: only the experts should not split"
        );
        let dir = written(spec);
        let checkpoint =
            Checkpoint::open(dir.path()).unwrap_or_else(|e| panic!("{what}: opening: {e}"));
        let counted = on_threads_counted(n, |group| {
            CausalLm::load(&checkpoint, &group, DType::F32, &Device::Cpu, 32).err()
        });
        for (rank, (err, calls)) in counted.into_iter().enumerate() {
            let err = err.unwrap_or_else(|| panic!("{what}: rank {rank} loaded"));
            match &err {
                Error::NotDivisible {
                    name: dim,
                    world_size,
                    ..
                } => {
                    assert!(
                        dim.contains("experts"),
                        "{what}: rank {rank}: {err} does not name the experts"
                    );
                    assert_eq!(*world_size, n, "{what}: rank {rank}: {err}");
                }
                other => panic!("{what}: rank {rank}: {other} (not NotDivisible)"),
            }
            // Refused at the agreement: no collective of the model before it, none after.
            assert_eq!(
                calls, agreement,
                "{what}: rank {rank} ran {calls} collectives, an agreement {agreement}"
            );
            if rank == 0 {
                println!("{what}: {err} ({calls} collectives)");
            }
        }
    }
}
