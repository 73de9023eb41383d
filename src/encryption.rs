//! Encrypting NCCL's own TCP traffic (`ncclSetEncryption`, NCCL 2.32): a pre-shared key
//! (TLS 1.3 PSK) for every socket NCCL opens, process-wide.
//!
//! ```no_run
//! # fn main() -> nccl::Result<()> {
//! use nccl::encryption::{set_encryption, EncryptionKey};
//!
//! // The same secret on every process of the job, before any id or communicator exists.
//! let secret = std::env::var("MY_JOB_SECRET").expect("set by the launcher");
//! set_encryption(&EncryptionKey::new(secret.as_bytes())?)?;
//! // ... UniqueId::new / the rendezvous / Comm::init_rank as usual ...
//! # Ok(())
//! # }
//! ```
//!
//! # What it protects, and what protects the rest
//!
//! NCCL encrypts and authenticates the TCP sockets it owns: its bootstrap (where ranks find
//! each other) and the `NET/Socket` transport's data. It does not cover InfiniBand/RoCE, NVLink
//! or shared memory (NCCL's `setup` guide says so), and a peer without the key cannot complete
//! the TLS handshake: NCCL drops its connection.
//!
//! The unique id travels before NCCL's sockets exist, through whatever the application uses. With
//! nccl-rs's TCP rendezvous, give it a [`RendezvousKey`](crate::bootstrap::RendezvousKey) too
//! ([`TcpRendezvous::with_secret`](crate::bootstrap::TcpRendezvous::with_secret) or
//! `NCCL_RS_RENDEZVOUS_KEY`): that encrypts and authenticates the id itself, so the exchange
//! does not become the weak link. One secret can serve both:
//! [`RendezvousKey::encryption_key`](crate::bootstrap::RendezvousKey::encryption_key) derives
//! this key from it one-way.
//!
//! # When to call it
//!
//! Before the process creates its first unique id or communicator (NCCL's documentation: before
//! `ncclGetUniqueId` or any other operation that may open network connections), with the same
//! key on every process of the job, unchanged for the job's lifetime: NCCL reads the key as it
//! opens each connection, so a key changed half-way splits the job. [`set_encryption`] refuses
//! once this process made an id or a communicator through nccl-rs.
//!
//! # When NCCL cannot encrypt
//!
//! NCCL only encrypts when it was built with `TLS_BACKEND=OPENSSL3` and finds OpenSSL 3
//! (`libssl.so.3`, `libcrypto.so.3`) at run time. `ncclSetEncryption` itself succeeds either
//! way (it only stores the key); the failure comes with the first connection, which is the
//! first communicator's init. In NCCL's source (`ncclSetEncryption`, `ncclGetCryptConnectionMode`
//! and `cryptSetMasterKey` in `src/misc/crypt.cc`, 2.32; the key is installed when a socket
//! connects or accepts) a build without TLS returns `ncclInvalidUsage` with the warning
//! "NCCL was built without TLS support but a pre-shared key was configured", and a missing
//! OpenSSL `ncclSystemError`. While a key is set, joins report those two as
//! [`Error::Unavailable`] naming `ncclSetEncryption`, so the cause is not mistaken for a
//! misuse of the communicator, but only where NCCL's last error (`ncclGetLastError`) says so
//! ("without TLS", or "ncclCrypt" for OpenSSL): that buffer is process-wide and may be empty
//! or overwritten by another thread, and an `ncclInvalidUsage` without that text is left as
//! it is, since it can as well be a real misuse.

use std::fmt;
use std::os::raw::c_char;
use std::sync::atomic::{AtomicBool, Ordering};

use zeroize::Zeroize;

use crate::calls;
use crate::error::{Error, Result, ResultCode};
use crate::library;

/// The fewest key bytes NCCL accepts (`ncclPskMinBytes` in NCCL's source; NCCL returns
/// `ncclInvalidArgument` below it).
pub const MIN_ENCRYPTION_KEY_BYTES: usize = 32;

/// Whether this process set a key through [`set_encryption`].
static KEY_SET: AtomicBool = AtomicBool::new(false);
/// Whether this process made a unique id or a communicator through nccl-rs, after which NCCL
/// may have opened sockets and a key would come too late.
static NETWORK_STARTED: AtomicBool = AtomicBool::new(false);

/// The pre-shared key of NCCL's TLS: at least [`MIN_ENCRYPTION_KEY_BYTES`] bytes, none of them
/// zero (NCCL reads the key as a C string, so bytes after a zero would be silently dropped).
///
/// `Debug` never shows the key, and the bytes are zeroed when it is dropped. NCCL keeps its own
/// copy (and erases it when replaced).
pub struct EncryptionKey {
    /// The key and a terminating zero, as NCCL reads it.
    c_string: Box<[u8]>,
}

