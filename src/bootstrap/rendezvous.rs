//! What every rendezvous shares: which rank of how many, the job key, the deadline, and the
//! exchange built on the two halves a [`Transport`] provides.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::env::{job_key_from, timeout_from, Vars, DEFAULT_JOB_KEY, DEFAULT_TIMEOUT};
use super::history::History;
use super::{BootstrapError, Result};
use crate::UniqueId;

/// How rank 0 hands the unique id to the other ranks: [`TcpTransport`](super::TcpTransport)
/// or [`FileTransport`](super::FileTransport). Sealed: the exchange relies on the guarantees
/// each transport documents (versioned protocol, job key checked, every wait bounded).
pub trait Transport: sealed::Halves + Clone + fmt::Debug + Send + Sync + 'static {}

pub(crate) mod sealed {
    use super::{BootstrapError, Rendezvous, Result};
    use crate::UniqueId;

    /// The two halves of an exchange, written by each transport.
    pub trait Halves: Sized {
        /// Rank 0 of a world of two or more: gets ready (a TCP listener fails on a busy port
        /// before NCCL state exists), creates the id with `make_id`, hands it to every other
        /// rank and returns once each has acknowledged it.
        fn host<E: From<BootstrapError>>(
            rendezvous: &Rendezvous<Self>,
            make_id: impl FnOnce() -> Result<UniqueId, E>,
        ) -> Result<UniqueId, E>;

        /// Any other rank: waits for rank 0's id, acknowledges and returns it.
        fn fetch(rendezvous: &Rendezvous<Self>) -> Result<UniqueId>;
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
            history: History::of_process(),
            transport,
        }
    }

    /// Applies the job key and timeout the variables set (see the
    /// [module documentation](super#environment-variables)).
    pub(crate) fn configured_by(self, vars: Vars<'_>) -> Result<Self> {
        Ok(self
            .with_job_key(job_key_from(vars))
            .with_timeout(timeout_from(vars)?))
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
        self.check_rank()?;
        match (self.rank, id_if_rank0) {
            (0, Some(id)) => self.host(|| Ok(id)),
            (0, None) => Err(BootstrapError::Config(
                "rank 0 must provide the unique id to hand out".to_owned(),
            )),
            (_, None) => T::fetch(self),
            (rank, Some(_)) => Err(BootstrapError::Config(format!(
                "only rank 0 provides the unique id, but rank {rank} was given one"
            ))),
        }
    }

    /// Like [`exchange`](Self::exchange), with rank 0 creating the id by calling `make_id`
    /// once the transport is ready to hand it out (so that, say, a busy port fails before
    /// NCCL state is created).
    pub fn exchange_with(
        &self,
        make_id: impl FnOnce() -> crate::Result<UniqueId>,
    ) -> crate::Result<UniqueId> {
        self.check_rank()?;
        match self.rank {
            0 => self.host(make_id),
            _ => Ok(T::fetch(self)?),
        }
    }

    /// Ranks other than 0: fetches the id from rank 0, waiting (up to the timeout) until rank
    /// 0 hands it out.
    pub fn fetch(&self) -> Result<UniqueId> {
        self.check_rank()?;
        if self.rank == 0 {
            return Err(BootstrapError::Config(
                "rank 0 hands out the unique id; it does not fetch it".to_owned(),
            ));
        }
        T::fetch(self)
    }

    /// Rank 0's side; a world of one needs no exchange.
    fn host<E: From<BootstrapError>>(
        &self,
        make_id: impl FnOnce() -> Result<UniqueId, E>,
    ) -> Result<UniqueId, E> {
        match self.world_size {
            1 => make_id(),
            _ => T::host(self, make_id),
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
