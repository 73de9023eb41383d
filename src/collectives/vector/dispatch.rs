//! The path of every v-collective to NCCL: validate completely, then hand each planned step
//! to the crate's one [`dispatch`] as an ordinary [`Operation`] inside the caller's group.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use super::operation::VOperation;
use super::plan::plan;
use super::rules::{built, Buf, Seg, Step};
use crate::calls;
use crate::collectives::{dispatch, Operation};
use crate::comm::Comm;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::op::Reduction;

/// A segment of a buffer whose pointer was already taken: what one step hands to
/// [`dispatch`]. Its guard does nothing, because the whole buffer's guard is held by the
/// group (one event wait and one record per buffer, not per segment).
struct Piece<'s, T> {
    ptr: CUdeviceptr,
    len: usize,
    /// The communicator's stream: the buffer was checked to be in its context already.
    stream: &'s Arc<CudaStream>,
    _type: PhantomData<T>,
}

impl<T> DeviceSlice<T> for Piece<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.stream
    }
}

impl<T> DevicePtr<T> for Piece<'_, T> {
    fn device_ptr<'a>(&'a self, _: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

impl<T> DevicePtrMut<T> for Piece<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, _: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Record(None))
    }
}

/// Validates `call` completely, then takes its buffers' pointers (ordering `stream` after
/// earlier work on them), hands their guards to `keep` (the group holds them until it has
/// ended) and dispatches each step inside the group that is open on this thread.
///
/// Nothing is enqueued when validation fails. An NCCL failure part-way leaves the steps
/// before it in the group, like any failed call in a group: NCCL's errors there are fatal
/// for the communicator.
pub(crate) fn dispatch_v<'b, 'a: 'b, T: NcclType>(
    comm: &'b Comm,
    stream: &'b CudaStream,
    call: VOperation<'a, T>,
    mut keep: impl FnMut(SyncOnDrop<'b>),
) -> Result<()> {
    if call.check.is_some() {
        return Err(Error::usage(format!(
            "the checked mode of {} synchronises with the other ranks, so it cannot run \
             inside a Group: enqueue it alone (Comm::enqueue_v)",
            call.kind.name()
        )));
    }
    let Validated {
        steps,
        send_used,
        recv_used,
    } = validate(comm, stream, &call)?;

    // Validation is over.
    let send = match (send_used, call.send) {
        (true, Some(buf)) => Some(buf.device_ptr(stream)),
        _ => None,
    };
    let recv = match (recv_used, call.recv) {
        (true, Some(buf)) => Some(buf.device_ptr_mut(stream)),
        _ => None,
    };
    let bases = Bases::<T> {
        send: send.map_or(0, |(ptr, guard)| {
            keep(guard);
            ptr
        }),
        recv: recv.map_or(0, |(ptr, guard)| {
            keep(guard);
            ptr
        }),
        stream: comm.stream(),
        _type: PhantomData,
    };
    for step in steps {
        dispatch_step(comm, stream, &bases, step, call.op)?;
    }
    Ok(())
}

/// Where the used buffers start: what each step's [`Piece`]s are cut from.
struct Bases<'s, T> {
    send: CUdeviceptr,
    recv: CUdeviceptr,
    /// The communicator's stream (see [`Piece::stream`]).
    stream: &'s Arc<CudaStream>,
    _type: PhantomData<T>,
}

impl<'s, T> Bases<'s, T> {
    fn piece(&self, seg: Seg) -> Piece<'s, T> {
        let base = match seg.buf {
            Buf::Send => self.send,
            Buf::Recv => self.recv,
        };
        Piece {
            ptr: base + seg.offset as u64 * std::mem::size_of::<T>() as u64,
            len: seg.count,
            stream: self.stream,
            _type: PhantomData,
        }
    }
}

