//! What device-API kernels take of a window: its handle as a kernel argument
//! ([`DeviceWindow`], the `ncclWindow_t` parameter the device functions such as
//! `ncclGetLsaPointer` read), and the device addresses of the LSA peers' windows queried on
//! the host ([`PeerPtr`]), each borrowing the window so it cannot be closed under them.
//!
//! Both are pushed to a launch through a cudarc slice standing at their address
//! (`Tracked`), so cudarc's own argument code orders the launch after the window's earlier
//! uses and records it on the stream the kernel actually runs on, whichever that is; when
//! they are dropped, the window's buffer is ordered after those kernels, so its next uses,
//! and its close (which deregisters, unmapping the peers' memory), wait for them. With
//! cudarc's event tracking off nothing is recorded, as for every buffer: finish the kernels
//! yourself before closing the window.

use std::ffi::{c_int, c_void};
use std::mem::ManuallyDrop;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchArgs, PushKernelArg, SyncOnDrop,
};

use super::Window;
use crate::calls::{self, Call};
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::memory::NcclBuffer;

/// A cudarc slice at a device address NCCL owns (a window handle, a peer's window), never
/// read, written or freed here: only pushed as a kernel argument, through cudarc's own
/// `&mut CudaSlice` argument, so the launch waits for the uses recorded on it before and
/// records itself after. Dropping it frees nothing (`CudaSlice::leak`, which releases the
/// slice's events and stream only).
pub(super) struct Tracked(ManuallyDrop<CudaSlice<u8>>);

impl Tracked {
    /// A slice at `addr`, its uses recorded on events of `stream`'s context.
    pub(super) fn new(stream: &Arc<CudaStream>, addr: u64) -> Result<Self> {
        // cudarc creates the slice's events with an `unwrap`: a driver out of event resources
        // would panic there, which is turned into an error instead.
        let slice = std::panic::catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: the slice never reads, writes or frees the address (see `Drop`); it
            // only carries the address into kernel launches and records their events.
            unsafe { stream.upgrade_device_ptr::<u8>(addr, 1) }
        }))
        .map_err(|_| Error::Unavailable {
            api: "cudarc's CudaSlice events",
            reason: "the CUDA driver could not create the events that order a kernel \
                     argument (cuEventCreate failed)"
                .into(),
        })?;
        Ok(Self(ManuallyDrop::new(slice)))
    }

    /// Records `stream`'s work so far as the argument's last write: launches that take it
    /// next wait for that work (and for the launches before).
    fn record_on(&mut self, stream: &CudaStream) {
        drop(self.0.device_ptr_mut(stream));
    }

    /// Makes `stream` wait for the launches that took it (each waits for the one before and
    /// records itself as the last write).
    pub(super) fn join_into(&self, stream: &CudaStream) {
        drop(self.0.device_ptr(stream));
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        // SAFETY: taken exactly once, here; the field is not used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.0) };
        // Gives the events and the stream back, never the address (it is NCCL's).
        let _address = slice.leak();
    }
}

/// Makes `stream` wait for the buffer's earlier reads and writes (without recording
/// anything on the buffer).
fn wait_for_buffer<T: NcclType>(buffer: &NcclBuffer<T>, stream: &CudaStream) {
    let ctx = stream.context();
    if ctx.is_managing_stream_synchronization() {
        for event in [&buffer.read, &buffer.write].into_iter().flatten() {
            ctx.record_err(stream.wait(event));
        }
    }
}

/// A window's `ncclWindow_t` as a kernel argument (`.arg(&mut device_window)`), made by
/// [`Window::device_window`]. A launch that takes it runs after the window's earlier uses
/// (and earlier launches with it), on whichever stream it is launched; when it is dropped,
/// the window records those launches as writes of its buffer, so the window's next uses
/// and its close wait for them (cudarc's event tracking, as for any buffer).
pub struct DeviceWindow<'w> {
    handle: u64,
    arg: &'w mut Tracked,
    /// The buffer's stream, where the launches are joined back into the buffer's events.
    stream: &'w CudaStream,
    /// Records the buffer's write on `stream`, once `drop` has made it wait for the launches.
    _record: SyncOnDrop<'w>,
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

