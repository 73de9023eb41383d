//! The all-to-all-v path of an [`ExpertExchange`](super::ExpertExchange): for ranks that
//! form no LSA team (several hosts, the simulated-hosts shape) or NCCL before 2.29.2. Local
//! kernels of the shipped module pack this rank's rows by destination, NCCL moves the counts
//! (all-to-all) and the rows (all-to-all-v, as bytes), and local kernels unpack them into
//! the same packed layout the LSA kernels give; combine returns the rows the same way and
//! sums them with the same code, so both paths give the same bits.

use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DevicePtrMut, PushKernelArg};

use std::time::Duration;

use super::layout::{Geometry, Work, ROWS_FROM_WORD, ROWS_TO_WORD};
use super::{launch_config, usable};
use crate::collectives::Layout;
use crate::comm::Comm;
use crate::device::all_reduce::HostWords;
use crate::device::kernel::DeviceModule;
use crate::device::shipped::{function, ShippedFn};
use crate::device::LsaElem;
use crate::error::{Error, Result};

/// The device addresses a dispatch works on.
pub(super) struct DispatchArgs {
    pub(super) x: u64,
    pub(super) routing: u64,
    pub(super) tokens: u32,
    pub(super) recv_x: u64,
    pub(super) recv_counts: u64,
    pub(super) state: u64,
    /// How long to wait for the counts; CTAs per kernel.
    pub(super) timeout: Duration,
    pub(super) ctas: u32,
}

/// The device addresses a combine works on.
pub(super) struct CombineArgs {
    pub(super) expert_out: u64,
    pub(super) weights: u64,
    pub(super) out: u64,
    pub(super) tokens: u32,
    pub(super) ctas: u32,
}

/// The path's kernels, looked up before the ranks agree.
pub(super) struct FallbackKernels {
    pub(super) pack: CudaFunction,
    count_rows: CudaFunction,
    unpack: CudaFunction,
    pack_back: CudaFunction,
    reduce: CudaFunction,
}

impl FallbackKernels {
    pub(super) fn new<T: LsaElem>(module: &DeviceModule) -> Result<Self> {
        Ok(Self {
            pack: function(module, ShippedFn::MoePack, T::SUFFIX)?,
            count_rows: function(module, ShippedFn::MoeCountRows, T::SUFFIX)?,
            unpack: function(module, ShippedFn::MoeUnpack, T::SUFFIX)?,
            pack_back: function(module, ShippedFn::MoePackBack, T::SUFFIX)?,
            reduce: function(module, ShippedFn::MoeReduce, T::SUFFIX)?,
        })
    }
}

/// The path's kernels, buffers, and the counts a dispatch leaves for its combine.
pub(super) struct Fallback {
    pack: CudaFunction,
    count_rows: CudaFunction,
    unpack: CudaFunction,
    pack_back: CudaFunction,
    reduce: CudaFunction,
    /// This rank's rows by destination, and their entry numbers.
    send: CudaSlice<u8>,
    send_meta: CudaSlice<u32>,
    /// Rows per expert from this rank, and per (source, local expert) to it.
    counts: CudaSlice<u32>,
    pairs: CudaSlice<u32>,
    /// Rows received (by source), their entry numbers, and the experts' outputs in that order.
    recv: CudaSlice<u8>,
    recv_meta: CudaSlice<u32>,
    back: CudaSlice<u8>,
    /// The outputs returned, in this rank's send order.
    returned: CudaSlice<u8>,
    row_bytes: usize,
    /// Rows this rank sent to each rank, and received from each, in the latest dispatch.
    rows_to: Vec<usize>,
    rows_from: Vec<usize>,
}

