//! Buffers, and issuing one operation through the safe API or through raw nccl-sys calls.
//!
//! Both paths take the same buffers, offsets and arguments; the raw path is what a C program
//! (nccl-tests) does: one `ncclAllReduce(...)` on the raw handle and device pointers, with its
//! result code checked.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{
    sys::CUdeviceptr, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop,
};
use nccl::sys::{self, ncclComm_t, ncclResult_t, NcclLib};
use nccl::{
    Comm, Construction, Group, NcclBuffer, Operation, ReduceOp, Registration, ResultCode, Signal,
    SignalWait, Window, WindowFlags, WindowView, WindowViewMut,
};

use crate::args::Alloc;
use crate::coll::{Coll, Layout};
use crate::elem::Elem;
use crate::vops;
use crate::BenchResult;

/// Which API issues an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// nccl-rs's safe API (`Comm::all_reduce`, `Group`, ...).
    Safe,
    /// Raw nccl-sys calls on `Comm::as_raw`.
    Raw,
    /// The kernels nccl-rs ships (`--lsa`): `LsaAllReduce` with this algorithm.
    Lsa(nccl::device::LsaAlgorithm),
}

impl Api {
    /// Its name in the output.
    pub fn name(self) -> &'static str {
        match self {
            Api::Safe => "safe",
            Api::Raw => "raw",
            Api::Lsa(algorithm) => crate::lsa::name(algorithm),
        }
    }
}

/// Device memory from either allocator, possibly registered with NCCL (`-R`), usable
/// wherever cudarc buffers are. `'c` is the borrow of the communicator (and, for a local
/// registration, of the buffer) that registered memory holds.
pub enum Storage<'c, T: Elem> {
    /// cudarc's allocation.
    Cuda(CudaSlice<T>),
    /// `ncclMemAlloc`.
    Nccl(NcclBuffer<T>),
    /// `ncclMemAlloc`, registered with `Comm::register` (`-R 1`).
    Registered(Registration<'c, T>),
    /// `ncclMemAlloc`, registered as a symmetric window (`-R 2`).
    Window(Window<'c, T>),
}

impl<'c, T: Elem> Storage<'c, T> {
    /// `len` zeroed elements on the device of `stream`.
    pub fn alloc(stream: &Arc<CudaStream>, len: usize, alloc: Alloc) -> BenchResult<Self> {
        Ok(match alloc {
            Alloc::Cuda => Storage::Cuda(stream.alloc_zeros(len)?),
            Alloc::Nccl => Storage::Nccl(NcclBuffer::alloc_zeros(stream, len)?),
        })
    }

    /// Elements `offset..offset + len`, for reading: a window view on windows, as a program
    /// using windows passes them.
    #[inline(always)]
    pub fn part(&self, offset: usize, len: usize) -> BenchResult<Part<'_, T>> {
        check_range(self.len(), offset, len)?;
        Ok(match self {
            Storage::Window(window) => Part::Window(window.view(offset..offset + len)?),
            _ => Part::Range {
                buf: self,
                offset,
                len,
            },
        })
    }

    /// Elements `offset..offset + len`, for writing.
    #[inline(always)]
    pub fn part_mut(&mut self, offset: usize, len: usize) -> BenchResult<PartMut<'_, 'c, T>> {
        check_range(self.len(), offset, len)?;
        Ok(match self {
            Storage::Window(window) => PartMut::Window(window.view_mut(offset..offset + len)?),
            _ => PartMut::Range {
                buf: self,
                offset,
                len,
            },
        })
    }
}

#[inline]
pub fn check_range(buffer: usize, offset: usize, len: usize) -> BenchResult<()> {
    match offset.checked_add(len) {
        Some(end) if end <= buffer => Ok(()),
        _ => Err(format!(
            "internal error: elements {offset}..+{len} lie outside a buffer of {buffer}"
        )
        .into()),
    }
}

/// Forwards a cudarc trait method to whichever buffer a [`Storage`] holds. The forwarding
/// methods here are inlined: they stand for a program's own `slice.slice(..)`, which the raw
/// path does without, and should not weigh on the safe column as calls of their own.
macro_rules! each {
    ($self:expr, $b:ident => $call:expr) => {
        match $self {
            Storage::Cuda($b) => $call,
            Storage::Nccl($b) => $call,
            Storage::Registered($b) => $call,
            Storage::Window($b) => $call,
        }
    };
}

