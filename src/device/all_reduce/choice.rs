//! What an [`LsaAllReduce`](super::LsaAllReduce) call runs: the algorithm
//! [`LsaAlgorithm::Auto`] picks by size and rank count (from measurements), and the grid each
//! kernel is launched on (a function of the count alone, so every rank runs the same).

use super::{LsaAlgorithm, FLAGS_MAX_CTAS, FLAGS_MIN_THREADS, THREADS, VECTOR};

/// What [`LsaAlgorithm::Auto`] runs, by message size in bytes: each entry covers the sizes up
/// to its bound (inclusive) past the previous one's; past the last, NCCL. Measured on 4×H100
/// (NV18, NCCL 2.32.3, NVLS off, CUDA graphs, one process per GPU, against NCCL on symmetric
/// windows; f32 and bf16), the fastest of NCCL and the three kernels at each size.
/// Fewer than four ranks (measured at two, `git show b6dda68:tests/gpu/round33.sh`): the
/// one-shot flags kernel ahead from 8 B (1.1×) to 4 MiB (1.25×), level with NCCL and the
/// two-shot at 8 MiB.
const AUTO_FEW_RANKS: &[(usize, LsaAlgorithm)] = &[(4 << 20, LsaAlgorithm::OneShotFlags)];
/// Four ranks or more (measured at four, the same run): one-shot ahead from 8 B (1.04-1.06×)
/// to 64 KiB (2.05×); two-shot ahead of both from 128 KiB (1.8×) to 2 MiB (1.06×); NCCL
/// ahead from 4 MiB (two-shot 0.88×).
const AUTO_MANY_RANKS: &[(usize, LsaAlgorithm)] = &[
    (64 << 10, LsaAlgorithm::OneShotFlags),
    (2 << 20, LsaAlgorithm::TwoShotFlags),
];
/// [`LsaAllReduce::choose`] for a message of `bytes` on `ranks` ranks, `fits`: whether it fits
/// the scratch.
pub(super) fn auto_choice(bytes: usize, ranks: usize, fits: bool) -> LsaAlgorithm {
    let table = if ranks >= 4 {
        AUTO_MANY_RANKS
    } else {
        AUTO_FEW_RANKS
    };
    let chosen = table
        .iter()
        .find(|(bound, _)| bytes <= *bound)
        .map_or(LsaAlgorithm::Nccl, |&(_, algorithm)| algorithm);
    if fits {
        chosen
    } else {
        LsaAlgorithm::Nccl
    }
}

/// The grid for `count` elements of `T`: one thread per 16 bytes, in CTAs of [`THREADS`]
/// (fewer, a multiple of 32, for a message that fits one CTA: a smaller CTA starts and
/// ends sooner), at most `max_ctas` of them. A function of the count alone, so every rank
/// runs the same grid.
pub(super) fn grid<T>(count: usize, max_ctas: u32) -> (u32, u32) {
    grid_of::<T>(count, max_ctas, THREADS)
}

/// The flags kernels' grid for `count` elements of `T`: CTAs of [`FLAGS_MIN_THREADS`] up to
/// [`FLAGS_MAX_CTAS`] of them, larger CTAs (up to [`THREADS`]) past that.
pub(super) fn flags_grid<T>(count: usize) -> (u32, u32) {
    let vectors = (count * std::mem::size_of::<T>()).div_ceil(VECTOR);
    let cta = vectors
        .div_ceil(FLAGS_MAX_CTAS as usize)
        .next_multiple_of(32)
        .clamp(FLAGS_MIN_THREADS as usize, THREADS as usize) as u32;
    grid_of::<T>(count, FLAGS_MAX_CTAS, cta)
}

