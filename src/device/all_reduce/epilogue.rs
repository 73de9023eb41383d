//! The tensor-parallel epilogue of a row-parallel layer on [`LsaAllReduce`]: the all-reduce,
//! the residual add and RMSNorm in one shipped kernel, or as the all-reduce then a second
//! shipped kernel (what a program without the fused kernel runs), which rounds alike.

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use super::{
    record_launch, Kernel, LsaAlgorithm, LsaAllReduce, LsaElem, MAX_CTAS, THREADS, VECTOR,
};
use crate::diagnostics::flight::ShippedKernel;
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

/// The most 16-byte vectors of a row one thread of the separate norm kernel keeps (a CTA a
/// row); the fused kernel's threads keep [`FUSED_VECTORS_PER_THREAD`] and longer rows are
/// split over CTAs.
const NORM_VECTORS_PER_THREAD: usize = 4;
/// The most vectors of a row one thread of the fused kernel keeps (its registers also hold
/// the wait for the peers).
const FUSED_VECTORS_PER_THREAD: usize = 2;
/// The most rows a fused call whose rows are split over CTAs normalises (the kernel's
/// exchange room for the CTAs' partial sums: `kMaxSplitRows`).
pub(super) const SPLIT_ROWS: usize = 8;

/// The vectors of a row a CTA of the fused kernel aims at where rows are split: 128 was the
/// fastest of 64, 128, 256 and unsplit rows (4×H100, bf16, hidden 4096 and 8192, at 4 and 2
/// ranks: `git show b6dda68:tests/gpu/round30.sh`).
const SPLIT_TARGET: usize = 128;

/// A launch of a norm kernel: CTAs, threads a CTA, CTAs a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct NormGrid {
    ctas: u32,
    threads: u32,
    splits: usize,
}

/// The separate norm kernel's grid for `rows` rows of `hidden` elements of `T`: a CTA per
/// row (at most [`MAX_CTAS`], looping), a thread per 16-byte vector of a row (a multiple of
/// 32, at most [`THREADS`]; a thread keeps up to [`NORM_VECTORS_PER_THREAD`]).
fn separate_grid<T>(rows: usize, hidden: usize) -> NormGrid {
    let vectors = hidden * std::mem::size_of::<T>() / VECTOR;
    NormGrid {
        ctas: rows.clamp(1, MAX_CTAS as usize) as u32,
        threads: vectors.next_multiple_of(32).clamp(32, THREADS as usize) as u32,
        splits: 1,
    }
}

/// The fused kernel's grid, `target` vectors a CTA in view: each row split over `splits`
/// CTAs (as many as keep a part near `target` vectors while rows × splits fit [`MAX_CTAS`],
/// at least enough that a thread keeps [`FUSED_VECTORS_PER_THREAD`]; one for more than
/// [`SPLIT_ROWS`] rows), a thread per vector of a part (a multiple of 32), and more CTAs to
/// push with (a CTA's worth of the message each), at most [`MAX_CTAS`] in all. `None` when
/// the rows are too many to split and too long not to: the separate sequence runs instead.
fn fused_grid<T>(rows: usize, hidden: usize, target: usize) -> Option<NormGrid> {
    let vectors = hidden * std::mem::size_of::<T>() / VECTOR;
    let needed = vectors.div_ceil(FUSED_VECTORS_PER_THREAD * THREADS as usize);
    let most = if rows <= SPLIT_ROWS {
        MAX_CTAS as usize / rows.max(1)
    } else {
        1
    };
    let mut splits = vectors.div_ceil(target).min(most).max(needed);
    if splits > most {
        return None;
    }
    // Parts are whole 32-vector chunks: fewer splits where rounding left the last ones
    // empty (each pass only shrinks the part, so it ends).
    let part = loop {
        let part = vectors.div_ceil(splits).next_multiple_of(32);
        let used = vectors.div_ceil(part);
        if used == splits {
            break part;
        }
        splits = used;
    };
    let threads = part.clamp(32, THREADS as usize);
    let pushers = (rows * vectors).div_ceil(threads);
    let ctas = (rows * splits).max(pushers).clamp(1, MAX_CTAS as usize);
    Some(NormGrid {
        ctas: ctas as u32,
        threads: threads as u32,
        splits,
    })
}

/// What one epilogue call runs.
#[derive(Debug, Clone, Copy)]
enum Plan {
    /// The fused kernel on this grid.
    Fused(NormGrid),
    /// The all-reduce in place on `x`, then the norm kernel.
    Separate(LsaAlgorithm),
    /// A fused call whose shape cannot fuse: the all-reduce from `x` into `out`, then the
    /// norm kernel in place on `out` (x stays as it was, as fused).
    IntoOut,
}