impl Drop for DeviceWindow<'_> {
    fn drop(&mut self) {
        // The buffer's stream waits for the launches; `_record`, dropped next, then records
        // the buffer's write there (after the waits for its earlier uses, made when this
        // was created; the mutable borrow kept any other use out since).
        self.arg.join_into(self.stream);
    }
}

// SAFETY (of cudarc's launch contract): the argument pushed is cudarc's own `&mut
// CudaSlice` argument, the address of the slice's `CUdeviceptr` (the window handle), owned
// by the window and borrowed for `'b`, which outlives the launch; the kernel parameter is
// the pointer-sized `ncclWindow_t`.
unsafe impl<'a, 'b: 'a, 'w> PushKernelArg<&'b mut DeviceWindow<'w>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceWindow<'w>) -> &mut Self {
        self.arg(&mut *arg.arg.0)
    }
}

/// The device address of element `offset` of a peer's window, valid while the window it was
/// queried on is borrowed (and its communicator alive). A kernel argument (`T*` on the
/// device side, `.arg(&mut ptr)`): like [`DeviceWindow`], a launch that takes it is recorded
/// on the stream it runs on, and dropping it makes the window's next uses and its close
/// wait for those launches. It covers [`len`](PeerPtr::len) elements of the target's
/// window, whose size the registration learnt (peers' windows may be smaller or larger
/// than this rank's from NCCL 2.30.7).
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
/// fn f(mut window: nccl::Window<'_, f32>) -> nccl::Result<()> {
///     let handle = window.device_window()?;
///     drop(window);
///     drop(handle);
///     Ok(())
/// }
/// ```
pub struct PeerPtr<'w, T: NcclType> {
    addr: u64,
    len: usize,
    arg: Tracked,
    /// The window's buffer, ordered after the launches when this is dropped.
    buffer: &'w NcclBuffer<T>,
}

impl<T: NcclType> std::fmt::Debug for PeerPtr<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerPtr({:#x}, {} elements)", self.addr, self.len)
    }
}

impl<T: NcclType> PeerPtr<'_, T> {
    /// The device address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// The elements it covers: the target's window from `offset` on.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it covers nothing (never, as made: an offset must be inside both this rank's
    /// window and the target's).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl<T: NcclType> Drop for PeerPtr<'_, T> {
    fn drop(&mut self) {
        // The buffer's stream waits for the launches, then the buffer records a write
        // there: its next uses and the window's close wait for them.
        let stream = &self.buffer.stream;
        self.arg.join_into(stream);
        drop(self.buffer.write_on(stream));
    }
}

// SAFETY (of cudarc's launch contract): the argument pushed is cudarc's own `&mut
// CudaSlice` argument, the address of the slice's `CUdeviceptr` (the peer address), owned
// by `arg` and borrowed for `'b`, outliving the launch; the kernel parameter is a pointer.
unsafe impl<'a, 'b: 'a, 'w, T: NcclType> PushKernelArg<&'b mut PeerPtr<'w, T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut PeerPtr<'w, T>) -> &mut Self {
        self.arg(&mut *arg.arg.0)
    }
}

/// Which pointer a query asks NCCL for.
enum Query {
    Lsa(c_int),
    Peer(c_int),
    LsaMultimem,
}

