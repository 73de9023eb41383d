//! Memory windows: NCCL-allocated buffers registered with every rank of a communicator
//! (`ncclCommWindowRegister`, NCCL 2.27), for symmetric-memory collectives, zero-CTA
//! copy-engine collectives ([`CtaPolicy::ZERO`](crate::config::CtaPolicy::ZERO)) and one-sided
//! RMA ([`Window::put_signal`]).
//!
//! # Registering
//!
//! [`Comm::register_window`] takes an [`NcclBuffer`] (CUDA VMM memory from `ncclMemAlloc`:
//! NCCL refuses any other kind, so no other buffer type is accepted) and returns a [`Window`]
//! that owns it and borrows the communicator. Registration is collective: every rank calls it,
//! in the same order as its other collective calls. A thread driving several communicators
//! (from [`Comm::init_all`]) registers on all of them at once with [`Comm::register_windows`],
//! which issues the registrations in one NCCL group; inside a [`Group`](crate::Group) opened
//! by the caller, registration is refused, because NCCL fills in the window only when that
//! group ends and a `Window` is only ever handed out once it is valid. On a nonblocking
//! communicator the call waits, for at most [`Comm::ready_timeout`], until NCCL has
//! finished the registration.
//!
//! The window covers the whole buffer, whose start is the start of its VMM allocation, so
//! NCCL's 4096-byte alignment rule ([`REQUIRED_ALIGNMENT`]) always holds.
//!
//! Before calling NCCL, the ranks exchange what they register (a small all-gather on the
//! communicator's stream, waited for): the element type's size, the flags, the size in
//! bytes, and whether the rank's own checks (flags the library knows, the communicator's
//! CUDA context, a non-empty buffer) passed. Every rank then reaches the same verdict, so a
//! rank that refuses its buffer is reported on every rank instead of leaving the others in
//! NCCL's registration. Flags and element types must be the same on every rank; before
//! NCCL 2.30.7 sizes too (NCCL sized the peers' mappings by the local registration), and
//! from 2.30.7 they may differ: [`Window::put_signal`] checks against the target's size;
//! collectives must stay within the smallest, which only the caller knows. What cannot go
//! through the exchange stays the caller's to keep alike on every rank: the library
//! version, calling from inside a [`Group`](crate::Group), and a communicator that has
//! failed or been aborted on one rank (its peers then wait as they would in NCCL; see
//! [`crate::fault`] for watching that).
//!
//! Where NCCL cannot make windows (no symmetric-memory support on this communicator) it
//! reports success with a NULL window (NCCL 2.29.2 and later, and some configurations
//! before): that is [`Error::Unavailable`], and the buffer comes back in the
//! [`RegisterError`].
//!
//! # Using a window
//!
//! A `Window` is a cudarc [`DevicePtr`](cudarc::driver::DevicePtr) and
//! [`DevicePtrMut`](cudarc::driver::DevicePtrMut) for its whole length, and hands
//! out views of any part of it ([`Window::view`], [`Window::view_mut`],
//! [`Window::split_at_mut`]), which are too. So every collective takes a window, or a view at
//! any offset, in place or out of place, with cudarc's event tracking as for any buffer.
//! With [`WindowFlags::COLL_SYMMETRIC`], NCCL's symmetric kernels need the buffers of a
//! collective at the same offset from the start of the window on every rank; only each
//! rank's own side of that can be checked (views always lie inside their window).
//!
//! With [`CtaPolicy::ZERO`](crate::config::CtaPolicy::ZERO) (2.28+), NCCL runs all-gather,
//! all-to-all, gather and scatter on copy engines when a rank's buffers lie in symmetric
//! windows, deciding on each rank from its own pointers: every rank of a gather passes a
//! receive view as long as the root's, at the root's offset (refused otherwise), and
//! in-place gather and scatter are refused there (NCCL's copy-engine versions write blocks
//! at the root's offset plus the rank's, past a single block). From NCCL 2.31 a per-call
//! [`CollConfig`](crate::CollConfig) policy decides this as well. See
//! [`Comm::copy_engine`](crate::Comm::copy_engine).
//!
//! NCCL launches its symmetric kernels with programmatic dependent launch, which the legacy
//! default stream does not give: a communicator for windows wants a stream of its own
//! (`LocalJob::init_comm_on`), and, when all NCCL work stays on that stream, cudarc's event
//! tracking off, whose per-buffer record and wait doubled the time of small symmetric
//! all-reduces on H200 (README, Performance).
//!
//! # Soundness
//!
//! * The window owns the buffer, so it is registered at most once (NCCL leaves buffers
//!   registered twice undefined) and cannot be freed or handed to anything else while
//!   registered; [`Window::close`] gives it back.
//! * The window borrows the communicator, so the communicator cannot be destroyed or
//!   aborted by value while a window lives. An [`AbortHandle`](crate::AbortHandle) or a
//!   [`Watchdog`](crate::Watchdog) can still abort it from another thread; NCCL then frees the
//!   window itself (`ncclDevrFinalize`, when the communicator's resources are freed: with
//!   the abort with one rank per process, else when the process's last rank of it ends it,
//!   and in either case only once the CUDA graphs that captured it are destroyed; NCCL holds
//!   its own reference to the memory meanwhile), and the
//!   window checks, under the communicator's lock, that the communicator is still alive
//!   before deregistering. It never deregisters after an abort or destroy.
//! * Deregistration is local and must not race work that uses the buffer: closing or
//!   dropping a window first waits, for at most [`Comm::drop_timeout`], until the work
//!   recorded on the buffer (its cudarc events), and everything enqueued so far on the
//!   communicator's stream and the buffer's stream, has finished. Work on other streams is
//!   only seen through the buffer's events, as everywhere in cudarc: with event tracking off,
//!   finish it yourself first.
//! * If that wait times out or NCCL fails to deregister, the buffer is leaked (never freed),
//!   since NCCL may still map it. [`Window::close`] instead returns the window with the error.
//! * Forgetting a window (`std::mem::forget`) leaks its buffer with it, so the memory NCCL
//!   maps is never freed behind NCCL either.
//! * As for every cudarc buffer, a CUDA graph that captured work on a window keeps only its
//!   address: do not launch it after the window is closed or dropped.
//!
//! # Closing, and ending the communicator
//!
//! `ncclCommWindowDeregister` is local in NCCL 2.28.7 to 2.30.7 (it unmaps the peers'
//! memory and frees NCCL's records; no bootstrap call), so a rank never waits for the
//! others to close. Peers, however, write into this rank's window (collectives on symmetric
//! windows, [`Window::put_signal`]), and only local work is waited for: close a window
//! only once every rank is past its last operation that uses it, e.g. in the same order on
//! every rank after the last collective on it, or after a [`Window::wait_signal`] for
//! every put aimed at it.
//!
//! Ending the communicator is collective, and more so with several of its ranks in one
//! process (see [`crate::comm`]): `ncclCommDestroy` and `ncclCommAbort` return at once on
//! each of those ranks but the last to call, which then frees all of them (their windows
//! too) with frees that synchronise each rank's GPU. Until every rank in the process has
//! ended the communicator, no rank may enqueue work that waits for a peer (a collective on
//! another communicator), or the last rank's cleanup waits for that work while the work
//! waits for the last rank.
//!
//! ```compile_fail
//! // The buffer belongs to the window: it cannot be used (or dropped) while registered.
//! fn f(comm: &nccl::Comm, buffer: nccl::NcclBuffer<f32>) -> nccl::Result<()> {
//!     let window = comm.register_window(buffer, nccl::WindowFlags::COLL_SYMMETRIC)?;
//!     drop(buffer);
//!     Ok(())
//! }
//! ```
//!
//! ```compile_fail
//! // The window borrows the communicator: the communicator cannot be destroyed under it.
//! fn f(comm: nccl::Comm, buffer: nccl::NcclBuffer<f32>) -> nccl::Result<()> {
//!     let window = comm.register_window(buffer, nccl::WindowFlags::COLL_SYMMETRIC)?;
//!     comm.destroy()?;
//!     drop(window);
//!     Ok(())
//! }
//! ```
//!
//! ```compile_fail
//! // Only NCCL-allocated (VMM) memory can be registered, by type.
//! fn f(comm: &nccl::Comm, slice: cudarc::driver::CudaSlice<f32>) {
//!     let _ = comm.register_window(slice, nccl::WindowFlags::COLL_SYMMETRIC);
//! }
//! ```
//!
//! ```compile_fail
//! // Closing needs the window back from every view (and every collective using one).
//! fn f(window: nccl::Window<'_, f32>) -> nccl::Result<()> {
//!     let view = window.view(0..4)?;
//!     let buffer = window.close().map_err(|(_, err)| err)?;
//!     drop(view);
//!     Ok(())
//! }
//! ```
//!
//! ```compile_fail
//! // A window stays on the thread of its communicator (a `Comm` is not `Sync`).
//! fn assert_send<T: Send>() {}
//! assert_send::<nccl::Window<'static, f32>>();
//! ```

