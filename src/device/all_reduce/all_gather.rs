//! The all-gather kernel [`LsaAllReduce`] ships beside its all-reduce: each rank's message
//! into every rank's output, the bits exactly as sent, through the instance's scratch and
//! call counter (a call of the same rotation as the flags all-reduce).

use cudarc::driver::{DevicePtr, DevicePtrMut};

use super::{Kernel, LsaAllReduce, LsaElem};
use crate::error::{Error, Result};

impl<T: LsaElem> LsaAllReduce<'_, T> {
    /// The largest message per rank [`all_gather`](Self::all_gather) takes:
    /// [`max_count`](Self::max_count) / 2 (its lines carry 8 bytes of data in 16).
    pub fn max_gather_count(&self) -> usize {
        self.max_count / 2
    }

    /// Gathers every rank's `send` into `recv` on the communicator's stream: rank r's
    /// elements at `recv[r × n .. (r + 1) × n]` (n = `send.len()`), bit for bit (negative
    /// zeros and NaN payloads included). One kernel: each rank stores its message into every
    /// peer's scratch in NCCL's LL format (8 bytes of data and two copies of the call's flag
    /// per 16-byte line) and copies the peers' lines out as their flags arrive; no barrier.
    ///
    /// `recv` holds `n` × ranks elements and `n` is at most
    /// [`max_gather_count`](Self::max_gather_count); both are refused alike on every rank
    /// that passes them, which changes nothing. Every rank makes the same call, as for the
    /// all-reduce, with the same `n`; a kernel whose peers never come gives up after
    /// [`timeout`](Self::timeout), as the all-reduce's do. Any alignment works (8-byte
    /// aligned buffers with a multiple of 8 bytes per rank take the fast path).
    pub fn all_gather(
        &mut self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let result = self.all_gather_checked(send, recv);
        self.refused_here(result)
    }

    // The body of the call above: its refusals go through `refused_here`.
    fn all_gather_checked(
        &mut self,
        send: &impl DevicePtr<T>,
        recv: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let count = send.len();
        let ranks = self.comm.size();
        if count > self.max_gather_count() {
            return Err(Error::invalid(format!(
                "LsaAllReduce::all_gather takes at most {} elements per rank \
                 (max_gather_count, max_count / 2), not {count}",
                self.max_gather_count()
            )));
        }
        if count.checked_mul(ranks) != Some(recv.len()) {
            return Err(Error::invalid(format!(
                "LsaAllReduce::all_gather: the receive buffer holds {} elements, not the send \
                 buffer's {count} times {ranks} ranks",
                recv.len()
            )));
        }
        self.ready(&[
            (send.stream().context(), "the send buffer"),
            (recv.stream().context(), "the receive buffer"),
        ])?;
        let stream = self.comm.stream();
        let (src, _read) = send.device_ptr(stream);
        let (dst, _written) = recv.device_ptr_mut(stream);
        self.launch(Kernel::AllGather, src, dst, count)
    }
}