impl EncryptionKey {
    /// A key from the secret's bytes, e.g. the text of a random hex string. Refuses a key
    /// shorter than [`MIN_ENCRYPTION_KEY_BYTES`], one with a zero byte, and one that repeats a
    /// single byte (a placeholder, not a key). Errors never quote the key.
    pub fn new(secret: &[u8]) -> Result<Self> {
        if secret.len() < MIN_ENCRYPTION_KEY_BYTES {
            return Err(Error::invalid(format!(
                "an encryption key needs at least {MIN_ENCRYPTION_KEY_BYTES} bytes (NCCL's \
                 minimum), this one has {}",
                secret.len()
            )));
        }
        if let Some(at) = secret.iter().position(|&b| b == 0) {
            return Err(Error::invalid(format!(
                "the encryption key has a zero byte at {at}: NCCL reads the key as a C string \
                 and would ignore the rest; use text, e.g. `openssl rand -hex 32`"
            )));
        }
        if secret.iter().all(|&b| b == secret[0]) {
            return Err(Error::invalid(
                "the encryption key repeats one byte: use random text, e.g. `openssl rand -hex \
                 32`",
            ));
        }
        let mut c_string = vec![0u8; secret.len() + 1].into_boxed_slice();
        c_string[..secret.len()].copy_from_slice(secret);
        Ok(EncryptionKey { c_string })
    }

    /// The key's length in bytes.
    pub fn len(&self) -> usize {
        self.c_string.len() - 1
    }

    /// Always false: an empty key is refused by [`EncryptionKey::new`].
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The key as text, for tests that compare derived keys.
    #[cfg(test)]
    pub(crate) fn secret_for_tests(&self) -> String {
        String::from_utf8_lossy(&self.c_string[..self.len()]).into_owned()
    }

    fn as_c_ptr(&self) -> *const c_char {
        self.c_string.as_ptr().cast()
    }
}

impl Clone for EncryptionKey {
    fn clone(&self) -> Self {
        EncryptionKey {
            c_string: self.c_string.clone(),
        }
    }
}

impl fmt::Debug for EncryptionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EncryptionKey({} bytes, hidden)", self.len())
    }
}

impl Drop for EncryptionKey {
    fn drop(&mut self) {
        self.c_string[..].zeroize();
    }
}

/// Makes NCCL encrypt every TCP socket it opens from now on with `key`
/// (`ncclSetEncryption`, NCCL 2.32, mode `NCCL_ENCRYPTION_MODE_PSK`). Process-global.
///
/// Call it before the first unique id or communicator, with the same key in every process
/// (see the [module documentation](self)); calling it again with another key before then
/// replaces the key. Fails with [`Error::Unsupported`] on NCCL older than 2.32, and with
/// [`Error::InvalidUsage`] once this process made a unique id or a communicator. Whether the
/// loaded NCCL can encrypt at all shows at the first join ([`Error::Unavailable`]).
pub fn set_encryption(key: &EncryptionKey) -> Result<()> {
    let lib = library::get()?;
    lib.require_call(&calls::ncclSetEncryption)?;
    if NETWORK_STARTED.load(Ordering::Acquire) {
        return Err(Error::usage(
            "set_encryption must come before the process's first unique id or communicator: \
             NCCL may already have opened sockets in clear text, and every process of a job \
             must use one key for its whole life",
        ));
    }
    let config = nccl_sys::ncclEncryptionConfig_t {
        mode: nccl_sys::ncclEncryptionMode_t::NCCL_ENCRYPTION_MODE_PSK.0 as _,
        psk: key.as_c_ptr(),
        ..Default::default()
    };
    // SAFETY: `config` comes from NCCL's initializer (size, magic, version) and `psk` points
    // to a zero-terminated string that lives until the call returns; NCCL copies it.
    let status = unsafe { lib.api().ncclSetEncryption(&config) };
    lib.check(calls::ncclSetEncryption.name, status)?;
    KEY_SET.store(true, Ordering::Release);
    Ok(())
}

/// Whether this process set an encryption key through [`set_encryption`].
pub fn encryption_is_set() -> bool {
    KEY_SET.load(Ordering::Acquire)
}

/// Records that NCCL may open sockets from now on (a unique id or a communicator was made).
pub(crate) fn network_started() {
    NETWORK_STARTED.store(true, Ordering::Release);
}

