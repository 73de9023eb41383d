//! Rank 0's side: the listener, and serving the id to every rank, each connection on its own
//! thread (the conversation itself is in [`conversation`](super::conversation)).

use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use super::conversation::handle_connection;
use super::keyed::Keyed;
use super::serve::{RejectedPeer, Serve};
use super::wire::{ReplyHeader, Status, KIND_REPLY};
use crate::bootstrap::history::History;
use crate::bootstrap::util::{deadline_after, io_error, time_left, Interrupt};
use crate::bootstrap::{BootstrapError, Result};
use crate::UniqueId;

/// Binds rank 0's listener for `addr`: on the address itself when it is a loopback literal or
/// `localhost`, else on every interface at its port. A name other nodes use for rank 0 may
/// resolve to a different address on rank 0 itself (e.g. `127.0.1.1` from `/etc/hosts`), so
/// binding the resolved address would refuse exactly the ranks that need it.
pub(super) fn bind_listener(addr: &str) -> Result<TcpListener> {
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| {
        BootstrapError::Config(format!("rendezvous address {addr:?} has no port"))
    })?;
    let port: u16 = port.parse().map_err(|_| {
        BootstrapError::Config(format!("rendezvous address {addr:?} has an invalid port"))
    })?;
    let bare_host = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = bare_host.eq_ignore_ascii_case("localhost")
        || bare_host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback());
    let resolved: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| io_error(format!("resolving rendezvous address {addr}"), e))?
        .collect();
    let candidates: Vec<SocketAddr> = if loopback {
        resolved
    } else {
        let unspecified = match resolved.first() {
            Some(SocketAddr::V6(_)) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        };
        vec![SocketAddr::new(unspecified, port)]
    };
    // std sets SO_REUSEADDR on Unix, so a port left in TIME_WAIT by a previous job is reusable.
    TcpListener::bind(&candidates[..]).map_err(|e| {
        let hint = if e.kind() == io::ErrorKind::AddrInUse {
            "; another program holds the port: pick a free one with NCCL_RS_ADDR"
        } else {
            ""
        };
        io_error(
            format!("rank 0 cannot listen on {addr} ({candidates:?}){hint}"),
            e,
        )
    })
}

/// Rank 0's bound listener, ready to [`serve`](TcpServer::serve). Made by
/// [`TcpRendezvous::bind`](super::TcpRendezvous::bind).
#[derive(Debug)]
pub struct TcpServer {
    pub(super) listener: TcpListener,
    pub(super) local_addr: SocketAddr,
    pub(super) world_size: usize,
    pub(super) job_hash: u64,
    /// The key and job digest when the ranks share a key (protocol version 3).
    pub(super) keyed: Option<Keyed>,
    /// Counts the serves under the job key (the round is taken when serving starts).
    pub(super) history: Arc<History>,
    pub(super) timeout: Duration,
    pub(super) connection_timeout: Duration,
    pub(super) interrupt: Option<Interrupt>,
}

/// What happened during a successful [`TcpServer::serve`].
#[derive(Debug)]
#[non_exhaustive]
pub struct ServeReport {
    /// How long serving took.
    pub elapsed: Duration,
    /// Peers that were turned away (garbage, wrong job, duplicates...), in order.
    pub rejected: Vec<RejectedPeer>,
}

/// How the accept loop ended.
enum Ending {
    AllServed,
    TimedOut,
    Interrupted(BootstrapError),
}

impl TcpServer {
    /// The address the listener is bound to (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves `id` until every rank `1..world_size` has fetched and acknowledged it, or the
    /// timeout passes ([`BootstrapError::Timeout`] listing the missing ranks).
    ///
    /// Each connection is handled on its own thread under its own deadline; peers that
    /// misbehave are answered with an error status, closed, and listed in the report.
    pub fn serve(self, id: UniqueId) -> Result<ServeReport> {
        self.serve_ids(vec![id])
    }

    /// Like [`serve`](Self::serve), handing out several ids (in this order) for
    /// [`Comm::init_rank_scalable`](crate::Comm::init_rank_scalable): 1 to the world size, at
    /// most [`MAX_EXCHANGED_IDS`](crate::bootstrap::MAX_EXCHANGED_IDS). A joining rank that
    /// expects another count is refused with [`BootstrapError::IdCountMismatch`].
    pub fn serve_ids(self, ids: Vec<UniqueId>) -> Result<ServeReport> {
        crate::bootstrap::IdCount::Exactly(ids.len()).check(self.world_size)?;
        let started = Instant::now();
        if self.world_size <= 1 {
            return Ok(ServeReport {
                elapsed: started.elapsed(),
                rejected: Vec::new(),
            });
        }
        self.listener
            .set_nonblocking(true)
            .map_err(|e| io_error("making the rendezvous listener non-blocking", e))?;
        let serve = Arc::new(Serve::new(
            ids,
            self.world_size,
            self.job_hash,
            self.history.start_serving(self.job_hash),
            self.keyed.clone(),
            deadline_after(started, self.timeout),
            self.connection_timeout,
        ));
        let ending = self.accept_until_done(&serve);
        let (rejected, missing) = serve.finish();
        match ending {
            Ending::AllServed => Ok(ServeReport {
                elapsed: started.elapsed(),
                rejected,
            }),
            Ending::Interrupted(error) => Err(error),
            Ending::TimedOut => Err(self.timeout_error(missing, &rejected, started)),
        }
    }

