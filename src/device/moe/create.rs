//! Making an [`ExpertExchange`]: what each rank prepares alone (the shape's checks, the
//! shipped kernels, the state, work buffers and host-mapped words), the ranks' agreement on
//! the shape and the path, then the path's own buffers (the LSA scratch window and device
//! communicator, or the all-to-all-v buffers), agreed on again.

use std::marker::PhantomData;
use std::mem::{offset_of, size_of, ManuallyDrop};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, DevicePtr};

use super::fallback::{Fallback, FallbackKernels};
use super::layout::{
    work_words, Geometry, MoeState, Work, MAX_CTAS, MAX_ENTRIES, MAX_EXPERTS, MAX_RANKS,
};
use super::{
    next_id, ExchangePath, ExpertExchange, ExpertShape, Lsa, Path, DEFAULT_TIMEOUT, THREADS,
};
use crate::agreement::{all_gather_rows, Wait};
use crate::comm::Comm;
use crate::device::all_reduce::{HostWords, KernelStopRegistration, LsaElem};
use crate::device::shipped::ShippedFn;
use crate::device::{shipped, DevComm, DevCommRequirements, DEV_COMM_SINCE};
use crate::diagnostics::flight::FlightRing;
use crate::error::{Error, Refusal, Result};
use crate::memory::NcclBuffer;
use crate::thread_group;
use crate::window::WindowFlags;

const CALL: &str = "ExpertExchange::new";
const WIDTH: usize = 8;

/// What a rank prepares before the ranks agree.
struct Prepared {
    geometry: Geometry,
    scratch_bytes: usize,
    lsa_capable: bool,
    /// The LSA kernels (dispatch, combine) and the fallback's.
    dispatch: CudaFunction,
    combine: CudaFunction,
    fallback: FallbackKernels,
    ctas: u32,
    state: CudaSlice<u64>,
    host_words: HostWords,
    work_buffers: CudaSlice<u32>,
    work: Work,
}

pub(super) fn create<'c, T: LsaElem>(
    comm: &'c Comm,
    shape: ExpertShape,
    path: ExchangePath,
) -> Result<ExpertExchange<'c, T>> {
    // The agreement is a collective: an open group would hold it back (the caller's rule).
    thread_group::ensure_outside(CALL)?;
    let prepared = prepare::<T>(comm, &shape, path);
    let refusal = prepared
        .as_ref()
        .err()
        .map_or(0, |err| Refusal::of(err).code());
    let lsa_capable = prepared.as_ref().is_ok_and(|p| p.lsa_capable);
    let row = [
        refusal,
        type_code(T::SUFFIX),
        shape.experts as u64,
        shape.top_k as u64,
        shape.hidden as u64,
        shape.max_tokens as u64,
        path_code(path),
        u64::from(lsa_capable),
    ];
    let agreed = agree(comm, row);
    let prepared = prepared?;
    let all_capable = agreed?;
    let use_lsa = match path {
        ExchangePath::AllToAllV => false,
        // `prepare` refused a rank that cannot, so here every rank can.
        ExchangePath::Lsa => true,
        _ => all_capable,
    };
    let stream = comm.stream();
    let (path, stop_stream) = if use_lsa {
        let allocated = NcclBuffer::<u32>::alloc_zeros(stream, prepared.scratch_bytes / 4)
            .and_then(|scratch| Ok((scratch, comm.context().new_stream()?)));
        let agreed = agree_again(comm, &allocated, row);
        let (scratch, stop_stream) = allocated?;
        agreed?;
        let scratch = comm
            .register_window(scratch, WindowFlags::COLL_SYMMETRIC)
            .map_err(Error::from)?;
        let dev_comm = DevComm::create(comm, &DevCommRequirements::new(), shipped::ABI);
        // As LsaAllReduce::new: no rank returns (and launches kernels that spin for peers)
        // while a peer may still be creating.
        let agreed = agree_again(comm, &dev_comm, row);
        let dev_comm = dev_comm?;
        agreed?;
        let lsa = Lsa {
            dev_comm,
            scratch,
            dispatch: prepared.dispatch,
            combine: prepared.combine,
        };
        (Path::Lsa(lsa), Some(stop_stream))
    } else {
        let fallback = Fallback::new(comm, &prepared.geometry, prepared.fallback);
        let agreed = agree_again(comm, &fallback, row);
        let fallback = fallback?;
        agreed?;
        (Path::AllToAllV(fallback), None)
    };
    // Numbered after the last agreement (every rank that gets here numbers alike), the LSA
    // path's kernels only: the fallback's NCCL calls are recorded as NCCL's.
    let flight_instance = stop_stream.as_ref().and_then(|_| {
        comm.shared()
            .lock()
            .flight
            .as_deref_mut()
            .map(FlightRing::new_shipped_instance)
    });
    // After the last meeting nothing can fail on one rank alone.
    let stopped = Arc::new(AtomicBool::new(false));
    let stop = stop_stream.map(|stream| {
        let (state, _read) = prepared.state.device_ptr(comm.stream());
        ManuallyDrop::new(KernelStopRegistration::new(
            comm,
            state + offset_of!(MoeState, timed_out) as u64,
            stream,
            stopped.clone(),
            flight_instance,
        ))
    });
    Ok(ExpertExchange {
        stop,
        comm,
        path,
        geometry: prepared.geometry,
        shape,
        ctas: prepared.ctas,
        work: prepared.work,
        work_buffers: ManuallyDrop::new(prepared.work_buffers),
        state: ManuallyDrop::new(prepared.state),
        host_words: ManuallyDrop::new(prepared.host_words),
        stopped,
        flight_instance,
        out_of_step: None,
        timeout: DEFAULT_TIMEOUT,
        id: next_id(),
        dispatches: 0,
        pending: None,
        _elem: PhantomData,
    })
}

