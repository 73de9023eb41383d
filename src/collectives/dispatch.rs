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
use super::rules::{check_config_kind, check_plan, check_self_p2p, Plan, Ptr};
use crate::calls::Call;
use crate::coll_config::CollConfig;
use crate::comm::Comm;
use crate::diagnostics::flight::{OpKind, RawKind, RawOp, NO_RANK};
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
    let to = Target {
        comm,
        stream,
        in_group,
    };
    match call.config {
        None => validate_and_call(to, call, keep, Plain),
        Some(config) => dispatch_configured(to, call, keep, config),
    }
}

/// Where an operation goes: the communicator, the stream, and whether a group is open on
/// this thread (then an in-progress result is left for the group's end).
#[derive(Clone, Copy)]
struct Target<'b> {
    comm: &'b Comm,
    stream: &'b CudaStream,
    in_group: bool,
}

/// [`dispatch`] for an operation with a [`CollConfig`]: refuses it on send and receive,
/// builds the raw struct for the loaded library (version gates and field checks live in
/// [`CollConfig::to_raw`]) and keeps it alive until NCCL has returned; what its pointers
/// refer to lives in the borrowed `config`.
#[cold]
#[inline(never)]
fn dispatch_configured<'b, 'a: 'b, T: NcclType>(
    to: Target<'b>,
    call: Operation<'a, T>,
    keep: impl FnOnce(Guards<'b>),
    config: &CollConfig<'_>,
) -> Result<()> {
    let (comm, kind) = (to.comm, call.kind);
    let call_row = check_config_kind(kind)
        .map_err(|broken| broken.to_error(kind, comm.rank(), comm.size()))?;
    let raw = config.to_raw(comm)?;
    let entry = Configured {
        call: call_row,
        config: raw.as_ptr(),
        copy_engine: config.copy_engine(comm),
    };
    // `raw` lives to the end of this function: NCCL copies the struct during the call, but
    // keeps its `algSelection` pointer (and may parse it again at ncclGroupEnd, NCCL 2.31's
    // rearchitected enqueue): that string lives in `config`, which the operation borrows
    // until it is enqueued or its group has ended.
    validate_and_call(to, call, keep, entry)
}

/// Validates `call` completely, calls NCCL through `entry`, completes the call and hands
/// the guards to `keep`: everything [`dispatch`] does, written once for both NCCL entry
/// points. Each step is inlined, so the whole path stays one straight run of code.
#[inline(always)]
fn validate_and_call<'b, 'a: 'b, T: NcclType>(
    to: Target<'b>,
    call: Operation<'a, T>,
    keep: impl FnOnce(Guards<'b>),
    entry: impl Entry,
) -> Result<()> {
    let Target {
        comm,
        stream,
        in_group,
    } = to;
    let kind = call.kind;
    check_library_and_stream::<T>(comm, stream, kind)?;
    let plan = check_rules(comm, &call, in_group, entry.copy_engine(comm))?;
    let used = Used::by(plan);
    check_buffer_contexts(comm, &call, used)?;
    let op = match &call.op {
        Some(op) => op.raw_for(comm, stream)?,
        None => nccl_sys::ncclRedOp_t::ncclSum,
    };

    // Validation is over: take the device pointers (this orders the stream after earlier
    // work on the buffers) and call NCCL. Taken here, not in a helper: guards returned from
    // one stayed in memory in builds that unwind, a few dozen instructions more per call.
    let (send_base, send_guard) = match (used.send, call.send) {
        (true, Some(held)) => {
            let (ptr, guard) = held.buf.device_ptr(stream);
            (ptr, Some(guard))
        }
        _ => (0, None),
    };
    let (recv_base, recv_guard) = match (used.recv, call.recv) {
        (true, Some(held)) => {
            let (ptr, guard) = held.buf.device_ptr_mut(stream);
            (ptr, Some(guard))
        }
        _ => (0, None),
    };
    let args = Args::at::<T>(plan, send_base, recv_base, op, stream);
    call_nccl(comm, stream, kind, args, in_group, entry)?;
    keep([send_guard, recv_guard]);
    Ok(())
}