impl<T: Elem> DeviceSlice<T> for Storage<'_, T> {
    #[inline]
    fn len(&self) -> usize {
        each!(self, b => b.len())
    }
    #[inline]
    fn stream(&self) -> &Arc<CudaStream> {
        each!(self, b => b.stream())
    }
}

impl<T: Elem> DevicePtr<T> for Storage<'_, T> {
    #[inline(always)]
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        each!(self, b => b.device_ptr(stream))
    }
}

impl<T: Elem> DevicePtrMut<T> for Storage<'_, T> {
    #[inline(always)]
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        each!(self, b => b.device_ptr_mut(stream))
    }
}

/// A range of a [`Storage`] for reading (`NcclBuffer` has no views of its own; windows
/// do). Uses of a range are tracked by the whole buffer's events.
pub enum Part<'a, T: Elem> {
    /// A range of any other buffer.
    Range {
        buf: &'a Storage<'a, T>,
        offset: usize,
        len: usize,
    },
    /// A view of a window.
    Window(WindowView<'a, T>),
}

/// A range of a [`Storage`] for writing.
pub enum PartMut<'a, 'c, T: Elem> {
    /// A range of any other buffer.
    Range {
        buf: &'a mut Storage<'c, T>,
        offset: usize,
        len: usize,
    },
    /// A view of a window.
    Window(WindowViewMut<'a, T>),
}

pub fn offset_bytes<T>(elements: usize) -> CUdeviceptr {
    (elements * std::mem::size_of::<T>()) as CUdeviceptr
}

impl<T: Elem> DeviceSlice<T> for Part<'_, T> {
    #[inline]
    fn len(&self) -> usize {
        match self {
            Part::Range { len, .. } => *len,
            Part::Window(view) => view.len(),
        }
    }
    #[inline]
    fn stream(&self) -> &Arc<CudaStream> {
        match self {
            Part::Range { buf, .. } => buf.stream(),
            Part::Window(view) => view.stream(),
        }
    }
}

impl<T: Elem> DevicePtr<T> for Part<'_, T> {
    #[inline(always)]
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            Part::Range { buf, offset, .. } => {
                let (ptr, guard) = buf.device_ptr(stream);
                (ptr + offset_bytes::<T>(*offset), guard)
            }
            Part::Window(view) => view.device_ptr(stream),
        }
    }
}

impl<T: Elem> DeviceSlice<T> for PartMut<'_, '_, T> {
    #[inline]
    fn len(&self) -> usize {
        match self {
            PartMut::Range { len, .. } => *len,
            PartMut::Window(view) => view.len(),
        }
    }
    #[inline]
    fn stream(&self) -> &Arc<CudaStream> {
        match self {
            PartMut::Range { buf, .. } => buf.stream(),
            PartMut::Window(view) => view.stream(),
        }
    }
}

impl<T: Elem> DevicePtr<T> for PartMut<'_, '_, T> {
    #[inline(always)]
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            PartMut::Range { buf, offset, .. } => {
                let (ptr, guard) = buf.device_ptr(stream);
                (ptr + offset_bytes::<T>(*offset), guard)
            }
            PartMut::Window(view) => view.device_ptr(stream),
        }
    }
}

impl<T: Elem> DevicePtrMut<T> for PartMut<'_, '_, T> {
    #[inline(always)]
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            PartMut::Range { buf, offset, .. } => {
                let offset = offset_bytes::<T>(*offset);
                let (ptr, guard) = buf.device_ptr_mut(stream);
                (ptr + offset, guard)
            }
            PartMut::Window(view) => view.device_ptr_mut(stream),
        }
    }
}

/// A rank's send and receive buffers (the same length), with their device addresses (and
/// the receive window's handle) for the raw path.
pub struct Buffers<'c, T: Elem> {
    /// The send buffer.
    pub send: Storage<'c, T>,
    /// The receive buffer (also the buffer of in-place operations).
    pub recv: Storage<'c, T>,
    send_ptr: CUdeviceptr,
    recv_ptr: CUdeviceptr,
    /// The receive window's handle with `-R 2`: where the raw path's puts go.
    recv_window: Option<sys::ncclWindow_t>,
    /// The shipped all-reduce kernels (`--lsa`).
    pub lsa: Option<Box<dyn crate::lsa::LsaIssue<T> + 'c>>,
}

impl<'c, T: Elem> Buffers<'c, T> {
    /// Two zeroed buffers of `len` elements, not registered.
    pub fn alloc(stream: &Arc<CudaStream>, len: usize, alloc: Alloc) -> BenchResult<Self> {
        let send = Storage::alloc(stream, len, alloc)?;
        let recv = Storage::alloc(stream, len, alloc)?;
        Ok(Self::new(stream, send, recv))
    }