mod agreement;
mod device_ptr;
mod register;
pub mod rma;
mod view;

use std::mem::ManuallyDrop;
use std::ops::BitOr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nccl_sys::ncclWindow_t;

use crate::calls;
use crate::comm::{Backoff, Comm, Lease};
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::memory::{forward_to_buffer, NcclBuffer};
use crate::release::Version;

pub use device_ptr::{DeviceWindow, PeerPtr};
pub use register::RegisterError;
pub use rma::{Signal, SignalWait};
pub use view::{WindowView, WindowViewMut};

/// `NCCL_WIN_REQUIRED_ALIGNMENT`: the alignment NCCL requires of a window's start within its
/// VMM allocation (4096 bytes, NCCL 2.28 header).
pub const REQUIRED_ALIGNMENT: usize = nccl_sys::NCCL_WIN_REQUIRED_ALIGNMENT;

/// First NCCL with `ncclCommWindowRegister` and `ncclCommWindowDeregister`.
pub const WINDOWS_SINCE: Version = calls::ncclCommWindowRegister.since;
/// First NCCL whose symmetric kernels this crate lets run: NCCL 2.28.7's release notes fix
/// "potential data corruption with built-in symmetric kernels for small messages with size
/// granularity under 8 bytes or when multiple symmetric operations were aggregated in a
/// group", and on 2.28.3 an all-gather of 1023 `f32` on symmetric windows returned wrong
/// elements on our 2×H200 host. Older libraries refuse [`WindowFlags::COLL_SYMMETRIC`] with
/// [`Error::Unsupported`] rather than risk it.
pub const SYMMETRIC_SINCE: Version = Version::new(2, 28, 7);
/// First NCCL with `ncclWinGetUserPtr` and one-sided RMA.
pub const USER_PTR_SINCE: Version = calls::ncclWinGetUserPtr.since;

