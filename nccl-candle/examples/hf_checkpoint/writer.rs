//! Synthetic Hugging Face checkpoints for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3)
//! and the mixtures of experts built on it (Mixtral, Qwen3-MoE): a directory with
//! `config.json`, the weights (one `model.safetensors`, or shards and
//! `model.safetensors.index.json`), `tokenizer.json`, `tokenizer_config.json` and
//! `generation_config.json`, laid out and named as `transformers` saves them, so that loading
//! code meant for real checkpoints reads them unchanged.
//!
//! Everything is a function of the [`Spec`]: the same spec gives the same bytes, on any machine
//! and whatever the thread count (weights come from a hash of the seed and the tensor's name;
//! the tokenizer is learnt from a fixed text with ties broken by order, not by hash-map order).
//!
//! Used by the `hf_checkpoint` example and, through `#[path]`, by tests; it needs only crates
//! `nccl-candle` itself depends on.
//!
//! Past 600 lines: the presets, each family's config.json and tensors, the safetensors and
//! index writing and the tokenizer's merges: one writer tests include as one file.

// Each crate that includes this file (the example, tests) uses a part of it.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::{self, BufWriter, Write};
use std::path::Path;

use candle_core::DType;
use serde_json::{json, Value};
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{
    AddedToken, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, Tokenizer,
};

/// The `transformers_version` the JSON files claim (what a recent save writes).
const TRANSFORMERS_VERSION: &str = "4.51.3";

/// `max_position_embeddings`, and the tokenizer's `model_max_length`.
const MAX_POSITIONS: usize = 512;

/// The tokenizer's special tokens, at ids 0, 1, 2: beginning and end of a sequence, and the
/// second end-of-turn token that a list-valued `eos_token_id` (Llama 3.1 style) names.
const BOS: &str = "<s>";
const EOS: &str = "</s>";
const EOT: &str = "<|eot_id|>";
const SPECIALS: [&str; 3] = [BOS, EOS, EOT];

/// How many tokens the tokenizer has: the specials, the 256 byte symbols, then merges (the
/// corpus has enough pairs for them). Under every preset's `vocab`, so the embedding table
/// has padding rows, as real models do; ids from here on are padding, never predicted.
pub const TOKENIZER_VOCAB: usize = 352;

/// The text the tokenizer's merges are learnt from.
const CORPUS: &str = "\
The lighthouse keeper kept a small notebook on the table by the window. Every evening she wrote \
down the weather, the ships that passed, and the number of birds that rested on the rail. Most \
entries were short: a line about the wind, a line about the sea, and sometimes a note that the \
lamp needed new oil. In the winter the storms came from the north, and the waves threw stones \
against the door. In the summer the water was quiet, and the keeper could hear the bells of the \
boats in the harbour on the other side of the bay.

When the keeper retired, her notebooks were given to the town library. The librarian read them \
one by one and found that they told a longer story than any single page: the slow change of the \
seasons, the names of the ships that returned every year, and the quiet patience of a person who \
watched the same horizon for thirty years. The town printed a small book from those pages, and \
the children at the school still read it aloud before the first storm of the winter. They learn \
that a careful record of ordinary things can become, after many years, the most interesting thing \
of all.

Numbers matter too: 1, 2, 3, 10, 42, 100 and 2024 appear in the notes, with prices like $3.50, \
times like 06:45, and the odd question (\"Where did the gulls go?\") written in the margin.";

/// The model family: which architecture `config.json` names and which tensors it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// `LlamaForCausalLM` (Llama 2 and 3).
    Llama,
    /// `MistralForCausalLM`.
    Mistral,
    /// `Qwen2ForCausalLM`: q/k/v biases always.
    Qwen2,
    /// `Qwen3ForCausalLM`: per-head q/k RMSNorms.
    Qwen3,
    /// `MixtralForCausalLM`: Mistral's attention; in every layer a router
    /// (`block_sparse_moe.gate`) and `experts` SwiGLU experts (`w1` gate, `w3` up, `w2` down,
    /// of `intermediate_size`) in place of the MLP; the top `num_experts_per_tok` weights
    /// always renormalised.
    Mixtral,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention; in layer `i` with `(i + 1) %
    /// decoder_sparse_step == 0` a router (`mlp.gate`) and `num_experts` experts
    /// (`gate_proj`, `up_proj`, `down_proj` of `moe_intermediate_size`), elsewhere Qwen3's MLP.
    Qwen3Moe,
}

impl Family {
    /// `model_type` in `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
        }
    }

    /// `architectures[0]` in `config.json`.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    /// Whether the family has experts (its spec's `experts` and the fields after it matter).
    pub fn is_moe(self) -> bool {
        matches!(self, Family::Mixtral | Family::Qwen3Moe)
    }

    fn is_qwen(self) -> bool {
        matches!(self, Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe)
    }

    /// Whether attention has Qwen3's per-head q/k RMSNorms (and config.json its `head_dim`).
    fn is_qwen3(self) -> bool {
        matches!(self, Family::Qwen3 | Family::Qwen3Moe)
    }
}

