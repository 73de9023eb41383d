//! Continuing with the survivors: revoke, shrink, grow, and the whole recovery in one call.

use std::os::raw::c_int;
use std::ptr;
use std::sync::Arc;

use cudarc::driver::CudaStream;
use nccl_sys::ncclComm_t;

use crate::calls;
use crate::comm::state::{Action, Cause, Failure, FailureState};
use crate::comm::{comm_call, rank_and_size, Comm};
use crate::config::{CommConfig, RawConfig};
use crate::error::{Error, Result};
use crate::id::{UniqueId, UNIQUE_ID_BYTES};
use crate::library;
use crate::thread_group;

/// A survivor's place in the communicator that [`Comm::recover`] builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Survivor {
    /// Its rank among the survivors.
    pub rank: usize,
    /// The number of survivors.
    pub size: usize,
}

/// The survivors' communicator from [`Comm::recover`].
#[derive(Debug)]
pub struct Recovered {
    /// The new communicator, without the failed ranks.
    pub comm: Comm,
    /// `None` when NCCL shrank the old communicator; otherwise the error that made the
    /// shrink impossible, and the communicator was rebuilt from a fresh unique id.
    pub shrink_error: Option<Error>,
}

/// How [`Comm::shrink`] treats the parent's outstanding operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ShrinkMode {
    /// `NCCL_SHRINK_DEFAULT`: the parent must be healthy and idle (planned scale-down).
    #[default]
    Default,
    /// `NCCL_SHRINK_ABORT`: first abort the parent's outstanding operations (recovery after a
    /// failure). The child shares no resources with the parent.
    Abort,
}

impl ShrinkMode {
    fn raw(self) -> c_int {
        match self {
            ShrinkMode::Default => nccl_sys::NCCL_SHRINK_DEFAULT,
            ShrinkMode::Abort => nccl_sys::NCCL_SHRINK_ABORT,
        }
    }
}

/// This rank's place among the survivors when the ranks in `failed` are gone: ranks keep
/// their order, as `ncclCommShrink` numbers them.
fn survivor_of(rank: usize, size: usize, failed: &[usize]) -> Result<Survivor> {
    exclude_list(failed, rank, size)?;
    Ok(Survivor {
        rank: rank - failed.iter().filter(|&&r| r < rank).count(),
        size: size - failed.len(),
    })
}

/// Checks a shrink's exclusion list and converts it for NCCL (sorted, as NCCL wants it).
pub(crate) fn exclude_list(exclude: &[usize], rank: usize, size: usize) -> Result<Vec<c_int>> {
    if exclude.is_empty() {
        return Err(Error::invalid(
            "shrink needs at least one rank to exclude (NCCL refuses an empty list)",
        ));
    }
    let mut list = Vec::with_capacity(exclude.len());
    for &excluded in exclude {
        if excluded >= size {
            return Err(Error::invalid(format!(
                "cannot exclude rank {excluded} from a communicator of {size} ranks"
            )));
        }
        if excluded == rank {
            return Err(Error::invalid(format!(
                "rank {rank} excludes itself: excluded ranks must not call shrink"
            )));
        }
        // `excluded < size`, and sizes fit a C int (NCCL reported them as one).
        list.push(
            c_int::try_from(excluded)
                .map_err(|_| Error::invalid(format!("rank {excluded} does not fit a C int")))?,
        );
    }
    list.sort_unstable();
    if let Some(pair) = list.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(Error::invalid(format!(
            "rank {} is excluded twice",
            pair[0]
        )));
    }
    Ok(list)
}

/// Checks the new size of a grow.
pub(crate) fn grow_size(old: usize, new: usize) -> Result<c_int> {
    if new <= old {
        return Err(Error::invalid(format!(
            "grow must add ranks: the communicator has {old}, the new size is {new}"
        )));
    }
    c_int::try_from(new)
        .map_err(|_| Error::invalid(format!("communicator size {new} does not fit a C int")))
}