/// Window registration flags (`NCCL_WIN_*`), combinable with `|`; each needs the NCCL
/// release that introduced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WindowFlags(u32);

impl WindowFlags {
    /// `NCCL_WIN_DEFAULT`: a plain registration (2.27).
    pub const DEFAULT: WindowFlags = WindowFlags(0x00);
    /// `NCCL_WIN_COLL_SYMMETRIC` (2.27; accepted here from 2.28.7, see [`SYMMETRIC_SINCE`]):
    /// the window may back symmetric collectives and be the source of one-sided RMA;
    /// collectives must use the same offset into it on every rank.
    pub const COLL_SYMMETRIC: WindowFlags = WindowFlags(0x01);
    /// `NCCL_WIN_STRICT_ORDERING` (2.29.7): ordered delivery for GIN VA signals over IB
    /// verbs.
    pub const STRICT_ORDERING: WindowFlags = WindowFlags(0x02);
    /// `NCCL_WIN_GIN_ONLY` (2.32): register for GPU-initiated networking only.
    pub const GIN_ONLY: WindowFlags = WindowFlags(0x04);
    /// `NCCL_WIN_CFT_COUNTED` (2.32.3 header): register for CFT counted endpoints only.
    pub const CFT_COUNTED: WindowFlags = WindowFlags(0x08);

