//! Dataset sharding: which samples each rank takes.

use std::ops::Range;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::{Error, Result};

/// Refuses a world of no ranks or a rank outside it.
fn check_rank(op: &'static str, rank: usize, world_size: usize) -> Result<()> {
    if rank >= world_size {
        return Err(Error::Argument {
            op,
            why: format!("rank {rank} is not one of the {world_size} ranks"),
        });
    }
    Ok(())
}

/// This rank's share of a dataset of `len` samples for each epoch, as PyTorch's
/// `DistributedSampler`: the epoch's order (a shuffle drawn from `seed + epoch`, the same
/// on every rank, or `0..len`) is dealt out round-robin, rank `r` taking positions
/// `r, r + world_size, ...`.
///
/// The counts are equal only when every rank passes the same `len`, world size and
/// `drop_last` (nothing compares them across ranks: the caller's to make sure of, e.g. with
/// [`fingerprint`](crate::fingerprint) and a [`TpGroup::agree`](crate::tp::TpGroup::agree)-like
/// exchange of its own).
///
/// **Every rank gets the same number of indices** ([`Self::num_samples`]): without
/// `drop_last` the order is padded by wrapping around to its start (a few samples then
/// appear twice in the epoch), with it the tail that does not split evenly is dropped. Equal
/// counts matter: a rank with one more batch would run one more step, whose gradient
/// all-reduce its peers never join, and wait forever.
///
/// Defaults as PyTorch's: shuffled, seed 0, padded. The shuffle is `rand`'s `StdRng`
/// (ChaCha12) seeded with `seed + epoch`, so one build gives the same order everywhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistributedSampler {
    len: usize,
    rank: usize,
    world_size: usize,
    seed: u64,
    shuffle: bool,
    drop_last: bool,
}

impl DistributedSampler {
    /// The sampler of `rank` among `world_size` ranks for a dataset of `len` samples,
    /// shuffled from seed 0, padded.
    pub fn new(len: usize, rank: usize, world_size: usize) -> Result<Self> {
        check_rank("DistributedSampler::new", rank, world_size)?;
        Ok(Self {
            len,
            rank,
            world_size,
            seed: 0,
            shuffle: true,
            drop_last: false,
        })
    }

    /// The same sampler with another seed (every rank must use the same).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// The same sampler, shuffled each epoch or not.
    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// The same sampler, dropping the tail that does not split evenly (`true`) or padding
    /// by wrapping around (`false`).
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// The number of samples in the dataset.
    pub fn dataset_len(&self) -> usize {
        self.len
    }

    /// This sampler's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The seed of the shuffles.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Whether each epoch is shuffled.
    pub fn shuffles(&self) -> bool {
        self.shuffle
    }

    /// Whether the uneven tail is dropped rather than padded.
    pub fn drops_last(&self) -> bool {
        self.drop_last
    }

    /// The number of indices each rank gets per epoch, the same on every rank.
    pub fn num_samples(&self) -> usize {
        if self.drop_last {
            self.len / self.world_size
        } else {
            self.len.div_ceil(self.world_size)
        }
    }

    /// The number of indices all ranks get together per epoch.
    pub fn total_size(&self) -> usize {
        self.num_samples() * self.world_size
    }

    /// This rank's indices for `epoch`, [`Self::num_samples`] of them.
    pub fn indices(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            order.shuffle(&mut StdRng::seed_from_u64(self.seed.wrapping_add(epoch)));
        }
        let total = self.total_size();
        // Padded: wrap around (more than once if there are fewer samples than ranks);
        // dropped: `total` is at most `len`.
        order
            .iter()
            .copied()
            .cycle()
            .take(total)
            .skip(self.rank)
            .step_by(self.world_size)
            .collect()
    }
}

