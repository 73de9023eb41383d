//! The single path every operation takes to NCCL: validate completely, then call.
//!
//! An operation with a [`CollConfig`] takes the same path; only the last step differs (the
//! `*Config` variant of the NCCL function, with the raw struct kept alive across the call),
//! and it branches off on a cold path, so an operation without one pays a single `Option`
//! check for the feature.

use std::ffi::c_void;
use std::os::raw::c_int;

use cudarc::driver::{CudaStream, SyncOnDrop};
use nccl_sys::{
    cudaStream_t, ncclCollConfig_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t,
    MissingSymbol, NcclLib,
};

use super::operation::{Kind, Operation};
use super::rules::{check_config_kind, check_plan, check_self_p2p, Ptr};
use crate::calls::Call;
use crate::coll_config::CollConfig;
use crate::comm::Comm;
use crate::dtype::NcclType;
use crate::error::Result;

/// The cudarc guards of the buffers of one enqueued operation. Dropping them records the
/// buffers' events on the stream, so they must outlive the enqueue (and the group end).
pub(crate) type Guards<'b> = [Option<SyncOnDrop<'b>>; 2];

/// Validates `call` completely and enqueues it on `stream`, then hands the buffers' guards
/// to `keep` (which drops them, or holds them until the group ends). Inside a group, an
/// in-progress result is left for the group's end to complete.
///
/// The guards go to a closure rather than out as a return value so that the common path
/// (no group: drop them at once) does not move them around.
///
/// Inlined, with everything it validates: where the kind is known at the call site (the
/// `Comm` methods, an operation built next to its enqueue), the count rules fold to the few
/// comparisons that kind needs, so the call path stays a short, straight run of code, which
/// is what a call reached cache-cold after the program's own work pays for.
#[inline(always)]
pub(crate) fn dispatch<'b, 'a: 'b, T: NcclType>(
    comm: &'b Comm,
    stream: &'b CudaStream,
    call: Operation<'a, T>,
    in_group: bool,
    keep: impl FnOnce(Guards<'b>),
) -> Result<()> {
    match call.config {
        None => validate_and_launch(comm, stream, call, in_group, keep, Plain),
        Some(config) => dispatch_configured(comm, stream, call, in_group, keep, config),
    }
}

/// [`dispatch`] for an operation with a [`CollConfig`]: refuses it on send and receive,
/// builds the raw struct for the loaded library (version gates and field checks live in
/// [`CollConfig::to_raw`]) and keeps it alive until NCCL has returned; what its pointers
/// refer to lives in the borrowed `config`.
#[cold]
#[inline(never)]
fn dispatch_configured<'b, 'a: 'b, T: NcclType>(
    comm: &'b Comm,
    stream: &'b CudaStream,
    call: Operation<'a, T>,
    in_group: bool,
    keep: impl FnOnce(Guards<'b>),
    config: &CollConfig<'_>,
) -> Result<()> {
    let kind = call.kind;
    let call_row = check_config_kind(kind)
        .map_err(|broken| broken.to_error(kind, comm.rank(), comm.size()))?;
    let raw = config.to_raw(comm)?;
    let launch = Configured {
        call: call_row,
        config: raw.as_ptr(),
        copy_engine: config.copy_engine(comm),
    };
    // `raw` lives to the end of this function: NCCL copies the struct during the call, but
    // keeps its `algSelection` pointer (and may parse it again at ncclGroupEnd, NCCL 2.31's
    // rearchitected enqueue): that string lives in `config`, which the operation borrows
    // until it is enqueued or its group has ended.
    validate_and_launch(comm, stream, call, in_group, keep, launch)
}

