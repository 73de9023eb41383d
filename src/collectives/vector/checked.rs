//! What crosses ranks: the checked mode's comparison of every rank's counts, and
//! [`Comm::exchange_counts`], the receive layout of an all-to-all from the send counts.
//!
//! Both are one small exchange through the crate's own operations on the device, waited
//! for; the comparison itself is a pure function of what was exchanged.

use std::time::Duration;

use cudarc::driver::CudaStream;

use super::dispatch::validate;
use super::layout::Layout;
use super::operation::VOperation;
use super::rules::{built, pair_counts, Built, VKind};
use crate::collectives::Operation;
use crate::comm::Comm;
use crate::dtype::NcclType;
use crate::error::{Error, Result};
use crate::thread_group;

/// What one rank contributes to the checked mode's exchange: whether its own arguments
/// passed, what it runs, and what it sends to and expects from every rank.
fn record(
    kind: VKind,
    dtype: crate::dtype::DataType,
    built: Option<Built>,
    counts: Option<(Vec<u64>, Vec<u64>)>,
    size: usize,
) -> Vec<u64> {
    let mut record = Vec::with_capacity(2 + 2 * size);
    record.push(u64::from(counts.is_none()));
    let built = match built {
        None => 0,
        Some(Built::Collective) => 1,
        Some(Built::PointToPoint) => 2,
    };
    record.push(kind.code() | built << 32 | u64::from(dtype.raw().0) << 40);
    match counts {
        Some((sends, recvs)) => {
            record.extend(sends);
            record.extend(recvs);
        }
        None => record.resize(2 + 2 * size, 0),
    }
    record
}

/// Compares every rank's record (rank `i`'s at `i * (2 + 2 * size)`): the same verdict, and
/// the same first mismatching pair, on every rank.
pub(crate) fn judge(name: &'static str, size: usize, all: &[u64]) -> Result<()> {
    let width = 2 + 2 * size;
    let rec = |i: usize| &all[i * width..(i + 1) * width];
    if let Some(i) = (0..size).find(|&i| rec(i)[0] != 0) {
        return Err(Error::invalid(format!(
            "{name}: rank {i} rejected its own arguments (its error says why); nothing was \
             enqueued on any rank"
        )));
    }
    if let Some(i) = (1..size).find(|&i| rec(i)[1] != rec(0)[1]) {
        return Err(Error::invalid(format!(
            "{name}: rank {i} runs another operation than rank 0 (a different v-collective, \
             root, element type or construction); nothing was enqueued on any rank"
        )));
    }
    for sender in 0..size {
        for receiver in 0..size {
            let sent = rec(sender)[2 + receiver];
            let expected = rec(receiver)[2 + size + sender];
            if sent != expected {
                return Err(Error::CountMismatch {
                    call: name,
                    sender,
                    receiver,
                    sent,
                    expected,
                });
            }
        }
    }
    Ok(())
}

/// A count exchange that did not finish in time is still queued on the communicator's
/// stream: a late rank would pair with it (and its next collective with this rank's next
/// one), so the ranks' views diverge. The communicator is aborted instead; other failures
/// already left it failed.
fn abandon_exchange(comm: &Comm, err: Error) -> Error {
    if !stalled(&err) {
        return err;
    }
    comm.abort_stalled(
        "the checked mode's count exchange to finish",
        "the exchange is still queued and a late rank would pair with it",
        err,
    )
}

/// Whether a failed wait for the count exchange left it queued (a timeout).
fn stalled(err: &Error) -> bool {
    matches!(err, Error::Timeout { .. })
}

