//! The generated dataset and each rank's batches.
//!
//! Sequence `i` of the dataset is computed from `(seed, i)` when needed, never stored or
//! downloaded: tokens follow `x[t+1] = (a * x[t] + b) mod vocab` with `a` in {1, 3, 5, 7}, `b`
//! in {1, 2, 3, 4} and `x[0]` drawn per sequence. A model first learns the 16 possible
//! successors of each token (loss ln 16 = 2.77, from ln vocab), then to read `a` and `b` off
//! the sequence so far (loss towards 0).

use candle_core::{Device, Tensor};
use nccl_candle::ddp::DistributedSampler;

use crate::model::Config;

/// The number of sequences: a prime, so that the sampler pads for every world size above 1.
pub const DATASET_LEN: usize = 10_007;

/// splitmix64: a well-mixed 64-bit word from a counter.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The `len` tokens of sequence `index`.
pub fn sequence(seed: u64, index: usize, vocab: usize, len: usize) -> Vec<u32> {
    let word = mix(seed ^ mix(index as u64));
    let a = [1, 3, 5, 7][(word & 3) as usize];
    let b = 1 + ((word >> 2) & 3) as usize;
    let mut x = ((word >> 8) % vocab as u64) as usize;
    let mut tokens = Vec::with_capacity(len);
    for _ in 0..len {
        tokens.push(x as u32);
        x = (a * x + b) % vocab;
    }
    tokens
}

/// The inputs and the targets (the inputs shifted by one) of the sequences `indices`: two
/// `(indices.len(), seq)` u32 tensors.
pub fn batch(
    indices: &[usize],
    seed: u64,
    config: &Config,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let width = config.seq + 1;
    let tokens: Vec<u32> = indices
        .iter()
        .flat_map(|&i| sequence(seed, i, config.vocab, width))
        .collect();
    let all = Tensor::from_vec(tokens, (indices.len(), width), device)?;
    Ok((
        all.narrow(1, 0, config.seq)?.contiguous()?,
        all.narrow(1, 1, config.seq)?.contiguous()?,
    ))
}

/// One rank's batches: step `s` takes the `s`-th run of `local_batch` indices of the epoch
/// the step falls in. Across the ranks, step `s` covers positions `s * global ..
/// (s + 1) * global` of the epoch's shuffled order (the sampler deals round-robin): the
/// global batch of a step does not depend on the number of ranks (short of an epoch's
/// padded tail), and rank 0 can rebuild it from every rank's sampler.
pub struct Shard {
    sampler: DistributedSampler,
    local_batch: usize,
    steps_per_epoch: usize,
    epoch: Option<(u64, Vec<usize>)>,
}

impl Shard {
    pub fn new(
        rank: usize,
        world: usize,
        seed: u64,
        local_batch: usize,
    ) -> nccl_candle::Result<Self> {
        let sampler = DistributedSampler::new(DATASET_LEN, rank, world)?.with_seed(seed);
        // Equal on every rank (the sampler's counts are), so every rank runs the same steps;
        // the indices past the last full batch of an epoch are left out.
        let steps_per_epoch = sampler.num_samples() / local_batch;
        Ok(Self {
            sampler,
            local_batch,
            steps_per_epoch,
            epoch: None,
        })
    }

    pub fn steps_per_epoch(&self) -> usize {
        self.steps_per_epoch
    }

    /// The dataset indices of this rank's part of step `step`.
    pub fn indices(&mut self, step: usize) -> &[usize] {
        let epoch = (step / self.steps_per_epoch) as u64;
        let start = (step % self.steps_per_epoch) * self.local_batch;
        if self.epoch.as_ref().is_none_or(|(e, _)| *e != epoch) {
            self.epoch = Some((epoch, self.sampler.indices(epoch)));
        }
        let indices = self.epoch.as_ref().map_or(&[][..], |(_, indices)| indices);
        &indices[start..start + self.local_batch]
    }
}
