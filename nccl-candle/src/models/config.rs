//! A Hugging Face `config.json` for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) and
//! its mixtures of experts (Mixtral, Qwen3-MoE): the fields these models use, resolved (defaults filled in, the architecture's own rules
//! applied), unknown fields ignored.
//!
//! Past 600 lines: one walk over the JSON with an error naming each field, the families'
//! rules and the validation, which read best together (the tests are in `config_tests.rs`).

use std::path::Path;

use serde_json::{Map, Value};

use crate::{CheckpointFault, Error, Result};

/// Which model family a checkpoint is (`model_type`, or `architectures[0]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    /// `llama` / `LlamaForCausalLM`: Llama 2 and 3 (Llama 3's rope scaling included).
    Llama,
    /// `mistral` / `MistralForCausalLM`: sliding-window attention when `sliding_window` is set.
    Mistral,
    /// `qwen2` / `Qwen2ForCausalLM`: biases on q, k and v.
    Qwen2,
    /// `qwen3` / `Qwen3ForCausalLM`: RMSNorms on each query and key head.
    Qwen3,
    /// `mixtral` / `MixtralForCausalLM`: Mistral's attention, every MLP a mixture of experts.
    Mixtral,
    /// `qwen3_moe` / `Qwen3MoeForCausalLM`: Qwen3's attention, MLPs mixtures of experts (all,
    /// or those `decoder_sparse_step` and `mlp_only_layers` say).
    Qwen3Moe,
}

/// The mixture of experts of a [`Family::Mixtral`] or [`Family::Qwen3Moe`] model: each token
/// goes to the `experts_per_token` experts its router scores best, and their SwiGLU MLPs'
/// outputs are summed with the router's softmax weights of those experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertsConfig {
    /// Experts in a layer (Mixtral's `num_local_experts`, Qwen3-MoE's `num_experts`).
    pub experts: usize,
    /// Experts each token goes to (`num_experts_per_tok`).
    pub experts_per_token: usize,
    /// Each expert's MLP features (Mixtral's `intermediate_size`, Qwen3-MoE's
    /// `moe_intermediate_size`).
    pub expert_intermediate_size: usize,
    /// Whether the chosen experts' weights are divided by their sum (Mixtral: always;
    /// Qwen3-MoE: `norm_topk_prob`, false when absent).
    pub norm_topk_prob: bool,
    /// Layer `i` is a mixture when `(i + 1)` is a multiple of this (`decoder_sparse_step`; 1
    /// for Mixtral) and `i` is not in [`dense_layers`](Self::dense_layers).
    pub decoder_sparse_step: usize,
    /// Layers with a dense MLP of `intermediate_size` whatever the step (`mlp_only_layers`).
    pub dense_layers: Vec<usize>,
}

impl ExpertsConfig {
    /// Whether layer `layer`'s MLP is the mixture (otherwise a dense MLP).
    pub fn is_sparse(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1))
            && !self.dense_layers.contains(&layer)
    }
}

/// Llama 3's rope scaling (`rope_scaling` with `rope_type` `llama3`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3RopeScaling {
    /// `factor`.
    pub factor: f64,
    /// `low_freq_factor`.
    pub low_freq_factor: f64,
    /// `high_freq_factor`.
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: usize,
}

