//! Children of a communicator: split, and the machinery shrink and grow share with it (the
//! child's slot that NCCL's background job writes, and its configuration).

use std::os::raw::c_int;
use std::ptr;
use std::sync::Arc;

use cudarc::driver::CudaStream;
use nccl_sys::ncclComm_t;

use super::{Comm, JobSlot, Membership, Siblings};
use crate::calls::{self, Call};
use crate::config::{CommConfig, CtaPolicy, RawConfig};
use crate::error::{Error, Result, ResultCode};
use crate::thread_group;

impl Comm {
    /// Splits the communicator (`ncclCommSplit`, NCCL 2.18). Ranks passing the same `color`
    /// form a new communicator, ordered by `key` (then by their rank here). A rank passing
    /// `None` takes part in the call but joins no communicator and gets `Ok(None)`.
    ///
    /// Every rank of this communicator must call it, with no NCCL work outstanding on it.
    /// The child uses this communicator's stream and inherits its configuration.
    pub fn split(&self, color: Option<u32>, key: i32) -> Result<Option<Comm>> {
        self.split_with(color, key, None, self.stream.clone())
    }

    /// [`Comm::split`] with a configuration for the child (or `None` to inherit this one's)
    /// and the stream the child will use (on the same device).
    pub fn split_with(
        &self,
        color: Option<u32>,
        key: i32,
        config: Option<&CommConfig>,
        stream: Arc<CudaStream>,
    ) -> Result<Option<Comm>> {
        self.lib.require_call(&calls::ncclCommSplit)?;
        thread_group::ensure_outside("Comm::split")?;
        let color = split_color(color)?;
        self.check_stream(&stream, "the split stream")?;
        let child_config = self.child_config(config);
        let mut raw_config = RawConfig::inherit_or(config, self.lib)?;
        let cfg_ptr = raw_config.as_mut_ptr();
        self.create_child(
            &calls::ncclCommSplit,
            stream,
            &child_config,
            color != nccl_sys::NCCL_SPLIT_NOCOLOR,
            (),
            |raw, child| {
                // SAFETY: live parent handle under its lock; `child` stays valid until NCCL's
                // job has written it (see `create_child`); `cfg_ptr` is null or an
                // initialised config alive until the call returns (NCCL copies it).
                unsafe {
                    self.lib
                        .api()
                        .ncclCommSplit(raw, color, key, child, cfg_ptr)
                }
            },
        )
    }

    /// The configuration a child (split, shrink, grow) is adopted with. No config means
    /// NCCL's "inherit the parent's": then the blocking mode and readiness timeout follow the
    /// parent too; a given config inherits only the blocking mode, if it leaves it unset.
    pub(crate) fn child_config(&self, config: Option<&CommConfig>) -> CommConfig {
        match config {
            Some(config) => config.clone().inherit_blocking(self.shared.blocking),
            None => {
                let inherited = CommConfig::default()
                    .blocking(self.shared.blocking)
                    .ready_timeout(self.ready_timeout);
                // NCCL's child takes the parent's whole config, CTA policy included.
                if self.copy_engine {
                    inherited.cta_policy(CtaPolicy::ZERO)
                } else {
                    inherited
                }
            }
        }
    }

    /// Runs a call that creates a child of this communicator (split, shrink, grow) and adopts
    /// the child.
    ///
    /// For a nonblocking parent NCCL writes the child handle from its background job, after
    /// the call has returned, and keeps the parent in progress until then; the job may also
    /// read `argument` (heap data the call was given: the rank list of a shrink, the id of a
    /// grow). So the handle's slot lives on the heap and is read only once the parent has
    /// settled; if it never settles, slot and argument are leaked rather than freed under
    /// NCCL's feet. On every other path both are freed. `expect_child` is false for a split
    /// without color, which yields no communicator.
    pub(crate) fn create_child<A>(
        &self,
        row: &'static Call,
        stream: Arc<CudaStream>,
        child_config: &CommConfig,
        expect_child: bool,
        argument: A,
        issue: impl FnOnce(
            ncclComm_t,
            *mut ncclComm_t,
        )
            -> std::result::Result<nccl_sys::ncclResult_t, nccl_sys::MissingSymbol>,
    ) -> Result<Option<Comm>> {
        super::streams::check_own_stream(&stream)?;
        self.stream.context().bind_to_thread()?;
        let slot = JobSlot::new(ptr::null_mut::<nccl_sys::ncclComm>());
        let call = row.name;
        let status = self.with_raw(row, |raw| issue(raw, slot.as_ptr()))?;
        let parent_error = match self.lib.check_pending(call, status) {
            // The parent settles when every member has joined the child, so the wait is the
            // child's creation timeout, not the parent's (which may be short, for detecting
            // failures).
            Ok(_) => match self.poll_in_progress(call, Some(child_config.ready_timeout), false) {
                Ok(code) => code,
                Err(err) => {
                    // A parent still in progress is aborted before anything else can touch
                    // it; NCCL's job may still write the slot and read the argument.
                    let err = self.abandon_in_progress(err);
                    slot.abandon();
                    std::mem::forget(argument);
                    return Err(err);
                }
            },
            Err(err) => {
                // The call failed before starting anything; a partial child is aborted.
                // SAFETY: NCCL returned an error, so no job of it runs in the background.
                let partial = unsafe { slot.read() };
                if !partial.is_null() {
                    // SAFETY: a handle from a failed creation that nobody else holds.
                    let _ = unsafe { self.lib.api().ncclCommAbort(partial) };
                }
                return Err(err);
            }
        };
        drop(argument);
        // SAFETY: the parent has settled, so NCCL's job has finished writing the slot.
        let child = unsafe { slot.read() };
        let adopted = match (child.is_null(), expect_child) {
            (true, false) => Ok(None),
            (true, true) => Err(match parent_error {
                ResultCode::Success => Error::Nccl {
                    call,
                    code: ResultCode::InternalError,
                    description: "NCCL reported success but returned no communicator".into(),
                    last_error: None,
                },
                code => self.lib.error(call, code),
            }),
            (false, _) => Comm::adopt(
                self.lib,
                child,
                stream,
                child_config,
                call,
                Ok(nccl_sys::ncclResult_t::ncclSuccess),
            )
            .map(Some),
        };
        // The child's own init job stores the handle into the slot once more when it
        // finishes (`ncclCommInitRankFunc` in NCCL's init.cc), and a grow leaves the parent
        // out of progress while it runs: the slot lives until the child was adopted (ready)
        // or aborted (which joins that job). Freeing it earlier corrupted the heap (2.32.3).
        drop(slot);
        adopted
    }

