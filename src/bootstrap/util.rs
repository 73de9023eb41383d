//! Small helpers shared by the rendezvous methods: hashing, nonces, deadline-bounded socket I/O
//! and environment lookups.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::BootstrapError;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;

/// FNV-1a over `bytes`, continuing from `state`. Used for job-key hashes and file checksums,
/// where the goal is catching accidents (other jobs, torn or foreign files), not adversaries.
pub(crate) fn fnv1a_from(state: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(state, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(FNV_PRIME)
    })
}

/// FNV-1a of `bytes`.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_from(FNV_OFFSET, bytes)
}

/// The 64-bit hash of a job key that travels on the wire and names rendezvous files. The
/// prefix keeps it distinct from other FNV uses (the id fingerprint, file checksums).
pub(crate) fn job_key_hash(key: &str) -> u64 {
    fnv1a_from(fnv1a(b"nccl-rs job key\0"), key.as_bytes())
}

/// A fresh, unpredictable-enough 64-bit value for nonces and generated job keys.
///
/// `RandomState` is seeded from the operating system's randomness once per thread; mixing in a
/// process-wide counter, the pid and the wall clock keeps successive values and values from
/// different processes apart. Not cryptographic: nothing here relies on secrecy.
pub(crate) fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.write_u32(std::process::id());
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    hasher.write_u128(nanos);
    hasher.finish()
}

/// The instant `timeout` after `start`, saturating far in the future for timeouts too large
/// to represent (e.g. `Duration::MAX` meaning "wait forever").
pub(crate) fn deadline_after(start: Instant, timeout: Duration) -> Instant {
    const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);
    start
        .checked_add(timeout)
        .or_else(|| start.checked_add(CENTURY))
        .unwrap_or(start)
}

/// Time left until `deadline`, or `None` once it has passed.
pub(crate) fn time_left(deadline: Instant) -> Option<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    // A zero timeout is rejected by `set_read_timeout`, and means "already late" anyway.
    (!left.is_zero()).then_some(left)
}

/// Why a deadline-bounded read stopped short.
#[derive(Debug)]
pub(crate) enum ReadShort {
    /// The peer closed the connection after sending `got` bytes.
    Eof { got: usize },
    /// The deadline passed after `got` bytes.
    TimedOut { got: usize },
    /// Any other socket error.
    Io(io::Error),
}

/// Fills `buf` from `stream`, giving up at `deadline`. Each read gets the time that is left, so
/// a peer that trickles one byte at a time cannot stretch the wait.
pub(crate) fn read_full(
    stream: &TcpStream,
    buf: &mut [u8],
    deadline: Instant,
) -> Result<(), ReadShort> {
    let mut got = 0;
    while got < buf.len() {
        let Some(left) = time_left(deadline) else {
            return Err(ReadShort::TimedOut { got });
        };
        stream.set_read_timeout(Some(left)).map_err(ReadShort::Io)?;
        match (&*stream).read(&mut buf[got..]) {
            Ok(0) => return Err(ReadShort::Eof { got }),
            Ok(n) => got += n,
            // A timed-out read reports WouldBlock (Unix) or TimedOut (Windows); the deadline
            // check at the top of the loop decides whether that was final.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted
                        | io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(ReadShort::Io(e)),
        }
    }
    Ok(())
}

/// Writes all of `bytes` to `stream`, giving up at `deadline`.
pub(crate) fn write_full(stream: &TcpStream, bytes: &[u8], deadline: Instant) -> io::Result<()> {
    let mut sent = 0;
    while sent < bytes.len() {
        let Some(left) = time_left(deadline) else {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("write timed out after {sent} of {} bytes", bytes.len()),
            ));
        };
        stream.set_write_timeout(Some(left))?;
        match (&*stream).write(&bytes[sent..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted
                        | io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Ends a wait early once it has become pointless, e.g. rank 0 serving the id to ranks of a
/// [`spawn_local`](super::spawn_local) job of which one has died: the closure returns the
/// error to end the wait with, `None` while the wait may go on.
#[derive(Clone)]
pub(crate) struct Interrupt(Arc<dyn Fn() -> Option<BootstrapError> + Send + Sync>);

impl Interrupt {
    pub(crate) fn new(reason: impl Fn() -> Option<BootstrapError> + Send + Sync + 'static) -> Self {
        Interrupt(Arc::new(reason))
    }

    /// The error to end the wait with, if it must end.
    pub(crate) fn reason(&self) -> Option<BootstrapError> {
        (self.0)()
    }
}

impl fmt::Debug for Interrupt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Interrupt")
    }
}

/// Wraps an I/O error with what was being done.
pub(crate) fn io_error(context: impl Into<String>, source: io::Error) -> BootstrapError {
    BootstrapError::Io {
        context: context.into(),
        source,
    }
}

/// Reads one variable from the process environment. A value that is not valid Unicode is
/// passed on (lossily converted) rather than treated as unset, so that it fails validation
/// with its name instead of silently disappearing.
pub(crate) fn process_var(name: &str) -> Option<String> {
    std::env::var_os(name).map(|value| value.to_string_lossy().into_owned())
}

/// Looks `name` up through `vars`, treating an empty or all-blank value as unset (shells and
/// job scripts often export empty variables).
pub(crate) fn lookup(vars: &dyn Fn(&str) -> Option<String>, name: &str) -> Option<String> {
    vars(name).filter(|value| !value.trim().is_empty())
}

/// Parses a duration given in seconds (`"30"`, `"2.5"`) from variable `var`.
pub(crate) fn parse_seconds(var: &str, value: &str) -> Result<Duration, BootstrapError> {
    let invalid = |reason: &str| BootstrapError::Env {
        var: var.to_owned(),
        value: value.to_owned(),
        reason: reason.to_owned(),
    };
    let seconds: f64 = value
        .trim()
        .parse()
        .map_err(|_| invalid("expected a number of seconds, e.g. 30 or 2.5"))?;
    if !seconds.is_finite() || seconds <= 0.0 {
        return Err(invalid("the timeout must be a positive number of seconds"));
    }
    Duration::try_from_secs_f64(seconds).map_err(|_| invalid("the timeout is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_key_hash_is_stable_and_distinguishes_keys() {
        assert_eq!(job_key_hash("a"), job_key_hash("a"));
        assert_ne!(job_key_hash("a"), job_key_hash("b"));
        assert_ne!(job_key_hash(""), fnv1a(b""));
    }

    #[test]
    fn random_values_differ() {
        let values: std::collections::HashSet<u64> = (0..64).map(|_| random_u64()).collect();
        assert_eq!(values.len(), 64);
    }

    #[test]
    fn huge_timeouts_saturate() {
        let now = Instant::now();
        assert!(deadline_after(now, Duration::MAX) > now + Duration::from_secs(3600));
        assert_eq!(
            deadline_after(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
    }

    #[test]
    fn seconds_parse_and_reject() {
        assert_eq!(
            parse_seconds("T", "2.5").unwrap(),
            Duration::from_millis(2500)
        );
        assert_eq!(parse_seconds("T", " 30 ").unwrap(), Duration::from_secs(30));
        for bad in ["0", "-1", "abc", "inf", "NaN", "1e300"] {
            let err = parse_seconds("T", bad).unwrap_err();
            assert!(
                matches!(err, BootstrapError::Env { ref var, .. } if var == "T"),
                "{bad}: {err}"
            );
        }
    }
}
