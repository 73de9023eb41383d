//! Making an [`LsaAllReduce`](super::LsaAllReduce): what each rank prepares alone (the
//! shipped kernels, the scratch buffer filled with sentinels, the kernels' state and the
//! host-mapped word they set when they give up), and the ranks' agreement on it before
//! anything collective.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtrMut, LaunchConfig,
    PinnedHostSlice, PushKernelArg,
};

use super::{KernelState, LsaElem, INBOX_BYTES, SINCE, THREADS, VECTOR};
use crate::agreement::{all_gather_rows, Wait};
use crate::comm::Comm;
use crate::device::shipped::{self, ShippedFn};
use crate::error::{Error, Refusal, Result};
use crate::memory::NcclBuffer;

/// The host-mapped words shipped kernels set for the host, which reads them at every launch
/// without waiting for the GPU: word 0 when a kernel gives up waiting (the all-reduce uses
/// that one only; the expert exchange also reports bad routing in words 1 and 2). Rooms come
/// from [`HOST_ROOMS`] and go back there.
pub(in crate::device) struct HostWords {
    /// Owns the page-locked words (`None` once given back to the pool).
    word: Option<(usize, PinnedHostSlice<u32>)>,
    /// Their host address (an integer, so that the owner stays `Send` and `Sync`).
    host: usize,
    /// Their device address, for the kernels' state ([`KernelState`]'s `gave_up`).
    device: u64,
}

/// Words in each room of [`HostWords`]: four reports, and the expert exchange's row counts
/// per rank, sent and received (2 × its `MAX_RANKS`), which its fallback reads back from
/// here rather than through a pageable copy (which can wait behind a peer's kernel on a
/// shared GPU).
pub(in crate::device) const HOST_WORDS: usize = 4 + 2 * 128;

/// Words of dropped instances, by device ordinal, kept for the life of the process and
/// handed to later instances. Freeing page-locked memory (`cuMemFreeHost`) waits for all the
/// work of the CUDA context, and ranks of one process sharing a GPU share that context: a
/// rank dropping an instance while its peer already waits in the next collective for it
/// would wait for that collective, which waits for this rank (as the step inputs' buffers
/// of nccl-candle's decode did, hung on one H200). One word per instance alive at once.
static HOST_ROOMS: Mutex<Vec<(usize, PinnedHostSlice<u32>)>> = Mutex::new(Vec::new());

