//! The tensor-parallel epilogue of a row-parallel layer on [`LsaAllReduce`]: the all-reduce,
//! the residual add and RMSNorm in one shipped kernel, or as the all-reduce then a second
//! shipped kernel (what a program without the fused kernel runs), which rounds alike.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{LsaAlgorithm, LsaAllReduce, LsaElem, MAX_CTAS, THREADS, VECTOR};
use crate::error::{Error, Result};

/// How [`LsaAllReduce::all_reduce_add_rms_norm`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LsaEpilogue {
    /// One kernel: the flags all-reduce, the residual add and the norm (each rank reduces
    /// a row, adds, normalises, with no second pass over memory and no second launch).
    Fused,
    /// The all-reduce with this algorithm (in place on the input), then a second kernel for
    /// the residual add and the norm: what a program without the fused kernel does.
    Separate(LsaAlgorithm),
}

/// The most 16-byte vectors of a row one thread of the norm keeps (the kernels' registers).
const NORM_VECTORS_PER_THREAD: usize = 4;

/// The grid of the norm kernels for `rows` rows of `hidden` elements of `T`: a thread per
/// 16-byte vector of a row, at most [`THREADS`] in a CTA (a multiple of 32; a thread keeps up
/// to [`NORM_VECTORS_PER_THREAD`] vectors); a CTA per row, and fused, more CTAs to push with
/// (one per CTA's worth of the message), at most [`MAX_CTAS`] in all.
fn norm_grid<T>(rows: usize, hidden: usize, fused: bool) -> (u32, u32) {
    let vectors = hidden * std::mem::size_of::<T>() / VECTOR;
    let threads = vectors.next_multiple_of(32).clamp(32, THREADS as usize);
    let pushers = if fused {
        (rows * vectors).div_ceil(threads)
    } else {
        0
    };
    let ctas = rows.max(pushers).clamp(1, MAX_CTAS as usize);
    (ctas as u32, threads as u32)
}

impl<T: LsaElem> LsaAllReduce<'_, T> {
    /// The tensor-parallel epilogue of a row-parallel layer, on `rows × hidden` elements
    /// (`hidden` = `weight.len()`): `x` holds this rank's partial sums; afterwards `residual`
    /// holds `T(T(Σ x) + residual)` and `out` that row-normalised,
    /// `T(h · rsqrt(mean(h²) + eps) · weight)` (RMSNorm, accumulated in `f32`), the same on
    /// every rank. With [`LsaEpilogue::Fused`] in one kernel; with
    /// [`LsaEpilogue::Separate`] as an all-reduce in place on `x`, then a second kernel. Both
    /// round where the separate sequence rounds, so they agree bit for bit where the
    /// all-reduce sums alike (two ranks, or the shipped kernels: every rank in rank order).
    ///
    /// `hidden` must be a multiple of 16 bytes' worth of elements and at most 2 048 of
    /// those vectors (16 384 16-bit elements); `x`, `residual` and `out` hold the same whole
    /// number of rows; fused, at most [`max_count`](Self::max_count) elements. Any
    /// alignment works (16-byte aligned buffers take the vector path). Every rank makes the
    /// same call.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_add_rms_norm(
        &mut self,
        x: &mut impl DevicePtrMut<T>,
        residual: &mut impl DevicePtrMut<T>,
        weight: &impl DevicePtr<T>,
        eps: f32,
        out: &mut impl DevicePtrMut<T>,
        how: LsaEpilogue,
    ) -> Result<()> {
        let (len, hidden) = (x.len(), weight.len());
        epilogue_shape::<T>(len, residual.len(), out.len(), hidden, eps)?;
        if how == LsaEpilogue::Fused && len > self.max_count {
            return Err(Error::invalid(format!(
                "LsaAllReduce::all_reduce_add_rms_norm: {len} elements fused, past max_count {}",
                self.max_count
            )));
        }
        // Every refusal this rank could make alone comes before anything runs.
        self.ready(&[
            (x.stream().context(), "x"),
            (residual.stream().context(), "the residual"),
            (weight.stream().context(), "the weight"),
            (out.stream().context(), "the output"),
        ])?;
        if let LsaEpilogue::Separate(algorithm) = how {
            self.all_reduce_in_place(x, algorithm)?;
        }
        let stream = self.comm.stream();
        let (x, _x) = x.device_ptr_mut(stream);
        let (residual, _residual) = residual.device_ptr_mut(stream);
        let (weight, _weight) = weight.device_ptr(stream);
        let (out, _out) = out.device_ptr_mut(stream);
        self.launch_norm(how, [x, residual, weight, out], len / hidden, hidden, eps)
    }

    fn launch_norm(
        &mut self,
        how: LsaEpilogue,
        [x, residual, weight, out]: [u64; 4],
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        let _usable = self.usable()?;
        if rows == 0 {
            return Ok(());
        }
        let (ctas, threads) = norm_grid::<T>(rows, hidden, how == LsaEpilogue::Fused);
        let cfg = LaunchConfig {
            grid_dim: (ctas, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = self.comm.stream();
        if let LsaEpilogue::Separate(_) = how {
            // SAFETY: nccl_rs_add_rms_norm_T(const T* sums, T* residual, const T* weight, T* out,
            // size_t rows, size_t hidden, float eps): `x`, `residual` and `out` hold
            // rows × hidden elements and `weight` hidden (checked by `epilogue_shape`), on this
            // context (checked by `ready`), ordered on this stream by the caller's guards; a
            // CTA handles whole rows of at most NORM_VECTORS_PER_THREAD vectors per thread.
            unsafe {
                stream
                    .launch_builder(&self.add_norm)
                    .arg(&x)
                    .arg(&residual)
                    .arg(&weight)
                    .arg(&out)
                    .arg(&rows)
                    .arg(&hidden)
                    .arg(&eps)
                    .launch(cfg)?;
            }
            return Ok(());
        }
        let scratch = self.scratch.as_raw() as u64;
        let timeout_ns = u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX);
        let (state, _state) = self.state.device_ptr_mut(stream);
        // SAFETY: nccl_rs_fused_add_rms_norm_T(const ncclDevComm*, ncclWindow_t, size_t slot,
        // const T* in, T* residual, const T* weight, T* out, size_t rows, size_t hidden,
        // float eps, State*, unsigned long long timeout_ns), in that order. The buffers are
        // as for the separate kernel above; the scratch is used as by the flags all-reduce of
        // rows × hidden <= max_count elements (checked); the grid is at most MAX_CTAS CTAs.
        unsafe {
            stream
                .launch_builder(&self.fused_norm)
                .arg(&self.dev_comm)
                .arg(&scratch)
                .arg(&self.slot_bytes)
                .arg(&x)
                .arg(&residual)
                .arg(&weight)
                .arg(&out)
                .arg(&rows)
                .arg(&hidden)
                .arg(&eps)
                .arg(&state)
                .arg(&timeout_ns)
                .launch(cfg)?;
        }
        Ok(())
    }
}