/// Validates `call` completely, enqueues it through `launch`, completes the call and hands
/// the guards to `keep`: everything [`dispatch`] does, written once for both NCCL entry
/// points.
#[inline(always)]
fn validate_and_launch<'b, 'a: 'b, T: NcclType>(
    comm: &'b Comm,
    stream: &'b CudaStream,
    call: Operation<'a, T>,
    in_group: bool,
    keep: impl FnOnce(Guards<'b>),
    launch: impl Launch,
) -> Result<()> {
    let lib = comm.library();
    let kind = call.kind;
    lib.require_call(kind.call())?;
    let dtype = T::DATA_TYPE;
    lib.require(dtype.name(), dtype.min_version())?;
    comm.check_stream(stream, "the stream")?;

    let (rank, size) = (comm.rank(), comm.size());
    let plan = check_plan(
        kind,
        rank,
        size,
        call.send.as_ref().map(|b| b.len),
        call.recv.as_ref().map(|b| b.len),
        call.in_place,
        launch.copy_engine(comm),
    )
    .and_then(|plan| check_self_p2p(kind, rank, in_group).map(|()| plan))
    .map_err(|broken| broken.to_error(kind, rank, size))?;
    let uses = |ptr: Ptr, send: bool| match ptr {
        Ptr::Send(_) => send,
        Ptr::Recv(_) => !send,
        Ptr::Null => false,
    };
    let send_used = uses(plan.send, true) || uses(plan.recv, true);
    let recv_used = uses(plan.send, false) || uses(plan.recv, false);
    if send_used {
        if let Some(held) = &call.send {
            let ctx = || held.buf.stream().context();
            comm.check_context_of(held.context, ctx, "the send buffer")?;
        }
    }
    if recv_used {
        if let Some(held) = &call.recv {
            let ctx = || held.buf.stream().context();
            comm.check_context_of(held.context, ctx, "the receive buffer")?;
        }
    }
    let op = match &call.op {
        Some(op) => op.raw_for(comm, stream)?,
        None => nccl_sys::ncclRedOp_t::ncclSum,
    };

    // Validation is over: take the device pointers (this orders the stream after earlier
    // work on the buffers) and call NCCL.
    let (send_base, send_guard) = match (send_used, call.send) {
        (true, Some(held)) => {
            let (ptr, guard) = held.buf.device_ptr(stream);
            (ptr, Some(guard))
        }
        _ => (0, None),
    };
    let (recv_base, recv_guard) = match (recv_used, call.recv) {
        (true, Some(held)) => {
            let (ptr, guard) = held.buf.device_ptr_mut(stream);
            (ptr, Some(guard))
        }
        _ => (0, None),
    };
    let elem = std::mem::size_of::<T>() as u64;
    let address = |ptr: Ptr| -> *mut c_void {
        match ptr {
            Ptr::Null => std::ptr::null_mut(),
            Ptr::Send(offset) => (send_base + offset as u64 * elem) as *mut c_void,
            Ptr::Recv(offset) => (recv_base + offset as u64 * elem) as *mut c_void,
        }
    };
    let (send, recv) = (address(plan.send) as *const c_void, address(plan.recv));
    let args = Args {
        send,
        recv,
        count: plan.count,
        datatype: dtype.raw(),
        op,
        stream: stream.cu_stream() as cudaStream_t,
    };
    let api = lib.api();
    let row = launch.call(kind);

    let state = comm.usable(row)?;
    // SAFETY: every pointer lies inside a buffer on the communicator's device whose length
    // was checked against `count` and the rank/root offsets above; the buffers stay borrowed
    // (and alive) at least until the work is enqueued, and their events are recorded
    // afterwards by the guards; the handle is live under the comm's lock, held until NCCL
    // has returned.
    let status = unsafe { launch.launch(api, kind, args, state.ptr) };
    drop(state);
    if in_group {
        lib.check_pending(row.name, status)?;
    } else {
        comm.complete(row, status)?;
    }
    keep([send_guard, recv_guard]);
    Ok(())
}

/// The arguments every NCCL operation call shares.
#[derive(Clone, Copy)]
struct Args {
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: ncclDataType_t,
    op: ncclRedOp_t,
    stream: cudaStream_t,
}

/// Which NCCL function a validated operation goes to.
trait Launch {
    /// The NCCL function called for `kind`.
    fn call(&self, kind: Kind) -> &'static Call;

    /// Whether NCCL may take its copy-engine path for this call (the rules in
    /// [`check_plan`] depend on it).
    fn copy_engine(&self, comm: &Comm) -> bool;

    /// Calls NCCL.
    ///
    /// # Safety
    ///
    /// `args` must have passed [`validate_and_launch`]'s checks for `kind`, with the buffers
    /// alive; `comm` must be a live handle, held under the communicator's lock.
    unsafe fn launch(
        &self,
        api: &NcclLib,
        kind: Kind,
        args: Args,
        comm: ncclComm_t,
    ) -> std::result::Result<ncclResult_t, MissingSymbol>;
}

/// Roots and peers were checked against the communicator size, which fits a C int.
#[inline(always)]
fn int(value: usize) -> c_int {
    value as c_int
}

