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

use super::{rma, Window, WindowFlags, REQUIRED_ALIGNMENT};
use crate::calls;
use crate::collectives::Operation;
use crate::comm::Comm;
use crate::comm::Membership;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::group::Group;
use crate::memory::NcclBuffer;
use crate::release::Version;
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

/// A heap slot NCCL writes a window handle into, possibly after the call has returned.
struct Slot(*mut ncclWindow_t);

impl Slot {
    fn new() -> Self {
        Slot(Box::into_raw(Box::new(std::ptr::null_mut())))
    }

    fn as_ptr(&self) -> *mut ncclWindow_t {
        self.0
    }

    /// The handle, once NCCL can no longer write it.
    fn read(&self) -> ncclWindow_t {
        // SAFETY: the slot came from Box::into_raw and lives until dropped; callers read it
        // only after NCCL finished the registration (the group ended and the communicator
        // settled), so nothing writes it concurrently.
        unsafe { *self.0 }
    }

    /// Keeps the slot allocated forever: NCCL may still write it.
    fn leak(self) {
        std::mem::forget(self);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // SAFETY: from Box::into_raw, freed once; dropped only when NCCL no longer writes it
        // (otherwise `leak` is called).
        drop(unsafe { Box::from_raw(self.0) });
    }
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
    comm.check_failure(CALL)
}

/// What this rank checks of its own buffer. A refusal here is carried through the exchange,
/// so every rank refuses the registration together instead of leaving its peers in NCCL's
/// bootstrap all-gather.
fn check<T: NcclType>(comm: &Comm, buffer: &NcclBuffer<T>, flags: WindowFlags) -> Result<()> {
    flags.check(comm.library().version())?;
    // The context, not only the device: NCCL maps the buffer in the communicator's context.
    comm.check_context(buffer.stream.context(), "the buffer")?;
    check_extent(buffer.ptr, buffer.len, std::mem::size_of::<T>())
}

/// First NCCL that lets ranks register windows of different sizes (before, the peers'
/// mappings were sized by the local registration: v2.29.7 `src/dev_runtime.cc`).
pub(crate) const SIZES_MAY_DIFFER_SINCE: Version = Version::new(2, 30, 7);

/// What one rank says in the registration's exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    /// This rank refused its own registration (its error says why).
    refused: bool,
    bytes: u64,
    flags: u32,
    /// `size_of::<T>()`: the element type's size, which every offset here is counted in.
    elem: u64,
    /// This rank needs NCCL's RMA set-up step now and can take it (see `rma::can_set_up`).
    rma: bool,
}

/// Words per [`Entry`] in the exchange.
const WIDTH: usize = 5;

impl Entry {
    fn of<T: NcclType>(
        buffer: &NcclBuffer<T>,
        flags: WindowFlags,
        refused: bool,
        rma: bool,
    ) -> Self {
        let elem = std::mem::size_of::<T>();
        Entry {
            refused,
            // Overflow was refused by `check_extent` (then `refused` is set).
            bytes: buffer.len.saturating_mul(elem) as u64,
            flags: flags.bits(),
            elem: elem as u64,
            rma,
        }
    }

    fn to_row(self) -> [u64; WIDTH] {
        [
            u64::from(self.refused),
            self.bytes,
            u64::from(self.flags),
            self.elem,
            u64::from(self.rma),
        ]
    }

    fn from_row(row: &[u64]) -> Self {
        Entry {
            refused: row[0] != 0,
            bytes: row[1],
            flags: row[2] as u32,
            elem: row[3],
            rma: row[4] != 0,
        }
    }
}