/// Hands one planned step to [`dispatch`] as an ordinary [`Operation`] inside the group.
/// The same pointer as source and destination is how NCCL works in place.
fn dispatch_step<T: NcclType>(
    comm: &Comm,
    stream: &CudaStream,
    bases: &Bases<'_, T>,
    step: Step,
    op: Option<Reduction<'_, T>>,
) -> Result<()> {
    let piece = |seg| bases.piece(seg);
    match step {
        Step::Send { peer, from } => {
            let from = piece(from);
            dispatch(comm, stream, Operation::send(&from, peer), true, drop)
        }
        Step::Recv { peer, into } => {
            let mut into = piece(into);
            dispatch(comm, stream, Operation::recv(&mut into, peer), true, drop)
        }
        Step::Broadcast { root, send, recv } => {
            let send = send.map(piece);
            let send = send.as_ref().map(|p| p as &dyn DevicePtr<T>);
            let mut recv = piece(recv);
            let call = Operation::broadcast(send, &mut recv, root);
            dispatch(comm, stream, call, true, drop)
        }
        Step::Reduce { root, send, recv } => {
            let mut recv = recv.map(piece);
            let recv = recv.as_mut().map(|p| p as &mut dyn DevicePtrMut<T>);
            // Reduce steps are only planned for reduce-scatter, which has a reduction.
            let op = op.ok_or_else(|| Error::invalid("a reduce without a reduction"))?;
            let send = piece(send);
            let call = Operation::reduce(&send, recv, op, root);
            dispatch(comm, stream, call, true, drop)
        }
    }
}

/// A v-collective that passed every local check: its steps, and which buffers they use.
pub(crate) struct Validated {
    steps: Vec<Step>,
    send_used: bool,
    recv_used: bool,
}

/// Every check this rank can make alone, before anything is enqueued: the rules of
/// [`plan`], the library version of each NCCL function used, the stream, the buffers'
/// contexts and the reduction. The checked mode runs it before its exchange, so a rank that
/// would fail here tells the others instead of leaving them to enqueue without it.
pub(crate) fn validate<T: NcclType>(
    comm: &Comm,
    stream: &CudaStream,
    call: &VOperation<'_, T>,
) -> Result<Validated> {
    let kind = call.kind;
    let lib = comm.library();
    let dtype = T::DATA_TYPE;
    lib.require(dtype.name(), dtype.min_version())?;
    comm.check_stream(stream, "the stream")?;
    let (rank, size) = (comm.rank(), comm.size());
    let steps = built(kind, call.construction)
        .and_then(|built| plan(kind, built, &call.args(rank, size)))
        .map_err(|broken| broken.to_error(kind, rank, size))?;
    // Every step's own checks run again in `dispatch`; the ones that could differ between
    // steps (the library version of each NCCL function) are settled here, so a call is
    // either refused whole or enqueued whole.
    for step in &steps {
        lib.require_call(match step {
            Step::Send { .. } => &calls::ncclSend,
            Step::Recv { .. } => &calls::ncclRecv,
            Step::Broadcast { .. } => &calls::ncclBroadcast,
            Step::Reduce { .. } => &calls::ncclReduce,
        })?;
    }
    let uses = |buf: Buf| {
        steps.iter().any(|step| match *step {
            Step::Send { from: seg, .. } | Step::Recv { into: seg, .. } => seg.buf == buf,
            Step::Broadcast { send, recv, .. } => {
                recv.buf == buf || send.is_some_and(|s| s.buf == buf)
            }
            Step::Reduce { send, recv, .. } => {
                send.buf == buf || recv.is_some_and(|r| r.buf == buf)
            }
        })
    };
    let (send_used, recv_used) = (uses(Buf::Send), uses(Buf::Recv));
    if let (true, Some(buf)) = (send_used, &call.send) {
        comm.check_context(buf.stream().context(), "the send buffer")?;
    }
    if let (true, Some(buf)) = (recv_used, &call.recv) {
        comm.check_context(buf.stream().context(), "the receive buffer")?;
    }
    if let Some(op) = &call.op {
        op.raw_for(comm, stream)?;
    }
    Ok(Validated {
        steps,
        send_used,
        recv_used,
    })
}