/// What to write: the model's shape, the stored dtype, the file layout and the seed.
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    /// The preset's name.
    pub name: &'static str,
    /// The family.
    pub family: Family,
    /// `vocab_size`: the embedding table's rows, at least the tokenizer's vocabulary (the rest
    /// is padding, as in real models).
    pub vocab: usize,
    /// `hidden_size`.
    pub hidden: usize,
    /// `intermediate_size`.
    pub intermediate: usize,
    /// `num_hidden_layers`.
    pub layers: usize,
    /// `num_attention_heads`.
    pub heads: usize,
    /// `num_key_value_heads`.
    pub kv_heads: usize,
    /// `head_dim` when `Some` (it may differ from `hidden / heads`). When `None` it is left out
    /// (Llama, Qwen2), written as `null` (Mistral, Mixtral), or written as `hidden / heads`
    /// (Qwen3, Qwen3-MoE, whose configs always carry it). candle-transformers' Mixtral reads
    /// no `head_dim` (it uses `hidden / heads`): leave it `None` for Mixtral.
    pub head_dim: Option<usize>,
    /// `tie_word_embeddings`: no `lm_head.weight` in the files.
    pub tie_embeddings: bool,
    /// The stored dtype and `torch_dtype`: `BF16` or `F32`.
    pub dtype: DType,
    /// 1: `model.safetensors`; n > 1: `model-0000i-of-0000n.safetensors` and the index.
    pub shards: usize,
    /// Llama only: Llama 3's `rope_scaling` (`original_max_position_embeddings` 64, so it
    /// matters at test lengths), `rope_theta` 500000 and a list-valued `eos_token_id`.
    pub llama3_rope: bool,
    /// `sliding_window`: Mistral's and Mixtral's attention window (`None` writes `null`);
    /// Qwen2/Qwen3/Qwen3-MoE write it (`null` for `None`) with `use_sliding_window` false;
    /// Llama has none.
    pub sliding_window: Option<usize>,
    /// Llama/Qwen3/Qwen3-MoE `attention_bias`: biases on q, k, v and o. Qwen2 has q/k/v biases
    /// (and no o bias) whatever this says; Mistral and Mixtral have none.
    pub attention_bias: bool,
    /// The experts of each mixture-of-experts layer: Mixtral's `num_local_experts`,
    /// Qwen3-MoE's `num_experts`. 0 for the dense families, as are the fields below.
    pub experts: usize,
    /// `num_experts_per_tok`: the experts each token is routed to, in `1..=experts`.
    pub experts_per_token: usize,
    /// Each expert's feature count: Qwen3-MoE's `moe_intermediate_size`; Mixtral's experts
    /// are of `intermediate_size`, so for Mixtral this equals `intermediate`.
    pub expert_intermediate: usize,
    /// Qwen3-MoE's `norm_topk_prob`: the top `experts_per_token` routing weights are
    /// renormalised to sum to 1. Mixtral always renormalises (its config has no such field):
    /// `true` for Mixtral, so that the spec describes the model.
    pub norm_topk_prob: bool,
    /// Qwen3-MoE's `decoder_sparse_step`: layer `i` has experts iff `(i + 1) % sparse_step ==
    /// 0` (`mlp_only_layers` is always empty), the others Qwen3's MLP of `intermediate`.
    /// Mixtral has experts in every layer: 1.
    pub sparse_step: usize,
    /// The seed the weights are drawn from.
    pub seed: u64,
}

impl Spec {
    /// The attention head size: `head_dim`, or `hidden / heads`.
    pub fn head_size(&self) -> usize {
        self.head_dim
            .unwrap_or_else(|| self.hidden.checked_div(self.heads).unwrap_or(0))
    }

    /// Whether q, k and v have biases.
    pub fn qkv_bias(&self) -> bool {
        match self.family {
            Family::Qwen2 => true,
            Family::Llama | Family::Qwen3 | Family::Qwen3Moe => self.attention_bias,
            Family::Mistral | Family::Mixtral => false,
        }
    }

    /// Whether o has a bias.
    pub fn o_bias(&self) -> bool {
        matches!(
            self.family,
            Family::Llama | Family::Qwen3 | Family::Qwen3Moe
        ) && self.attention_bias
    }

    /// Whether layer `layer` has experts (a router and `experts` expert MLPs) in place of the
    /// MLP: every layer of Mixtral, every `sparse_step`-th of Qwen3-MoE, none of the others.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.family.is_moe()
            && self.experts > 0
            && self.sparse_step > 0
            && (layer + 1).is_multiple_of(self.sparse_step)
    }

    /// `bos_token_id`.
    pub fn bos_token_id(&self) -> u32 {
        0
    }

    /// `eos_token_id`: `</s>`, and for a Llama 3 style spec the end-of-turn token too.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        if self.llama3_rope {
            vec![1, 2]
        } else {
            vec![1]
        }
    }

    /// The weights' file names, in order.
    pub fn weight_files(&self) -> Vec<String> {
        if self.shards <= 1 {
            vec!["model.safetensors".to_string()]
        } else {
            (1..=self.shards)
                .map(|i| format!("model-{i:05}-of-{:05}.safetensors", self.shards))
                .collect()
        }
    }
}

/// A preset: `dims` is `[vocab, hidden, intermediate, layers, heads, kv_heads]`; no extras.
fn spec(
    name: &'static str,
    family: Family,
    dims: [usize; 6],
    dtype: DType,
    shards: usize,
    tie_embeddings: bool,
    seed: u64,
) -> Spec {
    let [vocab, hidden, intermediate, layers, heads, kv_heads] = dims;
    Spec {
        name,
        family,
        vocab,
        hidden,
        intermediate,
        layers,
        heads,
        kv_heads,
        head_dim: None,
        tie_embeddings,
        dtype,
        shards,
        llama3_rope: false,
        sliding_window: None,
        attention_bias: false,
        experts: 0,
        experts_per_token: 0,
        expert_intermediate: 0,
        norm_topk_prob: false,
        sparse_step: 0,
        seed,
    }
}