impl Comm {
    /// Revokes the communicator (`ncclCommRevoke`, NCCL 2.28.7): stops the operations in
    /// flight, waits (up to [`Comm::ready_timeout`]) until it is quiescent, and leaves it
    /// valid for [`Comm::shrink`], [`Comm::split`], abort and destroy. New operations and
    /// [`Comm::finalize`] are refused afterwards. Revoking again is a no-op. A revoke still
    /// in progress when the timeout runs out aborts the communicator ([`Error::Timeout`]
    /// says so): nothing may touch it while NCCL still works on it.
    ///
    /// This is a local call: each rank revokes its own communicator.
    pub fn revoke(&self) -> Result<()> {
        self.library().require_call(&calls::ncclCommRevoke)?;
        thread_group::ensure_outside("Comm::revoke")?;
        {
            let mut state = self.shared().lock();
            state.usable_for(&calls::ncclCommRevoke, self.rank())?;
            let revoked = state
                .failure
                .as_ref()
                .is_some_and(|f| f.state >= FailureState::Revoked);
            if !revoked {
                let _ = self.context().bind_to_thread();
                state.run(
                    self.library(),
                    self.context(),
                    &self.who(),
                    Action::Revoke,
                    Failure::owner(FailureState::Revoked),
                )?;
            }
        }
        // A revoke still in progress after the timeout is aborted, as every other
        // nonblocking call is: nothing may touch the communicator while NCCL works on it.
        self.poll_in_progress(
            "ncclCommRevoke to complete",
            Some(self.ready_timeout()),
            false,
        )
        .map(drop)
        .map_err(|err| self.abandon_in_progress(err))
    }

    /// Builds a communicator of the surviving ranks (`ncclCommShrink`, NCCL 2.27): every
    /// rank of this communicator except those in `exclude` must call it, with the same
    /// list; ranks are renumbered in order, filling the gaps. The child uses this
    /// communicator's stream and, without `config`, inherits its configuration.
    ///
    /// With [`ShrinkMode::Abort`] NCCL first aborts the operations outstanding on this
    /// communicator (work stuck waiting for a dead rank). Afterwards this communicator must
    /// still be aborted or destroyed. Shrinking is allowed after a failure was recorded
    /// (watchdog [`Report`](crate::WatchdogAction::Report) or [`Comm::revoke`]), not after an abort.
    pub fn shrink(
        &self,
        exclude: &[usize],
        mode: ShrinkMode,
        config: Option<&CommConfig>,
    ) -> Result<Comm> {
        let lib = self.library();
        lib.require_call(&calls::ncclCommShrink)?;
        thread_group::ensure_outside("Comm::shrink")?;
        let mut list = exclude_list(exclude, self.rank(), self.size())?;
        let count =
            c_int::try_from(list.len()).map_err(|_| Error::invalid("too many ranks to exclude"))?;
        let child_config = self.child_config(config);
        let mut raw_config = RawConfig::inherit_or(config, lib)?;
        let cfg_ptr = raw_config.as_mut_ptr();
        if mode == ShrinkMode::Abort {
            // NCCL aborts only its own operations, after waiting for the stream work queued
            // before its last one: this crate's kernels are stopped first (see
            // `State::stop_kernels`).
            let _ = self.context().bind_to_thread();
            self.shared().lock().stop_kernels();
        }
        // The exclude list goes with the call: NCCL may read it from its background job.
        let list_ptr = list.as_mut_ptr();
        let child = self.create_child(
            &calls::ncclCommShrink,
            self.stream().clone(),
            &child_config,
            true,
            list,
            |raw, child| {
                // SAFETY: live parent handle under its lock; `list` holds `count` ranks and
                // outlives the parent's settling in `create_child`; `child` stays valid until
                // NCCL's job wrote it; `cfg_ptr` is null or an initialised config alive until
                // the call returns.
                unsafe {
                    lib.api()
                        .ncclCommShrink(raw, list_ptr, count, child, cfg_ptr, mode.raw())
                }
            },
        );
        expect_child(child, calls::ncclCommShrink.name)
    }

