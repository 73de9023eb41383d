//! A decode step captured once into a CUDA graph and replayed for every token.

use std::time::Duration;

use candle_core::{DType, Device, DeviceLocation, Tensor};
use nccl::cudarc::driver::sys::{
    self, CUgraphInstantiate_flags, CUgraphNodeType, CUstreamCaptureMode,
};
use nccl::cudarc::driver::{CudaGraph, CudaStream};

use super::captures::{self, PendingCapture};
use super::StepInputs;
use crate::cuda_device;
use crate::tp::TpGroup;
use crate::{fingerprint, Error, Result};
use nccl::diagnostics::flight::RecordedGraph;

/// A model whose decode step reads its token ids and position from device memory
/// ([`StepInputs`]), so that one captured step serves every position of a sequence.
///
/// # Safety
///
/// [`DecodeGraph`] replays the kernels [`decode_step`](Self::decode_step) enqueued while it
/// was captured, on the memory they touched then, for as long as it holds the model
/// (mutably borrowed). An implementation promises that while borrowed so:
/// * every tensor a step reads or writes is owned by the model (or the inputs) and keeps its
///   storage: [`prefill`](Self::prefill) of the batch the caches hold and `decode_step` never
///   free, replace or reallocate what an earlier step touched;
/// * `decode_step` enqueues only device work on [`device`](Self::device)'s stream (candle
///   ops, the group's collectives): no host copy, no synchronisation while the stream is
///   captured (outside a capture it may wait for its own stream), and every tensor it makes
///   and does not keep is dropped before it returns;
/// * `decode_step` refuses inputs of another `max_seq` or batch than its caches' (a position
///   is then always inside them).
pub unsafe trait StaticDecode {
    /// The device the model runs on.
    fn device(&self) -> &Device;
    /// The model's tensor-parallel group.
    fn group(&self) -> &TpGroup;
    /// The tokens of the logits.
    fn vocab(&self) -> usize;
    /// The positions the caches have room for.
    fn max_seq(&self) -> usize;
    /// The positions the caches hold: the next step's position.
    fn cached(&self) -> usize;
    /// The batch the caches are allocated for (`None` before the first prompt).
    fn cache_batch(&self) -> Option<usize>;
    /// Whether this rank can take a step of `batch` rows now (the caches hold a prompt of
    /// that batch, nothing failed): a fingerprint of what its step does (the settings every
    /// rank must share, e.g. a fused epilogue), or why not.
    fn check_step(&self, batch: usize) -> Result<u64>;
    /// Starts a sequence: empties the caches (keeping their memory for the same batch) and
    /// runs the prompt `ids` (`[batch, seq]`, `u32`) from position 0 with the host-driven
    /// path; returns the last position's logits, `[batch, vocab]`.
    fn prefill(&mut self, ids: &Tensor) -> Result<Tensor>;
    /// One step of `inputs.batch()` rows at the position `inputs` holds: writes the caches
    /// there and the logits into `inputs` ([`StepInputs::finish`]). Counts nothing on the
    /// host ([`set_cached`](Self::set_cached) does).
    fn decode_step(&mut self, inputs: &StepInputs) -> Result<()>;
    /// Records that the caches hold `cached` positions after device-driven steps.
    fn set_cached(&mut self, cached: usize) -> Result<()>;
}