/// A mixture-of-experts preset: [`spec`]'s, with `moe` `[experts, experts_per_token,
/// expert_intermediate, sparse_step]` and `norm_topk_prob` (Mixtral: `expert_intermediate`
/// is `intermediate`, `sparse_step` 1, `norm_topk_prob` true).
#[allow(clippy::too_many_arguments)] // A table's row, as `spec`'s.
fn moe_spec(
    name: &'static str,
    family: Family,
    dims: [usize; 6],
    moe: [usize; 4],
    norm_topk_prob: bool,
    dtype: DType,
    shards: usize,
    tie_embeddings: bool,
    seed: u64,
) -> Spec {
    let [experts, experts_per_token, expert_intermediate, sparse_step] = moe;
    Spec {
        experts,
        experts_per_token,
        expert_intermediate,
        norm_topk_prob,
        sparse_step,
        ..spec(name, family, dims, dtype, shards, tie_embeddings, seed)
    }
}

/// The presets: small (CPU-fast) and each with something of its own (grouped queries, tied
/// embeddings, shards, biases, a window, an odd vocabulary, a head size apart from
/// `hidden / heads`).
#[rustfmt::skip] // A table: one preset a line.
pub fn presets() -> Vec<Spec> {
    use DType::{BF16, F32};
    use Family::*;
    vec![
        // name, family, [vocab, hidden, intermediate, layers, heads, kv_heads], dtype, shards,
        // tied, seed
        spec("llama-gqa-bf16", Llama,               [384, 128, 352, 2, 8, 2],   BF16, 1, false, 11),
        Spec { llama3_rope: true,
            ..spec("llama3-tied-f32-sharded", Llama, [400, 128, 256, 3, 4, 4],  F32,  3, true,  12) },
        Spec { attention_bias: true,
            ..spec("llama-bias-f32", Llama,         [384, 96, 192, 2, 6, 6],    F32,  1, false, 13) },
        Spec { sliding_window: Some(8),
            ..spec("mistral-window-f32", Mistral,   [384, 128, 256, 2, 8, 2],   F32,  2, false, 14) },
        // 401: odd, so that it splits evenly over no number of ranks.
        Spec { sliding_window: Some(131072),
            ..spec("qwen2-oddvocab-f32", Qwen2,     [401, 128, 320, 2, 4, 2],   F32,  1, false, 15) },
        Spec { sliding_window: Some(32768),
            ..spec("qwen2-bf16-sharded", Qwen2,     [512, 192, 512, 2, 12, 4],  BF16, 2, true,  16) },
        // head_dim 64, not hidden / heads = 32.
        Spec { head_dim: Some(64),
            ..spec("qwen3-headdim-f32", Qwen3,      [384, 128, 256, 2, 4, 2],   F32,  1, true,  17) },
        Spec { head_dim: Some(32),
            ..spec("qwen3-bf16", Qwen3,             [512, 256, 768, 2, 8, 4],   BF16, 1, false, 18) },
    ]
}

/// Checkpoints the size of a small real model, for a GPU host's memory and load-speed runs;
/// not among [`presets`], which every CPU test writes and runs. `llama-1b-bf16`: 1.04 G
/// parameters, 2.1 GB in four shards; 24 query and 6 key/value heads of 96, so it splits
/// over 1, 2, 3 and 6 ranks. `qwen3-1b-bf16`: 1.34 G parameters, 2.7 GB in four shards; 16
/// query and 8 key/value heads of 128 (Qwen3's query/key norms), so it splits over 1, 2, 4
/// and 8 ranks.
#[rustfmt::skip] // A table: one preset a line.
pub fn large_presets() -> Vec<Spec> {
    use DType::BF16;
    use Family::*;
    vec![
        spec("llama-1b-bf16", Llama, [32000, 2304, 6144, 16, 24, 6], BF16, 4, false, 19),
        spec("qwen3-1b-bf16", Qwen3, [32000, 2048, 6144, 24, 16, 8], BF16, 4, false, 20),
    ]
}

/// The mixture-of-experts presets, small (CPU-fast); not among [`presets`], which the tests of
/// the dense families run through their own models. Each splits its attention, MLPs and
/// experts over 1, 2 and 3 ranks (query heads 6 or 12; key/value heads 6, split, or 1,
/// replicated; every feature count a multiple of 12; 6 or 12 experts).
///
/// * `mixtral-tiny`: 6 experts of 96 features, top 2 (always renormalised), in both layers;
///   6 query and key/value heads of 16; a window (4096) past every position, as an integer
///   (candle-transformers' Mixtral has no `null` window); f32, two shards, untied.
/// * `qwen3-moe-tiny`: 12 experts of 48 features, top 4, `norm_topk_prob`, in both layers
///   (`decoder_sparse_step` 1); 12 query heads of 16 (192 wide, hidden 64) over 6 key/value
///   heads; bf16, untied.
/// * `qwen3-moe-sparse`: `decoder_sparse_step` 2: layer 0 is Qwen3's MLP of 192 features,
///   layer 1 has 6 experts of 48, top 2, weights not renormalised; 12 query heads of 8 over
///   one key/value head (replicated on every rank, and 4 ranks split all but the experts);
///   f32, tied.
#[rustfmt::skip] // A table: one preset a line.
pub fn moe_presets() -> Vec<Spec> {
    use DType::{BF16, F32};
    use Family::*;
    vec![
        // name, family, [vocab, hidden, intermediate, layers, heads, kv_heads],
        // [experts, experts_per_token, expert_intermediate, sparse_step], norm_topk_prob,
        // dtype, shards, tied, seed
        Spec { sliding_window: Some(4096),
            ..moe_spec("mixtral-tiny", Mixtral,        [384, 96, 96, 2, 6, 6],    [6, 2, 96, 1],
                       true,  F32,  2, false, 21) },
        Spec { head_dim: Some(16),
            ..moe_spec("qwen3-moe-tiny", Qwen3Moe,     [384, 64, 192, 2, 12, 6],  [12, 4, 48, 1],
                       true,  BF16, 1, false, 22) },
        moe_spec("qwen3-moe-sparse", Qwen3Moe,         [384, 96, 192, 2, 12, 1],  [6, 2, 48, 2],
                 false, F32,  1, true,  23),
    ]
}

