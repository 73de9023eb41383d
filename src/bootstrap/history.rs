//! What a process remembers of the exchanges it made, so that several exchanges under one
//! job key stay apart.
//!
//! A rank that finished exchange `n` and starts `n + 1` while rank 0 still serves `n` to
//! slower ranks must wait for `n + 1`, not pick up `n` again or be taken for a duplicate of
//! itself. TCP counts rounds (every process runs the same sequence of exchanges, so the counts
//! agree); the file rendezvous remembers which publications a rank already used.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

use super::util::lock;

/// The exchanges made under each (job-key hash, rank); see the [module docs](self).
#[derive(Debug, Default)]
pub(crate) struct History {
    entries: Mutex<HashMap<(u64, usize), Entry>>,
}

#[derive(Debug, Default)]
struct Entry {
    /// The next TCP round of this rank; rank 0's counts the serves it started.
    next_round: u32,
    /// File publications (nonces) this rank already acked.
    used: HashSet<u64>,
}

impl History {
    /// The history every rendezvous of this process shares, unless given another. It is per
    /// process, not per rendezvous object, because the exchanges of one job are often started
    /// by independent calls (two `exchange_id(.., Exchange::Auto)` build two rendezvous).
    pub(crate) fn of_process() -> Arc<History> {
        static PROCESS: OnceLock<Arc<History>> = OnceLock::new();
        Arc::clone(PROCESS.get_or_init(Arc::default))
    }

    fn with<T>(&self, job: u64, rank: usize, f: impl FnOnce(&mut Entry) -> T) -> T {
        f(lock(&self.entries).entry((job, rank)).or_default())
    }

    /// The TCP round a fetching rank is on.
    pub(crate) fn round(&self, job: u64, rank: usize) -> u32 {
        self.with(job, rank, |entry| entry.next_round)
    }

    /// Records that `rank` completed TCP round `round`.
    pub(crate) fn finish_round(&self, job: u64, rank: usize, round: u32) {
        self.with(job, rank, |entry| {
            entry.next_round = round.saturating_add(1)
        });
    }

    /// Rank 0: the TCP round this serve is, counting it as started.
    pub(crate) fn start_serving(&self, job: u64) -> u32 {
        self.with(job, 0, |entry| {
            let round = entry.next_round;
            entry.next_round = round.saturating_add(1);
            round
        })
    }

    /// Whether `rank` already used the file publication `nonce`.
    pub(crate) fn used(&self, job: u64, rank: usize, nonce: u64) -> bool {
        self.with(job, rank, |entry| entry.used.contains(&nonce))
    }

    /// Records that `rank` used the file publication `nonce`.
    pub(crate) fn mark_used(&self, job: u64, rank: usize, nonce: u64) {
        self.with(job, rank, |entry| entry.used.insert(nonce));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_and_publications_are_kept_per_job_and_rank() {
        let history = History::default();
        assert_eq!(history.start_serving(7), 0);
        assert_eq!(history.start_serving(7), 1);
        assert_eq!(history.start_serving(8), 0);
        assert_eq!(history.round(7, 1), 0);
        history.finish_round(7, 1, 0);
        assert_eq!(history.round(7, 1), 1);
        assert_eq!(history.round(7, 2), 0);
        assert!(!history.used(7, 1, 99));
        history.mark_used(7, 1, 99);
        assert!(history.used(7, 1, 99));
        assert!(!history.used(7, 2, 99));
        assert!(!history.used(8, 1, 99));
    }
}
