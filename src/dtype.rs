//! Element types NCCL can move and reduce.
//!
//! [`NcclType`] is sealed: only types whose size and bit layout match an `ncclDataType_t`
//! exactly implement it, so a buffer's element count is always NCCL's `count`. There is no
//! `bool` (a sum could produce an invalid `bool`) and no `char` (4 bytes in Rust).

use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use nccl_sys::ncclDataType_t;

use crate::release::Version;

/// The NCCL data types (`ncclDataType_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataType {
    /// `ncclInt8`
    Int8,
    /// `ncclUint8`
    Uint8,
    /// `ncclInt32`
    Int32,
    /// `ncclUint32`
    Uint32,
    /// `ncclInt64`
    Int64,
    /// `ncclUint64`
    Uint64,
    /// `ncclFloat16` (IEEE half)
    Float16,
    /// `ncclFloat32`
    Float32,
    /// `ncclFloat64`
    Float64,
    /// `ncclBfloat16` (NCCL 2.10)
    Bfloat16,
    /// `ncclFloat8e4m3` (NCCL 2.24; needs an sm_90 or newer GPU)
    Float8E4M3,
    /// `ncclFloat8e5m2` (NCCL 2.24; needs an sm_90 or newer GPU)
    Float8E5M2,
}

impl DataType {
    /// Every data type, in `ncclDataType_t` order.
    pub const ALL: [DataType; 12] = [
        DataType::Int8,
        DataType::Uint8,
        DataType::Int32,
        DataType::Uint32,
        DataType::Int64,
        DataType::Uint64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Bfloat16,
        DataType::Float8E4M3,
        DataType::Float8E5M2,
    ];

    /// The raw `ncclDataType_t`.
    #[inline]
    pub fn raw(self) -> ncclDataType_t {
        match self {
            DataType::Int8 => ncclDataType_t::ncclInt8,
            DataType::Uint8 => ncclDataType_t::ncclUint8,
            DataType::Int32 => ncclDataType_t::ncclInt32,
            DataType::Uint32 => ncclDataType_t::ncclUint32,
            DataType::Int64 => ncclDataType_t::ncclInt64,
            DataType::Uint64 => ncclDataType_t::ncclUint64,
            DataType::Float16 => ncclDataType_t::ncclFloat16,
            DataType::Float32 => ncclDataType_t::ncclFloat32,
            DataType::Float64 => ncclDataType_t::ncclFloat64,
            DataType::Bfloat16 => ncclDataType_t::ncclBfloat16,
            DataType::Float8E4M3 => ncclDataType_t::ncclFloat8e4m3,
            DataType::Float8E5M2 => ncclDataType_t::ncclFloat8e5m2,
        }
    }

    /// Size of one element in bytes.
    #[inline]
    pub fn size(self) -> usize {
        match self {
            DataType::Int8 | DataType::Uint8 | DataType::Float8E4M3 | DataType::Float8E5M2 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Uint64 | DataType::Float64 => 8,
        }
    }

    /// Whether the type is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DataType::Float16
                | DataType::Float32
                | DataType::Float64
                | DataType::Bfloat16
                | DataType::Float8E4M3
                | DataType::Float8E5M2
        )
    }

    /// The first NCCL release that supports the type.
    #[inline]
    pub fn min_version(self) -> Version {
        match self {
            DataType::Bfloat16 => Version::new(2, 10, 3),
            DataType::Float8E4M3 | DataType::Float8E5M2 => Version::new(2, 24, 0),
            _ => Version::new(2, 0, 0),
        }
    }

    /// The name NCCL uses, e.g. `"ncclFloat32"`; handy in logs and benchmark tables.
    #[inline]
    pub fn name(self) -> &'static str {
        match self {
            DataType::Int8 => "ncclInt8",
            DataType::Uint8 => "ncclUint8",
            DataType::Int32 => "ncclInt32",
            DataType::Uint32 => "ncclUint32",
            DataType::Int64 => "ncclInt64",
            DataType::Uint64 => "ncclUint64",
            DataType::Float16 => "ncclFloat16",
            DataType::Float32 => "ncclFloat32",
            DataType::Float64 => "ncclFloat64",
            DataType::Bfloat16 => "ncclBfloat16",
            DataType::Float8E4M3 => "ncclFloat8e4m3",
            DataType::Float8E5M2 => "ncclFloat8e5m2",
        }
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust element type with an exact NCCL counterpart. Sealed: implemented for `i8`, `u8`,
/// `i32`, `u32`, `i64`, `u64`, [`half::f16`], [`half::bf16`], `f32`, `f64`,
/// [`float8::F8E4M3`] and [`float8::F8E5M2`].
pub trait NcclType:
    DeviceRepr + ValidAsZeroBits + Copy + Send + Sync + 'static + sealed::Sealed
{
    /// The matching NCCL data type.
    const DATA_TYPE: DataType;
}

macro_rules! nccl_types {
    ($($ty:ty => $dt:ident),* $(,)?) => {$(
        impl sealed::Sealed for $ty {}
        impl NcclType for $ty {
            const DATA_TYPE: DataType = DataType::$dt;
        }
    )*};
}

nccl_types! {
    i8 => Int8,
    u8 => Uint8,
    i32 => Int32,
    u32 => Uint32,
    i64 => Int64,
    u64 => Uint64,
    half::f16 => Float16,
    f32 => Float32,
    f64 => Float64,
    half::bf16 => Bfloat16,
    float8::F8E4M3 => Float8E4M3,
    float8::F8E5M2 => Float8E5M2,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check<T: NcclType>() {
        assert_eq!(
            std::mem::size_of::<T>(),
            T::DATA_TYPE.size(),
            "{:?}",
            T::DATA_TYPE
        );
    }

    #[test]
    fn rust_sizes_match_nccl_sizes() {
        check::<i8>();
        check::<u8>();
        check::<i32>();
        check::<u32>();
        check::<i64>();
        check::<u64>();
        check::<half::f16>();
        check::<f32>();
        check::<f64>();
        check::<half::bf16>();
        check::<float8::F8E4M3>();
        check::<float8::F8E5M2>();
    }

    #[test]
    fn raw_values_follow_the_header() {
        let raws: Vec<_> = DataType::ALL.iter().map(|t| t.raw().0).collect();
        assert_eq!(raws, (0..12).collect::<Vec<_>>());
        assert_eq!(
            DataType::Float8E5M2.raw(),
            nccl_sys::ncclDataType_t::ncclFloat8e5m2
        );
    }

    #[test]
    fn version_gates() {
        assert_eq!(DataType::Float8E4M3.min_version(), Version::new(2, 24, 0));
        assert!(DataType::Bfloat16.min_version() > Version::new(2, 10, 0));
        assert!(DataType::Float32.min_version() <= Version::new(2, 4, 0));
        assert!(DataType::Float16.is_float() && !DataType::Uint64.is_float());
    }
}
