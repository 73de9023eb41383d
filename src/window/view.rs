//! Views of part of a window: what collectives and RMA take when they use a window at an
//! offset.

use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use super::{Window, WindowFlags};
use crate::comm::Comm;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::memory::NcclBuffer;

/// Elements `offset..offset + len` of a [`Window`], for reading: a cudarc [`DevicePtr`].
///
/// ```compile_fail
/// // A read view keeps the window borrowed: no mutable view (or close) meanwhile.
/// fn f(window: &mut nccl::Window<'_, f32>) -> nccl::Result<()> {
///     let read = window.view(0..4)?;
///     let write = window.view_mut(4..8)?;
///     drop((read, write));
///     Ok(())
/// }
/// ```
pub struct WindowView<'w, T: NcclType> {
    buffer: &'w NcclBuffer<T>,
    comm: &'w Comm,
    flags: WindowFlags,
    offset: usize,
    len: usize,
}

/// Elements `offset..offset + len` of a [`Window`], for writing: a cudarc [`DevicePtrMut`]
/// (and [`DevicePtr`]).
pub struct WindowViewMut<'w, T: NcclType> {
    buffer: &'w NcclBuffer<T>,
    offset: usize,
    len: usize,
}

impl<T: NcclType> std::fmt::Debug for WindowView<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WindowView")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("window_len", &self.buffer.len)
            .finish()
    }
}

impl<T: NcclType> std::fmt::Debug for WindowViewMut<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WindowViewMut")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("window_len", &self.buffer.len)
            .finish()
    }
}

/// Resolves `range` against a window of `len` elements: `(start, end)`, or an error naming
/// what is wrong.
pub(crate) fn resolve(range: impl RangeBounds<usize>, len: usize) -> Result<(usize, usize)> {
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(start), Some(end)) if start <= end && end <= len => Ok((start, end)),
        _ => Err(Error::invalid(format!(
            "the range {:?}..{:?} is not inside the window of {len} elements",
            range.start_bound(),
            range.end_bound()
        ))),
    }
}

impl<'c, T: NcclType> Window<'c, T> {
    /// A read view of the elements in `range` (element indices). Out of range is an
    /// [`Error::InvalidArgument`].
    pub fn view(&self, range: impl RangeBounds<usize>) -> Result<WindowView<'_, T>> {
        let (start, end) = resolve(range, self.len())?;
        Ok(WindowView {
            buffer: &self.buffer,
            comm: self.comm(),
            flags: self.flags,
            offset: start,
            len: end - start,
        })
    }

    /// A write view of the elements in `range` (element indices). Out of range is an
    /// [`Error::InvalidArgument`].
    pub fn view_mut(&mut self, range: impl RangeBounds<usize>) -> Result<WindowViewMut<'_, T>> {
        let (start, end) = resolve(range, self.len())?;
        Ok(WindowViewMut {
            buffer: &self.buffer,
            offset: start,
            len: end - start,
        })
    }

    /// Two write views, of `..mid` and `mid..`: for out-of-place operations within one
    /// window (a write view is also a read view).
    pub fn split_at_mut(
        &mut self,
        mid: usize,
    ) -> Result<(WindowViewMut<'_, T>, WindowViewMut<'_, T>)> {
        let len = self.len();
        if mid > len {
            return Err(Error::invalid(format!(
                "cannot split the window of {len} elements at {mid}"
            )));
        }
        let buffer: &NcclBuffer<T> = &self.buffer;
        Ok((
            WindowViewMut {
                buffer,
                offset: 0,
                len: mid,
            },
            WindowViewMut {
                buffer,
                offset: mid,
                len: len - mid,
            },
        ))
    }
}

impl<'w, T: NcclType> WindowView<'w, T> {
    /// The first element's index in the window.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// The communicator of the window.
    pub fn comm(&self) -> &'w Comm {
        self.comm
    }

    /// The flags of the window.
    pub fn window_flags(&self) -> WindowFlags {
        self.flags
    }
}

impl<T: NcclType> WindowViewMut<'_, T> {
    /// The first element's index in the window.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

impl<T: NcclType> DeviceSlice<T> for WindowView<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.buffer.stream
    }
}

impl<T: NcclType> DeviceSlice<T> for WindowViewMut<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.buffer.stream
    }
}

/// Reads through either view: the buffer's read, moved to the view's first element.
macro_rules! read_through_view {
    ($($view:ident),*) => {$(
        impl<T: NcclType> DevicePtr<T> for $view<'_, T> {
            fn device_ptr<'a>(
                &'a self,
                stream: &'a CudaStream,
            ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
                let (base, guard) = self.buffer.device_ptr(stream);
                (
                    base + (self.offset * std::mem::size_of::<T>()) as u64,
                    guard,
                )
            }
        }
    )*};
}
read_through_view!(WindowView, WindowViewMut);

impl<T: NcclType> DevicePtrMut<T> for WindowViewMut<'_, T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        (
            self.buffer.ptr + (self.offset * std::mem::size_of::<T>()) as u64,
            self.buffer.write_on(stream),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_resolve_inside_the_window_or_fail() {
        assert_eq!(resolve(.., 8).unwrap(), (0, 8));
        assert_eq!(resolve(2..5, 8).unwrap(), (2, 5));
        assert_eq!(resolve(2..=5, 8).unwrap(), (2, 6));
        assert_eq!(resolve(..3, 8).unwrap(), (0, 3));
        assert_eq!(resolve(5.., 8).unwrap(), (5, 8));
        assert_eq!(resolve(8.., 8).unwrap(), (8, 8));
        assert_eq!(resolve(3..3, 8).unwrap(), (3, 3));
        for bad in [resolve(0..9, 8), resolve(9.., 8), resolve(0..=8, 8)] {
            let err = bad.unwrap_err().to_string();
            assert!(err.contains("not inside the window of 8"), "{err}");
        }
        #[allow(clippy::reversed_empty_ranges)]
        let inverted = resolve(5..3, 8);
        assert!(inverted.is_err());
        assert!(resolve(..=usize::MAX, 8).is_err());
        assert!(resolve((Bound::Excluded(usize::MAX), Bound::Unbounded), 8).is_err());
    }
}
