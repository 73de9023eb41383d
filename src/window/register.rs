//! Operation registration of windows, alone or several in one NCCL group.
//!
//! NCCL queues the registration as a group task and fills in the window handle when the
//! group ends: at once outside a group on a blocking communicator, from a background job on
//! a nonblocking one (`ncclCommWindowRegister` in `src/dev_runtime.cc`, 2.28 to 2.30.7). The
//! handle's slot therefore lives on the heap and is read only once NCCL is done with it; if
//! NCCL never finishes (a timeout), the slot and the buffer are leaked rather than freed
//! under its feet, and the communicator, still in progress, is aborted before anything else
//! can touch it (a window dropped next would otherwise deregister while NCCL's job still
//! registers; NCCL's deregistration skips its readiness check).

use std::ffi::c_void;

use nccl_sys::ncclWindow_t;

use super::agreement::{agree, finish_rma};
use super::{Window, WindowFlags};
use crate::calls;
use crate::comm::Membership;
use crate::comm::{Comm, JobSlot};
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::memory::NcclBuffer;
use crate::thread_group::{self, RawGroup};

const CALL: &str = calls::ncclCommWindowRegister.name;

/// A failed registration: the error, and the buffers given back.
///
/// `buffers` holds one entry per buffer passed in, in order: `Some` where the buffer is
/// safe to use (NCCL never took it, or was done with it), `None` where it was leaked because
/// NCCL may still map it (a registration that did not finish in time).
pub struct RegisterError<T: NcclType> {
    error: Error,
    buffers: Vec<Option<NcclBuffer<T>>>,
}

impl<T: NcclType> RegisterError<T> {
    fn new(error: Error, buffers: Vec<Option<NcclBuffer<T>>>) -> Self {
        Self { error, buffers }
    }

    /// Every buffer back, with `error`.
    fn returning(error: Error, buffers: Vec<NcclBuffer<T>>) -> Self {
        Self::new(error, buffers.into_iter().map(Some).collect())
    }

    /// What went wrong.
    pub fn error(&self) -> &Error {
        &self.error
    }

    /// The error, dropping (freeing) the buffers.
    pub fn into_error(self) -> Error {
        self.error
    }

    /// The buffers given back, in the order they were passed (`None`: leaked).
    pub fn into_buffers(self) -> Vec<Option<NcclBuffer<T>>> {
        self.buffers
    }

    /// The error and the buffers.
    pub fn into_parts(self) -> (Error, Vec<Option<NcclBuffer<T>>>) {
        (self.error, self.buffers)
    }

    /// The (first) buffer given back, if it was not leaked.
    pub fn into_buffer(self) -> Option<NcclBuffer<T>> {
        self.buffers.into_iter().next().flatten()
    }
}

impl<T: NcclType> std::fmt::Debug for RegisterError<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisterError")
            .field("error", &self.error)
            .field(
                "buffers_returned",
                &self.buffers.iter().filter(|b| b.is_some()).count(),
            )
            .field(
                "buffers_leaked",
                &self.buffers.iter().filter(|b| b.is_none()).count(),
            )
            .finish()
    }
}

impl<T: NcclType> std::fmt::Display for RegisterError<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl<T: NcclType> std::error::Error for RegisterError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl<T: NcclType> From<RegisterError<T>> for Error {
    fn from(err: RegisterError<T>) -> Error {
        err.error
    }
}

/// A heap slot NCCL writes a window handle into, possibly after the call has returned
/// (read only once NCCL is done with it: [`JobSlot::read`]'s contract).
type Slot = JobSlot<ncclWindow_t>;

/// A slot holding a null handle, which is what NCCL leaves where it registers nothing.
fn new_slot() -> Slot {
    JobSlot::new(std::ptr::null_mut())
}

/// What must hold on this rank before it can take part in the registration at all. These
/// are rank-local (the library, an open group, a failed communicator) and are the caller's
/// to keep the same on every rank: a rank refused here leaves its peers waiting in the
/// exchange, as NCCL's own registration would.
fn precheck(comm: &Comm) -> Result<()> {
    comm.library()
        .require_call(&calls::ncclCommWindowRegister)?;
    thread_group::ensure_outside(CALL)?;
    // Checked up front as well as under the lock of the call: in a group, a communicator
    // refused halfway would leave the registrations already queued waiting for its rank.
    // A failed or suspended one is refused before the ranks' agreement exchange.
    comm.usable(&calls::ncclCommWindowRegister).map(drop)
}