/// A model's configuration, resolved from its `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The family.
    pub family: Family,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `intermediate_size`.
    pub intermediate_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads`.
    pub num_attention_heads: usize,
    /// `num_key_value_heads` (`num_attention_heads` when absent).
    pub num_key_value_heads: usize,
    /// `head_dim` (`hidden_size / num_attention_heads` when absent or null).
    pub head_dim: usize,
    /// `rms_norm_eps`.
    pub rms_norm_eps: f64,
    /// `rope_theta` (10000 when absent).
    pub rope_theta: f64,
    /// Llama 3's rope scaling; `None` without `rope_scaling`, with `null`, or with
    /// `rope_type`/`type` `default`.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// `tie_word_embeddings` (false when absent): the head is the embedding table.
    pub tie_word_embeddings: bool,
    /// Biases on q_proj, k_proj and v_proj (Qwen2: always; Llama, Qwen3: `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on o_proj (Llama, Qwen3: `attention_bias`; Qwen2, Mistral: never).
    pub o_bias: bool,
    /// Biases on the MLP's projections (Llama: `mlp_bias`; others: never).
    pub mlp_bias: bool,
    /// RMSNorms on each query and key head (`q_norm`, `k_norm`; Qwen3).
    pub qk_norm: bool,
    /// The attention window: a query sees the keys of its last `sliding_window` positions
    /// (Mistral's `sliding_window` when set; `None` when absent or null, and always for
    /// Qwen2/Qwen3 with `use_sliding_window` false).
    pub sliding_window: Option<usize>,
    /// `bos_token_id`.
    pub bos_token_id: Option<u32>,
    /// `eos_token_id`: one id or a list (empty when absent or null).
    pub eos_token_ids: Vec<u32>,
    /// `torch_dtype` (`dtype` in newer files), as written (`"bfloat16"`, ...), if any.
    pub torch_dtype: Option<String>,
    /// The mixture of experts (Mixtral, Qwen3-MoE); `None` for the dense families.
    pub experts: Option<ExpertsConfig>,
}

/// The families: the type, its `model_type` and its `architectures[0]`.
const FAMILIES: [(Family, &str, &str); 6] = [
    (Family::Llama, "llama", "LlamaForCausalLM"),
    (Family::Mistral, "mistral", "MistralForCausalLM"),
    (Family::Qwen2, "qwen2", "Qwen2ForCausalLM"),
    (Family::Qwen3, "qwen3", "Qwen3ForCausalLM"),
    (Family::Mixtral, "mixtral", "MixtralForCausalLM"),
    (Family::Qwen3Moe, "qwen3_moe", "Qwen3MoeForCausalLM"),
];

/// The fields without which no model can be built; the others have defaults.
const REQUIRED_SIZES: [&str; 6] = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
];

impl Family {
    /// The `model_type` string ("llama", "mistral", "qwen2", "qwen3", "mixtral",
    /// "qwen3_moe").
    pub fn model_type(self) -> &'static str {
        FAMILIES
            .iter()
            .find(|(family, _, _)| *family == self)
            .map_or("", |(_, model_type, _)| model_type)
    }

    /// The `architectures[0]` class name (`"LlamaForCausalLM"`, ...).
    pub fn architecture(self) -> &'static str {
        FAMILIES
            .iter()
            .find(|(family, _, _)| *family == self)
            .map_or("", |(_, _, architecture)| architecture)
    }
}

impl ModelConfig {
    /// Parses `text` (the contents of `path`, named in errors), then [validates](Self::validate) it.
    ///
    /// The family comes from `model_type`, else from `architectures[0]`; both present and
    /// naming different families is [`CheckpointFault::Malformed`]. Required: `vocab_size`,
    /// `hidden_size`, `intermediate_size`, `num_hidden_layers`, `num_attention_heads`,
    /// `rms_norm_eps`, `max_position_embeddings`; the others have transformers' defaults, and
    /// `null` counts as absent. Integers must be JSON integers (`4096.0` is refused), floats
    /// may be either. Transformers 5's `rope_parameters` (`rope_theta` and the scaling in one
    /// object) is read when `rope_theta`/`rope_scaling` are not given.
    ///
    /// Errors are [`Error::Checkpoint`] naming the field: [`CheckpointFault::Malformed`] for
    /// text that is not a JSON object, a field of the wrong type, missing required fields or
    /// sizes [`validate`](Self::validate) refuses; [`CheckpointFault::Unsupported`] for another
    /// architecture, a `hidden_act` other than SiLU, a rope scaling other than Llama 3's (or on
    /// another family than Llama), a `partial_rotary_factor` other than 1, and Qwen2/Qwen3 with
    /// `use_sliding_window` true.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let value: Value = serde_json::from_str(text)
            .map_err(|err| malformed(path, format!("not JSON: {err}")))?;
        let Value::Object(map) = &value else {
            return Err(malformed(
                path,
                format!("expected a JSON object, found {}", found(&value)),
            ));
        };
        let top = Fields::new(map, "", path);

