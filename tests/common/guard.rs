//! Guards for GPU tests that run several ranks in one process: multicast off, and a deadline
//! that ends a hung test instead of the whole run hanging.

use std::sync::{mpsc, Once};
use std::time::Duration;

/// Multicast (NVLS) stays off in anything that launches NCCL (the runner sets it too).
pub fn nvls_off() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var("NCCL_NVLS_ENABLE").as_deref() != Ok("0") {
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
    });
}

/// Aborts the whole process, saying which test hung, unless dropped within `limit`: a rank
/// that fails while its peers wait in a collective would otherwise hang the run.
pub struct Deadline(Option<mpsc::Sender<()>>);

impl Deadline {
    pub fn new(test: &'static str, limit: Duration) -> Self {
        let (tx, rx) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
                eprintln!(
                    "{test}: no result after {limit:?}; a rank probably failed while its peers \
                     wait in a collective (see the panics above). Aborting the process."
                );
                std::process::abort();
            }
        });
        Deadline(Some(tx))
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}
