//! Protocol version 3, the encrypted rendezvous (described on
//! [`TcpTransport`](crate::bootstrap::TcpTransport)): rank 0's challenge, the Noise handshake
//! both sides build on it, the messages. Rank 0's side of one connection is in
//! [`conversation`](super::conversation) and the joining rank's in [`client`](super::client),
//! each beside version 1's.
//!
//! `Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s`: two ephemeral keys and the pre-shared key, no
//! static keys (the ranks have no identities beyond knowing the key). The PSK is mixed in
//! before the first message, so the hello is already encrypted and authenticated under it, and
//! the ephemeral Diffie-Hellman gives the reply forward secrecy: a key leaked later does not
//! open recorded sessions.
//!
//! The first message of a Noise handshake cannot be fresh by itself (the responder has said
//! nothing yet), so a recorded hello would decrypt again. Rank 0 therefore speaks first: a
//! random challenge per connection, which both sides put in the prologue. The handshake hash
//! covers the prologue and the hello's payload is encrypted with it as associated data, so a
//! hello made for another connection's challenge does not decrypt (version 2, which earlier
//! builds spoke, had no challenge: a replayed hello held its rank until the connection timed
//! out, and again with every replay).

use snow::{HandshakeState, TransportState};

use super::key::{random_bytes, RendezvousKey, DIGEST_LEN};
use super::wire::{
    ids_announced, put_prefix, version_of, Ack, Place, ReplyHeader, Status, ACK_LEN, KEYED_VERSION,
    KIND_ACK, KIND_CHALLENGE, KIND_HELLO, KIND_OPEN, KIND_REPLY, KIND_REQUEST, KIND_SEALED_REPLY,
    MAGIC, PLACE_LEN, REPLY_HEADER_LEN,
};
use crate::bootstrap::bytes::{get_u16, put};
use crate::bootstrap::ids::{decode_ids, MAX_EXCHANGED_IDS};
use crate::bootstrap::{BootstrapError, Result};
use crate::id::UNIQUE_ID_BYTES;
use crate::UniqueId;

const NOISE_PARAMS: &str = "Noise_NNpsk0_25519_ChaChaPoly_BLAKE2s";
/// Mixed into the handshake hash before anything else, followed by rank 0's challenge, so
/// that a transcript of this protocol can never be taken for one of another protocol (or of
/// version 2) using the same key, nor for one of another connection.
const PROLOGUE_LABEL: &[u8] = b"nccl-rs rendezvous NRSB v3\0";
/// Rank 0's random challenge, fresh for every connection.
pub(super) const CHALLENGE_LEN: usize = 32;
/// Rank 0's challenge on the wire: a clear reply header (version 3, kind 7, status 0, detail
/// [`CHALLENGE_LEN`]) and the challenge.
pub(super) const CHALLENGE_FRAME_LEN: usize = REPLY_HEADER_LEN + CHALLENGE_LEN;
/// A Curve25519 public key, as the handshake sends each ephemeral key.
const DH_LEN: usize = 32;
/// The Poly1305 tag that authenticates every encrypted payload.
const TAG_LEN: usize = 16;
/// The clear prefix of the opening, the hello and the ack: magic, version 3, kind. The
/// opening is this prefix alone.
pub(super) const CLEAR_PREFIX_LEN: usize = 8;

/// Where the place stands in the encrypted request, after the prefix and the job-key digest.
const PLACE_AT: usize = CLEAR_PREFIX_LEN + DIGEST_LEN;
/// The encrypted request: prefix, job-key digest, place.
pub(super) const REQUEST_PAYLOAD_LEN: usize = PLACE_AT + PLACE_LEN;
/// The hello on the wire: clear prefix, ephemeral key, encrypted request, tag.
pub(super) const HELLO_LEN: usize = CLEAR_PREFIX_LEN + DH_LEN + REQUEST_PAYLOAD_LEN + TAG_LEN;
/// The Noise message of a sealed refusal (reply header only); a sealed reply with ids adds
/// [`UNIQUE_ID_BYTES`] per id.
pub(super) const SEALED_REFUSAL_LEN: usize = DH_LEN + REPLY_HEADER_LEN + TAG_LEN;
/// The Noise message of a sealed single id.
#[cfg(test)]
pub(super) const SEALED_ID_LEN: usize = SEALED_REFUSAL_LEN + UNIQUE_ID_BYTES;
/// The longest sealed reply: [`MAX_EXCHANGED_IDS`] ids, well inside Noise's 65,535-byte
/// messages.
pub(super) const MAX_SEALED_LEN: usize = SEALED_REFUSAL_LEN + MAX_EXCHANGED_IDS * UNIQUE_ID_BYTES;
const _: () = assert!(MAX_SEALED_LEN <= 65_535);