    /// Builds the communicator of the survivors after the ranks in `failed` died, and
    /// aborts this one. Called by every survivor, with the same `failed` list.
    ///
    /// First it tries [`Comm::shrink`] with [`ShrinkMode::Abort`], NCCL's fast path that
    /// reuses this communicator's connections. NCCL cannot always take it: it refuses to
    /// shrink a communicator whose asynchronous error is set (in every version up to 2.32,
    /// `ncclCommShrink` checks the parent with the same test as any other call, after clearing
    /// the abort flag that would skip it), which is what a dead peer leaves behind when ranks
    /// talk over the network (`ncclRemoteError` from the socket or IB transport); NVLink peers
    /// usually just stall, and then shrinking works. A library older than 2.27 has no shrink
    /// at all. In those cases the survivors start over: this communicator is aborted, survivor
    /// 0 creates a fresh [`UniqueId`], `share_id` hands it to every survivor (exactly as for a
    /// first start: rank 0 passes `Some(id)` and gets it back, the others pass `None` and get
    /// rank 0's; see [`crate::bootstrap`]), and all of them initialise a new communicator.
    ///
    /// Either way this communicator is aborted afterwards (its calls then fail, and dropping
    /// it does nothing), and the survivors keep their order: survivor ranks are numbered from 0 in the
    /// order of their old ranks, as `ncclCommShrink` numbers them. The new communicator uses
    /// `config`, or this one's blocking mode and ready timeout. [`Recovered::shrink_error`]
    /// says which way was taken.
    ///
    /// If only some survivors can shrink, the others wait in the shrink until the new
    /// communicator's ready timeout expires and then rebuild too; `share_id` must therefore
    /// wait at least that long for survivor 0. With a blocking communicator that wait has no
    /// bound, so recovery needs nonblocking communicators (as detecting the failure does).
    ///
    /// `failed` is checked first (non-empty, in range, without this rank, no duplicates): a
    /// bad list returns [`Error::InvalidArgument`] and leaves this communicator as it was.
    ///
    /// ```no_run
    /// # use nccl::{bootstrap::FileRendezvous, Comm, CommConfig};
    /// # fn f(comm: Comm, dead: usize) -> nccl::Result<()> {
    /// let config = CommConfig::new().blocking(false);
    /// let recovered = comm.recover(&[dead], Some(&config), |survivor, id| {
    ///     let rendezvous = FileRendezvous::new("/tmp/job-42", survivor.rank, survivor.size)
    ///         .with_job_key("after-failure-1");
    ///     Ok(rendezvous.exchange(id)?)
    /// })?;
    /// if let Some(why) = &recovered.shrink_error {
    ///     eprintln!("rebuilt the communicator: NCCL could not shrink it ({why})");
    /// }
    /// let comm = recovered.comm;
    /// # Ok(()) }
    /// ```
    pub fn recover(
        &self,
        failed: &[usize],
        config: Option<&CommConfig>,
        share_id: impl FnOnce(Survivor, Option<UniqueId>) -> Result<UniqueId>,
    ) -> Result<Recovered> {
        thread_group::ensure_outside("Comm::recover")?;
        let survivor = survivor_of(self.rank(), self.size(), failed)?;
        let stream = self.stream().clone();
        let child_config = self.child_config(config);
        let shrink_error = match self.shrink(failed, ShrinkMode::Abort, config) {
            Ok(comm) => {
                // The parent's resources are still held; NCCL leaves freeing them to us.
                let _ = self.abort_in_place(Cause::Requested);
                return Ok(Recovered {
                    comm,
                    shrink_error: None,
                });
            }
            Err(err) => err,
        };
        // Its kernels may still spin on the stream the new communicator will use: abort them
        // first. The parent is dead either way; what its abort reports changes nothing.
        let _ = self.abort_in_place(Cause::Requested);
        let fresh = if survivor.rank == 0 {
            Some(UniqueId::new()?)
        } else {
            None
        };
        let id = share_id(survivor, fresh)?;
        let comm =
            Comm::init_rank_with_config(stream, &id, survivor.rank, survivor.size, &child_config)?;
        Ok(Recovered {
            comm,
            shrink_error: Some(shrink_error),
        })
    }

    /// A unique id for growing this communicator (`ncclCommGetUniqueId`, NCCL 2.29). Called
    /// on one existing rank (the coordinator), which passes it to [`Comm::grow`] and sends
    /// it to the new ranks for [`Comm::join_grow`]. Each id can be used for one grow only.
    pub fn get_unique_id_for_grow(&self) -> Result<UniqueId> {
        let lib = self.library();
        lib.require_call(&calls::ncclCommGetUniqueId)?;
        thread_group::ensure_outside("Comm::get_unique_id_for_grow")?;
        let mut id = nccl_sys::ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: live handle under its lock; `id` is a valid, writable id.
        unsafe { comm_call!(self, |raw| ncclCommGetUniqueId(raw, &mut id)) }?;
        Ok(UniqueId::from_raw(&id))
    }

    /// Grows the communicator to `new_size` ranks (`ncclCommGrow`, NCCL 2.29); called by
    /// every existing rank, with no operation outstanding. The coordinator passes the id from
    /// [`Comm::get_unique_id_for_grow`], the other existing ranks `None`; the new ranks call
    /// [`Comm::join_grow`]. Existing ranks keep their numbers. Destroy or abort this
    /// communicator afterwards.
    pub fn grow(
        &self,
        new_size: usize,
        id: Option<&UniqueId>,
        config: Option<&CommConfig>,
    ) -> Result<Comm> {
        let lib = self.library();
        lib.require_call(&calls::ncclCommGrow)?;
        thread_group::ensure_outside("Comm::grow")?;
        let nranks = grow_size(self.size(), new_size)?;
        let child_config = self.child_config(config);
        let mut raw_config = RawConfig::inherit_or(config, lib)?;
        let cfg_ptr = raw_config.as_mut_ptr();
        // Boxed like the child slot: NCCL's job may read it after the call returned.
        let raw_id = id.map(|id| Box::new(id.to_raw()));
        let id_ptr = raw_id
            .as_deref()
            .map_or(ptr::null(), |id| id as *const nccl_sys::ncclUniqueId);
        let child = self.create_child(
            &calls::ncclCommGrow,
            self.stream().clone(),
            &child_config,
            true,
            raw_id,
            |raw, child| {
                // SAFETY: live parent handle under its lock; `id_ptr` is null or points to an
                // id alive until the call returns; `child` stays valid until NCCL's job wrote
                // it; `cfg_ptr` null or an initialised config alive until the call returns.
                // Existing ranks pass rank -1, as NCCL requires.
                unsafe {
                    lib.api()
                        .ncclCommGrow(raw, nranks, id_ptr, -1, child, cfg_ptr)
                }
            },
        );
        expect_child(child, calls::ncclCommGrow.name)
    }

