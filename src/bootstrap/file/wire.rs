//! The file protocol's records, version 1 (described on
//! [`FileTransport`](crate::bootstrap::FileTransport)): rank 0's id file and a rank's ack.

use std::path::Path;

use crate::bootstrap::bytes::{fnv1a, get_u16, get_u32, get_u64, put};
use crate::bootstrap::{BootstrapError, Result};
use crate::id::UNIQUE_ID_BYTES;

const ID_MAGIC: [u8; 4] = *b"NRSF";
const ACK_MAGIC: [u8; 4] = *b"NRSA";
const VERSION: u16 = 1;
pub(super) const ID_FILE_LEN: usize = 192;
const ID_OFFSET: usize = 56;
const ID_CHECKSUM_OFFSET: usize = ID_OFFSET + UNIQUE_ID_BYTES;
pub(super) const ACK_FILE_LEN: usize = 48;
const ACK_CHECKSUM_OFFSET: usize = 40;

/// What rank 0's file says, once validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct IdRecord {
    pub(super) job_hash: u64,
    pub(super) world_size: u32,
    /// Names this publication: acks repeat it, so leftovers of another are never counted.
    pub(super) nonce: u64,
    pub(super) pid: u32,
    pub(super) start_ticks: u64,
    pub(super) pid_namespace: u64,
    pub(super) id: [u8; UNIQUE_ID_BYTES],
}

impl IdRecord {
    pub(super) fn encode(&self) -> [u8; ID_FILE_LEN] {
        let mut bytes = [0u8; ID_FILE_LEN];
        put(&mut bytes, 0, &ID_MAGIC);
        put(&mut bytes, 4, &VERSION.to_be_bytes());
        put(&mut bytes, 8, &self.job_hash.to_be_bytes());
        put(&mut bytes, 16, &self.world_size.to_be_bytes());
        put(&mut bytes, 24, &self.nonce.to_be_bytes());
        put(&mut bytes, 32, &self.pid.to_be_bytes());
        put(&mut bytes, 40, &self.start_ticks.to_be_bytes());
        put(&mut bytes, 48, &self.pid_namespace.to_be_bytes());
        put(&mut bytes, ID_OFFSET, &self.id);
        let checksum = fnv1a(&bytes[..ID_CHECKSUM_OFFSET]);
        put(&mut bytes, ID_CHECKSUM_OFFSET, &checksum.to_be_bytes());
        bytes
    }

    /// Validates and decodes an id file; `path` is for messages only.
    pub(super) fn decode(bytes: &[u8], path: &Path) -> Result<Self> {
        check_frame(bytes, path)?;
        let mut id = [0u8; UNIQUE_ID_BYTES];
        id.copy_from_slice(&bytes[ID_OFFSET..ID_CHECKSUM_OFFSET]);
        Ok(IdRecord {
            job_hash: get_u64(bytes, 8),
            world_size: get_u32(bytes, 16),
            nonce: get_u64(bytes, 24),
            pid: get_u32(bytes, 32),
            start_ticks: get_u64(bytes, 40),
            pid_namespace: get_u64(bytes, 48),
            id,
        })
    }
}

/// Checks magic, version, length and checksum of an id file.
fn check_frame(bytes: &[u8], path: &Path) -> Result<()> {
    let shown = path.display();
    let protocol = |what: String| Err(BootstrapError::Protocol(format!("{shown} {what}")));
    if bytes.len() < 6 {
        return protocol(format!("is truncated ({} bytes)", bytes.len()));
    }
    if bytes[0..4] != ID_MAGIC {
        return protocol("is not an nccl-rs rendezvous file (bad magic)".to_owned());
    }
    let version = get_u16(bytes, 4);
    if version != VERSION {
        return Err(BootstrapError::VersionMismatch {
            local: VERSION,
            peer: version,
        });
    }
    if bytes.len() != ID_FILE_LEN {
        return protocol(format!(
            "has {} bytes, a version {VERSION} rendezvous file has {ID_FILE_LEN}",
            bytes.len()
        ));
    }
    if get_u64(bytes, ID_CHECKSUM_OFFSET) != fnv1a(&bytes[..ID_CHECKSUM_OFFSET]) {
        return protocol("is corrupt (checksum mismatch)".to_owned());
    }
    Ok(())
}

/// An ack file: which rank read which publication. Rank 0 compares whole files, so only
/// encoding is needed.
pub(super) fn encode_ack(
    job_hash: u64,
    nonce: u64,
    rank: u32,
    fingerprint: u64,
) -> [u8; ACK_FILE_LEN] {
    let mut bytes = [0u8; ACK_FILE_LEN];
    put(&mut bytes, 0, &ACK_MAGIC);
    put(&mut bytes, 4, &VERSION.to_be_bytes());
    put(&mut bytes, 8, &job_hash.to_be_bytes());
    put(&mut bytes, 16, &nonce.to_be_bytes());
    put(&mut bytes, 24, &rank.to_be_bytes());
    put(&mut bytes, 32, &fingerprint.to_be_bytes());
    let checksum = fnv1a(&bytes[..ACK_CHECKSUM_OFFSET]);
    put(&mut bytes, ACK_CHECKSUM_OFFSET, &checksum.to_be_bytes());
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_round_trip_and_corruption() {
        let record = IdRecord {
            job_hash: 7,
            world_size: 4,
            nonce: 99,
            pid: 1,
            start_ticks: 2,
            pid_namespace: 3,
            id: [5; UNIQUE_ID_BYTES],
        };
        let path = Path::new("x.id");
        let bytes = record.encode();
        assert_eq!(IdRecord::decode(&bytes, path).unwrap(), record);
        let mut flipped = bytes;
        flipped[100] ^= 1;
        assert!(matches!(
            IdRecord::decode(&flipped, path),
            Err(BootstrapError::Protocol(ref m)) if m.contains("checksum")
        ));
        assert!(matches!(
            IdRecord::decode(&bytes[..100], path),
            Err(BootstrapError::Protocol(_))
        ));
        let mut newer = bytes;
        newer[5] = 2;
        assert!(matches!(
            IdRecord::decode(&newer, path),
            Err(BootstrapError::VersionMismatch { local: 1, peer: 2 })
        ));
    }

    #[test]
    fn acks_name_their_publication() {
        let ack = encode_ack(1, 2, 3, 4);
        assert_eq!(ack[0..4], ACK_MAGIC);
        assert_eq!(get_u64(&ack, 16), 2);
        assert_ne!(ack, encode_ack(1, 5, 3, 4));
    }
}