impl Fallback {
    pub(super) fn new(comm: &Comm, g: &Geometry, kernels: FallbackKernels) -> Result<Self> {
        let stream = comm.stream();
        let entries = g.max_tokens as usize * g.top_k as usize;
        let row_bytes = g.row_vecs as usize * 16;
        // A source sends at most one row per token to each of this rank's experts it names.
        let received =
            g.ranks as usize * g.max_tokens as usize * (g.top_k.min(g.local_experts) as usize);
        let bytes = |rows: usize| {
            rows.checked_mul(row_bytes)
                .ok_or_else(|| Error::invalid("ExpertExchange: the fallback's sizes overflow"))
        };
        Ok(Self {
            pack: kernels.pack,
            count_rows: kernels.count_rows,
            unpack: kernels.unpack,
            pack_back: kernels.pack_back,
            reduce: kernels.reduce,
            send: stream.alloc_zeros::<u8>(bytes(entries)?)?,
            send_meta: stream.alloc_zeros::<u32>(entries)?,
            counts: stream.alloc_zeros::<u32>(g.experts as usize)?,
            pairs: stream.alloc_zeros::<u32>(g.experts as usize)?,
            recv: stream.alloc_zeros::<u8>(bytes(received)?)?,
            recv_meta: stream.alloc_zeros::<u32>(received)?,
            back: stream.alloc_zeros::<u8>(bytes(received)?)?,
            returned: stream.alloc_zeros::<u8>(bytes(entries)?)?,
            row_bytes,
            rows_to: vec![0; g.ranks as usize],
            rows_from: vec![0; g.ranks as usize],
        })
    }

    pub(super) fn dispatch(
        &mut self,
        comm: &Comm,
        g: &Geometry,
        work: &Work,
        host_words: &HostWords,
        args: DispatchArgs,
    ) -> Result<()> {
        let ctas = args.ctas;
        let stream = comm.stream().clone();
        {
            let _usable = usable(comm)?;
            let (send, _s) = self.send.device_ptr_mut(&stream);
            let (send_meta, _m) = self.send_meta.device_ptr_mut(&stream);
            let (counts, _c) = self.counts.device_ptr_mut(&stream);
            // SAFETY: nccl_rs_moe_pack(Geometry, Work, const uint4* x, const int* topk,
            // unsigned tokens, uint4* send, unsigned* send_meta, unsigned* counts, MoeState*)
            // in that order; it reads `tokens` rows and routing entries (checked by the
            // caller), writes at most tokens × top_k rows and entry numbers into the send
            // buffers (sized for max_tokens × top_k), `experts` counts, and its work buffers.
            unsafe {
                stream
                    .launch_builder(&self.pack)
                    .arg(g)
                    .arg(work)
                    .arg(&args.x)
                    .arg(&args.routing)
                    .arg(&args.tokens)
                    .arg(&send)
                    .arg(&send_meta)
                    .arg(&counts)
                    .arg(&args.state)
                    .launch(launch_config(ctas))?;
            }
        }
        // (An all-to-all-v of equal counts: ncclAlltoAll itself needs NCCL 2.28.)
        let local = g.local_experts as usize;
        let each = Layout::even(g.ranks as usize, local);
        comm.all_to_all_v(&self.counts, each.clone(), &mut self.pairs, each)?;
        {
            let _usable = usable(comm)?;
            let (pairs, _p) = self.pairs.device_ptr(&stream);
            // SAFETY: nccl_rs_moe_count_rows(Geometry, const unsigned* pairs, MoeState*); it
            // reads ranks × local_experts counts (the buffer holds experts = that many) and
            // writes `ranks` host-mapped words past ROWS_FROM_WORD (the room holds them).
            unsafe {
                stream
                    .launch_builder(&self.count_rows)
                    .arg(g)
                    .arg(&pairs)
                    .arg(&args.state)
                    .launch(launch_config(ctas))?;
            }
        }
        // The rows per rank decide the all-to-all-v's: the pack and count kernels wrote them
        // into host-mapped words, read once the stream got there (a bounded wait: a peer
        // that never comes gives a timeout, not a hang; no pageable copy, which can wait
        // behind a peer's kernel on a shared GPU).
        comm.wait_stream(&stream, Some(args.timeout))?;
        let ranks = g.ranks as usize;
        self.rows_to = (0..ranks)
            .map(|r| host_words.word(ROWS_TO_WORD + r) as usize)
            .collect();
        self.rows_from = (0..ranks)
            .map(|s| host_words.word(ROWS_FROM_WORD + s) as usize)
            .collect();
        let received_capacity = self.recv_meta.len();
        let received: usize = self.rows_from.iter().sum();
        if received > received_capacity {
            return Err(Error::invalid(format!(
                "ExpertExchange: the peers announced {received} rows for this rank, more than \
                 the {received_capacity} any routing can send (a peer of another shape?)"
            )));
        }
        let bytes = |rows: &[usize]| -> Vec<usize> {
            rows.iter()
                .map(|r| r.saturating_mul(self.row_bytes))
                .collect()
        };
        let (to, from) = (bytes(&self.rows_to), bytes(&self.rows_from));
        comm.all_to_all_v(&self.send, to, &mut self.recv, Layout::packed(from))?;
        comm.all_to_all_v(
            &self.send_meta,
            self.rows_to.clone(),
            &mut self.recv_meta,
            Layout::packed(self.rows_from.clone()),
        )?;
        let _usable = usable(comm)?;
        let (recv, _r) = self.recv.device_ptr(&stream);
        let (recv_meta, _m) = self.recv_meta.device_ptr(&stream);
        let (pairs, _p) = self.pairs.device_ptr(&stream);
        // SAFETY: nccl_rs_moe_unpack(Geometry, Work, const uint4* recv, const unsigned*
        // recv_meta, const unsigned* pairs, uint4* recv_x, int* recv_counts); it reads the
        // rows the counts in `pairs` announce (at most the buffers' capacity, checked above)
        // and writes recv_x below received_rows rows and recv_counts below local_experts
        // (both checked by the caller), and its work buffers.
        unsafe {
            stream
                .launch_builder(&self.unpack)
                .arg(g)
                .arg(work)
                .arg(&recv)
                .arg(&recv_meta)
                .arg(&pairs)
                .arg(&args.recv_x)
                .arg(&args.recv_counts)
                .launch(launch_config(ctas))?;
        }
        Ok(())
    }