/// The loaded library has the operation's function and element type, and `stream` is in
/// the communicator's context.
#[inline(always)]
fn check_library_and_stream<T: NcclType>(
    comm: &Comm,
    stream: &CudaStream,
    kind: Kind,
) -> Result<()> {
    let lib = comm.library();
    lib.require_call(kind.call())?;
    let dtype = T::DATA_TYPE;
    lib.require(dtype.name(), dtype.min_version())?;
    comm.check_stream(stream, "the stream")
}

/// NCCL's count and buffer rules for this rank (see [`check_plan`]), and no send or receive
/// to this rank itself outside a group.
#[inline(always)]
fn check_rules<T: NcclType>(
    comm: &Comm,
    call: &Operation<'_, T>,
    in_group: bool,
    copy_engine: bool,
) -> Result<Plan> {
    let (kind, rank, size) = (call.kind, comm.rank(), comm.size());
    check_plan(
        kind,
        rank,
        size,
        call.send.as_ref().map(|b| b.len),
        call.recv.as_ref().map(|b| b.len),
        call.in_place,
        copy_engine,
    )
    .and_then(|plan| check_self_p2p(kind, rank, in_group).map(|()| plan))
    .map_err(|broken| broken.to_error(kind, rank, size))
}

/// Which of the operation's buffers the plan hands to NCCL: only those are checked and
/// have their pointers taken.
#[derive(Clone, Copy)]
struct Used {
    send: bool,
    recv: bool,
}

impl Used {
    #[inline(always)]
    fn by(plan: Plan) -> Self {
        let uses = |ptr: Ptr, send: bool| match ptr {
            Ptr::Send(_) => send,
            Ptr::Recv(_) => !send,
            Ptr::Null => false,
        };
        Used {
            send: uses(plan.send, true) || uses(plan.recv, true),
            recv: uses(plan.send, false) || uses(plan.recv, false),
        }
    }
}

/// Every buffer handed to NCCL lies in the communicator's context.
#[inline(always)]
fn check_buffer_contexts<T: NcclType>(
    comm: &Comm,
    call: &Operation<'_, T>,
    used: Used,
) -> Result<()> {
    if used.send {
        if let Some(held) = &call.send {
            let ctx = || held.buf.stream().context();
            comm.check_context_of(held.context, ctx, "the send buffer")?;
        }
    }
    if used.recv {
        if let Some(held) = &call.recv {
            let ctx = || held.buf.stream().context();
            comm.check_context_of(held.context, ctx, "the receive buffer")?;
        }
    }
    Ok(())
}

/// Calls NCCL through `entry` under the communicator's lock, records the operation in the
/// communicator's flight recorder while still holding it (the recorder's only hook: every
/// operation handed to NCCL passes here exactly once), then completes the call (in a group,
/// an in-progress result is left for the group's end, which also notes the stream).
///
/// Outside a group, a stream other than the communicator's own is noted once the call is
/// complete (launched, for a nonblocking communicator too), also after an error, which may
/// have left part of the work enqueued: recording on a stream is always harmless then, and
/// ending the communicator must wait for, or abort, whatever runs there.
#[inline(always)]
fn call_nccl(
    comm: &Comm,
    stream: &CudaStream,
    kind: Kind,
    args: Args,
    in_group: bool,
    entry: impl Entry,
) -> Result<()> {
    let lib = comm.library();
    let row = entry.call(kind);
    let mut state = comm.usable(row)?;
    // SAFETY: every pointer lies inside a buffer on the communicator's device whose length
    // was checked against `count` and the rank/root offsets (`validate_and_call`); the
    // buffers stay borrowed (and alive) at least until the work is enqueued, and their
    // events are recorded afterwards by the guards; the handle is live under the comm's
    // lock, held until NCCL has returned; a configuration is `Configured`'s, whose raw
    // struct `dispatch_configured` keeps alive across this call.
    let status = unsafe { invoke(lib.api(), kind, args, state.ptr, entry.config()) };
    let refused = !matches!(
        status,
        Ok(ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress)
    );
    state.record_op(flight_op(kind, &args, in_group, refused));
    drop(state);
    if in_group {
        return lib.check_pending(row.name, status).map(drop);
    }
    let completed = comm.complete(row, status);
    comm.note_stream(stream);
    completed
}

