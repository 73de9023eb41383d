//! The exchange by which ranks agree before a collective call NCCL leaves unchecked: each
//! rank's row of words is all-gathered over the communicator, so every rank judges the same
//! table and either every rank calls NCCL or every rank returns the same error. Window
//! registration ([`crate::window`]) and device communicators ([`crate::device`]) agree
//! this way; what a row holds and how it is judged is theirs.

use std::time::Duration;

use crate::collectives::Operation;
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::group::Group;

/// How long the exchanges of the other communicators of one call still get once one of them
/// failed (the all-gather of one communicator ends on all its ranks at about once).
const AFTER_FAILURE: Duration = Duration::from_millis(100);

/// How an exchange waits, and what its timeout says.
pub(crate) struct Wait {
    /// The longest wait for one communicator's exchange (`None`: until it ends).
    pub(crate) limit: fn(&Comm) -> Option<Duration>,
    /// What was awaited, for the error of the abort that follows a timeout.
    pub(crate) what: &'static str,
    /// The timeout's text for a communicator, in place of the wait's own, where there is one.
    pub(crate) explain: Option<fn(&Comm) -> String>,
}

/// All-gathers `rows[i]` (`width` words) over `comms[i]`, for every `i`, in one group (one
/// thread may drive several ranks of a communicator), and waits for each as `wait` says:
/// every rank's row per communicator, rank `r`'s at `[r * width..]`. A wait that runs out
/// leaves the exchange queued, where a late rank would pair with it: that communicator is
/// aborted, and so is every other of `comms` whose exchange is not done a moment later.
pub(crate) fn all_gather_rows(
    comms: &[&Comm],
    rows: &[Vec<u64>],
    width: usize,
    wait: &Wait,
) -> Result<Vec<Vec<u64>>> {
    let mut sends = Vec::with_capacity(comms.len());
    let mut recvs = Vec::with_capacity(comms.len());
    for (comm, row) in comms.iter().zip(rows) {
        debug_assert_eq!(row.len(), width);
        let stream = comm.stream();
        comm.context().bind_to_thread()?;
        sends.push(stream.clone_htod(row)?);
        recvs.push(stream.alloc_zeros::<u64>(width * comm.size())?);
    }
    {
        let mut group = Group::start()?;
        for ((comm, send), recv) in comms.iter().zip(&sends).zip(recvs.iter_mut()) {
            group.enqueue(comm, Operation::all_gather(send, recv))?;
        }
        group.finish()?;
    }
    let mut all = Vec::with_capacity(comms.len());
    let mut failure = None;
    for (comm, recv) in comms.iter().zip(&recvs) {
        // Once one wait failed, the others get only a moment more, but are still looked at:
        // an exchange not done by then stays queued on its communicator and would pair with
        // a later collective, so that communicator is aborted too, not left usable.
        let limit = match failure {
            None => (wait.limit)(comm),
            Some(_) => Some(AFTER_FAILURE),
        };
        let waited = comm
            .wait_stream(comm.stream(), limit)
            .map_err(|err| match err {
                Error::Timeout { waited, what } => comm.abort_stalled(
                    wait.what,
                    "the exchange is still queued and a late rank would pair with it",
                    Error::Timeout {
                        what: wait.explain.map_or(what, |explain| explain(comm)),
                        waited,
                    },
                ),
                other => other,
            });
        match (waited, &failure) {
            (Err(err), None) => failure = Some(err),
            (Ok(()), None) => all.push(comm.stream().clone_dtoh(recv)?),
            (_, Some(_)) => {}
        }
    }
    match failure {
        Some(err) => Err(err),
        None => Ok(all),
    }
}