/// The element type in the agreement's row (sizes alone would let bf16 pair with f16).
fn type_code(suffix: &str) -> u64 {
    match suffix {
        "f32" => 1,
        "bf16" => 2,
        "f16" => 3,
        _ => 0,
    }
}

fn path_code(path: ExchangePath) -> u64 {
    match path {
        ExchangePath::Lsa => 1,
        ExchangePath::AllToAllV => 2,
        _ => 0,
    }
}

/// The shape's own checks, the same on every rank (so every rank refuses alike).
fn check_shape<T>(shape: &ExpertShape, ranks: usize) -> Result<()> {
    let ExpertShape {
        experts,
        top_k,
        hidden,
        max_tokens,
    } = *shape;
    let row_bytes = hidden.checked_mul(size_of::<T>());
    let why = if ranks > MAX_RANKS {
        format!("at most {MAX_RANKS} ranks, not {ranks}")
    } else if experts == 0 || !experts.is_multiple_of(ranks) || experts > MAX_EXPERTS {
        format!(
            "experts ({experts}) must be a multiple of the ranks ({ranks}), at most {MAX_EXPERTS}"
        )
    } else if top_k == 0 || top_k > experts {
        format!("top_k ({top_k}) must lie in 1..={experts}")
    } else if max_tokens == 0 || max_tokens.saturating_mul(top_k) > MAX_ENTRIES {
        format!("max_tokens × top_k ({max_tokens} × {top_k}) must lie in 1..={MAX_ENTRIES}")
    } else if hidden == 0 || row_bytes.is_none_or(|b| b % 16 != 0) {
        format!(
            "a row of hidden = {hidden} elements of {} bytes must fill whole 16-byte vectors",
            size_of::<T>()
        )
    } else {
        return Ok(());
    };
    Err(Error::invalid(format!("ExpertExchange::new: {why}")))
}

fn prepare<T: LsaElem>(comm: &Comm, shape: &ExpertShape, path: ExchangePath) -> Result<Prepared> {
    let ranks = comm.size();
    check_shape::<T>(shape, ranks)?;
    let (geometry, scratch_bytes) = Geometry::new(
        ranks,
        shape.experts,
        shape.top_k,
        shape.max_tokens,
        shape.hidden * size_of::<T>(),
    )
    .ok_or_else(|| Error::invalid("ExpertExchange::new: the shape's sizes overflow"))?;
    let lsa = lsa_refusal(comm);
    if let (ExchangePath::Lsa, Some(why)) = (path, &lsa) {
        return Err(Error::Unavailable {
            api: "ExpertExchange (ExchangePath::Lsa)",
            reason: why.clone(),
        });
    }
    let ctx = comm.context();
    ctx.bind_to_thread()?;
    let module = shipped::load_moe(ctx)?;
    let dispatch = shipped::function(&module, ShippedFn::MoeDispatch, T::SUFFIX)?;
    let combine = shipped::function(&module, ShippedFn::MoeCombine, T::SUFFIX)?;
    let fallback = FallbackKernels::new::<T>(&module)?;
    let ctas = resident_ctas(ctx, [&dispatch, &combine, &fallback.pack])?;
    let stream = comm.stream();
    let host_words = HostWords::new(ctx)?;
    let mut words = vec![0u64; size_of::<MoeState>() / 8];
    words[offset_of!(MoeState, host) / 8] = host_words.device();
    let state = stream.clone_htod(&words)?;
    let sizes = work_words(&geometry);
    let work_buffers = stream.alloc_zeros::<u32>(sizes.iter().sum())?;
    let base = {
        let (ptr, _read) = work_buffers.device_ptr(stream);
        ptr
    };
    let mut at = base;
    let mut next = |words: usize| {
        let ptr = at;
        at += 4 * words as u64;
        ptr
    };
    let work = Work {
        done: next(sizes[0]),
        routing: next(sizes[1]),
        totals: next(sizes[2]),
        sources: next(sizes[3]),
        pairs: next(sizes[4]),
        slots: next(sizes[5]),
        parts: next(sizes[6]),
    };
    Ok(Prepared {
        geometry,
        scratch_bytes,
        lsa_capable: lsa.is_none(),
        dispatch,
        combine,
        fallback,
        ctas,
        state,
        host_words,
        work_buffers,
        work,
    })
}