/// The preset called `name`, of [`presets`], [`moe_presets`] or [`large_presets`].
pub fn preset(name: &str) -> Option<Spec> {
    presets()
        .into_iter()
        .chain(moe_presets())
        .chain(large_presets())
        .find(|s| s.name == name)
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy)]
enum Init {
    /// Uniform, mean 0, this standard deviation.
    Std(f32),
    /// Uniform in `[lo, hi)`.
    Range(f32, f32),
    /// The vocabulary's rows (embeddings, head): uniform, mean 0, std `.0` for the tokenizer's
    /// tokens and `.1` for the padding rows after them.
    Vocab(f32, f32),
}

struct TensorSpec {
    name: String,
    shape: Vec<usize>,
    init: Init,
}

/// Every tensor of the checkpoint in `transformers`' state-dict order, with its init.
fn tensor_specs(spec: &Spec) -> Vec<TensorSpec> {
    let (h, hd, inter) = (spec.hidden, spec.head_size(), spec.intermediate);
    let (q_out, kv_out) = (spec.heads * hd, spec.kv_heads * hd);
    // The input projections (q, k, v, gate, up) get std 1/sqrt(fan_in): their outputs are
    // O(1), so attention scores are O(1) and attention, RoPE and the window visibly change the
    // logits (std 0.02, a trained model's init, would leave attention nearly uniform).
    let std_in = |fan_in: usize| Init::Std(1.0 / (fan_in.max(1) as f32).sqrt());
    // The output projections (o, down) get four times that: the residual stream grows to
    // several times the embeddings' size, as in real models, and a tied model's last hidden
    // state is not mostly its input token's embedding (which made it echo that token).
    let out_std = |fan_in: usize| Init::Std(4.0 / (fan_in.max(1) as f32).sqrt());
    // The head's rows (the embeddings too, they are the head when tied) get std 3/sqrt(hidden):
    // logits spread by about 3, so greedy decoding is rarely a near tie. The padding rows after
    // the tokenizer's tokens get a tenth of that, as trained models' padding rows are never
    // predicted: a decode stays within ids the tokenizer can turn into text.
    let head_rows = {
        let std = 3.0 / (h.max(1) as f32).sqrt();
        Init::Vocab(std, std / 10.0)
    };
    // Biases large enough that one added twice (once per rank) shows even in bf16; norm
    // weights near 1 but not 1, so that one left out shows.
    let bias = Init::Std(0.2);
    let norm = Init::Range(0.8, 1.2);
    // Routers get the input projections' std: their logits are O(1) and differ from token
    // to token, so that tokens go to different experts and the top-k weights are far from
    // equal. Experts get an MLP's inits (of their own feature count).
    let router = std_in(h);
    let mut out = Vec::new();
    let mut push =
        |name: String, shape: Vec<usize>, init: Init| out.push(TensorSpec { name, shape, init });
    push(
        "model.embed_tokens.weight".into(),
        vec![spec.vocab, h],
        head_rows,
    );
    for i in 0..spec.layers {
        let p = format!("model.layers.{i}");
        for (proj, rows) in [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)] {
            push(
                format!("{p}.self_attn.{proj}.weight"),
                vec![rows, h],
                std_in(h),
            );
            if spec.qkv_bias() {
                push(format!("{p}.self_attn.{proj}.bias"), vec![rows], bias);
            }
        }
        push(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, q_out],
            out_std(q_out),
        );
        if spec.o_bias() {
            push(format!("{p}.self_attn.o_proj.bias"), vec![h], bias);
        }
        if spec.family.is_qwen3() {
            push(format!("{p}.self_attn.q_norm.weight"), vec![hd], norm);
            push(format!("{p}.self_attn.k_norm.weight"), vec![hd], norm);
        }
        let (experts, e_inter) = (spec.experts, spec.expert_intermediate);
        if spec.family == Family::Mixtral {
            // MixtralSparseMoeBlock: the gate, then each MixtralBlockSparseTop2MLP's w1
            // (gate), w2 (down), w3 (up).
            let m = format!("{p}.block_sparse_moe");
            push(format!("{m}.gate.weight"), vec![experts, h], router);
            for e in 0..experts {
                let x = format!("{m}.experts.{e}");
                push(format!("{x}.w1.weight"), vec![e_inter, h], std_in(h));
                push(format!("{x}.w2.weight"), vec![h, e_inter], out_std(e_inter));
                push(format!("{x}.w3.weight"), vec![e_inter, h], std_in(h));
            }
        } else if spec.is_moe_layer(i) {
            // Qwen3MoeSparseMoeBlock: the gate, then each expert's Qwen3MoeMLP.
            push(format!("{p}.mlp.gate.weight"), vec![experts, h], router);
            for e in 0..experts {
                let x = format!("{p}.mlp.experts.{e}");
                push(format!("{x}.gate_proj.weight"), vec![e_inter, h], std_in(h));
                push(format!("{x}.up_proj.weight"), vec![e_inter, h], std_in(h));
                push(
                    format!("{x}.down_proj.weight"),
                    vec![h, e_inter],
                    out_std(e_inter),
                );
            }
        } else {
            push(
                format!("{p}.mlp.gate_proj.weight"),
                vec![inter, h],
                std_in(h),
            );
            push(format!("{p}.mlp.up_proj.weight"), vec![inter, h], std_in(h));
            push(
                format!("{p}.mlp.down_proj.weight"),
                vec![h, inter],
                out_std(inter),
            );
        }
        push(format!("{p}.input_layernorm.weight"), vec![h], norm);
        push(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            norm,
        );
    }
    push("model.norm.weight".into(), vec![h], norm);
    if !spec.tie_embeddings {
        push("lm_head.weight".into(), vec![spec.vocab, h], head_rows);
    }
    out
}