/// The plain functions: `ncclAllReduce` ... `ncclRecv`.
struct Plain;

impl Launch for Plain {
    #[inline(always)]
    fn call(&self, kind: Kind) -> &'static Call {
        kind.call()
    }

    #[inline(always)]
    fn copy_engine(&self, comm: &Comm) -> bool {
        comm.copy_engine()
    }

    #[inline(always)]
    unsafe fn launch(
        &self,
        api: &NcclLib,
        kind: Kind,
        a: Args,
        comm: ncclComm_t,
    ) -> std::result::Result<ncclResult_t, MissingSymbol> {
        let Args {
            send,
            recv,
            count,
            datatype: dt,
            op,
            stream: s,
        } = a;
        // SAFETY: forwarded from our caller (see the trait).
        unsafe {
            match kind {
                Kind::AllReduce => api.ncclAllReduce(send, recv, count, dt, op, comm, s),
                Kind::Broadcast { root } => {
                    api.ncclBroadcast(send, recv, count, dt, int(root), comm, s)
                }
                Kind::Reduce { root } => {
                    api.ncclReduce(send, recv, count, dt, op, int(root), comm, s)
                }
                Kind::AllGather => api.ncclAllGather(send, recv, count, dt, comm, s),
                Kind::ReduceScatter => api.ncclReduceScatter(send, recv, count, dt, op, comm, s),
                Kind::AllToAll => api.ncclAlltoAll(send, recv, count, dt, comm, s),
                Kind::Gather { root } => api.ncclGather(send, recv, count, dt, int(root), comm, s),
                Kind::Scatter { root } => {
                    api.ncclScatter(send, recv, count, dt, int(root), comm, s)
                }
                Kind::Send { peer } => api.ncclSend(send, count, dt, int(peer), comm, s),
                Kind::Recv { peer } => api.ncclRecv(recv, count, dt, int(peer), comm, s),
            }
        }
    }
}

/// The `*Config` variants (NCCL 2.31), with a raw configuration that outlives the call.
struct Configured {
    /// The `*Config` function, from [`check_config_kind`].
    call: &'static Call,
    config: *const ncclCollConfig_t,
    /// The call's copy-engine decision: its own CTA policy where NCCL lets that win.
    copy_engine: bool,
}

impl Launch for Configured {
    fn call(&self, _kind: Kind) -> &'static Call {
        self.call
    }

    fn copy_engine(&self, _comm: &Comm) -> bool {
        self.copy_engine
    }

    unsafe fn launch(
        &self,
        api: &NcclLib,
        kind: Kind,
        a: Args,
        comm: ncclComm_t,
    ) -> std::result::Result<ncclResult_t, MissingSymbol> {
        let Args {
            send,
            recv,
            count,
            datatype: dt,
            op,
            stream: s,
        } = a;
        let cfg = self.config;
        // SAFETY: forwarded from our caller (see the trait); `cfg` points to a struct built
        // by `CollConfig::to_raw` for the loaded library, alive until after this call.
        unsafe {
            match kind {
                Kind::AllReduce => api.ncclAllReduceConfig(send, recv, count, dt, op, comm, s, cfg),
                Kind::Broadcast { root } => {
                    api.ncclBroadcastConfig(send, recv, count, dt, int(root), comm, s, cfg)
                }
                Kind::Reduce { root } => {
                    api.ncclReduceConfig(send, recv, count, dt, op, int(root), comm, s, cfg)
                }
                Kind::AllGather => api.ncclAllGatherConfig(send, recv, count, dt, comm, s, cfg),
                Kind::ReduceScatter => {
                    api.ncclReduceScatterConfig(send, recv, count, dt, op, comm, s, cfg)
                }
                Kind::AllToAll => api.ncclAlltoAllConfig(send, recv, count, dt, comm, s, cfg),
                Kind::Gather { root } => {
                    api.ncclGatherConfig(send, recv, count, dt, int(root), comm, s, cfg)
                }
                Kind::Scatter { root } => {
                    api.ncclScatterConfig(send, recv, count, dt, int(root), comm, s, cfg)
                }
                // Refused by `check_config_kind` before anything was taken; NCCL's own
                // answer to a bad argument, should that ever change, rather than a panic.
                Kind::Send { .. } | Kind::Recv { .. } => Ok(ncclResult_t::ncclInvalidArgument),
            }
        }
    }
}
