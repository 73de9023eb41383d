//! The device communicator: `ncclDevCommCreate`'s `ncclDevComm`, lent by NCCL on a
//! communicator (a [`Lease`]) and handed to kernels as a pointer to a device copy.
//!
//! NCCL writes the struct in the layout of the requirements' `version` (the kernels' header
//! version), so this crate never reads it as a Rust struct: it reserves [`DEV_COMM_ROOM`]
//! bytes on the heap for NCCL to write, copies them to device memory once NCCL is done, and
//! passes kernels the device address (a `const ncclDevComm*` parameter). The versioned
//! layout stays out of the kernel ABI: every version is one pointer wide.
//!
//! NCCL fills the struct when the group it was created in ends (creation is collective and
//! runs in a group of its own outside one), so creation is refused inside a
//! [`Group`](crate::Group); several communicators driven by one thread create theirs
//! together with [`DevComm::create_all`]. Destruction (`ncclDevCommDestroy`, local)
//! deregisters the resource window the barriers live in, so it waits first for the work
//! that may still use it: see [`DevComm`].

use std::mem::ManuallyDrop;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, DevicePtrMut, LaunchArgs, PushKernelArg};
use nccl_sys::{ncclDevCommRequirements_t, ncclDevComm_t, NCCL_API_MAGIC};

use super::{agreement, DevCommRequirements, DeviceAbi, Team};
use crate::calls;
use crate::comm::{Backoff, Comm, JobSlot, Lease, Membership};
use crate::error::{Error, Refusal, Result, ResultCode};
use crate::library::Library;
use crate::release::Version;
use crate::thread_group::{self, RawGroup};

const CALL: &str = calls::ncclDevCommCreate.name;

/// The bytes reserved for NCCL's `ncclDevComm` (248 in NCCL 2.32.3, 224 in 2.29.7); a library
/// reporting a larger `devCommRuntimeVersionSize` is refused.
pub const DEV_COMM_ROOM: usize = 1024;

/// The first header version whose `ncclDevComm` starts with `magic` and `version`.
const VERSIONED_LAYOUT_SINCE: Version = Version::new(2, 30, 0);

/// Where NCCL writes the device communicator.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Image([u8; DEV_COMM_ROOM]);

impl Image {
    /// Whether NCCL wrote a device communicator of `abi` for a communicator of `size` ranks.
    fn is_written(&self, abi: DeviceAbi, size: usize) -> bool {
        let word = |at: usize| {
            let mut bytes = [0u8; 4];
            bytes.copy_from_slice(&self.0[at..at + 4]);
            u32::from_ne_bytes(bytes)
        };
        let size = u32::try_from(size).unwrap_or(u32::MAX);
        if abi.version() >= VERSIONED_LAYOUT_SINCE {
            // magic, version, rank, nRanks
            word(0) == NCCL_API_MAGIC && word(4) == abi.version().code() && word(12) == size
        } else {
            // 2.29: rank, nRanks first
            word(4) == size
        }
    }
}

/// The heap slot NCCL writes the device communicator into (see [`JobSlot`]).
type Slot = JobSlot<Image>;