/// The epilogue's shape rules (the same on every rank for the same call).
fn epilogue_shape<T>(
    len: usize,
    residual: usize,
    out: usize,
    hidden: usize,
    eps: f32,
) -> Result<()> {
    let per_vector = VECTOR / std::mem::size_of::<T>();
    let most = NORM_VECTORS_PER_THREAD * THREADS as usize * per_vector;
    let why = if hidden == 0 || !hidden.is_multiple_of(per_vector) {
        format!(
            "the hidden size (weight's length) {hidden} is not a positive multiple of \
             {per_vector} elements (16 bytes)"
        )
    } else if hidden > most {
        format!("the hidden size {hidden} is past the kernels' {most} elements")
    } else if residual != len || out != len || !len.is_multiple_of(hidden) {
        format!(
            "x, residual and out hold {len}, {residual} and {out} elements, not the same whole \
             number of rows of {hidden}"
        )
    } else if !(eps.is_finite() && eps >= 0.0) {
        format!("eps {eps} is not a finite non-negative number")
    } else {
        return Ok(());
    };
    Err(Error::invalid(format!(
        "LsaAllReduce::all_reduce_add_rms_norm: {why}"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_grids_keep_a_row_in_a_cta() {
        use half::bf16;
        // hidden 4096 bf16: 512 vectors, a thread each; hidden 8192: two each.
        assert_eq!(norm_grid::<bf16>(1, 4096, false), (1, 512));
        assert_eq!(norm_grid::<bf16>(1, 4096, true), (1, 512));
        assert_eq!(norm_grid::<bf16>(1, 8192, true), (2, 512));
        assert_eq!(norm_grid::<bf16>(4, 8192, true), (8, 512));
        assert_eq!(norm_grid::<bf16>(100, 8192, true), (MAX_CTAS, 512));
        // The largest row: 2048 vectors, 512 threads of four.
        assert_eq!(norm_grid::<bf16>(1, 16384, false), (1, 512));
        assert_eq!(norm_grid::<f32>(3, 4, true), (3, 32));
        for hidden in (8..=16384).step_by(8) {
            let (_, threads) = norm_grid::<bf16>(1, hidden, true);
            assert!((hidden / 8).div_ceil(threads as usize) <= NORM_VECTORS_PER_THREAD);
        }
    }
}