        // The family first: another architecture's fields are not worth complaining about.
        let family = family(&top)?;
        if let Some(act) = top.str("hidden_act")? {
            // transformers' ACT2FN maps both names to the same SiLU.
            if act != "silu" && act != "swish" {
                return Err(unsupported(
                    path,
                    format!("hidden_act {act:?} is not supported (only \"silu\")"),
                ));
            }
        }

        let mut missing: Vec<&str> = Vec::new();
        let mut sizes = [0usize; REQUIRED_SIZES.len()];
        for (slot, key) in sizes.iter_mut().zip(REQUIRED_SIZES) {
            match top.usize(key)? {
                Some(size) => *slot = size,
                None => missing.push(key),
            }
        }
        let rms_norm_eps = top.f64("rms_norm_eps")?;
        if rms_norm_eps.is_none() {
            missing.push("rms_norm_eps");
        }
        let (Some(rms_norm_eps), true) = (rms_norm_eps, missing.is_empty()) else {
            return Err(malformed(
                path,
                format!("missing required fields: {}", missing.join(", ")),
            ));
        };
        let [vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, max_position_embeddings] =
            sizes;

        let num_key_value_heads = top
            .usize("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        // transformers' defaults: Qwen3Config's 128, the others' `hidden_size //
        // num_attention_heads` (zero heads is left to validate).
        let head_dim = match top.usize("head_dim")? {
            Some(head_dim) => head_dim,
            None if family == Family::Qwen3 => 128,
            None => hidden_size.checked_div(num_attention_heads).unwrap_or(0),
        };
        let tie_word_embeddings = top.bool("tie_word_embeddings")?.unwrap_or(false);
        let (rope_theta, rope_scaling) = rope(&top, family)?;

        // The biases as each family's modelling code builds them, whatever else the file says
        // (transformers' Mistral and Qwen2 ignore `attention_bias` and `mlp_bias`).
        let (qkv_bias, o_bias, mlp_bias) = match family {
            Family::Llama => {
                let attention_bias = top.bool("attention_bias")?.unwrap_or(false);
                (
                    attention_bias,
                    attention_bias,
                    top.bool("mlp_bias")?.unwrap_or(false),
                )
            }
            Family::Qwen3 | Family::Qwen3Moe => {
                let attention_bias = top.bool("attention_bias")?.unwrap_or(false);
                (attention_bias, attention_bias, false)
            }
            Family::Qwen2 => (true, false, false),
            Family::Mistral | Family::Mixtral => (false, false, false),
        };

        let sliding_window = match family {
            Family::Mistral | Family::Mixtral => top.usize("sliding_window")?,
            Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe => {
                // Qwen files carry a `sliding_window` even when it is off; only the switch counts.
                if top.bool("use_sliding_window")?.unwrap_or(false) {
                    return Err(unsupported(
                        path,
                        format!(
                            "use_sliding_window: true: sliding-window attention is not \
                             implemented for {} (Qwen2's window applies to the layers from \
                             max_window_layers on, the others attend fully)",
                            family.model_type()
                        ),
                    ));
                }
                None
            }
            Family::Llama => None,
        };

        let bos_token_id = match top.value("bos_token_id") {
            Some(id) => Some(token_id(id, "bos_token_id", path)?),
            None => None,
        };
        let eos_token_ids = match top.value("eos_token_id") {
            None => Vec::new(),
            Some(Value::Array(ids)) => ids
                .iter()
                .enumerate()
                .map(|(i, id)| token_id(id, &format!("eos_token_id[{i}]"), path))
                .collect::<Result<Vec<u32>>>()?,
            Some(id @ Value::Number(_)) => vec![token_id(id, "eos_token_id", path)?],
            Some(other) => {
                return Err(malformed(
                    path,
                    format!(
                        "eos_token_id: expected a token id or a list of them, found {}",
                        found(other)
                    ),
                ))
            }
        };
        // Newer transformers write `dtype`, older `torch_dtype`.
        let torch_dtype = match top.str("dtype")? {
            Some(dtype) => Some(dtype.to_owned()),
            None => top.str("torch_dtype")?.map(str::to_owned),
        };

        let config = ModelConfig {
            family,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings,
            qkv_bias,
            o_bias,
            mlp_bias,
            qk_norm: matches!(family, Family::Qwen3 | Family::Qwen3Moe),
            sliding_window,
            bos_token_id,
            eos_token_ids,
            torch_dtype,
            experts: experts(&top, family, intermediate_size)?,
        };
        config.validate(path)?;
        Ok(config)
    }

