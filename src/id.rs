//! The unique id that names a communicator before it exists.
//!
//! Rank 0 creates it with [`UniqueId::new`]; every other rank receives it out of band (MPI, a
//! file, a socket: see [`crate::bootstrap`]) and passes it to
//! [`Comm::init_rank`](crate::Comm::init_rank). The id is exposed as plain bytes, never as
//! C `char`, whose signedness differs between platforms.

use std::fmt;
use std::str::FromStr;

use crate::calls;
use crate::error::{Error, Result};
use crate::library;

/// Size of an NCCL unique id in bytes.
pub const UNIQUE_ID_BYTES: usize = 128;

/// An `ncclUniqueId`: 128 opaque bytes shared by every rank of a communicator.
///
/// `Display` and `FromStr` use lowercase hex (256 characters), convenient for environment
/// variables and command lines. `Debug` shows only a short fingerprint, since the id lets a
/// process join the communicator.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId([u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    /// Asks NCCL for a fresh id (`ncclGetUniqueId`). Call this on one rank only.
    ///
    /// NCCL starts its bootstrap listener here, on the interface chosen by
    /// `NCCL_SOCKET_IFNAME` and friends.
    pub fn new() -> Result<Self> {
        let lib = library::get()?;
        crate::encryption::network_started();
        let mut raw = nccl_sys::ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: `raw` is a valid, writable ncclUniqueId for the duration of the call.
        let status = unsafe { lib.api().ncclGetUniqueId(&mut raw) };
        lib.check(calls::ncclGetUniqueId.name, status)?;
        Ok(Self::from_raw(&raw))
    }

    /// Rebuilds an id from the bytes another rank sent.
    pub const fn from_bytes(bytes: [u8; UNIQUE_ID_BYTES]) -> Self {
        Self(bytes)
    }

    /// The raw bytes, to send to the other ranks.
    pub const fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.0
    }

    /// Consumes the id, returning its bytes.
    pub const fn into_bytes(self) -> [u8; UNIQUE_ID_BYTES] {
        self.0
    }

    pub(crate) fn from_raw(raw: &nccl_sys::ncclUniqueId) -> Self {
        Self(raw.internal.map(|c| c as u8))
    }

    pub(crate) fn to_raw(self) -> nccl_sys::ncclUniqueId {
        nccl_sys::ncclUniqueId {
            internal: self.0.map(|b| b as _),
        }
    }

    /// A short, non-reversible fingerprint of the id (FNV-1a), for logs.
    pub fn fingerprint(&self) -> u64 {
        self.0.iter().fold(0xcbf2_9ce4_8422_2325u64, |hash, &b| {
            (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }
}

impl From<[u8; UNIQUE_ID_BYTES]> for UniqueId {
    fn from(bytes: [u8; UNIQUE_ID_BYTES]) -> Self {
        Self(bytes)
    }
}

impl From<UniqueId> for [u8; UNIQUE_ID_BYTES] {
    fn from(id: UniqueId) -> Self {
        id.0
    }
}

impl TryFrom<&[u8]> for UniqueId {
    type Error = Error;

    fn try_from(bytes: &[u8]) -> Result<Self> {
        let array: [u8; UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| {
            Error::invalid(format!(
                "a unique id is {UNIQUE_ID_BYTES} bytes, got {}",
                bytes.len()
            ))
        })?;
        Ok(Self(array))
    }
}

impl AsRef<[u8]> for UniqueId {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId({:016x})", self.fingerprint())
    }
}

impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in &self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

impl FromStr for UniqueId {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        let text = text.trim();
        if text.len() != 2 * UNIQUE_ID_BYTES {
            return Err(Error::invalid(format!(
                "a unique id in hex is {} characters, got {}",
                2 * UNIQUE_ID_BYTES,
                text.len()
            )));
        }
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        for (i, pair) in text.as_bytes().chunks_exact(2).enumerate() {
            let digit = |c: u8| {
                (c as char).to_digit(16).ok_or_else(|| {
                    Error::invalid(format!(
                        "unique id hex has a non-hex character {:?} at {}",
                        c as char,
                        2 * i
                    ))
                })
            };
            bytes[i] = (digit(pair[0])? * 16 + digit(pair[1])?) as u8;
        }
        Ok(Self(bytes))
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for UniqueId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if serializer.is_human_readable() {
            serializer.collect_str(self)
        } else {
            serializer.serialize_bytes(&self.0)
        }
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for UniqueId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = UniqueId;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    f,
                    "{UNIQUE_ID_BYTES} bytes or {} hex digits",
                    2 * UNIQUE_ID_BYTES
                )
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<UniqueId, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<UniqueId, E> {
                UniqueId::try_from(v).map_err(E::custom)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<UniqueId, A::Error> {
                let mut bytes = [0u8; UNIQUE_ID_BYTES];
                for (i, slot) in bytes.iter_mut().enumerate() {
                    *slot = seq
                        .next_element()?
                        .ok_or_else(|| serde::de::Error::invalid_length(i, &self))?;
                }
                if seq.next_element::<u8>()?.is_some() {
                    return Err(serde::de::Error::invalid_length(UNIQUE_ID_BYTES + 1, &self));
                }
                Ok(UniqueId(bytes))
            }
        }
        if deserializer.is_human_readable() {
            deserializer.deserialize_str(Visitor)
        } else {
            deserializer.deserialize_bytes(Visitor)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> UniqueId {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37).wrapping_add(200);
        }
        UniqueId::from_bytes(bytes)
    }

    #[test]
    fn hex_round_trip() {
        let id = sample();
        let hex = id.to_string();
        assert_eq!(hex.len(), 256);
        assert!(hex.starts_with("c8ed"), "{hex}");
        assert_eq!(hex.parse::<UniqueId>().unwrap(), id);
        assert_eq!(hex.to_uppercase().parse::<UniqueId>().unwrap(), id);
    }

    #[test]
    fn bad_hex_is_rejected_with_reason() {
        let err = "abc".parse::<UniqueId>().unwrap_err().to_string();
        assert!(err.contains("256 characters, got 3"), "{err}");
        let mut hex = sample().to_string();
        hex.replace_range(10..11, "g");
        let err = hex.parse::<UniqueId>().unwrap_err().to_string();
        assert!(err.contains("'g'") && err.contains("at 10"), "{err}");
    }

    #[test]
    fn bytes_round_trip_including_high_bytes() {
        let id = sample();
        let raw = id.to_raw();
        assert_eq!(UniqueId::from_raw(&raw), id);
        assert_eq!(UniqueId::try_from(&id.as_bytes()[..]).unwrap(), id);
        assert!(UniqueId::try_from(&id.as_bytes()[..127]).is_err());
        let bytes: [u8; 128] = id.into();
        assert_eq!(UniqueId::from(bytes), id);
    }

    #[test]
    fn debug_does_not_leak_the_id() {
        let id = sample();
        let debug = format!("{id:?}");
        assert!(!debug.contains(&id.to_string()[..32]));
        assert!(debug.starts_with("UniqueId("));
    }

    #[cfg(feature = "serde")]
    #[test]
    fn serde_json_round_trip() {
        let id = sample();
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(json, format!("\"{id}\""));
        assert_eq!(serde_json::from_str::<UniqueId>(&json).unwrap(), id);
        assert!(serde_json::from_str::<UniqueId>("\"00ff\"").is_err());
    }
}
