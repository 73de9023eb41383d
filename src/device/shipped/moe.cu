// The mixture-of-experts exchange nccl-rs ships (src/device/moe/): dispatch sends each token
// to the ranks holding its top-k experts, combine brings the experts' outputs back and sums
// them with the router's weights. Compiled ahead of time by generate.sh against NCCL 2.29.2's
// headers, as allreduce.cu is. Peers never touch the caller's buffers: they write only this
// rank's scratch window, which the kernels copy out of. One file past 600 lines: nvcc builds
// it as one module, and the LSA kernels and the fallback's share the routing's checks, the
// copies and the sum, which is what makes both paths give the same bits.
//
// Experts are numbered 0..experts; rank r holds experts [r × L, (r + 1) × L), L = experts /
// ranks ("local experts"). A routing entry i = t × top_k + k names token t's k-th expert, or
// -1 (no expert: dropped). An entry outside [-1, experts), or one repeating an expert of its
// token, is bad: it is dropped, the token's combined output is NaN, and the first one is
// reported to the host (host-mapped words 1 and 2).
//
// Layouts, deterministic (every run and the all_to_all_v fallback give the same):
// * an entry's position among its expert's entries from this rank: the number of earlier
//   entries (lower i) naming the same expert;
// * the dispatch output of local expert le: packed rows, first those from rank 0 in position
//   order, then rank 1's, ...; `recv_counts[le]` of them.
// * combine: out[t] = sum over k in order of weight[t][k] × row(t, k), in f32, rounded once.
//
// Low-latency scheme over the LSA team's peer memory (decode: up to kMaxEntries entries a
// rank): dispatch stores each entry's token row straight into its expert owner's scratch slot
// [buf][le][source][position] with the entry number beside it; the last of a source's rows for
// an expert (found with a per-expert counter after a system fence) publishes the count as one
// 64-bit word (flag << 32 | count) with release; experts that get nothing from a source get a
// zero count. The owner waits for the counts of each (expert, source), then copies the rows
// out in the packed order. Buffers alternate by call parity: a rank's next-but-one dispatch
// writes a buffer only after every rank's next dispatch sent it counts, which each sent after
// finishing this one. Combine stores each packed row back into its source's slot [entry] and
// a 32-bit flag beside it after a system fence; the source waits for its entries' flags and
// sums, a warp a part of a token's row. One combine buffer: a rank's next combine writes only
// after the next dispatch, which each source starts after its combine ended. Flags and counts
// carry the call's number (never zero, which the scratch starts as); the last part of a token
// clears its combine flags (so a flag left from a much earlier call cannot match once the
// 31-bit numbers wrap), count words are all rewritten every second call, and the per-expert
// and per-token counters are reset by whoever finds itself last. A rank's acquire loads are
// followed by a barrier (warp or CTA) before other threads read the rows they announce: the
// barrier orders memory among its threads, so nothing more is needed.
//
// State, waits and give-up follow allreduce.cu: per-CTA call counts in device memory (CUDA
// graphs can replay the kernels), bounded waits, `timed_out` (which the host's stop also
// writes) ending every later kernel at once with NaN outputs, and the host-mapped words. After
// a give-up a dispatch's outputs are unspecified (its CTAs stop where they are); the combine
// that follows writes NaN over every token.
#include <nccl_device.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

constexpr int kMoeMaxCtas = 64;
// Routing entries (tokens × top_k) a rank sends per call at most: they sit in shared memory.
constexpr int kMaxEntries = 4096;
constexpr int kMaxExperts = 1024;
constexpr int kMaxRanks = 128;
// An entry's `routing` value when it was bad (dropped, its token's output NaN).
constexpr int kBad = -2;
// Sources' entry numbers share a word with the rank: entry < 2^20, rank < 2^12.
constexpr unsigned int kEntryBits = 20;
// Vectors of a token row one warp of the combine sums (4 a lane): a token's row is split
// into parts of this many, so that more warps than tokens share the reading.
constexpr unsigned int kPartVecs = 128;

// Mirrored by src/device/moe/layout.rs (checked against `nccl_rs_moe_layout` below).
struct MoeState {
  unsigned long long dispatch_calls[kMoeMaxCtas];
  unsigned long long combine_calls[kMoeMaxCtas];
  unsigned int timed_out;     // a kernel gave up, or the host stopped them
  unsigned int pad;
  unsigned int* host;         // host-mapped: [0] gave up, [1] first bad entry + 1, [2] its value,
                              // [kRowsTo + r] rows sent to rank r, [kRowsFrom + s] received
};
// Host-mapped words of the fallback's row counts (src/device/moe/layout.rs).
constexpr int kRowsTo = 4;
constexpr int kRowsFrom = kRowsTo + kMaxRanks;

