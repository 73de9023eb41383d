//! The TCP protocol's messages, version 1 (described on
//! [`TcpTransport`](crate::bootstrap::TcpTransport)): constants, status codes, and the three
//! messages with their encodings. Version 3 (the keyed one, in [`keyed`](super::keyed)) wraps
//! the same reply and ack inside its encryption and uses the same prefix and status codes.

use crate::bootstrap::bytes::{get_u16, get_u32, get_u64, put};
use crate::bootstrap::{BootstrapError, Result};

pub(super) const MAGIC: [u8; 4] = *b"NRSB";
/// The protocol version this build speaks.
pub(super) const VERSION: u16 = 1;
pub(super) const KIND_REQUEST: u16 = 1;
pub(super) const KIND_REPLY: u16 = 2;
pub(super) const KIND_ACK: u16 = 3;
/// The version of the encrypted protocol, spoken when the ranks share a rendezvous key.
pub(super) const KEYED_VERSION: u16 = 3;
/// The encrypted protocol of earlier builds: its hello carried no challenge of rank 0's, so a
/// recorded one could be replayed. Refused, with its number named.
pub(super) const EARLIER_KEYED_VERSION: u16 = 2;
/// Keyed: a joining rank's Noise handshake message carrying its encrypted request.
pub(super) const KIND_HELLO: u16 = 4;
/// Keyed: rank 0's Noise handshake message carrying the encrypted reply.
pub(super) const KIND_SEALED_REPLY: u16 = 5;
/// Version 3: a joining rank asks for a challenge (the clear prefix alone).
pub(super) const KIND_OPEN: u16 = 6;
/// Version 3: rank 0's fresh challenge, which the hello must be bound to.
pub(super) const KIND_CHALLENGE: u16 = 7;
/// Prefix, job hash, place.
pub(super) const REQUEST_LEN: usize = 16 + PLACE_LEN;
pub(super) const REPLY_HEADER_LEN: usize = 16;
pub(super) const ACK_LEN: usize = 24;
/// Where the version ends in every message: the server reads that far first, so that garbage
/// or another version is answered at once.
pub(super) const PREFIX_LEN: usize = 6;

/// Detail of a "rank already taken" reply: another connection holds the rank but has not
/// acked yet (worth retrying), or the rank has acked (final).
pub(super) const DUPLICATE_IN_FLIGHT: u32 = 1;
pub(super) const DUPLICATE_DONE: u32 = 2;

/// Writes the magic, version and `kind` every message starts with.
pub(super) fn put_prefix(bytes: &mut [u8], version: u16, kind: u16) {
    put(bytes, 0, &MAGIC);
    put(bytes, 4, &version.to_be_bytes());
    put(bytes, 6, &kind.to_be_bytes());
}

/// The version a message announces (bytes 4..6).
pub(super) fn version_of(bytes: &[u8]) -> u16 {
    get_u16(bytes, 4)
}

/// The kind of a message (bytes 6..8).
pub(super) fn kind_of(bytes: &[u8]) -> u16 {
    get_u16(bytes, 6)
}

/// The number of ids a reply's detail announces: 0 from a rank 0 that predates several ids
/// means one.
pub(super) fn ids_announced(detail: u32) -> usize {
    (detail as usize).max(1)
}

/// Converts a count that travels as `u32`.
pub(super) fn wire_u32(value: usize, what: &str) -> Result<u32> {
    u32::try_from(value).map_err(|_| {
        BootstrapError::Config(format!(
            "{what} {value} does not fit the protocol's 32 bits"
        ))
    })
}

/// Writes the table of status codes once: the enum and its decoding.
macro_rules! statuses {
    ($($(#[$doc:meta])* $name:ident = $code:literal,)*) => {
        /// Reply status codes. Numbers are part of the protocol.
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub(super) enum Status {
            $($(#[$doc])* $name = $code,)*
        }

        impl Status {
            pub(super) fn from_code(code: u16) -> Option<Self> {
                match code {
                    $($code => Some(Status::$name),)*
                    _ => None,
                }
            }
        }
    };
}

statuses! {
    Ok = 0,
    BadMagic = 1,
    /// Detail: rank 0's version.
    UnsupportedVersion = 2,
    Malformed = 3,
    WrongJob = 4,
    /// Detail: rank 0's world size.
    WorldSizeMismatch = 5,
    /// Detail: the world size.
    RankOutOfRange = 6,
    /// Detail: [`DUPLICATE_IN_FLIGHT`] or [`DUPLICATE_DONE`].
    DuplicateRank = 7,
    TimedOut = 8,
    Busy = 9,
    /// Rank 0 still serves an earlier round. Detail: rank 0's round.
    Early = 10,
    /// Rank 0 already serves a later round. Detail: rank 0's round.
    Late = 11,
    /// Keyed only: the hello did not decrypt under rank 0's key and challenge (the keys
    /// differ, or the message was altered or replayed).
    AuthFailed = 12,
    /// The request asks for another number of ids than rank 0 hands out. Detail: rank 0's
    /// count.
    IdCountMismatch = 13,
}

/// Where a joining rank stands, as the requests of both versions carry it right after the job
/// (hash or digest), so that rank 0 checks it the same way whichever version brought it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Place {
    pub(super) world_size: u32,
    pub(super) rank: u32,
    /// How many exchanges this rank made under the job key before.
    pub(super) round: u32,
    /// How many ids the rank expects: 0 (what earlier versions send) means one,
    /// [`ANY_IDS`](crate::bootstrap::ids::ANY_IDS) whatever rank 0 hands out.
    pub(super) ids_wanted: u32,
}

/// The bytes of a [`Place`] on the wire.
pub(super) const PLACE_LEN: usize = 16;

impl Place {
    /// Writes the place at `at` in `bytes`.
    pub(super) fn put(&self, bytes: &mut [u8], at: usize) {
        put(bytes, at, &self.world_size.to_be_bytes());
        put(bytes, at + 4, &self.rank.to_be_bytes());
        put(bytes, at + 8, &self.round.to_be_bytes());
        put(bytes, at + 12, &self.ids_wanted.to_be_bytes());
    }

    /// Reads the place at `at` in `bytes`.
    pub(super) fn get(bytes: &[u8], at: usize) -> Self {
        Place {
            world_size: get_u32(bytes, at),
            rank: get_u32(bytes, at + 4),
            round: get_u32(bytes, at + 8),
            ids_wanted: get_u32(bytes, at + 12),
        }
    }
}

/// A joining rank's request: its job, by the job key's 64-bit hash, and its place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Request {
    pub(super) job_hash: u64,
    pub(super) place: Place,
}

impl Request {
    pub(super) fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut bytes = [0u8; REQUEST_LEN];
        put_prefix(&mut bytes, VERSION, KIND_REQUEST);
        put(&mut bytes, 8, &self.job_hash.to_be_bytes());
        self.place.put(&mut bytes, 16);
        bytes
    }

    /// Decodes a request whose magic and version were checked.
    pub(super) fn decode(bytes: &[u8; REQUEST_LEN]) -> Self {
        Request {
            job_hash: get_u64(bytes, 8),
            place: Place::get(bytes, 16),
        }
    }
}

/// The first 16 bytes of every reply; later versions keep them, so that a peer of any
/// version can read why it was turned away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ReplyHeader {
    pub(super) version: u16,
    pub(super) kind: u16,
    pub(super) status: u16,
    pub(super) detail: u32,
}