    /// `send` and `recv` (from `ncclMemAlloc`) registered with `comm` (`-R 1`); they stay
    /// borrowed while registered.
    pub fn registered(
        comm: &'c Comm,
        send: &'c mut NcclBuffer<T>,
        recv: &'c mut NcclBuffer<T>,
    ) -> BenchResult<Self> {
        let send = Storage::Registered(comm.register(send)?);
        let recv = Storage::Registered(comm.register(recv)?);
        Ok(Self::new(comm.stream(), send, recv))
    }

    /// Two zeroed buffers of `len` elements from `ncclMemAlloc`, each registered as a
    /// symmetric window on `comm` (`-R 2`), as nccl-tests registers its send and receive
    /// buffers.
    pub fn windows(comm: &'c Comm, len: usize) -> BenchResult<Self> {
        let window = |len| -> BenchResult<Window<'c, T>> {
            let buffer = NcclBuffer::alloc_zeros(comm.stream(), len)?;
            Ok(comm
                .register_window(buffer, WindowFlags::COLL_SYMMETRIC)
                .map_err(nccl::Error::from)?)
        };
        let send = window(len)?;
        let recv = window(len)?;
        let recv_window = Some(recv.as_raw());
        let mut bufs = Self::new(comm.stream(), Storage::Window(send), Storage::Window(recv));
        bufs.recv_window = recv_window;
        Ok(bufs)
    }

    fn new(stream: &Arc<CudaStream>, send: Storage<'c, T>, mut recv: Storage<'c, T>) -> Self {
        let send_ptr = send.device_ptr(stream).0;
        let recv_ptr = recv.device_ptr_mut(stream).0;
        Buffers {
            send,
            recv,
            send_ptr,
            recv_ptr,
            recv_window: None,
            lsa: None,
        }
    }

    /// Elements in each buffer.
    pub fn len(&self) -> usize {
        self.send.len()
    }

    /// The device addresses of the send and receive buffers, for raw calls.
    pub fn raw_ptrs(&self) -> (CUdeviceptr, CUdeviceptr) {
        (self.send_ptr, self.recv_ptr)
    }
}

/// One operation as both APIs issue it: the collective, its layout and arguments.
pub struct Issuer {
    /// The collective.
    pub coll: Coll,
    /// Its buffer layout at the current size.
    pub layout: Layout,
    /// The reduction (ignored by collectives without one).
    pub op: ReduceOp,
    /// The root of broadcast and reduce.
    pub root: usize,
    /// This rank.
    pub rank: usize,
    /// The number of ranks.
    pub n: usize,
    /// Issue raw calls for [`Api::Safe`] too (`--control`).
    pub control: bool,
    /// The construction of all_gather_v (`--construction`).
    pub construction: Construction,
    raw: RawComm,
}

/// What the raw path needs, fetched once outside the timed loops.
#[derive(Clone, Copy)]
pub struct RawComm {
    /// The library's functions.
    pub lib: &'static NcclLib,
    /// The communicator's raw handle.
    pub comm: ncclComm_t,
    /// Its stream.
    pub stream: sys::cudaStream_t,
}

impl Issuer {
    /// An issuer for `comm` (which must outlive it and stay un-aborted while it is used).
    pub fn new(comm: &Comm, coll: Coll, layout: Layout, op: ReduceOp, root: usize) -> Self {
        // SAFETY: the handle is only used by `issue_raw` while the communicator is alive (the
        // benchmark keeps it until every measurement is over), never to destroy or abort it,
        // and from this thread only, never concurrently with calls through `comm`.
        let raw_comm = unsafe { comm.as_raw() };
        Issuer {
            coll,
            layout,
            op,
            root,
            rank: comm.rank(),
            n: comm.size(),
            control: false,
            construction: Construction::Auto,
            raw: RawComm {
                lib: comm.library().api(),
                comm: raw_comm,
                stream: comm.stream().cu_stream() as sys::cudaStream_t,
            },
        }
    }

    /// What the raw path needs.
    pub fn raw(&self) -> &RawComm {
        &self.raw
    }

