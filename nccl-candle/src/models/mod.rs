//! Tensor-parallel models of the Llama family (Llama 2 and 3, Mistral, Qwen2, Qwen3) and its
//! mixtures of experts (Mixtral, Qwen3-MoE: expert parallel) that load Hugging Face
//! checkpoints: `config.json`, `model.safetensors` or the shards of
//! `model.safetensors.index.json`, `tokenizer.json`.
//!
//! [`Checkpoint::open`] reads the configuration and the weights files' headers (no data);
//! [`CausalLm::load`] has every rank check what it can alone, agree with the others on the
//! checkpoint and the arguments, and read only its own shard of each tensor; then
//! [`CausalLm::forward`] gives the next token's logits on every rank.
//!
//! ```no_run
//! # fn main() -> nccl_candle::Result<()> {
//! use candle_core::{DType, Device, Tensor};
//! use nccl_candle::models::{CausalLm, Checkpoint};
//! use nccl_candle::tp::TpGroup;
//!
//! let checkpoint = Checkpoint::open("Qwen3-0.6B")?;
//! let device = Device::new_cuda_with_stream(0)?;
//! // One rank here; a group over a `nccl::Comm` (or `LsaCollectives`) splits the model.
//! let group = TpGroup::single();
//! let mut model = CausalLm::load(&checkpoint, &group, DType::BF16, &device, 512)?;
//! let tokenizer = checkpoint.tokenizer()?;
//! let ids = tokenizer.encode("The capital of France is", true).map_err(|e| {
//!     nccl_candle::Error::Argument { op: "encode", why: e.to_string() }
//! })?;
//! let ids = Tensor::new(ids.get_ids(), &device)?.unsqueeze(0)?;
//! let logits = model.forward(&ids, 0)?;
//! let next = logits.argmax(1)?.to_vec1::<u32>()?[0];
//! println!("{}", tokenizer.decode(&[next], true).unwrap_or_default());
//! # Ok(())
//! # }
//! ```

mod checkpoint;
mod config;
mod decoder;
mod experts;
mod plan;
mod rope;
mod sampling;

pub use checkpoint::{
    Checkpoint, TensorInfo, CONFIG_FILE, INDEX_FILE, TOKENIZER_FILE, WEIGHTS_FILE,
};
pub use config::{ExpertsConfig, Family, Llama3RopeScaling, ModelConfig};
pub use decoder::{argmax, CausalLm};
pub use sampling::{Sampler, Sampling};