/// The verdict on a registration from every rank's entry (rank `i`'s at `all[i]`): the
/// same on every rank, since every rank judges the same entries. Windows must agree on
/// flags and element size on every version (NCCL reads every rank's copy through this
/// rank's handle, in bytes), and before 2.30.7 on their size.
fn judge(version: Version, all: &[Entry]) -> Result<()> {
    if let Some(i) = all.iter().position(|e| e.refused) {
        return Err(Error::invalid(format!(
            "{CALL}: rank {i} refused its own window (its error says why); no rank registered"
        )));
    }
    let Some(first) = all.first() else {
        return Ok(());
    };
    let differs = |what: &str, i: usize, mine: u64, theirs: u64| {
        Err(Error::invalid(format!(
            "{CALL}: rank {i} registers {what} {theirs} where rank 0 registers {mine}; every \
             rank must register the same, so no rank registered"
        )))
    };
    for (i, e) in all.iter().enumerate().skip(1) {
        if e.elem != first.elem {
            return differs("element size", i, first.elem, e.elem);
        }
        if e.flags != first.flags {
            return differs("flags", i, u64::from(first.flags), u64::from(e.flags));
        }
        if e.bytes != first.bytes && version < SIZES_MAY_DIFFER_SINCE {
            return Err(Error::invalid(format!(
                "{CALL}: rank {i} registers {} bytes where rank 0 registers {}; before NCCL \
                 {SIZES_MAY_DIFFER_SINCE} every rank must register the same size, so no rank \
                 registered",
                e.bytes, first.bytes
            )));
        }
    }
    Ok(())
}

/// All-gathers `mine[i]` over `comms[i]`, for every `i`, in one group (one thread may drive
/// several ranks of a communicator), and waits for it: the entries of every rank, per
/// communicator. Where a wait runs out (nonblocking communicators, [`Comm::ready_timeout`])
/// the exchange stays queued and a late rank would pair with it: that communicator is
/// aborted.
fn exchange(comms: &[&Comm], mine: &[Entry]) -> Result<Vec<Vec<Entry>>> {
    let mut sends = Vec::with_capacity(comms.len());
    let mut recvs = Vec::with_capacity(comms.len());
    for (comm, entry) in comms.iter().zip(mine) {
        let stream = comm.stream();
        comm.context().bind_to_thread()?;
        sends.push(stream.clone_htod(&entry.to_row())?);
        recvs.push(stream.alloc_zeros::<u64>(WIDTH * comm.size())?);
    }
    {
        let mut group = Group::start()?;
        for ((comm, send), recv) in comms.iter().zip(&sends).zip(recvs.iter_mut()) {
            group.enqueue(comm, Operation::all_gather(send, recv))?;
        }
        group.finish()?;
    }
    let mut all = Vec::with_capacity(comms.len());
    for (comm, recv) in comms.iter().zip(&recvs) {
        let timeout = (!comm.is_blocking()).then(|| comm.ready_timeout());
        comm.wait_stream(comm.stream(), timeout)
            .map_err(|err| match err {
                Error::Timeout { .. } => comm.abort_stalled(
                    "the window registration's exchange to finish",
                    "the exchange is still queued and a late rank would pair with it",
                    err,
                ),
                other => other,
            })?;
        let rows = comm.stream().clone_dtoh(recv)?;
        all.push(rows.chunks_exact(WIDTH).map(Entry::from_row).collect());
    }
    Ok(all)
}

/// What the ranks agreed on for one communicator's registration.
struct Agreed {
    /// Every rank's window size in bytes.
    peer_bytes: Vec<u64>,
    /// `hostRmaSupport` of this rank's communicator, where reported.
    host_rma: Option<bool>,
    /// Every rank takes NCCL's RMA set-up step after registering (see [`rma::set_up`]).
    set_up_rma: bool,
}

/// `hostRmaSupport`, where the library reports it; any other failure of the query is this
/// rank's error (it goes through the exchange like the others).
fn host_rma(comm: &Comm) -> Result<Option<bool>> {
    match crate::properties::query(comm) {
        Ok(props) => Ok(props.host_rma_support),
        Err(err) if err.is_unsupported() => Ok(None),
        Err(err) => Err(err),
    }
}

/// The exchange and its verdict for `comms[i]` registering `buffers[i]`: what every rank
/// agreed on per communicator, where every rank may go on, else the error every rank
/// returns (this rank's own error first).
fn agree<T: NcclType>(
    comms: &[&Comm],
    buffers: &[NcclBuffer<T>],
    flags: WindowFlags,
) -> Result<Vec<Agreed>> {
    let local: Vec<Result<Option<bool>>> = comms
        .iter()
        .zip(buffers)
        .map(|(comm, buffer)| check(comm, buffer, flags).and_then(|()| host_rma(comm)))
        .collect();
    let mine: Vec<Entry> = comms
        .iter()
        .zip(buffers)
        .zip(&local)
        .map(|((comm, buffer), verdict)| {
            let rma = match verdict {
                Ok(host) => rma::can_set_up(comm, *host),
                Err(_) => false,
            };
            Entry::of(buffer, flags, verdict.is_err(), rma)
        })
        .collect();
    // One rank alone has nobody to agree with.
    let all = if comms.iter().all(|comm| comm.size() == 1) {
        mine.iter().map(|entry| vec![*entry]).collect()
    } else {
        exchange(comms, &mine)?
    };
    let mut agreed = Vec::with_capacity(comms.len());
    for ((comm, verdict), entries) in comms.iter().zip(local).zip(&all) {
        let host_rma = verdict?;
        judge(comm.library().version(), entries)?;
        agreed.push(Agreed {
            peer_bytes: entries.iter().map(|e| e.bytes).collect(),
            host_rma,
            // A lone rank cannot wait for anyone, and NCCL's set-up has nobody to wait for.
            set_up_rma: comm.size() > 1 && entries.iter().all(|e| e.rma),
        });
    }
    Ok(agreed)
}