    /// Issues the operation on `comm`'s stream, in place or not, with every buffer starting
    /// `shift` elements into the buffers.
    pub fn issue<T: Elem>(
        &self,
        api: Api,
        comm: &Comm,
        bufs: &mut Buffers<'_, T>,
        in_place: bool,
        shift: usize,
    ) -> BenchResult<()> {
        match api {
            Api::Safe if !self.control => self.issue_safe(comm, bufs, in_place, shift),
            Api::Safe | Api::Raw => self.issue_raw(bufs, in_place, shift),
            Api::Lsa(algorithm) => {
                let Layout {
                    count,
                    send_len,
                    recv_len,
                    ..
                } = self.layout;
                let Buffers {
                    send, recv, lsa, ..
                } = bufs;
                let lsa = lsa.as_mut().ok_or("--lsa: no LsaAllReduce was created")?;
                if self.coll == Coll::AllGather {
                    if in_place {
                        return Err("--lsa: the all-gather kernel has no in-place form".into());
                    }
                    return lsa.gather(
                        &send.part(shift, send_len)?,
                        &mut recv.part_mut(shift, recv_len)?,
                    );
                }
                let send = (!in_place).then(|| send.part(shift, count)).transpose()?;
                lsa.issue(algorithm, send.as_ref(), &mut recv.part_mut(shift, count)?)
            }
        }
    }

    fn issue_safe<T: Elem>(
        &self,
        comm: &Comm,
        b: &mut Buffers<'_, T>,
        in_place: bool,
        shift: usize,
    ) -> BenchResult<()> {
        let Layout {
            count,
            send_len,
            recv_len,
            ..
        } = self.layout;
        let (op, root) = (self.op, self.root);
        if self.coll.is_v() {
            return vops::issue_safe(self, comm, b, in_place, shift);
        }
        match (self.coll, in_place) {
            (Coll::AllReduce, false) => comm.all_reduce(
                &b.send.part(shift, count)?,
                &mut b.recv.part_mut(shift, count)?,
                op,
            )?,
            (Coll::AllReduce, true) => {
                comm.all_reduce_in_place(&mut b.recv.part_mut(shift, count)?, op)?
            }
            (Coll::AllGather, false) => comm.all_gather(
                &b.send.part(shift, send_len)?,
                &mut b.recv.part_mut(shift, recv_len)?,
            )?,
            (Coll::AllGather, true) => {
                comm.all_gather_in_place(&mut b.recv.part_mut(shift, recv_len)?)?
            }
            (Coll::ReduceScatter, false) => comm.reduce_scatter(
                &b.send.part(shift, send_len)?,
                &mut b.recv.part_mut(shift, recv_len)?,
                op,
            )?,
            (Coll::ReduceScatter, true) => {
                comm.reduce_scatter_in_place(&mut b.recv.part_mut(shift, send_len)?, op)?
            }
            (Coll::Broadcast, false) => {
                let send = b.send.part(shift, count)?;
                comm.broadcast(
                    Some(&send as &dyn DevicePtr<T>),
                    &mut b.recv.part_mut(shift, count)?,
                    root,
                )?
            }
            (Coll::Broadcast, true) => {
                comm.broadcast_in_place(&mut b.recv.part_mut(shift, count)?, root)?
            }
            (Coll::Reduce, false) => {
                let mut recv = b.recv.part_mut(shift, count)?;
                comm.reduce(
                    &b.send.part(shift, count)?,
                    Some(&mut recv as &mut dyn DevicePtrMut<T>),
                    op,
                    root,
                )?
            }
            (Coll::Reduce, true) => {
                comm.reduce_in_place(&mut b.recv.part_mut(shift, count)?, op, root)?
            }
            (Coll::AllToAll, _) => comm.all_to_all(
                &b.send.part(shift, send_len)?,
                &mut b.recv.part_mut(shift, recv_len)?,
            )?,
            (Coll::SendRecv, _) => {
                let send = b.send.part(shift, count)?;
                let mut recv = b.recv.part_mut(shift, count)?;
                let mut group = Group::start()?;
                group.enqueue(comm, Operation::send(&send, (self.rank + 1) % self.n))?;
                group.enqueue(
                    comm,
                    Operation::recv(&mut recv, (self.rank + self.n - 1) % self.n),
                )?;
                group.finish()?
            }
            (Coll::AllToAllV | Coll::AllGatherV | Coll::ReduceScatterV, _) => {
                return Err("internal error: a v-collective on the fixed-size path".into())
            }
            (Coll::PutSignal, _) => {
                let (next, prev) = ((self.rank + 1) % self.n, (self.rank + self.n - 1) % self.n);
                let (Storage::Window(send), Storage::Window(recv)) = (&b.send, &mut b.recv) else {
                    return Err("internal error: the put_signal ring runs on windows only".into());
                };
                // Into the next rank's receive window, named by this rank's handle of it,
                // at the offset the source has in the send window.
                recv.put_signal(
                    &send.view(shift..shift + count)?,
                    next,
                    shift,
                    Signal::default(),
                )?;
                recv.wait_signal(&[SignalWait::new(prev, 1)])?
            }
        }
        Ok(())
    }