/// Every tensor the checkpoint holds, name and shape, in `transformers`' state-dict order.
pub fn tensor_names_and_shapes(spec: &Spec) -> Vec<(String, Vec<usize>)> {
    tensor_specs(spec)
        .into_iter()
        .map(|t| (t.name, t.shape))
        .collect()
}

/// splitmix64: a tiny, well-mixed generator whose stream depends on nothing but its seed.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`, 24 bits (all an f32 mantissa holds).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// A tensor's generator: seeded from the spec's seed and the tensor's name (FNV-1a), so each
/// tensor's values are independent of the others and of the order they are made in.
fn rng_for(seed: u64, name: &str) -> SplitMix64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3);
    }
    let mut rng = SplitMix64(h ^ seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    // Discard one output so that nearby seeds do not start nearby.
    rng.next_u64();
    rng
}

/// A tensor's values as stored (little-endian `dtype`).
fn tensor_bytes(spec: &Spec, t: &TensorSpec) -> io::Result<Vec<u8>> {
    let n: usize = t.shape.iter().product();
    let mut rng = rng_for(spec.seed, &t.name);
    let cols = t.shape.last().copied().unwrap_or(1).max(1);
    let mut bytes = Vec::with_capacity(n * spec.dtype.size_in_bytes());
    for i in 0..n {
        let (lo, hi) = match t.init {
            // Uniform on [-a, a) has std a/sqrt(3).
            Init::Std(std) => (-std * 3f32.sqrt(), std * 3f32.sqrt()),
            Init::Vocab(std, _) if i / cols < TOKENIZER_VOCAB => {
                (-std * 3f32.sqrt(), std * 3f32.sqrt())
            }
            Init::Vocab(_, pad) => (-pad * 3f32.sqrt(), pad * 3f32.sqrt()),
            Init::Range(lo, hi) => (lo, hi),
        };
        let v = lo + (hi - lo) * rng.unit();
        match spec.dtype {
            DType::F32 => bytes.extend_from_slice(&v.to_le_bytes()),
            // Drawn in f32, rounded to nearest bf16: what `tensor.to(torch.bfloat16)` stores.
            DType::BF16 => bytes.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            other => return Err(invalid(format!("dtype {other:?}: only BF16 and F32"))),
        }
    }
    Ok(bytes)
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

fn other_err(msg: String) -> io::Error {
    io::Error::other(msg)
}

/// The spec's shape makes sense (what real configs guarantee).
fn check(spec: &Spec) -> io::Result<()> {
    let positive = [
        ("vocab", spec.vocab),
        ("hidden", spec.hidden),
        ("intermediate", spec.intermediate),
        ("layers", spec.layers),
        ("heads", spec.heads),
        ("kv_heads", spec.kv_heads),
        ("shards", spec.shards),
        ("head_dim", spec.head_size()),
    ];
    if let Some((what, _)) = positive.iter().find(|(_, v)| *v == 0) {
        return Err(invalid(format!("{}: {what} must be positive", spec.name)));
    }
    if !spec.heads.is_multiple_of(spec.kv_heads) {
        return Err(invalid(format!(
            "{}: heads {} not a multiple of kv_heads {}",
            spec.name, spec.heads, spec.kv_heads
        )));
    }
    if spec.head_dim.is_none() && !spec.hidden.is_multiple_of(spec.heads) {
        return Err(invalid(format!(
            "{}: hidden {} not a multiple of heads {} (give head_dim)",
            spec.name, spec.hidden, spec.heads
        )));
    }
    if !spec.head_size().is_multiple_of(2) {
        return Err(invalid(format!(
            "{}: RoPE needs an even head size",
            spec.name
        )));
    }
    if spec.llama3_rope && spec.family != Family::Llama {
        return Err(invalid(format!("{}: llama3_rope is Llama's", spec.name)));
    }
    check_experts(spec)?;
    if !matches!(spec.dtype, DType::BF16 | DType::F32) {
        return Err(invalid(format!(
            "{}: dtype {:?}: only BF16 and F32",
            spec.name, spec.dtype
        )));
    }
    if spec.vocab < TOKENIZER_VOCAB {
        return Err(invalid(format!(
            "{}: vocab {} is under the tokenizer's {TOKENIZER_VOCAB}",
            spec.name, spec.vocab
        )));
    }
    let tensors = tensor_specs(spec).len();
    if spec.shards > tensors {
        return Err(invalid(format!(
            "{}: {} shards for {tensors} tensors",
            spec.name, spec.shards
        )));
    }
    Ok(())
}

/// The mixture-of-experts fields: all 0 (and `norm_topk_prob` false) for a dense family; for
/// Mixtral and Qwen3-MoE experts, a top-k in `1..=experts`, an expert size and a sparse step,
/// Mixtral's fixed to what its config implies (experts of `intermediate`, in every layer,
/// weights renormalised).
fn check_experts(spec: &Spec) -> io::Result<()> {
    let name = spec.name;
    if !spec.family.is_moe() {
        let set = [
            ("experts", spec.experts),
            ("experts_per_token", spec.experts_per_token),
            ("expert_intermediate", spec.expert_intermediate),
            ("sparse_step", spec.sparse_step),
            ("norm_topk_prob", usize::from(spec.norm_topk_prob)),
        ];
        if let Some((what, _)) = set.iter().find(|(_, v)| *v != 0) {
            return Err(invalid(format!(
                "{name}: {what} is for Mixtral and Qwen3-MoE, not {:?}",
                spec.family
            )));
        }
        return Ok(());
    }
    let positive = [
        ("experts", spec.experts),
        ("expert_intermediate", spec.expert_intermediate),
        ("sparse_step", spec.sparse_step),
    ];
    if let Some((what, _)) = positive.iter().find(|(_, v)| *v == 0) {
        return Err(invalid(format!("{name}: {what} must be positive")));
    }
    if !(1..=spec.experts).contains(&spec.experts_per_token) {
        return Err(invalid(format!(
            "{name}: experts_per_token {} not in 1..={}",
            spec.experts_per_token, spec.experts
        )));
    }
    if spec.family == Family::Mixtral {
        if spec.expert_intermediate != spec.intermediate {
            return Err(invalid(format!(
                "{name}: Mixtral's experts are of intermediate_size {}, not {}",
                spec.intermediate, spec.expert_intermediate
            )));
        }
        if spec.sparse_step != 1 {
            return Err(invalid(format!(
                "{name}: Mixtral has experts in every layer (sparse_step 1, not {})",
                spec.sparse_step
            )));
        }
        if !spec.norm_topk_prob {
            return Err(invalid(format!(
                "{name}: Mixtral always renormalises its top-k weights (norm_topk_prob true)"
            )));
        }
    }
    Ok(())
}

/// Writes the checkpoint `spec` describes into `dir` (created if missing; files of the same
/// names are replaced): `config.json`, `generation_config.json`, the weights, `tokenizer.json`
/// and `tokenizer_config.json`.
pub fn write(spec: &Spec, dir: &Path) -> io::Result<()> {
    check(spec)?;
    fs::create_dir_all(dir)?;

    let tokenizer = build_tokenizer(spec)?;
    let tokenizer_json = tokenizer
        .to_string(true)
        .map_err(|e| other_err(format!("tokenizer.json: {e}")))?;
    fs::write(dir.join("tokenizer.json"), tokenizer_json)?;
    write_json(&dir.join("tokenizer_config.json"), &tokenizer_config(spec))?;

    write_weights(spec, dir)?;
    write_json(&dir.join("config.json"), &config(spec))?;
    write_json(
        &dir.join("generation_config.json"),
        &generation_config(spec),
    )?;
    Ok(())
}

/// JSON as `transformers` writes it: keys sorted, two-space indent, a final newline.
fn write_json(path: &Path, value: &Value) -> io::Result<()> {
    // serde_json's own map is sorted unless `preserve_order` is on somewhere in the build;
    // sorting here keeps the bytes the same either way.
    fn sorted(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let b: BTreeMap<&String, Value> = m.iter().map(|(k, v)| (k, sorted(v))).collect();
                Value::Object(b.into_iter().map(|(k, v)| (k.clone(), v)).collect())
            }
            Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    let mut text = serde_json::to_string_pretty(&sorted(value))
        .map_err(|e| other_err(format!("{}: {e}", path.display())))?;
    text.push('\n');
    fs::write(path, text)
}

fn torch_dtype(spec: &Spec) -> &'static str {
    match spec.dtype {
        DType::BF16 => "bfloat16",
        _ => "float32",
    }
}