/// CTAs per call: as many as two ranks sharing this GPU keep resident at once with every
/// kernel of `kernels` (the dispatch's CTAs wait for each other's counts), at most
/// [`MAX_CTAS`]. Two: NCCL lets at most two ranks share a GPU (`NCCL_MULTI_RANK_GPU_ENABLE`);
/// on a GPU of one rank the cap binds first on GPUs of 64 SMs or more.
fn resident_ctas<const N: usize>(
    ctx: &Arc<CudaContext>,
    kernels: [&CudaFunction; N],
) -> Result<u32> {
    let sms = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let mut per_sm = u32::MAX;
    for kernel in kernels {
        per_sm =
            per_sm.min(kernel.occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None)?);
    }
    let ctas = (per_sm as u64 * sms.max(0) as u64 / 2).min(MAX_CTAS as u64) as u32;
    if ctas == 0 {
        return Err(Error::Unavailable {
            api: "ExpertExchange",
            reason: "its kernels' CTAs do not fit this GPU twice over".into(),
        });
    }
    Ok(ctas)
}

/// Why this rank cannot run the LSA kernels (`None`: it can).
fn lsa_refusal(comm: &Comm) -> Option<String> {
    if let Err(err) = comm
        .library()
        .require("ExpertExchange's LSA kernels", DEV_COMM_SINCE)
    {
        return Some(err.to_string());
    }
    let props = match comm.properties() {
        Ok(props) => props,
        Err(err) => return Some(err.to_string()),
    };
    if !props.device_api_support {
        return Some("the communicator has no device-API support".into());
    }
    if props.lsa_teams != Some(1) {
        return Some(format!(
            "its kernels need every rank in one LSA team (one host's NVLink, or ranks sharing \
             a GPU); this communicator has {} LSA teams",
            props
                .lsa_teams
                .map_or_else(|| "an unknown number of".into(), |n| n.to_string())
        ));
    }
    None
}

fn wait() -> Wait {
    Wait {
        limit: |comm| Some(comm.ready_timeout()),
        what: "ExpertExchange's agreement exchange to finish",
        explain: None,
    }
}

/// Every rank's row all-gathered: each rank returns its own error, the others
/// [`Error::RankRefused`]; shapes that differ give [`Error::RankMismatch`] everywhere.
/// `Ok(true)` where every rank can run the LSA kernels.
fn agree(comm: &Comm, row: [u64; WIDTH]) -> Result<bool> {
    if comm.size() == 1 {
        return Ok(row[7] == 1);
    }
    let all = all_gather_rows(&[comm], &[row.to_vec()], WIDTH, &wait())?;
    let rows: Vec<&[u64]> = all[0].chunks_exact(WIDTH).collect();
    if let Some((rank, reason)) = rows
        .iter()
        .enumerate()
        .find_map(|(rank, row)| Refusal::from_code(row[0]).map(|r| (rank, r)))
    {
        return Err(Error::RankRefused {
            call: CALL,
            rank,
            reason,
        });
    }
    let fields = [
        ("element type", 1),
        ("experts", 2),
        ("top_k", 3),
        ("hidden", 4),
        ("max_tokens", 5),
        ("path", 6),
    ];
    for (field, i) in fields {
        if let Some((rank, r)) = rows.iter().enumerate().find(|(_, r)| r[i] != rows[0][i]) {
            return Err(Error::RankMismatch {
                call: CALL,
                field,
                first: 0,
                expected: rows[0][i],
                rank,
                value: r[i],
            });
        }
    }
    Ok(rows.iter().all(|r| r[7] == 1))
}

/// A later meeting: every rank's verdict on `made`.
fn agree_again<M>(comm: &Comm, made: &Result<M>, mut row: [u64; WIDTH]) -> Result<()> {
    row[0] = made.as_ref().err().map_or(0, |err| Refusal::of(err).code());
    agree(comm, row).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_checked_before_anything_is_made() {
        let ok = ExpertShape::new(8, 2, 64, 16);
        assert!(check_shape::<half::bf16>(&ok, 2).is_ok());
        let cases = [
            (ExpertShape::new(7, 2, 64, 16), 2, "multiple of the ranks"),
            (ExpertShape::new(2048, 2, 64, 16), 2, "at most 1024"),
            (ExpertShape::new(8, 0, 64, 16), 2, "top_k"),
            (ExpertShape::new(8, 9, 64, 16), 2, "top_k"),
            (ExpertShape::new(8, 8, 64, 1024), 2, "max_tokens"),
            (ExpertShape::new(8, 2, 4, 16), 2, "16-byte"),
            (ExpertShape::new(256, 2, 64, 16), 256, "ranks"),
        ];
        for (shape, ranks, says) in cases {
            let err = check_shape::<half::bf16>(&shape, ranks)
                .unwrap_err()
                .to_string();
            assert!(err.contains(says), "{shape:?}: {err}");
        }
        // Rows of f32 need hidden a multiple of 4, of bf16 a multiple of 8.
        assert!(check_shape::<f32>(&ExpertShape::new(8, 2, 4, 16), 2).is_ok());
    }
}