    /// NCCL's estimate of the operation's time (`Group::simulate`, `ncclGroupSimulateEnd`),
    /// nothing launched; `None` for the operations a simulation cannot take (point-to-point
    /// and those built from it, v-collectives, one-sided RMA) or a single rank. Every rank
    /// calls it for the same operation, as for a real one.
    pub fn simulate<T: Elem>(
        &self,
        comm: &Comm,
        b: &mut Buffers<'_, T>,
        in_place: bool,
    ) -> BenchResult<Option<std::time::Duration>> {
        let Layout {
            count,
            send_len,
            recv_len,
            ..
        } = self.layout;
        let (op, root) = (self.op, self.root);
        let simulable = matches!(
            self.coll,
            Coll::AllReduce
                | Coll::AllGather
                | Coll::ReduceScatter
                | Coll::Broadcast
                | Coll::Reduce
        );
        if !simulable || self.n < 2 {
            return Ok(None);
        }
        let estimate = match (self.coll, in_place) {
            (Coll::AllReduce, false) => estimate(
                comm,
                Operation::all_reduce(&b.send.part(0, count)?, &mut b.recv.part_mut(0, count)?, op),
            ),
            (Coll::AllReduce, true) => estimate(
                comm,
                Operation::all_reduce_in_place(&mut b.recv.part_mut(0, count)?, op),
            ),
            (Coll::AllGather, false) => estimate(
                comm,
                Operation::all_gather(
                    &b.send.part(0, send_len)?,
                    &mut b.recv.part_mut(0, recv_len)?,
                ),
            ),
            (Coll::AllGather, true) => estimate(
                comm,
                Operation::all_gather_in_place(&mut b.recv.part_mut(0, recv_len)?),
            ),
            (Coll::ReduceScatter, false) => estimate(
                comm,
                Operation::reduce_scatter(
                    &b.send.part(0, send_len)?,
                    &mut b.recv.part_mut(0, recv_len)?,
                    op,
                ),
            ),
            (Coll::ReduceScatter, true) => estimate(
                comm,
                Operation::reduce_scatter_in_place(&mut b.recv.part_mut(0, send_len)?, op),
            ),
            (Coll::Broadcast, false) => {
                let send = b.send.part(0, count)?;
                estimate(
                    comm,
                    Operation::broadcast(
                        Some(&send as &dyn DevicePtr<T>),
                        &mut b.recv.part_mut(0, count)?,
                        root,
                    ),
                )
            }
            (Coll::Broadcast, true) => estimate(
                comm,
                Operation::broadcast_in_place(&mut b.recv.part_mut(0, count)?, root),
            ),
            (Coll::Reduce, false) => {
                let send = b.send.part(0, count)?;
                let mut recv = b.recv.part_mut(0, count)?;
                estimate(
                    comm,
                    Operation::reduce(&send, Some(&mut recv as &mut dyn DevicePtrMut<T>), op, root),
                )
            }
            (Coll::Reduce, true) => estimate(
                comm,
                Operation::reduce_in_place(&mut b.recv.part_mut(0, count)?, op, root),
            ),
            _ => return Ok(None),
        };
        Ok(Some(estimate?))
    }