fn no_window() -> Error {
    Error::Unavailable {
        api: CALL,
        reason: "NCCL registered no window: this communicator has no symmetric-memory \
                 support (NCCL 2.29.2 and later report that as success with a NULL window; \
                 NCCL_DEBUG=INFO says why, e.g. CUDA VMM disabled or GPUs that cannot map \
                 each other's memory)"
            .into(),
    }
}

/// Hands one registration to NCCL (inside a group or not); the returned flag says whether
/// the communicator is still working on it.
fn issue<T: NcclType>(
    comm: &Comm,
    buffer: &NcclBuffer<T>,
    flags: WindowFlags,
    slot: &Slot,
) -> Result<bool> {
    let lib = comm.library();
    buffer.stream.context().bind_to_thread()?;
    let bytes = buffer.len * std::mem::size_of::<T>();
    let out = slot.as_ptr();
    let status = comm.with_raw(&calls::ncclCommWindowRegister, |raw| {
        // SAFETY: live communicator under its lock; the buffer is `bytes` of VMM memory on its
        // device, owned by the caller until NCCL is done with it; `out` stays allocated until
        // NCCL can no longer write it (see `Slot`); the flags were checked against the
        // library.
        unsafe {
            lib.api().ncclCommWindowRegister(
                raw,
                buffer.ptr as *mut c_void,
                bytes,
                out,
                flags.bits() as std::os::raw::c_int,
            )
        }
    })?;
    lib.check_pending(CALL, status)
}

/// Says what a registration that never settled waits for.
fn not_settled(rank: usize, err: Error) -> Error {
    match err {
        Error::Timeout { waited, .. } => Error::Timeout {
            what: format!(
                "{CALL} on rank {rank} to complete (every rank must register, in the same \
                 order as its other collective calls); the buffer was leaked, as NCCL may \
                 still register it"
            ),
            waited,
        },
        other => other,
    }
}

