//! The single path every operation takes to NCCL: validate completely, then call.

use std::ffi::c_void;

use cudarc::driver::{CudaStream, SyncOnDrop};

use super::operation::{Kind, Operation};
use super::rules::{check_plan, check_self_p2p, Ptr};
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
#[inline]
pub(crate) fn dispatch<'b, 'a: 'b, T: NcclType>(
    comm: &'b Comm,
    stream: &'b CudaStream,
    call: Operation<'a, T>,
    in_group: bool,
    keep: impl FnOnce(Guards<'b>),
) -> Result<()> {
    let lib = comm.library();
    let kind = call.kind;
    let name = kind.name();
    lib.require(name, kind.min_version())?;
    let dtype = T::DATA_TYPE;
    lib.require(dtype.name(), dtype.min_version())?;
    comm.check_stream(stream, "the stream")?;

    let (rank, size) = (comm.rank(), comm.size());
    let plan = check_plan(
        kind,
        rank,
        size,
        call.send.as_ref().map(|b| b.len()),
        call.recv.as_ref().map(|b| b.len()),
        call.in_place,
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
        if let Some(buf) = &call.send {
            comm.check_context(buf.stream().context(), "the send buffer")?;
        }
    }
    if recv_used {
        if let Some(buf) = &call.recv {
            comm.check_context(buf.stream().context(), "the receive buffer")?;
        }
    }
    let op = match &call.op {
        Some(op) => op.raw_for(comm, stream)?,
        None => nccl_sys::ncclRedOp_t::ncclSum,
    };

    // Validation is over: take the device pointers (this orders the stream after earlier
    // work on the buffers) and call NCCL.
    let (send_base, send_guard) = match (send_used, call.send) {
        (true, Some(buf)) => {
            let (ptr, guard) = buf.device_ptr(stream);
            (ptr, Some(guard))
        }
        _ => (0, None),
    };
    let (recv_base, recv_guard) = match (recv_used, call.recv) {
        (true, Some(buf)) => {
            let (ptr, guard) = buf.device_ptr_mut(stream);
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
    let count = plan.count;
    let datatype = dtype.raw();
    let cu_stream = stream.cu_stream() as nccl_sys::cudaStream_t;
    let api = lib.api();
    // Roots and peers were checked against the communicator size, which fits a C int.
    let int = |value: usize| value as std::os::raw::c_int;

    let status = comm.with_raw(name, |raw| {
        // SAFETY: every pointer lies inside a buffer on the communicator's device whose
        // length was checked against `count` and the rank/root offsets above; the buffers
        // stay borrowed (and alive) at least until the work is enqueued, and their events are
        // recorded afterwards by the guards; the handle is live under the comm's lock.
        unsafe {
            match kind {
                Kind::AllReduce => {
                    api.ncclAllReduce(send, recv, count, datatype, op, raw, cu_stream)
                }
                Kind::Broadcast { root } => {
                    api.ncclBroadcast(send, recv, count, datatype, int(root), raw, cu_stream)
                }
                Kind::Reduce { root } => {
                    api.ncclReduce(send, recv, count, datatype, op, int(root), raw, cu_stream)
                }
                Kind::AllGather => api.ncclAllGather(send, recv, count, datatype, raw, cu_stream),
                Kind::ReduceScatter => {
                    api.ncclReduceScatter(send, recv, count, datatype, op, raw, cu_stream)
                }
                Kind::AllToAll => api.ncclAlltoAll(send, recv, count, datatype, raw, cu_stream),
                Kind::Gather { root } => {
                    api.ncclGather(send, recv, count, datatype, int(root), raw, cu_stream)
                }
                Kind::Scatter { root } => {
                    api.ncclScatter(send, recv, count, datatype, int(root), raw, cu_stream)
                }
                Kind::Send { peer } => {
                    api.ncclSend(send, count, datatype, int(peer), raw, cu_stream)
                }
                Kind::Recv { peer } => {
                    api.ncclRecv(recv, count, datatype, int(peer), raw, cu_stream)
                }
            }
        }
    })?;
    if in_group {
        lib.check_pending(name, status)?;
    } else {
        comm.complete(name, status)?;
    }
    keep([send_guard, recv_guard]);
    Ok(())
}
