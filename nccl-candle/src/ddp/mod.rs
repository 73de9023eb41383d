//! Data-parallel training on candle: every rank holds a whole replica of the model, trains
//! on its own share of each global batch, and the ranks average their gradients so that
//! every replica makes the same step.
//!
//! * [`broadcast_vars`] starts every replica from the root's parameters;
//! * [`GradientAverager`] averages gradients over the ranks in a few large all-reduces
//!   (buckets of at most 25 MiB by default, as PyTorch DDP), and [`DistributedOptimizer`]
//!   wraps a candle optimizer with it;
//! * [`DistributedSampler`] deals each epoch's samples out to the ranks, the same number to
//!   each.
//!
//! Whatever could differ between ranks and decides the size of a collective (the variables'
//! names, shapes and element types, the bucket size, the root) is agreed on first, by an
//! exchange of fingerprints, so that differing models are an error on every rank
//! ([`Error::Mismatch`](crate::Error::Mismatch)) rather than a hang. Variables are visited
//! in name order everywhere ([`sorted_vars`]).
//!
//! What stays the caller's: every rank must reach each of these calls (the agreement waits
//! for all ranks without a timeout, as a collective does: a rank that failed before it
//! leaves the others waiting; use nccl-rs's watchdog or `AbortHandle` to bound it), and a
//! CUDA failure on one rank while it prepares the agreement's buffers (out of memory) fails
//! that rank alone. The per-step gradient checks of [`GradientAverager::average`] are
//! rank-local too (candle's `backward` never makes gradients that fail them).
//!
//! ```rust,ignore
//! let varmap = candle_nn::VarMap::new();
//! let model = build(candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &device))?;
//! nccl_candle::ddp::broadcast_vars(&comm, &varmap, 0)?;
//! let adamw = candle_nn::AdamW::new(varmap.all_vars(), params)?;
//! let mut opt = nccl_candle::ddp::DistributedOptimizer::new(&comm, adamw, &varmap)?;
//! let sampler = DistributedSampler::new(dataset_len, comm.rank(), comm.size())?.with_seed(1);
//! for epoch in 0..epochs {
//!     for batch in sampler.indices(epoch).chunks_exact(local_batch) {
//!         let loss = model.loss(batch)?;
//!         opt.backward_step(&loss)?;
//!     }
//! }
//! ```

mod averager;
mod bucket;
mod optimizer;
mod sampler;
mod vars;

pub use averager::{AverageTiming, GradientAverager, DEFAULT_BUCKET_BYTES};
pub use bucket::{plan_buckets, Bucket, Slot};
pub use optimizer::DistributedOptimizer;
pub use sampler::{partition, DistributedSampler};
pub use vars::{broadcast_var_list, broadcast_vars, sorted_vars};
