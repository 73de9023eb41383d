//! The captures of this process still to be instantiated, by device: a rank whose capture
//! is instantiated waits for the others before the collective that agrees on it.
//!
//! Why: instantiating a graph can wait for the kernels running in its CUDA context, and
//! ranks on threads of one process sharing a GPU share that context. A rank that
//! instantiated first and went on to the agreement's collective left a kernel on the GPU
//! waiting for its peer, and the peer, still instantiating, waited for that kernel: seen
//! with two ranks sharing one H200 (a mixture of experts' step: one rank in
//! `cuGraphInstantiateWithFlags`, the other synchronising its agreement, until killed).
//! Every capture registers before its first collective, so once a rank's warm-up ended
//! (which its peers' warm-ups had to join) every peer of this process has registered; the
//! agreement waits until none of them is still to be instantiated. Ranks in other
//! processes have contexts of their own and are not waited for; captures of other groups on
//! the same GPU in this process are (the table knows devices, not groups), for at most the
//! caller's limit. One-rank groups, whose agreement needs no GPU, do not register.

use std::collections::HashMap;
use std::sync::{Condvar, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Captures still to be instantiated, by CUDA device ordinal.
static PENDING: LazyLock<(Mutex<HashMap<usize, usize>>, Condvar)> =
    LazyLock::new(|| (Mutex::new(HashMap::new()), Condvar::new()));

/// The table, whatever a thread that panicked while holding it left (counts only).
fn pending() -> MutexGuard<'static, HashMap<usize, usize>> {
    PENDING.0.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One capture on device `ordinal` still to be instantiated; dropped once it is (or
/// failed, or unwound).
pub(super) struct PendingCapture {
    ordinal: usize,
}

impl PendingCapture {
    pub(super) fn register(ordinal: usize) -> Self {
        *pending().entry(ordinal).or_insert(0) += 1;
        Self { ordinal }
    }
}

impl Drop for PendingCapture {
    fn drop(&mut self) {
        let mut table = pending();
        if let Some(count) = table.get_mut(&self.ordinal) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                table.remove(&self.ordinal);
            }
        }
        PENDING.1.notify_all();
    }
}

/// Waits until no capture on device `ordinal` in this process is still to be instantiated,
/// for at most `limit`; whether none is.
pub(super) fn wait_until_instantiated(ordinal: usize, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    let mut table = pending();
    while table.contains_key(&ordinal) {
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        table = PENDING
            .1
            .wait_timeout(table, deadline - now)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_ends_when_the_last_capture_of_its_device_is_instantiated() {
        // Ordinals no other test uses.
        let (a, b) = (1_000_001, 1_000_002);
        assert!(wait_until_instantiated(a, Duration::ZERO));
        let first = PendingCapture::register(a);
        let second = PendingCapture::register(a);
        let other = PendingCapture::register(b);
        assert!(!wait_until_instantiated(a, Duration::from_millis(20)));
        drop(first);
        assert!(!wait_until_instantiated(a, Duration::from_millis(20)));
        let waiter =
            std::thread::spawn(move || wait_until_instantiated(a, Duration::from_secs(30)));
        std::thread::sleep(Duration::from_millis(20));
        drop(second);
        assert!(waiter.join().unwrap());
        // Another device's capture is not waited for.
        assert!(wait_until_instantiated(a, Duration::ZERO));
        assert!(!wait_until_instantiated(b, Duration::ZERO));
        drop(other);
        assert!(wait_until_instantiated(b, Duration::ZERO));
    }
}
