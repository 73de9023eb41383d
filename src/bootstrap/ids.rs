//! How many unique ids an exchange hands out: one for `ncclCommInitRank`, or several for
//! `ncclCommInitRankScalable` (NCCL 2.23), chosen by size or asked for; which ranks NCCL's
//! guide has create them; and how a list of ids is read from a message and fingerprinted
//! for the acks.

use super::env::{lookup, vars, Vars};
use super::{BootstrapError, Result};
use crate::id::UNIQUE_ID_BYTES;
use crate::release::Version;
use crate::UniqueId;

/// How many ranks one unique id's bootstrap root serves before NCCL makes them queue: NCCL's
/// `NCCL_UID_STAGGER_THRESHOLD` default (256). Above it each rank waits its turn to connect,
/// at `NCCL_UID_STAGGER_RATE` (7000 a second), so that one root is not flooded; several ids
/// split the ranks among several roots instead. [`IdCount::Auto`] uses one id per this many
/// ranks.
pub const SCALABLE_RANKS_PER_ID: usize = 256;

/// The most ids one exchange hands out: enough for 65,536 ranks at
/// [`SCALABLE_RANKS_PER_ID`] each, and what one message of the encrypted TCP protocol holds
/// with room to spare.
pub const MAX_EXCHANGED_IDS: usize = 256;

/// The first NCCL with `ncclCommInitRankScalable`.
const SCALABLE_SINCE: Version = Version::new(2, 23, 0);

/// The id count on the TCP wire for "whatever rank 0 hands out" ([`IdCount::Auto`]). A request
/// of a version that predates several ids carries 0 there, meaning exactly one.
pub(crate) const ANY_IDS: u32 = u32::MAX;

/// How many unique ids a rendezvous hands out (`NCCL_RS_UNIQUE_IDS`: `auto` or a number).
///
/// Only rank 0 decides under `Auto`; a joining rank on `Auto` takes what rank 0 hands out,
/// and one with an exact count fails with [`BootstrapError::IdCountMismatch`] on any other.
/// Several ids are joined with [`Comm::init_rank_scalable`](crate::Comm::init_rank_scalable).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IdCount {
    /// One id up to [`SCALABLE_RANKS_PER_ID`] ranks, else one per that many (rounded up, at
    /// most [`MAX_EXCHANGED_IDS`]), when the loaded NCCL has `ncclCommInitRankScalable`; one
    /// id on older NCCL. Rank 0's NCCL decides: every exchange (TCP, file, MPI) hands the
    /// other ranks rank 0's count.
    #[default]
    Auto,
    /// Exactly this many: at least 1, at most the world size and [`MAX_EXCHANGED_IDS`].
    Exactly(usize),
}

impl IdCount {
    /// The setting of `NCCL_RS_UNIQUE_IDS`; `Auto` when unset.
    pub fn from_vars(vars: impl Fn(&str) -> Option<String>) -> Result<IdCount> {
        id_count_from(&vars)
    }

    /// The count rank 0 hands out to `world_size` ranks, with `scalable` saying whether the
    /// loaded NCCL has `ncclCommInitRankScalable`.
    pub fn resolve(self, world_size: usize, scalable: bool) -> Result<usize> {
        match self {
            IdCount::Auto if scalable => Ok(auto_count(world_size)),
            IdCount::Auto => Ok(1),
            IdCount::Exactly(n) => {
                check_count(n, world_size)?;
                Ok(n)
            }
        }
    }

    /// Rank 0's count, asking the loaded NCCL whether it can join with several ids only when
    /// the answer matters (so that exchanges of small jobs never load NCCL for it).
    pub(crate) fn resolve_for_host(self, world_size: usize) -> Result<usize> {
        let scalable = match self {
            IdCount::Auto if auto_count(world_size) > 1 => crate::library::get()
                .map(|lib| lib.version() >= SCALABLE_SINCE)
                .unwrap_or(false),
            _ => false,
        };
        self.resolve(world_size, scalable)
    }