    /// Every flag with its C name and the first NCCL release that has it.
    pub const KNOWN: [(WindowFlags, &'static str, Version); 4] = [
        (
            WindowFlags::COLL_SYMMETRIC,
            "NCCL_WIN_COLL_SYMMETRIC",
            SYMMETRIC_SINCE,
        ),
        (
            WindowFlags::STRICT_ORDERING,
            "NCCL_WIN_STRICT_ORDERING",
            Version::new(2, 29, 7),
        ),
        (
            WindowFlags::GIN_ONLY,
            "NCCL_WIN_GIN_ONLY",
            Version::new(2, 32, 0),
        ),
        (
            WindowFlags::CFT_COUNTED,
            "NCCL_WIN_CFT_COUNTED",
            Version::new(2, 32, 3),
        ),
    ];

    /// The raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Flags from raw bits; bits NCCL does not define are refused at registration.
    pub const fn from_bits(bits: u32) -> Self {
        WindowFlags(bits)
    }

    /// Whether every flag of `other` is set.
    pub const fn contains(self, other: WindowFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Checks the flags against the library version `found`: unknown bits are
    /// [`Error::InvalidArgument`], flags newer than the library [`Error::Unsupported`].
    pub fn check(self, found: Version) -> Result<()> {
        let known = Self::KNOWN.iter().fold(0, |all, (flag, ..)| all | flag.0);
        if self.0 & !known != 0 {
            return Err(Error::invalid(format!(
                "window flags {:#x} include bits NCCL does not define (known: {known:#x})",
                self.0
            )));
        }
        for (flag, api, needs) in Self::KNOWN {
            if self.contains(flag) && found < needs {
                return Err(Error::Unsupported { api, needs, found });
            }
        }
        Ok(())
    }
}

impl BitOr for WindowFlags {
    type Output = WindowFlags;
    fn bitor(self, rhs: WindowFlags) -> WindowFlags {
        WindowFlags(self.0 | rhs.0)
    }
}

/// An [`NcclBuffer`] registered as a window on every rank of a communicator; see the
/// [module docs](self).
///
/// Close (or drop) windows only once every rank is done with them (peers write into this
/// rank's window), e.g. in the same order on every rank after the last collective on
/// them; deregistration itself is local. Ending the communicator is collective: with
/// several of its ranks in one process, the last to end it frees every rank's windows and
/// synchronises their GPUs, so end it on every rank before enqueuing work that waits for a
/// peer (see [Closing](self#closing-and-ending-the-communicator)).
pub struct Window<'c, T: NcclType> {
    /// The NCCL handle, deregistered (`ncclCommWindowDeregister`) on its communicator.
    lease: Lease<'c, ncclWindow_t>,
    /// Taken out only by `close` after a successful release, and never dropped otherwise:
    /// a window that cannot be released leaks its buffer.
    buffer: ManuallyDrop<NcclBuffer<T>>,
    flags: WindowFlags,
    /// `hostRmaSupport` of the communicator, where the library reports it (2.29.4).
    host_rma: Option<bool>,
    /// Every rank's window size in bytes, from the registration's exchange (empty where
    /// unknown): a put must fit the target's window, which NCCL does not check.
    peer_bytes: Vec<u64>,
    /// The cudarc slice that carries the handle into kernel launches
    /// ([`Window::device_window`]), made on first use; it frees nothing when dropped.
    kernel_arg: Option<device_ptr::Tracked>,
}

impl<T: NcclType> std::fmt::Debug for Window<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window")
            .field("rank", &self.comm().rank())
            .field("handle", &self.as_raw())
            .field("buffer", &*self.buffer)
            .field("flags", &self.flags)
            .finish()
    }
}

impl<'c, T: NcclType> Window<'c, T> {
    /// Wraps a handle NCCL just filled in for `buffer`.
    fn new(
        comm: &'c Comm,
        raw: ncclWindow_t,
        buffer: NcclBuffer<T>,
        flags: WindowFlags,
        peer_bytes: Vec<u64>,
        host_rma: Option<bool>,
    ) -> Self {
        // `host_rma` was asked once at registration (a failed query failed it) rather than
        // on every RMA call.
        let lease = Lease::new(
            comm,
            raw,
            &calls::ncclCommWindowDeregister,
            |lib, raw, win| {
                // SAFETY: `GiveBack`'s contract: live communicator under its lock (an abort from
                // another thread takes the same lock, and NCCL frees the window then); `win` was
                // registered on it and no work uses the buffer any more (waited out first).
                unsafe { lib.api().ncclCommWindowDeregister(raw, win) }
            },
        );
        Self {
            lease,
            buffer: ManuallyDrop::new(buffer),
            flags,
            host_rma,
            peer_bytes,
            kernel_arg: None,
        }
    }

    /// Rank `peer`'s window length in elements, where the registration learnt it.
    pub(crate) fn peer_len(&self, peer: usize) -> Option<usize> {
        let bytes = *self.peer_bytes.get(peer)?;
        usize::try_from(bytes / std::mem::size_of::<T>() as u64).ok()
    }

