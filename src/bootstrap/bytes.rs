//! The building blocks of both wire formats: big-endian integers at fixed offsets, and the
//! FNV-1a hash behind job-key hashes and checksums.

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0100_0000_01b3;

/// FNV-1a over `bytes`, continuing from `state`. Used for job-key hashes and file checksums,
/// where the goal is catching accidents (other jobs, torn or foreign files), not adversaries.
pub(crate) fn fnv1a_from(state: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(state, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(FNV_PRIME)
    })
}

/// FNV-1a of `bytes`.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_from(FNV_OFFSET, bytes)
}

/// The 64-bit hash of a job key that travels on the wire and names rendezvous files. The
/// prefix keeps it distinct from other FNV uses (the id fingerprint, file checksums).
pub(crate) fn job_key_hash(key: &str) -> u64 {
    fnv1a_from(fnv1a(b"nccl-rs job key\0"), key.as_bytes())
}

/// The `N` bytes at `at`. Callers check the length of what they decode first; the messages
/// and files have fixed sizes.
fn field<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[at..at + N]);
    out
}

/// The big-endian `u16` at `at`.
pub(crate) fn get_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_be_bytes(field(bytes, at))
}

/// The big-endian `u32` at `at`.
pub(crate) fn get_u32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(field(bytes, at))
}

/// The big-endian `u64` at `at`.
pub(crate) fn get_u64(bytes: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(field(bytes, at))
}

/// Writes `value` (already big-endian bytes) at `at`.
pub(crate) fn put(bytes: &mut [u8], at: usize, value: &[u8]) {
    bytes[at..at + value.len()].copy_from_slice(value);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_key_hash_is_stable_and_distinguishes_keys() {
        assert_eq!(job_key_hash("a"), job_key_hash("a"));
        assert_ne!(job_key_hash("a"), job_key_hash("b"));
        assert_ne!(job_key_hash(""), fnv1a(b""));
    }

    #[test]
    fn fields_round_trip_big_endian() {
        let mut bytes = [0u8; 16];
        put(&mut bytes, 0, &0x0102u16.to_be_bytes());
        put(&mut bytes, 2, &0x0304_0506u32.to_be_bytes());
        put(&mut bytes, 8, &0x0708_090a_0b0c_0d0eu64.to_be_bytes());
        assert_eq!(bytes[..6], [1, 2, 3, 4, 5, 6]);
        assert_eq!(get_u16(&bytes, 0), 0x0102);
        assert_eq!(get_u32(&bytes, 2), 0x0304_0506);
        assert_eq!(get_u64(&bytes, 8), 0x0708_090a_0b0c_0d0e);
    }
}