    /// What a joining rank puts on the wire.
    pub(crate) fn wire(self) -> u32 {
        match self {
            IdCount::Auto => ANY_IDS,
            // Checked against MAX_EXCHANGED_IDS before any exchange.
            IdCount::Exactly(n) => n as u32,
        }
    }

    /// Whether a joining rank set up like this accepts `handed_out` ids.
    pub(crate) fn accepts(self, handed_out: usize) -> Result<()> {
        match self {
            IdCount::Exactly(n) if n != handed_out => Err(BootstrapError::IdCountMismatch {
                handed_out,
                expected: n,
            }),
            _ => Ok(()),
        }
    }

    /// Checks an exact count against the world size before anything is sent.
    pub(crate) fn check(self, world_size: usize) -> Result<()> {
        match self {
            IdCount::Auto => Ok(()),
            IdCount::Exactly(n) => check_count(n, world_size),
        }
    }
}

/// One id per [`SCALABLE_RANKS_PER_ID`] ranks, rounded up, within `1..=MAX_EXCHANGED_IDS`.
fn auto_count(world_size: usize) -> usize {
    world_size
        .div_ceil(SCALABLE_RANKS_PER_ID)
        .clamp(1, MAX_EXCHANGED_IDS)
}

fn check_count(n: usize, world_size: usize) -> Result<()> {
    if n == 0 || n > world_size.max(1) || n > MAX_EXCHANGED_IDS {
        return Err(BootstrapError::Config(format!(
            "{n} unique ids for {world_size} ranks: a rendezvous hands out 1 to {} (at most one \
             per rank, NCCL's limit, and at most {MAX_EXCHANGED_IDS})",
            world_size.clamp(1, MAX_EXCHANGED_IDS)
        )));
    }
    Ok(())
}

/// The count message an MPI exchange broadcasts from rank 0 before any id: a status byte (1:
/// rank 0 settled the count), then the count as a big-endian `u32`.
#[cfg(any(test, feature = "mpi"))]
pub(crate) const COUNT_MESSAGE_LEN: usize = 5;

/// Rank 0's count message: `settled` is its own [`IdCount::resolve_for_host`].
#[cfg(any(test, feature = "mpi"))]
pub(crate) fn count_message(settled: &Result<usize>) -> [u8; COUNT_MESSAGE_LEN] {
    let mut message = [0u8; COUNT_MESSAGE_LEN];
    // A settled count is within 1..=MAX_EXCHANGED_IDS, so it fits.
    if let Some(count) = settled.as_ref().ok().and_then(|&n| u32::try_from(n).ok()) {
        message[0] = 1;
        message[1..].copy_from_slice(&count.to_be_bytes());
    }
    message
}

/// What the count message rank 0 broadcast means on a rank whose own setting is `own`: the
/// count every rank uses (rank 0's, never this rank's own resolution: under
/// [`IdCount::Auto`] that depends on the NCCL this process loaded, which may differ between
/// ranks), or why not. `Err` when rank 0 could not settle it (it reports its own error), or
/// when `own` asks for exactly another count ([`BootstrapError::IdCountMismatch`]).
#[cfg(any(test, feature = "mpi"))]
pub(crate) fn agreed_count(
    message: &[u8; COUNT_MESSAGE_LEN],
    own: IdCount,
    world_size: usize,
) -> Result<usize> {
    let mut count = [0u8; 4];
    count.copy_from_slice(&message[1..]);
    let count = u32::from_be_bytes(count) as usize;
    if message[0] != 1 {
        return Err(BootstrapError::Config(
            "rank 0 could not settle how many NCCL unique ids to create (see rank 0's error)"
                .to_owned(),
        ));
    }
    check_count(count, world_size)?;
    own.accepts(count)?;
    Ok(count)
}