    /// The communicator the window is registered with.
    #[inline]
    pub fn comm(&self) -> &'c Comm {
        self.lease.comm()
    }

    /// The flags it was registered with.
    pub fn flags(&self) -> WindowFlags {
        self.flags
    }

    /// Its length in elements (the whole buffer).
    pub fn len(&self) -> usize {
        self.buffer.len
    }

    /// Whether it has no elements (never: empty buffers cannot be registered).
    pub fn is_empty(&self) -> bool {
        self.buffer.len == 0
    }

    /// Its length in bytes, as registered.
    pub fn num_bytes(&self) -> usize {
        self.buffer.len * std::mem::size_of::<T>()
    }

    /// Whether the communicator supports host-initiated one-sided RMA, as
    /// `ncclCommQueryProperties` reported at registration (`None` before NCCL 2.29.4).
    pub fn host_rma_support(&self) -> Option<bool> {
        self.host_rma
    }

    /// The raw `ncclWindow_t`, for NCCL functions this crate does not wrap (the device API).
    /// It is valid while the window lives and its communicator has not been aborted.
    #[inline]
    pub fn as_raw(&self) -> ncclWindow_t {
        self.lease.handle()
    }

    /// The device address NCCL records for the window (`ncclWinGetUserPtr`, NCCL 2.29): the
    /// start of the buffer.
    pub fn user_ptr(&self) -> Result<u64> {
        let lib = self.comm().library();
        lib.require_call(&calls::ncclWinGetUserPtr)?;
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        let win = self.as_raw();
        let status = self.comm().with_raw(&calls::ncclWinGetUserPtr, |raw| {
            // SAFETY: live communicator under its lock; `win` is a window registered on it
            // and still registered (it is only deregistered by value); `ptr` is a valid
            // out-pointer.
            unsafe { lib.api().ncclWinGetUserPtr(raw, win, &mut ptr) }
        })?;
        lib.check(calls::ncclWinGetUserPtr.name, status)?;
        Ok(ptr as u64)
    }

    /// Deregisters the window and gives the buffer back.
    ///
    /// Waits first, for at most the communicator's [`Comm::drop_timeout`], until the work
    /// using the buffer has finished (see the [module docs](self)). On a timeout or an NCCL
    /// failure the window comes back with the error, still registered; dropping it then
    /// tries again and leaks the buffer if that fails too. A window whose communicator was
    /// aborted meanwhile is NCCL's to free (it holds its own reference to the memory): its
    /// buffer comes back without a call.
    // The error gives the window back (as rusqlite's `close` does); it is the rare path.
    #[allow(clippy::result_large_err)]
    pub fn close(mut self) -> std::result::Result<NcclBuffer<T>, (Self, Error)> {
        if let Err(err) = self.release() {
            return Err((self, err));
        }
        let mut this = ManuallyDrop::new(self);
        // `this` is never dropped: what it holds besides the buffer is dropped here.
        drop(this.kernel_arg.take());
        drop(std::mem::take(&mut this.peer_bytes));
        // SAFETY: the window is released; `this` is never dropped, so the buffer is taken
        // exactly once.
        Ok(unsafe { ManuallyDrop::take(&mut this.buffer) })
    }

    /// Waits for the buffer's work, then deregisters, unless NCCL owns the window's end
    /// with its communicator (aborted or destroyed from another thread: 2.29.7 release
    /// notes, `ncclDevrFinalize` in dev_runtime.cc).
    fn release(&mut self) -> Result<()> {
        let (buffer, comm) = (&*self.buffer, self.lease.comm());
        // The kernels that took the window's handle ([`Window::device_window`]) on any
        // stream: a `DeviceWindow` joins them into the buffer's stream when dropped, but one
        // forgotten (`mem::forget`, safe) never did; the handle's own events still know
        // them, so the buffer's stream, whose work `wait_idle` waits for, waits for them too.
        if let Some(arg) = &self.kernel_arg {
            arg.join_into(&buffer.stream);
        }
        self.lease
            .give_back(|| Self::wait_idle(buffer, comm, comm.drop_timeout()))
    }

    /// Waits until the buffer's recorded uses and the work enqueued so far on the
    /// communicator's stream and the buffer's stream have finished.
    fn wait_idle(buffer: &NcclBuffer<T>, comm: &Comm, timeout: Duration) -> Result<()> {
        buffer.stream.context().bind_to_thread()?;
        let comm_done = comm.stream().record_event(None)?;
        let buffer_done = if Arc::ptr_eq(&buffer.stream, comm.stream()) {
            None
        } else {
            Some(buffer.stream.record_event(None)?)
        };
        let start = Instant::now();
        let mut backoff = Backoff::new();
        loop {
            let mut idle = true;
            for event in [
                buffer.read.as_ref(),
                buffer.write.as_ref(),
                Some(&comm_done),
                buffer_done.as_ref(),
            ]
            .into_iter()
            .flatten()
            {
                if !event.try_is_complete()? {
                    idle = false;
                    break;
                }
            }
            if idle {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                return Err(Error::Timeout {
                    what: format!(
                        "the work using the window of rank {} ({} bytes) to finish before \
                         deregistering it (a dropped window then leaks its buffer)",
                        comm.rank(),
                        buffer.len * std::mem::size_of::<T>()
                    ),
                    waited: start.elapsed(),
                });
            }
            backoff.wait();
        }
    }
}

