//! candle-transformers 0.11.1's own model of each family, loaded from a checkpoint the
//! `hf_checkpoint` writer made: the reference the tests compare with (a test-only dependency).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

use super::writer::{Family, Spec};

/// candle-transformers' model for the family, loaded from the checkpoint the way its examples
/// load a downloaded one (the Llama there has no attention biases: it ignores them), on the
/// device it computes on.
///
/// The mixture-of-experts families: Mixtral's config needs `use_flash_attn` (no serde
/// default; not a Hugging Face field, so the loader adds `false` to the parsed JSON, never to
/// the file) and an integer `sliding_window` (a `null` one becomes `max_position_embeddings`,
/// no window within the model's positions); its head is always `lm_head.weight` (a tied
/// checkpoint's is read as the embeddings). Qwen3-MoE's experts run candle's naive block (its
/// fused one is for candle-transformers' own `cuda` feature, which this dependency leaves
/// off), on any device.
pub struct Reference {
    model: Model,
    device: Device,
}

enum Model {
    Llama(
        candle_transformers::models::llama::Llama,
        candle_transformers::models::llama::Cache,
    ),
    Mistral(candle_transformers::models::mistral::Model),
    Qwen2(candle_transformers::models::qwen2::ModelForCausalLM),
    Qwen3(candle_transformers::models::qwen3::ModelForCausalLM),
    Mixtral(candle_transformers::models::mixtral::Model),
    Qwen3Moe(candle_transformers::models::qwen3_moe::ModelForCausalLM),
}

/// The names of the tensors a load read, shared with the backend that records them.
type Read = Arc<Mutex<BTreeSet<String>>>;

// Each test binary that includes this file uses some of these: the CPU tests load on the
// CPU, the GPU tests on a GPU.
#[allow(dead_code)]
impl Reference {
    pub fn load(spec: &Spec, dir: &Path) -> Reference {
        Self::load_as(spec, dir, DType::F32)
    }

    /// [`load`](Self::load) computing in `dtype`.
    pub fn load_as(spec: &Spec, dir: &Path, dtype: DType) -> Reference {
        Self::load_on(spec, dir, dtype, &Device::Cpu)
    }

    /// [`load_as`](Self::load_as) on `dev`.
    pub fn load_on(spec: &Spec, dir: &Path, dtype: DType, dev: &Device) -> Reference {
        Self::load_recording(spec, dir, dtype, dev, None)
    }

    /// The names of the checkpoint's tensors that candle-transformers' model reads (a tied
    /// Mixtral's head as the embeddings), loading it in f32 on the CPU: a tensor it needs and
    /// the files lack panics here, as [`load`](Self::load) does.
    pub fn tensors_read(spec: &Spec, dir: &Path) -> BTreeSet<String> {
        let read = Read::default();
        Self::load_recording(spec, dir, DType::F32, &Device::Cpu, Some(read.clone()));
        let names = read.lock().unwrap().clone();
        names
    }