/// A model's decode step, captured into a CUDA graph on its device's stream and replayed
/// for each token ([`capture`](Self::capture)), or run eagerly through the same code
/// ([`eager`](Self::eager): the reference a replay is compared with, bit for bit).
///
/// It borrows the model mutably for its whole life, so nothing the graph reads or writes
/// (weights, caches, the group's collectives and their scratch) can be dropped, replaced or
/// used through the model meanwhile; its inputs and outputs are its own, and only copies of
/// them are handed out. Dropping it leaves running replays to finish on the stream: every
/// later use of the model's memory, frees included, is ordered after them on that stream.
/// It is not `Send`: candle keeps the small host uploads the captured kernels read in a
/// cache of the capturing thread (for the thread's life: each capture adds a few KiB that
/// candle never frees).
///
/// The group is shared ([`TpGroup`] is cheap to clone): collectives other code runs on a
/// clone of it go on the same stream, in the order the host enqueued them, as with eager
/// passes. A [`Watchdog`](nccl::Watchdog) on the communicator probes its streams from its
/// own thread; a probe it records just as a capture begins is captured too, which
/// invalidates the capture (an error on every rank) or trips the watchdog on its next query
/// (the communicator aborted, an error): never wrong data.
///
/// Every rank of the group makes it and steps it alike, as with any collective: capture
/// agrees on the arguments first (each rank's [`StaticDecode::check_step`] and settings),
/// runs one step eagerly (the warm-up that loads kernels and fills candle's cache of host
/// data, every rank's collectives included: a failure inside it is an eager pass's failure,
/// its peers' collectives wait for the watchdog or an abort), captures, and agrees on the
/// outcome, so a rank whose capture failed leaves no peer replaying alone. A capture runs
/// nothing, so a failed one leaves the model as it was; with
/// [`LsaCollectives`](crate::tp::LsaCollectives), a shipped kernel's refusal while capturing
/// puts its instance out of step on that rank as a refused launch does (its `status` says
/// so; drop the group on every rank), and so does a failure inside an expert exchange on
/// one rank (its next host-driven call is refused there, and its peers' kernels give up
/// after their timeout). A mixture of experts whose exchange runs NCCL's all-to-all-v
/// (no LSA team, NCCL before 2.29.2) is refused a capture by its `check_step`, before
/// anything runs; its eager steps run.
/// Ranks on threads of one process sharing a GPU (one CUDA context): a rank of a group of
/// two or more whose capture is instantiated waits, before the agreement on the outcome,
/// until no such capture of that GPU in the process is still being instantiated
/// (instantiation can wait for the context's running kernels, and the agreement's would
/// wait for the peer still instantiating); another group's capture on that GPU is waited
/// for too. At most 60 s, then it refuses (an error on every rank; its agreement may then
/// meet the very hang the wait avoids, which the kernels' timeout or a watchdog ends).
/// A step refused on one rank alone (ids of another batch, a sequence at `max_seq`) leaves
/// its peers' replay waiting in its collectives, as with an eager pass: the communicator's
/// watchdog or abort ends the wait (NCCL's kernels), the shipped kernels' timeout theirs.
/// NCCL's release of the communicator waits until the graph is dropped (see
/// [`nccl::Comm::releases_in_flight`]): an abort returns anyway, its kernels stopped.
///
/// The communicator's flight recorder knows the graph: the capture is recorded once every
/// rank agreed on it (given back where the ranks refused it) and every launch is an entry of
/// its own, so a rank that replayed fewer times is named when the ranks' records are compared
/// (see [`nccl::diagnostics::flight`]'s CUDA graphs).
pub struct DecodeGraph<'m, M: StaticDecode> {
    model: &'m mut M,
    inputs: StepInputs,
    /// `None`: eager steps.
    graph: Option<CudaGraph>,
    /// The graph in the flight recorder of the group's communicator, which records each
    /// launch (`None`: eager steps or no communicator; a handle without a number where the
    /// recorder is off). Declared after `graph`, so that the graph is destroyed first (a
    /// destroy of the communicator waits for it).
    recorded: Option<RecordedGraph>,
    /// A step failed midway: the caches disagree with the count.
    failed: bool,
}

impl<M: StaticDecode> std::fmt::Debug for DecodeGraph<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeGraph")
            .field("batch", &self.inputs.batch())
            .field("captured", &self.graph.is_some())
            .field("failed", &self.failed)
            .finish()
    }
}

/// The nodes of a captured graph, by kind ([`DecodeGraph::nodes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphNodes {
    /// Kernels (candle's, cuBLAS's, NCCL's, the shipped collectives').
    pub kernels: usize,
    /// Memory sets (candle's zeros).
    pub memsets: usize,
    /// Copies.
    pub memcpys: usize,
    /// Allocations of the step's temporaries (stream-ordered allocation under capture).
    pub allocs: usize,
    /// Their frees.
    pub frees: usize,
    /// Anything else (NCCL's host or event nodes, empty nodes).
    pub other: usize,
}

impl std::fmt::Display for GraphNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} kernels, {} memsets, {} copies, {} allocations, {} frees, {} other nodes",
            self.kernels, self.memsets, self.memcpys, self.allocs, self.frees, self.other
        )
    }
}

/// A CUDA device for models captured into graphs: its own stream (candle's
/// `Device::new_cuda_with_stream`; the legacy default stream cannot be captured) and no
/// cross-stream event tracking (cudarc waits on events recorded outside a capture, which
/// invalidates it).
///
/// # Safety
///
/// cudarc no longer orders this device's tensors between streams: every use of them on
/// another stream (a `to_device` onto another device, which copies on that device's stream;
/// raw cudarc work on a stream of one's own) must be ordered with this device's stream by
/// the caller, before it reads them and before they are dropped. candle's ops on this device
/// and this crate's collectives all run on its one stream.
pub unsafe fn capturable_device(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda_with_stream(ordinal)?;
    if let Device::Cuda(cuda) = &device {
        // SAFETY: no tensor of this device exists yet; the caller takes on the ordering of
        // other streams (the function's contract).
        unsafe { cuda_device::disable_event_tracking(cuda) }?;
    }
    Ok(device)
}