/// The checked mode: every rank's counts are all-gathered and compared, and every rank
/// returns the same verdict before anything of `call` is enqueued (on any stream). This
/// rank's own invalid arguments (anything the enqueue itself would refuse: counts, layouts,
/// `stream`, buffer contexts, the reduction) are reported after the exchange, so the others
/// are not left waiting, nor enqueue without this rank.
pub(crate) fn verify<T: NcclType>(
    comm: &Comm,
    stream: &CudaStream,
    call: &VOperation<'_, T>,
    timeout: Duration,
) -> Result<()> {
    let (kind, rank, size) = (call.kind, comm.rank(), comm.size());
    let args = call.args(rank, size);
    let local = validate(comm, stream, call)
        .and_then(|_| built(kind, call.construction).map_err(|b| b.to_error(kind, rank, size)));
    let counts = local.is_ok().then(|| pair_counts(kind, &args));
    let mine = record(
        kind,
        T::DATA_TYPE,
        local.as_ref().ok().copied(),
        counts,
        size,
    );

    // On the communicator's own stream, whichever stream the operation itself runs on: the
    // exchange is waited for before the operation is enqueued.
    let own = comm.stream();
    let send = own.clone_htod(&mine)?;
    let mut all = own.alloc_zeros::<u64>(mine.len() * size)?;
    comm.enqueue_on(own, Operation::all_gather(&send, &mut all))?;
    comm.wait_stream(own, Some(timeout))
        .map_err(|err| abandon_exchange(comm, err))?;
    let all = own.clone_dtoh(&all)?;
    local?;
    judge(kind.name(), size, &all)
}