impl Comm {
    /// Registers `buffer` as a window on this communicator (`ncclCommWindowRegister`, NCCL
    /// 2.27). Operation: every rank calls it. See the [module docs](crate::window).
    ///
    /// On NCCL 2.29 and 2.30 the first registration on a communicator also takes one-sided
    /// RMA's set-up step, on every rank together, where every rank can; where not, the window
    /// registers all the same and RMA calls on the communicator are refused with
    /// [`Error::Unavailable`] (see [`rma`](crate::window::rma#setting-rma-up-every-rank-at-once)).
    ///
    /// On failure the buffer comes back inside the [`RegisterError`] (which converts into
    /// [`Error`] with `?`), unless NCCL may still be registering it. A nonblocking
    /// registration that does not finish within [`Comm::ready_timeout`] aborts the
    /// communicator (its windows are then freed by NCCL) and leaks the buffer.
    ///
    /// Left to the caller: the same NCCL settings on every rank. NCCL decides per process
    /// whether a communicator has symmetric memory (`NCCL_WIN_ENABLE`, `NCCL_CUMEM_ENABLE`,
    /// from 2.29 the network plugin's GIN support: `symmetricSupport`, `src/init.cc`); a
    /// rank without it gets the NULL window ([`Error::Unavailable`]) at once, without
    /// joining, while ranks with it wait in the registration for it. This crate cannot
    /// see NCCL's verdict before registering, so the exchange above does not cover it.
    pub fn register_window<T: NcclType>(
        &self,
        buffer: NcclBuffer<T>,
        flags: WindowFlags,
    ) -> std::result::Result<Window<'_, T>, RegisterError<T>> {
        let agreed = match precheck(self)
            .and_then(|()| agree(&[self], std::slice::from_ref(&buffer), flags))
        {
            Ok(agreed) => agreed,
            Err(err) => return Err(RegisterError::returning(err, vec![buffer])),
        };
        let slot = new_slot();
        let pending = match issue(self, &buffer, flags, &slot) {
            Ok(pending) => pending,
            // NCCL returned an error: its own failure path cleared the slot and nothing runs
            // in the background.
            Err(err) => return Err(RegisterError::returning(err, vec![buffer])),
        };
        // A nonblocking communicator registers in NCCL's background job, which writes the
        // slot later; NCCL 2.28 even returns success for it (`ncclCommWindowRegister` lets
        // the group's `ncclInProgress` through its check and returns its own `ncclSuccess`),
        // so the wait must not depend on the status.
        if pending || !self.is_blocking() {
            if let Err(err) = self.wait_ready(self.ready_timeout()) {
                // Still in progress, the communicator is aborted before anything else can
                // touch it (a dropped earlier window would deregister while NCCL's job
                // still registers this one).
                let err = self.abandon_in_progress(not_settled(self.rank(), err));
                slot.abandon();
                std::mem::forget(buffer);
                return Err(RegisterError::new(err, vec![None]));
            }
        }
        // SAFETY: NCCL is done with the slot: a blocking registration filled it before
        // returning, and a nonblocking one's communicator has settled (waited for above).
        let raw = unsafe { slot.read() };
        if raw.is_null() {
            // No symmetric memory here: the NULL window, returned at once. Ranks whose NCCL
            // settings differ may not all get it (see the docs above).
            return Err(RegisterError::returning(no_window(), vec![buffer]));
        }
        let rma_done = finish_rma(&[self], &agreed);
        let Some(agreed) = agreed.into_iter().next() else {
            return Err(RegisterError::returning(no_window(), vec![buffer]));
        };
        let window = Window::new(self, raw, buffer, flags, agreed.peer_bytes, agreed.host_rma);
        match rma_done {
            Ok(()) => Ok(window),
            // Registered, but the set-up every rank took failed: give the buffer back.
            Err(err) => match window.close() {
                Ok(buffer) => Err(RegisterError::returning(err, vec![buffer])),
                Err((window, _)) => {
                    drop(window);
                    Err(RegisterError::new(err, vec![None]))
                }
            },
        }
    }

    /// Registers `buffers[i]` as a window on `comms[i]`, for every `i`, in one NCCL group:
    /// how one thread driving several communicators (from [`Comm::init_all`]) registers,
    /// since a registration blocks until every rank has joined it.
    ///
    /// Every window is valid when this returns: NCCL fills them in when the group ends, and
    /// nonblocking communicators are waited for (each for at most its
    /// [`Comm::ready_timeout`]; one still in progress then is aborted, the others still
    /// waited for). On failure no window is kept: the buffers come back in the
    /// [`RegisterError`], except those NCCL may still be registering.
    pub fn register_windows<'c, T: NcclType>(
        comms: &'c [Comm],
        buffers: Vec<NcclBuffer<T>>,
        flags: WindowFlags,
    ) -> std::result::Result<Vec<Window<'c, T>>, RegisterError<T>> {
        if let Err(err) = check_all(comms, &buffers) {
            return Err(RegisterError::returning(err, buffers));
        }
        let Some(first) = comms.first() else {
            return Ok(Vec::new());
        };
        let all: Vec<&Comm> = comms.iter().collect();
        let agreed = match agree(&all, &buffers, flags) {
            Ok(agreed) => agreed,
            Err(err) => return Err(RegisterError::returning(err, buffers)),
        };
        // Aborts from other threads wait until the group has ended (see `crate::fault`):
        // entered before it starts, so it is left after the group ended, also on an early
        // return.
        let mut membership = Membership::enter(comms.iter());
        let mut raw_group = match RawGroup::start(first.library()) {
            Ok(group) => group,
            Err(err) => return Err(RegisterError::returning(err, buffers)),
        };
        let slots: Vec<Slot> = comms.iter().map(|_| new_slot()).collect();
        let mut issued = 0;
        let mut failure = None;
        for ((comm, buffer), slot) in comms.iter().zip(&buffers).zip(&slots) {
            match issue(comm, buffer, flags, slot) {
                Ok(_) => issued += 1,
                Err(err) => {
                    failure = Some(err);
                    break;
                }
            }
        }
        let ended = raw_group.end();
        let deferred = membership.leave(CALL);
        let pending = match ended {
            Ok(pending) => pending,
            Err(err) => {
                failure.get_or_insert(err);
                false
            }
        };
        if let Some(err) = deferred {
            failure.get_or_insert(err);
        }
        // As in `register_window`: nonblocking registrations finish in NCCL's job whatever
        // the status said. Every communicator is waited for (and aborted if it stays in
        // progress), so none is left with NCCL's job running when this returns.
        let mut unsettled = vec![false; comms.len()];
        let mut stalled = None;
        if pending || !first.is_blocking() {
            for (i, comm) in comms.iter().enumerate().take(issued) {
                if let Err(err) = comm.wait_ready(comm.ready_timeout()) {
                    unsettled[i] = true;
                    stalled.get_or_insert(comm.abandon_in_progress(not_settled(comm.rank(), err)));
                }
            }
        }
        if let Some(error) = stalled {
            // NCCL may still write the slot and map the buffer of a communicator that did not
            // settle: those are leaked, the rest given back (a settled communicator's window
            // is deregistered, which is local).
            let mut kept = Vec::with_capacity(buffers.len());
            for (i, ((comm, buffer), slot)) in comms.iter().zip(buffers).zip(slots).enumerate() {
                if unsettled[i] {
                    slot.abandon();
                    std::mem::forget(buffer);
                    kept.push(None);
                    continue;
                }
                // SAFETY: this communicator settled (or was never given the slot), so no
                // job of NCCL writes it any more.
                let raw = unsafe { slot.read() };
                if i >= issued || raw.is_null() {
                    kept.push(Some(buffer));
                } else {
                    let window = Window::new(comm, raw, buffer, flags, Vec::new(), None);
                    kept.push(window.close().ok());
                }
            }
            return Err(RegisterError::new(error, kept));
        }
        // SAFETY: every communicator settled (none stalled above) and the group has ended, so
        // NCCL is done with every slot; the slots it was never given hold null.
        let handles: Vec<ncclWindow_t> = slots.iter().map(|slot| unsafe { slot.read() }).collect();
        if failure.is_none() && handles.iter().any(|raw| raw.is_null()) {
            failure = Some(no_window());
        }
        if failure.is_none() {
            if let Err(err) = finish_rma(&all, &agreed) {
                failure = Some(err);
            }
        }
        let mut agreed = agreed.into_iter();
        let mut windows = Vec::with_capacity(comms.len());
        let mut returned = Vec::new();
        for ((comm, buffer), raw) in comms.iter().zip(buffers).zip(handles) {
            let (peers, host) = agreed
                .next()
                .map_or((Vec::new(), None), |a| (a.peer_bytes, a.host_rma));
            if raw.is_null() {
                returned.push(Some(buffer));
            } else if failure.is_some() {
                // Registered, but the rest failed: deregister (local) and give it back.
                let window = Window::new(comm, raw, buffer, flags, peers, host);
                returned.push(window.close().ok());
            } else {
                windows.push(Window::new(comm, raw, buffer, flags, peers, host));
            }
        }
        match failure {
            Some(error) => Err(RegisterError::new(error, returned)),
            None => Ok(windows),
        }
    }
}

/// The checks of [`Comm::register_windows`] that need no NCCL call and come before the
/// exchange (see [`precheck`]).
fn check_all<T: NcclType>(comms: &[Comm], buffers: &[NcclBuffer<T>]) -> Result<()> {
    if comms.len() != buffers.len() {
        return Err(Error::invalid(format!(
            "register_windows got {} communicators and {} buffers",
            comms.len(),
            buffers.len()
        )));
    }
    if let Some(first) = comms.first() {
        if comms.iter().any(|c| c.is_blocking() != first.is_blocking()) {
            return Err(Error::invalid(
                "NCCL does not allow blocking and nonblocking communicators in one group",
            ));
        }
    }
    comms.iter().try_for_each(precheck)
}

#[cfg(test)]
mod tests;