/// Explains a join's failure that comes from encryption NCCL cannot provide, while a key is
/// set; any other error is returned as it is.
pub(crate) fn explain(error: Error) -> Error {
    if !encryption_is_set() {
        return error;
    }
    match unavailable_reason(&error) {
        Some(reason) => Error::Unavailable {
            api: calls::ncclSetEncryption.name,
            reason,
        },
        None => error,
    }
}

/// Why NCCL could not encrypt, when `error` is how NCCL says so (see the module documentation
/// for the source of each case): the code alone is not enough, NCCL's last error must name
/// the cause.
fn unavailable_reason(error: &Error) -> Option<String> {
    let Error::Nccl {
        code, last_error, ..
    } = error
    else {
        return None;
    };
    let said = last_error.as_deref().unwrap_or("");
    let nccl_says = |reason: &str| {
        let quoted = if said.is_empty() {
            String::new()
        } else {
            format!(" (NCCL: {})", said.trim())
        };
        Some(format!("{reason}{quoted}"))
    };
    match code {
        ResultCode::InvalidUsage if said.contains("without TLS") => nccl_says(
            "the loaded NCCL was built without TLS support (it needs TLS_BACKEND=OPENSSL3), so \
             it cannot encrypt its sockets; use an NCCL built with it, or leave encryption off",
        ),
        ResultCode::SystemError if said.contains("ncclCrypt") => nccl_says(
            "NCCL could not load OpenSSL 3 (libssl.so.3 and libcrypto.so.3) for its TLS; \
             install it where the dynamic loader finds it",
        ),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_validated_without_being_shown() {
        let secret = b"0123456789abcdef0123456789abcdef";
        let key = EncryptionKey::new(secret).unwrap();
        assert_eq!(key.len(), 32);
        assert_eq!(&key.c_string[..32], secret);
        assert_eq!(key.c_string[32], 0, "zero-terminated for NCCL");
        let debug = format!("{key:?}");
        assert_eq!(debug, "EncryptionKey(32 bytes, hidden)");
        assert!(!debug.contains("0123"));

        let err = EncryptionKey::new(&secret[..31]).unwrap_err().to_string();
        assert!(
            err.contains("at least 32 bytes") && err.contains("has 31"),
            "{err}"
        );
        assert!(!err.contains("0123"), "{err}");

        let mut with_zero = secret.to_vec();
        with_zero[5] = 0;
        let err = EncryptionKey::new(&with_zero).unwrap_err().to_string();
        assert!(err.contains("zero byte at 5"), "{err}");

        let err = EncryptionKey::new(&[b'a'; 40]).unwrap_err().to_string();
        assert!(err.contains("repeats one byte"), "{err}");
    }

    #[test]
    fn only_nccl_s_tls_failures_are_explained() {
        let nccl = |code, last: Option<&str>| Error::Nccl {
            call: "ncclCommInitRank",
            code,
            description: "x".into(),
            last_error: last.map(str::to_owned),
        };
        let without_tls = "NCCL was built without TLS support but a pre-shared key was configured";
        let reason =
            unavailable_reason(&nccl(ResultCode::InvalidUsage, Some(without_tls))).unwrap();
        assert!(reason.contains("TLS_BACKEND=OPENSSL3"), "{reason}");
        assert!(reason.contains(without_tls), "{reason}");
        let reason = unavailable_reason(&nccl(
            ResultCode::SystemError,
            Some("ncclCrypt: failed to open libssl.so.3"),
        ))
        .unwrap();
        assert!(reason.contains("OpenSSL 3"), "{reason}");
        // Other failures stay what they are, an InvalidUsage with no last error included (the
        // buffer is process-wide: empty, or another thread's, it says nothing about TLS).
        assert!(unavailable_reason(&nccl(ResultCode::InvalidUsage, Some("bad rank"))).is_none());
        assert!(unavailable_reason(&nccl(ResultCode::InvalidUsage, None)).is_none());
        assert!(unavailable_reason(&nccl(ResultCode::InvalidUsage, Some(""))).is_none());
        assert!(unavailable_reason(&nccl(ResultCode::InvalidUsage, Some("  \n"))).is_none());
        assert!(unavailable_reason(&nccl(ResultCode::SystemError, None)).is_none());
        assert!(unavailable_reason(&Error::invalid("x")).is_none());
        // Without a key set, nothing is rewritten.
        if !encryption_is_set() {
            let error = explain(nccl(ResultCode::InvalidUsage, Some(without_tls)));
            assert!(matches!(error, Error::Nccl { .. }), "{error}");
        }
    }
}