/// The flight recorder's view of an operation (see [`crate::diagnostics::flight`]).
#[inline(always)]
fn flight_op(kind: Kind, args: &Args, in_group: bool, refused: bool) -> RawOp {
    // Roots and peers were checked against the communicator size, which fits a C int.
    let (op_kind, rank) = match kind {
        Kind::AllReduce => (OpKind::AllReduce, NO_RANK),
        Kind::Broadcast { root } => (OpKind::Broadcast, root as u32),
        Kind::Reduce { root } => (OpKind::Reduce, root as u32),
        Kind::AllGather => (OpKind::AllGather, NO_RANK),
        Kind::ReduceScatter => (OpKind::ReduceScatter, NO_RANK),
        Kind::AllToAll => (OpKind::AllToAll, NO_RANK),
        Kind::Gather { root } => (OpKind::Gather, root as u32),
        Kind::Scatter { root } => (OpKind::Scatter, root as u32),
        Kind::Send { peer } => (OpKind::Send, peer as u32),
        Kind::Recv { peer } => (OpKind::Recv, peer as u32),
    };
    RawOp {
        kind: RawKind {
            tag: op_kind.tag(),
            rank,
        },
        collective: op_kind.is_collective(),
        count: args.count,
        // Data types number 0 to 11; any larger raw value reads back as unknown.
        dtype: args.datatype.0.min(255) as u8,
        op: args.op.0.min(255) as u8,
        stream: args.stream as u64,
        in_group,
        refused,
    }
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

impl Args {
    /// The arguments of `plan`, its pointers taken from the buffers starting at `send_base`
    /// and `recv_base` (0 where a buffer is not used).
    #[inline(always)]
    fn at<T: NcclType>(
        plan: Plan,
        send_base: u64,
        recv_base: u64,
        op: ncclRedOp_t,
        stream: &CudaStream,
    ) -> Self {
        let elem = std::mem::size_of::<T>() as u64;
        let address = |ptr: Ptr| -> *mut c_void {
            match ptr {
                Ptr::Null => std::ptr::null_mut(),
                Ptr::Send(offset) => (send_base + offset as u64 * elem) as *mut c_void,
                Ptr::Recv(offset) => (recv_base + offset as u64 * elem) as *mut c_void,
            }
        };
        Args {
            send: address(plan.send) as *const c_void,
            recv: address(plan.recv),
            count: plan.count,
            datatype: T::DATA_TYPE.raw(),
            op,
            stream: stream.cu_stream() as cudaStream_t,
        }
    }
}

/// Which NCCL entry point a validated operation goes to: the plain function or its
/// `*Config` variant.
trait Entry {
    /// The NCCL function called for `kind`.
    fn call(&self, kind: Kind) -> &'static Call;

    /// Whether NCCL may take its copy-engine path for this call (the rules in
    /// [`check_plan`] depend on it).
    fn copy_engine(&self, comm: &Comm) -> bool;

    /// The raw configuration the `*Config` variant takes; `None` for the plain function.
    fn config(&self) -> Option<*const ncclCollConfig_t>;
}

/// Roots and peers were checked against the communicator size, which fits a C int.
#[inline(always)]
fn int(value: usize) -> c_int {
    value as c_int
}

/// `Some(the row)` where a kind has a `*Config` variant, `None` where it has none.
macro_rules! config_row {
    () => {
        None
    };
    ($row:ident) => {
        Some(&crate::calls::$row)
    };
}

/// The `*Config` call where a kind has one; NCCL's own answer to a bad argument where it has
/// none (refused by `check_config_kind` before anything was taken, so never reached; should
/// that ever change, an error rather than a panic).
macro_rules! call_configured_or_refuse {
    ($api:ident, [], ($($arg:expr),*), $config:ident) => {
        Ok(ncclResult_t::ncclInvalidArgument)
    };
    ($api:ident, [$function:ident], ($($arg:expr),*), $config:ident) => {
        $api.$function($($arg,)* $config)
    };
}

/// The table of entry points: one row per operation kind, with its NCCL function, the
/// `*Config` variant where NCCL has one, and the arguments both take (the variant adds the
/// configuration last). Writes `Kind::call`, `Kind::config_call` and `invoke`, which calls
/// NCCL, from it, so every fact about a kind's call stands in its row.
macro_rules! entry_points {
    (
        |$api:ident, $comm:ident, $args:pat, $config:ident|
        $($kind:pat => $plain:ident $(| $configured:ident)? ($($arg:expr),*);)*
    ) => {
        // The rows bind roots and peers that the name lookups do not use.
        #[allow(unused_variables)]
        impl Kind {
            /// The NCCL function the operation calls (its row in [`calls`](crate::calls)).
            #[inline]
            pub(crate) fn call(self) -> &'static Call {
                match self {
                    $($kind => &crate::calls::$plain,)*
                }
            }

            /// The `*Config` variant NCCL 2.31 has for the collective; none for send and
            /// receive, which take no configuration.
            pub(crate) fn config_call(self) -> Option<&'static Call> {
                match self {
                    $($kind => config_row!($($configured)?),)*
                }
            }
        }

        /// Calls `kind`'s NCCL function: the plain one without `config`, the `*Config`
        /// variant with it. For the plain functions `config` is a constant `None`, and the
        /// other half of the match folds away.
        ///
        /// # Safety
        ///
        /// `args` must have passed [`validate_and_call`]'s checks for `kind`, with the
        /// buffers alive; `comm` must be a live handle, held under the communicator's lock;
        /// `config` must point to a struct built by `CollConfig::to_raw` for the loaded
        /// library, alive until after this call.
        // Send and receive bind a peer their refusal under a configuration does not use.
        #[allow(unused_variables)]
        #[inline(always)]
        unsafe fn invoke(
            $api: &NcclLib,
            kind: Kind,
            $args: Args,
            $comm: ncclComm_t,
            config: Option<*const ncclCollConfig_t>,
        ) -> std::result::Result<ncclResult_t, MissingSymbol> {
            // SAFETY: forwarded from our caller (see above).
            unsafe {
                match config {
                    None => match kind {
                        $($kind => $api.$plain($($arg),*),)*
                    },
                    Some($config) => match kind {
                        $($kind => call_configured_or_refuse!(
                            $api, [$($configured)?], ($($arg),*), $config
                        ),)*
                    },
                }
            }
        }
    };
}

