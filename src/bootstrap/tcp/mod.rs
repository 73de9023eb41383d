//! TCP rendezvous: rank 0 serves the unique id, every other rank fetches it.
//!
//! Rooms: [`wire`] (the messages), [`client`] (a joining rank), [`server`] (rank 0's listener
//! and accept loop), [`conversation`] (one connection on rank 0), [`socket`] (deadline-bound
//! reads and writes).

mod client;
mod conversation;
mod key;
mod keyed;
#[cfg(test)]
mod keyed_tests;
mod server;
mod socket;
#[cfg(test)]
mod tests;
mod wire;

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

pub use conversation::RejectedPeer;
pub use key::{RendezvousKey, MIN_KEY_BYTES};
pub use server::{ServeReport, TcpServer};

use super::bytes::job_key_hash;
use super::env::{address_from, lookup, process_var, vars, Vars};
use super::rendezvous::{sealed, Rendezvous, Transport};
use super::util::{io_error, Interrupt};
use super::{BootstrapError, Placement, Result};
use crate::UniqueId;

/// How long one connection may take from accept to ack, unless set otherwise. A well-behaved
/// rank needs a round trip or two; this only bounds misbehaving peers.
const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// A TCP rendezvous for one rank: rank 0 serves the id at an address, the others fetch it.
///
/// ```no_run
/// use nccl::bootstrap::TcpRendezvous;
/// use std::time::Duration;
///
/// # fn main() -> nccl::Result<()> {
/// # let (rank, world_size) = (1, 4);
/// let rendezvous = TcpRendezvous::new("node0:29500", rank, world_size)
///     .with_job_key("training-run-17")
///     .with_timeout(Duration::from_secs(60));
/// let id = rendezvous.exchange_with(nccl::UniqueId::new)?;
/// # let _ = id;
/// # Ok(())
/// # }
/// ```
pub type TcpRendezvous = Rendezvous<TcpTransport>;

/// The TCP transport of a [`TcpRendezvous`]: rank 0's address and the per-connection
/// deadline.
///
/// # Protocol, version 1
///
/// Rank 0 listens on the port of the rendezvous address: on that exact address when it is a
/// loopback address (`127.0.0.1`, `::1`, `localhost`), else on every interface (the name other
/// nodes use for rank 0 may resolve differently on rank 0 itself). Each other rank connects,
/// retrying refused connections until its deadline since rank 0 may start later. All integers
/// are big-endian.
///
/// | message | bytes |
/// | --- | --- |
/// | request (rank → rank 0), 32 bytes | magic `NRSB`, version `u16`, kind `u16` = 1, job-key hash `u64`, world size `u32`, rank `u32`, round `u32`, reserved `u32` |
/// | reply (rank 0 → rank), 16 bytes | magic `NRSB`, version `u16`, kind `u16` = 2, status `u16`, reserved `u16`, detail `u32`; then the 128-byte id when status is 0 |
/// | ack (rank → rank 0), 24 bytes | magic `NRSB`, version `u16`, kind `u16` = 3, rank `u32`, reserved `u32`, id fingerprint `u64` |
///
/// Status codes: 0 ok, 1 bad magic, 2 unsupported version (detail: rank 0's version), 3
/// malformed request, 4 wrong job key, 5 world-size mismatch (detail: rank 0's size), 6 rank
/// out of range (detail: world size), 7 rank already taken (detail 1: another connection is
/// still fetching it, retry; 2: it has acked), 8 timed out (retry), 9 busy (retry), 10 early
/// (rank 0 still serves an earlier round, retry; detail: rank 0's round), 11 late (rank 0
/// already serves a later round). The round counts the exchanges this process made under the
/// job key before, from 0, on every rank alike. Later versions keep the first 16 bytes of a reply as they are, so a peer of any version can read
/// why it was turned away.
///
/// Rank 0 serves connections concurrently, each under its own deadline, so a peer that sends
/// garbage, stops half-way or never speaks gets its error code and is closed without holding
/// up the others. A rank counts as served once its ack arrives; rank 0 returns when every rank
/// has acked, so it *knows* all ranks hold the id, and fails with [`BootstrapError::Timeout`]
/// naming the missing ranks when the deadline passes first.
///
#[derive(Debug, Clone)]
pub struct TcpTransport {
    addr: String,
    connection_timeout: Duration,
    /// A listener rank 0 bound ahead of time ([`spawn_local`](super::spawn_local) binds before
    /// telling the children the port, so no other process can take it in between).
    prebound: Option<Arc<TcpListener>>,
    /// Ends rank 0's serving early (a [`spawn_local`](super::spawn_local) rank died).
    interrupt: Option<Interrupt>,
    /// The shared key: with it, only protocol version 2 is spoken.
    secret: Option<RendezvousKey>,
}

impl Transport for TcpTransport {}

