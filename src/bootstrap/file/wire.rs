//! The file protocol's records, version 1 (described on
//! [`FileTransport`](crate::bootstrap::FileTransport)): rank 0's id file and a rank's ack;
//! version 2 of the id file carries several ids.

use std::path::Path;

use crate::bootstrap::bytes::{fnv1a, get_u16, get_u32, get_u64, put};
use crate::bootstrap::ids::{decode_ids, MAX_EXCHANGED_IDS};
use crate::bootstrap::{BootstrapError, Result};
use crate::id::UNIQUE_ID_BYTES;
use crate::UniqueId;

const ID_MAGIC: [u8; 4] = *b"NRSF";
const ACK_MAGIC: [u8; 4] = *b"NRSA";
/// The version of a record with one id; acks are always this version.
const VERSION: u16 = 1;
/// The version of a record with several ids (for `ncclCommInitRankScalable`). Rank 0 writes
/// it only then, so a job that hands out one id writes exactly what earlier versions did.
const IDS_VERSION: u16 = 2;
/// Where the fields every version shares end.
const HEADER_LEN: usize = 56;
/// Version 1: the id right after the header, then the checksum.
#[cfg(test)]
const ID_FILE_LEN: usize = HEADER_LEN + UNIQUE_ID_BYTES + 8;
/// Version 2: the id count (`u32`) and a reserved `u32` after the header, then the ids.
const IDS_OFFSET: usize = HEADER_LEN + 8;
/// The longest record: version 2 with [`MAX_EXCHANGED_IDS`] ids.
pub(super) const MAX_ID_FILE_LEN: usize = IDS_OFFSET + MAX_EXCHANGED_IDS * UNIQUE_ID_BYTES + 8;
pub(super) const ACK_FILE_LEN: usize = 48;
const ACK_CHECKSUM_OFFSET: usize = 40;

/// What rank 0's file says, once validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct IdRecord {
    pub(super) job_hash: u64,
    pub(super) world_size: u32,
    /// Names this publication: acks repeat it, so leftovers of another are never counted.
    pub(super) nonce: u64,
    pub(super) pid: u32,
    pub(super) start_ticks: u64,
    pub(super) pid_namespace: u64,
    /// One id (version 1) or several (version 2), in rank 0's order.
    pub(super) ids: Vec<UniqueId>,
}

impl IdRecord {
    /// Version 1 for one id, version 2 for several.
    pub(super) fn encode(&self) -> Vec<u8> {
        let several = self.ids.len() > 1;
        let ids_at = if several { IDS_OFFSET } else { HEADER_LEN };
        let checksum_at = ids_at + self.ids.len() * UNIQUE_ID_BYTES;
        let mut bytes = vec![0u8; checksum_at + 8];
        put(&mut bytes, 0, &ID_MAGIC);
        let version = if several { IDS_VERSION } else { VERSION };
        put(&mut bytes, 4, &version.to_be_bytes());
        put(&mut bytes, 8, &self.job_hash.to_be_bytes());
        put(&mut bytes, 16, &self.world_size.to_be_bytes());
        put(&mut bytes, 24, &self.nonce.to_be_bytes());
        put(&mut bytes, 32, &self.pid.to_be_bytes());
        put(&mut bytes, 40, &self.start_ticks.to_be_bytes());
        put(&mut bytes, 48, &self.pid_namespace.to_be_bytes());
        if several {
            // At most MAX_EXCHANGED_IDS, checked before publishing.
            put(
                &mut bytes,
                HEADER_LEN,
                &(self.ids.len() as u32).to_be_bytes(),
            );
        }
        for (i, id) in self.ids.iter().enumerate() {
            put(&mut bytes, ids_at + i * UNIQUE_ID_BYTES, id.as_bytes());
        }
        let checksum = fnv1a(&bytes[..checksum_at]);
        put(&mut bytes, checksum_at, &checksum.to_be_bytes());
        bytes
    }

    /// Validates and decodes an id file of either version; `path` is for messages only.
    pub(super) fn decode(bytes: &[u8], path: &Path) -> Result<Self> {
        let (ids_at, count) = check_frame(bytes, path)?;
        let ids = decode_ids(&bytes[ids_at..ids_at + count * UNIQUE_ID_BYTES]);
        Ok(IdRecord {
            job_hash: get_u64(bytes, 8),
            world_size: get_u32(bytes, 16),
            nonce: get_u64(bytes, 24),
            pid: get_u32(bytes, 32),
            start_ticks: get_u64(bytes, 40),
            pid_namespace: get_u64(bytes, 48),
            ids,
        })
    }
}

