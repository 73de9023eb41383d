//! RAS (in progress).