impl sealed::Halves for TcpTransport {
    fn host<E: From<BootstrapError>>(
        rendezvous: &TcpRendezvous,
        make_id: impl FnOnce() -> Result<UniqueId, E>,
    ) -> Result<UniqueId, E> {
        let server = rendezvous.bind()?;
        let id = make_id()?;
        server.serve(id)?;
        Ok(id)
    }

    fn fetch(rendezvous: &TcpRendezvous) -> Result<UniqueId> {
        client::fetch(rendezvous)
    }
}

impl Rendezvous<TcpTransport> {
    /// A rendezvous at `addr` (`host:port`) for `rank` of `world_size`, with the default job
    /// key and timeouts.
    pub fn new(addr: impl Into<String>, rank: usize, world_size: usize) -> Self {
        let transport = TcpTransport {
            addr: addr.into(),
            connection_timeout: DEFAULT_CONNECTION_TIMEOUT,
            prebound: None,
            interrupt: None,
            secret: None,
        };
        Rendezvous::over(transport, rank, world_size)
    }

    /// A TCP rendezvous for `placement` from this process's environment: the address from
    /// `NCCL_RS_ADDR` or `MASTER_ADDR`/`MASTER_PORT`, the job key and the timeout as described
    /// in the [module documentation](super#environment-variables). Fails when no address is
    /// set.
    pub fn from_env(placement: &Placement) -> Result<Self> {
        Self::from_vars(placement, process_var)
    }

    /// Like [`from_env`](Self::from_env), reading variables through `vars`.
    pub fn from_vars(placement: &Placement, vars: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let vars: Vars<'_> = &vars;
        let addr = address_from(vars)?.ok_or_else(|| {
            BootstrapError::Config(
                "no TCP rendezvous address: set NCCL_RS_ADDR, or MASTER_ADDR and MASTER_PORT"
                    .to_owned(),
            )
        })?;
        let rendezvous =
            TcpRendezvous::new(addr, placement.rank, placement.world_size).configured_by(vars)?;
        Ok(match key_from(vars)? {
            Some(key) => rendezvous.with_secret(key),
            None => rendezvous,
        })
    }

    /// Speaks the encrypted, authenticated protocol (version 2) with `key`, which every rank
    /// must share: without the key a peer learns nothing and is turned away, and a rank only
    /// accepts an id from a rank 0 that holds it. See the [protocol](TcpTransport#protocol-version-2-with-a-key).
    pub fn with_secret(mut self, key: RendezvousKey) -> Self {
        self.transport.secret = Some(key);
        self
    }

    /// Whether this rendezvous has a key (speaks protocol version 2).
    pub fn is_encrypted(&self) -> bool {
        self.transport.secret.is_some()
    }

    /// Sets how long rank 0 gives one connection from accept to ack (default 10 s). Bounds
    /// how long a silent or slow peer keeps a server thread.
    pub fn with_connection_timeout(mut self, timeout: Duration) -> Self {
        self.transport.connection_timeout = timeout;
        self
    }

    pub(crate) fn with_prebound(mut self, listener: TcpListener) -> Self {
        self.transport.prebound = Some(Arc::new(listener));
        self
    }

    pub(crate) fn with_interrupt(mut self, interrupt: Interrupt) -> Self {
        self.transport.interrupt = Some(interrupt);
        self
    }

    /// The `host:port` address.
    pub fn addr(&self) -> &str {
        &self.transport.addr
    }

    /// Rank 0: binds the listener, without serving yet. With port 0 the system picks a free
    /// port: see [`TcpServer::local_addr`].
    pub fn bind(&self) -> Result<TcpServer> {
        self.require_rank0("listens")?;
        wire::wire_u32(self.world_size(), "world size")?;
        let listener = match &self.transport.prebound {
            Some(listener) => listener
                .try_clone()
                .map_err(|e| io_error("duplicating the pre-bound rendezvous listener", e))?,
            None => server::bind_listener(self.addr())?,
        };
        let local_addr = listener
            .local_addr()
            .map_err(|e| io_error("reading the rendezvous listener's address", e))?;
        Ok(TcpServer {
            listener,
            local_addr,
            world_size: self.world_size(),
            job_hash: job_key_hash(self.job_key()),
            keyed: match &self.transport.secret {
                Some(key) => Some(keyed::Keyed {
                    key: key.clone(),
                    job_digest: key::job_digest(self.job_key())?,
                }),
                None => None,
            },
            history: Arc::clone(&self.history),
            timeout: self.timeout(),
            connection_timeout: self.transport.connection_timeout,
            interrupt: self.transport.interrupt.clone(),
        })
    }
}

/// The rendezvous key from `NCCL_RS_RENDEZVOUS_KEY`, if set (blank counts as unset).
pub(crate) fn key_from(vars: Vars<'_>) -> Result<Option<RendezvousKey>> {
    lookup(vars, vars::RENDEZVOUS_KEY)
        .map(|text| RendezvousKey::from_var(&text))
        .transpose()
}
