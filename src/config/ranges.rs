//! The values NCCL takes for the `int` fields that both configurations carry
//! ([`CommConfig`](crate::CommConfig) and [`CollConfig`](crate::CollConfig)): one definition of
//! each range, so that the two tables cannot drift apart.

use std::os::raw::c_int;

/// The largest value an `int` field of `ncclConfig_t` or `ncclCollConfig_t` holds.
pub(crate) const INT_MAX: i64 = c_int::MAX as i64;

/// An inclusive range of values NCCL takes for one `int` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Range {
    /// The smallest value taken.
    pub(crate) min: i64,
    /// The largest value taken.
    pub(crate) max: i64,
}

impl Range {
    /// Whether NCCL takes `value`.
    pub(crate) fn contains(self, value: i64) -> bool {
        (self.min..=self.max).contains(&value)
    }
}

/// Any value a C `int` holds that is not negative: a field without a narrower rule.
pub(crate) const NON_NEGATIVE: Range = Range {
    min: 0,
    max: INT_MAX,
};
/// A count that must be at least one: CTAs (`minCTAs`, `maxCTAs`, `nvlsCTAs`) and peers.
pub(crate) const AT_LEAST_ONE: Range = Range {
    min: 1,
    max: INT_MAX,
};
/// `cgaClusterSize`: CUDA's thread-block cluster size, 0 to 8.
pub(crate) const CGA_CLUSTER_SIZE: Range = Range { min: 0, max: 8 };
/// `nChannelsPerNetPeer`: 1 to 64 (NCCL rounds up to a power of two).
pub(crate) const CHANNELS_PER_NET_PEER: Range = Range { min: 1, max: 64 };