impl Comm {
    /// The receive layout of an all-to-all in which each rank knows only what it sends:
    /// `send_counts[j]` is what this rank sends to rank `j`; the result's count `i` is what
    /// rank `i` sends to this one, packed in rank order. The mixture-of-experts pattern:
    ///
    /// ```no_run
    /// # fn moe(comm: &nccl::Comm, tokens: &cudarc::driver::CudaSlice<f32>,
    /// #        per_expert_rank: Vec<usize>) -> nccl::Result<()> {
    /// use nccl::Layout;
    /// let recv_layout = comm.exchange_counts(&per_expert_rank)?;
    /// let mut routed = comm.stream().alloc_zeros::<f32>(recv_layout.total())?;
    /// comm.all_to_all_v(tokens, per_expert_rank, &mut routed, recv_layout)?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// Every rank must call it. It runs one all-to-all of `size` 64-bit counts on the
    /// communicator's stream and waits for it (watching the communicator's asynchronous
    /// error, as [`Comm::synchronize`] does), so with several communicators driven from one
    /// thread, call it from one thread per communicator.
    pub fn exchange_counts(&self, send_counts: &[usize]) -> Result<Layout> {
        thread_group::ensure_outside("Comm::exchange_counts")?;
        let size = self.size();
        if send_counts.len() != size {
            return Err(Error::invalid(format!(
                "Comm::exchange_counts on rank {}: {} send counts given, but the communicator \
                 has {size} ranks (one count per rank is needed)",
                self.rank(),
                send_counts.len()
            )));
        }
        // usize is at most 64 bits wide on every platform CUDA runs on.
        let host: Vec<u64> = send_counts.iter().map(|&count| count as u64).collect();
        let stream = self.stream();
        let send = stream.clone_htod(&host)?;
        let mut recv = stream.alloc_zeros::<u64>(size)?;
        let one_each = Layout::even(size, 1);
        self.enqueue_v(VOperation::all_to_all_v(
            &send,
            one_each.clone(),
            &mut recv,
            one_each,
        ))?;
        self.wait_stream(stream, None)?;
        let counts = stream
            .clone_dtoh(&recv)?
            .into_iter()
            .enumerate()
            .map(|(peer, count)| {
                usize::try_from(count).map_err(|_| {
                    Error::invalid(format!(
                        "Comm::exchange_counts on rank {}: rank {peer} sends {count} elements, \
                         more than this platform can address",
                        self.rank()
                    ))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Layout::packed(counts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DataType;

    /// The records of `size` ranks, each given as (sends, recvs).
    fn gather(kind: VKind, rows: &[(Vec<u64>, Vec<u64>)]) -> Vec<u64> {
        let size = rows.len();
        rows.iter()
            .flat_map(|row| {
                record(
                    kind,
                    DataType::Float32,
                    Some(Built::PointToPoint),
                    Some(row.clone()),
                    size,
                )
            })
            .collect()
    }

    /// M3: a timed-out count exchange leaves the all-gather queued, so the communicator
    /// must be aborted (before the fix the error was returned as is and it stayed usable);
    /// other failures of the wait already come from a failed communicator.
    #[test]
    fn m3_a_timed_out_exchange_is_abandoned() {
        let timeout = Error::Timeout {
            what: "work on the stream of rank 0".into(),
            waited: Duration::from_secs(1),
        };
        assert!(stalled(&timeout));
        assert!(!stalled(&Error::usage("aborted")));
        assert!(!stalled(&Error::invalid("x")));
    }

    #[test]
    fn agreeing_counts_pass() {
        // 0 sends 1 to itself and 2 to rank 1; rank 1 sends 3 to 0 and nothing to itself.
        let all = gather(
            VKind::AllToAll,
            &[(vec![1, 2], vec![1, 3]), (vec![3, 0], vec![2, 0])],
        );
        assert!(judge("all_to_all_v", 2, &all).is_ok());
    }

    #[test]
    fn the_first_mismatching_pair_is_named() {
        let all = gather(
            VKind::AllToAll,
            &[
                (vec![1, 2, 0], vec![1, 3, 0]),
                (vec![3, 0, 4], vec![2, 0, 0]),
                (vec![0, 5, 0], vec![0, 3, 0]),
            ],
        );
        // (1 -> 2): 4 sent, 3 expected comes before (2 -> 1): 5 sent, 0 expected.
        match judge("all_to_all_v", 3, &all) {
            Err(Error::CountMismatch {
                call,
                sender,
                receiver,
                sent,
                expected,
            }) => {
                assert_eq!(
                    (call, sender, receiver, sent, expected),
                    ("all_to_all_v", 1, 2, 4, 3)
                );
            }
            other => panic!("expected a count mismatch, got {other:?}"),
        }
        let text = judge("all_to_all_v", 3, &all).unwrap_err().to_string();
        assert!(text.contains("rank 1 sends 4 elements to rank 2"), "{text}");
        assert!(text.contains("which expects 3"), "{text}");
        assert!(text.contains("nothing was enqueued"), "{text}");
    }

    #[test]
    fn a_rank_with_invalid_arguments_is_reported_to_all() {
        let mut all = gather(
            VKind::AllToAll,
            &[(vec![1, 0], vec![1, 0]), (vec![0, 1], vec![0, 1])],
        );
        let width = 6;
        let broken = record(VKind::AllToAll, DataType::Float32, None, None, 2);
        assert_eq!(broken.len(), width);
        all[width..].copy_from_slice(&broken);
        let text = judge("all_to_all_v", 2, &all).unwrap_err().to_string();
        assert!(text.contains("rank 1 rejected its own arguments"), "{text}");
    }

    #[test]
    fn different_operations_are_reported() {
        let ok = (vec![1, 1], vec![1, 1]);
        let mut all = gather(VKind::Gather { root: 0 }, &[ok.clone(), ok.clone()]);
        let other_root = record(
            VKind::Gather { root: 1 },
            DataType::Float32,
            Some(Built::PointToPoint),
            Some(ok.clone()),
            2,
        );
        all[6..].copy_from_slice(&other_root);
        let text = judge("gather_v", 2, &all).unwrap_err().to_string();
        assert!(text.contains("rank 1 runs another operation"), "{text}");

        let other_type = record(
            VKind::Gather { root: 0 },
            DataType::Int32,
            Some(Built::PointToPoint),
            Some(ok),
            2,
        );
        all[6..].copy_from_slice(&other_type);
        assert!(judge("gather_v", 2, &all).is_err());
    }
}