impl<'c, T: NcclType> Window<'c, T> {
    /// The window as a kernel argument (see [`DeviceWindow`]), for launches on any stream.
    /// It borrows the window mutably: the kernel may write it through the handle. The first
    /// call makes the cudarc slice that carries the handle (two CUDA events), which the
    /// window keeps; it fails only if CUDA cannot create those.
    pub fn device_window(&mut self) -> Result<DeviceWindow<'_>> {
        let handle = self.as_raw() as u64;
        let Window {
            buffer, kernel_arg, ..
        } = self;
        let buffer: &NcclBuffer<T> = buffer;
        let arg = match kernel_arg {
            Some(arg) => arg,
            None => kernel_arg.insert(Tracked::new(&buffer.stream, handle)?),
        };
        // The launches wait for the buffer's earlier uses: the argument's last use is
        // recorded on the buffer's stream once that has waited for them.
        let stream: &CudaStream = &buffer.stream;
        wait_for_buffer(buffer, stream);
        arg.record_on(stream);
        Ok(DeviceWindow {
            handle,
            arg,
            stream,
            _record: SyncOnDrop::record_event(&buffer.write, stream),
        })
    }

    /// The device address of element `offset` of LSA rank `lsa_rank`'s window
    /// (`ncclGetLsaDevicePointer`, NCCL 2.29.2): loads and stores there reach that peer's
    /// memory, for the peer's window's length from `offset`. Local; needs a symmetric
    /// window.
    pub fn lsa_ptr(&self, lsa_rank: usize, offset: usize) -> Result<PeerPtr<'_, T>> {
        let rank = to_int("LSA rank", lsa_rank)?;
        // The peer's size is known by its world rank; where the registration learnt none,
        // this rank's own stands for it.
        let limit = if self.peer_bytes.is_empty() {
            self.len()
        } else {
            let world = self.lsa_world_rank(lsa_rank)?;
            self.peer_len(world).unwrap_or(self.len())
        };
        self.query_ptr(
            &calls::ncclGetLsaDevicePointer,
            Query::Lsa(rank),
            offset,
            limit,
        )
    }

    /// The device address of element `offset` of world rank `peer`'s window, which must be
    /// in this rank's LSA team (`ncclGetPeerDevicePointer`, NCCL 2.29.2), for the peer's
    /// window's length from `offset`. Local.
    pub fn peer_ptr(&self, peer: usize, offset: usize) -> Result<PeerPtr<'_, T>> {
        let rank = to_int("peer", peer)?;
        if peer >= self.comm().size() {
            return Err(Error::invalid(format!(
                "peer {peer} is not a rank of this communicator of {}",
                self.comm().size()
            )));
        }
        let limit = self.peer_len(peer).unwrap_or(self.len());
        self.query_ptr(
            &calls::ncclGetPeerDevicePointer,
            Query::Peer(rank),
            offset,
            limit,
        )
    }

    /// The multicast address of element `offset` over the LSA team
    /// (`ncclGetLsaMultimemDevicePointer`, NCCL 2.29.2), for the smallest of the team's
    /// windows from `offset` (a multicast store reaches every one): [`Error::Unavailable`]
    /// where the communicator has no multicast (NVLS off), as on hosts without NVSwitch.
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
        let mut limit = self.len();
        if !self.peer_bytes.is_empty() {
            for lsa_rank in 0..self.comm().lsa_team()?.size {
                let world = self.lsa_world_rank(lsa_rank)?;
                limit = limit.min(self.peer_len(world).unwrap_or(limit));
            }
        }
        self.query_ptr(
            &calls::ncclGetLsaMultimemDevicePointer,
            Query::LsaMultimem,
            offset,
            limit,
        )
    }

    /// The world rank of LSA rank `lsa_rank` of this rank's team (`ncclTeamRankToWorld`).
    fn lsa_world_rank(&self, lsa_rank: usize) -> Result<usize> {
        let comm = self.comm();
        comm.team_rank_to_world(comm.lsa_team()?, lsa_rank)
    }

    /// Asks NCCL for the address of element `offset` of a window `limit` elements long.
    fn query_ptr(
        &self,
        row: &'static Call,
        query: Query,
        offset: usize,
        limit: usize,
    ) -> Result<PeerPtr<'_, T>> {
        let lib = self.comm().library();
        lib.require_call(row)?;
        // NCCL takes offsets inside this rank's own window (`ncclDevrGetLsaRankPtr` checks
        // the offset against the local window's size, 2.29 to 2.30.7), whatever the target's.
        if offset >= self.len() {
            return Err(Error::invalid(format!(
                "offset {offset} is not inside this rank's window of {} elements (NCCL \
                 resolves offsets within the local window)",
                self.len()
            )));
        }
        if offset >= limit {
            return Err(Error::invalid(format!(
                "offset {offset} is past the target window's {limit} elements"
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
        let buffer: &NcclBuffer<T> = &self.buffer;
        Ok(PeerPtr {
            addr: out as u64,
            len: limit - offset,
            arg: Tracked::new(&buffer.stream, out as u64)?,
            buffer,
        })
    }
}

fn to_int(what: &str, value: usize) -> Result<c_int> {
    c_int::try_from(value)
        .map_err(|_| Error::invalid(format!("{what} {value} does not fit a C int")))
}
