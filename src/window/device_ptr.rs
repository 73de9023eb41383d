//! What device-API kernels take of a window: its handle as a kernel argument
//! ([`DeviceWindow`], the `ncclWindow_t` parameter the device functions such as
//! `ncclGetLsaPointer` read), and the device addresses of the LSA peers' windows queried on
//! the host ([`PeerPtr`]), each borrowing the window so it cannot be closed under them.

use std::ffi::{c_int, c_void};
use std::marker::PhantomData;

use cudarc::driver::{CudaStream, DevicePtrMut, LaunchArgs, PushKernelArg, SyncOnDrop};

use super::Window;
use crate::calls::{self, Call};
use crate::dtype::NcclType;
use crate::error::{Error, Result};

/// A window's `ncclWindow_t` as a kernel argument, for launches on one stream: made by
/// [`Window::device_window`], which orders the stream after the window's earlier uses and,
/// when dropped (after the launch that took it), records the kernel as a write of the
/// window, so the window's close waits for it (cudarc's event tracking, as for any buffer).
pub struct DeviceWindow<'w> {
    handle: u64,
    _sync: SyncOnDrop<'w>,
}

impl std::fmt::Debug for DeviceWindow<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceWindow({:#x})", self.handle)
    }
}

impl DeviceWindow<'_> {
    /// The handle's value (an address in NCCL's device memory).
    pub fn handle(&self) -> u64 {
        self.handle
    }
}

// SAFETY (of cudarc's launch contract): the argument pushed is the address of a `u64` owned
// by `arg` and borrowed for `'b`, which outlives the launch; the kernel parameter is the
// pointer-sized `ncclWindow_t`.
unsafe impl<'a, 'b: 'a, 'w> PushKernelArg<&'b DeviceWindow<'w>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceWindow<'w>) -> &mut Self {
        self.arg(&arg.handle)
    }
}

/// The device address of element `offset` of a peer's window, valid while the window it was
/// queried on is borrowed (and its communicator alive). A kernel argument (`T*` on the
/// device side); it covers [`len`](PeerPtr::len) elements as this rank's window is
/// registered (peers' windows may be smaller from NCCL 2.30.7: stay within theirs).
///
/// ```compile_fail
/// // A peer pointer cannot outlive the borrow of its window.
/// fn f(window: nccl::Window<'_, f32>) -> nccl::Result<()> {
///     let ptr = window.lsa_ptr(0, 0)?;
///     let buffer = window.close().map_err(|(_, err)| err)?;
///     drop(ptr);
///     Ok(())
/// }
/// ```
///
/// ```compile_fail
/// // Nor can a window handle made for a kernel.
/// fn f(mut window: nccl::Window<'_, f32>, stream: &cudarc::driver::CudaStream) {
///     let handle = window.device_window(stream);
///     drop(window);
///     drop(handle);
/// }
/// ```
pub struct PeerPtr<'w, T> {
    addr: u64,
    len: usize,
    _window: PhantomData<&'w [T]>,
}

impl<T> std::fmt::Debug for PeerPtr<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerPtr({:#x}, {} elements)", self.addr, self.len)
    }
}

impl<T> PeerPtr<'_, T> {
    /// The device address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The elements it covers, from this rank's window's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it covers nothing (an offset at the window's end).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

// SAFETY (of cudarc's launch contract): the argument pushed is the address of a `u64` owned
// by `arg` and borrowed for `'b`, outliving the launch; the kernel parameter is a pointer.
unsafe impl<'a, 'b: 'a, 'w, T> PushKernelArg<&'b PeerPtr<'w, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b PeerPtr<'w, T>) -> &mut Self {
        self.arg(&arg.addr)
    }
}

/// Which pointer a query asks NCCL for.
enum Query {
    Lsa(c_int),
    Peer(c_int),
    LsaMultimem,
}

impl<'c, T: NcclType> Window<'c, T> {
    /// The window as a kernel argument for launches on `stream` (see [`DeviceWindow`]).
    /// It borrows the window mutably: the kernel may write it through the handle.
    pub fn device_window<'w>(&'w mut self, stream: &'w CudaStream) -> DeviceWindow<'w> {
        let handle = self.as_raw() as u64;
        let (_, sync) = self.buffer.device_ptr_mut(stream);
        DeviceWindow {
            handle,
            _sync: sync,
        }
    }

