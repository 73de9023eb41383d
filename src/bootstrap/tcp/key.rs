//! The pre-shared key of the encrypted rendezvous (protocol version 3): parsing, generating,
//! and deriving the Noise PSK from it. Hashing and randomness come from `snow`'s own
//! resolver, the same BLAKE2s and operating-system generator the handshake uses, so the
//! rendezvous adds no cryptographic code and no crate of its own.

use std::fmt;

use snow::params::HashChoice;
use snow::resolvers::{CryptoResolver, DefaultResolver};
use zeroize::Zeroize;

use crate::bootstrap::env::vars;
use crate::bootstrap::{BootstrapError, Result};

/// The fewest key bytes accepted: 256 bits, so that guessing the key is out of reach even for
/// an attacker who recorded a handshake and tries keys offline.
pub const MIN_KEY_BYTES: usize = 32;

/// Length of the PSK Noise mixes in, and of every BLAKE2s digest used here.
pub(super) const DIGEST_LEN: usize = 32;

/// Keeps the PSK apart from any other use of the same user key (say, NCCL's own
/// `ncclSetEncryption` with the same secret): the rendezvous never uses the key as given.
/// This label and the job label keep "v2": they name the derivations, which protocol version
/// 3 left as they were (so [`RendezvousKey::encryption_key`] gives the same NCCL key too).
const PSK_LABEL: &[u8] = b"nccl-rs rendezvous v2 psk\0";
/// Keeps NCCL's TLS key apart from the rendezvous PSK it is derived from.
const ENCRYPTION_LABEL: &[u8] = b"nccl-rs ncclSetEncryption psk\0";
/// Prefix of the job-key digest that the encrypted request carries.
const JOB_LABEL: &[u8] = b"nccl-rs rendezvous v2 job key\0";

/// The secret every rank of a job shares for the encrypted TCP rendezvous: at least
/// [`MIN_KEY_BYTES`] bytes the user supplies (or [`RendezvousKey::generate`] draws), kept only
/// as the 32-byte Noise PSK derived from them.
///
/// Its `Debug` never shows the key, and the derived bytes are zeroed when it is dropped. Give
/// it to [`TcpRendezvous::with_secret`](crate::bootstrap::TcpRendezvous::with_secret), or set
/// `NCCL_RS_RENDEZVOUS_KEY` (hex) on every rank.
#[derive(Clone)]
pub struct RendezvousKey {
    psk: [u8; DIGEST_LEN],
}

impl RendezvousKey {
    /// A key from raw bytes: at least [`MIN_KEY_BYTES`] of them, not all the same byte (a
    /// zeroed or placeholder buffer is a mistake, not a key).
    pub fn from_bytes(key: &[u8]) -> Result<Self> {
        if key.len() < MIN_KEY_BYTES {
            return Err(BootstrapError::Config(format!(
                "a rendezvous key needs at least {MIN_KEY_BYTES} bytes, this one has {}",
                key.len()
            )));
        }
        if key.iter().all(|&b| b == key[0]) {
            return Err(BootstrapError::Config(
                "the rendezvous key repeats one byte: use random bytes, e.g. `openssl rand -hex \
                 32`"
                .to_owned(),
            ));
        }
        let psk = blake2s(&[PSK_LABEL, key])?;
        Ok(RendezvousKey { psk })
    }

    /// A key from hexadecimal text (as `NCCL_RS_RENDEZVOUS_KEY` holds it): at least 64 hex
    /// digits, upper or lower case, surrounding whitespace ignored. Errors never quote the
    /// text.
    pub fn from_hex(text: &str) -> Result<Self> {
        let mut bytes = decode_hex(text.trim()).map_err(BootstrapError::Config)?;
        let key = Self::from_bytes(&bytes);
        bytes.zeroize();
        key
    }

    /// A fresh random key, drawn from the operating system's generator.
    pub fn generate() -> Result<Self> {
        let mut bytes: [u8; MIN_KEY_BYTES] = random_bytes()?;
        let key = Self::from_bytes(&bytes);
        bytes.zeroize();
        key
    }

    /// A fresh random key and its hex text, for handing to processes this one starts
    /// ([`spawn_local`](crate::bootstrap::spawn_local)). The text is not zeroed: it is copied
    /// into the children's environment anyway.
    pub(crate) fn generate_hex() -> Result<(Self, String)> {
        let mut bytes: [u8; MIN_KEY_BYTES] = random_bytes()?;
        let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        bytes.zeroize();
        Ok((Self::from_hex(&text)?, text))
    }

    /// The key from variable `NCCL_RS_RENDEZVOUS_KEY`'s value; the error names the variable
    /// and never shows the value.
    pub(crate) fn from_var(value: &str) -> Result<Self> {
        Self::from_hex(value).map_err(|error| BootstrapError::Env {
            var: vars::RENDEZVOUS_KEY.to_owned(),
            value: format!("<hidden, {} characters>", value.trim().chars().count()),
            reason: match error {
                BootstrapError::Config(reason) => reason,
                other => other.to_string(),
            },
        })
    }

    /// The key for NCCL's own TLS ([`set_encryption`](crate::encryption::set_encryption)),
    /// derived one-way from this one: BLAKE2s-256(`"nccl-rs ncclSetEncryption psk\0"` ‖
    /// the rendezvous PSK), as 64 hex digits. Every rank holding this rendezvous key derives the
    /// same encryption key, and neither key reveals the other, so one secret handed to the job
    /// protects both the unique id and NCCL's traffic.
    pub fn encryption_key(&self) -> crate::Result<crate::EncryptionKey> {
        let mut derived = blake2s(&[ENCRYPTION_LABEL, &self.psk])?;
        let mut text: Vec<u8> = Vec::with_capacity(2 * DIGEST_LEN);
        for byte in derived {
            for nibble in [byte >> 4, byte & 0xf] {
                text.push(b"0123456789abcdef"[usize::from(nibble)]);
            }
        }
        derived.zeroize();
        let key = crate::EncryptionKey::new(&text);
        text.zeroize();
        key
    }