/// Whether a sealed reply of `len` bytes can be one: a refusal, or 1 to
/// [`MAX_EXCHANGED_IDS`] ids.
pub(super) fn sealed_len_is_valid(len: usize) -> bool {
    len == SEALED_REFUSAL_LEN
        || (len > SEALED_REFUSAL_LEN
            && len <= MAX_SEALED_LEN
            && (len - SEALED_REFUSAL_LEN).is_multiple_of(UNIQUE_ID_BYTES))
}
/// The ack on the wire: clear prefix, then the version 1 ack layout encrypted.
pub(super) const ACK_FRAME_LEN: usize = CLEAR_PREFIX_LEN + ACK_LEN + TAG_LEN;

/// What rank 0 needs to speak version 3: the key and the digest of its job key.
#[derive(Debug, Clone)]
pub(super) struct Keyed {
    pub(super) key: RendezvousKey,
    pub(super) job_digest: [u8; DIGEST_LEN],
}

/// A joining rank's request as version 3 encrypts it: the exact job key (as a digest) where
/// version 1 sends a 64-bit hash, and the same place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct KeyedRequest {
    pub(super) job_digest: [u8; DIGEST_LEN],
    pub(super) place: Place,
}

impl KeyedRequest {
    fn encode(&self) -> [u8; REQUEST_PAYLOAD_LEN] {
        let mut bytes = [0u8; REQUEST_PAYLOAD_LEN];
        put_prefix(&mut bytes, KEYED_VERSION, KIND_REQUEST);
        put(&mut bytes, CLEAR_PREFIX_LEN, &self.job_digest);
        self.place.put(&mut bytes, PLACE_AT);
        bytes
    }

    /// `None` unless `bytes` is a version 3 request (it decrypted, so only a peer with the key
    /// and another layout gets here).
    pub(super) fn decode(bytes: &[u8]) -> Option<Self> {
        let valid = bytes.len() == REQUEST_PAYLOAD_LEN
            && bytes[0..4] == MAGIC
            && version_of(bytes) == KEYED_VERSION
            && get_u16(bytes, 6) == KIND_REQUEST;
        valid.then(|| {
            let mut job_digest = [0u8; DIGEST_LEN];
            job_digest.copy_from_slice(&bytes[CLEAR_PREFIX_LEN..PLACE_AT]);
            KeyedRequest {
                job_digest,
                place: Place::get(bytes, PLACE_AT),
            }
        })
    }
}

/// The opening a joining rank sends: the clear prefix with kind 6, asking for a challenge.
pub(super) fn opening() -> [u8; CLEAR_PREFIX_LEN] {
    let mut bytes = [0u8; CLEAR_PREFIX_LEN];
    put_prefix(&mut bytes, KEYED_VERSION, KIND_OPEN);
    bytes
}

/// A fresh challenge from the operating system's generator.
pub(super) fn new_challenge() -> Result<[u8; CHALLENGE_LEN]> {
    random_bytes()
}

/// Rank 0's challenge as it is sent: the clear header that announces it, then its bytes.
pub(super) fn challenge_frame(challenge: &[u8; CHALLENGE_LEN]) -> [u8; CHALLENGE_FRAME_LEN] {
    let mut bytes = [0u8; CHALLENGE_FRAME_LEN];
    let header = ReplyHeader::encode_as(
        KEYED_VERSION,
        KIND_CHALLENGE,
        Status::Ok,
        CHALLENGE_LEN as u32,
    );
    put(&mut bytes, 0, &header);
    put(&mut bytes, REPLY_HEADER_LEN, challenge);
    bytes
}

/// The handshake of a joining rank (the initiator), bound to rank 0's `challenge`.
pub(super) fn initiator(
    key: &RendezvousKey,
    challenge: &[u8; CHALLENGE_LEN],
) -> Result<HandshakeState> {
    builder(key, challenge, |builder| builder.build_initiator())
}