/// A device communicator (`ncclDevComm`) of one rank; see the
/// [device API docs](crate::device).
///
/// It borrows its [`Comm`], so it cannot outlive it, and is destroyed (`ncclDevCommDestroy`)
/// on drop or [`close`](DevComm::close), after waiting, for at most
/// [`Comm::drop_timeout`], for the work that may still use it: everything enqueued on the
/// communicator's stream, and every kernel launched with it as an argument on any stream
/// (cudarc's event tracking records those; with tracking off, launch on the communicator's
/// stream or synchronize first). If that wait times out or NCCL fails, NCCL's resources
/// and the device copy are leaked rather than freed under a running kernel. While the
/// communicator is suspended ([`Comm::suspend`]) NCCL allows no destruction (it
/// deregisters the barriers' resource window): [`close`](DevComm::close) then gives it back
/// with [`Error::Suspended`] (close it again once resumed), and a drop leaks it, until
/// NCCL frees its resources with the communicator.
///
/// Its communicator cannot be dropped before it (the borrow), and its wait first makes the
/// communicator's stream wait for those kernels, timed out or not: the communicator's own
/// end, which waits for its stream within [`Comm::drop_timeout`] and otherwise aborts, so
/// covers them. cudarc keeps one read event per buffer, recorded again by each launch: of
/// kernels launched on several streams only the last launch's is seen, so with kernels of
/// it on several streams at once, synchronize the others before dropping it.
///
/// Passed to a kernel (`.arg(&dev_comm)` on a cudarc launch), it is the kernel parameter
/// `const ncclDevComm*`.
///
/// ```compile_fail
/// // A device communicator cannot outlive its communicator.
/// fn f(comm: nccl::Comm, abi: nccl::device::DeviceAbi) -> nccl::Result<()> {
///     let reqs = nccl::device::DevCommRequirements::new().lsa_barriers(1);
///     let dev_comm = nccl::device::DevComm::create(&comm, &reqs, abi)?;
///     drop(comm);
///     drop(dev_comm);
///     Ok(())
/// }
/// ```
pub struct DevComm<'c> {
    /// The host image's address, destroyed (`ncclDevCommDestroy`) on its communicator.
    lease: Lease<'c, *mut ncclDevComm_t>,
    /// What NCCL wrote; dropped only once the lease is given back (leaked otherwise).
    image: ManuallyDrop<Slot>,
    /// The device copy kernels read; freed only once the lease is given back.
    device: ManuallyDrop<CudaSlice<u8>>,
    abi: DeviceAbi,
    world: Team,
    lsa: Team,
}

impl std::fmt::Debug for DevComm<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevComm")
            .field("rank", &self.world.rank)
            .field("size", &self.world.size)
            .field("lsa", &self.lsa)
            .field("abi", &self.abi)
            .finish_non_exhaustive()
    }
}

/// What must hold before this rank can take part in the agreement at all (see
/// `agreement.rs`): the library, the same on every rank; no group open on this thread and a
/// usable (not failed, released or suspended) communicator, without which no exchange can
/// be enqueued.
fn precheck(comm: &Comm) -> Result<()> {
    let lib = comm.library();
    lib.require_call(&calls::ncclDevCommCreate)?;
    // Before the properties, which a library older than 2.29 has not either.
    lib.require(
        "ncclDevCommCreate (versioned device communicators)",
        super::DEV_COMM_SINCE,
    )?;
    thread_group::ensure_outside("DevComm::create")?;
    comm.usable(&calls::ncclDevCommCreate).map(drop)
}

/// The checks this rank makes before NCCL is asked, and the struct it hands over; a refusal
/// goes through the agreement, so every rank refuses together.
fn prepare(
    comm: &Comm,
    reqs: &DevCommRequirements,
    abi: DeviceAbi,
) -> std::result::Result<ncclDevCommRequirements_t, (Refusal, Error)> {
    let lib = comm.library();
    let refused = |err: Error| (Refusal::of(&err), err);
    abi.check(lib.version(), reqs.uses_gin())
        .map_err(|err| (Refusal::DeviceAbi, err))?;
    let props = comm.properties().map_err(refused)?;
    reqs.check(&props, lib.version(), abi).map_err(refused)?;
    if let Some(size) = props.dev_comm_runtime_size {
        if size > DEV_COMM_ROOM {
            return Err(refused(Error::Unavailable {
                api: CALL,
                reason: format!(
                    "this NCCL's ncclDevComm is {size} bytes, more than the {DEV_COMM_ROOM} \
                     this crate reserves for it"
                ),
            }));
        }
    }
    Ok(reqs.to_raw(abi))
}

/// Hands one creation to NCCL (inside the group).
fn issue(comm: &Comm, reqs: &ncclDevCommRequirements_t, slot: &Slot) -> Result<()> {
    let lib = comm.library();
    comm.context().bind_to_thread()?;
    let out = slot.as_ptr().cast::<ncclDevComm_t>();
    let status = comm.with_raw(&calls::ncclDevCommCreate, |raw| {
        // SAFETY: live communicator under its lock; `reqs` is an initialised struct whose
        // `size` is at most the library's (checked against its version) and whose lists are
        // NULL; `out` points at DEV_COMM_ROOM bytes, 64-aligned, which stay allocated until
        // NCCL is done writing them (see `Slot`).
        unsafe { lib.api().ncclDevCommCreate(raw, reqs, out) }
    })?;
    lib.check_pending(CALL, status).map(|_| ())
}