/// How long a rank whose capture is instantiated waits for the other captures on its GPU
/// in this process (see `captures`) before it agrees on the outcome anyway, as a refusal.
const INSTANTIATION_WAIT: Duration = Duration::from_secs(60);

/// Ends a capture left open by a panic; the graph, if any, is dropped.
struct CaptureGuard<'a>(Option<&'a std::sync::Arc<CudaStream>>);

impl Drop for CaptureGuard<'_> {
    fn drop(&mut self) {
        if let Some(stream) = self.0.take() {
            drop(stream.end_capture(CUgraphInstantiate_flags(0)));
        }
    }
}

/// The raw `cudaStream_t` of `stream`, as the flight recorder notes streams.
fn raw_stream(stream: &CudaStream) -> u64 {
    stream.cu_stream() as u64
}

/// Why `device` cannot capture, if it cannot.
fn capture_refusal(device: &Device) -> Option<String> {
    let Device::Cuda(cuda) = device else {
        return Some(format!(
            "the model is on {:?}, not a CUDA device",
            device.location()
        ));
    };
    let stream = match cuda_device::stream(cuda) {
        Ok(stream) => stream,
        Err(err) => return Some(err.to_string()),
    };
    if stream.cu_stream().is_null() {
        return Some(
            "the device runs on CUDA's legacy default stream, which cannot be captured \
             (make it with capturable_device)"
                .into(),
        );
    }
    if cuda_device::is_event_tracking(cuda).unwrap_or(true) {
        return Some(
            "the device tracks cross-stream events, which a capture cannot wait on (make it \
             with capturable_device)"
                .into(),
        );
    }
    None
}

impl<'m, M: StaticDecode> DecodeGraph<'m, M> {
    /// The model's step for `batch` rows, run eagerly by [`step`](Self::step) (no graph):
    /// the same kernels a captured step replays. Local: no collective.
    pub fn eager(model: &'m mut M, batch: usize) -> Result<Self> {
        let inputs = StepInputs::new(batch, model.vocab(), model.max_seq(), model.device())?;
        Ok(Self {
            model,
            inputs,
            graph: None,
            recorded: None,
            failed: false,
        })
    }

