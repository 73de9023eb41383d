//! Static decode: a step whose token ids and position live in device memory, and KV caches
//! allocated once, so that one CUDA graph captured per batch size replays every token of a
//! sequence without a kernel launch from the host.
//!
//! * [`KvCache`]: a layer's keys and values, written at a host position (the prompt, eager
//!   decode) or at the position the step reads on the device.
//! * [`StepInputs`]: the step's ids, position and outputs in device memory, and the masks
//!   and rotary rows made from the position.
//! * [`attend`]: one query position over a whole cache, grouped-query, masked.
//! * [`DecodeGraph`] over a [`StaticDecode`] model: capture once, replay per token (or run
//!   the same step eagerly); [`capturable_device`] makes a device a graph can capture on.
//!
//! [`CausalLm`](crate::models::CausalLm) implements [`StaticDecode`].

mod attend;
mod cache;
mod captures;
mod graph;
mod inputs;

pub use attend::attend;
pub use cache::KvCache;
pub use graph::{capturable_device, DecodeGraph, GraphNodes, StaticDecode};
pub use inputs::{PositionIndex, StepInputs};