    /// Joins a growing communicator as new rank `rank` of `new_size` (`ncclCommGrow` without
    /// a parent, NCCL 2.29), on the device of `stream`, with the id the coordinator sent.
    pub fn join_grow(
        stream: Arc<CudaStream>,
        id: &UniqueId,
        rank: usize,
        new_size: usize,
        config: Option<&CommConfig>,
    ) -> Result<Comm> {
        let lib = library::get()?;
        lib.require_call(&calls::ncclCommGrow)?;
        thread_group::ensure_outside("Comm::join_grow")?;
        let (rank, nranks) = rank_and_size(rank, new_size)?;
        crate::comm::check_own_stream(&stream)?;
        let config = config.cloned().unwrap_or_default();
        let mut raw_config = config.to_raw(lib)?;
        let cfg_ptr = raw_config.as_mut_ptr();
        let raw_id = id.to_raw();
        stream.context().bind_to_thread()?;
        let mut child: ncclComm_t = ptr::null_mut();
        // SAFETY: no parent (new ranks pass null); `raw_id` and the config outlive the call;
        // `child` is a valid out-pointer.
        let status = unsafe {
            lib.api()
                .ncclCommGrow(ptr::null_mut(), nranks, &raw_id, rank, &mut child, cfg_ptr)
        };
        Comm::adopt(
            lib,
            child,
            stream,
            &config,
            calls::ncclCommGrow.name,
            status,
        )
    }
}

/// The child of a shrink or grow, which always yields one when it succeeds.
fn expect_child(child: Result<Option<Comm>>, call: &'static str) -> Result<Comm> {
    child?.ok_or_else(|| Error::usage(format!("{call} returned no communicator")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn survivors_keep_their_order() {
        let place = |rank, failed: &[usize]| survivor_of(rank, 6, failed).unwrap();
        assert_eq!(place(0, &[2]), Survivor { rank: 0, size: 5 });
        assert_eq!(place(3, &[2]), Survivor { rank: 2, size: 5 });
        assert_eq!(place(5, &[4, 0]), Survivor { rank: 3, size: 4 });
        assert_eq!(place(1, &[5, 0, 3]), Survivor { rank: 0, size: 3 });
        // Bad lists are refused before anything happens.
        for failed in [&[][..], &[6], &[1], &[2, 2]] {
            let err = survivor_of(1, 6, failed).unwrap_err();
            assert!(
                matches!(err, Error::InvalidArgument(_)),
                "{failed:?}: {err}"
            );
        }
    }

    #[test]
    fn exclusion_lists_are_checked_and_sorted() {
        assert_eq!(exclude_list(&[3, 1], 0, 4).unwrap(), vec![1, 3]);
        assert_eq!(exclude_list(&[2], 0, 4).unwrap(), vec![2]);
        let err = |e: &[usize], rank, size| exclude_list(e, rank, size).unwrap_err().to_string();
        assert!(err(&[], 0, 4).contains("at least one rank"));
        assert!(err(&[4], 0, 4).contains("cannot exclude rank 4"));
        assert!(err(&[1, 0], 0, 4).contains("excludes itself"));
        assert!(err(&[2, 1, 2], 0, 4).contains("rank 2 is excluded twice"));
    }

    #[test]
    fn grow_sizes_are_checked() {
        assert_eq!(grow_size(2, 3).unwrap(), 3);
        assert!(grow_size(4, 4)
            .unwrap_err()
            .to_string()
            .contains("must add"));
        assert!(grow_size(4, 2).is_err());
        assert!(grow_size(1, usize::MAX).is_err());
    }

    #[test]
    fn shrink_modes_map_to_nccl_flags() {
        assert_eq!(ShrinkMode::Default.raw(), 0);
        assert_eq!(ShrinkMode::Abort.raw(), 1);
        assert_eq!(ShrinkMode::default(), ShrinkMode::Default);
    }
}