// Scratch byte offsets and sizes, the same on every rank (src/device/moe/layout.rs).
struct Geometry {
  unsigned int ranks, experts, local_experts, top_k;
  unsigned int max_tokens, row_vecs;  // row_vecs: 16-byte vectors a token row holds
  unsigned long long rows_at;         // dispatch rows [2][L][ranks][max_tokens][row]
  unsigned long long meta_at;         // their entry numbers [2][L][ranks][max_tokens] u32
  unsigned long long counts_at;       // counts [2][L][ranks] u64
  unsigned long long back_at;         // combine rows [max_tokens × top_k][row]
  unsigned long long flags_at;        // combine flags [max_tokens × top_k] u32
};

// This rank's own device memory, kept from a dispatch for its combine.
struct Work {
  unsigned int* done;     // [experts] rows sent this call, per expert (zero between calls)
  int* routing;           // [max_tokens × top_k] the entries as sent (-1 dropped, kBad)
  unsigned int* totals;   // [L] rows each local expert received
  unsigned int* sources;  // [L][ranks × max_tokens] rank << kEntryBits | entry, packed order
  unsigned int* pairs;    // [ranks][L] rows from each rank per local expert (fallback)
  unsigned int* slots;    // [max_tokens × top_k] an entry's row in the send buffer (fallback)
  unsigned int* parts;    // [max_tokens] parts of a token summed this call (zero between calls)
};

extern "C" __device__ const unsigned long long nccl_rs_moe_layout[] = {
    sizeof(MoeState),
    offsetof(MoeState, dispatch_calls),
    offsetof(MoeState, combine_calls),
    offsetof(MoeState, timed_out),
    offsetof(MoeState, host),
    sizeof(Geometry),
    offsetof(Geometry, rows_at),
    offsetof(Geometry, flags_at),
    sizeof(Work),
    kMoeMaxCtas,
    kMaxEntries,
    kMaxExperts,
    kMaxRanks,
    kRowsTo,
    kRowsFrom,
};

template <typename T> struct Elem;
template <> struct Elem<float> {
  static constexpr uint32_t kNanWord = 0x7fc00000u;
  __device__ static float widen(float x) { return x; }
  __device__ static float narrow(float x) { return x; }
};
template <> struct Elem<__nv_bfloat16> {
  static constexpr uint32_t kNanWord = 0x7fc07fc0u;
  __device__ static float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 narrow(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Elem<__half> {
  static constexpr uint32_t kNanWord = 0x7e007e00u;
  __device__ static float widen(__half x) { return __half2float(x); }
  __device__ static __half narrow(float x) { return __float2half_rn(x); }
};

union Vec {
  uint4 v;
  uint32_t w[4];
  unsigned char b[16];
};

__device__ __forceinline__ Vec load_volatile(const void* p) {
  Vec x;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(x.w[0]), "=r"(x.w[1]), "=r"(x.w[2]), "=r"(x.w[3])
               : "l"(p)
               : "memory");
  return x;
}

__device__ __forceinline__ void store_volatile(void* p, const Vec& x) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(x.w[0]),
               "r"(x.w[1]), "r"(x.w[2]), "r"(x.w[3])
               : "memory");
}

