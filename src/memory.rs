//! NCCL-allocated memory and buffer registration.
//!
//! [`NcclBuffer`] is device memory from `ncclMemAlloc` (NCCL 2.19): CUDA VMM memory that NCCL
//! can map into peers for zero-copy transfers, the allocation NCCL recommends for registered
//! buffers. It implements cudarc's [`DevicePtr`] and [`DevicePtrMut`], so it works with every
//! collective and with cudarc's copies, with the same event tracking as a `CudaSlice`.
//!
//! [`Comm::register`] registers a buffer with a communicator (`ncclCommRegister`, 2.19, local)
//! and deregisters it when the returned [`Registration`] is dropped. The registration borrows
//! the buffer mutably and is itself a device buffer (cudarc's `DevicePtr` and `DevicePtrMut`),
//! so it is passed to operations as their send or receive buffer, in or out of place, while
//! the borrow checker keeps the buffer from being freed or used behind it. NCCL's rule: if one
//! rank passes registered buffers to an operation, every rank must.
//!
//! Deregistering waits for the buffer's queued work first. If NCCL fails to deregister, the
//! buffer may still be mapped by NCCL, so it is never returned to NCCL's allocator: its memory
//! is leaked when it is dropped, rather than freed under NCCL. A communicator that was aborted
//! or destroyed has released its registrations itself; deregistering then only forgets them.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};

use crate::calls;
use crate::comm::{comm_call, Backoff, Comm, Lease};
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::library::{self, Library};

/// How long dropping an [`NcclBuffer`] (or deregistering it) waits for the work queued on it.
/// Work still running then will not finish (a collective whose peer died): the memory is
/// leaked rather than freed under the GPU.
pub const BUFFER_DROP_TIMEOUT: Duration = Duration::from_secs(10);

/// Device memory allocated by `ncclMemAlloc`; see the [module docs](self).
pub struct NcclBuffer<T: NcclType> {
    // Crate-visible for windows, which hand out views of the buffer (`crate::window`).
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) stream: Arc<CudaStream>,
    lib: &'static Library,
    pub(crate) read: Option<CudaEvent>,
    pub(crate) write: Option<CudaEvent>,
    /// Set when NCCL may still map the memory (a failed deregistration): never freed then.
    leaked: bool,
    _type: PhantomData<T>,
}

// SAFETY: the buffer owns its allocation; the pointer is a device address, usable from any
// thread, and every access goes through cudarc's stream ordering.
unsafe impl<T: NcclType> Send for NcclBuffer<T> {}
// SAFETY: shared access only hands out the device address for reads, ordered by events.
unsafe impl<T: NcclType> Sync for NcclBuffer<T> {}

impl<T: NcclType> std::fmt::Debug for NcclBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("dtype", &T::DATA_TYPE)
            .field("device", &self.stream.context().ordinal())
            .finish()
    }
}

impl<T: NcclType> NcclBuffer<T> {
    /// Allocates `len` elements with `ncclMemAlloc` on the device of `stream`, zero-filled.
    /// `stream` orders the buffer's first use and its release.
    pub fn alloc_zeros(stream: &Arc<CudaStream>, len: usize) -> Result<Self> {
        let lib = library::get()?;
        lib.require_call(&calls::ncclMemAlloc)?;
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::invalid(format!("{len} elements overflow the address space")))?;
        let ctx: &Arc<CudaContext> = stream.context();
        ctx.bind_to_thread()?;
        let mut raw: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; NCCL allocates on the current device, which
        // was just bound.
        let status = unsafe { lib.api().ncclMemAlloc(&mut raw, bytes.max(1)) };
        lib.check(calls::ncclMemAlloc.name, status)?;
        let tracked = ctx.is_event_tracking();
        let event = || -> Result<Option<CudaEvent>> {
            Ok(if tracked {
                Some(ctx.new_event(None)?)
            } else {
                None
            })
        };
        let mut buffer = Self {
            ptr: raw as u64,
            len,
            stream: stream.clone(),
            lib,
            read: None,
            write: None,
            leaked: false,
            _type: PhantomData,
        };
        buffer.read = event()?;
        buffer.write = event()?;
        stream.memset_zeros(&mut buffer)?;
        Ok(buffer)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Waits, for at most `limit`, until no queued work uses the buffer: its last recorded
    /// read and write (work on other streams), and everything queued on its own stream.
    /// Polls rather than blocks, so a collective whose peer never comes (work that will not
    /// finish) ends in [`Error::Timeout`] instead of a hang.
    fn wait_idle(&self, limit: Duration) -> Result<()> {
        let ctx = self.stream.context();
        ctx.bind_to_thread()?;
        let queued = self.stream.record_event(None)?;
        let pending = [self.read.as_ref(), self.write.as_ref(), Some(&queued)];
        let start = Instant::now();
        let mut backoff = Backoff::new();
        loop {
            let mut idle = true;
            for event in pending.into_iter().flatten() {
                idle &= event.try_is_complete()?;
            }
            if idle {
                return Ok(());
            }
            if start.elapsed() >= limit {
                return Err(Error::Timeout {
                    what: "the work queued on an NcclBuffer to finish".into(),
                    waited: start.elapsed(),
                });
            }
            backoff.wait();
        }
    }
}