    /// Captures the model's step for `batch` rows into a CUDA graph. The caches must hold a
    /// prompt of that batch ([`StaticDecode::prefill`], or [`prefill`](Self::prefill) of an
    /// eager graph); the step after it is the first the graph can take. Every rank calls it
    /// alike (see the type's docs): a refusal or failure on any rank is an error on every
    /// rank ([`Error::Graph`] with the step and candle's or CUDA's reason for this rank's,
    /// [`Error::PeerRefused`] for a peer's).
    pub fn capture(model: &'m mut M, batch: usize) -> Result<Self> {
        let device = model.device().clone();
        let group = model.group().clone();
        let position = model.cached();
        // Registered before this rank's first collective; see `captures`.
        let ordinal = match device.location() {
            DeviceLocation::Cuda { gpu_id } => Some(gpu_id),
            _ => None,
        };
        // A group without collectives agrees without the GPU: nothing to wait for.
        let ordinal = ordinal.filter(|_| group.size() > 1);
        let pending = ordinal.map(PendingCapture::register);
        let checked = || -> Result<(StepInputs, u64)> {
            let inputs = StepInputs::new(batch, model.vocab(), model.max_seq(), &device)?;
            if let Some(why) = capture_refusal(&device) {
                return Err(Error::Graph { op: "check", why });
            }
            let settings = model.check_step(batch).map_err(|e| Error::Graph {
                op: "check",
                why: e.to_string(),
            })?;
            if position >= model.max_seq() {
                return Err(Error::Graph {
                    op: "check",
                    why: format!("no room after {position} positions"),
                });
            }
            Ok((inputs, settings))
        };
        let (inputs, local) = match checked() {
            Ok((inputs, settings)) => (Some(inputs), Ok(settings)),
            Err(err) => (None, Err(err)),
        };
        let settings = *local.as_ref().unwrap_or(&0);
        let fp = fingerprint(&(batch, position, model.max_seq(), model.vocab(), settings));
        group.agree_checked("decode graph arguments", fp, local.map(|_| ()), &device)?;
        let mut inputs = inputs.ok_or_else(|| Error::Graph {
            op: "check",
            why: "no inputs after the agreement".into(),
        })?;
        let Device::Cuda(cuda) = &device else {
            return Err(Error::Graph {
                op: "check",
                why: "not a CUDA device".into(),
            });
        };
        let stream = cuda_device::stream(cuda)?;
        // The flight recorder's marks of the capture's ends, so that the graph's replays are
        // recorded once every rank agreed on it (and the agreement is not counted as captured).
        let (mut began, mut capture_ended) = (None, None);
        let (began, capture_ended) = (&mut began, &mut capture_ended);
        let captured = {
            // candle uploads small host data (strided layouts, scalars) at each op; under
            // this guard it keeps them in device memory, filled by the warm-up and read by
            // the captured kernels for the life of the thread.
            let _cache = cuda_device::graph_htod_cache(cuda)?;
            // The warm-up writes the caches at `position` with ids 0: the first replay
            // writes that position again before anything reads it.
            let warm = inputs
                .write(&vec![0; batch], position)
                .and_then(|()| model.decode_step(&inputs))
                .and_then(|()| Ok(device.synchronize()?))
                .map_err(|e| Error::Graph {
                    op: "warm-up",
                    why: e.to_string(),
                });
            warm.and_then(|()| {
                *began = group.graph_capture_mark();
                stream
                    .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .map_err(|e| Error::Graph {
                        op: "capture",
                        why: e.to_string(),
                    })?;
                // Ends the capture should the step panic (in candle or cudarc), so that the
                // stream stays usable.
                let mut guard = CaptureGuard(Some(&stream));
                let step = model.decode_step(&inputs);
                guard.0 = None;
                // Always ended, so that the stream is usable whatever the step did.
                let ended = stream.end_capture(CUgraphInstantiate_flags(0));
                *capture_ended = group.graph_capture_mark();
                step.map_err(|e| Error::Graph {
                    op: "capture",
                    why: e.to_string(),
                })?;
                match ended {
                    Ok(Some(graph)) => Ok(graph),
                    Ok(None) => Err(Error::Graph {
                        op: "capture",
                        why: "the step captured nothing".into(),
                    }),
                    Err(e) => Err(Error::Graph {
                        op: "instantiate",
                        why: e.to_string(),
                    }),
                }
            })
        };
        let (graph, mut local) = match captured {
            Ok(graph) => (Some(graph), Ok(())),
            Err(err) => (None, Err(err)),
        };
        // Instantiated (or failed): no collective of this rank's while a capture sharing its
        // context is still being instantiated, this rank's own refusal included.
        drop(pending);
        if let Some(ordinal) = ordinal {
            if !captures::wait_until_instantiated(ordinal, INSTANTIATION_WAIT) && local.is_ok() {
                local = Err(Error::Graph {
                    op: "instantiate",
                    why: format!(
                        "another capture on GPU {ordinal} in this process was still being \
                         instantiated after {INSTANTIATION_WAIT:?}"
                    ),
                });
            }
        }
        let agreed = group.agree_checked("decode graph capture", fp, local, &device);
        if agreed.is_err() {
            // Refused on every rank: what the captures numbered (fewer on a rank whose capture
            // failed partway) is given back, so later collectives are numbered alike.
            group.discard_capture(began.take(), capture_ended.take(), raw_stream(&stream));
        }
        agreed?;
        // Every rank's capture succeeded: each numbers the graph alike.
        let recorded = graph.as_ref().and_then(|_| {
            group.record_graph(began.take(), capture_ended.take(), raw_stream(&stream))
        });
        Ok(Self {
            model,
            inputs,
            graph,
            recorded,
            failed: false,
        })
    }

    /// Whether steps replay a captured graph (`false`: eager).
    pub fn is_captured(&self) -> bool {
        self.graph.is_some()
    }

    /// The rows of a step.
    pub fn batch(&self) -> usize {
        self.inputs.batch()
    }

    /// The model (read only: the graph holds it).
    pub fn model(&self) -> &M {
        self.model
    }