entry_points! {
    |api, comm, Args { send, recv, count, datatype: dt, op, stream: s }, config|
    Kind::AllReduce => ncclAllReduce | ncclAllReduceConfig (send, recv, count, dt, op, comm, s);
    Kind::Broadcast { root } => ncclBroadcast | ncclBroadcastConfig (send, recv, count, dt, int(root), comm, s);
    Kind::Reduce { root } => ncclReduce | ncclReduceConfig (send, recv, count, dt, op, int(root), comm, s);
    Kind::AllGather => ncclAllGather | ncclAllGatherConfig (send, recv, count, dt, comm, s);
    Kind::ReduceScatter => ncclReduceScatter | ncclReduceScatterConfig (send, recv, count, dt, op, comm, s);
    Kind::AllToAll => ncclAlltoAll | ncclAlltoAllConfig (send, recv, count, dt, comm, s);
    Kind::Gather { root } => ncclGather | ncclGatherConfig (send, recv, count, dt, int(root), comm, s);
    Kind::Scatter { root } => ncclScatter | ncclScatterConfig (send, recv, count, dt, int(root), comm, s);
    Kind::Send { peer } => ncclSend (send, count, dt, int(peer), comm, s);
    Kind::Recv { peer } => ncclRecv (recv, count, dt, int(peer), comm, s);
}

/// The plain functions: `ncclAllReduce` ... `ncclRecv`.
struct Plain;

impl Entry for Plain {
    #[inline(always)]
    fn call(&self, kind: Kind) -> &'static Call {
        kind.call()
    }

    #[inline(always)]
    fn copy_engine(&self, comm: &Comm) -> bool {
        comm.copy_engine()
    }

    #[inline(always)]
    fn config(&self) -> Option<*const ncclCollConfig_t> {
        None
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

impl Entry for Configured {
    fn call(&self, _kind: Kind) -> &'static Call {
        self.call
    }

    fn copy_engine(&self, _comm: &Comm) -> bool {
        self.copy_engine
    }

    fn config(&self) -> Option<*const ncclCollConfig_t> {
        Some(self.config)
    }
}
