//! Releasing and restoring a communicator's dynamic GPU memory: [`Comm::suspend`],
//! [`Comm::resume`] and [`Comm::mem_stats`] (`ncclCommSuspend`, `ncclCommResume`,
//! `ncclCommMemStats`, NCCL 2.29.7).
//!
//! The rules, from NCCL's source, are on [`Comm::suspend`].

use std::fmt;

use nccl_sys::ncclCommMemStat_t;

use super::Comm;
use crate::calls;
use crate::error::{Error, Result};
use crate::thread_group;

/// What NCCL reports about a communicator's GPU memory (`ncclCommMemStats`), in bytes.
///
/// NCCL counts what its memory manager tracks; a communicator NCCL created without one
/// reports zeros. The byte counts are of allocations, not of what is mapped now: they stay
/// the same while suspended, and [`MemStats::suspended`] says whether the suspendable part
/// is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemStats {
    /// Memory [`Comm::suspend`] releases (`ncclStatGpuMemSuspend`: scratch and offload
    /// buffers).
    pub suspendable: u64,
    /// Whether that memory is released now (`ncclStatGpuMemSuspended`).
    pub suspended: bool,
    /// Memory that stays allocated while suspended (`ncclStatGpuMemPersist`).
    pub persistent: u64,
    /// Everything NCCL's memory manager tracks for the communicator (`ncclStatGpuMemTotal`).
    pub total: u64,
}

impl MemStats {
    /// The bytes mapped on the GPU now: the total, less the suspendable part while it is
    /// released.
    pub fn resident(&self) -> u64 {
        if self.suspended {
            self.total.saturating_sub(self.suspendable)
        } else {
            self.total
        }
    }
}

impl fmt::Display for MemStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} suspendable{}, {} persistent, {} total",
            Bytes(self.suspendable),
            if self.suspended { " (released)" } else { "" },
            Bytes(self.persistent),
            Bytes(self.total)
        )
    }
}

/// A byte count written in binary units, e.g. `512.0 MiB`.
pub(crate) struct Bytes(pub(crate) u64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
        let mut value = self.0 as f64;
        let mut unit = 0;
        while value >= 1024.0 && unit + 1 < UNITS.len() {
            value /= 1024.0;
            unit += 1;
        }
        if unit == 0 {
            write!(f, "{} B", self.0)
        } else {
            write!(f, "{value:.1} {}", UNITS[unit])
        }
    }
}

impl Comm {
    /// Releases the communicator's dynamic GPU memory (`ncclCommSuspend` with
    /// `NCCL_SUSPEND_MEM`, NCCL 2.29.7), e.g. between a training and an inference phase or
    /// around a weight swap, until [`Comm::resume`].
    ///
    /// Collective and device-synchronising: every rank calls it, from its own thread, with
    /// nothing outstanding on the communicator; see below for what NCCL does and what is
    /// refused meanwhile ([`Error::Suspended`]). Fails with
    /// [`Error::Unsupported`] before NCCL 2.29.7, and with [`Error::InvalidUsage`] (nothing
    /// called) on a communicator already suspended or while a [`Group`](crate::Group) is
    /// open on this thread (NCCL would add the suspend to that group).
    ///
    /// # Rules
    ///
    /// What NCCL does (`src/mem_manager.cc`, 2.29.7 to 2.30.7), and what this room makes of it:
    ///
    /// * Both calls are **collective**: suspend synchronises the whole device
    ///   (`cudaDeviceSynchronize`) and then waits for every rank at a bootstrap barrier before
    ///   unmapping its buffers; resume re-creates them, exchanges the new handles with every rank
    ///   and ends with two more barriers. Every rank calls them, each rank from its own thread
    ///   (one thread driving several ranks would wait at the first barrier for ranks it has not
    ///   called yet), and only once nothing is outstanding on the communicator. Work of other
    ///   communicators on the same GPU is waited for too, so it must be able to finish without
    ///   this rank.
    /// * `NCCL_SUSPEND_MEM` is the only thing NCCL can suspend (2.29.7 to 2.32): "scratch"
    ///   buffers are unmapped, "offload" buffers are first copied to host memory; buffers NCCL
    ///   marks persistent stay. The virtual addresses are kept, so pointers NCCL handed out stay
    ///   valid once resumed.
    /// * While suspended, NCCL allows no use of the communicator. This crate refuses every call
    ///   on it before NCCL sees it ([`Error::Suspended`]), except the queries (rank, size,
    ///   device, asynchronous error, properties, [`Comm::mem_stats`]), [`Comm::resume`],
    ///   [`Comm::abort`] and [`Comm::destroy`]: operations, groups, window and buffer
    ///   registration and deregistration (a window or registration dropped meanwhile leaks
    ///   rather than being freed while NCCL cannot take it back), split, shrink, grow, revoke and
    ///   finalize all get the error; so do creating and destroying a device communicator
    ///   (`ncclDevCommDestroy` deregisters its resource window), and one dropped meanwhile
    ///   leaks the same way. The check is per rank: each rank's `Comm` knows whether it
    ///   was suspended; a rank that goes on while its peers are suspended is refused locally,
    ///   and a rank that suspends while its peers do not waits for them at NCCL's barrier.
    /// * A second suspend, and a resume of a communicator that is not suspended, are refused
    ///   here (NCCL would refuse them too, with `ncclInvalidUsage`, which counts as fatal).
    /// * Dropping a suspended communicator aborts it at once: nothing can be outstanding, and
    ///   an orderly destroy would gain nothing, so the drop stays bounded.
    /// * NCCL refuses both calls on a communicator that shares resources with another
    ///   (`CommConfig::split_share`, on the parent and the child) and when the memory manager is
    ///   off (`NCCL_DISABLE_MEM_MANAGER=1`), with `ncclInvalidUsage`.
    pub fn suspend(&self) -> Result<()> {
        self.lib.require_call(&calls::ncclCommSuspend)?;
        thread_group::ensure_outside("Comm::suspend")?;
        if self.shared.lock().suspended {
            return Err(Error::usage(format!(
                "Comm::suspend on rank {}: the communicator is already suspended",
                self.rank
            )));
        }
        let flags = nccl_sys::NCCL_SUSPEND_MEM;
        // SAFETY: live handle under its lock; `flags` holds only NCCL_SUSPEND_MEM.
        let result = unsafe { comm_call!(self, |raw| ncclCommSuspend(raw, flags)) };
        match &result {
            Ok(()) => self.shared.lock().suspended = true,
            // Where a failed suspend left the memory, NCCL's own flag says.
            Err(_) => self.note_suspended_from_nccl(),
        }
        result
    }