/// A grid of CTAs of `cta` threads (fewer, a multiple of 32, for a message that fits one
/// CTA), at most `max_ctas`, a thread per 16 bytes of `count` elements of `T`.
fn grid_of<T>(count: usize, max_ctas: u32, cta: u32) -> (u32, u32) {
    let vectors = (count * std::mem::size_of::<T>()).div_ceil(VECTOR);
    let ctas = vectors.div_ceil(cta as usize).clamp(1, max_ctas as usize) as u32;
    let threads = if ctas == 1 {
        vectors.next_multiple_of(32).clamp(32, cta as usize) as u32
    } else {
        cta
    };
    (ctas, threads)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::all_reduce::MAX_CTAS;

    #[test]
    fn auto_takes_what_was_measured_fastest() {
        use LsaAlgorithm::{Nccl, OneShotFlags, TwoShotFlags};
        for ranks in [2, 3] {
            assert_eq!(auto_choice(8, ranks, true), OneShotFlags);
            assert_eq!(auto_choice(32 << 10, ranks, true), OneShotFlags);
            assert_eq!(auto_choice(4 << 20, ranks, true), OneShotFlags);
            assert_eq!(auto_choice((4 << 20) + 16, ranks, true), Nccl);
            assert_eq!(auto_choice(8, ranks, false), Nccl);
        }
        for ranks in [4, 8] {
            assert_eq!(auto_choice(8, ranks, true), OneShotFlags);
            assert_eq!(auto_choice(32 << 10, ranks, true), OneShotFlags);
            assert_eq!(auto_choice(64 << 10, ranks, true), OneShotFlags);
            assert_eq!(auto_choice((64 << 10) + 16, ranks, true), TwoShotFlags);
            assert_eq!(auto_choice(1 << 20, ranks, true), TwoShotFlags);
            assert_eq!(auto_choice(2 << 20, ranks, true), TwoShotFlags);
            assert_eq!(auto_choice((2 << 20) + 16, ranks, true), Nccl);
            assert_eq!(auto_choice(256 << 10, ranks, false), Nccl);
        }
        assert_eq!(auto_choice(usize::MAX, 2, true), Nccl);
    }

    #[test]
    fn grids_cover_the_message_up_to_the_barrier_count() {
        assert_eq!(grid::<f32>(1, MAX_CTAS), (1, 32));
        assert_eq!(grid::<f32>(4 * 32, MAX_CTAS), (1, 32));
        assert_eq!(grid::<f32>(4 * 33, MAX_CTAS), (1, 64));
        assert_eq!(grid::<f32>(4 * 512, MAX_CTAS), (1, 512));
        assert_eq!(grid::<f32>(4 * 512 + 1, MAX_CTAS), (2, 512));
        assert_eq!(grid::<half::bf16>(8 * 512 * 3, MAX_CTAS), (3, 512));
        assert_eq!(grid::<f32>(1 << 30, MAX_CTAS), (MAX_CTAS, 512));
        assert_eq!(grid::<f32>(1 << 30, FLAGS_MAX_CTAS), (FLAGS_MAX_CTAS, 512));
        assert_eq!(grid::<f32>(4 * 512 * 20, FLAGS_MAX_CTAS), (20, 512));
    }

    #[test]
    fn flags_grids_take_more_smaller_ctas_first() {
        assert_eq!(flags_grid::<f32>(2), (1, 32));
        assert_eq!(flags_grid::<f32>(4 * 128), (1, 128));
        // 8 KiB: four CTAs of 128; 32 KiB: sixteen.
        assert_eq!(flags_grid::<f32>(2048), (4, 128));
        assert_eq!(flags_grid::<half::bf16>(16384), (16, 128));
        // 64 CTAs of 128 hold 128 KiB; past that the CTAs grow.
        assert_eq!(flags_grid::<f32>(32768), (64, 128));
        assert_eq!(flags_grid::<f32>(65536), (64, 256));
        assert_eq!(flags_grid::<f32>(1 << 20), (64, 512));
        assert_eq!(flags_grid::<f32>(1 << 30), (64, 512));
    }
}
