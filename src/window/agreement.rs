//! Before NCCL sees a window registration, the ranks agree on it: each says what it
//! registers (or that it refused its own), every rank judges the same table, and either all
//! register or none does. Also where one-sided RMA's setup is settled for the windows.

use super::{rma, WindowFlags, REQUIRED_ALIGNMENT};
use crate::agreement::{all_gather_rows, Wait};
use crate::calls;
use crate::comm::Comm;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::memory::NcclBuffer;
use crate::release::Version;

const CALL: &str = calls::ncclCommWindowRegister.name;

/// First NCCL that lets ranks register windows of different sizes (before, the peers'
/// mappings were sized by the local registration: v2.29.7 `src/dev_runtime.cc`).
pub(crate) const SIZES_MAY_DIFFER_SINCE: Version = Version::new(2, 30, 7);

/// What one rank says in the registration's exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    /// This rank refused its own registration (its error says why).
    refused: bool,
    bytes: u64,
    flags: u32,
    /// `size_of::<T>()`: the element type's size, which every offset here is counted in.
    elem: u64,
    /// This rank needs NCCL's RMA set-up step now and can take it (see `rma::can_set_up`).
    rma: bool,
}

/// Words per [`Entry`] in the exchange.
const WIDTH: usize = 5;

impl Entry {
    fn of<T: NcclType>(
        buffer: &NcclBuffer<T>,
        flags: WindowFlags,
        refused: bool,
        rma: bool,
    ) -> Self {
        let elem = std::mem::size_of::<T>();
        Entry {
            refused,
            // Overflow was refused by `check_extent` (then `refused` is set).
            bytes: buffer.len.saturating_mul(elem) as u64,
            flags: flags.bits(),
            elem: elem as u64,
            rma,
        }
    }

    fn to_row(self) -> [u64; WIDTH] {
        [
            u64::from(self.refused),
            self.bytes,
            u64::from(self.flags),
            self.elem,
            u64::from(self.rma),
        ]
    }

    fn from_row(row: &[u64]) -> Self {
        Entry {
            refused: row[0] != 0,
            bytes: row[1],
            flags: row[2] as u32,
            elem: row[3],
            rma: row[4] != 0,
        }
    }
}

/// The verdict on a registration from every rank's entry (rank `i`'s at `all[i]`): the
/// same on every rank, since every rank judges the same entries. Windows must agree on
/// flags and element size on every version (NCCL reads every rank's copy through this
/// rank's handle, in bytes), and before 2.30.7 on their size.
fn judge(version: Version, all: &[Entry]) -> Result<()> {
    if let Some(i) = all.iter().position(|e| e.refused) {
        return Err(Error::invalid(format!(
            "{CALL}: rank {i} refused its own window (its error says why); no rank registered"
        )));
    }
    let Some(first) = all.first() else {
        return Ok(());
    };
    let differs = |what: &str, i: usize, mine: u64, theirs: u64| {
        Err(Error::invalid(format!(
            "{CALL}: rank {i} registers {what} {theirs} where rank 0 registers {mine}; every \
             rank must register the same, so no rank registered"
        )))
    };
    for (i, e) in all.iter().enumerate().skip(1) {
        if e.elem != first.elem {
            return differs("element size", i, first.elem, e.elem);
        }
        if e.flags != first.flags {
            return differs("flags", i, u64::from(first.flags), u64::from(e.flags));
        }
        if e.bytes != first.bytes && version < SIZES_MAY_DIFFER_SINCE {
            return Err(Error::invalid(format!(
                "{CALL}: rank {i} registers {} bytes where rank 0 registers {}; before NCCL \
                 {SIZES_MAY_DIFFER_SINCE} every rank must register the same size, so no rank \
                 registered",
                e.bytes, first.bytes
            )));
        }
    }
    Ok(())
}

/// The exchange: every rank's entry, per communicator. A nonblocking communicator waits at
/// most its [`Comm::ready_timeout`]; a blocking one until the exchange ends.
fn exchange(comms: &[&Comm], mine: &[Entry]) -> Result<Vec<Vec<Entry>>> {
    let rows: Vec<Vec<u64>> = mine.iter().map(|entry| entry.to_row().to_vec()).collect();
    let wait = Wait {
        limit: |comm| (!comm.is_blocking()).then(|| comm.ready_timeout()),
        what: "the window registration's exchange to finish",
        explain: None,
    };
    let all = all_gather_rows(comms, &rows, WIDTH, &wait)?;
    Ok(all
        .iter()
        .map(|rows| rows.chunks_exact(WIDTH).map(Entry::from_row).collect())
        .collect())
}

/// What the ranks agreed on for one communicator's registration.
pub(super) struct Agreed {
    /// Every rank's window size in bytes.
    pub(super) peer_bytes: Vec<u64>,
    /// `hostRmaSupport` of this rank's communicator, where reported.
    pub(super) host_rma: Option<bool>,
    /// Every rank takes NCCL's RMA set-up step after registering (see [`rma::set_up`]).
    pub(super) set_up_rma: bool,
}

