//! NCCL-allocated memory and buffer registration.
//!
//! [`NcclBuffer`] is device memory from `ncclMemAlloc` (NCCL 2.19): CUDA VMM memory that NCCL
//! can map into peers for zero-copy transfers, the allocation NCCL recommends for registered
//! buffers. It implements cudarc's [`DevicePtr`] and [`DevicePtrMut`], so it works with every
//! collective and with cudarc's copies, with the same event tracking as a `CudaSlice`.
//!
//! [`Comm::register`] registers a buffer with a communicator (`ncclCommRegister`, 2.19, local)
//! and deregisters it when the returned [`Registration`] is dropped. NCCL's rule: if one rank
//! passes registered buffers to an operation, every rank must.

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};

use crate::comm::Comm;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::library::{self, Library, Version};

/// Device memory allocated by `ncclMemAlloc`; see the [module docs](self).
pub struct NcclBuffer<T: NcclType> {
    // Crate-visible for windows, which hand out views of the buffer (`crate::window`).
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) stream: Arc<CudaStream>,
    lib: &'static Library,
    pub(crate) read: Option<CudaEvent>,
    pub(crate) write: Option<CudaEvent>,
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
        lib.require("ncclMemAlloc", Version::new(2, 19, 0))?;
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| Error::invalid(format!("{len} elements overflow the address space")))?;
        let ctx: &Arc<CudaContext> = stream.context();
        ctx.bind_to_thread()?;
        let mut raw: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; NCCL allocates on the current device, which
        // was just bound.
        let status = unsafe { lib.api().ncclMemAlloc(&mut raw, bytes.max(1)) };
        lib.check("ncclMemAlloc", status)?;
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

impl<T: NcclType> DevicePtrMut<T> for NcclBuffer<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        let ctx = stream.context();
        if ctx.is_managing_stream_synchronization() {
            for event in [&self.read, &self.write].into_iter().flatten() {
                ctx.record_err(stream.wait(event));
            }
        }
        (self.ptr, SyncOnDrop::record_event(&self.write, stream))
    }
}

impl<T: NcclType> Drop for NcclBuffer<T> {
    fn drop(&mut self) {
        // Every recorded use must be finished before the memory goes back to NCCL.
        let ctx = self.stream.context();
        let _ = ctx.bind_to_thread();
        for event in [&self.read, &self.write].into_iter().flatten() {
            ctx.record_err(event.synchronize());
        }
        ctx.record_err(self.stream.synchronize());
        // SAFETY: the pointer came from ncclMemAlloc and no queued work uses it any more.
        let _ = unsafe {
            self.lib
                .api()
                .ncclMemFree(self.ptr as *mut std::ffi::c_void)
        };
    }
}

/// A buffer registered with a communicator; deregistered when dropped.
pub struct Registration<'a> {
    comm: &'a Comm,
    handle: *mut std::ffi::c_void,
    bytes: usize,
}

impl std::fmt::Debug for Registration<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("rank", &self.comm.rank())
            .field("bytes", &self.bytes)
            .finish()
    }
}

impl Comm {
    /// Registers `buffer` with this communicator for zero-copy transfers
    /// (`ncclCommRegister`, NCCL 2.19). Local: no other rank takes part, but if one rank
    /// uses registered buffers in an operation, all must.
    pub fn register<'a, T: NcclType>(
        &'a self,
        buffer: &'a NcclBuffer<T>,
    ) -> Result<Registration<'a>> {
        self.library()
            .require("ncclCommRegister", Version::new(2, 19, 0))?;
        if buffer.stream.context().ordinal() != self.device() {
            return Err(Error::invalid(format!(
                "the buffer is on device {} but the communicator is on device {}",
                buffer.stream.context().ordinal(),
                self.device()
            )));
        }
        let bytes = buffer.len * std::mem::size_of::<T>();
        let mut handle: *mut std::ffi::c_void = std::ptr::null_mut();
        let status = self.with_raw("ncclCommRegister", |raw| {
            // SAFETY: live handle under its lock; the buffer is `bytes` long, stays borrowed
            // while registered, and `handle` is a valid out-pointer.
            unsafe {
                self.library().api().ncclCommRegister(
                    raw,
                    buffer.ptr as *mut std::ffi::c_void,
                    bytes,
                    &mut handle,
                )
            }
        })?;
        self.complete("ncclCommRegister", status)?;
        Ok(Registration {
            comm: self,
            handle,
            bytes,
        })
    }
}

impl Registration<'_> {
    /// Deregisters now, reporting an error instead of ignoring it as `Drop` does.
    pub fn deregister(mut self) -> Result<()> {
        let result = self.deregister_raw();
        self.handle = std::ptr::null_mut();
        result
    }

    fn deregister_raw(&self) -> Result<()> {
        if self.handle.is_null() {
            return Ok(());
        }
        let lib = self.comm.library();
        let status = self.comm.with_raw("ncclCommDeregister", |raw| {
            // SAFETY: the handle came from ncclCommRegister on this live communicator.
            unsafe { lib.api().ncclCommDeregister(raw, self.handle) }
        })?;
        lib.check("ncclCommDeregister", status)
    }
}

impl Drop for Registration<'_> {
    fn drop(&mut self) {
        let _ = self.deregister_raw();
    }
}