    fn issue_raw<T: Elem>(
        &self,
        b: &Buffers<'_, T>,
        in_place: bool,
        shift: usize,
    ) -> BenchResult<()> {
        if self.coll.is_v() {
            return vops::issue_raw(self, b, in_place, shift);
        }
        let count = self.layout.count;
        let at = |base: CUdeviceptr, elements: usize| {
            (base + offset_bytes::<T>(elements)) as *mut c_void
        };
        // Every operation stays within `total` elements from `shift` (in place too), which
        // `check_range` confirms, as the safe path's validation does.
        check_range(b.len(), shift, self.layout.span)?;
        // The pointers the safe API computes (and nccl-tests uses) for each in-place form.
        let (send, recv) = if in_place {
            let base = at(b.recv_ptr, shift);
            match self.coll {
                Coll::AllGather => (at(b.recv_ptr, shift + self.rank * count), base),
                Coll::ReduceScatter => (base, at(b.recv_ptr, shift + self.rank * count)),
                _ => (base, base),
            }
        } else {
            (at(b.send_ptr, shift), at(b.recv_ptr, shift))
        };
        let send = send as *const c_void;
        let RawComm { lib, comm, stream } = self.raw;
        let dtype = T::DATA_TYPE.raw();
        let op = self.op.raw();
        let root = self.root as std::os::raw::c_int;
        // SAFETY: `comm` is the live handle of this rank's communicator (see `Issuer::new`),
        // `stream` its live stream; every pointer lies inside a buffer of this rank's device
        // that holds at least `count` elements (per peer where NCCL says so) past it, as
        // checked above; the buffers stay alive and untouched by anything else until the
        // work completes, because the benchmark waits for the stream before using them. For
        // the put ring, `window` is this rank's handle of the receive window, registered on
        // `comm` with COLL_SYMMETRIC for as long as the buffers live, and the put's
        // `count` elements at `shift` fit it (same length as the send window).
        let status = unsafe {
            match self.coll {
                Coll::AllReduce => lib.ncclAllReduce(send, recv, count, dtype, op, comm, stream),
                Coll::AllGather => lib.ncclAllGather(send, recv, count, dtype, comm, stream),
                Coll::ReduceScatter => {
                    lib.ncclReduceScatter(send, recv, count, dtype, op, comm, stream)
                }
                Coll::Broadcast => lib.ncclBroadcast(send, recv, count, dtype, root, comm, stream),
                Coll::Reduce => lib.ncclReduce(send, recv, count, dtype, op, root, comm, stream),
                Coll::AllToAll => lib.ncclAlltoAll(send, recv, count, dtype, comm, stream),
                Coll::SendRecv => {
                    let next = ((self.rank + 1) % self.n) as std::os::raw::c_int;
                    let prev = ((self.rank + self.n - 1) % self.n) as std::os::raw::c_int;
                    raw_check("ncclGroupStart", lib.ncclGroupStart())?;
                    let sent = lib.ncclSend(send, count, dtype, next, comm, stream);
                    let received = lib.ncclRecv(recv, count, dtype, prev, comm, stream);
                    // The group is ended whatever happened to the calls inside it.
                    let ended = lib.ncclGroupEnd();
                    raw_check("ncclSend", sent)?;
                    raw_check("ncclRecv", received)?;
                    ended
                }
                Coll::PutSignal => {
                    let window = b
                        .recv_window
                        .ok_or("internal error: the put_signal ring runs on windows only")?;
                    let next = ((self.rank + 1) % self.n) as std::os::raw::c_int;
                    let prev = ((self.rank + self.n - 1) % self.n) as std::os::raw::c_int;
                    let put = lib.ncclPutSignal(
                        send,
                        count,
                        dtype,
                        next,
                        window,
                        offset_bytes::<T>(shift) as usize,
                        0,
                        0,
                        0,
                        comm,
                        stream,
                    );
                    raw_check("ncclPutSignal", put)?;
                    let mut wait = sys::ncclWaitSignalDesc_t {
                        opCnt: 1,
                        peer: prev,
                        sigIdx: 0,
                        ctx: 0,
                    };
                    lib.ncclWaitSignal(1, &mut wait, comm, stream)
                }
                // Issued by `vops` above.
                Coll::AllToAllV | Coll::AllGatherV | Coll::ReduceScatterV => {
                    return Err("internal error: a v-collective on the fixed-size path".into())
                }
            }
        };
        raw_check(self.coll.name(), status)
    }
}

/// NCCL's estimate for `operation` alone in a simulated group (nothing launched).
fn estimate<'g, T: Elem>(
    comm: &'g Comm,
    operation: Operation<'g, T>,
) -> BenchResult<std::time::Duration> {
    let mut simulation = Group::simulate()?;
    simulation.enqueue(comm, operation)?;
    Ok(simulation.estimate()?)
}

/// Turns a raw call's outcome into a result.
pub fn raw_check(call: &str, status: Result<ncclResult_t, sys::MissingSymbol>) -> BenchResult<()> {
    match status {
        Ok(ncclResult_t::ncclSuccess) => Ok(()),
        Ok(code) => Err(format!("{call} (raw) failed: {}", ResultCode::from_raw(code)).into()),
        Err(missing) => {
            Err(format!("{call} (raw): the NCCL library lacks {}", missing.name).into())
        }
    }
}