    /// Starts a new sequence with prompt `ids` (`[batch, seq]`, `u32`, this graph's batch):
    /// the model's [`prefill`](StaticDecode::prefill), eager; returns its logits
    /// (`[batch, vocab]`). The graph stays valid: the caches keep their memory.
    pub fn prefill(&mut self, ids: &Tensor) -> Result<Tensor> {
        let (batch, _) = ids.dims2()?;
        if batch != self.inputs.batch() || ids.dtype() != DType::U32 {
            return Err(Error::Argument {
                op: "DecodeGraph::prefill",
                why: format!(
                    "ids {:?} {:?} for a graph of batch {}",
                    ids.dims(),
                    ids.dtype(),
                    self.inputs.batch()
                ),
            });
        }
        self.failed = true;
        let logits = self.model.prefill(ids)?;
        self.failed = false;
        Ok(logits)
    }

    /// Runs one step with token ids `ids` (one per row) at the next position: writes the
    /// inputs, then replays the graph (or runs the step eagerly). Its outputs are
    /// [`logits`](Self::logits) and [`greedy_tokens`](Self::greedy_tokens) until the next
    /// step.
    pub fn step(&mut self, ids: &[u32]) -> Result<()> {
        if self.failed {
            return Err(Error::Argument {
                op: "DecodeGraph::step",
                why: "an earlier step or prompt failed midway: start a new sequence (prefill)"
                    .into(),
            });
        }
        let position = self.model.cached();
        if position == 0 || position >= self.model.max_seq() {
            return Err(Error::Argument {
                op: "DecodeGraph::step",
                why: format!(
                    "position {position}: a step needs a prompt first and room for {} \
                     positions",
                    self.model.max_seq()
                ),
            });
        }
        self.inputs.write(ids, position)?;
        self.failed = true;
        match &self.graph {
            Some(graph) => {
                let launched = graph.launch();
                if let (Some(recorded), Device::Cuda(cuda)) = (&self.recorded, self.model.device())
                {
                    if let Ok(stream) = cuda_device::stream(cuda) {
                        recorded.record_replay(raw_stream(&stream), launched.is_err());
                    }
                }
                launched.map_err(|e| Error::Graph {
                    op: "launch",
                    why: e.to_string(),
                })?
            }
            None => self.model.decode_step(&self.inputs)?,
        }
        self.model.set_cached(position + 1)?;
        self.failed = false;
        Ok(())
    }

    /// What the captured graph is made of (`None` for eager steps): the number of kernels a
    /// replay runs is what bounds a small model's step.
    pub fn nodes(&self) -> Result<Option<GraphNodes>> {
        let Some(graph) = &self.graph else {
            return Ok(None);
        };
        let failed = |call: &str, r: sys::CUresult| Error::Graph {
            op: "nodes",
            why: format!("{call}: {r:?}"),
        };
        let mut count = 0usize;
        // SAFETY: the graph is alive (owned by `graph`); a null array asks for the count.
        let r = unsafe { sys::cuGraphGetNodes(graph.cu_graph(), std::ptr::null_mut(), &mut count) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(failed("cuGraphGetNodes", r));
        }
        let mut nodes = vec![std::ptr::null_mut(); count];
        // SAFETY: `nodes` has room for `count` handles, which CUDA fills.
        let r = unsafe { sys::cuGraphGetNodes(graph.cu_graph(), nodes.as_mut_ptr(), &mut count) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(failed("cuGraphGetNodes", r));
        }
        let mut kinds = GraphNodes::default();
        for &node in nodes.iter().take(count) {
            let mut kind = CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
            // SAFETY: `node` is a node of the live graph, `kind` a place for its type.
            let r = unsafe { sys::cuGraphNodeGetType(node, &mut kind) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(failed("cuGraphNodeGetType", r));
            }
            match kind {
                CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL => kinds.kernels += 1,
                CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET => kinds.memsets += 1,
                CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY => kinds.memcpys += 1,
                CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_ALLOC => kinds.allocs += 1,
                CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEM_FREE => kinds.frees += 1,
                _ => kinds.other += 1,
            }
        }
        Ok(Some(kinds))
    }

    /// A copy of the last step's logits, `[batch, vocab]` `f32` (one device copy: the
    /// graph's own buffer is never handed out, since an in-place op on it could replace the
    /// memory the graph writes).
    pub fn logits(&self) -> Result<Tensor> {
        Ok(self.inputs.logits().copy()?)
    }

    /// The last step's greedy tokens on the host, read after the stream is synchronised (a
    /// copy that waits on a collective in a pageable buffer can hold up a peer sharing the
    /// GPU).
    pub fn greedy_tokens(&self) -> Result<Vec<u32>> {
        self.model.device().synchronize()?;
        Ok(self.inputs.greedy().to_vec1::<u32>()?)
    }
}
