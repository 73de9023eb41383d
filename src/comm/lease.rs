//! What NCCL lends on a communicator and must get back on it: a window, a buffer
//! registration, a pre-multiplied-sum operator, a device communicator (`ncclDevComm`).
//!
//! Each is a handle made by one NCCL call on a [`Comm`] and given back by another, and each
//! follows the same rules, kept here once:
//!
//! * it borrows the communicator, so it cannot outlive it;
//! * it is given back under the communicator's lock, where an abort from another thread
//!   cannot run at the same time;
//! * a communicator that was aborted or destroyed frees it with itself (NCCL's release may
//!   still be running, see `in_flight.rs`), so giving it back then calls nothing (calling
//!   would be a use after free) and succeeds;
//! * if NCCL fails to take it back, it stays lent: the owner may try again, and leaks what
//!   NCCL may still use (a registered buffer) rather than freeing it.

use nccl_sys::ncclComm_t;

use super::Comm;
use crate::calls::Call;
use crate::error::Result;
use crate::library::Library;

/// The NCCL call that gives a handle back, with the communicator's raw handle.
///
/// # Safety
///
/// Called only by [`Lease::give_back`]: under the communicator's lock, on a live
/// communicator, with a handle made on it and not given back yet; its owner has waited out
/// the work that uses it.
pub(crate) type GiveBack<H> =
    unsafe fn(
        &Library,
        ncclComm_t,
        H,
    ) -> std::result::Result<nccl_sys::ncclResult_t, nccl_sys::MissingSymbol>;

/// A handle NCCL lent on `comm`, and how to give it back; see the [module docs](self).
pub(crate) struct Lease<'c, H: Copy> {
    comm: &'c Comm,
    handle: H,
    /// False once given back (or freed by NCCL with the communicator).
    held: bool,
    call: &'static Call,
    give_back: GiveBack<H>,
}

impl<'c, H: Copy> Lease<'c, H> {
    /// A handle NCCL just made on `comm`, given back by `call` through `give_back`.
    pub(crate) fn new(
        comm: &'c Comm,
        handle: H,
        call: &'static Call,
        give_back: GiveBack<H>,
    ) -> Self {
        Self {
            comm,
            handle,
            held: true,
            call,
            give_back,
        }
    }

    /// The communicator it was lent on.
    #[inline(always)]
    pub(crate) fn comm(&self) -> &'c Comm {
        self.comm
    }

    /// The handle (meaningless once given back, when no owner hands it out any more).
    #[inline(always)]
    pub(crate) fn handle(&self) -> H {
        self.handle
    }

    /// Whether it still has to be given back.
    pub(crate) fn is_held(&self) -> bool {
        self.held
    }

    /// Gives the handle back, once: `settle` first (waiting out the work that uses it),
    /// then the call under the communicator's lock. A communicator released meanwhile frees
    /// it with itself: `Ok` without a call. On an error it stays held.
    pub(crate) fn give_back(&mut self, settle: impl FnOnce() -> Result<()>) -> Result<()> {
        if !self.held {
            return Ok(());
        }
        settle()?;
        let (lib, handle, give_back) = (self.comm.library(), self.handle, self.give_back);
        let outcome = self.comm.with_raw(self.call, |raw| {
            // SAFETY: `GiveBack`'s contract: under the lock of a live communicator (with_raw
            // fails on a released one), a handle made on it and still held, its work settled.
            unsafe { give_back(lib, raw, handle) }
        });
        match outcome {
            Ok(status) => lib.check(self.call.name, status)?,
            // Aborted or destroyed, possibly from another thread: NCCL frees the handle with
            // the communicator, so there is nothing left to give back.
            Err(_) if self.comm.shared().lock().ptr.is_null() => {}
            Err(err) => return Err(err),
        }
        self.held = false;
        Ok(())
    }
}