    pub(super) fn combine(
        &mut self,
        comm: &Comm,
        g: &Geometry,
        work: &Work,
        args: CombineArgs,
    ) -> Result<()> {
        let ctas = args.ctas;
        let stream = comm.stream().clone();
        {
            let _usable = usable(comm)?;
            let (back, _b) = self.back.device_ptr_mut(&stream);
            // SAFETY: nccl_rs_moe_pack_back(Geometry, Work, const uint4* expert_out, uint4*
            // back); it reads the packed rows the dispatch received (below received_rows,
            // checked by the caller) and writes as many rows into `back`, sized as `recv`.
            unsafe {
                stream
                    .launch_builder(&self.pack_back)
                    .arg(g)
                    .arg(work)
                    .arg(&args.expert_out)
                    .arg(&back)
                    .launch(launch_config(ctas))?;
            }
        }
        let from: Vec<usize> = self
            .rows_from
            .iter()
            .map(|r| r.saturating_mul(self.row_bytes))
            .collect();
        let to: Vec<usize> = self
            .rows_to
            .iter()
            .map(|r| r.saturating_mul(self.row_bytes))
            .collect();
        comm.all_to_all_v(&self.back, from, &mut self.returned, Layout::packed(to))?;
        let _usable = usable(comm)?;
        let (returned, _r) = self.returned.device_ptr(&stream);
        // SAFETY: nccl_rs_moe_reduce_T(Geometry, Work, const uint4* returned, const float*
        // weights, T* out, unsigned tokens); it reads the rows returned at the send slots
        // the dispatch recorded, `tokens × top_k` weights, and writes `tokens` rows of
        // `out` (checked by the caller).
        unsafe {
            stream
                .launch_builder(&self.reduce)
                .arg(g)
                .arg(work)
                .arg(&returned)
                .arg(&args.weights)
                .arg(&args.out)
                .arg(&args.tokens)
                .launch(launch_config(ctas))?;
        }
        Ok(())
    }
}