impl<T: NcclType> Drop for Window<'_, T> {
    fn drop(&mut self) {
        if self.release().is_ok() {
            // SAFETY: released, and `buffer` is not touched again.
            unsafe { ManuallyDrop::drop(&mut self.buffer) };
        }
        // Otherwise the buffer is leaked: NCCL may still map it.
    }
}

forward_to_buffer!(Window, buffer);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_follow_the_header() {
        let header = [
            (WindowFlags::DEFAULT, nccl_sys::NCCL_WIN_DEFAULT),
            (
                WindowFlags::COLL_SYMMETRIC,
                nccl_sys::NCCL_WIN_COLL_SYMMETRIC,
            ),
            (
                WindowFlags::STRICT_ORDERING,
                nccl_sys::NCCL_WIN_STRICT_ORDERING,
            ),
            (WindowFlags::GIN_ONLY, nccl_sys::NCCL_WIN_GIN_ONLY),
            (WindowFlags::CFT_COUNTED, nccl_sys::NCCL_WIN_CFT_COUNTED),
        ];
        for (flag, bits) in header {
            assert_eq!(flag.bits(), bits as u32, "{flag:?}");
        }
        assert_eq!(REQUIRED_ALIGNMENT, 4096);
        let both = WindowFlags::COLL_SYMMETRIC | WindowFlags::STRICT_ORDERING;
        assert!(both.contains(WindowFlags::COLL_SYMMETRIC));
        assert!(both.contains(WindowFlags::DEFAULT));
        assert!(!WindowFlags::COLL_SYMMETRIC.contains(WindowFlags::GIN_ONLY));
        assert_eq!(WindowFlags::from_bits(3), both);
    }

    #[test]
    fn flags_are_gated_by_version() {
        let v = Version::new;
        assert!(WindowFlags::COLL_SYMMETRIC.check(v(2, 28, 7)).is_ok());
        assert!(WindowFlags::DEFAULT.check(v(2, 27, 3)).is_ok());
        // Symmetric kernels before 2.28.7 could corrupt data: refused.
        match WindowFlags::COLL_SYMMETRIC.check(v(2, 28, 3)) {
            Err(Error::Unsupported { api, needs, .. }) => {
                assert_eq!((api, needs), ("NCCL_WIN_COLL_SYMMETRIC", v(2, 28, 7)));
            }
            other => panic!("{other:?}"),
        }
        let gates = [
            (WindowFlags::STRICT_ORDERING, v(2, 29, 3), v(2, 29, 7)),
            (WindowFlags::GIN_ONLY, v(2, 31, 2), v(2, 32, 0)),
            (WindowFlags::CFT_COUNTED, v(2, 32, 0), v(2, 32, 3)),
        ];
        for (flag, old, new) in gates {
            match (WindowFlags::COLL_SYMMETRIC | flag).check(old) {
                Err(Error::Unsupported { needs, found, .. }) => {
                    assert_eq!((needs, found), (new, old), "{flag:?}");
                }
                other => panic!("{flag:?} on {old}: {other:?}"),
            }
            assert!(flag.check(new).is_ok(), "{flag:?}");
        }
        let err = WindowFlags::from_bits(0x10).check(v(2, 32, 3)).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("0x10")),
            "{err}"
        );
    }
}
