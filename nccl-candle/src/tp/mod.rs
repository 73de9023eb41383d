//! Tensor parallelism for inference, Megatron-style: layers whose weights are split over
//! the ranks of a group, each rank computing its part, and the collectives that join the
//! parts.
//!
//! * [`ColumnParallelLinear`]: weight `[out, in]` split by rows (output features); each
//!   rank gives its block of the output ([`ColumnParallelLinear::forward`]), or the whole
//!   output through an all-gather ([`ColumnParallelLinear::forward_gathered`]).
//! * [`RowParallelLinear`]: weight split by columns (input features); takes the block of the
//!   input a column-parallel layer left on this rank and all-reduces the partial products,
//!   then adds the (whole) bias once.
//! * [`VocabParallelEmbedding`]: the table split by rows (tokens); each rank looks up the ids
//!   it holds, zeros for the others, and an all-reduce sums the rows.
//!
//! A column-parallel layer followed by a row-parallel one (attention's q/k/v then o, an
//! MLP's gate/up then down) costs one all-reduce. [`StackedLinear`] runs column-parallel
//! projections of one input (q/k/v, gate/up) as one product.
//!
//! # The row-parallel epilogue
//!
//! In a transformer a row-parallel layer's sum is added to the residual stream, which is
//! then normalised for the next sublayer. [`TpGroup::all_reduce_add_rms_norm`] (and
//! [`RowParallelLinear::forward_add_rms_norm`], from the layer's input) does the three as
//! one op of the group's [`Collectives`]: by default the all-reduce, candle's add and
//! `candle_nn::ops::rms_norm`; with [`LsaCollectives`] one fused kernel that nccl-rs ships
//! (`nccl::device::LsaAllReduce::all_reduce_add_rms_norm_to`) for contiguous bf16 CUDA
//! tensors that fit it ([`LsaCollectives::fuses`]), the unfused sequence otherwise.
//!
//! **Inference only**: the collectives are candle ops without a backward pass, so gradients
//! do not flow through these layers.
//!
//! # Groups and agreement
//!
//! Layers share a [`TpGroup`]: the ranks (a [`Comm`](nccl::Comm), or any [`Collectives`],
//! e.g. [`ThreadedCollectives`] for ranks simulated on threads with CPU tensors) or a
//! one-rank world ([`TpGroup::single`]) in which no collective runs. Its skip mode
//! ([`TpGroup::set_skip_collectives`]) leaves the layers' collectives out, which gives WRONG
//! numbers and exists only to time how much of a step the collectives take.
//!
//! Every rank must build the same layers in the same order and call them in the same order
//! with tensors of the same shapes, as with any collective. Loading checks what depends only
//! on the layer's arguments, the file's shapes and the world size (a dimension that does not
//! split: [`Error::NotDivisible`](crate::Error::NotDivisible); a shard of the wrong shape:
//! [`Error::ShardShape`](crate::Error::ShardShape)); these refusals come out the same on
//! every rank as long as every rank passes the same arguments and reads the same file, so
//! they need no exchange. That the arguments and files are the same is the caller's to
//! make sure of, before loading: [`TpGroup::agree`] compares a [`fingerprint`](crate::fingerprint) (of a
//! configuration, of a file's header) over the ranks and fails on every rank when one
//! differs.
//!
//! Weights come through candle's [`ShardedVarBuilder`](candle_nn::var_builder::ShardedVarBuilder),
//! which reads only this rank's block of each tensor from the safetensors files.

mod embedding;
mod epilogue;
mod expert_exchange;
mod group;
mod linear;
mod lsa;
mod shard;
mod stacked;
mod threaded;

pub use embedding::{masked_lookup, VocabParallelEmbedding};
pub(crate) use expert_exchange::ExpertsKey;
pub use group::{Collectives, TpGroup};
pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use lsa::LsaCollectives;
pub use shard::{load_replicated, shard_range};
pub use stacked::StackedLinear;
pub use threaded::ThreadedCollectives;