    /// Splits several communicators driven by this thread (for example from
    /// [`Comm::init_all`]) in one group, so the blocking split of one rank does not wait
    /// forever for the others. `colors[i]` and `keys[i]` apply to `comms[i]`.
    pub fn split_all(
        comms: &[Comm],
        colors: &[Option<u32>],
        keys: &[i32],
    ) -> Result<Vec<Option<Comm>>> {
        if comms.len() != colors.len() || comms.len() != keys.len() {
            return Err(Error::invalid(format!(
                "split_all got {} communicators, {} colors and {} keys",
                comms.len(),
                colors.len(),
                keys.len()
            )));
        }
        let Some(first) = comms.first() else {
            return Ok(Vec::new());
        };
        let lib = first.lib;
        lib.require_call(&calls::ncclCommSplit)?;
        if comms
            .iter()
            .any(|c| c.shared.blocking != first.shared.blocking)
        {
            return Err(Error::invalid(
                "split_all cannot mix blocking and nonblocking communicators",
            ));
        }
        let colors = colors
            .iter()
            .map(|&color| split_color(color))
            .collect::<Result<Vec<_>>>()?;
        let mut children: Vec<ncclComm_t> = vec![ptr::null_mut(); comms.len()];
        // Aborts from other threads wait until the group has ended (see `crate::fault`):
        // entered before it starts, so it is left after the group ended, also on an early
        // return.
        let _entered = Membership::enter(comms.iter());
        let mut group = thread_group::RawGroup::start(lib)?;
        // Every parent must be live before the first split joins the group: with aborts
        // deferred from here on, none can be released below, so no split is left out of a
        // group whose other splits wait for it (a blocking group end would never return).
        for comm in comms {
            comm.shared
                .lock()
                .usable_for(&calls::ncclCommSplit, comm.rank)?;
        }
        for (i, comm) in comms.iter().enumerate() {
            let child = &mut children[i];
            let status = comm.with_raw(&calls::ncclCommSplit, |raw| {
                // SAFETY: live handle under its lock; `child` outlives the group, where NCCL
                // fills it in; a null config inherits the parent's.
                unsafe {
                    lib.api()
                        .ncclCommSplit(raw, colors[i], keys[i], child, ptr::null_mut())
                }
            });
            let checked =
                status.and_then(|status| lib.check_pending(calls::ncclCommSplit.name, status));
            if let Err(err) = checked {
                group.end_ignoring_errors();
                // The splits already in the group may still be finished by NCCL's jobs,
                // which write their slots: leaked, as below, rather than freed under them.
                std::mem::forget(children);
                return Err(err);
            }
        }
        let pending = group.end();
        drop(_entered);
        let pending = pending?;
        if pending {
            // As in `create_child`: NCCL's jobs write the children and keep the parents in
            // progress until done. If a parent never settles, the slots stay allocated.
            // Every parent is waited for, and aborted if it stays in progress, so none is
            // left with NCCL's job running when this returns.
            let mut stalled = None;
            for parent in comms {
                if let Err(err) =
                    parent.poll_in_progress("ncclCommSplit", Some(parent.ready_timeout), false)
                {
                    stalled.get_or_insert(parent.abandon_in_progress(err));
                }
            }
            if let Some(err) = stalled {
                std::mem::forget(children);
                return Err(err);
            }
        }
        let mut out = Vec::with_capacity(comms.len());
        let mut first_err = None;
        let siblings = Arc::new(Siblings::default());
        for ((raw, parent), color) in children.into_iter().zip(comms).zip(&colors) {
            if *color == nccl_sys::NCCL_SPLIT_NOCOLOR || raw.is_null() {
                out.push(None);
                continue;
            }
            // A null config was passed: the child inherits the parent's configuration.
            let config = parent.child_config(None);
            match Comm::adopt(
                lib,
                raw,
                parent.stream.clone(),
                &config,
                "ncclCommSplit",
                Ok(nccl_sys::ncclResult_t::ncclSuccess),
            ) {
                Ok(mut child) => {
                    child.siblings = Some(siblings.clone());
                    out.push(Some(child));
                }
                Err(err) => {
                    first_err.get_or_insert(err);
                    out.push(None);
                }
            }
        }
        match first_err {
            Some(err) => Err(err),
            None => Ok(out),
        }
    }
}

fn split_color(color: Option<u32>) -> Result<c_int> {
    match color {
        None => Ok(nccl_sys::NCCL_SPLIT_NOCOLOR),
        Some(color) => c_int::try_from(color).map_err(|_| {
            Error::invalid(format!(
                "split color {color} is too large (at most {})",
                c_int::MAX
            ))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_colors() {
        assert_eq!(split_color(None).unwrap(), -1);
        assert_eq!(split_color(Some(7)).unwrap(), 7);
        assert!(split_color(Some(u32::MAX)).is_err());
    }
}