impl ReplyHeader {
    pub(super) fn encode(status: Status, detail: u32) -> [u8; REPLY_HEADER_LEN] {
        Self::encode_as(VERSION, KIND_REPLY, status, detail)
    }

    /// A header of any version and kind (version 3 announces its challenge and its sealed
    /// reply with one).
    pub(super) fn encode_as(
        version: u16,
        kind: u16,
        status: Status,
        detail: u32,
    ) -> [u8; REPLY_HEADER_LEN] {
        let mut bytes = [0u8; REPLY_HEADER_LEN];
        put_prefix(&mut bytes, version, kind);
        put(&mut bytes, 8, &(status as u16).to_be_bytes());
        put(&mut bytes, 12, &detail.to_be_bytes());
        bytes
    }

    /// Decodes a header whose magic was checked.
    pub(super) fn decode(bytes: &[u8; REPLY_HEADER_LEN]) -> Self {
        ReplyHeader {
            version: version_of(bytes),
            kind: kind_of(bytes),
            status: get_u16(bytes, 8),
            detail: get_u32(bytes, 12),
        }
    }
}

/// A rank's acknowledgement that it holds the id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ack {
    pub(super) rank: u32,
    /// [`UniqueId::fingerprint`](crate::UniqueId::fingerprint) of the id received.
    pub(super) fingerprint: u64,
}

impl Ack {
    pub(super) fn encode(&self) -> [u8; ACK_LEN] {
        self.encode_as(VERSION)
    }

    /// The ack as protocol `version` writes it (version 3 encrypts this).
    pub(super) fn encode_as(&self, version: u16) -> [u8; ACK_LEN] {
        let mut bytes = [0u8; ACK_LEN];
        put_prefix(&mut bytes, version, KIND_ACK);
        put(&mut bytes, 8, &self.rank.to_be_bytes());
        put(&mut bytes, 16, &self.fingerprint.to_be_bytes());
        bytes
    }

    /// Decodes an ack; `None` for anything but a version 1 ack.
    pub(super) fn decode(bytes: &[u8; ACK_LEN]) -> Option<Self> {
        Self::decode_as(bytes, VERSION)
    }

    /// Decodes an ack; `None` for anything but an ack of protocol `version`.
    pub(super) fn decode_as(bytes: &[u8; ACK_LEN], version: u16) -> Option<Self> {
        let valid =
            bytes[0..4] == MAGIC && version_of(bytes) == version && kind_of(bytes) == KIND_ACK;
        valid.then(|| Ack {
            rank: get_u32(bytes, 8),
            fingerprint: get_u64(bytes, 16),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_round_trip() {
        let request = Request {
            job_hash: 0x0102_0304_0506_0708,
            place: Place {
                world_size: 4,
                rank: 3,
                round: 2,
                ids_wanted: 2,
            },
        };
        let bytes = request.encode();
        assert_eq!(bytes[0..4], MAGIC);
        assert_eq!(
            (version_of(&bytes), kind_of(&bytes)),
            (VERSION, KIND_REQUEST)
        );
        assert_eq!(Request::decode(&bytes), request);

        let header = ReplyHeader::decode(&ReplyHeader::encode(Status::Early, 9));
        assert_eq!(
            (header.kind, header.status, header.detail),
            (KIND_REPLY, 10, 9)
        );

        let ack = Ack {
            rank: 3,
            fingerprint: 77,
        };
        assert_eq!(Ack::decode(&ack.encode()), Some(ack));
        let mut wrong_kind = ack.encode();
        wrong_kind[7] = KIND_REQUEST as u8;
        assert_eq!(Ack::decode(&wrong_kind), None);
    }

    #[test]
    fn status_codes_decode() {
        for code in 0..=13 {
            assert_eq!(Status::from_code(code).map(|s| s as u16), Some(code));
        }
        assert_eq!(Status::from_code(14), None);
    }
}
