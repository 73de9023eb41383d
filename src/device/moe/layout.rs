//! The expert exchange's device ABI: the kernels' state, the scratch geometry and the work
//! buffers' pointers as `#[repr(C)]` types (mirroring `moe.cu`, checked against the table the
//! compiled kernels export), and the sizes the host allocates.

use cudarc::driver::DeviceRepr;

/// CTAs a call runs at most (each keeps its own call counts in [`MoeState`]).
pub(super) const MAX_CTAS: u32 = 64;
/// Routing entries (tokens × top-k) a rank sends per call at most: the kernels keep them in
/// shared memory.
pub const MAX_ENTRIES: usize = 4096;
/// Experts at most (their counts sit in shared memory).
pub const MAX_EXPERTS: usize = 1024;
/// Ranks at most.
pub const MAX_RANKS: usize = 128;

/// The host-mapped words the kernels write: gave up (word 0), the first bad routing entry + 1,
/// its value, (unused), then the fallback's rows sent to each rank and received from each.
pub(super) const BAD_ENTRY_WORD: usize = 1;
pub(super) const BAD_VALUE_WORD: usize = 2;
pub(super) const ROWS_TO_WORD: usize = 4;
pub(super) const ROWS_FROM_WORD: usize = ROWS_TO_WORD + MAX_RANKS;
const _: () = assert!(ROWS_FROM_WORD + MAX_RANKS <= crate::device::all_reduce::HOST_WORDS);

/// The kernels' state in device memory (`MoeState` in `moe.cu`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct MoeState {
    pub(super) dispatch_calls: [u64; MAX_CTAS as usize],
    pub(super) combine_calls: [u64; MAX_CTAS as usize],
    /// Set by a kernel that gave up, or by the host's stop.
    pub(super) timed_out: u32,
    pub(super) pad: u32,
    /// Device address of the host-mapped words: gave up, the first bad routing entry + 1,
    /// its value, then the fallback's row counts ([`ROWS_TO_WORD`], [`ROWS_FROM_WORD`]).
    pub(super) host: u64,
}

/// Where each part of the scratch window lies, in bytes, and the shape (`Geometry`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Geometry {
    pub(super) ranks: u32,
    pub(super) experts: u32,
    pub(super) local_experts: u32,
    pub(super) top_k: u32,
    pub(super) max_tokens: u32,
    /// 16-byte vectors a token row holds.
    pub(super) row_vecs: u32,
    pub(super) rows_at: u64,
    pub(super) meta_at: u64,
    pub(super) counts_at: u64,
    pub(super) back_at: u64,
    pub(super) flags_at: u64,
}

// SAFETY: plain old data with the layout of `moe.cu`'s `Geometry` (checked by the test below
// against the compiled kernels' table), passed by value.
unsafe impl DeviceRepr for Geometry {}

/// Device addresses of this rank's work buffers (`Work`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Work {
    pub(super) done: u64,
    pub(super) routing: u64,
    pub(super) totals: u64,
    pub(super) sources: u64,
    pub(super) pairs: u64,
    pub(super) slots: u64,
    pub(super) parts: u64,
}

// SAFETY: seven device addresses, the layout of `moe.cu`'s `Work` (checked below).
unsafe impl DeviceRepr for Work {}

