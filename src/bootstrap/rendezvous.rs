//! What every rendezvous shares: which rank of how many, the job key, the deadline, and the
//! exchange built on the two halves a [`Transport`] provides.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::env::{job_key_from, timeout_from, Vars, DEFAULT_JOB_KEY, DEFAULT_TIMEOUT};
use super::history::History;
use super::ids::{id_count_from, IdCount};
use super::{BootstrapError, Result};
use crate::UniqueId;

/// How rank 0 hands the unique id to the other ranks: [`TcpTransport`](super::TcpTransport)
/// or [`FileTransport`](super::FileTransport). Sealed: the exchange relies on the guarantees
/// each transport documents (versioned protocol, job key checked, every wait bounded).
pub trait Transport: sealed::Halves + Clone + fmt::Debug + Send + Sync + 'static {}

pub(crate) mod sealed {
    use super::{BootstrapError, IdCount, Rendezvous, Result};
    use crate::UniqueId;

    /// The two halves of an exchange, written by each transport.
    pub trait Halves: Sized {
        /// Rank 0 of a world of two or more: gets ready (a TCP listener fails on a busy port
        /// before NCCL state exists), creates `count` ids with `make_id`, hands them to every
        /// other rank and returns once each has acknowledged them.
        fn host<E: From<BootstrapError>>(
            rendezvous: &Rendezvous<Self>,
            count: usize,
            make_ids: impl FnOnce(usize) -> Result<Vec<UniqueId>, E>,
        ) -> Result<Vec<UniqueId>, E>;

        /// Any other rank: waits for rank 0's ids, checks their number against `wanted`,
        /// acknowledges and returns them.
        fn fetch(rendezvous: &Rendezvous<Self>, wanted: IdCount) -> Result<Vec<UniqueId>>;
    }
}

/// A rendezvous for one rank: rank 0 creates the unique id and hands it over `T`, the other
/// ranks fetch it. [`TcpRendezvous`](super::TcpRendezvous) and
/// [`FileRendezvous`](super::FileRendezvous) name the two kinds; their constructors and
/// transport settings are in the `impl Rendezvous<TcpTransport>` and
/// `impl Rendezvous<FileTransport>` blocks below, the settings they share (job key, timeout)
/// and the exchange in the generic one.
#[derive(Debug, Clone)]
pub struct Rendezvous<T> {
    rank: usize,
    world_size: usize,
    job_key: String,
    timeout: Duration,
    id_count: IdCount,
    pub(crate) history: Arc<History>,
    pub(crate) transport: T,
}

impl<T: Transport> Rendezvous<T> {
    /// `rank` of `world_size` over `transport`, with the default job key and timeout.
    pub(crate) fn over(transport: T, rank: usize, world_size: usize) -> Self {
        Rendezvous {
            rank,
            world_size,
            job_key: DEFAULT_JOB_KEY.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            id_count: IdCount::Auto,
            history: History::of_process(),
            transport,
        }
    }

    /// Applies the job key, timeout and id count the variables set (see the
    /// [module documentation](super#environment-variables)).
    pub(crate) fn configured_by(self, vars: Vars<'_>) -> Result<Self> {
        Ok(self
            .with_job_key(job_key_from(vars))
            .with_timeout(timeout_from(vars)?)
            .with_id_count(id_count_from(vars)?))
    }

    /// Sets how many unique ids [`exchange_ids`](Self::exchange_ids) and
    /// [`exchange_ids_with`](Self::exchange_ids_with) hand out (default [`IdCount::Auto`]).
    /// The single-id methods ([`exchange`](Self::exchange), [`exchange_with`](Self::exchange_with),
    /// [`fetch`](Self::fetch)) always hand out one.
    pub fn with_id_count(mut self, count: IdCount) -> Self {
        self.id_count = count;
        self
    }

    /// The id count of [`exchange_ids`](Self::exchange_ids).
    pub fn id_count(&self) -> IdCount {
        self.id_count
    }

    /// Sets the job key; every rank must use the same one.
    pub fn with_job_key(mut self, key: impl Into<String>) -> Self {
        self.job_key = key.into();
        self
    }