/// The handshake of rank 0's side of one connection (the responder), bound to the
/// `challenge` it sent.
pub(super) fn responder(
    key: &RendezvousKey,
    challenge: &[u8; CHALLENGE_LEN],
) -> Result<HandshakeState> {
    builder(key, challenge, |builder| builder.build_responder())
}

/// The prologue both sides mix in: the label, then the challenge.
pub(super) fn prologue(challenge: &[u8; CHALLENGE_LEN]) -> Vec<u8> {
    [PROLOGUE_LABEL, &challenge[..]].concat()
}

fn builder(
    key: &RendezvousKey,
    challenge: &[u8; CHALLENGE_LEN],
    build: impl FnOnce(snow::Builder<'_>) -> Result<HandshakeState, snow::Error>,
) -> Result<HandshakeState> {
    let params = NOISE_PARAMS
        .parse()
        .map_err(|e| noise_error("choosing the Noise protocol", e))?;
    let prologue = prologue(challenge);
    let builder = snow::Builder::new(params)
        .psk(0, key.psk())
        .and_then(|builder| builder.prologue(&prologue))
        .map_err(|e| noise_error("setting up the Noise handshake", e))?;
    build(builder).map_err(|e| noise_error("starting the Noise handshake", e))
}

/// A Noise failure outside of authentication (a packaging or programming error).
pub(super) fn noise_error(what: &str, error: snow::Error) -> BootstrapError {
    BootstrapError::Protocol(format!("{what}: {error}"))
}

/// The hello a joining rank sends: the clear prefix, then the handshake's first message with
/// the encrypted request.
pub(super) fn hello(
    handshake: &mut HandshakeState,
    request: &KeyedRequest,
) -> Result<[u8; HELLO_LEN]> {
    let mut bytes = [0u8; HELLO_LEN];
    put_prefix(&mut bytes, KEYED_VERSION, KIND_HELLO);
    let written = handshake
        .write_message(&request.encode(), &mut bytes[CLEAR_PREFIX_LEN..])
        .map_err(|e| noise_error("encrypting the request", e))?;
    if written != HELLO_LEN - CLEAR_PREFIX_LEN {
        return Err(BootstrapError::Protocol(format!(
            "the hello came out {written} bytes long, not {}",
            HELLO_LEN - CLEAR_PREFIX_LEN
        )));
    }
    Ok(bytes)
}

/// Opens rank 0's sealed reply (the Noise message after the clear header): the reply header
/// and, when it says ok, the ids (as many as the header's detail announces).
pub(super) fn open_reply(
    handshake: &mut HandshakeState,
    message: &[u8],
) -> Result<(ReplyHeader, Vec<UniqueId>)> {
    let mut payload = vec![0u8; REPLY_HEADER_LEN + MAX_EXCHANGED_IDS * UNIQUE_ID_BYTES];
    let len = handshake.read_message(message, &mut payload).map_err(|_| {
        BootstrapError::Authentication {
            detail: "rank 0's reply did not decrypt under this rank's key: the keys differ, or \
                     the reply was forged or altered on the way"
                .to_owned(),
        }
    })?;
    let mut header_bytes = [0u8; REPLY_HEADER_LEN];
    header_bytes.copy_from_slice(&payload[..REPLY_HEADER_LEN]);
    let header = ReplyHeader::decode(&header_bytes);
    let id_bytes = len.saturating_sub(REPLY_HEADER_LEN);
    let well_formed = header_bytes[0..4] == MAGIC
        && header.version == KEYED_VERSION
        && header.kind == KIND_REPLY
        && len >= REPLY_HEADER_LEN
        && id_bytes.is_multiple_of(UNIQUE_ID_BYTES)
        && (id_bytes == 0 || id_bytes / UNIQUE_ID_BYTES == ids_announced(header.detail));
    if !well_formed {
        return Err(BootstrapError::Protocol(format!(
            "rank 0's sealed reply is not a version 3 reply ({len} bytes, version {}, kind {}, \
             detail {})",
            header.version, header.kind, header.detail
        )));
    }
    Ok((header, decode_ids(&payload[REPLY_HEADER_LEN..len])))
}

/// The ack a joining rank sends once it holds the id: only a rank that completed this very
/// handshake can encrypt it.
pub(super) fn ack_frame(transport: &mut TransportState, ack: &Ack) -> Result<[u8; ACK_FRAME_LEN]> {
    let mut bytes = [0u8; ACK_FRAME_LEN];
    put_prefix(&mut bytes, KEYED_VERSION, KIND_ACK);
    transport
        .write_message(
            &ack.encode_as(KEYED_VERSION),
            &mut bytes[CLEAR_PREFIX_LEN..],
        )
        .map_err(|e| noise_error("encrypting the acknowledgement", e))?;
    Ok(bytes)
}

/// Encrypts a reply (`ids` when the status is ok, none otherwise) as the handshake's second
/// message, behind the clear header that announces it.
pub(super) fn seal_reply(
    handshake: &mut HandshakeState,
    status: Status,
    detail: u32,
    ids: &[UniqueId],
) -> Result<Vec<u8>> {
    let mut payload = Vec::with_capacity(REPLY_HEADER_LEN + ids.len() * UNIQUE_ID_BYTES);
    payload.extend_from_slice(&ReplyHeader::encode_as(
        KEYED_VERSION,
        KIND_REPLY,
        status,
        detail,
    ));
    for id in ids {
        payload.extend_from_slice(id.as_bytes());
    }
    let mut message = vec![0u8; DH_LEN + payload.len() + TAG_LEN];
    let len = handshake
        .write_message(&payload, &mut message)
        .map_err(|e| noise_error("encrypting the reply", e))?;
    message.truncate(len);
    let announced = u32::try_from(len).unwrap_or(u32::MAX);
    let mut bytes =
        ReplyHeader::encode_as(KEYED_VERSION, KIND_SEALED_REPLY, Status::Ok, announced).to_vec();
    bytes.extend_from_slice(&message);
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_sizes_add_up() {
        let request = KeyedRequest {
            job_digest: [7; DIGEST_LEN],
            place: Place {
                world_size: 4,
                rank: 3,
                round: 2,
                ids_wanted: 0,
            },
        };
        assert_eq!(KeyedRequest::decode(&request.encode()), Some(request));
        assert_eq!(KeyedRequest::decode(&request.encode()[1..]), None);

        let key = RendezvousKey::generate().expect("key");
        let challenge = new_challenge().expect("challenge");
        assert_ne!(challenge, new_challenge().expect("challenge"));
        let frame = challenge_frame(&challenge);
        let header = ReplyHeader::decode(frame[..REPLY_HEADER_LEN].try_into().unwrap());
        assert_eq!(
            (header.version, header.kind, header.detail),
            (KEYED_VERSION, KIND_CHALLENGE, CHALLENGE_LEN as u32)
        );
        assert_eq!(frame[REPLY_HEADER_LEN..], challenge);
        assert_eq!(opening()[..4], MAGIC);
        let mut client = initiator(&key, &challenge).expect("initiator");
        let mut server = responder(&key, &challenge).expect("responder");
        let bytes = hello(&mut client, &request).expect("hello");
        // The same hello against another challenge (a replay into another connection) does
        // not decrypt.
        let mut other = responder(&key, &new_challenge().expect("challenge")).expect("responder");
        let mut payload = [0u8; REQUEST_PAYLOAD_LEN];
        assert!(other
            .read_message(&bytes[CLEAR_PREFIX_LEN..], &mut payload)
            .is_err());
        let mut payload = [0u8; REQUEST_PAYLOAD_LEN];
        server
            .read_message(&bytes[CLEAR_PREFIX_LEN..], &mut payload)
            .expect("open hello");
        assert_eq!(KeyedRequest::decode(&payload), Some(request));
        let id = UniqueId::from_bytes([5; UNIQUE_ID_BYTES]);
        let reply = seal_reply(&mut server, Status::Ok, 0, &[id]).expect("seal");
        assert_eq!(reply.len(), REPLY_HEADER_LEN + SEALED_ID_LEN);
        let (header, opened) = open_reply(&mut client, &reply[REPLY_HEADER_LEN..]).expect("open");
        assert_eq!((header.status, opened), (Status::Ok as u16, vec![id]));
        assert!(sealed_len_is_valid(SEALED_ID_LEN));
        assert!(sealed_len_is_valid(
            SEALED_REFUSAL_LEN + 3 * UNIQUE_ID_BYTES
        ));
        assert!(!sealed_len_is_valid(SEALED_ID_LEN + 1));
        assert!(!sealed_len_is_valid(MAX_SEALED_LEN + UNIQUE_ID_BYTES));
    }
}
