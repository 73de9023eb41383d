//! Heap memory an NCCL background job writes after the call that was given its address has
//! returned: the child handle of a nonblocking split, shrink or grow, the handle of a
//! nonblocking window registration.
//!
//! The slot is freed when dropped, so an owner must [`JobSlot::abandon`] (leak) it while the
//! job may still run, and may read it only once the job is done: [`JobSlot::read`] is
//! `unsafe` with that contract, the caller stating why NCCL is done (the call failed, or the
//! communicator settled).

use std::ptr::NonNull;

/// A value on the heap whose address NCCL's job may write; see the [module docs](self).
pub(crate) struct JobSlot<T: Copy> {
    ptr: NonNull<T>,
}

impl<T: Copy> JobSlot<T> {
    /// A slot holding `value` until NCCL writes it.
    pub(crate) fn new(value: T) -> Self {
        Self {
            ptr: NonNull::from(Box::leak(Box::new(value))),
        }
    }

    /// The address to hand to NCCL.
    pub(crate) fn as_ptr(&self) -> *mut T {
        self.ptr.as_ptr()
    }

    /// Reads the value.
    ///
    /// # Safety
    ///
    /// No NCCL job may be writing it any more (the call failed, or its communicator
    /// settled).
    pub(crate) unsafe fn read(&self) -> T {
        // SAFETY: the pointer is valid (owned, from a Box) and the caller rules out a
        // concurrent write.
        unsafe { self.ptr.as_ptr().read() }
    }

    /// Leaks the memory: NCCL's job may still write it.
    pub(crate) fn abandon(self) {
        std::mem::forget(self);
    }
}

impl<T: Copy> Drop for JobSlot<T> {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `Box::leak` in `new` and is freed only here, once;
        // owners abandon (never drop) a slot a job may still write.
        drop(unsafe { Box::from_raw(self.ptr.as_ptr()) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_freed_unless_abandoned() {
        let slot = JobSlot::new(std::ptr::null_mut::<nccl_sys::ncclComm>());
        let written = NonNull::<nccl_sys::ncclComm>::dangling().as_ptr();
        // SAFETY: the test is NCCL's job here; nothing else writes the slot.
        unsafe { slot.as_ptr().write(written) };
        // SAFETY: the write above is over.
        assert_eq!(unsafe { slot.read() }, written);
        drop(slot);
        JobSlot::new(7u64).abandon();
    }
}