impl HostWords {
    pub(in crate::device) fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let ordinal = ctx.ordinal();
        let reused = {
            let mut pool = HOST_ROOMS.lock();
            pool.iter()
                .position(|(o, _)| *o == ordinal)
                .map(|i| pool.swap_remove(i).1)
        };
        let mut word = match reused {
            Some(word) => word,
            None => {
                let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
                // SAFETY: the words are written (zeroed) below before anything reads them.
                unsafe { ctx.alloc_pinned_with_flags::<u32>(HOST_WORDS, flags) }?
            }
        };
        // Zeroed whether new or reused (a reused room may hold its last instance's reports).
        word.as_mut_slice()?.fill(0);
        let host = word.as_mut_ptr()?;
        ctx.bind_to_thread()?;
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` is page-locked memory allocated with DEVICEMAP and PORTABLE on this
        // device (mapped in every context), `ctx` is bound to this thread, and `device` a
        // valid place for the address.
        let rc = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host.cast(), 0) };
        rc.result()?;
        Ok(Self {
            word: Some((ordinal, word)),
            host: host as usize,
            device,
        })
    }

    /// Whether a kernel gave up (word 0).
    pub(in crate::device) fn is_set(&self) -> bool {
        self.word(0) != 0
    }

    /// Word `i` (below [`HOST_WORDS`]) as the kernels last wrote it; 0 past the room.
    pub(in crate::device) fn word(&self, i: usize) -> u32 {
        if i >= HOST_WORDS {
            return 0;
        }
        self.atomic(i).load(Ordering::Acquire)
    }

    /// Sets word `i` (below [`HOST_WORDS`]) to zero: a report taken by the host.
    pub(in crate::device) fn clear(&self, i: usize) {
        if i < HOST_WORDS {
            // The caller takes a report once the stream's work so far ended (no kernel of
            // the instance writes the word meanwhile unless more calls were made since).
            self.atomic(i).store(0, Ordering::Release);
        }
    }

    /// Word `i` (below [`HOST_WORDS`]) as an atomic: the host's threads may read and clear
    /// it at once (an instance is `Sync`), and the GPU writes it meanwhile.
    fn atomic(&self, i: usize) -> &AtomicU32 {
        debug_assert!(i < HOST_WORDS);
        // SAFETY: `host` is the address of the HOST_WORDS u32 words `word` owns (4-aligned
        // page-locked memory), alive as long as `self` (kept in the pool after); i <
        // HOST_WORDS (the callers check); every host access goes through this atomic view.
        unsafe { &*(self.host as *const AtomicU32).add(i) }
    }

    /// The words' device address, for a kernels' state.
    pub(in crate::device) fn device(&self) -> u64 {
        self.device
    }
}

/// Gives the word back to the pool. Dropped only once no kernel of its instance can run
/// (the instance's drop leaks it otherwise), so nothing writes it after.
impl Drop for HostWords {
    fn drop(&mut self) {
        if let Some(word) = self.word.take() {
            HOST_ROOMS.lock().push(word);
        }
    }
}

/// What a rank prepares on its own before the ranks agree.
pub(super) struct Prepared {
    pub(super) flags: CudaFunction,
    pub(super) twoshot: CudaFunction,
    pub(super) all_gather: CudaFunction,
    pub(super) barrier: CudaFunction,
    pub(super) fused_norm: CudaFunction,
    pub(super) add_norm: CudaFunction,
    pub(super) scratch: NcclBuffer<u32>,
    pub(super) state: CudaSlice<KernelState>,
    pub(super) gave_up: HostWords,
    pub(super) slot_bytes: usize,
    /// The stream the instance's stop writes on (see `stop.rs`): made here, before the
    /// agreement, since making a stream can wait for the whole context (cudarc synchronises
    /// it when a context gets its second stream), which, on a GPU shared by ranks of one
    /// process, a peer's first kernel may be spinning on.
    pub(super) stop_stream: Arc<CudaStream>,
}

/// Scratch bytes per rank slot for `max_count` elements of `T` (one vector more than the
/// message: a two-shot call's slot holds twice a 1/ranks chunk, rounded up), and the
/// scratch's words for `ranks` ranks; `None` on overflow.
pub(super) fn scratch_size<T>(max_count: usize, ranks: usize) -> Option<(usize, usize)> {
    let slot = max_count
        .checked_mul(std::mem::size_of::<T>())?
        .checked_next_multiple_of(VECTOR)?
        .checked_add(VECTOR)?;
    let words = ranks
        .checked_mul(3)?
        .checked_add(2)?
        .checked_mul(slot)?
        .checked_add(ranks.checked_mul(INBOX_BYTES)?)?
        / 4;
    Some((slot, words))
}

pub(super) fn prepare<T: LsaElem>(comm: &Comm, max_count: usize) -> Result<Prepared> {
    let lib = comm.library();
    lib.require("nccl-rs's shipped device kernels", SINCE)?;
    if max_count == 0 {
        return Err(Error::invalid("LsaAllReduce needs max_count of at least 1"));
    }
    let props = comm.properties()?;
    if !props.device_api_support {
        return Err(Error::Unavailable {
            api: "LsaAllReduce",
            reason: "the communicator has no device-API support".into(),
        });
    }
    if props.lsa_teams != Some(1) {
        return Err(Error::Unavailable {
            api: "LsaAllReduce",
            reason: format!(
                "its kernels need every rank in one LSA team (one host's NVLink, or ranks \
                 sharing a GPU); this communicator has {} LSA teams",
                props
                    .lsa_teams
                    .map_or_else(|| "an unknown number of".into(), |n| n.to_string())
            ),
        });
    }
    let (slot_bytes, words) = scratch_size::<T>(max_count, comm.size())
        .ok_or_else(|| Error::invalid(format!("LsaAllReduce: max_count {max_count} overflows")))?;
    let ctx = comm.context();
    ctx.bind_to_thread()?;
    let module = shipped::load(ctx)?;
    let kernel = |f: ShippedFn| shipped::function(&module, f, T::SUFFIX);
    let flags = kernel(ShippedFn::OneShotFlags)?;
    let twoshot = kernel(ShippedFn::TwoShotFlags)?;
    let all_gather = kernel(ShippedFn::AllGather)?;
    let barrier = kernel(ShippedFn::OneShotBarrier)?;
    let fused_norm = kernel(ShippedFn::FusedAddRmsNorm)?;
    let add_norm = kernel(ShippedFn::AddRmsNorm)?;
    let fill = kernel(ShippedFn::FillU32)?;
    let stream = comm.stream();
    let stop_stream = ctx.new_stream()?;
    let mut scratch = NcclBuffer::<u32>::alloc_zeros(stream, words)?;
    let gave_up = HostWords::new(ctx)?;
    let state = stream.clone_htod(&[KernelState::new(gave_up.device)])?;
    // The flags buffers start as sentinels (the barrier buffers need nothing). Peers first
    // write into them after this rank's window registration, whose exchange runs on this
    // stream after this fill.
    let sentinels = 3 * comm.size() * slot_bytes / 4;
    let sentinel = T::SENTINEL_WORD;
    let cfg = LaunchConfig {
        grid_dim: (
            sentinels.div_ceil(THREADS as usize).clamp(1, 1024) as u32,
            1,
            1,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    {
        let (ptr, _written) = scratch.device_ptr_mut(stream);
        // SAFETY: nccl_rs_fill_u32(uint32_t*, size_t, uint32_t) writes `sentinels` words from
        // `ptr`, inside the `words`-word buffer (sentinels <= words).
        unsafe {
            stream
                .launch_builder(&fill)
                .arg(&ptr)
                .arg(&sentinels)
                .arg(&sentinel)
                .launch(cfg)?;
        }
    }
    Ok(Prepared {
        flags,
        twoshot,
        all_gather,
        barrier,
        fused_norm,
        add_norm,
        scratch,
        state,
        gave_up,
        slot_bytes,
        stop_stream,
    })
}

const CALL: &str = "LsaAllReduce::new";
const WIDTH: usize = 3;

/// Every rank's verdict, element size and `max_count`, all-gathered: each rank returns its
/// own error, the others [`Error::RankRefused`]; differing sizes give
/// [`Error::RankMismatch`] everywhere.
pub(super) fn agree(comm: &Comm, row: [u64; WIDTH]) -> Result<()> {
    if comm.size() == 1 {
        return Ok(());
    }
    let wait = Wait {
        limit: |comm| Some(comm.ready_timeout()),
        what: "LsaAllReduce's agreement exchange to finish",
        explain: None,
    };
    let all = all_gather_rows(&[comm], &[row.to_vec()], WIDTH, &wait)?;
    let rows: Vec<&[u64]> = all[0].chunks_exact(WIDTH).collect();
    if let Some((rank, reason)) = rows
        .iter()
        .enumerate()
        .find_map(|(rank, row)| Refusal::from_code(row[0]).map(|r| (rank, r)))
    {
        return Err(Error::RankRefused {
            call: CALL,
            rank,
            reason,
        });
    }
    for (field, i) in [("element size", 1), ("max_count", 2)] {
        if let Some((rank, row)) = rows.iter().enumerate().find(|(_, r)| r[i] != rows[0][i]) {
            return Err(Error::RankMismatch {
                call: CALL,
                field,
                first: 0,
                expected: rows[0][i],
                rank,
                value: row[i],
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_holds_three_buffers_per_rank_two_more_and_the_inboxes() {
        let inbox = |ranks: usize| ranks * INBOX_BYTES;
        assert_eq!(
            scratch_size::<f32>(1, 2),
            Some((32, ((3 * 2 + 2) * 32 + inbox(2)) / 4))
        );
        assert_eq!(
            scratch_size::<half::bf16>(8, 4),
            Some((32, (14 * 32 + inbox(4)) / 4))
        );
        assert_eq!(
            scratch_size::<f32>(5, 4),
            Some((48, (14 * 48 + inbox(4)) / 4))
        );
        // Two ranks, an odd number of vectors: the chunk (2 of 3) twice fits the slot.
        let (slot, _) = scratch_size::<f32>(12, 2).unwrap();
        assert!(2 * 3usize.div_ceil(2) * VECTOR <= slot);
        assert_eq!(scratch_size::<f32>(usize::MAX / 2, 2), None);
        assert_eq!(scratch_size::<f32>(1 << 20, usize::MAX / 2), None);
    }
}