    /// The 32-byte PSK of the Noise handshake.
    pub(super) fn psk(&self) -> &[u8; DIGEST_LEN] {
        &self.psk
    }
}

impl fmt::Debug for RendezvousKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RendezvousKey(<hidden>)")
    }
}

impl Drop for RendezvousKey {
    fn drop(&mut self) {
        self.psk.zeroize();
    }
}

/// The digest of a job key carried by the encrypted request: the exact key, where protocol
/// version 1 carries a 64-bit hash that only tells jobs apart by accident.
pub(super) fn job_digest(job_key: &str) -> Result<[u8; DIGEST_LEN]> {
    blake2s(&[JOB_LABEL, job_key.as_bytes()])
}

/// BLAKE2s-256 of `parts` one after the other (each label ends in a NUL, so parts cannot run
/// into each other).
fn blake2s(parts: &[&[u8]]) -> Result<[u8; DIGEST_LEN]> {
    let mut hash = DefaultResolver
        .resolve_hash(&HashChoice::Blake2s)
        .ok_or_else(|| missing("BLAKE2s"))?;
    for part in parts {
        hash.input(part);
    }
    let mut out = [0u8; DIGEST_LEN];
    hash.result(&mut out);
    Ok(out)
}

/// `N` bytes from the operating system's generator (keys, and rank 0's challenges).
pub(super) fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut rng = DefaultResolver
        .resolve_rng()
        .ok_or_else(|| missing("a random number generator"))?;
    let mut bytes = [0u8; N];
    rng.try_fill_bytes(&mut bytes).map_err(|e| {
        BootstrapError::Config(format!(
            "the operating system's random number generator failed: {e}"
        ))
    })?;
    Ok(bytes)
}

/// A primitive this build of `snow` lacks (its features are set in Cargo.toml).
fn missing(what: &str) -> BootstrapError {
    BootstrapError::Config(format!(
        "this build's Noise library has no {what} (a packaging error)"
    ))
}

/// Decodes hex text of at least `2 * MIN_KEY_BYTES` digits.
fn decode_hex(text: &str) -> std::result::Result<Vec<u8>, String> {
    let digits = text.as_bytes();
    if !digits.len().is_multiple_of(2) {
        return Err(format!(
            "expected hexadecimal digits in pairs, got {} digits",
            digits.len()
        ));
    }
    if digits.len() < 2 * MIN_KEY_BYTES {
        return Err(format!(
            "expected at least {} hexadecimal digits ({MIN_KEY_BYTES} bytes, e.g. from `openssl \
             rand -hex {MIN_KEY_BYTES}`), got {}",
            2 * MIN_KEY_BYTES,
            digits.len()
        ));
    }
    let value = |d: u8| char::from(d).to_digit(16);
    digits
        .chunks(2)
        .enumerate()
        .map(|(i, pair)| match (value(pair[0]), value(pair[1])) {
            (Some(high), Some(low)) => Ok((high * 16 + low) as u8),
            _ => Err(format!(
                "expected only hexadecimal digits, found another character at position {}",
                2 * i + usize::from(value(pair[0]).is_some())
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEX: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    #[test]
    fn hex_keys_parse_and_bad_ones_are_refused_without_showing_them() {
        let key = RendezvousKey::from_hex(HEX).expect("key");
        let upper = RendezvousKey::from_hex(&format!("  {}\n", HEX.to_uppercase())).expect("key");
        assert_eq!(key.psk(), upper.psk());
        assert_ne!(key.psk()[..], decode_hex(HEX).expect("hex")[..]);
        for bad in [
            &HEX[..62],
            &HEX[..63],
            "zz",
            &format!("{}zz", &HEX[..62]),
            &"ab".repeat(32),
        ] {
            let err = RendezvousKey::from_var(bad).unwrap_err();
            let text = err.to_string();
            assert!(text.contains("NCCL_RS_RENDEZVOUS_KEY"), "{text}");
            assert!(!text.contains(bad), "{text}");
        }
        assert_eq!(format!("{key:?}"), "RendezvousKey(<hidden>)");
    }

    #[test]
    fn the_encryption_key_is_derived_alike_and_differs_from_the_psk() {
        let hex = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";
        let a = RendezvousKey::from_hex(hex)
            .unwrap()
            .encryption_key()
            .unwrap();
        let b = RendezvousKey::from_hex(hex)
            .unwrap()
            .encryption_key()
            .unwrap();
        assert_eq!(a.len(), 64);
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        let other = RendezvousKey::generate().unwrap().encryption_key().unwrap();
        // Same length, hidden either way: compare through a test-only view of the bytes.
        assert_eq!(a.secret_for_tests(), b.secret_for_tests());
        assert_ne!(a.secret_for_tests(), other.secret_for_tests());
        assert!(!a.secret_for_tests().contains("00112233"));
    }

    #[test]
    fn generated_keys_differ_and_round_trip_through_hex() {
        let (key, text) = RendezvousKey::generate_hex().expect("key");
        assert_eq!(text.len(), 64);
        assert_eq!(
            RendezvousKey::from_hex(&text).expect("key").psk(),
            key.psk()
        );
        let other = RendezvousKey::generate().expect("key");
        assert_ne!(other.psk(), key.psk());
        assert_ne!(
            job_digest("a").expect("digest"),
            job_digest("b").expect("digest")
        );
    }
}