    fn load_recording(
        spec: &Spec,
        dir: &Path,
        dtype: DType,
        dev: &Device,
        read: Option<Read>,
    ) -> Reference {
        use candle_transformers::models::{llama, mistral, mixtral, qwen2, qwen3, qwen3_moe};
        let config = std::fs::read(dir.join("config.json")).unwrap();
        let files: Vec<PathBuf> = spec.weight_files().iter().map(|f| dir.join(f)).collect();
        // What `VarBuilder::from_mmaped_safetensors` builds, between backends of this file's.
        // SAFETY: the files are this test's own, in its private directory, unchanged while mapped.
        let mut backend: Box<dyn SimpleBackend> =
            Box::new(unsafe { MmapedSafetensors::multi(&files) }.unwrap());
        if let Some(read) = read {
            backend = Box::new(Recording {
                inner: backend,
                read,
            });
        }
        if spec.family == Family::Mixtral && spec.tie_embeddings {
            backend = Box::new(TiedHead { inner: backend });
        }
        let vb = VarBuilder::from_backend(backend, dtype, dev.clone());
        let model = match spec.family {
            Family::Llama => {
                let cfg: llama::LlamaConfig = serde_json::from_slice(&config).unwrap();
                let cfg = cfg.into_config(false);
                let cache = llama::Cache::new(true, dtype, &cfg, dev).unwrap();
                Model::Llama(llama::Llama::load(vb, &cfg).unwrap(), cache)
            }
            Family::Mistral => {
                let cfg: mistral::Config = serde_json::from_slice(&config).unwrap();
                Model::Mistral(mistral::Model::new(&cfg, vb).unwrap())
            }
            Family::Qwen2 => {
                let cfg: qwen2::Config = serde_json::from_slice(&config).unwrap();
                Model::Qwen2(qwen2::ModelForCausalLM::new(&cfg, vb).unwrap())
            }
            Family::Qwen3 => {
                let cfg: qwen3::Config = serde_json::from_slice(&config).unwrap();
                Model::Qwen3(qwen3::ModelForCausalLM::new(&cfg, vb).unwrap())
            }
            Family::Mixtral => {
                let cfg: mixtral::Config = serde_json::from_value(mixtral_config(&config)).unwrap();
                Model::Mixtral(mixtral::Model::new(&cfg, vb).unwrap())
            }
            Family::Qwen3Moe => {
                let cfg: qwen3_moe::Config = serde_json::from_slice(&config).unwrap();
                Model::Qwen3Moe(qwen3_moe::ModelForCausalLM::new(&cfg, vb).unwrap())
            }
        };
        Reference {
            model,
            device: dev.clone(),
        }
    }

    /// The last position's logits, `ids` being the tokens from position `pos` on.
    pub fn forward(&mut self, ids: &[u32], pos: usize) -> Vec<f32> {
        let input = Tensor::new(ids, &self.device)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = match &mut self.model {
            Model::Llama(m, cache) => m.forward(&input, pos, cache),
            Model::Mistral(m) => m.forward(&input, pos),
            Model::Qwen2(m) => m.forward(&input, pos),
            Model::Qwen3(m) => m.forward(&input, pos),
            // Both narrow to the last position before the head: [1, 1, vocab].
            Model::Mixtral(m) => m.forward(&input, pos),
            Model::Qwen3Moe(m) => m.forward(&input, pos),
        }
        .unwrap();
        let logits = logits.flatten_all().unwrap().to_dtype(DType::F32).unwrap();
        logits.to_vec1().unwrap()
    }
}

/// A Mixtral `config.json` as candle-transformers' `mixtral::Config` reads it: with
/// `use_flash_attn` false (a field of candle's, without a serde default; Hugging Face's
/// configs have none) and an integer `sliding_window` (`null`, no window, becomes
/// `max_position_embeddings`: no window within the model's positions).
fn mixtral_config(json: &[u8]) -> serde_json::Value {
    let mut value: serde_json::Value = serde_json::from_slice(json).unwrap();
    let fields = value.as_object_mut().unwrap();
    fields.entry("use_flash_attn").or_insert(false.into());
    if fields["sliding_window"].is_null() {
        let positions = fields["max_position_embeddings"].clone();
        fields.insert("sliding_window".into(), positions);
    }
    value
}

/// A backend that records the names of the tensors read through it.
struct Recording<'a> {
    inner: Box<dyn SimpleBackend + 'a>,
    read: Read,
}

impl SimpleBackend for Recording<'_> {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.read.lock().unwrap().insert(name.to_string());
        self.inner.get(s, name, h, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.read.lock().unwrap().insert(name.to_string());
        self.inner.get_unchecked(name, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(name)
    }
}

/// A backend whose `lm_head.weight` is the embeddings, for a tied checkpoint read by a model
/// that always reads a separate head (candle-transformers' Mixtral).
struct TiedHead<'a> {
    inner: Box<dyn SimpleBackend + 'a>,
}

impl TiedHead<'_> {
    fn name(name: &str) -> &str {
        if name == "lm_head.weight" {
            "model.embed_tokens.weight"
        } else {
            name
        }
    }
}

impl SimpleBackend for TiedHead<'_> {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.inner.get(s, Self::name(name), h, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.inner.get_unchecked(Self::name(name), dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.inner.contains_tensor(Self::name(name))
    }
}