/// Takes NCCL's RMA set-up step where the ranks agreed to (every rank then calls this with
/// the same verdict), and records the outcome on each communicator.
fn finish_rma(comms: &[&Comm], agreed: &[Agreed]) -> Result<()> {
    let set_up: Vec<&Comm> = comms
        .iter()
        .zip(agreed)
        .filter(|(_, a)| a.set_up_rma)
        .map(|(comm, _)| *comm)
        .collect();
    let outcome = if set_up.is_empty() {
        Ok(())
    } else {
        rma::set_up(&set_up)
    };
    for (comm, a) in comms.iter().zip(agreed) {
        // Only a lazy NCCL still pending changes state; a failed step leaves RMA off. A
        // lone rank's set-up waits for nobody.
        if comm.rma_setup.get() == crate::comm::RmaSetup::Pending {
            let done = comm.size() == 1 || (a.set_up_rma && outcome.is_ok());
            rma::record_setup(comm, done);
        }
    }
    outcome
}

/// NCCL refuses empty windows, and needs the window's start 4096-byte aligned in its VMM
/// allocation; an `NcclBuffer` starts its own allocation, so its address must be aligned.
fn check_extent(ptr: u64, len: usize, elem: usize) -> Result<()> {
    if len == 0 {
        return Err(Error::invalid(
            "a window needs at least one element (NCCL refuses empty windows)",
        ));
    }
    if len.checked_mul(elem).is_none() {
        return Err(Error::invalid(format!(
            "{len} elements overflow the address space"
        )));
    }
    if ptr % REQUIRED_ALIGNMENT as u64 != 0 {
        return Err(Error::invalid(format!(
            "the buffer at {ptr:#x} is not {REQUIRED_ALIGNMENT}-byte aligned, as NCCL requires"
        )));
    }
    Ok(())
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
    /// On failure the buffer comes back inside the [`RegisterError`] (which converts into
    /// [`Error`] with `?`), unless NCCL may still be registering it. A nonblocking
    /// registration that does not finish within [`Comm::ready_timeout`] aborts the
    /// communicator (its windows are then freed by NCCL) and leaks the buffer.
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
        let slot = Slot::new();
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
                slot.leak();
                std::mem::forget(buffer);
                return Err(RegisterError::new(err, vec![None]));
            }
        }
        let raw = slot.read();
        if raw.is_null() {
            // Every rank gets the NULL window (no symmetric memory on the communicator).
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
        let mut raw_group = match RawGroup::start(first.library()) {
            Ok(group) => group,
            Err(err) => return Err(RegisterError::returning(err, buffers)),
        };
        // Aborts from other threads wait until the group has ended (see `crate::fault`).
        let mut membership = Membership::enter(comms.iter());
        let slots: Vec<Slot> = comms.iter().map(|_| Slot::new()).collect();
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
                    slot.leak();
                    std::mem::forget(buffer);
                    kept.push(None);
                } else if i >= issued || slot.read().is_null() {
                    kept.push(Some(buffer));
                } else {
                    let window = Window::new(comm, slot.read(), buffer, flags, Vec::new(), None);
                    kept.push(window.close().ok());
                }
            }
            return Err(RegisterError::new(error, kept));
        }
        if failure.is_none() && slots.iter().any(|slot| slot.read().is_null()) {
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
        for ((comm, buffer), slot) in comms.iter().zip(buffers).zip(&slots) {
            let raw = slot.read();
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
mod tests {
    use super::*;

    fn entry(bytes: u64, flags: u32, elem: u64) -> Entry {
        Entry {
            refused: false,
            bytes,
            flags,
            elem,
            rma: true,
        }
    }

    const V2_29: Version = Version::new(2, 29, 7);
    const V2_32: Version = Version::new(2, 32, 3);

    /// M5: windows whose size (before 2.30.7), flags or element type differ across ranks are
    /// refused on every rank; before the fix nothing compared them.
    #[test]
    fn m5_mismatched_windows_are_refused_on_every_rank() {
        let same = [entry(4096, 1, 4), entry(4096, 1, 4)];
        assert!(judge(V2_29, &same).is_ok());
        let sizes = [entry(4096, 1, 4), entry(8192, 1, 4)];
        let err = judge(V2_29, &sizes).unwrap_err().to_string();
        assert!(err.contains("rank 1 registers 8192 bytes"), "{err}");
        assert!(err.contains("same size"), "{err}");
        // From 2.30.7 sizes may differ (puts are then checked against the peer's size).
        assert!(judge(SIZES_MAY_DIFFER_SINCE, &sizes).is_ok());
        let flags = [entry(4096, 1, 4), entry(4096, 0, 4)];
        let err = judge(V2_32, &flags).unwrap_err().to_string();
        assert!(err.contains("rank 1 registers flags 0"), "{err}");
        let types = [entry(4096, 1, 4), entry(4096, 1, 4), entry(4096, 1, 8)];
        let err = judge(V2_32, &types).unwrap_err().to_string();
        assert!(err.contains("rank 2 registers element size 8"), "{err}");
        // The entries survive the exchange's encoding.
        let e = Entry {
            refused: true,
            ..entry(1 << 40, 9, 2)
        };
        assert_eq!(Entry::from_row(&e.to_row()), e);
    }

    /// M4: a rank refusing its own window (empty, misaligned, wrong context, flags the
    /// library lacks) is reported to every rank through the exchange, so none is left in
    /// NCCL's bootstrap all-gather; before the fix the refusing rank returned alone.
    #[test]
    fn m4_a_rank_refusing_its_window_is_reported_to_all() {
        let mut all = [entry(4096, 1, 4), entry(4096, 1, 4), entry(4096, 1, 4)];
        all[2].refused = true;
        let err = judge(V2_32, &all).unwrap_err().to_string();
        assert!(err.contains("rank 2 refused its own window"), "{err}");
        assert!(err.contains("no rank registered"), "{err}");
    }

    #[test]
    fn extents_are_checked() {
        assert!(check_extent(0x10_0000, 1, 4).is_ok());
        assert!(check_extent(0x10_1000, 1 << 20, 8).is_ok());
        let err = check_extent(0x10_0000, 0, 4).unwrap_err().to_string();
        assert!(err.contains("at least one element"), "{err}");
        let err = check_extent(0x10_0800, 4, 4).unwrap_err().to_string();
        assert!(err.contains("4096-byte aligned"), "{err}");
        let err = check_extent(0x10_0000, usize::MAX, 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("overflow"), "{err}");
    }

    #[test]
    fn a_null_window_is_unavailable_not_a_window() {
        let err = no_window();
        assert!(err.is_unsupported() && !err.is_fatal());
        assert!(
            matches!(err, Error::Unavailable { api: CALL, .. }),
            "{err:?}"
        );
    }

    #[test]
    fn unsettled_registrations_say_the_buffer_was_leaked() {
        let waited = std::time::Duration::from_secs(1);
        let err = not_settled(
            3,
            Error::Timeout {
                what: "x".into(),
                waited,
            },
        );
        match err {
            Error::Timeout { what, waited: w } => {
                assert_eq!(w, waited);
                assert!(what.contains("rank 3") && what.contains("leaked"), "{what}");
                assert!(what.contains("every rank must register"), "{what}");
            }
            other => panic!("{other:?}"),
        }
        let other = not_settled(0, Error::invalid("y"));
        assert!(matches!(other, Error::InvalidArgument(_)));
    }

    #[test]
    fn slots_start_null_and_free_themselves() {
        let slot = Slot::new();
        assert!(slot.read().is_null());
        // SAFETY: the test plays NCCL, writing the slot before it is read.
        unsafe { *slot.as_ptr() = 0x40 as ncclWindow_t };
        assert_eq!(slot.read() as usize, 0x40);
    }
}