/// `NCCL_RS_UNIQUE_IDS`: `auto` (or unset) or a count of at least 1.
pub(crate) fn id_count_from(vars: Vars<'_>) -> Result<IdCount> {
    let Some(text) = lookup(vars, vars::UNIQUE_IDS) else {
        return Ok(IdCount::Auto);
    };
    let value = text.trim();
    if value.eq_ignore_ascii_case("auto") {
        return Ok(IdCount::Auto);
    }
    match value.parse::<usize>() {
        Ok(n) if (1..=MAX_EXCHANGED_IDS).contains(&n) => Ok(IdCount::Exactly(n)),
        _ => Err(BootstrapError::Env {
            var: vars::UNIQUE_IDS.to_owned(),
            value: value.to_owned(),
            reason: format!("expected `auto` or a count from 1 to {MAX_EXCHANGED_IDS}"),
        }),
    }
}

/// Whether `rank` of `nranks` creates one of `nids` unique ids, by the rule of NCCL's guide
/// ("Creating a communicator using multiple ncclUniqueIds"): the ranks are cut into `nids`
/// groups as even as possible (the first `nranks % nids` one rank larger) and the first rank
/// of each group creates its id. 7 ranks and 3 ids: ranks 0, 3 and 5.
pub fn rank_has_root(rank: usize, nranks: usize, nids: usize) -> bool {
    if nids == 0 || nranks == 0 || rank >= nranks {
        return false;
    }
    let nids = nids.min(nranks);
    let (per_root, larger) = (nranks / nids, nranks % nids);
    let limit = larger * (per_root + 1);
    if rank < limit {
        rank.is_multiple_of(per_root + 1)
    } else {
        (rank - limit).is_multiple_of(per_root)
    }
}

/// The rank that creates id `index` under [`rank_has_root`]'s rule.
pub fn root_rank(index: usize, nranks: usize, nids: usize) -> usize {
    let nids = nids.clamp(1, nranks.max(1));
    let (per_root, larger) = (nranks / nids, nranks % nids);
    index * per_root + index.min(larger)
}