/// What this rank knows of host RMA before registering: `hostRmaSupport` where the library
/// reports it, and whether NCCL's rank-local checks of its first RMA call will pass here
/// ([`rma::local_checks_pass`]). Any other failure of the query is this rank's error (it goes
/// through the exchange like the others).
fn host_rma(comm: &Comm) -> Result<(Option<bool>, bool)> {
    match crate::properties::query_with_gin(comm) {
        Ok((props, gin)) => Ok((
            props.host_rma_support,
            rma::local_checks_pass(props.host_rma_support, gin),
        )),
        Err(err) if err.is_unsupported() => Ok((None, false)),
        Err(err) => Err(err),
    }
}

/// The exchange and its verdict for `comms[i]` registering `buffers[i]`: what every rank
/// agreed on per communicator, where every rank may go on, else the error every rank
/// returns (this rank's own error first).
pub(super) fn agree<T: NcclType>(
    comms: &[&Comm],
    buffers: &[NcclBuffer<T>],
    flags: WindowFlags,
) -> Result<Vec<Agreed>> {
    let local: Vec<Result<(Option<bool>, bool)>> = comms
        .iter()
        .zip(buffers)
        .map(|(comm, buffer)| check(comm, buffer, flags).and_then(|()| host_rma(comm)))
        .collect();
    let mine: Vec<Entry> = comms
        .iter()
        .zip(buffers)
        .zip(&local)
        .map(|((comm, buffer), verdict)| {
            let rma = match verdict {
                Ok((_, checks_pass)) => rma::can_set_up(comm, *checks_pass),
                Err(_) => false,
            };
            Entry::of(buffer, flags, verdict.is_err(), rma)
        })
        .collect();
    // One rank alone has nobody to agree with.
    let all = if comms.iter().all(|comm| comm.size() == 1) {
        mine.iter().map(|entry| vec![*entry]).collect()
    } else {
        exchange(comms, &mine)?
    };
    let mut agreed = Vec::with_capacity(comms.len());
    for ((comm, verdict), entries) in comms.iter().zip(local).zip(&all) {
        let (host_rma, _) = verdict?;
        judge(comm.library().version(), entries)?;
        agreed.push(Agreed {
            peer_bytes: entries.iter().map(|e| e.bytes).collect(),
            host_rma,
            // A lone rank cannot wait for anyone, and NCCL's set-up has nobody to wait for.
            set_up_rma: comm.size() > 1 && entries.iter().all(|e| e.rma),
        });
    }
    Ok(agreed)
}

/// Takes NCCL's RMA set-up step where the ranks agreed to (every rank then calls this with
/// the same verdict), and records the outcome on each communicator.
pub(super) fn finish_rma(comms: &[&Comm], agreed: &[Agreed]) -> Result<()> {
    let set_up: Vec<&Comm> = comms
        .iter()
        .zip(agreed)
        .filter(|(_, a)| a.set_up_rma)
        .map(|(comm, _)| *comm)
        .collect();
    let outcome = if set_up.is_empty() {
        Ok(())
    } else {
        rma::set_up(&set_up)
    };
    for (comm, a) in comms.iter().zip(agreed) {
        // Only a lazy NCCL still pending changes state; a failed step leaves RMA off. A
        // lone rank's set-up waits for nobody.
        if comm.rma_setup.get() == crate::comm::RmaSetup::Pending {
            let done = comm.size() == 1 || (a.set_up_rma && outcome.is_ok());
            rma::record_setup(comm, done);
        }
    }
    outcome
}

/// What this rank checks of its own buffer. A refusal here is carried through the exchange,
/// so every rank refuses the registration together instead of leaving its peers in NCCL's
/// bootstrap all-gather.
fn check<T: NcclType>(comm: &Comm, buffer: &NcclBuffer<T>, flags: WindowFlags) -> Result<()> {
    flags.check(comm.library().version())?;
    // The context, not only the device: NCCL maps the buffer in the communicator's context.
    comm.check_context(buffer.stream.context(), "the buffer")?;
    check_extent(buffer.ptr, buffer.len, std::mem::size_of::<T>())
}

/// NCCL refuses empty windows, and needs the window's start 4096-byte aligned in its VMM
/// allocation; an `NcclBuffer` starts its own allocation, so its address must be aligned.
fn check_extent(ptr: u64, len: usize, elem: usize) -> Result<()> {
    if len == 0 {
        return Err(Error::invalid(
            "a window needs at least one element (NCCL refuses empty windows)",
        ));
    }
    if len.checked_mul(elem).is_none() {
        return Err(Error::invalid(format!(
            "{len} elements overflow the address space"
        )));
    }
    if !ptr.is_multiple_of(REQUIRED_ALIGNMENT as u64) {
        return Err(Error::invalid(format!(
            "the buffer at {ptr:#x} is not {REQUIRED_ALIGNMENT}-byte aligned, as NCCL requires"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