/// Rank `rank`'s contiguous block of `len` items split over `world_size` ranks as evenly as
/// possible: the first `len % world_size` ranks get one item more. Meant for work whose
/// count may differ between ranks (a sum over an evaluation set, say); for training steps,
/// whose count must be equal, use [`DistributedSampler`].
pub fn partition(len: usize, rank: usize, world_size: usize) -> Result<Range<usize>> {
    check_rank("partition", rank, world_size)?;
    let (base, extra) = (len / world_size, len % world_size);
    let start = rank * base + rank.min(extra);
    let size = base + usize::from(rank < extra);
    Ok(start..start + size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(
        len: usize,
        world: usize,
        epoch: u64,
        edit: impl Fn(DistributedSampler) -> DistributedSampler,
    ) -> Vec<Vec<usize>> {
        (0..world)
            .map(|rank| edit(DistributedSampler::new(len, rank, world).unwrap()).indices(epoch))
            .collect()
    }

    #[test]
    fn ranks_cover_the_dataset_disjointly_when_it_divides() {
        for shuffle in [false, true] {
            let shards = all(12, 4, 3, |s| s.with_shuffle(shuffle).with_seed(7));
            let mut seen: Vec<usize> = shards.concat();
            seen.sort_unstable();
            assert_eq!(seen, (0..12).collect::<Vec<_>>(), "shuffle {shuffle}");
            assert!(shards.iter().all(|s| s.len() == 3));
        }
    }

    #[test]
    fn every_rank_gets_the_same_count() {
        for len in 0..30 {
            for world in 1..9 {
                for drop_last in [false, true] {
                    let shards = all(len, world, 0, |s| s.with_drop_last(drop_last));
                    let want = DistributedSampler::new(len, 0, world)
                        .unwrap()
                        .with_drop_last(drop_last)
                        .num_samples();
                    assert!(shards.iter().all(|s| s.len() == want), "{len} {world}");
                    let mut seen = shards.concat();
                    seen.sort_unstable();
                    let distinct = {
                        let mut d = seen.clone();
                        d.dedup();
                        d
                    };
                    if drop_last {
                        // No sample twice; the dropped tail is less than a round.
                        assert_eq!(distinct.len(), seen.len());
                        assert!(len - seen.len() < world);
                    } else {
                        // Every sample at least once; padding repeats fewer than a round.
                        assert_eq!(distinct, (0..len).collect::<Vec<_>>());
                        assert!(seen.len() - len < world);
                    }
                }
            }
        }
    }

    #[test]
    fn padding_wraps_around_to_the_start() {
        // 10 samples over 4 ranks, in order: 0..10 then 0, 1.
        let shards = all(10, 4, 0, |s| s.with_shuffle(false));
        assert_eq!(
            shards,
            [vec![0, 4, 8], vec![1, 5, 9], vec![2, 6, 0], vec![3, 7, 1]]
        );
        let shards = all(10, 4, 0, |s| s.with_shuffle(false).with_drop_last(true));
        assert_eq!(shards, [vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
        // Fewer samples than ranks: wraps more than once.
        let shards = all(2, 5, 0, |s| s.with_shuffle(false));
        assert_eq!(shards, [[0], [1], [0], [1], [0]]);
    }

    #[test]
    fn shuffles_are_deterministic_and_change_with_the_epoch() {
        let one = all(1000, 3, 5, |s| s.with_seed(42));
        assert_eq!(one, all(1000, 3, 5, |s| s.with_seed(42)));
        assert_ne!(one, all(1000, 3, 6, |s| s.with_seed(42)));
        assert_ne!(one, all(1000, 3, 5, |s| s.with_seed(43)));
        assert_ne!(one, all(1000, 3, 5, |s| s.with_shuffle(false)));
    }

    #[test]
    fn ranks_outside_the_world_are_refused() {
        assert!(matches!(
            DistributedSampler::new(10, 4, 4),
            Err(Error::Argument { .. })
        ));
        assert!(DistributedSampler::new(10, 0, 0).is_err());
        assert!(partition(10, 0, 0).is_err());
    }

    #[test]
    fn partitions_are_contiguous_and_balanced() {
        for len in 0..40 {
            for world in 1..9 {
                let blocks: Vec<_> = (0..world)
                    .map(|r| partition(len, r, world).unwrap())
                    .collect();
                assert_eq!(blocks[0].start, 0);
                assert_eq!(blocks[world - 1].end, len);
                for pair in blocks.windows(2) {
                    assert_eq!(pair[0].end, pair[1].start);
                    assert!(pair[0].len() >= pair[1].len());
                    assert!(pair[0].len() - pair[1].len() <= 1);
                }
            }
        }
    }
}