    /// Reads and parses the file ([`from_json`](Self::from_json)). A file that cannot be read
    /// is [`CheckpointFault::Missing`]; one that is not UTF-8, [`CheckpointFault::Malformed`].
    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|err| Error::Checkpoint {
            path: path.to_path_buf(),
            fault: CheckpointFault::Missing,
            why: format!("cannot read the model's config: {err}"),
        })?;
        let text = String::from_utf8(bytes)
            .map_err(|err| malformed(path, format!("not UTF-8 text: {err}")))?;
        Self::from_json(&text, path)
    }

    /// Query heads' total width: `num_attention_heads * head_dim` (q_proj's output, o_proj's
    /// input; not `hidden_size` when `head_dim` is given, as in Qwen3).
    pub fn q_width(&self) -> usize {
        // validate refuses an overflow; saturating keeps an unvalidated value from panicking.
        self.num_attention_heads.saturating_mul(self.head_dim)
    }

    /// Key/value heads' total width: `num_key_value_heads * head_dim` (k_proj's and v_proj's
    /// output).
    pub fn kv_width(&self) -> usize {
        self.num_key_value_heads.saturating_mul(self.head_dim)
    }

    /// Checks the sizes are usable at all, whatever the number of ranks: every size above 0
    /// (`sliding_window` too when set), the query heads a multiple of the key/value heads, an
    /// even `head_dim` (rotary embeddings turn pairs), `rms_norm_eps` positive and finite,
    /// `rope_theta` positive and finite, and Llama 3's scaling sane (`factor` >= 1,
    /// 0 < `low_freq_factor` < `high_freq_factor`, `original_max_position_embeddings` > 0).
    ///
    /// Error: [`Error::Checkpoint`] with [`CheckpointFault::Malformed`], its `why` naming every
    /// field at fault.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let mut faults: Vec<String> = Vec::new();
        for (name, size) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if size == 0 {
                faults.push(format!("{name} is 0"));
            }
        }
        if self.num_key_value_heads > 0
            && !self
                .num_attention_heads
                .is_multiple_of(self.num_key_value_heads)
        {
            faults.push(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            faults.push(format!(
                "head_dim ({}) is odd (rotary embeddings turn pairs of dimensions)",
                self.head_dim
            ));
        }
        if self
            .num_attention_heads
            .checked_mul(self.head_dim)
            .is_none()
        {
            faults.push(format!(
                "num_attention_heads ({}) * head_dim ({}) overflows",
                self.num_attention_heads, self.head_dim
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            faults.push(format!(
                "rms_norm_eps ({}) is not a positive finite number",
                self.rms_norm_eps
            ));
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            faults.push(format!(
                "rope_theta ({}) is not a positive finite number",
                self.rope_theta
            ));
        }
        if self.sliding_window == Some(0) {
            faults.push("sliding_window is 0".to_owned());
        }
        if let Some(experts) = &self.experts {
            let (names, per_token) = match self.family {
                Family::Mixtral => (
                    ("num_local_experts", "intermediate_size"),
                    "num_experts_per_tok",
                ),
                _ => (
                    ("num_experts", "moe_intermediate_size"),
                    "num_experts_per_tok",
                ),
            };
            if experts.experts == 0 {
                faults.push(format!("{} is 0", names.0));
            }
            if experts.expert_intermediate_size == 0 {
                faults.push(format!("{} is 0", names.1));
            }
            if experts.experts_per_token == 0 || experts.experts_per_token > experts.experts {
                faults.push(format!(
                    "{per_token} ({}) is not in 1..={} ({})",
                    experts.experts_per_token, experts.experts, names.0
                ));
            }
            if experts.decoder_sparse_step == 0 {
                faults.push("decoder_sparse_step is 0".to_owned());
            }
        }
        if let Some(scaling) = &self.rope_scaling {
            // `!(x >= y)` rather than `x < y`: NaN fails it too.
            if !(scaling.factor.is_finite() && scaling.factor >= 1.0) {
                faults.push(format!(
                    "rope_scaling.factor ({}) is not a finite number >= 1",
                    scaling.factor
                ));
            }
            if !(scaling.low_freq_factor.is_finite() && scaling.low_freq_factor > 0.0) {
                faults.push(format!(
                    "rope_scaling.low_freq_factor ({}) is not a positive finite number",
                    scaling.low_freq_factor
                ));
            }
            if !(scaling.high_freq_factor.is_finite()
                && scaling.low_freq_factor < scaling.high_freq_factor)
            {
                faults.push(format!(
                    "rope_scaling.low_freq_factor ({}) is not below rope_scaling.high_freq_factor ({})",
                    scaling.low_freq_factor, scaling.high_freq_factor
                ));
            }
            if scaling.original_max_position_embeddings == 0 {
                faults.push("rope_scaling.original_max_position_embeddings is 0".to_owned());
            }
        }
        if faults.is_empty() {
            Ok(())
        } else {
            Err(malformed(path, faults.join("; ")))
        }
    }
}

/// A [`CheckpointFault::Malformed`] error on `path`.
fn malformed(path: &Path, why: String) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        fault: CheckpointFault::Malformed,
        why,
    }
}