impl<T: NcclType> DeviceSlice<T> for NcclBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T: NcclType> DevicePtr<T> for NcclBuffer<T> {
    fn device_ptr<'a>(
        &'a self,
        stream: &'a CudaStream,
    ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        // Same contract as cudarc's slices: wait for the last write, record this read.
        let ctx = stream.context();
        if ctx.is_managing_stream_synchronization() {
            if let Some(write) = &self.write {
                ctx.record_err(stream.wait(write));
            }
        }
        (self.ptr, SyncOnDrop::record_event(&self.read, stream))
    }
}

impl<T: NcclType> NcclBuffer<T> {
    /// A write on `stream`, with cudarc's contract: the stream waits for the buffer's last
    /// reads and writes, and the returned guard records this write. Takes `&self` so that
    /// disjoint views of one buffer (a window's `split_at_mut`) can share it; the events then
    /// order those views with each other too, conservatively.
    pub(crate) fn write_on<'a>(&'a self, stream: &'a CudaStream) -> SyncOnDrop<'a> {
        let ctx = stream.context();
        if ctx.is_managing_stream_synchronization() {
            for event in [&self.read, &self.write].into_iter().flatten() {
                ctx.record_err(stream.wait(event));
            }
        }
        SyncOnDrop::record_event(&self.write, stream)
    }
}

impl<T: NcclType> DevicePtrMut<T> for NcclBuffer<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, self.write_on(stream))
    }
}

impl<T: NcclType> Drop for NcclBuffer<T> {
    fn drop(&mut self) {
        // Every recorded use must be finished before the memory goes back to NCCL; work
        // that does not finish in time (a peer that never came) keeps it forever.
        let idle = self.wait_idle(BUFFER_DROP_TIMEOUT);
        if self.leaked || idle.is_err() {
            // NCCL may still map it, or queued work may still use it: leak, never free.
            return;
        }
        // SAFETY: the pointer came from ncclMemAlloc and no queued work uses it any more.
        let _ = unsafe {
            self.lib
                .api()
                .ncclMemFree(self.ptr as *mut std::ffi::c_void)
        };
    }
}

/// Implements cudarc's `DeviceSlice`, `DevicePtr` and `DevicePtrMut` for `$owner<'_, T>`, a
/// type that stands for the [`NcclBuffer`] in its field `$buffer` (a [`Registration`], a
/// [`Window`](crate::Window)), by handing every call to that buffer: its events order the
/// work whichever of them an operation is given.
macro_rules! forward_to_buffer {
    ($owner:ident, $buffer:ident) => {
        impl<T: $crate::dtype::NcclType> ::cudarc::driver::DeviceSlice<T> for $owner<'_, T> {
            fn len(&self) -> usize {
                self.$buffer.len
            }
            fn stream(&self) -> &::std::sync::Arc<::cudarc::driver::CudaStream> {
                &self.$buffer.stream
            }
        }

        impl<T: $crate::dtype::NcclType> ::cudarc::driver::DevicePtr<T> for $owner<'_, T> {
            fn device_ptr<'b>(
                &'b self,
                stream: &'b ::cudarc::driver::CudaStream,
            ) -> (
                ::cudarc::driver::sys::CUdeviceptr,
                ::cudarc::driver::SyncOnDrop<'b>,
            ) {
                ::cudarc::driver::DevicePtr::device_ptr(&*self.$buffer, stream)
            }
        }

        impl<T: $crate::dtype::NcclType> ::cudarc::driver::DevicePtrMut<T> for $owner<'_, T> {
            fn device_ptr_mut<'b>(
                &'b mut self,
                stream: &'b ::cudarc::driver::CudaStream,
            ) -> (
                ::cudarc::driver::sys::CUdeviceptr,
                ::cudarc::driver::SyncOnDrop<'b>,
            ) {
                ::cudarc::driver::DevicePtrMut::device_ptr_mut(&mut *self.$buffer, stream)
            }
        }
    };
}
pub(crate) use forward_to_buffer;

