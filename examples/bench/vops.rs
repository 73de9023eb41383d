//! Issuing the v-collectives (`all_to_all_v`, `all_gather_v`, `reduce_scatter_v`) through
//! the safe API, and through raw nccl-sys calls built the way the library builds them (the
//! same NCCL calls, in the same order, in one group), so the safe/raw ratio isolates the
//! binding: validation, planning and the owned layouts each call takes.

use std::ffi::c_void;
use std::os::raw::c_int;

use cudarc::driver::sys::CUdeviceptr;
use nccl::{Comm, Construction, VOperation};

use crate::coll::Coll;
use crate::elem::Elem;
use crate::ops::{check_range, offset_bytes, raw_check, Buffers, Issuer, RawComm};
use crate::BenchResult;

fn no_shape() -> Box<dyn std::error::Error + Send + Sync> {
    "internal error: a v-collective without its split matrix".into()
}

/// The safe API: one `Comm::enqueue_v` of the operation on buffers from `shift`. The
/// layouts are cloned because a `VOperation` owns them, as every caller's must.
pub fn issue_safe<T: Elem>(
    issuer: &Issuer,
    comm: &Comm,
    b: &mut Buffers<'_, T>,
    in_place: bool,
    shift: usize,
) -> BenchResult<()> {
    let layout = &issuer.layout;
    let v = layout.v.as_deref().ok_or_else(no_shape)?;
    let (send_len, recv_len, op) = (layout.send_len, layout.recv_len, issuer.op);
    match (issuer.coll, in_place) {
        (Coll::AllToAllV, _) => comm.enqueue_v(VOperation::all_to_all_v(
            &b.send.part(shift, send_len)?,
            v.send.clone(),
            &mut b.recv.part_mut(shift, recv_len)?,
            v.recv.clone(),
        ))?,
        (Coll::AllGatherV, false) => comm.enqueue_v(
            VOperation::all_gather_v(
                &b.send.part(shift, send_len)?,
                &mut b.recv.part_mut(shift, recv_len)?,
                v.recv.clone(),
            )
            .construction(issuer.construction),
        )?,
        (Coll::AllGatherV, true) => comm.enqueue_v(
            VOperation::all_gather_v_in_place(
                &mut b.recv.part_mut(shift, recv_len)?,
                v.recv.clone(),
            )
            .construction(issuer.construction),
        )?,
        (Coll::ReduceScatterV, false) => comm.enqueue_v(VOperation::reduce_scatter_v(
            &b.send.part(shift, send_len)?,
            v.send.clone(),
            &mut b.recv.part_mut(shift, recv_len)?,
            op,
        ))?,
        (Coll::ReduceScatterV, true) => comm.enqueue_v(VOperation::reduce_scatter_v_in_place(
            &mut b.recv.part_mut(shift, send_len)?,
            v.send.clone(),
            op,
        ))?,
        (other, _) => {
            return Err(format!("internal error: {} is not a v-collective", other.name()).into())
        }
    }
    Ok(())
}