/// A [`CheckpointFault::Unsupported`] error on `path`.
fn unsupported(path: &Path, why: String) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        fault: CheckpointFault::Unsupported,
        why,
    }
}

/// A value as JSON text for an error, cut short: a field may hold a whole table.
fn found(value: &Value) -> String {
    const LONGEST: usize = 60;
    let text = value.to_string();
    if text.chars().count() <= LONGEST {
        text
    } else {
        let head: String = text.chars().take(LONGEST).collect();
        format!("{head}...")
    }
}

/// A token id: an integer that fits `u32`.
fn token_id(value: &Value, name: &str, path: &Path) -> Result<u32> {
    value
        .as_u64()
        .and_then(|id| u32::try_from(id).ok())
        .ok_or_else(|| {
            malformed(
                path,
                format!(
                    "{name}: expected a token id (an integer from 0 to {}), found {}",
                    u32::MAX,
                    found(value)
                ),
            )
        })
}

/// A JSON object's fields, read by type, named in errors with `prefix` before the key
/// (`rope_scaling.factor`). Absent and `null` are both `None`: these files write `null` for
/// "unset" (`"head_dim": null`, `"sliding_window": null`).
struct Fields<'a> {
    map: &'a Map<String, Value>,
    prefix: &'a str,
    path: &'a Path,
}

impl<'a> Fields<'a> {
    fn new(map: &'a Map<String, Value>, prefix: &'a str, path: &'a Path) -> Self {
        Fields { map, prefix, path }
    }

    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn value(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|value| !value.is_null())
    }

    fn wrong(&self, key: &str, expected: &str, value: &Value) -> Error {
        malformed(
            self.path,
            format!(
                "{}: expected {expected}, found {}",
                self.name(key),
                found(value)
            ),
        )
    }

    /// A size: a JSON integer, not negative (a float such as `4096.0` is refused: these files
    /// write sizes as integers, and a float says the file was made by something else).
    fn usize(&self, key: &str) -> Result<Option<usize>> {
        let Some(value) = self.value(key) else {
            return Ok(None);
        };
        value
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| self.wrong(key, "a non-negative integer", value))
    }

    /// A number, integer or float (`"rope_theta": 1000000` is common).
    fn f64(&self, key: &str) -> Result<Option<f64>> {
        let Some(value) = self.value(key) else {
            return Ok(None);
        };
        value
            .as_f64()
            .map(Some)
            .ok_or_else(|| self.wrong(key, "a number", value))
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        let Some(value) = self.value(key) else {
            return Ok(None);
        };
        value
            .as_bool()
            .map(Some)
            .ok_or_else(|| self.wrong(key, "true or false", value))
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>> {
        let Some(value) = self.value(key) else {
            return Ok(None);
        };
        value
            .as_str()
            .map(Some)
            .ok_or_else(|| self.wrong(key, "a string", value))
    }

    fn object(&self, key: &str) -> Result<Option<&'a Map<String, Value>>> {
        let Some(value) = self.value(key) else {
            return Ok(None);
        };
        value
            .as_object()
            .map(Some)
            .ok_or_else(|| self.wrong(key, "an object or null", value))
    }
}