fn eos_value(spec: &Spec) -> Value {
    let ids = spec.eos_token_ids();
    if spec.llama3_rope {
        json!(ids)
    } else {
        json!(ids[0])
    }
}

/// `config.json`, with the fields `transformers` writes for the family.
fn config(spec: &Spec) -> Value {
    let mut c = json!({
        "architectures": [spec.family.architecture()],
        "attention_dropout": 0.0,
        "bos_token_id": spec.bos_token_id(),
        "eos_token_id": eos_value(spec),
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate,
        "max_position_embeddings": MAX_POSITIONS,
        "model_type": spec.family.model_type(),
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "tie_word_embeddings": spec.tie_embeddings,
        "torch_dtype": torch_dtype(spec),
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": true,
        "vocab_size": spec.vocab,
    });
    let Value::Object(m) = &mut c else {
        unreachable!("json! of an object literal is an object")
    };
    let mut set = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    match spec.family {
        Family::Llama => {
            set("attention_bias", json!(spec.attention_bias));
            set("mlp_bias", json!(false));
            set("pretraining_tp", json!(1));
            set("rms_norm_eps", json!(1e-5));
            if spec.llama3_rope {
                set(
                    "rope_scaling",
                    json!({
                        "factor": 8.0,
                        "high_freq_factor": 4.0,
                        "low_freq_factor": 1.0,
                        "original_max_position_embeddings": 64,
                        "rope_type": "llama3",
                    }),
                );
                set("rope_theta", json!(500000.0));
            } else {
                set("rope_scaling", Value::Null);
                set("rope_theta", json!(10000.0));
            }
            if let Some(hd) = spec.head_dim {
                set("head_dim", json!(hd));
            }
        }
        Family::Mistral => {
            set("head_dim", json!(spec.head_dim));
            set("rms_norm_eps", json!(1e-5));
            set("rope_theta", json!(10000.0));
            set("sliding_window", json!(spec.sliding_window));
        }
        // Mistral's fields (Mixtral's own rope_theta), then the experts'.
        Family::Mixtral => {
            set("head_dim", json!(spec.head_dim));
            set("rms_norm_eps", json!(1e-5));
            set("rope_theta", json!(1000000.0));
            set("sliding_window", json!(spec.sliding_window));
            set("num_local_experts", json!(spec.experts));
            set("num_experts_per_tok", json!(spec.experts_per_token));
            set("output_router_logits", json!(false));
            set("router_aux_loss_coef", json!(0.02));
            set("router_jitter_noise", json!(0.0));
        }
        Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe => {
            set("max_window_layers", json!(spec.layers));
            set("rms_norm_eps", json!(1e-6));
            set("rope_scaling", Value::Null);
            set("rope_theta", json!(1000000.0));
            set("sliding_window", json!(spec.sliding_window));
            set("use_sliding_window", json!(false));
            if spec.family.is_qwen3() {
                set("attention_bias", json!(spec.attention_bias));
                set("head_dim", json!(spec.head_size()));
            } else if let Some(hd) = spec.head_dim {
                set("head_dim", json!(hd));
            }
            if spec.family == Family::Qwen3Moe {
                set("decoder_sparse_step", json!(spec.sparse_step));
                set("mlp_only_layers", json!([]));
                set("moe_intermediate_size", json!(spec.expert_intermediate));
                set("norm_topk_prob", json!(spec.norm_topk_prob));
                set("num_experts", json!(spec.experts));
                set("num_experts_per_tok", json!(spec.experts_per_token));
                set("output_router_logits", json!(false));
                set("router_aux_loss_coef", json!(0.001));
            }
        }
    }
    c
}