impl<T: LsaElem> LsaAllReduce<'_, T> {
    /// The tensor-parallel epilogue of a row-parallel layer, on `rows × hidden` elements
    /// (`hidden` = `weight.len()`): `x` holds this rank's partial sums; afterwards `residual`
    /// holds `T(T(Σ x) + residual)` and `out` that row-normalised,
    /// `T(h · rsqrt(mean(h²) + eps) · weight)` (RMSNorm, accumulated in `f32`), the same on
    /// every rank. With [`LsaEpilogue::Fused`] in one kernel (x unchanged); with
    /// [`LsaEpilogue::Separate`] as an all-reduce in place on `x`, then a second kernel. Both
    /// round where the separate sequence rounds and sum the squares in one order whatever
    /// the launch, so they agree bit for bit where the all-reduce sums alike (two ranks, or
    /// the shipped kernels: every rank in rank order).
    ///
    /// `hidden` must be a multiple of 16 bytes' worth of elements and at most 2 048 of
    /// those vectors (16 384 16-bit elements); `x`, `residual` and `out` hold the same whole
    /// number of rows; fused, at most [`max_count`](Self::max_count) elements. Any
    /// alignment works (16-byte aligned buffers take the vector path). Every rank makes the
    /// same call. Fused, more than 8 rows of more than 1 024 vectors (8 192 16-bit
    /// elements) run as the all-reduce into `out` and the norm kernel in place there.
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
        let result = self.all_reduce_add_rms_norm_checked(x, residual, weight, eps, out, how);
        self.refused_here(result)
    }

    // The body of the call above: its refusals go through `refused_here`.
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_add_rms_norm_checked(
        &mut self,
        x: &mut impl DevicePtrMut<T>,
        residual: &mut impl DevicePtrMut<T>,
        weight: &impl DevicePtr<T>,
        eps: f32,
        out: &mut impl DevicePtrMut<T>,
        how: LsaEpilogue,
    ) -> Result<()> {
        let plan = self.epilogue_plan(
            x,
            [residual.len(); 2],
            [residual.stream().context(); 2],
            weight,
            eps,
            out,
            how,
        )?;
        let stream = self.comm.stream();
        let (residual, _residual) = residual.device_ptr_mut(stream);
        self.run_epilogue(plan, x, [residual, residual], weight, eps, out)
    }

    /// [`all_reduce_add_rms_norm`](Self::all_reduce_add_rms_norm) with the new residual
    /// written to `residual_out` instead of over `residual`, which stays as it was (as a
    /// framework whose tensors are immutable needs): `residual_out` holds `T(T(Σ x) +
    /// residual)`, `out` its norm. The same rules, `residual_out` as long as `residual`.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_add_rms_norm_to(
        &mut self,
        x: &mut impl DevicePtrMut<T>,
        residual: &impl DevicePtr<T>,
        weight: &impl DevicePtr<T>,
        eps: f32,
        residual_out: &mut impl DevicePtrMut<T>,
        out: &mut impl DevicePtrMut<T>,
        how: LsaEpilogue,
    ) -> Result<()> {
        let result = self.all_reduce_add_rms_norm_to_checked(
            x,
            residual,
            weight,
            eps,
            residual_out,
            out,
            how,
        );
        self.refused_here(result)
    }

    // The body of the call above: its refusals go through `refused_here`.
    #[allow(clippy::too_many_arguments)]
    fn all_reduce_add_rms_norm_to_checked(
        &mut self,
        x: &mut impl DevicePtrMut<T>,
        residual: &impl DevicePtr<T>,
        weight: &impl DevicePtr<T>,
        eps: f32,
        residual_out: &mut impl DevicePtrMut<T>,
        out: &mut impl DevicePtrMut<T>,
        how: LsaEpilogue,
    ) -> Result<()> {
        let plan = self.epilogue_plan(
            x,
            [residual.len(), residual_out.len()],
            [residual.stream().context(), residual_out.stream().context()],
            weight,
            eps,
            out,
            how,
        )?;
        let stream = self.comm.stream();
        let (residual, _residual) = residual.device_ptr(stream);
        let (residual_out, _residual_out) = residual_out.device_ptr_mut(stream);
        self.run_epilogue(plan, x, [residual, residual_out], weight, eps, out)
    }

    /// Checks an epilogue call (every refusal this rank could make alone comes first) and picks
    /// what runs.
    #[allow(clippy::too_many_arguments)]
    fn epilogue_plan(
        &mut self,
        x: &impl DevicePtrMut<T>,
        residual_lens: [usize; 2],
        residual_contexts: [&std::sync::Arc<cudarc::driver::CudaContext>; 2],
        weight: &impl DevicePtr<T>,
        eps: f32,
        out: &impl DevicePtrMut<T>,
        how: LsaEpilogue,
    ) -> Result<Plan> {
        let (len, hidden) = (x.len(), weight.len());
        for residual in residual_lens {
            epilogue_shape::<T>(len, residual, out.len(), hidden, eps)?;
        }
        if how == LsaEpilogue::Fused && len > self.max_count {
            return Err(Error::invalid(format!(
                "LsaAllReduce::all_reduce_add_rms_norm: {len} elements fused, past max_count {}",
                self.max_count
            )));
        }
        self.ready(&[
            (x.stream().context(), "x"),
            (residual_contexts[0], "the residual"),
            (residual_contexts[1], "the residual output"),
            (weight.stream().context(), "the weight"),
            (out.stream().context(), "the output"),
        ])?;
        let rows = len / hidden;
        let plan = match how {
            LsaEpilogue::Separate(algorithm) => Plan::Separate(algorithm),
            LsaEpilogue::Fused => {
                fused_grid::<T>(rows, hidden, SPLIT_TARGET).map_or(Plan::IntoOut, Plan::Fused)
            }
        };
        Ok(plan)
    }

    /// Runs `plan` (from [`epilogue_plan`](Self::epilogue_plan)): its all-reduce where it has
    /// one of its own, then its norm kernel.
    fn run_epilogue(
        &mut self,
        plan: Plan,
        x: &mut impl DevicePtrMut<T>,
        [residual_in, residual_out]: [u64; 2],
        weight: &impl DevicePtr<T>,
        eps: f32,
        out: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let (len, hidden) = (x.len(), weight.len());
        if let Plan::Separate(algorithm) = plan {
            self.all_reduce_in_place(x, algorithm)?;
        }
        let stream = self.comm.stream();
        let (x, _x) = x.device_ptr_mut(stream);
        let (weight, _weight) = weight.device_ptr(stream);
        let (out, _out) = out.device_ptr_mut(stream);
        // The sums the norm kernel reads: the all-reduce's, in place on x, or into out.
        let sums = if let Plan::IntoOut = plan {
            // The one-shot (len <= max_count): the shipped kernels' rank order, and no more
            // CTAs that must be resident at once than the fused kernel would have had (the
            // two-shot's 64 would).
            self.launch(Kernel::AllReduce(LsaAlgorithm::OneShotFlags), x, out, len)?;
            out
        } else {
            x
        };
        self.launch_norm(
            plan,
            [sums, residual_in, residual_out, weight, out],
            len / hidden,
            hidden,
            eps,
        )
    }

    fn launch_norm(
        &mut self,
        plan: Plan,
        [x, residual_in, residual_out, weight, out]: [u64; 5],
        rows: usize,
        hidden: usize,
        eps: f32,
    ) -> Result<()> {
        let mut usable = self.usable()?;
        if rows == 0 {
            return Ok(());
        }
        let grid = match plan {
            Plan::Fused(grid) => grid,
            Plan::Separate(_) | Plan::IntoOut => separate_grid::<T>(rows, hidden),
        };
        let cfg = LaunchConfig {
            grid_dim: (grid.ctas, 1, 1),
            block_dim: (grid.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let stream = self.comm.stream();
        if !matches!(plan, Plan::Fused(_)) {
            // SAFETY: nccl_rs_add_rms_norm_T(const T* sums, const T* residual_in,
            // T* residual_out, const T* weight, T* out, size_t rows, size_t hidden, float eps):
            // `x` (the sums), the residuals and `out` hold rows × hidden elements and `weight`
            // hidden (checked by `epilogue_shape`), on this context (checked by `ready`),
            // ordered on this stream by the caller's guards; a CTA handles whole rows of at
            // most NORM_VECTORS_PER_THREAD vectors a thread, reading a row before writing it
            // (so the sums may be `out`, and the residuals one buffer).
            let launched = unsafe {
                stream
                    .launch_builder(&self.add_norm)
                    .arg(&x)
                    .arg(&residual_in)
                    .arg(&residual_out)
                    .arg(&weight)
                    .arg(&out)
                    .arg(&rows)
                    .arg(&hidden)
                    .arg(&eps)
                    .launch(cfg)
            };
            record_launch::<T>(
                &mut usable,
                self.flight_instance,
                ShippedKernel::AddRmsNorm,
                rows * hidden,
                stream.cu_stream() as u64,
                launched.is_err(),
            );
            launched?;
            return Ok(());
        }
        let scratch = self.scratch.as_raw() as u64;
        let timeout_ns = u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX);
        let (state, state_written) = self.state.device_ptr_mut(stream);
        // SAFETY: nccl_rs_fused_add_rms_norm_T(const ncclDevComm*, ncclWindow_t, size_t slot,
        // const T* in, const T* residual_in, T* residual_out, const T* weight, T* out,
        // size_t rows, size_t hidden, size_t splits, float eps, State*,
        // unsigned long long timeout_ns), in that order. The buffers are as for the separate
        // kernel above; the scratch is used as by the flags all-reduce of rows × hidden <=
        // max_count elements (checked); the grid is at most MAX_CTAS CTAs, and split rows
        // (splits > 1) at most SPLIT_ROWS with rows × splits <= the grid, parts of at most
        // FUSED_VECTORS_PER_THREAD vectors a thread (`fused_grid`), within the state's
        // partials.
        let launched = unsafe {
            stream
                .launch_builder(&self.fused_norm)
                .arg(&self.dev_comm)
                .arg(&scratch)
                .arg(&self.slot_bytes)
                .arg(&x)
                .arg(&residual_in)
                .arg(&residual_out)
                .arg(&weight)
                .arg(&out)
                .arg(&rows)
                .arg(&hidden)
                .arg(&grid.splits)
                .arg(&eps)
                .arg(&state)
                .arg(&timeout_ns)
                .launch(cfg)
        };
        drop(state_written);
        record_launch::<T>(
            &mut usable,
            self.flight_instance,
            ShippedKernel::FusedAddRmsNorm,
            rows * hidden,
            stream.cu_stream() as u64,
            launched.is_err(),
        );
        if let Err(err) = launched {
            self.put_out_of_step("a kernel launch failed here");
            return Err(err.into());
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
    use half::bf16;

    fn fused(rows: usize, hidden: usize) -> Option<(u32, u32, usize)> {
        fused_grid::<bf16>(rows, hidden, SPLIT_TARGET).map(|g| (g.ctas, g.threads, g.splits))
    }

    #[test]
    fn separate_grids_keep_a_row_in_a_cta() {
        let g = separate_grid::<bf16>(1, 4096);
        assert_eq!((g.ctas, g.threads, g.splits), (1, 512, 1));
        let g = separate_grid::<bf16>(100, 16384);
        assert_eq!((g.ctas, g.threads, g.splits), (MAX_CTAS, 512, 1));
        let g = separate_grid::<f32>(3, 4);
        assert_eq!((g.ctas, g.threads), (3, 32));
        for hidden in (8..=16384).step_by(8) {
            let g = separate_grid::<bf16>(1, hidden);
            assert!((hidden / 8).div_ceil(g.threads as usize) <= NORM_VECTORS_PER_THREAD);
        }
    }

    #[test]
    fn fused_grids_split_decode_rows_and_fit_the_kernel() {
        // hidden 4096 bf16 (512 vectors): four CTAs of 128 a row.
        assert_eq!(fused(1, 4096), Some((4, 128, 4)));
        assert_eq!(fused(4, 4096), Some((16, 128, 4)));
        // hidden 8192 (1024 vectors): as many as 16 CTAs allow.
        assert_eq!(fused(1, 8192), Some((8, 128, 8)));
        assert_eq!(fused(4, 8192), Some((16, 256, 4)));
        // Many rows: one CTA a row, looping; too long to keep unsplit: the separate path.
        assert_eq!(fused(100, 8192), Some((16, 512, 1)));
        assert_eq!(fused(9, 16384), None);
        assert_eq!(fused(8, 16384), Some((16, 512, 2)));
        for rows in 1..=40 {
            for hidden in (8..=16384).step_by(8) {
                let vectors = hidden / 8;
                let Some(g) = fused_grid::<bf16>(rows, hidden, SPLIT_TARGET) else {
                    assert!(rows > SPLIT_ROWS && vectors > 1024);
                    continue;
                };
                let part = vectors.div_ceil(g.splits).next_multiple_of(32);
                assert!(part.div_ceil(g.threads as usize) <= FUSED_VECTORS_PER_THREAD);
                // Every split has vectors: no CTA waits on siblings with nothing of its own.
                assert!(
                    (g.splits - 1) * part < vectors,
                    "{rows} x {hidden}: an empty part"
                );
                assert!(g.ctas <= MAX_CTAS && g.threads % 32 == 0);
                if g.splits > 1 {
                    assert!(rows <= SPLIT_ROWS && rows * g.splits <= g.ctas as usize);
                }
            }
        }
    }
}