    /// The device address of element `offset` of LSA rank `lsa_rank`'s window
    /// (`ncclGetLsaDevicePointer`, NCCL 2.29.2): loads and stores there reach that peer's
    /// memory. Local; needs a symmetric window.
    pub fn lsa_ptr(&self, lsa_rank: usize, offset: usize) -> Result<PeerPtr<'_, T>> {
        let rank = to_int("LSA rank", lsa_rank)?;
        self.query_ptr(&calls::ncclGetLsaDevicePointer, Query::Lsa(rank), offset)
    }

    /// The device address of element `offset` of world rank `peer`'s window, which must be
    /// in this rank's LSA team (`ncclGetPeerDevicePointer`, NCCL 2.29.2). Local.
    pub fn peer_ptr(&self, peer: usize, offset: usize) -> Result<PeerPtr<'_, T>> {
        let rank = to_int("peer", peer)?;
        if peer >= self.comm().size() {
            return Err(Error::invalid(format!(
                "peer {peer} is not a rank of this communicator of {}",
                self.comm().size()
            )));
        }
        let mut ptr =
            self.query_ptr(&calls::ncclGetPeerDevicePointer, Query::Peer(rank), offset)?;
        if let Some(len) = self.peer_len(peer) {
            ptr.len = len.saturating_sub(offset);
        }
        Ok(ptr)
    }

    /// The multicast address of element `offset` over the LSA team
    /// (`ncclGetLsaMultimemDevicePointer`, NCCL 2.29.2): [`Error::Unavailable`] where the
    /// communicator has no multicast (NVLS off), as on hosts without NVSwitch.
    pub fn lsa_multimem_ptr(&self, offset: usize) -> Result<PeerPtr<'_, T>> {
        // Asked first, so NCCL's multicast set-up is never reached where there is none.
        if !self.comm().properties()?.multimem_support {
            return Err(Error::Unavailable {
                api: calls::ncclGetLsaMultimemDevicePointer.name,
                reason: "the communicator reports no multicast support (multimemSupport is \
                         false: no NVSwitch multicast, or NVLS disabled)"
                    .into(),
            });
        }
        self.query_ptr(
            &calls::ncclGetLsaMultimemDevicePointer,
            Query::LsaMultimem,
            offset,
        )
    }

    fn query_ptr(&self, row: &'static Call, query: Query, offset: usize) -> Result<PeerPtr<'_, T>> {
        let lib = self.comm().library();
        lib.require_call(row)?;
        if offset > self.len() {
            return Err(Error::invalid(format!(
                "offset {offset} is past the window's {} elements",
                self.len()
            )));
        }
        let bytes = offset * std::mem::size_of::<T>();
        let win = self.as_raw();
        let mut out: *mut c_void = std::ptr::null_mut();
        // The queries find the communicator through the window; holding its lock keeps an
        // abort from another thread from freeing both meanwhile.
        let status = self.comm().with_raw(row, |_raw| {
            let api = lib.api();
            // SAFETY: `win` is registered on this live communicator (the window is borrowed,
            // so not deregistered); `out` is a valid out-pointer; the rest are integers NCCL
            // checks.
            unsafe {
                match query {
                    Query::Lsa(rank) => api.ncclGetLsaDevicePointer(win, bytes, rank, &mut out),
                    Query::Peer(rank) => api.ncclGetPeerDevicePointer(win, bytes, rank, &mut out),
                    Query::LsaMultimem => api.ncclGetLsaMultimemDevicePointer(win, bytes, &mut out),
                }
            }
        })?;
        lib.check(row.name, status)?;
        if out.is_null() {
            return Err(Error::Unavailable {
                api: row.name,
                reason: "NCCL returned no address: the peer is not load/store reachable from \
                         this rank, or (multimem) the communicator has no NVLink multicast"
                    .into(),
            });
        }
        Ok(PeerPtr {
            addr: out as u64,
            len: self.len() - offset,
            _window: PhantomData,
        })
    }
}

fn to_int(what: &str, value: usize) -> Result<c_int> {
    c_int::try_from(value)
        .map_err(|_| Error::invalid(format!("{what} {value} does not fit a C int")))
}