/// The fingerprint an ack carries: FNV-1a over the ids' bytes one after the other, which for
/// one id is [`UniqueId::fingerprint`] (so a single-id ack is what earlier versions send).
pub(crate) fn fingerprint(ids: &[UniqueId]) -> u64 {
    ids.iter()
        .flat_map(|id| id.as_bytes().iter())
        .fold(0xcbf2_9ce4_8422_2325u64, |hash, &b| {
            (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
}

/// The ids laid one after the other in `bytes`, in order, as messages carry them (the caller
/// has checked that `bytes` holds a whole number of ids).
pub(crate) fn decode_ids(bytes: &[u8]) -> Vec<UniqueId> {
    bytes
        .chunks_exact(UNIQUE_ID_BYTES)
        .map(|chunk| {
            let mut id = [0u8; UNIQUE_ID_BYTES];
            id.copy_from_slice(chunk);
            UniqueId::from_bytes(id)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rank_takes_rank_0s_count_over_its_own_resolution() {
        // Rank 0 loaded an NCCL with ncclCommInitRankScalable and settled 16 ids for 4096
        // ranks; a rank whose own NCCL predates it would resolve Auto to 1, but takes 16.
        let settled = IdCount::Auto.resolve(4096, true);
        assert_eq!(IdCount::Auto.resolve(4096, false).unwrap(), 1);
        let message = count_message(&settled);
        assert_eq!(agreed_count(&message, IdCount::Auto, 4096).unwrap(), 16);
        assert_eq!(
            agreed_count(&message, IdCount::Exactly(16), 4096).unwrap(),
            16
        );
        // A rank set up for exactly another count says so (on every rank, once agreed).
        match agreed_count(&message, IdCount::Exactly(2), 4096) {
            Err(BootstrapError::IdCountMismatch {
                handed_out: 16,
                expected: 2,
            }) => {}
            other => panic!("{other:?}"),
        }
        // Rank 0 failed to settle a count: every rank fails, none makes up its own.
        let failed = count_message(&IdCount::Exactly(9).resolve(4, true));
        assert_eq!(failed[0], 0);
        match agreed_count(&failed, IdCount::Auto, 4) {
            Err(BootstrapError::Config(text)) => assert!(text.contains("rank 0"), "{text}"),
            other => panic!("{other:?}"),
        }
        // A count no rank 0 of this build sends (more ids than ranks) is refused.
        let mut bogus = count_message(&Ok(1));
        bogus[1..].copy_from_slice(&5u32.to_be_bytes());
        assert!(agreed_count(&bogus, IdCount::Auto, 4).is_err());
    }

    #[test]
    fn roots_follow_nccl_s_rule() {
        let roots: Vec<usize> = (0..7).filter(|&r| rank_has_root(r, 7, 3)).collect();
        assert_eq!(roots, [0, 3, 5]);
        assert_eq!(
            (0..3).map(|i| root_rank(i, 7, 3)).collect::<Vec<_>>(),
            roots
        );
        for (nranks, nids) in [(2, 2), (3, 2), (8, 4), (1000, 7), (5, 1)] {
            let roots: Vec<usize> = (0..nranks)
                .filter(|&r| rank_has_root(r, nranks, nids))
                .collect();
            let computed: Vec<usize> = (0..nids).map(|i| root_rank(i, nranks, nids)).collect();
            assert_eq!(roots, computed, "{nranks} ranks, {nids} ids");
        }
        assert!(!rank_has_root(0, 4, 0));
    }

    #[test]
    fn auto_uses_one_id_per_stagger_threshold_when_nccl_can() {
        assert_eq!(IdCount::Auto.resolve(2, true).unwrap(), 1);
        assert_eq!(IdCount::Auto.resolve(256, true).unwrap(), 1);
        assert_eq!(IdCount::Auto.resolve(257, true).unwrap(), 2);
        assert_eq!(IdCount::Auto.resolve(4096, true).unwrap(), 16);
        assert_eq!(
            IdCount::Auto.resolve(1 << 30, true).unwrap(),
            MAX_EXCHANGED_IDS
        );
        assert_eq!(IdCount::Auto.resolve(4096, false).unwrap(), 1);
        assert_eq!(IdCount::Exactly(2).resolve(3, false).unwrap(), 2);
        let err = IdCount::Exactly(3)
            .resolve(2, true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("3 unique ids for 2 ranks"), "{err}");
        assert!(IdCount::Exactly(0).resolve(2, true).is_err());
    }

    #[test]
    fn the_variable_reads_auto_or_a_count() {
        let with = |value: &'static str| {
            move |name: &str| (name == vars::UNIQUE_IDS).then(|| value.to_owned())
        };
        assert_eq!(IdCount::from_vars(|_| None).unwrap(), IdCount::Auto);
        assert_eq!(IdCount::from_vars(with("auto")).unwrap(), IdCount::Auto);
        assert_eq!(
            IdCount::from_vars(with(" 3 ")).unwrap(),
            IdCount::Exactly(3)
        );
        for bad in ["0", "-1", "many", "257"] {
            let err = IdCount::from_vars(with(bad)).unwrap_err().to_string();
            assert!(err.contains("NCCL_RS_UNIQUE_IDS"), "{err}");
        }
    }

    #[test]
    fn one_id_fingerprints_as_before_and_order_matters() {
        let a = UniqueId::from_bytes([1; UNIQUE_ID_BYTES]);
        let b = UniqueId::from_bytes([2; UNIQUE_ID_BYTES]);
        assert_eq!(fingerprint(&[a]), a.fingerprint());
        assert_ne!(fingerprint(&[a, b]), fingerprint(&[b, a]));
    }
}
