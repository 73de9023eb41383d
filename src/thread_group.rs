//! This thread's NCCL group: `ncclGroupStart`/`ncclGroupEnd` as a pair that ends exactly
//! once, and the nesting depth that lets every other call refuse to run while a group is
//! open. Below the communicator and the operations, which both consult it; the public
//! [`Group`](crate::Group) is built on it.

use std::cell::Cell;
use std::marker::PhantomData;

use crate::calls;
use crate::error::{Error, Result};
use crate::library::Library;

thread_local! {
    static OPEN_GROUPS: Cell<u32> = const { Cell::new(0) };
}

/// Whether a group opened by this crate is active on the calling thread.
#[inline]
pub fn is_open() -> bool {
    OPEN_GROUPS.with(|open| open.get() > 0)
}

/// Fails if a group is open on this thread; `what` names the refused call.
#[inline(always)]
pub(crate) fn ensure_outside(what: &str) -> Result<()> {
    if is_open() {
        return Err(group_open_error(what));
    }
    Ok(())
}

#[cold]
#[inline(never)]
fn group_open_error(what: &str) -> Error {
    Error::usage(format!(
        "{what} called while a Group is open on this thread: enqueue through the Group (or \
         finish it first)"
    ))
}

/// A started `ncclGroupStart` that is ended exactly once, by `end` or on drop.
pub(crate) struct RawGroup {
    lib: &'static Library,
    open: bool,
    _thread_bound: PhantomData<*const ()>,
}

impl RawGroup {
    pub(crate) fn start(lib: &'static Library) -> Result<Self> {
        if is_open() {
            return Err(Error::usage(
                "a Group is already open on this thread; NCCL groups here do not nest",
            ));
        }
        // SAFETY: ncclGroupStart only updates this thread's group depth.
        let status = unsafe { lib.api().ncclGroupStart() };
        lib.check(calls::ncclGroupStart.name, status)?;
        OPEN_GROUPS.with(|open| open.set(open.get() + 1));
        Ok(Self {
            lib,
            open: true,
            _thread_bound: PhantomData,
        })
    }

    /// Ends the group; `Ok(true)` means nonblocking communicators are still progressing.
    pub(crate) fn end(&mut self) -> Result<bool> {
        if !self.open {
            return Ok(false);
        }
        self.open = false;
        OPEN_GROUPS.with(|open| open.set(open.get().saturating_sub(1)));
        // SAFETY: matches the ncclGroupStart of `start` on this same thread (the type is
        // neither Send nor Sync).
        let status = unsafe { self.lib.api().ncclGroupEnd() };
        self.lib.check_pending(calls::ncclGroupEnd.name, status)
    }

    /// Ends the group without launching it (`ncclGroupSimulateEnd`, NCCL 2.22, which the
    /// caller checked): NCCL plans its operations and returns its estimate of their time, in
    /// microseconds (`NCCL_UNDEF_FLOAT`, -1, where it planned none).
    pub(crate) fn simulate_end(&mut self) -> Result<f32> {
        if !self.open {
            return Err(Error::usage("the group has already ended"));
        }
        self.open = false;
        OPEN_GROUPS.with(|open| open.set(open.get().saturating_sub(1)));
        let mut info = nccl_sys::nccl_sim_info_initializer();
        // SAFETY: matches the ncclGroupStart of `start` on this same thread; `info` is an
        // initialised ncclSimInfo_t that NCCL reads and fills in during the call.
        let status = unsafe { self.lib.api().ncclGroupSimulateEnd(&mut info) };
        self.lib.check(calls::ncclGroupSimulateEnd.name, status)?;
        Ok(info.estimatedTime)
    }

    /// Whether `ncclGroupEnd` is still to come.
    pub(crate) fn is_open(&self) -> bool {
        self.open
    }

    pub(crate) fn end_ignoring_errors(&mut self) {
        let _ = self.end();
    }
}

impl Drop for RawGroup {
    fn drop(&mut self) {
        self.end_ignoring_errors();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outside_check_reflects_open_groups() {
        assert!(!is_open());
        assert!(ensure_outside("x").is_ok());
        OPEN_GROUPS.with(|open| open.set(1));
        let err = ensure_outside("ncclAllReduce").unwrap_err().to_string();
        assert!(
            err.contains("ncclAllReduce called while a Group is open"),
            "{err}"
        );
        OPEN_GROUPS.with(|open| open.set(0));
        // Other threads have their own state.
        OPEN_GROUPS.with(|open| open.set(1));
        std::thread::spawn(|| assert!(!is_open())).join().unwrap();
        OPEN_GROUPS.with(|open| open.set(0));
    }
}