fn generation_config(spec: &Spec) -> Value {
    json!({
        "_from_model_config": true,
        "bos_token_id": spec.bos_token_id(),
        "eos_token_id": eos_value(spec),
        "transformers_version": TRANSFORMERS_VERSION,
    })
}

fn tokenizer_config(spec: &Spec) -> Value {
    let added: serde_json::Map<String, Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(id, content)| {
            let token = json!({
                "content": content,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": true,
            });
            (id.to_string(), token)
        })
        .collect();
    json!({
        "add_bos_token": adds_bos(spec),
        "add_eos_token": false,
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "clean_up_tokenization_spaces": false,
        "eos_token": EOS,
        "model_max_length": MAX_POSITIONS,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
}

/// Llama, Mistral and Mixtral tokenizers put `<s>` in front of every encoding; Qwen's add
/// nothing.
fn adds_bos(spec: &Spec) -> bool {
    !spec.family.is_qwen()
}

/// The byte-level BPE tokenizer (GPT-2 / Llama 3 / Qwen style): the specials, the 256 byte
/// symbols, and merges learnt from [`CORPUS`].
fn build_tokenizer(spec: &Spec) -> io::Result<Tokenizer> {
    let tok_err =
        |what: &str, e: &dyn std::fmt::Display| other_err(format!("tokenizer: {what}: {e}"));
    let (tokens, merges) = learn_bpe(TOKENIZER_VOCAB)?;
    // The padding rows' init counts on exactly this many; only an edit of the corpus or the
    // constant can break it.
    if tokens.len() != TOKENIZER_VOCAB {
        return Err(other_err(format!(
            "tokenizer: {} tokens learnt, not {TOKENIZER_VOCAB}",
            tokens.len()
        )));
    }
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| tok_err("BPE", &e))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    if adds_bos(spec) {
        let template = TemplateProcessing::builder()
            .try_single(format!("{BOS} $A:0"))
            .map_err(|e| tok_err("template", &e))?
            .try_pair(format!("{BOS}:0 $A:0 {BOS}:1 $B:1"))
            .map_err(|e| tok_err("template", &e))?
            .special_tokens(vec![(BOS, spec.bos_token_id())])
            .build()
            .map_err(|e| tok_err("template", &e))?;
        tokenizer.with_post_processor(Some(template));
    } else {
        tokenizer.with_post_processor(Some(ByteLevel::new(false, false, true)));
    }
    tokenizer
        .add_special_tokens(SPECIALS.iter().map(|s| AddedToken::from(*s, true)))
        .map_err(|e| tok_err("special tokens", &e))?;
    Ok(tokenizer)
}

