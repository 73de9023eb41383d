//! A key/value cache allocated once for its longest sequence, written at positions the host
//! knows (prefill, eager decode) or that the device holds (a step replayed from a CUDA graph).

#[cfg(feature = "cuda")]
use candle_core::cuda::CudaStorageSlice;
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp1, Layout, Tensor};

use super::PositionIndex;
#[allow(unused_imports)] // for the docs
use super::StepInputs;
use crate::{Error, Result};

/// One attention layer's keys and values, `[batch, kv_heads, max_seq, head_dim]` each,
/// allocated at the first [`append`](Self::append) (of that batch, heads, width and type)
/// and never moved afterwards: a CUDA graph that captured a step keeps pointing at the same
/// memory. The eager path ([`append`](Self::append)) runs the kernels candle's own
/// `candle_nn::kv_cache::KvCache` runs (a `slice_set` at the position, a view of the
/// positions held), so its results are candle's bit for bit.
///
/// Not `Clone`: a copy would share the storage that steps write in place.
#[derive(Debug)]
pub struct KvCache {
    max_seq: usize,
    /// `(keys, values)`, once allocated.
    data: Option<(Tensor, Tensor)>,
    /// Positions written by the host-driven path (the next [`append`](Self::append) writes
    /// at this position).
    len: usize,
}

impl KvCache {
    /// An empty cache with room for `max_seq` positions (nothing allocated yet).
    pub fn new(max_seq: usize) -> Self {
        Self {
            max_seq,
            data: None,
            len: 0,
        }
    }

    /// The positions it has room for.
    pub fn max_seq(&self) -> usize {
        self.max_seq
    }