/// Checks magic, version, length and checksum of an id file: where its ids start and how
/// many there are.
fn check_frame(bytes: &[u8], path: &Path) -> Result<(usize, usize)> {
    let shown = path.display();
    let protocol = |what: String| Err(BootstrapError::Protocol(format!("{shown} {what}")));
    if bytes.len() < 6 {
        return protocol(format!("is truncated ({} bytes)", bytes.len()));
    }
    if bytes[0..4] != ID_MAGIC {
        return protocol("is not an nccl-rs rendezvous file (bad magic)".to_owned());
    }
    let version = get_u16(bytes, 4);
    let (ids_at, count) = match version {
        VERSION => (HEADER_LEN, 1),
        IDS_VERSION if bytes.len() >= IDS_OFFSET => {
            (IDS_OFFSET, get_u32(bytes, HEADER_LEN) as usize)
        }
        IDS_VERSION => return protocol(format!("is truncated ({} bytes)", bytes.len())),
        _ => {
            return Err(BootstrapError::VersionMismatch {
                local: IDS_VERSION,
                peer: version,
            })
        }
    };
    if !(1..=MAX_EXCHANGED_IDS).contains(&count) {
        return protocol(format!("announces {count} unique ids"));
    }
    let len = ids_at + count * UNIQUE_ID_BYTES + 8;
    if bytes.len() != len {
        return protocol(format!(
            "has {} bytes, a version {version} rendezvous file with {count} id(s) has {len}",
            bytes.len()
        ));
    }
    let checksum_at = len - 8;
    if get_u64(bytes, checksum_at) != fnv1a(&bytes[..checksum_at]) {
        return protocol("is corrupt (checksum mismatch)".to_owned());
    }
    Ok((ids_at, count))
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

    /// A record of `ids` with arbitrary other fields.
    fn record_of(ids: Vec<UniqueId>) -> IdRecord {
        IdRecord {
            job_hash: 7,
            world_size: 4,
            nonce: 99,
            pid: 1,
            start_ticks: 2,
            pid_namespace: 3,
            ids,
        }
    }

    #[test]
    fn record_round_trip_and_corruption() {
        let record = record_of(vec![UniqueId::from_bytes([5; UNIQUE_ID_BYTES])]);
        let path = Path::new("x.id");
        let bytes = record.encode();
        assert_eq!(bytes.len(), ID_FILE_LEN);
        assert_eq!(ID_FILE_LEN, 192, "what version 1 always wrote");
        assert_eq!(IdRecord::decode(&bytes, path).unwrap(), record);
        let mut flipped = bytes.clone();
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
        newer[5] = 3;
        assert!(matches!(
            IdRecord::decode(&newer, path),
            Err(BootstrapError::VersionMismatch { local: 2, peer: 3 })
        ));
    }

    #[test]
    fn several_ids_make_a_version_2_record() {
        let ids: Vec<UniqueId> = (1..=3)
            .map(|b| UniqueId::from_bytes([b; UNIQUE_ID_BYTES]))
            .collect();
        let record = record_of(ids);
        let path = Path::new("x.id");
        let bytes = record.encode();
        assert_eq!(get_u16(&bytes, 4), 2);
        assert_eq!(bytes.len(), IDS_OFFSET + 3 * UNIQUE_ID_BYTES + 8);
        assert!(bytes.len() <= MAX_ID_FILE_LEN);
        assert_eq!(IdRecord::decode(&bytes, path).unwrap(), record);
        // A count that disagrees with the length, a truncated file and a flipped id byte are
        // all refused.
        let mut lying = bytes.clone();
        put(&mut lying, HEADER_LEN, &2u32.to_be_bytes());
        assert!(IdRecord::decode(&lying, path).is_err());
        assert!(IdRecord::decode(&bytes[..bytes.len() - 1], path).is_err());
        let mut flipped = bytes.clone();
        flipped[IDS_OFFSET + 200] ^= 1;
        assert!(matches!(
            IdRecord::decode(&flipped, path),
            Err(BootstrapError::Protocol(ref m)) if m.contains("checksum")
        ));
        let mut zero = bytes;
        put(&mut zero, HEADER_LEN, &0u32.to_be_bytes());
        assert!(IdRecord::decode(&zero, path).is_err());
    }

    #[test]
    fn acks_name_their_publication() {
        let ack = encode_ack(1, 2, 3, 4);
        assert_eq!(ack[0..4], ACK_MAGIC);
        assert_eq!(get_u64(&ack, 16), 2);
        assert_ne!(ack, encode_ack(1, 5, 3, 4));
    }
}
