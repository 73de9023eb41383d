//! The agreement that comes before collectives whose sizes depend on per-rank state (the
//! variable list, the bucket layout, the root): every rank all-gathers a row of
//! `[fingerprint, refused]` and judges the same table, so a mismatch or one rank's refusal
//! becomes an error on every rank instead of collectives of differing sizes (a hang or
//! silent corruption).

use std::hash::{DefaultHasher, Hash, Hasher};

use nccl::cudarc::driver::DriverError;
use nccl::Comm;

use crate::{Error, Result};

/// The words of one rank's row: its fingerprint, then 1 where it refused the call.
const ROW: usize = 2;

/// A fingerprint of `value` for the ranks' agreements (e.g. [`TpGroup::agree`](crate::tp::TpGroup::agree)):
/// SipHash under the fixed keys of `DefaultHasher::new()`, so every process of one build
/// computes the same number for the same value (not across Rust versions: all ranks must run
/// the same binary).
pub fn fingerprint(value: &impl Hash) -> u64 {
    let mut hasher = DefaultHasher::new();
    value.hash(&mut hasher);
    hasher.finish()
}

/// What the table of rows says; every rank reads the same table, so every rank concludes
/// the same.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Every rank accepted and every fingerprint is rank 0's.
    Agreed,
    /// These ranks refused the call.
    Refused(Vec<usize>),
    /// These ranks' fingerprints differ from rank 0's.
    Mismatch(Vec<usize>),
}

/// Judges the all-gathered rows, rank `r`'s at `table[ROW * r..]`. A refusal comes first:
/// a rank that refused may also have fingerprinted something else.
pub(crate) fn judge(table: &[u64]) -> Verdict {
    let refused: Vec<usize> = table
        .chunks(ROW)
        .enumerate()
        .filter(|(_, row)| row.get(1) != Some(&0))
        .map(|(rank, _)| rank)
        .collect();
    if !refused.is_empty() {
        return Verdict::Refused(refused);
    }
    let first = table.first();
    let differing: Vec<usize> = table
        .chunks(ROW)
        .enumerate()
        .filter(|(_, row)| row.first() != first)
        .map(|(rank, _)| rank)
        .collect();
    if differing.is_empty() {
        Verdict::Agreed
    } else {
        Verdict::Mismatch(differing)
    }
}

/// Exchanges this rank's `fingerprint` and whether its own checks (`local`) failed, then
/// returns, on this rank: its own error if it had one, else the other ranks' refusal, else
/// a mismatch of fingerprints, else `Ok`. Every rank calls this, whatever its checks found:
/// that is what lets the others return instead of waiting in the collective that follows.
pub(crate) fn agree(
    comm: &Comm,
    op: &'static str,
    what: &'static str,
    fingerprint: u64,
    local: Result<()>,
) -> Result<()> {
    let row = [fingerprint, u64::from(local.is_err())];
    let exchanged = all_gather_row(comm, &row);
    // This rank's own error says more than the exchange's or the peers'.
    local?;
    match judge(&exchanged?) {
        Verdict::Agreed => Ok(()),
        Verdict::Refused(ranks) => Err(Error::PeerRefused { op, ranks }),
        Verdict::Mismatch(ranks) => Err(Error::Mismatch { what, ranks }),
    }
}

fn cuda(err: DriverError) -> Error {
    Error::Nccl(nccl::Error::from(err))
}

/// Every rank's `row`, in rank order. Runs on the communicator's own stream with nccl-rs
/// directly (not on a candle device: a rank whose variables are on the CPU must still take
/// part) and waits for the result, checking NCCL's asynchronous error while it waits; so
/// whatever stream later collectives use, this one has ended on this rank before they start.
fn all_gather_row(comm: &Comm, row: &[u64]) -> Result<Vec<u64>> {
    let stream = comm.stream();
    comm.context().bind_to_thread().map_err(cuda)?;
    // The stream first, then the upload: a pageable copy queued behind a collective that
    // waits for a peer holds the context's staging buffer, which a peer sharing the context
    // (ranks on one GPU in one process) needs for its own upload before it can join.
    comm.synchronize()?;
    let send = stream.clone_htod(row).map_err(cuda)?;
    let mut recv = stream
        .alloc_zeros::<u64>(row.len() * comm.size())
        .map_err(cuda)?;
    comm.all_gather(&send, &mut recv)?;
    comm.synchronize()?;
    stream.clone_dtoh(&recv).map_err(cuda)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_table_one_verdict() {
        assert_eq!(judge(&[7, 0, 7, 0, 7, 0]), Verdict::Agreed);
        assert_eq!(judge(&[7, 0]), Verdict::Agreed);
        assert_eq!(
            judge(&[7, 0, 8, 0, 7, 0, 9, 0]),
            Verdict::Mismatch(vec![1, 3])
        );
        // Rank 0 is the reference: when it alone differs, every other rank is named.
        assert_eq!(judge(&[1, 0, 7, 0, 7, 0]), Verdict::Mismatch(vec![1, 2]));
        // A refusal wins over a mismatch (a refusing rank may have hashed something else).
        assert_eq!(judge(&[7, 0, 8, 1, 7, 1]), Verdict::Refused(vec![1, 2]));
    }

    #[test]
    fn fingerprints_follow_the_value() {
        let layout = |dims: &[usize]| fingerprint(&("op", 0usize, [("w", dims.to_vec(), "f32")]));
        assert_eq!(layout(&[2, 3]), layout(&[2, 3]));
        assert_ne!(layout(&[2, 3]), layout(&[3, 2]));
        // Fixed keys: the same number in every process of one build.
        assert_eq!(
            fingerprint(&"x"),
            fingerprint(&String::from("x")),
            "str and String hash alike"
        );
    }
}