impl Geometry {
    /// The geometry for `ranks` ranks and the shape, with the scratch's total bytes; `None`
    /// where a size overflows.
    pub(super) fn new(
        ranks: usize,
        experts: usize,
        top_k: usize,
        max_tokens: usize,
        row_bytes: usize,
    ) -> Option<(Self, usize)> {
        let local = experts / ranks;
        let slots = local.checked_mul(ranks)?.checked_mul(max_tokens)?;
        let entries = max_tokens.checked_mul(top_k)?;
        let align = |n: usize| n.checked_next_multiple_of(16);
        let rows_at = 0usize;
        let meta_at = align(rows_at + 2usize.checked_mul(slots)?.checked_mul(row_bytes)?)?;
        let counts_at = align(meta_at + 2 * slots.checked_mul(4)?)?;
        let back_at = align(counts_at + 2 * local * ranks * 8)?;
        let flags_at = align(back_at.checked_add(entries.checked_mul(row_bytes)?)?)?;
        let total = align(flags_at.checked_add(entries.checked_mul(4)?)?)?;
        let geometry = Self {
            ranks: u32::try_from(ranks).ok()?,
            experts: u32::try_from(experts).ok()?,
            local_experts: u32::try_from(local).ok()?,
            top_k: u32::try_from(top_k).ok()?,
            max_tokens: u32::try_from(max_tokens).ok()?,
            row_vecs: u32::try_from(row_bytes / 16).ok()?,
            rows_at: rows_at as u64,
            meta_at: meta_at as u64,
            counts_at: counts_at as u64,
            back_at: back_at as u64,
            flags_at: flags_at as u64,
        };
        Some((geometry, total))
    }
}

/// The words of `u32` of each work buffer, in `Work`'s order: done per expert, routing per
/// entry, totals per local expert, sources per packed row, pairs per (rank, local expert),
/// slots per entry, parts summed per token.
pub(super) fn work_words(g: &Geometry) -> [usize; 7] {
    let (r, e, l) = (
        g.ranks as usize,
        g.experts as usize,
        g.local_experts as usize,
    );
    let entries = g.max_tokens as usize * g.top_k as usize;
    [
        e,
        entries,
        l,
        l * r * g.max_tokens as usize,
        r * l,
        entries,
        g.max_tokens as usize,
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// The table `nccl_rs_moe_layout` of the checked-in PTX: the layout the kernels were
    /// compiled with.
    fn compiled_layout() -> Vec<u64> {
        let ptx = include_str!("../shipped/moe.compute_80.ptx");
        let line = ptx
            .lines()
            .find(|l| l.contains("nccl_rs_moe_layout["))
            .expect("the layout table in moe.compute_80.ptx");
        let declared: usize = line[line.find('[').unwrap() + 1..line.find(']').unwrap()]
            .parse()
            .unwrap();
        let mut bytes: Vec<u8> = line[line.find('{').unwrap() + 1..line.find('}').unwrap()]
            .split(',')
            .map(|b| b.trim().parse().unwrap())
            .collect();
        // PTX leaves out the initializer's trailing zeros.
        bytes.resize(declared, 0);
        bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn the_host_types_are_the_compiled_kernels() {
        let expected = [
            size_of::<MoeState>(),
            offset_of!(MoeState, dispatch_calls),
            offset_of!(MoeState, combine_calls),
            offset_of!(MoeState, timed_out),
            offset_of!(MoeState, host),
            size_of::<Geometry>(),
            offset_of!(Geometry, rows_at),
            offset_of!(Geometry, flags_at),
            size_of::<Work>(),
            MAX_CTAS as usize,
            MAX_ENTRIES,
            MAX_EXPERTS,
            MAX_RANKS,
            ROWS_TO_WORD,
            ROWS_FROM_WORD,
        ]
        .map(|v| v as u64);
        assert_eq!(compiled_layout(), expected);
    }

    #[test]
    fn the_scratch_regions_follow_each_other_aligned() {
        // 2 ranks, 8 experts (4 each), top-2, 3 tokens, rows of 32 bytes.
        let (g, total) = Geometry::new(2, 8, 2, 3, 32).unwrap();
        assert_eq!(g.local_experts, 4);
        assert_eq!(g.rows_at, 0);
        assert_eq!(g.meta_at, 2 * 4 * 2 * 3 * 32);
        assert_eq!(g.counts_at, g.meta_at + 2 * 24 * 4);
        assert_eq!(g.back_at, g.counts_at + 2 * 8 * 8);
        assert_eq!(g.flags_at, g.back_at + 6 * 32);
        assert_eq!(total as u64, g.flags_at + 32);
        assert_eq!(work_words(&g), [8, 6, 4, 24, 8, 6, 3]);
        assert!(Geometry::new(2, 8, 2, usize::MAX / 4, 32).is_none());
    }
}