/// Raw nccl-sys calls, as a C program would build the operation (and as the library's plan
/// does): all-to-all-v as one send and one receive per peer with data; all-gather-v as one
/// broadcast per root with data (or, `--construction p2p`, this rank's segment sent to every
/// peer and every segment received); reduce-scatter-v as one reduce per root with data;
/// zero-count transfers skipped; all in one group.
pub fn issue_raw<T: Elem>(
    issuer: &Issuer,
    b: &Buffers<'_, T>,
    in_place: bool,
    shift: usize,
) -> BenchResult<()> {
    let layout = &issuer.layout;
    let v = layout.v.as_deref().ok_or_else(no_shape)?;
    // Every segment lies within `span` elements from `shift`, as the safe path validates.
    check_range(b.len(), shift, layout.span)?;
    let (send_base, recv_base) = b.raw_ptrs();
    let at = |base: CUdeviceptr, elements: usize| {
        (base + offset_bytes::<T>(shift + elements)) as *mut c_void
    };
    let RawComm { lib, comm, stream } = *issuer.raw();
    let dtype = T::DATA_TYPE.raw();
    let op = issuer.op.raw();
    let (me, n) = (issuer.rank, issuer.n);
    // As the library settles `Auto` for all_gather_v: grouped send/receive.
    let p2p_gather = issuer.construction != Construction::Collective;
    // SAFETY: `comm` and `stream` are this rank's live communicator and stream (see
    // `Issuer::new`); every pointer lies inside a buffer of this rank's device with its
    // segment's count of elements past it (the layouts are packed within `span`, checked
    // above); off the root, a broadcast's send pointer is its receive pointer and a
    // reduce's receive pointer is null, both ignored by NCCL; the buffers stay alive and
    // untouched by anything else until the stream is waited for.
    let call = |peer: usize, kind: Raw| unsafe {
        let peer_int = peer as c_int;
        match kind {
            Raw::Send(from, count) => (
                "ncclSend",
                lib.ncclSend(from, count, dtype, peer_int, comm, stream),
            ),
            Raw::Recv(into, count) => (
                "ncclRecv",
                lib.ncclRecv(into, count, dtype, peer_int, comm, stream),
            ),
            Raw::Broadcast(from, into, count) => (
                "ncclBroadcast",
                lib.ncclBroadcast(from, into, count, dtype, peer_int, comm, stream),
            ),
            Raw::Reduce(from, into, count) => (
                "ncclReduce",
                lib.ncclReduce(from, into, count, dtype, op, peer_int, comm, stream),
            ),
        }
    };
    let issue_all = || -> BenchResult<()> {
        let issue = |peer, kind| {
            let (name, status) = call(peer, kind);
            raw_check(name, status)
        };
        match issuer.coll {
            Coll::AllToAllV => {
                for peer in 0..n {
                    let (sc, rc) = (v.send.counts()[peer], v.recv.counts()[peer]);
                    if sc > 0 {
                        issue(peer, Raw::Send(at(send_base, v.send.displs()[peer]), sc))?;
                    }
                    if rc > 0 {
                        issue(peer, Raw::Recv(at(recv_base, v.recv.displs()[peer]), rc))?;
                    }
                }
            }
            Coll::AllGatherV => {
                let mine = v.recv.counts()[me];
                let own = if in_place {
                    at(recv_base, v.recv.displs()[me])
                } else {
                    at(send_base, 0)
                };
                for peer in 0..n {
                    let (count, into) =
                        (v.recv.counts()[peer], at(recv_base, v.recv.displs()[peer]));
                    if p2p_gather {
                        if peer == me && in_place {
                            continue;
                        }
                        if mine > 0 {
                            issue(peer, Raw::Send(own, mine))?;
                        }
                        if count > 0 {
                            issue(peer, Raw::Recv(into, count))?;
                        }
                    } else if count > 0 {
                        let from = if peer == me { own } else { into };
                        issue(peer, Raw::Broadcast(from, into, count))?;
                    }
                }
            }
            Coll::ReduceScatterV => {
                let input = if in_place { recv_base } else { send_base };
                for root in 0..n {
                    let count = v.send.counts()[root];
                    if count == 0 {
                        continue;
                    }
                    let from = at(input, v.send.displs()[root]);
                    let into = match (root == me, in_place) {
                        (true, true) => from,
                        (true, false) => at(recv_base, 0),
                        (false, _) => std::ptr::null_mut(),
                    };
                    issue(root, Raw::Reduce(from, into, count))?;
                }
            }
            other => {
                return Err(
                    format!("internal error: {} is not a v-collective", other.name()).into(),
                )
            }
        }
        Ok(())
    };
    // SAFETY: a group bracket has no arguments; it is ended whatever happens inside it.
    raw_check("ncclGroupStart", unsafe { lib.ncclGroupStart() })?;
    let issued = issue_all();
    // SAFETY: ends the group started above.
    let ended = unsafe { lib.ncclGroupEnd() };
    issued?;
    raw_check("ncclGroupEnd", ended)
}

/// One raw NCCL call of a v-collective (pointers and count; the peer or root comes beside).
#[derive(Clone, Copy)]
enum Raw {
    Send(*mut c_void, usize),
    Recv(*mut c_void, usize),
    Broadcast(*mut c_void, *mut c_void, usize),
    Reduce(*mut c_void, *mut c_void, usize),
}