impl<'c> DevComm<'c> {
    /// Creates a device communicator on `comm` for device code of `abi`
    /// (`ncclDevCommCreate`). Collective: every rank calls it, with the same requirements
    /// and device ABI, in the same order as its other collective calls. Refused inside a
    /// [`Group`](crate::Group) (NCCL fills it in only when the group ends).
    ///
    /// Checked first, without asking NCCL ([`DevCommRequirements`]): the library (2.29.2+),
    /// the ABI against the library, the communicator's device-API, multicast and GIN support
    /// ([`Error::Unavailable`] where it lacks them). Then the ranks agree, in one small
    /// all-gather on the communicator's stream (waited for, for at most
    /// [`Comm::ready_timeout`]): a rank whose checks failed returns its own error and every
    /// other rank [`Error::RankRefused`] naming it; requirements, device ABIs or libraries
    /// that differ across ranks give every rank [`Error::RankMismatch`] naming the field and
    /// the ranks. Only then does any rank call NCCL, so none is left waiting in it.
    ///
    /// A rank that cannot take part in the agreement (a group open on its thread, or its
    /// communicator failed, released or suspended) returns its error at once, and its peers
    /// wait in the agreement until their [`Comm::ready_timeout`], after which their
    /// communicators are aborted ([`Error::Timeout`]): the exchange stays queued there and
    /// would pair with a later collective. On a blocking communicator NCCL may also block in
    /// the all-gather's first connection to the peers, which no timeout bounds; keep those
    /// calls alike on every rank (or use nonblocking communicators and a
    /// [`Watchdog`](crate::Watchdog)). A communicator of one rank agrees with nobody and
    /// exchanges nothing.
    pub fn create(comm: &'c Comm, reqs: &DevCommRequirements, abi: DeviceAbi) -> Result<Self> {
        let mut made = Self::create_in_group(&[comm], reqs, abi)?;
        made.pop()
            .ok_or_else(|| internal("no device communicator was made"))
    }

    /// Creates a device communicator on every communicator of `comms`, in one NCCL group:
    /// how one thread driving several ranks (from [`Comm::init_all`]) creates them, since
    /// each creation waits for every rank. The ranks agree first as in
    /// [`create`](DevComm::create), all of them in one exchange; the error returned is the
    /// first of `comms`' own, else the agreement's. On failure none is kept.
    pub fn create_all(
        comms: &'c [Comm],
        reqs: &DevCommRequirements,
        abi: DeviceAbi,
    ) -> Result<Vec<Self>> {
        let all: Vec<&'c Comm> = comms.iter().collect();
        Self::create_in_group(&all, reqs, abi)
    }

