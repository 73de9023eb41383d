//! NCCL's release numbers: the ground every version check stands on.
//!
//! A room of its own so that the error type (which names the version an API needs) and the
//! library loader (which reads it) both import it from below instead of from each other.

use std::fmt;

/// An NCCL release version, e.g. 2.28.3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Major version (2 for every NCCL 2.x).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl Version {
    /// A version from its parts.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }

    /// Decodes an `NCCL_VERSION_CODE` as returned by `ncclGetVersion`.
    ///
    /// NCCL changed the encoding at 2.9: before, `X*1000 + Y*100 + Z` (2.8.4 is 2804); since,
    /// `X*10000 + Y*100 + Z` (2.28.3 is 22803). Codes of the new form are all at least 20900,
    /// old ones at most 2899, so the magnitude tells them apart.
    pub const fn from_code(code: u32) -> Self {
        if code >= 10_000 {
            Self::new(code / 10_000, (code % 10_000) / 100, code % 100)
        } else {
            Self::new(code / 1_000, (code % 1_000) / 100, code % 100)
        }
    }

    /// Encodes the version the way NCCL's `NCCL_VERSION(X, Y, Z)` macro does.
    pub const fn code(self) -> u32 {
        if self.major <= 2 && self.minor <= 8 {
            self.major * 1_000 + self.minor * 100 + self.patch
        } else {
            self.major * 10_000 + self.minor * 100 + self.patch
        }
    }

    /// The version of the header the bindings were generated from.
    pub const HEADER: Version = Version::new(
        nccl_sys::NCCL_MAJOR as u32,
        nccl_sys::NCCL_MINOR as u32,
        nccl_sys::NCCL_PATCH as u32,
    );
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_codes_decode_both_encodings() {
        assert_eq!(Version::from_code(2804), Version::new(2, 8, 4));
        assert_eq!(Version::from_code(2708), Version::new(2, 7, 8));
        assert_eq!(Version::from_code(20903), Version::new(2, 9, 3));
        assert_eq!(Version::from_code(22803), Version::new(2, 28, 3));
        assert_eq!(Version::from_code(23203), Version::new(2, 32, 3));
        for v in [
            Version::new(2, 4, 8),
            Version::new(2, 8, 4),
            Version::new(2, 9, 6),
            Version::new(2, 28, 9),
            Version::new(2, 32, 3),
        ] {
            assert_eq!(Version::from_code(v.code()), v);
        }
        assert_eq!(Version::new(2, 28, 3).to_string(), "2.28.3");
        assert!(Version::new(2, 28, 9) > Version::new(2, 28, 3));
        assert!(Version::new(2, 9, 0) > Version::new(2, 8, 4));
        assert_eq!(Version::HEADER, Version::new(2, 32, 3));
        assert_eq!(Version::HEADER.code(), 23203);
    }
}
