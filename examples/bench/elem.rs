//! Element types: nccl-tests' names for them, conversions for the data check, and a way to
//! run generic code for a type chosen at run time.

use cudarc::driver::ValidAsZeroBits;
use nccl::NcclType;

/// An element type the benchmark can fill, reduce on the host and compare.
pub trait Elem: NcclType + ValidAsZeroBits + Default + std::fmt::Debug {
    /// Relative precision of a floating-point type (0 for integers, compared exactly).
    const EPS: f64;
    /// The value nearest to `v`; integers wrap like the GPU's arithmetic does.
    fn from_f64(v: f64) -> Self;
    /// The value as an `f64` (exact for every value the check produces).
    fn to_f64(self) -> f64;
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
    ($($t:ty: $eps:expr, $from:expr, $to:expr);* $(;)?) => {$(
        impl Elem for $t {
            const EPS: f64 = $eps;
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            fn to_f64(self) -> f64 {
                $to(self)
            }
        }
    )*};
}
float_elem! {
    f32: f32::EPSILON as f64, |v: f64| v as f32, |v: f32| v as f64;
    f64: f64::EPSILON, |v: f64| v, |v: f64| v;
    half::f16: 1.0 / 1024.0, half::f16::from_f64, half::f16::to_f64;
    half::bf16: 1.0 / 128.0, half::bf16::from_f64, half::bf16::to_f64;
    float8::F8E4M3: 1.0 / 8.0, float8::F8E4M3::from_f64, |v| float8::F8E4M3::to_f64(&v);
    float8::F8E5M2: 1.0 / 4.0, float8::F8E5M2::from_f64, |v| float8::F8E5M2::to_f64(&v);
}

/// The element types, named as nccl-tests names them (`-d`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// `int8`
    Int8,
    /// `uint8`
    Uint8,
    /// `int32`
    Int32,
    /// `uint32`
    Uint32,
    /// `int64`
    Int64,
    /// `uint64`
    Uint64,
    /// `half` (IEEE fp16)
    Half,
    /// `float`
    Float,
    /// `double`
    Double,
    /// `bfloat16`
    Bfloat16,
    /// `f8e4m3`
    F8E4M3,
    /// `f8e5m2`
    F8E5M2,
}

impl DType {
    /// Every type, in `ncclDataType_t` order (what `-d all` runs).
    pub const ALL: [DType; 12] = [
        DType::Int8,
        DType::Uint8,
        DType::Int32,
        DType::Uint32,
        DType::Int64,
        DType::Uint64,
        DType::Half,
        DType::Float,
        DType::Double,
        DType::Bfloat16,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// nccl-tests' name.
    pub fn name(self) -> &'static str {
        match self {
            DType::Int8 => "int8",
            DType::Uint8 => "uint8",
            DType::Int32 => "int32",
            DType::Uint32 => "uint32",
            DType::Int64 => "int64",
            DType::Uint64 => "uint64",
            DType::Half => "half",
            DType::Float => "float",
            DType::Double => "double",
            DType::Bfloat16 => "bfloat16",
            DType::F8E4M3 => "f8e4m3",
            DType::F8E5M2 => "f8e5m2",
        }
    }

    /// Parses nccl-tests' names and a few common aliases.
    pub fn parse(text: &str) -> Option<DType> {
        Some(match text.to_ascii_lowercase().as_str() {
            "int8" | "char" | "i8" => DType::Int8,
            "uint8" | "u8" => DType::Uint8,
            "int32" | "int" | "i32" => DType::Int32,
            "uint32" | "u32" => DType::Uint32,
            "int64" | "i64" => DType::Int64,
            "uint64" | "u64" => DType::Uint64,
            "half" | "float16" | "fp16" | "f16" => DType::Half,
            "float" | "float32" | "fp32" | "f32" => DType::Float,
            "double" | "float64" | "fp64" | "f64" => DType::Double,
            "bfloat16" | "bf16" => DType::Bfloat16,
            "f8e4m3" | "fp8e4m3" | "float8e4m3" => DType::F8E4M3,
            "f8e5m2" | "fp8e5m2" | "float8e5m2" => DType::F8E5M2,
            _ => return None,
        })
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        self.nccl().size()
    }

    /// The crate's data type.
    pub fn nccl(self) -> nccl::DataType {
        match self {
            DType::Int8 => nccl::DataType::Int8,
            DType::Uint8 => nccl::DataType::Uint8,
            DType::Int32 => nccl::DataType::Int32,
            DType::Uint32 => nccl::DataType::Uint32,
            DType::Int64 => nccl::DataType::Int64,
            DType::Uint64 => nccl::DataType::Uint64,
            DType::Half => nccl::DataType::Float16,
            DType::Float => nccl::DataType::Float32,
            DType::Double => nccl::DataType::Float64,
            DType::Bfloat16 => nccl::DataType::Bfloat16,
            DType::F8E4M3 => nccl::DataType::Float8E4M3,
            DType::F8E5M2 => nccl::DataType::Float8E5M2,
        }
    }
}

/// Generic code to run for the element type chosen at run time; see [`dispatch`].
pub trait TypeVisitor {
    /// What the code returns.
    type Output;
    /// Runs the code for element type `T`.
    fn visit<T: Elem>(self) -> Self::Output;
}

/// Runs `visitor` for the Rust type of `dtype`.
pub fn dispatch<V: TypeVisitor>(dtype: DType, visitor: V) -> V::Output {
    match dtype {
        DType::Int8 => visitor.visit::<i8>(),
        DType::Uint8 => visitor.visit::<u8>(),
        DType::Int32 => visitor.visit::<i32>(),
        DType::Uint32 => visitor.visit::<u32>(),
        DType::Int64 => visitor.visit::<i64>(),
        DType::Uint64 => visitor.visit::<u64>(),
        DType::Half => visitor.visit::<half::f16>(),
        DType::Float => visitor.visit::<f32>(),
        DType::Double => visitor.visit::<f64>(),
        DType::Bfloat16 => visitor.visit::<half::bf16>(),
        DType::F8E4M3 => visitor.visit::<float8::F8E4M3>(),
        DType::F8E5M2 => visitor.visit::<float8::F8E5M2>(),
    }
}