    /// Restores what [`Comm::suspend`] released (`ncclCommResume`, NCCL 2.29.7), at the same
    /// addresses; the communicator then works as before.
    ///
    /// Collective: every rank calls it, from its own thread. Fails with
    /// [`Error::InvalidUsage`] (nothing called) unless the communicator is suspended, and
    /// with [`Error::Unsupported`] before NCCL 2.29.7.
    pub fn resume(&self) -> Result<()> {
        self.lib.require_call(&calls::ncclCommResume)?;
        thread_group::ensure_outside("Comm::resume")?;
        if !self.shared.lock().suspended {
            return Err(Error::usage(format!(
                "Comm::resume on rank {}: the communicator is not suspended (Comm::suspend \
                 first)",
                self.rank
            )));
        }
        // SAFETY: live handle under its lock; no other argument.
        let result = unsafe { comm_call!(self, |raw| ncclCommResume(raw)) };
        match &result {
            Ok(()) => self.shared.lock().suspended = false,
            Err(_) => self.note_suspended_from_nccl(),
        }
        result
    }

    /// Whether this rank's communicator is suspended ([`Comm::suspend`]).
    pub fn is_suspended(&self) -> bool {
        self.shared.lock().suspended
    }

    /// NCCL's figures for the communicator's GPU memory (`ncclCommMemStats`, NCCL 2.29.7).
    /// A local query: allowed while suspended, and after a failure while the communicator
    /// is still allocated. [`Error::Unsupported`] before NCCL 2.29.7.
    pub fn mem_stats(&self) -> Result<MemStats> {
        self.lib.require_call(&calls::ncclCommMemStats)?;
        Ok(MemStats {
            suspendable: self.mem_stat(ncclCommMemStat_t::ncclStatGpuMemSuspend)?,
            suspended: self.mem_stat(ncclCommMemStat_t::ncclStatGpuMemSuspended)? != 0,
            persistent: self.mem_stat(ncclCommMemStat_t::ncclStatGpuMemPersist)?,
            total: self.mem_stat(ncclCommMemStat_t::ncclStatGpuMemTotal)?,
        })
    }

    fn mem_stat(&self, stat: ncclCommMemStat_t) -> Result<u64> {
        let mut value = 0u64;
        // SAFETY: live handle under its lock; `stat` is one of NCCL's four values and
        // `value` a valid out-pointer for the call.
        unsafe { comm_call!(self, |raw| ncclCommMemStats(raw, stat, &mut value)) }?;
        Ok(value)
    }

    /// After a failed suspend or resume: takes NCCL's own word for whether the memory is
    /// released, or, if NCCL cannot say, keeps the communicator refused for work (resume,
    /// queries and tear-down stay possible).
    #[cold]
    fn note_suspended_from_nccl(&self) {
        let suspended = self
            .mem_stat(ncclCommMemStat_t::ncclStatGpuMemSuspended)
            .map(|flag| flag != 0)
            .unwrap_or(true);
        self.shared.lock().suspended = suspended;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_read_in_binary_units() {
        assert_eq!(Bytes(0).to_string(), "0 B");
        assert_eq!(Bytes(1023).to_string(), "1023 B");
        assert_eq!(Bytes(1536).to_string(), "1.5 KiB");
        assert_eq!(Bytes(512 << 20).to_string(), "512.0 MiB");
        assert_eq!(Bytes(3 << 30).to_string(), "3.0 GiB");
        assert_eq!(Bytes(u64::MAX).to_string(), "16777216.0 TiB");
    }

    #[test]
    fn stats_say_what_is_resident() {
        let mut stats = MemStats {
            suspendable: 512 << 20,
            suspended: false,
            persistent: 64 << 20,
            total: 576 << 20,
        };
        assert_eq!(stats.resident(), 576 << 20);
        assert_eq!(
            stats.to_string(),
            "512.0 MiB suspendable, 64.0 MiB persistent, 576.0 MiB total"
        );
        stats.suspended = true;
        assert_eq!(stats.resident(), 64 << 20);
        assert!(stats
            .to_string()
            .contains("512.0 MiB suspendable (released)"));
    }
}