/// A buffer registered with a communicator; deregistered when dropped. It borrows the
/// buffer for its whole life and stands for it in operations (send or receive); see the
/// [module docs](self).
pub struct Registration<'a, T: NcclType> {
    /// The registration handle, deregistered (`ncclCommDeregister`) on its communicator.
    lease: Lease<'a, *mut std::ffi::c_void>,
    buffer: &'a mut NcclBuffer<T>,
}

impl<T: NcclType> std::fmt::Debug for Registration<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("rank", &self.lease.comm().rank())
            .field("buffer", &self.buffer)
            .finish()
    }
}

impl Comm {
    /// Registers `buffer` with this communicator for zero-copy transfers
    /// (`ncclCommRegister`, NCCL 2.19). Local: no other rank takes part, but if one rank
    /// uses registered buffers in an operation, all must. Use the returned registration
    /// where the buffer would go.
    pub fn register<'a, T: NcclType>(
        &'a self,
        buffer: &'a mut NcclBuffer<T>,
    ) -> Result<Registration<'a, T>> {
        self.library().require_call(&calls::ncclCommRegister)?;
        self.check_context(buffer.stream.context(), "the buffer")?;
        let bytes = buffer.len * std::mem::size_of::<T>();
        let mut handle: *mut std::ffi::c_void = std::ptr::null_mut();
        let base = buffer.ptr as *mut std::ffi::c_void;
        // SAFETY: live handle under its lock; the buffer is `bytes` long, stays borrowed
        // while registered, and `handle` is a valid out-pointer.
        unsafe { comm_call!(self, |raw| ncclCommRegister(raw, base, bytes, &mut handle)) }?;
        let lease = Lease::new(
            self,
            handle,
            &calls::ncclCommDeregister,
            |lib, raw, handle| {
                // SAFETY: `GiveBack`'s contract: the handle came from ncclCommRegister on this
                // live communicator and no queued work uses the buffer (waited out first).
                unsafe { lib.api().ncclCommDeregister(raw, handle) }
            },
        );
        Ok(Registration { lease, buffer })
    }
}

impl<'a, T: NcclType> Registration<'a, T> {
    /// Deregisters now (`ncclCommDeregister`), after the buffer's queued work, reporting
    /// what `Drop` would ignore. On failure the registration comes back with the error, as
    /// rusqlite's `close` does: try again, or drop it (the buffer is then never freed). A
    /// communicator that was aborted or destroyed already released its registrations: that
    /// is `Ok`, as for [`Window::close`](crate::Window::close).
    #[allow(clippy::result_large_err)] // rusqlite's shape; called once per registration
    pub fn deregister(mut self) -> std::result::Result<(), (Self, Error)> {
        match self.deregister_raw() {
            Ok(()) => Ok(()),
            Err(err) => Err((self, err)),
        }
    }

    /// The registered buffer, for reading its length or stream.
    pub fn buffer(&self) -> &NcclBuffer<T> {
        self.buffer
    }

    fn deregister_raw(&mut self) -> Result<()> {
        // Deregistration must not race work still queued on the buffer.
        let buffer = &*self.buffer;
        self.lease
            .give_back(|| buffer.wait_idle(BUFFER_DROP_TIMEOUT))
    }
}

forward_to_buffer!(Registration, buffer);

impl<T: NcclType> Drop for Registration<'_, T> {
    fn drop(&mut self) {
        if self.deregister_raw().is_err() && self.lease.is_held() {
            // NCCL may still map the buffer: it must never go back to the allocator.
            self.buffer.leaked = true;
        }
    }
}