    fn create_in_group(
        comms: &[&'c Comm],
        reqs: &DevCommRequirements,
        abi: DeviceAbi,
    ) -> Result<Vec<Self>> {
        let Some(first) = comms.first() else {
            return Ok(Vec::new());
        };
        if comms.iter().any(|c| c.is_blocking() != first.is_blocking()) {
            return Err(Error::invalid(
                "NCCL does not allow blocking and nonblocking communicators in one group",
            ));
        }
        comms.iter().try_for_each(|comm| precheck(comm))?;
        let local = comms.iter().map(|comm| prepare(comm, reqs, abi)).collect();
        let raws = agreement::agree(comms, reqs, abi, local)?;
        // Aborts from other threads wait until the group has ended (see `crate::fault`):
        // entered before it starts, so it is left after the group ended, also on an early
        // return.
        let mut membership = Membership::enter(comms.iter().copied());
        let mut group = RawGroup::start(first.library())?;
        let slots: Vec<Slot> = comms
            .iter()
            .map(|_| JobSlot::new(Image([0; DEV_COMM_ROOM])))
            .collect();
        let mut issued = 0;
        let mut failure = None;
        for ((comm, raw), slot) in comms.iter().zip(&raws).zip(&slots) {
            match issue(comm, raw, slot) {
                Ok(()) => issued += 1,
                Err(err) => {
                    failure = Some(err);
                    break;
                }
            }
        }
        let ended = group.end();
        if let Some(err) = membership.leave(CALL) {
            failure.get_or_insert(err);
        }
        let pending = ended.unwrap_or_else(|err| {
            failure.get_or_insert(err);
            false
        });
        // A nonblocking communicator creates it in NCCL's background job: wait for each, and
        // leak the slot of one that does not settle (NCCL may still write it).
        let mut settled = vec![true; comms.len()];
        if pending || !first.is_blocking() {
            for (i, comm) in comms.iter().enumerate().take(issued) {
                if let Err(err) = comm.wait_ready(comm.ready_timeout()) {
                    settled[i] = false;
                    let err = comm.abandon_in_progress(err);
                    failure.get_or_insert(err);
                }
            }
        }
        let mut made = Vec::with_capacity(comms.len());
        for (i, (comm, slot)) in comms.iter().zip(slots).enumerate() {
            if !settled[i] {
                slot.abandon();
                continue;
            }
            // SAFETY: the group has ended and this communicator settled (or never got the
            // slot), so no NCCL job writes it any more.
            let image = unsafe { slot.read() };
            if i >= issued || !image.is_written(abi, comm.size()) {
                if i < issued && failure.is_none() {
                    failure = Some(internal(
                        "NCCL reported success but wrote no device communicator",
                    ));
                }
                continue;
            }
            match Self::adopt(comm, slot, &image, abi) {
                Ok(dev_comm) => made.push(dev_comm),
                Err(err) => {
                    failure.get_or_insert(err);
                }
            }
        }
        match failure {
            // The ones made are destroyed by their drop (local).
            Some(err) => Err(err),
            None => Ok(made),
        }
    }

    /// Takes ownership of what NCCL wrote into `slot`, then copies it to the device.
    fn adopt(comm: &'c Comm, slot: Slot, image: &Image, abi: DeviceAbi) -> Result<Self> {
        let lease = Lease::new(
            comm,
            slot.as_ptr().cast::<ncclDevComm_t>(),
            &calls::ncclDevCommDestroy,
            |lib, raw, dev_comm| {
                // SAFETY: `GiveBack`'s contract: live communicator under its lock; `dev_comm`
                // is what ncclDevCommCreate wrote on it, not destroyed yet, and no work uses
                // it any more (waited out first).
                unsafe { lib.api().ncclDevCommDestroy(raw, dev_comm) }
            },
        );
        let copied = comm
            .context()
            .bind_to_thread()
            .and_then(|()| comm.stream().clone_htod(&image.0[..]));
        let teams = comm.world_team().and_then(|w| Ok((w, comm.lsa_team()?)));
        match (copied, teams) {
            (Ok(device), Ok((world, lsa))) => Ok(Self {
                lease,
                image: ManuallyDrop::new(slot),
                device: ManuallyDrop::new(device),
                abi,
                world,
                lsa,
            }),
            (copied, teams) => {
                let err = match (copied, teams) {
                    (Err(err), _) => Error::from(err),
                    (_, Err(err)) => err,
                    _ => internal("unreachable"),
                };
                let mut lease = lease;
                // Nothing ran with it yet: nothing to wait for.
                if lease.give_back(|| Ok(())).is_ok() {
                    drop(slot);
                } else {
                    slot.abandon();
                }
                Err(err)
            }
        }
    }

    /// The communicator it was created on.
    pub fn comm(&self) -> &'c Comm {
        self.lease.comm()
    }

    /// The device-code ABI it was laid out for.
    pub fn abi(&self) -> DeviceAbi {
        self.abi
    }

    /// This rank in the world team (the communicator's rank).
    pub fn rank(&self) -> usize {
        self.world.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.world.size
    }

    /// The world team.
    pub fn world_team(&self) -> Team {
        self.world
    }

    /// The LSA team: the ranks whose windows kernels can load from and store to.
    pub fn lsa_team(&self) -> Team {
        self.lsa
    }

    /// The device address of the copy kernels read (what `.arg(&dev_comm)` passes).
    pub fn device_ptr(&self) -> u64 {
        let (ptr, _sync) =
            cudarc::driver::DevicePtr::device_ptr(&*self.device, self.comm().stream());
        ptr
    }

