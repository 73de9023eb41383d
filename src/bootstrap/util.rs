//! Small helpers the rooms of `bootstrap` share: a lock that survives a panicked holder,
//! nonces, deadlines, interrupting a wait, and I/O errors with context.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::BootstrapError;

/// Locks `mutex`, taking the state over from a holder that panicked: every state kept here
/// stays consistent between statements (counters, lists), and bookkeeping must go on (reaping
/// children, finishing a serve) whatever happened on another thread.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Waits on `changed` for at most `timeout` (forever when `None`), with [`lock`]'s take on a
/// panicked holder.
pub(crate) fn wait_for<'a, T>(
    changed: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: Option<Duration>,
) -> MutexGuard<'a, T> {
    match timeout {
        None => changed.wait(guard).unwrap_or_else(PoisonError::into_inner),
        Some(timeout) => {
            let (guard, _) = changed
                .wait_timeout(guard, timeout)
                .unwrap_or_else(PoisonError::into_inner);
            guard
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_poisoned_lock_is_taken_over() {
        let mutex = Arc::new(Mutex::new(1));
        let holder = Arc::clone(&mutex);
        let _ = std::thread::spawn(move || {
            let _guard = holder.lock();
            panic!("poison the lock");
        })
        .join();
        assert!(mutex.is_poisoned());
        *lock(&mutex) += 1;
        assert_eq!(*lock(&mutex), 2);
    }
}