/// Learns byte-level BPE merges from [`CORPUS`] until there are `target` tokens (or no pair
/// occurs twice): the tokens by id (specials, bytes by code point, merges in order) and the
/// merges. The tokenizers crate's trainer would do as well, but it breaks ties in an order
/// that can depend on its hash maps' per-process seeds; here ties go to the smallest pair, so
/// the vocabulary is the same on every run.
fn learn_bpe(target: usize) -> io::Result<(Vec<String>, Merges)> {
    let mut pre = PreTokenizedString::from(CORPUS);
    ByteLevel::new(false, true, true)
        .pre_tokenize(&mut pre)
        .map_err(|e| other_err(format!("tokenizer: pre-tokenizing the corpus: {e}")))?;
    let mut word_counts: BTreeMap<Vec<String>, u64> = BTreeMap::new();
    for (word, _, _) in pre.get_splits(OffsetReferential::Original, OffsetType::Byte) {
        let symbols = word.chars().map(String::from).collect();
        *word_counts.entry(symbols).or_default() += 1;
    }
    let mut words: Vec<(Vec<String>, u64)> = word_counts.into_iter().collect();

    let mut tokens: Vec<String> = SPECIALS.iter().map(|s| s.to_string()).collect();
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort_unstable();
    tokens.extend(alphabet.into_iter().map(String::from));
    let mut known: BTreeSet<String> = tokens.iter().cloned().collect();
    let mut merges = Vec::new();

    while tokens.len() < target {
        let mut pairs: BTreeMap<(&str, &str), u64> = BTreeMap::new();
        for (symbols, count) in &words {
            for w in symbols.windows(2) {
                *pairs.entry((w[0].as_str(), w[1].as_str())).or_default() += count;
            }
        }
        // The most frequent pair; among equals the first in order, the smallest.
        let mut best: Option<((&str, &str), u64)> = None;
        for (pair, count) in pairs {
            if best.is_none_or(|(_, c)| count > c) {
                best = Some((pair, count));
            }
        }
        let Some(((a, b), count)) = best else { break };
        if count < 2 {
            break;
        }
        let (a, b) = (a.to_string(), b.to_string());
        let merged = format!("{a}{b}");
        for (symbols, _) in &mut words {
            let mut out = Vec::with_capacity(symbols.len());
            let mut i = 0;
            while i < symbols.len() {
                if i + 1 < symbols.len() && symbols[i] == a && symbols[i + 1] == b {
                    out.push(merged.clone());
                    i += 2;
                } else {
                    out.push(std::mem::take(&mut symbols[i]));
                    i += 1;
                }
            }
            *symbols = out;
        }
        if known.insert(merged.clone()) {
            tokens.push(merged);
        }
        merges.push((a, b));
    }
    Ok((tokens, merges))
}

/// Which shard each tensor goes to, in order: contiguous runs of roughly equal bytes, none
/// empty (`check` saw to there being at least as many tensors as shards).
fn assign_shards(sizes: &[usize], shards: usize) -> Vec<usize> {
    let total: usize = sizes.iter().sum::<usize>().max(1);
    let mut out = Vec::with_capacity(sizes.len());
    let mut before = 0usize;
    let mut prev = 0usize;
    for (i, &size) in sizes.iter().enumerate() {
        // The shard the tensor's middle byte falls in, were the bytes cut into equal parts...
        let ideal = ((before + size / 2) * shards / total).min(shards - 1);
        // ...but no shard skipped, and enough tensors left for the shards after this one.
        let left = sizes.len() - i;
        let lowest = prev.max(shards.saturating_sub(left));
        let highest = if i == 0 {
            0
        } else {
            (prev + 1).min(shards - 1)
        };
        let k = ideal.clamp(lowest, highest.max(lowest));
        out.push(k);
        prev = k;
        before += size;
    }
    out
}

/// The weights: one file, or shards with their index.
fn write_weights(spec: &Spec, dir: &Path) -> io::Result<()> {
    let tensors = tensor_specs(spec);
    let elem = spec.dtype.size_in_bytes();
    let sizes: Vec<usize> = tensors
        .iter()
        .map(|t| t.shape.iter().product::<usize>() * elem)
        .collect();
    let files = spec.weight_files();
    let owner = assign_shards(&sizes, files.len());
    let mut weight_map = serde_json::Map::new();
    for (k, file) in files.iter().enumerate() {
        let mine: Vec<&TensorSpec> = tensors
            .iter()
            .zip(&owner)
            .filter(|(_, &o)| o == k)
            .map(|(t, _)| t)
            .collect();
        for t in &mine {
            weight_map.insert(t.name.clone(), json!(file));
        }
        write_safetensors(spec, &mine, &dir.join(file))?;
    }
    if files.len() > 1 {
        let index = json!({
            "metadata": { "total_size": sizes.iter().sum::<usize>() },
            "weight_map": weight_map,
        });
        write_json(&dir.join("model.safetensors.index.json"), &index)?;
    }
    Ok(())
}

/// One safetensors file as the `safetensors` library writes it for PyTorch: an 8-byte header
/// length, the JSON header (`__metadata__` `{"format": "pt"}`, then the tensors in data
/// order, sorted by name) padded with spaces to 8 bytes, then the data.
fn write_safetensors(spec: &Spec, tensors: &[&TensorSpec], path: &Path) -> io::Result<()> {
    let dtype = match spec.dtype {
        DType::BF16 => "BF16",
        _ => "F32",
    };
    let mut sorted: Vec<&TensorSpec> = tensors.to_vec();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut header = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut offset = 0usize;
    for t in &sorted {
        let bytes = t.shape.iter().product::<usize>() * spec.dtype.size_in_bytes();
        let name = serde_json::to_string(&t.name)
            .map_err(|e| other_err(format!("{}: {e}", path.display())))?;
        let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        header.push_str(&format!(
            r#",{name}:{{"dtype":"{dtype}","shape":[{}],"data_offsets":[{offset},{}]}}"#,
            shape.join(","),
            offset + bytes
        ));
        offset += bytes;
    }
    header.push('}');
    while !header.len().is_multiple_of(8) {
        header.push(' ');
    }
    let mut out = BufWriter::new(fs::File::create(path)?);
    out.write_all(&(header.len() as u64).to_le_bytes())?;
    out.write_all(header.as_bytes())?;
    for t in &sorted {
        out.write_all(&tensor_bytes(spec, t)?)?;
    }
    out.flush()
}