    fn accept_until_done(&self, serve: &Arc<Serve>) -> Ending {
        // Enough handlers for every rank to connect at once, bounded against connection floods.
        let max_active = self.world_size.saturating_mul(2).clamp(16, 512);
        let mut next_connection = 0u64;
        let mut idle_pause = Duration::from_millis(1);
        loop {
            if serve.all_served() {
                return Ending::AllServed;
            }
            if let Some(error) = self.interrupt.as_ref().and_then(Interrupt::reason) {
                // The interrupt ends the wait for ranks that can no longer come. A rank that
                // already holds the ids may have acknowledged them before it ended, its ack
                // not yet read by its connection's thread: see those conversations out, so
                // that an exchange every rank completed is not reported as failed.
                serve.see_out_claims();
                if serve.all_served() {
                    return Ending::AllServed;
                }
                return Ending::Interrupted(error);
            }
            if time_left(serve.serve_deadline).is_none() {
                return Ending::TimedOut;
            }
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    idle_pause = Duration::from_millis(1);
                    next_connection += 1;
                    admit(serve, stream, peer, next_connection, max_active);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    thread::sleep(idle_pause);
                    idle_pause = (idle_pause * 2).min(Duration::from_millis(16));
                }
                // Aborted handshakes, interrupted calls, or running out of descriptors for a
                // moment: none of them is a reason to abandon the ranks still to come.
                Err(_) => thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    fn timeout_error(
        &self,
        missing: Vec<usize>,
        rejected: &[RejectedPeer],
        started: Instant,
    ) -> BootstrapError {
        let mut stage = format!(
            "waiting for {} of {} ranks to fetch the unique id from rank 0 on {}: missing {}",
            missing.len(),
            self.world_size,
            self.local_addr,
            list_ranks(&missing)
        );
        if !rejected.is_empty() {
            let shown: Vec<String> = rejected.iter().take(8).map(|r| r.to_string()).collect();
            stage.push_str("; turned away: ");
            stage.push_str(&shown.join("; "));
            if rejected.len() > shown.len() {
                stage.push_str(&format!("; and {} more", rejected.len() - shown.len()));
            }
        }
        BootstrapError::Timeout {
            stage,
            after: started.elapsed(),
            missing_ranks: missing,
        }
    }
}

/// Hands an accepted connection to a handler thread, or turns it away when too many are in
/// flight.
fn admit(
    serve: &Arc<Serve>,
    stream: TcpStream,
    peer: SocketAddr,
    connection: u64,
    max_active: usize,
) {
    // Accepted sockets must block (with timeouts); do not rely on inheritance rules.
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    if !serve.register(connection, &stream, max_active) {
        // Answer without lingering: this runs on the accept loop, which must keep going.
        // If the reply is lost, the peer sees a reset and retries all the same.
        if stream.set_nonblocking(true).is_ok() {
            let busy = ReplyHeader::encode_as(serve.version(), KIND_REPLY, Status::Busy, 0);
            let _ = (&stream).write(&busy);
        }
        return;
    }
    let worker = Arc::clone(serve);
    let spawned = thread::Builder::new()
        .name(format!("nccl-rs-rendezvous-{connection}"))
        .spawn(move || handle_connection(&worker, stream, peer, connection));
    if spawned.is_err() {
        // The stream went down with the closure; undo the bookkeeping.
        serve.unregister(connection);
    }
}

/// Formats a rank list, eliding the middle of very long ones.
fn list_ranks(ranks: &[usize]) -> String {
    const SHOWN: usize = 32;
    if ranks.len() <= SHOWN {
        return format!("{ranks:?}");
    }
    let head: Vec<String> = ranks[..SHOWN].iter().map(|r| r.to_string()).collect();
    format!("[{}, ... ({} more)]", head.join(", "), ranks.len() - SHOWN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_rank_lists_are_elided() {
        let ranks: Vec<usize> = (0..40).collect();
        let text = list_ranks(&ranks);
        assert!(text.ends_with("... (8 more)]"), "{text}");
        assert_eq!(list_ranks(&[1, 2]), "[1, 2]");
    }
}