    /// `ncclLLA2ACalcSlots`: the LL all-to-all slots needed for `max_elements` of
    /// `max_element_size` bytes, for [`DevCommRequirements::lsa_ll_a2a`].
    pub fn ll_a2a_slots(lib: &Library, max_elements: u32, max_element_size: u32) -> Result<u32> {
        let int = |v: u32| {
            i32::try_from(v).map_err(|_| Error::invalid(format!("{v} does not fit a C int")))
        };
        let (elements, size) = (int(max_elements)?, int(max_element_size)?);
        // SAFETY: pure arithmetic on two integers.
        let slots = unsafe { lib.api().ncclLLA2ACalcSlots(elements, size) }
            .map_err(|missing| lib.missing(missing))?;
        u32::try_from(slots).map_err(|_| internal(format!("ncclLLA2ACalcSlots returned {slots}")))
    }

    /// Destroys it (`ncclDevCommDestroy`), after the wait described on [`DevComm`]. On a
    /// timeout or an NCCL failure it comes back with the error; dropping it then tries again
    /// and leaks it if that fails too.
    #[allow(clippy::result_large_err)]
    pub fn close(mut self) -> std::result::Result<(), (Self, Error)> {
        match self.release() {
            Ok(()) => Ok(()),
            Err(err) => Err((self, err)),
        }
    }

    fn release(&mut self) -> Result<()> {
        let comm = self.lease.comm();
        let device = &mut *self.device;
        self.lease
            .give_back(|| settle(comm, device, comm.drop_timeout()))
    }
}

/// Waits until the kernels that took `device` as an argument (its cudarc events) and the
/// work enqueued so far on the communicator's stream have finished.
fn settle(comm: &Comm, device: &mut CudaSlice<u8>, timeout: Duration) -> Result<()> {
    comm.context().bind_to_thread()?;
    // Makes the communicator's stream wait for every recorded use of the device copy.
    drop(device.device_ptr_mut(comm.stream()));
    let done = comm.stream().record_event(None)?;
    let start = Instant::now();
    let mut backoff = Backoff::new();
    while !done.try_is_complete()? {
        if start.elapsed() >= timeout {
            return Err(Error::Timeout {
                what: format!(
                    "the kernels using the device communicator of rank {} to finish before \
                     destroying it (a dropped one is then leaked)",
                    comm.rank()
                ),
                waited: start.elapsed(),
            });
        }
        backoff.wait();
    }
    Ok(())
}

fn internal(what: impl Into<String>) -> Error {
    Error::Nccl {
        call: CALL,
        code: ResultCode::InternalError,
        description: what.into(),
        last_error: None,
    }
}

impl Drop for DevComm<'_> {
    fn drop(&mut self) {
        if self.release().is_ok() || !self.lease.is_held() {
            // SAFETY: given back; neither field is touched again.
            unsafe {
                ManuallyDrop::drop(&mut self.device);
                ManuallyDrop::drop(&mut self.image);
            }
        }
        // Otherwise both stay leaked: a kernel or NCCL may still read them.
    }
}

// SAFETY (of the launch contract cudarc asks of `PushKernelArg`): the pushed argument is the
// address of the device copy's `CUdeviceptr`, owned by `arg` and borrowed for `'b`, which
// outlives the launch; it is pushed through cudarc's own `CudaSlice` argument, so the
// launch records the copy's read event and `settle` waits for it.
unsafe impl<'a, 'b: 'a, 'c> PushKernelArg<&'b DevComm<'c>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b DevComm<'c>) -> &mut Self {
        self.arg(&*arg.device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_image_is_recognised_per_layout() {
        let abi = DeviceAbi::new(Version::new(2, 32, 3));
        let mut image = Image([0; DEV_COMM_ROOM]);
        assert!(!image.is_written(abi, 2));
        image.0[0..4].copy_from_slice(&NCCL_API_MAGIC.to_ne_bytes());
        image.0[4..8].copy_from_slice(&23203u32.to_ne_bytes());
        image.0[12..16].copy_from_slice(&2u32.to_ne_bytes());
        assert!(image.is_written(abi, 2));
        assert!(!image.is_written(abi, 3));
        assert!(!image.is_written(DeviceAbi::new(Version::new(2, 30, 7)), 2));
        let mut old = Image([0; DEV_COMM_ROOM]);
        old.0[4..8].copy_from_slice(&2u32.to_ne_bytes());
        assert!(old.is_written(DeviceAbi::new(Version::new(2, 29, 7)), 2));
        assert_eq!(std::mem::align_of::<Image>(), 64);
        assert!(DEV_COMM_ROOM >= std::mem::size_of::<ncclDevComm_t>());
    }
}