    /// The positions it holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no position.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Writes `k` and `v` (`[b, kv_heads, seq, head_dim]`) at the next positions and returns
    /// every position held, `[b, kv_heads, len + seq, head_dim]` views of the cache. The
    /// first call allocates (zeros) for its shape, and so does a call of another batch,
    /// heads, width or type on an empty cache (after [`reset`](Self::reset), which keeps
    /// the memory for the same shape); such a call on a cache holding positions is refused,
    /// as is a sequence past `max_seq`.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        if self.len == 0 && self.check("KvCache::append", k, v).is_err() {
            self.data = None;
        }
        let seq = self.check("KvCache::append", k, v)?.2;
        if seq > self.max_seq - self.len {
            return Err(Error::Argument {
                op: "KvCache::append",
                why: format!(
                    "{seq} positions after {} in a cache of {}",
                    self.len, self.max_seq
                ),
            });
        }
        let (keys, values) = self.allocated(k, v)?;
        keys.slice_set(&k.contiguous()?, 2, self.len)?;
        values.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len += seq;
        Ok((keys.narrow(2, 0, self.len)?, values.narrow(2, 0, self.len)?))
    }

    /// Writes `k` and `v` (`[b, kv_heads, 1, head_dim]`) at the step's position and returns
    /// the whole cache (every position up to `max_seq`; attention masks the later ones with
    /// [`StepInputs::mask`]). `index` is [`StepInputs::position_index`] of `k`'s shape (made
    /// once a step for every layer). The cache must already be allocated for this shape by
    /// an [`append`](Self::append) (the prompt's). Advances nothing on the host: the owner
    /// counts positions ([`set_len`](Self::set_len)).
    pub fn write_at(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        index: &PositionIndex,
    ) -> Result<(Tensor, Tensor)> {
        let seq = self.check("KvCache::write_at", k, v)?.2;
        if seq != 1 || index.dims() != k.dims() || index.max_seq() > self.max_seq {
            return Err(Error::Shape {
                op: "KvCache::write_at",
                why: format!(
                    "keys {:?} and an index of {:?} below {} for a cache of {}: one position \
                     a step, an index of the keys' shape made for this cache's length or less",
                    k.dims(),
                    index.dims(),
                    index.max_seq(),
                    self.max_seq
                ),
            });
        }
        let Some((keys, values)) = &self.data else {
            return Err(Error::Argument {
                op: "KvCache::write_at",
                why: "the cache is not allocated yet (the prompt's append allocates it)".into(),
            });
        };
        keys.scatter_set(index.tensor(), &k.contiguous()?, 2)?;
        values.scatter_set(index.tensor(), &v.contiguous()?, 2)?;
        Ok((keys.clone(), values.clone()))
    }

    /// Sets the positions held to `len` after steps that wrote them on the device
    /// ([`write_at`](Self::write_at)); refused past `max_seq`.
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.max_seq {
            return Err(Error::Argument {
                op: "KvCache::set_len",
                why: format!("{len} positions in a cache of {}", self.max_seq),
            });
        }
        self.len = len;
        Ok(())
    }

    /// Forgets every position, keeping the memory (a graph that captured a step still
    /// points at it) and clearing it: a device-positioned step attends over every position
    /// with the later ones masked, and an earlier sequence's infinity or NaN there would
    /// still poison it (masking adds minus infinity, and zero times NaN is NaN).
    pub fn reset(&mut self) -> Result<()> {
        self.len = 0;
        if let Some((keys, values)) = &self.data {
            keys.inplace_op1(&Zero)?;
            values.inplace_op1(&Zero)?;
        }
        Ok(())
    }

    /// The cache's shape for `k`, `v`, checked against each other and the allocation.
    fn check(
        &self,
        op: &'static str,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(usize, usize, usize, usize)> {
        let dims = k.dims4()?;
        if v.dims() != k.dims() || v.dtype() != k.dtype() || !v.device().same_device(k.device()) {
            return Err(Error::Shape {
                op,
                why: format!(
                    "keys {:?} {:?} and values {:?} {:?} differ",
                    k.dims(),
                    k.dtype(),
                    v.dims(),
                    v.dtype()
                ),
            });
        }
        if let Some((keys, _)) = &self.data {
            let (b, heads, _, dim) = keys.dims4()?;
            if (dims.0, dims.1, dims.3) != (b, heads, dim) || keys.dtype() != k.dtype() {
                return Err(Error::Shape {
                    op,
                    why: format!(
                        "keys {:?} {:?} for a cache of [{b}, {heads}, {}, {dim}] {:?} holding \
                         positions (reset it first)",
                        k.dims(),
                        k.dtype(),
                        self.max_seq,
                        keys.dtype()
                    ),
                });
            }
        }
        Ok(dims)
    }

    fn allocated(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        if let Some((keys, values)) = &self.data {
            return Ok((keys.clone(), values.clone()));
        }
        let (b, heads, _, dim) = k.dims4()?;
        let shape = (b, heads, self.max_seq, dim);
        let keys = Tensor::zeros(shape, k.dtype(), k.device())?;
        let values = Tensor::zeros(shape, v.dtype(), v.device())?;
        self.data = Some((keys.clone(), values.clone()));
        Ok((keys, values))
    }

    /// The batch it is allocated for.
    pub fn batch(&self) -> Option<usize> {
        self.data.as_ref().map(|(k, _)| k.dims()[0])
    }

    /// The element type, once allocated.
    pub fn dtype(&self) -> Option<DType> {
        self.data.as_ref().map(|(k, _)| k.dtype())
    }
}

/// Sets a float tensor's whole storage to zero in place (one memset on the device's stream).
struct Zero;

impl InplaceOp1 for Zero {
    fn name(&self) -> &'static str {
        "zero"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        match storage {
            CpuStorage::BF16(v) => v.fill(half::bf16::ZERO),
            CpuStorage::F16(v) => v.fill(half::f16::ZERO),
            CpuStorage::F32(v) => v.fill(0.0),
            CpuStorage::F64(v) => v.fill(0.0),
            _ => return Err(candle_core::Error::Msg("zero: not a float cache".into())),
        }
        Ok(())
    }

    // Without `cuda` (the docs' build) candle has no CUDA storage: its default refuses.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, storage: &mut CudaStorage, _: &Layout) -> candle_core::Result<()> {
        let stream = storage.device.cuda_stream();
        let done = match &mut storage.slice {
            CudaStorageSlice::BF16(v) => stream.memset_zeros(v),
            CudaStorageSlice::F16(v) => stream.memset_zeros(v),
            CudaStorageSlice::F32(v) => stream.memset_zeros(v),
            CudaStorageSlice::F64(v) => stream.memset_zeros(v),
            _ => return Err(candle_core::Error::Msg("zero: not a float cache".into())),
        };
        done.map_err(|e| candle_core::Error::Msg(format!("zero: {e}")))
    }
}
