//! TCP rendezvous: rank 0 serves the unique id, every other rank fetches it.
//!
//! Rooms: [`wire`] (the messages), [`client`] (a joining rank), [`server`] (rank 0's listener
//! and accept loop), [`conversation`] (one connection on rank 0, either version), [`serve`]
//! (what one serve's connections share, and the steps both versions make), [`socket`]
//! (deadline-bound reads and writes), [`key`] (the [`RendezvousKey`]) and [`keyed`] (protocol
//! version 3's challenge, Noise handshake and messages).

mod client;
mod conversation;
mod key;
mod keyed;
#[cfg(test)]
mod keyed_tests;
mod serve;
mod server;
mod socket;
#[cfg(test)]
mod tests;
mod wire;

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

pub use key::{RendezvousKey, MIN_KEY_BYTES};
pub use serve::RejectedPeer;
pub use server::{ServeReport, TcpServer};

use super::bytes::job_key_hash;
use super::env::{address_from, lookup, process_var, vars, Vars};
use super::ids::IdCount;
use super::rendezvous::{sealed, Rendezvous, Transport};
use super::util::{io_error, Interrupt};
use super::{BootstrapError, Placement, Result};
use crate::UniqueId;

/// How long one connection may take from accept to ack, unless set otherwise. A well-behaved
/// rank needs a round trip or two; this only bounds misbehaving peers.
const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one connection may take from accept to its whole request (version 3: the opening
/// and, after rank 0's challenge, the hello), at most; a shorter connection timeout shortens
/// it too. A rank sends its request the moment it connects (one round trip more with a key),
/// so this only drops peers that connect and say nothing, which would otherwise hold one of
/// rank 0's bounded handlers each for a whole connection timeout. A rank dropped by it is
/// told "timed out" and tries again.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

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
/// | request (rank → rank 0), 32 bytes | magic `NRSB`, version `u16`, kind `u16` = 1, job-key hash `u64`, world size `u32`, rank `u32`, round `u32`, ids wanted `u32` |
/// | reply (rank 0 → rank), 16 bytes | magic `NRSB`, version `u16`, kind `u16` = 2, status `u16`, reserved `u16`, detail `u32`; when status is 0, detail is the number of ids *k* and the *k* 128-byte ids follow |
/// | ack (rank → rank 0), 24 bytes | magic `NRSB`, version `u16`, kind `u16` = 3, rank `u32`, reserved `u32`, id fingerprint `u64` |
///
/// Status codes: 0 ok, 1 bad magic, 2 unsupported version (detail: rank 0's version), 3
/// malformed request, 4 wrong job key, 5 world-size mismatch (detail: rank 0's size), 6 rank
/// out of range (detail: world size), 7 rank already taken (detail 1: another connection is
/// still fetching it, retry; 2: it has acked), 8 timed out (retry), 9 busy (retry), 10 early
/// (rank 0 still serves an earlier round, retry; detail: rank 0's round), 11 late (rank 0
/// already serves a later round), 13 id count mismatch (detail: how many ids rank 0 hands
/// out). The round counts the exchanges this process made under the
/// job key before, from 0, on every rank alike. Later versions keep the first 16 bytes of a reply as they are, so a peer of any version can read
/// why it was turned away.
///
/// **Several ids** (for [`Comm::init_rank_scalable`](crate::Comm::init_rank_scalable), see
/// [`IdCount`](super::IdCount)) came later within version 1, compatibly: the request's last
/// field, reserved and zero before, says how many ids the rank wants (0: one, as every earlier
/// rank sends; `0xffff_ffff`: whatever rank 0 hands out; else exactly that many), and an ok
/// reply's detail, zero before, says how many follow (0 from an earlier rank 0 means one). A
/// rank 0 refuses a request for another count with status 13, which an earlier rank reports as
/// an unknown status (a [`BootstrapError::Protocol`] error) and a current one as
/// [`BootstrapError::IdCountMismatch`]; a current rank that gets another count from an earlier
/// rank 0 fails with `IdCountMismatch` before acknowledging, and rank 0 then times out naming
/// it. The ack's fingerprint covers all ids (FNV-1a over their bytes in order; for one id,
/// [`UniqueId::fingerprint`]). Nothing changes on the wire while one id is exchanged.
///
/// Rank 0 serves connections concurrently, each under its own deadline, so a peer that sends
/// garbage, stops half-way or never speaks gets its error code and is closed without holding
/// up the others. A connection must deliver its whole request within 2 s of being accepted (or
/// the connection timeout, if shorter) and finish within the connection timeout: a peer that
/// connects and says nothing gives its handler back after those 2 s, so that silent
/// connections cannot keep the bounded number of handlers (twice the world size, from 16 to
/// 512) busy and the ranks turned away as busy for long. A rank counts as served once its ack
/// arrives; rank 0 returns when every rank has acked, so it *knows* all ranks hold the id, and
/// fails with [`BootstrapError::Timeout`] naming the missing ranks when the deadline passes
/// first.
///
/// Version 1 has no secret: anyone who can reach the port can fetch the id, and anyone on the
/// path can read it. Its job-key hash only keeps honest jobs apart. Use version 3 where that
/// matters (always, once NCCL's own traffic is encrypted with `ncclSetEncryption`).
///
/// # Protocol version 3, with a key
///
/// Spoken instead of version 1 by every rank that holds a [`RendezvousKey`]
/// ([`TcpRendezvous::with_secret`], or `NCCL_RS_RENDEZVOUS_KEY`; [`spawn_local`](super::spawn_local)
/// draws one per job). Rank 0 first sends a fresh random challenge; then the two sides run
/// the Noise protocol `Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s` (implemented by the `snow`
/// crate): each side sends a fresh X25519 ephemeral key, and the pre-shared key (PSK) is mixed
/// in before the first message. The PSK is BLAKE2s-256(`"nccl-rs rendezvous v2 psk\0"` ‖ user
/// key), never the user's key itself, and the prologue is `"nccl-rs rendezvous NRSB v3\0"` ‖
/// the challenge.
///
/// | message | bytes |
/// | --- | --- |
/// | opening (rank → rank 0), 8 bytes | magic `NRSB`, version `u16` = 3, kind `u16` = 6, in clear |
/// | challenge (rank 0 → rank), 48 bytes | a clear 16-byte version 1-layout header with version 3, kind 7, status 0 and detail 32; then 32 random bytes, fresh for this connection |
/// | hello (rank → rank 0), 112 bytes | magic `NRSB`, version `u16` = 3, kind `u16` = 4 in clear; then Noise message 1: ephemeral key (32), encrypted request (56: magic, version 3, kind 1, BLAKE2s-256 digest of `"nccl-rs rendezvous v2 job key\0"` ‖ job key (32), world size `u32`, rank `u32`, round `u32`, ids wanted `u32` as in version 1), tag (16) |
/// | sealed reply (rank 0 → rank) | a clear 16-byte version 1-layout header with version 3, kind 5, status 0 and detail = the length of what follows (64, or 64 + 128 *k*); then Noise message 2: ephemeral key (32), encrypted reply (a 16-byte reply header of version 3, kind 2, with the status codes of version 1 and, when ok, detail *k*; then the *k* 128-byte ids when the status is 0), tag (16) |
/// | ack (rank → rank 0), 48 bytes | magic `NRSB`, version `u16` = 3, kind `u16` = 3 in clear; then a Noise transport message: the 24-byte ack of version 1 (with version 3) encrypted, tag (16) |
///
/// A peer turned away before its hello decrypted gets a clear 16-byte header of version 3 as
/// in version 1: bad magic (1), unsupported version (2, detail 3; this is also the answer to a
/// version 1 request), malformed or truncated (3), timed out (8), busy (9), or 12: the hello
/// did not decrypt under rank 0's key and this connection's challenge. Every later refusal
/// (wrong job, world size, rank, round, duplicate) is sealed in message 2. A version 1 rank 0
/// answers an opening with its own unsupported-version reply, so the two sides always tell a
/// missing key from a wrong one: [`BootstrapError::Authentication`] on both, saying which side
/// lacks the key.
///
/// Version 2, which earlier builds speak with a key, is version 3 without the opening and the
/// challenge (its prologue is the label alone). The two do not interoperate: each side answers
/// the other's first message with unsupported version, and a rank reports
/// [`BootstrapError::VersionMismatch`] naming both versions.
///
/// What this gives, against an attacker who can read, change, drop, replay or inject traffic
/// on the network but does not hold the key:
///
/// * **Confidentiality.** The id only travels inside message 2, encrypted with ChaCha20-Poly1305
///   under keys from the PSK and both ephemeral keys. Forward secrecy: a key leaked later does
///   not open a recorded session (its ephemeral keys are gone).
/// * **Authentication, both ways.** Only a holder of the key can write a hello that decrypts
///   (so rank 0 never answers a stranger with the id) and a reply that decrypts (so a rank never
///   accepts an id from a fake rank 0). Any change to a message fails its tag.
/// * **Binding.** The request inside the hello carries the exact job key (as a digest), the
///   world size, the rank and the round; the Noise handshake hash covers it, and the reply and
///   the ack are encrypted under keys that depend on it. A message of another job, rank or
///   session cannot be substituted: the sealed refusal names a wrong job, world size or rank,
///   and anything spliced from another session fails to decrypt.
/// * **Replay.** A recorded hello is bound to the challenge of the connection it was made for;
///   sent on any other connection it does not decrypt under that connection's challenge, so
///   it is refused at once (status 12, [`BootstrapError::Authentication`] in rank 0's report)
///   and claims no rank: the genuine rank is never kept waiting by it. (Version 2 had no
///   challenge: a replayed hello decrypted and held its rank until the connection timed out,
///   and again with each replay.)
///
/// What it does not prevent: seeing that a rendezvous happens, between which hosts, and the
/// clear prefixes and sizes; delaying or dropping traffic, or resetting connections, so that
/// the rendezvous times out; opening connections faster than rank 0 drops the silent ones (2 s
/// each), so that ranks are turned away as busy (they retry until their own timeout);
/// injecting a clear refusal that makes a rank give up (an attacker on the path can stop the
/// exchange anyway). The key must reach every rank by a channel as safe as the id needs: an
/// environment variable is readable by the same user and by root. The file rendezvous does not
/// use the key; its file is created with mode `0600`.
#[derive(Debug, Clone)]
pub struct TcpTransport {
    addr: String,
    connection_timeout: Duration,
    /// A listener rank 0 bound ahead of time ([`spawn_local`](super::spawn_local) binds before
    /// telling the children the port, so no other process can take it in between).
    prebound: Option<Arc<TcpListener>>,
    /// Ends rank 0's serving early (a [`spawn_local`](super::spawn_local) rank died).
    interrupt: Option<Interrupt>,
    /// The shared key: with it, only protocol version 3 is spoken.
    secret: Option<RendezvousKey>,
}

impl Transport for TcpTransport {}

impl sealed::Halves for TcpTransport {
    fn host<E: From<BootstrapError>>(
        rendezvous: &TcpRendezvous,
        count: usize,
        make_ids: impl FnOnce(usize) -> Result<Vec<UniqueId>, E>,
    ) -> Result<Vec<UniqueId>, E> {
        let server = rendezvous.bind()?;
        let ids = make_ids(count)?;
        server.serve_ids(ids.clone())?;
        Ok(ids)
    }

    fn fetch(rendezvous: &TcpRendezvous, wanted: IdCount) -> Result<Vec<UniqueId>> {
        client::fetch(rendezvous, wanted)
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

    /// Speaks the encrypted, authenticated protocol (version 3) with `key`, which every rank
    /// must share: without the key a peer learns nothing and is turned away, and a rank only
    /// accepts an id from a rank 0 that holds it. See the [protocol](TcpTransport#protocol-version-3-with-a-key).
    pub fn with_secret(mut self, key: RendezvousKey) -> Self {
        self.transport.secret = Some(key);
        self
    }

    /// Whether this rendezvous has a key (speaks protocol version 3).
    pub fn is_encrypted(&self) -> bool {
        self.transport.secret.is_some()
    }

    /// Sets how long rank 0 gives one connection from accept to ack (default 10 s). Bounds
    /// how long a slow peer keeps a server thread; a silent one is dropped after 2 s (or this
    /// timeout, if shorter) without a whole request.
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
