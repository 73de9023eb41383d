//! candle-transformers 0.11.1's own model of each family, loaded from a checkpoint the
//! `hf_checkpoint` writer made: the reference the tests compare with (a test-only dependency).

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use super::writer::{Family, Spec};

/// candle-transformers' model for the family, loaded from the checkpoint the way its examples
/// load a downloaded one (the Llama there has no attention biases: it ignores them), on the
/// device it computes on.
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
}

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
        use candle_transformers::models::{llama, mistral, qwen2, qwen3};
        let config = std::fs::read(dir.join("config.json")).unwrap();
        let files: Vec<PathBuf> = spec.weight_files().iter().map(|f| dir.join(f)).collect();
        // SAFETY: the files are this test's own, in its private directory, unchanged while mapped.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, dev) }.unwrap();
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
        }
        .unwrap();
        let logits = logits.flatten_all().unwrap().to_dtype(DType::F32).unwrap();
        logits.to_vec1().unwrap()
    }
}