    /// Sets how long the whole exchange may take on this rank: rank 0 waits this long for all
    /// ranks, the others this long for rank 0's id.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Keeps this rendezvous's exchange count apart from the rest of the process.
    #[cfg(test)]
    pub(crate) fn with_history(mut self, history: Arc<History>) -> Self {
        self.history = history;
        self
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The job key.
    pub fn job_key(&self) -> &str {
        &self.job_key
    }

    /// The exchange timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs this rank's side: rank 0 must pass `Some(id)` and returns once every rank holds it;
    /// the others pass `None` and return the fetched id.
    pub fn exchange(&self, id_if_rank0: Option<UniqueId>) -> Result<UniqueId> {
        let ids = self.exchange_n(IdCount::Exactly(1), id_if_rank0.map(|id| vec![id]))?;
        Ok(ids[0])
    }

    /// Like [`exchange`](Self::exchange), with rank 0 creating the id by calling `make_id`
    /// once the transport is ready to hand it out (so that, say, a busy port fails before
    /// NCCL state is created).
    pub fn exchange_with(
        &self,
        make_id: impl FnOnce() -> crate::Result<UniqueId>,
    ) -> crate::Result<UniqueId> {
        let ids = self.exchange_n_with(IdCount::Exactly(1), |_| Ok(vec![make_id()?]))?;
        Ok(ids[0])
    }

    /// Ranks other than 0: fetches the id from rank 0, waiting (up to the timeout) until rank
    /// 0 hands it out.
    pub fn fetch(&self) -> Result<UniqueId> {
        Ok(self.fetch_n(IdCount::Exactly(1))?[0])
    }

    /// Hands out several unique ids, for
    /// [`Comm::init_rank_scalable`](crate::Comm::init_rank_scalable): rank 0 passes
    /// `Some(ids)` (as many as [`id_count`](Self::id_count) says, any number from 1 to the
    /// world size under [`IdCount::Auto`]) and returns once every rank holds them; the others
    /// pass `None` and return them, in rank 0's order.
    pub fn exchange_ids(&self, ids_if_rank0: Option<Vec<UniqueId>>) -> Result<Vec<UniqueId>> {
        self.exchange_n(self.id_count, ids_if_rank0)
    }

    /// Like [`exchange_ids`](Self::exchange_ids), with rank 0 creating the ids by calling
    /// `make_id` once per id ([`IdCount::Auto`] resolved by the world size) once the transport is
    /// ready.
    pub fn exchange_ids_with(
        &self,
        mut make_id: impl FnMut() -> crate::Result<UniqueId>,
    ) -> crate::Result<Vec<UniqueId>> {
        self.exchange_n_with(self.id_count, |count| {
            (0..count).map(|_| make_id()).collect()
        })
    }

    /// Ranks other than 0: fetches rank 0's ids, as many as [`id_count`](Self::id_count) says
    /// (any number under [`IdCount::Auto`]).
    pub fn fetch_ids(&self) -> Result<Vec<UniqueId>> {
        self.fetch_n(self.id_count)
    }

    fn exchange_n(
        &self,
        count: IdCount,
        ids_if_rank0: Option<Vec<UniqueId>>,
    ) -> Result<Vec<UniqueId>> {
        self.check_rank()?;
        count.check(self.world_size)?;
        match (self.rank, ids_if_rank0) {
            (0, Some(ids)) => {
                let n = ids.len();
                IdCount::Exactly(n).check(self.world_size)?;
                count.accepts(n).map_err(|_| {
                    BootstrapError::Config(format!(
                        "rank 0 was given {n} unique ids to hand out, but the rendezvous is set \
                         up for {count:?}"
                    ))
                })?;
                self.host(n, |_| Ok(ids))
            }
            (0, None) => Err(BootstrapError::Config(
                "rank 0 must provide the unique ids to hand out".to_owned(),
            )),
            (_, None) => T::fetch(self, count),
            (rank, Some(_)) => Err(BootstrapError::Config(format!(
                "only rank 0 provides the unique ids, but rank {rank} was given some"
            ))),
        }
    }

    fn exchange_n_with(
        &self,
        count: IdCount,
        make_ids: impl FnOnce(usize) -> crate::Result<Vec<UniqueId>>,
    ) -> crate::Result<Vec<UniqueId>> {
        self.check_rank()?;
        count.check(self.world_size)?;
        match self.rank {
            0 => {
                let n = count.resolve_for_host(self.world_size)?;
                self.host(n, |n| {
                    let ids = make_ids(n)?;
                    debug_assert_eq!(ids.len(), n);
                    Ok(ids)
                })
            }
            _ => Ok(T::fetch(self, count)?),
        }
    }

    fn fetch_n(&self, count: IdCount) -> Result<Vec<UniqueId>> {
        self.check_rank()?;
        count.check(self.world_size)?;
        if self.rank == 0 {
            return Err(BootstrapError::Config(
                "rank 0 hands out the unique id; it does not fetch it".to_owned(),
            ));
        }
        T::fetch(self, count)
    }

    /// Rank 0's side; a world of one needs no exchange.
    fn host<E: From<BootstrapError>>(
        &self,
        count: usize,
        make_ids: impl FnOnce(usize) -> Result<Vec<UniqueId>, E>,
    ) -> Result<Vec<UniqueId>, E> {
        match self.world_size {
            1 => make_ids(count),
            _ => T::host(self, count, make_ids),
        }
    }

    /// Checks rank and world size before any exchange starts.
    pub(crate) fn check_rank(&self) -> Result<()> {
        if self.world_size == 0 {
            return Err(BootstrapError::Config(
                "the world size must be at least 1".to_owned(),
            ));
        }
        if self.rank >= self.world_size {
            return Err(BootstrapError::RankOutOfRange {
                rank: self.rank,
                world_size: self.world_size,
            });
        }
        Ok(())
    }

    /// Fails unless this is rank 0 (`what` says what only rank 0 does).
    pub(crate) fn require_rank0(&self, what: &str) -> Result<()> {
        self.check_rank()?;
        match self.rank {
            0 => Ok(()),
            rank => Err(BootstrapError::Config(format!(
                "only rank 0 {what}, this is rank {rank}"
            ))),
        }
    }
}