/// The family, from `model_type` and `architectures[0]` (either is enough; both must agree).
fn family(top: &Fields<'_>) -> Result<Family> {
    let path = top.path;
    let supported_types = || {
        FAMILIES
            .iter()
            .map(|(_, model_type, _)| *model_type)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let by_type = match top.str("model_type")? {
        None => None,
        Some(model_type) => Some(
            FAMILIES
                .iter()
                .find(|(_, known, _)| *known == model_type)
                .map(|(family, _, _)| *family)
                .ok_or_else(|| {
                    unsupported(
                        path,
                        format!(
                            "model_type {model_type:?} is not supported (supported: {})",
                            supported_types()
                        ),
                    )
                })?,
        ),
    };
    let architecture = match top.value("architectures") {
        None => None,
        Some(Value::Array(names)) => names.first(),
        Some(other) => return Err(top.wrong("architectures", "a list of class names", other)),
    };
    let by_architecture = match architecture {
        None => None,
        Some(value) => {
            let name = value
                .as_str()
                .ok_or_else(|| top.wrong("architectures[0]", "a class name", value))?;
            // A known model_type with another head (`LlamaForSequenceClassification`) has
            // other weights than these models load: refused too.
            Some(
                FAMILIES
                    .iter()
                    .find(|(_, _, known)| *known == name)
                    .map(|(family, _, _)| *family)
                    .ok_or_else(|| {
                        let supported = FAMILIES
                            .iter()
                            .map(|(_, _, architecture)| *architecture)
                            .collect::<Vec<_>>()
                            .join(", ");
                        unsupported(
                            path,
                            format!(
                                "architectures[0] {name:?} is not supported (supported: {supported})"
                            ),
                        )
                    })?,
            )
        }
    };
    match (by_type, by_architecture) {
        (Some(by_type), Some(by_architecture)) if by_type != by_architecture => Err(malformed(
            path,
            format!(
                "model_type {:?} and architectures[0] {:?} name different families",
                by_type.model_type(),
                by_architecture.architecture()
            ),
        )),
        (Some(family), _) | (None, Some(family)) => Ok(family),
        (None, None) => Err(malformed(
            path,
            format!(
                "missing model_type and architectures: cannot tell the family (supported: {})",
                supported_types()
            ),
        )),
    }
}

/// The mixture of experts of Mixtral and Qwen3-MoE, with transformers' defaults for absent
/// fields; `None` for the dense families.
fn experts(
    top: &Fields<'_>,
    family: Family,
    intermediate_size: usize,
) -> Result<Option<ExpertsConfig>> {
    let config = match family {
        Family::Mixtral => ExpertsConfig {
            experts: top.usize("num_local_experts")?.unwrap_or(8),
            experts_per_token: top.usize("num_experts_per_tok")?.unwrap_or(2),
            expert_intermediate_size: intermediate_size,
            norm_topk_prob: true,
            decoder_sparse_step: 1,
            dense_layers: Vec::new(),
        },
        Family::Qwen3Moe => {
            let dense_layers = match top.value("mlp_only_layers") {
                None => Vec::new(),
                Some(Value::Array(layers)) => layers
                    .iter()
                    .enumerate()
                    .map(|(i, layer)| {
                        layer
                            .as_u64()
                            .and_then(|l| usize::try_from(l).ok())
                            .ok_or_else(|| {
                                top.wrong(&format!("mlp_only_layers[{i}]"), "a layer index", layer)
                            })
                    })
                    .collect::<Result<Vec<usize>>>()?,
                Some(other) => {
                    return Err(top.wrong("mlp_only_layers", "a list of layer indices", other))
                }
            };
            ExpertsConfig {
                experts: top.usize("num_experts")?.unwrap_or(128),
                experts_per_token: top.usize("num_experts_per_tok")?.unwrap_or(8),
                expert_intermediate_size: top.usize("moe_intermediate_size")?.unwrap_or(768),
                norm_topk_prob: top.bool("norm_topk_prob")?.unwrap_or(false),
                decoder_sparse_step: top.usize("decoder_sparse_step")?.unwrap_or(1),
                dense_layers,
            }
        }
        Family::Llama | Family::Mistral | Family::Qwen2 | Family::Qwen3 => return Ok(None),
    };
    Ok(Some(config))
}

/// `rope_theta` and Llama 3's scaling, from `rope_theta` and `rope_scaling`, or from
/// transformers 5's `rope_parameters` (which holds both, and may be all the file has: taking
/// the default theta then would run the model at the wrong frequencies without a word).
fn rope(top: &Fields<'_>, family: Family) -> Result<(f64, Option<Llama3RopeScaling>)> {
    let path = top.path;
    let parameters = top
        .object("rope_parameters")?
        .map(|map| Fields::new(map, "rope_parameters.", path));

    let theta = match (
        top.f64("rope_theta")?,
        match &parameters {
            Some(parameters) => parameters.f64("rope_theta")?,
            None => None,
        },
    ) {
        (Some(top_theta), Some(nested)) if top_theta != nested => {
            return Err(malformed(
                path,
                format!(
                    "rope_theta ({top_theta}) and rope_parameters.rope_theta ({nested}) disagree"
                ),
            ))
        }
        (Some(theta), _) | (None, Some(theta)) => theta,
        (None, None) => 10_000.0,
    };

    // A partial rotary embedding (some dimensions left unturned) is not what these models do.
    for fields in std::iter::once(top).chain(parameters.as_ref()) {
        if let Some(factor) = fields.f64("partial_rotary_factor")? {
            if factor != 1.0 {
                return Err(unsupported(
                    path,
                    format!(
                        "{} {factor} is not supported (only 1: rotary embeddings on the whole head)",
                        fields.name("partial_rotary_factor")
                    ),
                ));
            }
        }
    }

    // `rope_scaling` must say its type (`rope_type`, or the older `type`); transformers 5's
    // `rope_parameters` without one is the default rope.
    let (scaling, rope_type) = match top.object("rope_scaling")? {
        Some(map) => {
            let scaling = Fields::new(map, "rope_scaling.", path);
            let rope_type = match scaling.str("rope_type")? {
                Some(rope_type) => rope_type,
                None => scaling.str("type")?.ok_or_else(|| {
                    malformed(
                        path,
                        "rope_scaling: missing rope_type (or type): cannot tell which scaling"
                            .to_owned(),
                    )
                })?,
            };
            (scaling, rope_type)
        }
        None => match parameters {
            Some(parameters) => {
                let rope_type = match parameters.str("rope_type")? {
                    Some(rope_type) => rope_type,
                    None => parameters.str("type")?.unwrap_or("default"),
                };
                (parameters, rope_type)
            }
            None => return Ok((theta, None)),
        },
    };
    let which = scaling.prefix.trim_end_matches('.');
    match rope_type {
        "default" => Ok((theta, None)),
        "llama3" => {
            if family != Family::Llama {
                return Err(unsupported(
                    path,
                    format!(
                        "{which}: Llama 3's rope scaling (llama3) on a {} model is not supported \
                         (only on llama)",
                        family.model_type()
                    ),
                ));
            }
            let mut missing = Vec::new();
            let mut factors = [0.0f64; 3];
            for (slot, key) in
                factors
                    .iter_mut()
                    .zip(["factor", "low_freq_factor", "high_freq_factor"])
            {
                match scaling.f64(key)? {
                    Some(factor) => *slot = factor,
                    None => missing.push(scaling.name(key)),
                }
            }
            let original = scaling.usize("original_max_position_embeddings")?;
            if original.is_none() {
                missing.push(scaling.name("original_max_position_embeddings"));
            }
            let (Some(original_max_position_embeddings), true) = (original, missing.is_empty())
            else {
                return Err(malformed(
                    path,
                    format!(
                        "{which}: llama3 scaling missing required fields: {}",
                        missing.join(", ")
                    ),
                ));
            };
            let [factor, low_freq_factor, high_freq_factor] = factors;
            Ok((
                theta,
                Some(Llama3RopeScaling {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                }),
            ))
        }
        other => Err(unsupported(
            path,
            format!("{which}: rope_type {other:?} is not supported (supported: llama3, default)"),
        )),
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
