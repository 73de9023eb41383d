//! Element types: nccl-tests' names for them, conversions for the data check, and a way to
//! run generic code for a type chosen at run time.

use cudarc::driver::ValidAsZeroBits;
use nccl::{DataType, NcclType};

/// An element type the benchmark can fill, reduce on the host and compare.
pub trait Elem: NcclType + ValidAsZeroBits + Default + std::fmt::Debug {
    /// Relative precision of a floating-point type (0 for integers, compared exactly).
    const EPS: f64;
    /// The value nearest to `v`; integers wrap like the GPU's arithmetic does.
    fn from_f64(v: f64) -> Self;
    /// The value as an `f64` (exact for every value the check produces).
    fn to_f64(self) -> f64;
    /// The shipped all-reduce kernels for this type (`--lsa`): f32, bf16 and f16 only.
    fn lsa_all_reduce(
        _comm: &nccl::Comm,
        _max_count: usize,
    ) -> crate::BenchResult<Box<dyn crate::lsa::LsaIssue<Self> + '_>> {
        Err("--lsa runs the kernels nccl-rs ships, which sum f32, bf16 and f16 only".into())
    }
}

macro_rules! int_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            const EPS: f64 = 0.0;
            fn from_f64(v: f64) -> Self {
                // Through i128 so that products larger than the type wrap instead of
                // saturating, as the GPU's fixed-width arithmetic does.
                (v as i128) as $t
            }
            fn to_f64(self) -> f64 {
                self as f64
            }
        }
    )*};
}
int_elem!(i8, u8, i32, u32, i64, u64);

// The conversions are the types' inherent functions, named by path: a method call such as
// `v.to_f64()` would resolve to `Elem::to_f64` itself (by-value receivers are probed before
// the inherent `&self` method) and recurse forever.
macro_rules! float_elem {
    ($($t:ty: $eps:expr, $from:expr, $to:expr $(, $lsa:ident)?);* $(;)?) => {$(
        impl Elem for $t {
            const EPS: f64 = $eps;
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            fn to_f64(self) -> f64 {
                $to(self)
            }
            $(
            fn $lsa(
                comm: &nccl::Comm,
                max_count: usize,
            ) -> crate::BenchResult<Box<dyn crate::lsa::LsaIssue<Self> + '_>> {
                crate::lsa::create(comm, max_count)
            }
            )?
        }
    )*};
}
float_elem! {
    f32: f32::EPSILON as f64, |v: f64| v as f32, |v: f32| v as f64, lsa_all_reduce;
    f64: f64::EPSILON, |v: f64| v, |v: f64| v;
    half::f16: 1.0 / 1024.0, half::f16::from_f64, half::f16::to_f64, lsa_all_reduce;
    half::bf16: 1.0 / 128.0, half::bf16::from_f64, half::bf16::to_f64, lsa_all_reduce;
    float8::F8E4M3: 1.0 / 8.0, float8::F8E4M3::from_f64, |v| float8::F8E4M3::to_f64(&v);
    float8::F8E5M2: 1.0 / 4.0, float8::F8E5M2::from_f64, |v| float8::F8E5M2::to_f64(&v);
}

/// The element types the benchmark runs, in `ncclDataType_t` order (what `-d all` runs),
/// each with nccl-tests' name (`-d`) and the aliases accepted for it.
pub const TYPES: [(DataType, &str, &[&str]); 12] = [
    (DataType::Int8, "int8", &["char", "i8"]),
    (DataType::Uint8, "uint8", &["u8"]),
    (DataType::Int32, "int32", &["int", "i32"]),
    (DataType::Uint32, "uint32", &["u32"]),
    (DataType::Int64, "int64", &["i64"]),
    (DataType::Uint64, "uint64", &["u64"]),
    (DataType::Float16, "half", &["float16", "fp16", "f16"]),
    (DataType::Float32, "float", &["float32", "fp32", "f32"]),
    (DataType::Float64, "double", &["float64", "fp64", "f64"]),
    (DataType::Bfloat16, "bfloat16", &["bf16"]),
    (DataType::Float8E4M3, "f8e4m3", &["fp8e4m3", "float8e4m3"]),
    (DataType::Float8E5M2, "f8e5m2", &["fp8e5m2", "float8e5m2"]),
];

/// nccl-tests' name of `dtype` (NCCL's own for a type the benchmark does not run).
pub fn name(dtype: DataType) -> &'static str {
    TYPES
        .iter()
        .find(|(t, ..)| *t == dtype)
        .map_or(dtype.name(), |(_, name, _)| name)
}

/// Parses nccl-tests' names and a few common aliases.
pub fn parse(text: &str) -> Option<DataType> {
    let text = text.to_ascii_lowercase();
    TYPES
        .iter()
        .find(|(_, name, aliases)| *name == text || aliases.contains(&text.as_str()))
        .map(|(dtype, ..)| *dtype)
}

/// Generic code to run for the element type chosen at run time; see [`dispatch`].
pub trait TypeVisitor {
    /// What the code returns.
    type Output;
    /// Runs the code for element type `T`.
    fn visit<T: Elem>(self) -> Self::Output;
}

/// Runs `visitor` for the Rust type whose [`NcclType::DATA_TYPE`] is `dtype`; `None` for a
/// type without an [`Elem`] here.
pub fn dispatch<V: TypeVisitor>(dtype: DataType, visitor: V) -> Option<V::Output> {
    macro_rules! first_match {
        ($($t:ty),*) => {$(
            if dtype == <$t as NcclType>::DATA_TYPE {
                return Some(visitor.visit::<$t>());
            }
        )*};
    }
    first_match!(i8, u8, i32, u32, i64, u64, half::f16, f32, f64, half::bf16);
    first_match!(float8::F8E4M3, float8::F8E5M2);
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Size;

    impl TypeVisitor for Size {
        type Output = (DataType, usize);
        fn visit<T: Elem>(self) -> (DataType, usize) {
            (T::DATA_TYPE, std::mem::size_of::<T>())
        }
    }

    #[test]
    fn every_named_type_runs_as_its_rust_type() {
        for (dtype, name, aliases) in TYPES {
            assert_eq!(dispatch(dtype, Size), Some((dtype, dtype.size())), "{name}");
            assert_eq!(super::name(dtype), name);
            for text in aliases.iter().chain([&name]) {
                assert_eq!(parse(text), Some(dtype), "{text}");
                assert_eq!(parse(&text.to_ascii_uppercase()), Some(dtype), "{text}");
            }
        }
        assert_eq!(parse("nope"), None);
    }
}
