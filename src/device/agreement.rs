//! Before NCCL sees a device communicator's creation, the ranks agree on it: each says
//! whether its own checks passed (or why not), what it asks for and for which device ABI,
//! every rank judges the same table, and either every rank calls `ncclDevCommCreate` or
//! every rank returns an error. NCCL's creation is collective (it ends in bootstrap barriers
//! over every rank: `ncclDevrCommCreateInternal`, `src/dev_runtime.cc`, 2.30.7), so a rank
//! refused alone would leave its peers waiting in NCCL for ever; and NCCL compares nothing
//! across ranks, so requirements that differ would lay the barriers out differently on each.
//!
//! What is decided where:
//!
//! * Kept local, before the exchange, because every rank necessarily reaches the same
//!   verdict: the library's version and symbols (NCCL refuses to create a communicator whose
//!   ranks load different versions: `initTransportsRank`, `src/init.cc`, 2.30.7), which
//!   also decides NCCL before 2.29.2, with no device API at all.
//! * Kept local because the rank cannot take part in an exchange at all: a
//!   [`Group`](crate::Group) open on its thread (the exchange's all-gather would wait for
//!   that group's end), and a communicator that failed, was released or is suspended (no
//!   operation may be enqueued on it). Its peers then wait in the exchange, for at most
//!   their [`Comm::ready_timeout`]; a wait that runs out aborts their communicator, since
//!   the exchange stays queued on it and would pair with a later collective.
//! * Exchanged: everything else this rank checks (the properties query, the ABI against
//!   the library, device-API, multicast and GIN support, the counts, the room for the
//!   struct), and what must match: the library and ABI versions and every requirement field.

use nccl_sys::ncclDevCommRequirements_t;

use super::requirements::AGREED_FIELDS;
use super::{DevCommRequirements, DeviceAbi};
use crate::agreement::{all_gather_rows, Wait};
use crate::calls;
use crate::comm::Comm;
use crate::error::{Error, Refusal, Result};

const CALL: &str = calls::ncclDevCommCreate.name;

/// What one rank says in the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    /// Why this rank refused on its own, if it did (its own error says more).
    pub(super) refusal: Option<Refusal>,
    /// The loaded library's version code.
    pub(super) library: u32,
    /// The device code's header version code.
    pub(super) abi: u32,
    /// [`DevCommRequirements::agreed`]'s values, in its order.
    pub(super) fields: [u64; AGREED_FIELDS],
}

/// Words per [`Entry`] in the exchange.
const WIDTH: usize = 3 + AGREED_FIELDS;

/// The names of the fields compared, in the order of [`DevCommRequirements::agreed`].
fn field_names() -> [&'static str; AGREED_FIELDS] {
    DevCommRequirements::new().agreed().map(|(name, _)| name)
}

impl Entry {
    pub(super) fn of(
        reqs: &DevCommRequirements,
        library: u32,
        abi: DeviceAbi,
        refusal: Option<Refusal>,
    ) -> Self {
        Entry {
            refusal,
            library,
            abi: abi.version().code(),
            fields: reqs.agreed().map(|(_, value)| value),
        }
    }

    fn to_row(self) -> [u64; WIDTH] {
        let mut row = [0; WIDTH];
        row[0] = self.refusal.map_or(0, Refusal::code);
        row[1] = u64::from(self.library);
        row[2] = u64::from(self.abi);
        row[3..].copy_from_slice(&self.fields);
        row
    }

    fn from_row(row: &[u64]) -> Self {
        let mut fields = [0; AGREED_FIELDS];
        fields.copy_from_slice(&row[3..WIDTH]);
        Entry {
            refusal: Refusal::from_code(row[0]),
            // Written from u32s by `to_row`.
            library: row[1] as u32,
            abi: row[2] as u32,
            fields,
        }
    }
}

/// The verdict from every rank's entry (rank `i`'s at `all[i]`): the same on every rank,
/// since every rank judges the same entries. The first rank that refused, else the first
/// rank (then the first field) that differs from rank 0.
pub(super) fn judge(all: &[Entry]) -> Result<()> {
    if let Some((rank, reason)) = all
        .iter()
        .enumerate()
        .find_map(|(i, e)| e.refusal.map(|r| (i, r)))
    {
        return Err(Error::RankRefused {
            call: CALL,
            rank,
            reason,
        });
    }
    let Some(first) = all.first() else {
        return Ok(());
    };
    let names = field_names();
    for (rank, e) in all.iter().enumerate().skip(1) {
        let versions = [
            ("the NCCL library version", first.library, e.library),
            ("the device code's NCCL header version", first.abi, e.abi),
        ]
        .map(|(field, expected, value)| (field, u64::from(expected), u64::from(value)));
        let fields = names
            .iter()
            .zip(first.fields.iter().zip(&e.fields))
            .map(|(&field, (&expected, &value))| (field, expected, value));
        if let Some((field, expected, value)) = versions
            .into_iter()
            .chain(fields)
            .find(|(_, expected, value)| expected != value)
        {
            return Err(Error::RankMismatch {
                call: CALL,
                field,
                first: 0,
                expected,
                rank,
                value,
            });
        }
    }
    Ok(())
}

/// The exchange: every rank's entry, per communicator. Every communicator waits at most its
/// [`Comm::ready_timeout`], blocking ones too: a peer that cannot take part never sends its
/// entry.
fn exchange(comms: &[&Comm], mine: &[Entry]) -> Result<Vec<Vec<Entry>>> {
    let rows: Vec<Vec<u64>> = mine.iter().map(|entry| entry.to_row().to_vec()).collect();
    let wait = Wait {
        limit: |comm| Some(comm.ready_timeout()),
        what: "the device communicator's agreement exchange to finish",
        explain: Some(|comm| {
            format!(
                "every rank's entry in {CALL}'s agreement on rank {} (a rank that never joined \
                 was refused before it could: a Group open on its thread, or its communicator \
                 failed or suspended)",
                comm.rank()
            )
        }),
    };
    let all = all_gather_rows(comms, &rows, WIDTH, &wait)?;
    Ok(all
        .iter()
        .map(|rows| rows.chunks_exact(WIDTH).map(Entry::from_row).collect())
        .collect())
}

/// The exchange and its verdict for `comms[i]` whose own checks gave `local[i]` (the struct
/// for NCCL, or the refusal and this rank's error): the structs, where every rank may go
/// on, else the error every rank returns (a rank's own error first).
pub(super) fn agree(
    comms: &[&Comm],
    reqs: &DevCommRequirements,
    abi: DeviceAbi,
    local: Vec<std::result::Result<ncclDevCommRequirements_t, (Refusal, Error)>>,
) -> Result<Vec<ncclDevCommRequirements_t>> {
    let mine: Vec<Entry> = comms
        .iter()
        .zip(&local)
        .map(|(comm, verdict)| {
            let refusal = verdict.as_ref().err().map(|(refusal, _)| *refusal);
            Entry::of(reqs, comm.library().version().code(), abi, refusal)
        })
        .collect();
    // One rank alone has nobody to agree with.
    let all = if comms.iter().all(|comm| comm.size() == 1) {
        mine.iter().map(|entry| vec![*entry]).collect()
    } else {
        exchange(comms, &mine)?
    };
    let raws = local
        .into_iter()
        .map(|verdict| verdict.map_err(|(_, err)| err))
        .collect::<Result<Vec<_>>>()?;
    all.iter().try_for_each(|entries| judge(entries))?;
    Ok(raws)
}

#[cfg(test)]
mod tests;