// Copies vectors first, first + step, ... below `vecs` of `src` to `dst` (16-byte vectors),
// kBatch loads in flight before their stores (a copy is latency-bound otherwise: each store
// waits for its load). `kRemoteDst`: stores volatile (a peer's window); `kVolatileSrc`: loads
// volatile (rows peers wrote into this rank's window).
constexpr int kBatch = 4;
template <bool kVolatileSrc, bool kVolatileDst>
__device__ __forceinline__ void copy_vecs(char* dst, const char* src, size_t first, size_t step,
                                          size_t vecs) {
  for (size_t v0 = first; v0 < vecs; v0 += kBatch * step) {
    Vec x[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; b++) {
      const size_t v = v0 + b * step;
      if (v < vecs) {
        if (kVolatileSrc) {
          x[b] = load_volatile(src + v * 16);
        } else {
          x[b].v = *(const uint4*)(src + v * 16);
        }
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; b++) {
      const size_t v = v0 + b * step;
      if (v < vecs) {
        if (kVolatileDst) {
          store_volatile(dst + v * 16, x[b]);
        } else {
          *(uint4*)(dst + v * 16) = x[b].v;
        }
      }
    }
  }
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void give_up(MoeState* st) {
  atomicExch(&st->timed_out, 1u);
  unsigned int* host = *(unsigned int* volatile*)&st->host;
  if (host != nullptr) {
    *(volatile unsigned int*)host = 1u;
    __threadfence_system();
  }
}

// One thread's bounded wait (as allreduce.cu's).
struct Waiter {
  unsigned long long start = 0;
  unsigned int spins = 0;
  bool gave_up = false;
  __device__ __forceinline__ bool go_on(MoeState* st, unsigned long long timeout_ns) {
    if (gave_up) return false;
    if ((++spins & 1023u) == 0) {
      const unsigned long long t = now_ns();
      if (start == 0) start = t;
      if (t - start > timeout_ns || *(volatile unsigned int*)&st->timed_out) {
        give_up(st);
        gave_up = true;
        return false;
      }
    }
    return true;
  }
};

constexpr unsigned long long kFailed = ~0ull;

// This CTA's count of calls (kFailed once the instance gave up or was stopped), read by
// thread 0 and shared.
__device__ __forceinline__ unsigned long long begin_call(const MoeState* st,
                                                         const unsigned long long* calls) {
  __shared__ unsigned long long shared;
  if (threadIdx.x == 0) {
    const unsigned int failed = *(const volatile unsigned int*)&st->timed_out;
    shared = failed ? kFailed : calls[blockIdx.x];
  }
  __syncthreads();
  return shared;
}

// As allreduce.cu's end_call: CTA 0 also advances the counts past its grid.
__device__ __forceinline__ void end_call(unsigned long long* calls, unsigned long long call) {
  if (threadIdx.x == 0) calls[blockIdx.x] = call + 1;
  if (blockIdx.x == 0) {
    for (int b = gridDim.x + threadIdx.x; b < kMoeMaxCtas; b += blockDim.x) calls[b] = call + 1;
  }
}

// A call's flag: in [1, 2^31), never the scratch's initial zero.
__device__ __forceinline__ unsigned int flag_of(unsigned long long call) {
  return (unsigned int)(call % 0x7fffffffull) + 1u;
}

__device__ __forceinline__ unsigned int lane_id() { return threadIdx.x % 32; }
__device__ __forceinline__ unsigned int warp_id() { return threadIdx.x / 32; }
__device__ __forceinline__ unsigned int warps() { return blockDim.x / 32; }

// Loads the routing of `entries` entries into `idx` (shared), marks bad ones kBad, counts
// each expert's entries into `cnt` (shared, `experts` of them); every CTA computes the same.
// Returns the first bad entry + 1 (0: none) to every thread.
__device__ unsigned int load_routing(const int* topk, unsigned int entries, unsigned int top_k,
                                     unsigned int experts, int* idx, unsigned int* cnt) {
  __shared__ unsigned int first_bad;
  if (threadIdx.x == 0) first_bad = ~0u;
  for (unsigned int i = threadIdx.x; i < entries; i += blockDim.x) idx[i] = topk[i];
  for (unsigned int e = threadIdx.x; e < experts; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  // Bad: out of range, or repeating an earlier expert of the same token. Marked in a bitmap
  // first: the checks read the routing as given.
  __shared__ unsigned int bad_bits[kMaxEntries / 32];
  for (unsigned int i = threadIdx.x; i < kMaxEntries / 32; i += blockDim.x) bad_bits[i] = 0;
  __syncthreads();
  for (unsigned int i = threadIdx.x; i < entries; i += blockDim.x) {
    const int v = idx[i];
    bool b = v < -1 || v >= (int)experts;
    if (!b && v >= 0) {
      for (unsigned int j = i - i % top_k; j < i; j++) b |= idx[j] == v;
    }
    if (b) {
      atomicOr(&bad_bits[i / 32], 1u << (i % 32));
      atomicMin(&first_bad, i);
    }
  }
  __syncthreads();
  for (unsigned int i = threadIdx.x; i < entries; i += blockDim.x) {
    if (bad_bits[i / 32] & (1u << (i % 32))) idx[i] = kBad;
  }
  __syncthreads();
  for (unsigned int i = threadIdx.x; i < entries; i += blockDim.x) {
    if (idx[i] >= 0) atomicAdd(&cnt[idx[i]], 1u);
  }
  __syncthreads();
  return first_bad == ~0u ? 0 : first_bad + 1;
}

// Reports the first bad entry (CTA 0 only) and keeps the routing for the combine.
__device__ void keep_routing(const int* topk, const int* idx, unsigned int entries,
                             unsigned int bad, const Work& w, MoeState* st) {
  if (blockIdx.x != 0) return;
  for (unsigned int i = threadIdx.x; i < entries; i += blockDim.x) w.routing[i] = idx[i];
  if (bad != 0 && threadIdx.x == 0) {
    unsigned int* host = st->host;
    if (host != nullptr && *(volatile unsigned int*)&host[1] == 0) {
      *(volatile int*)&host[2] = topk[bad - 1];
      __threadfence_system();
      *(volatile unsigned int*)&host[1] = bad;
      __threadfence_system();
    }
  }
}

// The position of entry i among the entries naming its expert e (the earlier ones), by the
// whole warp.
__device__ __forceinline__ unsigned int position(const int* idx, unsigned int i, int e) {
  unsigned int pos = 0;
  for (unsigned int j0 = 0; j0 < i; j0 += 32) {
    const unsigned int j = j0 + lane_id();
    pos += __popc(__ballot_sync(0xffffffffu, j < i && idx[j] == e));
  }
  return pos;
}

__device__ __forceinline__ size_t disp_slot(const Geometry& g, unsigned int buf, unsigned int le,
                                            unsigned int src, unsigned int pos) {
  return (((size_t)buf * g.local_experts + le) * g.ranks + src) * g.max_tokens + pos;
}

__device__ __forceinline__ void poison_rows(uint4* out, size_t first_row, size_t rows,
                                            unsigned int row_vecs, uint32_t nan_word,
                                            size_t first, size_t step) {
  const uint4 nan = make_uint4(nan_word, nan_word, nan_word, nan_word);
  const size_t vecs = rows * row_vecs;
  for (size_t v = first; v < vecs; v += step) out[first_row * row_vecs + v] = nan;
}

// ---- Low-latency dispatch over the LSA team ------------------------------------------------
// A CTA's receiving side waits for counts that any CTA of any rank (this one's included)
// publishes, so every CTA of the grid must be resident at once: the host sizes the grid by
// the kernel's occupancy (for two ranks sharing the GPU).
__device__ void dispatch_lsa(const ncclDevComm* comm, ncclWindow_t scratch, const Geometry& g,
                             const Work& w, const uint4* x, const int* topk,
                             unsigned int tokens, uint4* recv_x, int* recv_counts,
                             MoeState* st, unsigned long long timeout_ns) {
  __shared__ int idx[kMaxEntries];
  __shared__ unsigned int cnt[kMaxExperts];
  __shared__ unsigned int from[kMaxRanks];
  const unsigned long long call = begin_call(st, st->dispatch_calls);
  const unsigned int L = g.local_experts, R = g.ranks;
  if (call == kFailed) {
    // No counts: nothing received (the instance refuses its later calls).
    for (unsigned int le = blockIdx.x * blockDim.x + threadIdx.x; le < L;
         le += gridDim.x * blockDim.x) {
      recv_counts[le] = 0;
      w.totals[le] = 0;
    }
    return;
  }
  const unsigned int me = comm->lsaRank, flag = flag_of(call), buf = (unsigned int)(call & 1);
  const unsigned int entries = tokens * g.top_k;
  const unsigned int bad = load_routing(topk, entries, g.top_k, g.experts, idx, cnt);
  keep_routing(topk, idx, entries, bad, w, st);
  const size_t row_bytes = (size_t)g.row_vecs * 16;

  // The zero counts: an expert this rank sends nothing to still hears from it.
  for (unsigned int e = blockIdx.x * blockDim.x + threadIdx.x; e < g.experts;
       e += gridDim.x * blockDim.x) {
    if (cnt[e] != 0) continue;
    const unsigned int r = e / L, le = e % L;
    const size_t at = g.counts_at + (((size_t)buf * L + le) * R + me) * 8;
    cuda::atomic_ref<unsigned long long, cuda::thread_scope_system> word(
        *(unsigned long long*)ncclGetLsaPointer(scratch, at, r));
    word.store((unsigned long long)flag << 32, cuda::memory_order_release);
  }

  // The rows: a warp an entry.
  const unsigned int gw = blockIdx.x * warps() + warp_id(), all_warps = gridDim.x * warps();
  for (unsigned int i = gw; i < entries; i += all_warps) {
    const int e = idx[i];
    if (e < 0) continue;  // alike for the whole warp
    const unsigned int pos = position(idx, i, e);
    const unsigned int r = (unsigned int)e / L, le = (unsigned int)e % L, t = i / g.top_k;
    const size_t slot = disp_slot(g, buf, le, me, pos);
    char* row = (char*)ncclGetLsaPointer(scratch, g.rows_at + slot * row_bytes, r);
    copy_vecs<false, true>(row, (const char*)(x + (size_t)t * g.row_vecs), lane_id(), 32,
                           g.row_vecs);
    if (lane_id() == 0) {
      *(volatile unsigned int*)ncclGetLsaPointer(scratch, g.meta_at + slot * 4, r) = i;
    }
    __syncwarp();
    if (lane_id() == 0) {
      // Every row of the warp before the count, and every earlier warp's (their fences
      // before their increments) before the last one's count.
      __threadfence_system();
      const unsigned int sent = atomicAdd(&w.done[e], 1u) + 1;
      if (sent == cnt[e]) {
        __threadfence_system();
        w.done[e] = 0;
        const size_t at = g.counts_at + (((size_t)buf * L + le) * R + me) * 8;
        cuda::atomic_ref<unsigned long long, cuda::thread_scope_system> word(
            *(unsigned long long*)ncclGetLsaPointer(scratch, at, r));
        word.store(((unsigned long long)flag << 32) | cnt[e], cuda::memory_order_release);
      }
    }
  }

  // The receiving side: CTA b takes (local expert, source) pairs b, b + grid, ...
  const char* local = (const char*)ncclGetLocalPointer(scratch, 0);
  Waiter waiter;
  bool failed = false;
  for (unsigned int p = blockIdx.x; p < L * R; p += gridDim.x) {
    const unsigned int le = p / R, s = p % R;
    bool ok = true;
    // Counts from sources 0..s (the offset needs those before s).
    for (unsigned int q = threadIdx.x; q <= s; q += blockDim.x) {
      cuda::atomic_ref<const unsigned long long, cuda::thread_scope_system> word(
          *(const unsigned long long*)(local + g.counts_at + (((size_t)buf * L + le) * R + q) * 8));
      unsigned long long c = word.load(cuda::memory_order_acquire);
      while ((unsigned int)(c >> 32) != flag) {
        if (!waiter.go_on(st, timeout_ns)) {
          ok = false;
          break;
        }
        c = word.load(cuda::memory_order_acquire);
      }
      from[q] = ok ? (unsigned int)c : 0;
      if (!ok) break;
    }
    if (!__syncthreads_and(ok)) {
      failed = true;
      break;
    }
    unsigned int offset = 0;
    for (unsigned int q = 0; q < s; q++) offset += from[q];
    const unsigned int count = from[s];
    const size_t packed = (size_t)le * R * g.max_tokens + offset;
    // The pair's rows are consecutive slots, copied to consecutive packed rows: one copy of
    // count rows by the whole CTA.
    const size_t slot0 = disp_slot(g, buf, le, s, 0);
    copy_vecs<true, false>((char*)(recv_x + packed * g.row_vecs),
                           local + g.rows_at + slot0 * row_bytes, threadIdx.x, blockDim.x,
                           (size_t)count * g.row_vecs);
    for (unsigned int pos = threadIdx.x; pos < count; pos += blockDim.x) {
      const unsigned int entry =
          *(const volatile unsigned int*)(local + g.meta_at + (slot0 + pos) * 4);
      w.sources[packed + pos] = (s << kEntryBits) | entry;
    }
    if (s == R - 1 && threadIdx.x == 0) {
      recv_counts[le] = (int)(offset + count);
      w.totals[le] = offset + count;
    }
    __syncthreads();  // `from` is read before the next pair overwrites it
  }
  if (failed) {
    for (unsigned int p = blockIdx.x; p < L * R; p += gridDim.x) {
      if (p % R == R - 1 && threadIdx.x == 0) {
        recv_counts[p / R] = 0;
        w.totals[p / R] = 0;
      }
    }
  }
  end_call(st->dispatch_calls, call);
}

// out[t] = sum over k in order of weight × row(t, k) for this lane's vectors in [from, to);
// `row(k)` gives entry t × top_k + k's row (nullptr: dropped). NaN where any entry was bad.
template <typename T, typename RowOf>
__device__ __forceinline__ void combine_token(T* out, const float* weights, const int* routing,
                                              unsigned int t, const Geometry& g, unsigned int from,
                                              unsigned int to, RowOf row_of) {
  constexpr int n = 16 / sizeof(T);
  bool nan = false;
  for (unsigned int k = 0; k < g.top_k; k++) nan |= routing[t * g.top_k + k] == kBad;
  uint4* dst = (uint4*)(out + (size_t)t * g.row_vecs * n);
  for (unsigned int v = from + lane_id(); v < to; v += 32) {
    Vec o;
    if (nan) {
      o.v = make_uint4(Elem<T>::kNanWord, Elem<T>::kNanWord, Elem<T>::kNanWord,
                       Elem<T>::kNanWord);
    } else {
      float acc[n];
#pragma unroll
      for (int j = 0; j < n; j++) acc[j] = 0.f;
      // kBatch rows' vectors loaded at once, then summed in k order.
      for (unsigned int k0 = 0; k0 < g.top_k; k0 += kBatch) {
        Vec x[kBatch];
        float weight[kBatch];
        bool used[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; b++) {
          const unsigned int k = k0 + b;
          const char* row = k < g.top_k ? row_of(k) : nullptr;
          used[b] = row != nullptr;
          if (used[b]) {
            weight[b] = weights[t * g.top_k + k];
            x[b] = load_volatile(row + (size_t)v * 16);
          }
        }
#pragma unroll
        for (int b = 0; b < kBatch; b++) {
          if (!used[b]) continue;
#pragma unroll
          for (int j = 0; j < n; j++) {
            T e;
            memcpy(&e, x[b].b + j * sizeof(T), sizeof(T));
            acc[j] = __fmaf_rn(weight[b], Elem<T>::widen(e), acc[j]);
          }
        }
      }
#pragma unroll
      for (int j = 0; j < n; j++) {
        T e = Elem<T>::narrow(acc[j]);
        memcpy(o.b + j * sizeof(T), &e, sizeof(T));
      }
    }
    dst[v] = o.v;
  }
}

// ---- Low-latency combine over the LSA team -------------------------------------------------
template <typename T>
__device__ void combine_lsa(const ncclDevComm* comm, ncclWindow_t scratch, const Geometry& g,
                            const Work& w, const uint4* expert_out, const float* weights,
                            T* out, unsigned int tokens, MoeState* st,
                            unsigned long long timeout_ns) {
  const unsigned long long call = begin_call(st, st->combine_calls);
  const unsigned int gw = blockIdx.x * warps() + warp_id(), all_warps = gridDim.x * warps();
  const uint32_t nan_word = Elem<T>::kNanWord;
  if (call == kFailed) {
    poison_rows((uint4*)out, 0, tokens, g.row_vecs, nan_word,
                (size_t)blockIdx.x * blockDim.x + threadIdx.x, (size_t)gridDim.x * blockDim.x);
    return;
  }
  const unsigned int flag = flag_of(call), R = g.ranks;
  const size_t row_bytes = (size_t)g.row_vecs * 16;
  // Every packed row back to its source's slot of its entry, then the entry's flag: the rows
  // of all local experts numbered in one run (`before[le]`: rows of the experts before le),
  // a warp a row, so every warp of the grid sends, however few rows each expert has.
  __shared__ unsigned int before[kMaxExperts + 1];
  if (warp_id() == 0) {
    // A warp's scan, 32 experts a step (their totals loaded together).
    unsigned int carry = 0;
    for (unsigned int base = 0; base < g.local_experts; base += 32) {
      const unsigned int le = base + lane_id();
      const unsigned int mine = le < g.local_experts ? w.totals[le] : 0;
      unsigned int sum = mine;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned int up = __shfl_up_sync(0xffffffffu, sum, o);
        if (lane_id() >= (unsigned int)o) sum += up;
      }
      if (le < g.local_experts) before[le] = carry + sum - mine;
      carry += __shfl_sync(0xffffffffu, sum, 31);
    }
    if (lane_id() == 0) before[g.local_experts] = carry;
  }
  __syncthreads();
  const unsigned int rows = before[g.local_experts];
  for (unsigned int f = gw; f < rows; f += all_warps) {
    // The expert holding flat row f: the last le with before[le] <= f.
    unsigned int lo = 0, hi = g.local_experts;
    while (hi - lo > 1) {
      const unsigned int mid = (lo + hi) / 2;
      if (before[mid] <= f) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    const size_t packed = (size_t)lo * R * g.max_tokens + (f - before[lo]);
    const unsigned int source = w.sources[packed];
    const unsigned int s = source >> kEntryBits, entry = source & ((1u << kEntryBits) - 1);
    char* row = (char*)ncclGetLsaPointer(scratch, g.back_at + entry * row_bytes, s);
    copy_vecs<false, true>(row, (const char*)(expert_out + packed * g.row_vecs), lane_id(), 32,
                           g.row_vecs);
    __syncwarp();
    if (lane_id() == 0) {
      __threadfence_system();
      *(volatile unsigned int*)ncclGetLsaPointer(scratch, g.flags_at + entry * 4, s) = flag;
    }
  }
  // This rank's tokens, in parts of kPartVecs vectors (a warp a part), each once every
  // entry's row is in; the last part of a token to finish clears its flags.
  const char* local = (const char*)ncclGetLocalPointer(scratch, 0);
  const unsigned int parts = (g.row_vecs + kPartVecs - 1) / kPartVecs;
  Waiter waiter;
  for (unsigned int u = gw; u < tokens * parts; u += all_warps) {
    const unsigned int t = u / parts, from = (u % parts) * kPartVecs;
    const unsigned int to = min(from + kPartVecs, g.row_vecs);
    bool ok = true;
    for (unsigned int k = lane_id(); k < g.top_k; k += 32) {
      const unsigned int entry = t * g.top_k + k;
      if (w.routing[entry] < 0) continue;
      cuda::atomic_ref<const unsigned int, cuda::thread_scope_system> at(
          *(const unsigned int*)(local + g.flags_at + entry * 4));
      while (at.load(cuda::memory_order_acquire) != flag) {
        if (!waiter.go_on(st, timeout_ns)) {
          ok = false;
          break;
        }
      }
    }
    // The lanes' acquires ordered before every lane's row reads (the warp barrier orders
    // memory among its threads).
    __syncwarp();
    if (!__all_sync(0xffffffffu, ok)) {
      const uint4 nan = make_uint4(nan_word, nan_word, nan_word, nan_word);
      for (unsigned int v = from + lane_id(); v < to; v += 32) {
        ((uint4*)out)[(size_t)t * g.row_vecs + v] = nan;
      }
      continue;
    }
    combine_token<T>(out, weights, w.routing, t, g, from, to, [&](unsigned int k) -> const char* {
      const unsigned int entry = t * g.top_k + k;
      return w.routing[entry] < 0 ? nullptr : local + g.back_at + entry * row_bytes;
    });
    // Consumed: the last part clears the token's flags, so that a flag never matches a much
    // later call's number (they wrap after 2^31 - 1 calls). No peer writes the slots again
    // before this rank's next dispatch.
    __syncwarp();
    unsigned int last = 0;
    if (lane_id() == 0) last = atomicAdd(&w.parts[t], 1u) + 1 == parts;
    if (__shfl_sync(0xffffffffu, last, 0)) {
      for (unsigned int k = lane_id(); k < g.top_k; k += 32) {
        const unsigned int entry = t * g.top_k + k;
        if (w.routing[entry] >= 0) *(volatile unsigned int*)(local + g.flags_at + entry * 4) = 0;
      }
      if (lane_id() == 0) w.parts[t] = 0;
    }
  }
  end_call(st->combine_calls, call);
}

// ---- The all_to_all_v fallback's local steps (no peer memory) ------------------------------
// pack: this rank's rows into `send` ordered by expert then position (so by destination rank,
// as the all_to_all_v sends them), their entry numbers into `send_meta`, each expert's count
// into `counts` [experts], each entry's row into w.slots.
__device__ void pack(const Geometry& g, const Work& w, const uint4* x, const int* topk,
                     unsigned int tokens, uint4* send, unsigned int* send_meta,
                     unsigned int* counts, MoeState* st) {
  __shared__ int idx[kMaxEntries];
  __shared__ unsigned int cnt[kMaxExperts];
  __shared__ unsigned int before[kMaxExperts];
  const unsigned int entries = tokens * g.top_k;
  const unsigned int bad = load_routing(topk, entries, g.top_k, g.experts, idx, cnt);
  keep_routing(topk, idx, entries, bad, w, st);
  if (threadIdx.x == 0) {
    unsigned int sum = 0;
    for (unsigned int e = 0; e < g.experts; e++) {
      before[e] = sum;
      sum += cnt[e];
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (unsigned int e = threadIdx.x; e < g.experts; e += blockDim.x) counts[e] = cnt[e];
    // Rows to each rank, for the host (which sizes the all_to_all_v by them).
    unsigned int* host = st->host;
    for (unsigned int r = threadIdx.x; r < g.ranks && host != nullptr; r += blockDim.x) {
      unsigned int rows = 0;
      for (unsigned int le = 0; le < g.local_experts; le++) rows += cnt[r * g.local_experts + le];
      *(volatile unsigned int*)&host[kRowsTo + r] = rows;
    }
    __threadfence_system();
  }
  const unsigned int gw = blockIdx.x * warps() + warp_id(), all_warps = gridDim.x * warps();
  for (unsigned int i = gw; i < entries; i += all_warps) {
    const int e = idx[i];
    if (e < 0) continue;
    const unsigned int at = before[e] + position(idx, i, e);
    copy_vecs<false, false>((char*)(send + (size_t)at * g.row_vecs),
                            (const char*)(x + (size_t)(i / g.top_k) * g.row_vecs), lane_id(), 32,
                            g.row_vecs);
    if (lane_id() == 0) {
      send_meta[at] = i;
      w.slots[i] = at;
    }
  }
}

// count_rows: rows received from each rank (the counts' all-to-all left in `pairs`), for the
// host.
__device__ void count_rows(const Geometry& g, const unsigned int* pairs, MoeState* st) {
  unsigned int* host = st->host;
  if (blockIdx.x != 0 || host == nullptr) return;
  for (unsigned int s = threadIdx.x; s < g.ranks; s += blockDim.x) {
    unsigned int rows = 0;
    for (unsigned int le = 0; le < g.local_experts; le++) rows += pairs[s * g.local_experts + le];
    *(volatile unsigned int*)&host[kRowsFrom + s] = rows;
  }
  __threadfence_system();
}

// unpack: rows received from every rank ([source][local expert][position], `pairs` counts
// [ranks][L] as the all_to_all of counts delivered them) into the packed output.
__device__ void unpack(const Geometry& g, const Work& w, const uint4* recv,
                       const unsigned int* recv_meta, const unsigned int* pairs,
                       uint4* recv_x, int* recv_counts) {
  __shared__ unsigned int source_at[kMaxRanks];
  const unsigned int L = g.local_experts, R = g.ranks;
  if (threadIdx.x == 0) {
    unsigned int sum = 0;
    for (unsigned int s = 0; s < R; s++) {
      source_at[s] = sum;
      for (unsigned int le = 0; le < L; le++) sum += pairs[s * L + le];
    }
  }
  __syncthreads();
  if (blockIdx.x == 0) {
    for (unsigned int i = threadIdx.x; i < R * L; i += blockDim.x) w.pairs[i] = pairs[i];
    for (unsigned int le = threadIdx.x; le < L; le += blockDim.x) {
      unsigned int total = 0;
      for (unsigned int s = 0; s < R; s++) total += pairs[s * L + le];
      recv_counts[le] = (int)total;
      w.totals[le] = total;
    }
  }
  // CTA b takes pairs (le, s) b, b + grid, ... as the LSA kernel does.
  for (unsigned int p = blockIdx.x; p < L * R; p += gridDim.x) {
    const unsigned int le = p / R, s = p % R;
    unsigned int offset = 0, in_source = source_at[s];
    for (unsigned int q = 0; q < s; q++) offset += pairs[q * L + le];
    for (unsigned int l = 0; l < le; l++) in_source += pairs[s * L + l];
    const unsigned int count = pairs[s * L + le];
    const size_t packed = (size_t)le * R * g.max_tokens + offset;
    for (unsigned int pos = warp_id(); pos < count; pos += warps()) {
      copy_vecs<false, false>((char*)(recv_x + (packed + pos) * g.row_vecs),
                              (const char*)(recv + (size_t)(in_source + pos) * g.row_vecs),
                              lane_id(), 32, g.row_vecs);
      if (lane_id() == 0) {
        w.sources[packed + pos] = (s << kEntryBits) | recv_meta[in_source + pos];
      }
    }
  }
}

// pack_back: the experts' packed outputs into `back` in the order unpack read them
// ([source][local expert][position]), for the all_to_all_v that returns them.
__device__ void pack_back(const Geometry& g, const Work& w, const uint4* expert_out,
                          uint4* back) {
  const unsigned int L = g.local_experts, R = g.ranks;
  for (unsigned int p = blockIdx.x; p < L * R; p += gridDim.x) {
    const unsigned int le = p / R, s = p % R;
    unsigned int offset = 0, in_source = 0;
    for (unsigned int q = 0; q < s; q++) offset += w.pairs[q * L + le];
    for (unsigned int q = 0; q < s; q++) {
      for (unsigned int l = 0; l < L; l++) in_source += w.pairs[q * L + l];
    }
    for (unsigned int l = 0; l < le; l++) in_source += w.pairs[s * L + l];
    const unsigned int count = w.pairs[s * L + le];
    const size_t packed = (size_t)le * R * g.max_tokens + offset;
    for (unsigned int pos = warp_id(); pos < count; pos += warps()) {
      copy_vecs<false, false>((char*)(back + (size_t)(in_source + pos) * g.row_vecs),
                              (const char*)(expert_out + (packed + pos) * g.row_vecs), lane_id(),
                              32, g.row_vecs);
    }
  }
}

// reduce: the combine's sum from rows returned in this rank's send order (w.slots).
template <typename T>
__device__ void reduce(const Geometry& g, const Work& w, const uint4* returned,
                       const float* weights, T* out, unsigned int tokens) {
  const unsigned int gw = blockIdx.x * warps() + warp_id(), all_warps = gridDim.x * warps();
  const size_t row_bytes = (size_t)g.row_vecs * 16;
  for (unsigned int t = gw; t < tokens; t += all_warps) {
    combine_token<T>(out, weights, w.routing, t, g, 0, g.row_vecs, [&](unsigned int k) -> const char* {
      const unsigned int entry = t * g.top_k + k;
      return w.routing[entry] < 0 ? nullptr
                                  : (const char*)returned + (size_t)w.slots[entry] * row_bytes;
    });
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(512) nccl_rs_moe_dispatch(
    const ncclDevComm* comm, ncclWindow_t scratch, Geometry g, Work w, const uint4* x,
    const int* topk, unsigned int tokens, uint4* recv_x, int* recv_counts, MoeState* st,
    unsigned long long timeout_ns) {
  dispatch_lsa(comm, scratch, g, w, x, topk, tokens, recv_x, recv_counts, st, timeout_ns);
}

extern "C" __global__ void __launch_bounds__(512) nccl_rs_moe_pack(
    Geometry g, Work w, const uint4* x, const int* topk, unsigned int tokens, uint4* send,
    unsigned int* send_meta, unsigned int* counts, MoeState* st) {
  pack(g, w, x, topk, tokens, send, send_meta, counts, st);
}

extern "C" __global__ void __launch_bounds__(512) nccl_rs_moe_count_rows(
    Geometry g, const unsigned int* pairs, MoeState* st) {
  count_rows(g, pairs, st);
}

extern "C" __global__ void __launch_bounds__(512) nccl_rs_moe_unpack(
    Geometry g, Work w, const uint4* recv, const unsigned int* recv_meta,
    const unsigned int* pairs, uint4* recv_x, int* recv_counts) {
  unpack(g, w, recv, recv_meta, pairs, recv_x, recv_counts);
}

extern "C" __global__ void __launch_bounds__(512) nccl_rs_moe_pack_back(
    Geometry g, Work w, const uint4* expert_out, uint4* back) {
  pack_back(g, w, expert_out, back);
}

#define NCCL_RS_MOE(NAME, T)                                                                  \
  extern "C" __global__ void __launch_bounds__(512) nccl_rs_moe_combine_##NAME(               \
      const ncclDevComm* comm, ncclWindow_t scratch, Geometry g, Work w,                      \
      const uint4* expert_out, const float* weights, T* out, unsigned int tokens,             \
      MoeState* st, unsigned long long timeout_ns) {                                          \
    combine_lsa<T>(comm, scratch, g, w, expert_out, weights, out, tokens, st, timeout_ns);    \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(512) nccl_rs_moe_reduce_##NAME(                \
      Geometry g, Work w, const uint4* returned, const float* weights, T* out,                \
      unsigned int tokens) {                                                                  \
    reduce<T>(g, w, returned, weights, out, tokens);                                          \
  }

NCCL_RS_MOE(f32, float)
NCCL_RS_MOE(bf16, __nv_bfloat16)
NCCL_RS_MOE(f16, __half)
