// The all-reduce kernels nccl-rs ships (src/device/shipped/mod.rs): sum over the ranks of one
// LSA team, f32/bf16/f16, accumulated in f32 in rank order, so every rank gets the same bits;
// and the tensor-parallel epilogue (all-reduce, residual add, RMSNorm) fused into one kernel.
// Compiled ahead of time by generate.sh against NCCL 2.29.2's headers (the oldest versioned
// device ABI; LSA code runs on every later library). Peers never touch the caller's buffers:
// each rank copies its input into its own scratch window, and peers read or receive only that.
// One file past 600 lines: nvcc builds it as one module, and every kernel shares the State,
// the vector helpers and the bounded waits.
//
// Two schemes:
// * one-shot "flags" (Lamport): a rank stores its input straight into every peer's scratch
//   slot; a receiver spins on its own slots until no element holds the sentinel (negative
//   zero, which inputs never carry: it is written as +0, which sums the same). Three buffers
//   rotate by call: a call clears the buffer of the call before it, which no peer can write
//   again before it has this rank's data of the call after. No barrier at all.
// * two-shot "flags": rank j reduces chunk j of the message (a 1/ranks share): every rank
//   stores its chunk j into rank j's slot (reduce-scatter), rank j waits for its slots, sums
//   them and stores the sum into every rank's slot j past the chunk (all-gather), where the
//   others wait for it. The one-shot's buffers, rotation and clearing; a rank moves its
//   message twice instead of once per peer, at the cost of a second wait.
// * all-gather "LL": a rank stores its input into every peer's slot in NCCL's LL format, 8
//   bytes of data and two 4-byte flags (the call's number) in each 16-byte line, so any bits
//   travel exactly (a negative zero too) and a receiver waits for the flags, not a sentinel.
//   A call of the flags rotation: its buffer is cleared to sentinels (never a valid flag)
//   by the next call, like any other's.
// * one-shot "barrier": a rank copies its input into its scratch slot, meets its peers at a
//   barrier (CTA b of every rank at barrier b: flags in each rank's scratch, NCCL's LSA
//   barrier's scheme with a timeout), and reads every peer's slot. Two buffers alternate by
//   call, so no second barrier is needed: a rank writes a buffer again only after its peers'
//   kernels of the call in between started, so they finished this one.
//
// A scratch window serves one element type (the sentinel is the type's negative zero).
// Every kernel runs the same grid on every rank (a function of the count only: the host
// computes it), keeps its call counters in a small State in device memory (so CUDA graphs can
// replay it), and gives up waiting after `timeout_ns` instead of spinning forever when a peer
// never comes: it sets State::timed_out (every later kernel of the instance then returns at
// once, pushing nothing, so its peers give up too instead of reading another call's data)
// and the host-mapped word State::gave_up (the host refuses further launches without
// waiting for the GPU).
#include <nccl_device.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stddef.h>
#include <stdint.h>

namespace {

// The row-split norm's exchange: a row's sum of squares is the sum of its 32-vector chunks'
// sums (at most kMaxChunks), which the CTAs splitting the row publish here.
constexpr int kMaxChunks = 64;
// Rows a split norm call normalises at once (its 16 CTAs in groups of two or more).
constexpr int kMaxSplitRows = 8;
// CTAs of a flags call (one- and two-shot, all-gather, fused) and of a barrier call at most:
// FLAGS_MAX_CTAS and MAX_CTAS in mod.rs.
constexpr int kFlagsMaxCtas = 64;
constexpr int kBarrierMaxCtas = 16;

// Mirrored by KernelState in src/device/all_reduce/state.rs (zero at creation but the
// partials, sentinels, and `gave_up`), which its tests check against
// nccl_rs_allreduce_state_layout below. Each CTA keeps its own count of the calls made (every
// count of an array equal between calls: CTA 0 also advances those past its grid), so no CTA
// waits for another's to start or finish a call.
struct State {
  unsigned long long unused0[2];
  unsigned long long flags_bytes[3];     // bytes per slot the flags call that used buffer i wrote
  unsigned long long unused1;
  unsigned int timed_out;                // a kernel of this instance gave up waiting
  unsigned int pad;
  unsigned int* gave_up;                 // host-mapped: set with timed_out, read by the host
  unsigned long long partial_floats[3];  // partials the flags call that used buffer i wrote
  unsigned long long unused2;
  unsigned long long flags_calls[kFlagsMaxCtas];
  unsigned long long barrier_calls[kBarrierMaxCtas];
  float partials[3][kMaxSplitRows * kMaxChunks];  // sentinels (-0) until written
};

template <typename T> struct Elem;
template <> struct Elem<float> {
  static constexpr int kWidth = 4;
  static constexpr uint32_t kSentinelWord = 0x80000000u;
  static constexpr uint32_t kNanWord = 0x7fc00000u;
  __device__ static float widen(float x) { return x; }
  __device__ static float narrow(float x) { return x; }
};
template <> struct Elem<__nv_bfloat16> {
  static constexpr int kWidth = 2;
  static constexpr uint32_t kSentinelWord = 0x80008000u;
  static constexpr uint32_t kNanWord = 0x7fc07fc0u;
  __device__ static float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 narrow(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Elem<__half> {
  static constexpr int kWidth = 2;
  static constexpr uint32_t kSentinelWord = 0x80008000u;
  static constexpr uint32_t kNanWord = 0x7e007e00u;
  __device__ static float widen(__half x) { return __half2float(x); }
  __device__ static __half narrow(float x) { return __float2half_rn(x); }
};

union Vec {
  uint4 v;
  uint32_t w[4];
  unsigned char b[16];
};

template <typename T> __device__ __forceinline__ bool holds_sentinel(const Vec& x) {
  bool hit = false;
#pragma unroll
  for (int i = 0; i < 4; i++) {
    if (Elem<T>::kWidth == 4) {
      hit |= x.w[i] == 0x80000000u;
    } else {
      hit |= (x.w[i] & 0xffffu) == 0x8000u || (x.w[i] >> 16) == 0x8000u;
    }
  }
  return hit;
}

// Negative zero (the sentinel) becomes +0: the same in any sum.
template <typename T> __device__ __forceinline__ void scrub(Vec& x) {
#pragma unroll
  for (int i = 0; i < 4; i++) {
    if (Elem<T>::kWidth == 4) {
      if (x.w[i] == 0x80000000u) x.w[i] = 0;
    } else {
      uint32_t lo = x.w[i] & 0xffffu, hi = x.w[i] >> 16;
      if (lo == 0x8000u) lo = 0;
      if (hi == 0x8000u) hi = 0;
      x.w[i] = lo | (hi << 16);
    }
  }
}

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

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Gives up: every later kernel of this instance returns at once, and the host hears of it.
__device__ __forceinline__ void give_up(State* st) {
  atomicExch(&st->timed_out, 1u);
  unsigned int* host = *(unsigned int* volatile*)&st->gave_up;
  if (host != nullptr) {
    *(volatile unsigned int*)host = 1u;
    __threadfence_system();
  }
}

// One thread's wait: true while it may go on spinning; false once `timeout_ns` has passed
// since its first check, or another thread of the instance gave up.
struct Waiter {
  unsigned long long start = 0;
  unsigned int spins = 0;
  bool gave_up = false;
  __device__ __forceinline__ bool go_on(State* st, unsigned long long timeout_ns) {
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

// The call number begin_call gives when an earlier kernel of the instance gave up.
constexpr unsigned long long kFailed = ~0ull;

// What a CTA reads of the state as its call starts: read once by thread 0, every load issued
// before any is used, and shared, so every thread of the CTA leaves together.
struct CallStart {
  unsigned long long call;  // this CTA's count of calls, or kFailed
  size_t prev_bytes;        // flags calls: bytes a slot the previous call wrote
  size_t prev_partials;     // flags calls: norm partials the previous call wrote
};

// (A reference to shared memory, which keeps it to the end: nothing held in registers over
// the waits.)
__device__ __forceinline__ const CallStart& begin_call(const State* st,
                                                       const unsigned long long* calls) {
  __shared__ CallStart shared;
  if (threadIdx.x == 0) {
    const unsigned int failed = *(const volatile unsigned int*)&st->timed_out;
    const unsigned long long call = calls[blockIdx.x];
    // All three entries at once, not only [prev] (which needs `call` first): the [buf] ones,
    // which CTA 0 of this call may be writing at its end, are read volatile and discarded.
    const volatile unsigned long long* bytes = st->flags_bytes;
    const volatile unsigned long long* partials = st->partial_floats;
    const unsigned long long b0 = bytes[0], b1 = bytes[1], b2 = bytes[2];
    const unsigned long long p0 = partials[0], p1 = partials[1], p2 = partials[2];
    const int prev = (int)((call + 2) % 3);
    shared.call = failed ? kFailed : call;
    shared.prev_bytes = prev == 0 ? b0 : prev == 1 ? b1 : b2;
    shared.prev_partials = prev == 0 ? p0 : prev == 1 ? p1 : p2;
  }
  __syncthreads();
  return shared;
}

// Sets this CTA's count of calls past `call`; CTA 0 also the counts of the CTAs past the
// grid, so every count agrees at the next call whatever its grid. Only later kernels read
// them. (Stores alone: a load here would hold the kernel's end for a round trip.)
__device__ __forceinline__ void end_call(unsigned long long* calls, unsigned long long call,
                                         int max_ctas) {
  if (threadIdx.x == 0) calls[blockIdx.x] = call + 1;
  if (blockIdx.x == 0) {
    for (int b = gridDim.x + threadIdx.x; b < max_ctas; b += blockDim.x) calls[b] = call + 1;
  }
}

// Vector `v` (16 bytes) of `in`, zero past `count`; element-wise where `in` is not aligned.
template <typename T>
__device__ __forceinline__ Vec load_input(const T* in, size_t v, size_t count, bool aligned) {
  constexpr int n = 16 / sizeof(T);
  const size_t first = v * n;
  Vec x;
  if (aligned && first + n <= count) {
    x.v = *(const uint4*)(in + first);
    return x;
  }
  x.v = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int i = 0; i < n; i++) {
    if (first + i < count) {
      T e = in[first + i];
      memcpy(x.b + i * sizeof(T), &e, sizeof(T));
    }
  }
  return x;
}

template <typename T> __device__ __forceinline__ void accumulate(float (&acc)[16 / sizeof(T)], const Vec& x) {
  constexpr int n = 16 / sizeof(T);
#pragma unroll
  for (int i = 0; i < n; i++) {
    T e;
    memcpy(&e, x.b + i * sizeof(T), sizeof(T));
    acc[i] += Elem<T>::widen(e);
  }
}

template <typename T>
__device__ __forceinline__ void store_output(T* out, size_t v, size_t count, bool aligned,
                                             const float (&acc)[16 / sizeof(T)]) {
  constexpr int n = 16 / sizeof(T);
  const size_t first = v * n;
  Vec x;
#pragma unroll
  for (int i = 0; i < n; i++) {
    T e = Elem<T>::narrow(acc[i]);
    memcpy(x.b + i * sizeof(T), &e, sizeof(T));
  }
  if (aligned && first + n <= count) {
    *(uint4*)(out + first) = x.v;
    return;
  }
#pragma unroll
  for (int i = 0; i < n; i++) {
    if (first + i < count) memcpy(out + first + i, x.b + i * sizeof(T), sizeof(T));
  }
}

// Vector `v` of `x` into `out`, element-wise where `out` is not aligned or past `count`.
template <typename T>
__device__ __forceinline__ void store_vec(T* out, size_t v, size_t count, bool aligned,
                                          const Vec& x) {
  constexpr int n = 16 / sizeof(T);
  const size_t first = v * n;
  if (aligned && first + n <= count) {
    *(uint4*)(out + first) = x.v;
    return;
  }
#pragma unroll
  for (int i = 0; i < n; i++) {
    if (first + i < count) memcpy(out + first + i, x.b + i * sizeof(T), sizeof(T));
  }
}

// A call that fails (it gave up waiting, or an earlier kernel of the instance did) writes
// quiet NaN over every output element it would have written and has not, so an output is
// never left holding stale memory: vectors first, first + step, ... of `out` below `vecs`.
template <typename T>
__device__ __forceinline__ void poison(T* out, size_t first, size_t step, size_t vecs,
                                       size_t count, bool aligned) {
  Vec x;
  x.v = make_uint4(Elem<T>::kNanWord, Elem<T>::kNanWord, Elem<T>::kNanWord, Elem<T>::kNanWord);
  for (size_t v = first; v < vecs; v += step) store_vec(out, v, count, aligned, x);
}

// Scratch layout (bytes, per rank): flags buffers [3][lsaSize][slot], barrier buffers
// [2][slot], then the barrier inboxes [16 CTAs][lsaSize] of 4 bytes.

// The sum of every peer's vector `v` of the local flags buffer `buf`, each waited for until
// it holds no sentinel; false if the wait gave up.
template <typename T>
__device__ __forceinline__ bool pull(float (&acc)[16 / sizeof(T)], const char* local, int buf,
                                     int peers, size_t slot, size_t v, Waiter& waiter, State* st,
                                     unsigned long long timeout_ns) {
#pragma unroll
  for (int i = 0; i < 16 / (int)sizeof(T); i++) acc[i] = 0.f;
  // kBatch peers' slots loaded at once (one memory round trip for them, not one each), then
  // each awaited and summed in rank order.
  constexpr int kBatch = 4;
  for (int p0 = 0; p0 < peers; p0 += kBatch) {
    Vec x[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; j++) {
      if (p0 + j < peers) x[j] = load_volatile(local + ((size_t)buf * peers + p0 + j) * slot + v * 16);
    }
#pragma unroll
    for (int j = 0; j < kBatch; j++) {
      if (p0 + j < peers) {
        const char* at = local + ((size_t)buf * peers + p0 + j) * slot + v * 16;
        while (holds_sentinel<T>(x[j])) {
          if (!waiter.go_on(st, timeout_ns)) return false;
          x[j] = load_volatile(at);
        }
        accumulate<T>(acc, x[j]);
      }
    }
  }
  return true;
}

// Clears what the previous flags call wrote into buffer `prev` (the same vectors of every
// slot, and its norm partials) for the call after next, records what this call wrote (`vecs`
// vectors of each slot, `partials` floats), and advances the call count.
template <typename T>
__device__ __forceinline__ void end_flags_call(char* local, int buf, int prev, int peers,
                                               size_t slot, size_t vecs, size_t partials,
                                               State* st, const CallStart& start) {
  const size_t prev_vecs = start.prev_bytes / 16;
  const size_t prev_partials = start.prev_partials;
  Vec sentinel;
  sentinel.v = make_uint4(Elem<T>::kSentinelWord, Elem<T>::kSentinelWord,
                          Elem<T>::kSentinelWord, Elem<T>::kSentinelWord);
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t step = (size_t)gridDim.x * blockDim.x;
  for (int p = 0; p < peers; p++) {
    char* at = local + ((size_t)prev * peers + p) * slot;
    for (size_t v = first; v < prev_vecs; v += step) store_volatile(at + v * 16, sentinel);
  }
  for (size_t i = first; i < prev_partials; i += step) {
    *(volatile unsigned int*)&st->partials[prev][i] = 0x80000000u;
  }
  // Other entries than those read above (buf != prev); read by the next call.
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    st->flags_bytes[buf] = vecs * 16;
    st->partial_floats[buf] = partials;
  }
  end_call(st->flags_calls, start.call, kFlagsMaxCtas);
}

template <typename T>
__device__ void oneshot_flags(const ncclDevComm* comm, ncclWindow_t scratch, size_t slot,
                              const T* in, T* out, size_t count, State* st,
                              unsigned long long timeout_ns) {
  constexpr int n = 16 / sizeof(T);
  const int peers = comm->lsaSize, me = comm->lsaRank;
  const size_t vecs = (count + n - 1) / n;
  const bool aligned = ((uintptr_t)in % 16 == 0) && ((uintptr_t)out % 16 == 0);
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t step = (size_t)gridDim.x * blockDim.x;
  // The first vector's load is issued before the failure check, so their latencies overlap.
  Vec x0 = first < vecs ? load_input(in, first, count, aligned) : Vec{};
  const CallStart& start = begin_call(st, st->flags_calls);
  if (start.call == kFailed) {
    poison(out, first, step, vecs, count, aligned);
    return;
  }
  const unsigned long long call = start.call;
  const int buf = (int)(call % 3), prev = (int)((call + 2) % 3);
  const size_t mine = ((size_t)buf * peers + me) * slot;

  // Push: this rank's slot of every peer's current buffer.
  for (size_t v = first; v < vecs; v += step) {
    Vec x = v == first ? x0 : load_input(in, v, count, aligned);
    scrub<T>(x);
    for (int p = 0; p < peers; p++) {
      store_volatile((char*)ncclGetLsaPointer(scratch, mine + v * 16, p), x);
    }
  }

  // Pull: wait for every slot of the local buffer, sum in rank order.
  char* local = (char*)ncclGetLocalPointer(scratch, 0);
  Waiter waiter;
  for (size_t v = first; v < vecs; v += step) {
    float acc[n];
    // Once given up, a vector whose data is not all there at once is NaN (see `poison`).
    if (!pull<T>(acc, local, buf, peers, slot, v, waiter, st, timeout_ns)) {
#pragma unroll
      for (int i = 0; i < n; i++) acc[i] = __int_as_float(0x7fc00000);
    }
    store_output(out, v, count, aligned, acc);
  }
  end_flags_call<T>(local, buf, prev, peers, slot, vecs, 0, st, start);
}

// Slot layout of a two-shot call in buffer `buf` of rank r: slot p holds, at vectors
// [0, chunk), rank p's part of r's chunk, and at [chunk, 2 × chunk) the sum rank p made of
// chunk p (slots are sized for 2 × chunk: one vector more than the message).
template <typename T>
__device__ void twoshot_flags(const ncclDevComm* comm, ncclWindow_t scratch, size_t slot,
                              const T* in, T* out, size_t count, State* st,
                              unsigned long long timeout_ns) {
  constexpr int n = 16 / sizeof(T);
  const int peers = comm->lsaSize, me = comm->lsaRank;
  const size_t vecs = (count + n - 1) / n;
  const size_t chunk = (vecs + peers - 1) / peers;
  const bool aligned = ((uintptr_t)in % 16 == 0) && ((uintptr_t)out % 16 == 0);
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t step = (size_t)gridDim.x * blockDim.x;
  Vec x0 = first < vecs ? load_input(in, first, count, aligned) : Vec{};
  const CallStart& start = begin_call(st, st->flags_calls);
  if (start.call == kFailed) {
    poison(out, first, step, vecs, count, aligned);
    return;
  }
  const unsigned long long call = start.call;
  const int buf = (int)(call % 3), prev = (int)((call + 2) % 3);
  const size_t mine = ((size_t)buf * peers + me) * slot;
  char* local = (char*)ncclGetLocalPointer(scratch, 0);

  // Reduce-scatter, pushing: vector v goes to its owner's slot `me`. In place, a thread
  // reads each input vector it handles here, before any thread writes it below: the writes
  // of chunk j wait for this rank's own pushes of chunk j, and the other chunks are written
  // by the thread that pushed them.
  for (size_t v = first; v < vecs; v += step) {
    Vec x = v == first ? x0 : load_input(in, v, count, aligned);
    scrub<T>(x);
    const int owner = (int)(v / chunk);
    store_volatile((char*)ncclGetLsaPointer(scratch, mine + (v - owner * chunk) * 16, owner), x);
  }

  // This rank's chunk: sum its slots in rank order, write it out, push it to every peer.
  const size_t base = (size_t)me * chunk;
  const size_t len = base < vecs ? min(chunk, vecs - base) : 0;
  Waiter waiter;
  bool ok = true;
  for (size_t k = first; k < len; k += step) {
    float acc[n];
    if (!pull<T>(acc, local, buf, peers, slot, k, waiter, st, timeout_ns)) {
      ok = false;
      break;
    }
    Vec sum;
#pragma unroll
    for (int i = 0; i < n; i++) {
      T e = Elem<T>::narrow(acc[i]);
      memcpy(sum.b + i * sizeof(T), &e, sizeof(T));
    }
    scrub<T>(sum);
    store_vec(out, base + k, count, aligned, sum);
    for (int p = 0; p < peers; p++) {
      if (p != me) {
        store_volatile((char*)ncclGetLsaPointer(scratch, mine + (chunk + k) * 16, p), sum);
      }
    }
  }

  // All-gather: every other rank's sums, as they arrive.
  for (size_t v = first; ok && v < vecs; v += step) {
    const int owner = (int)(v / chunk);
    if (owner == me) continue;
    const char* at = local + ((size_t)buf * peers + owner) * slot + (chunk + v - owner * chunk) * 16;
    Vec x = load_volatile(at);
    while (holds_sentinel<T>(x)) {
      if (!waiter.go_on(st, timeout_ns)) {
        ok = false;
        break;
      }
      x = load_volatile(at);
    }
    if (ok) store_vec(out, v, count, aligned, x);
  }
  if (!ok) {
    // Both sets this thread writes: its vectors of this rank's chunk, and of the message.
    if (len > 0) poison(out + base * n, first, step, len, count - base * n, aligned);
    poison(out, first, step, vecs, count, aligned);
  }
  // One rank pushes no sums: its slot holds the chunk alone.
  end_flags_call<T>(local, buf, prev, peers, slot, peers > 1 ? 2 * chunk : chunk, 0, st, start);
}

// 8 bytes of `src` from byte `at`, zero past `bytes`; bytewise where not 8-byte aligned.
__device__ __forceinline__ uint2 load_8(const unsigned char* src, size_t at, size_t bytes,
                                        bool aligned) {
  if (aligned && at + 8 <= bytes) return *(const uint2*)(src + at);
  unsigned char b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < 8; i++) {
    if (at + i < bytes) b[i] = src[at + i];
  }
  uint2 x;
  memcpy(&x, b, 8);
  return x;
}

// 8 bytes `x` into `dst` from byte `at`, none past `bytes`; bytewise where not aligned.
__device__ __forceinline__ void store_8(unsigned char* dst, size_t at, size_t bytes,
                                        bool aligned, uint2 x) {
  if (aligned && at + 8 <= bytes) {
    *(uint2*)(dst + at) = x;
    return;
  }
  unsigned char b[8];
  memcpy(b, &x, 8);
  for (int i = 0; i < 8; i++) {
    if (at + i < bytes) dst[at + i] = b[i];
  }
}

// NaN over this thread's lines of every rank's part of an all-gather's `out` but `skip`'s
// (the elements of T, whole: 8 bytes hold whole elements), as `poison` for the all-reduces.
template <typename T>
__device__ __forceinline__ void poison_lines(unsigned char* out, size_t bytes, size_t first,
                                             size_t step, size_t lines, int peers, int skip,
                                             bool aligned) {
  const uint2 nan = make_uint2(Elem<T>::kNanWord, Elem<T>::kNanWord);
  for (int p = 0; p < peers; p++) {
    if (p == skip) continue;
    for (size_t l = first; l < lines; l += step) store_8(out + (size_t)p * bytes, l * 8, bytes, aligned, nan);
  }
}

// All-gather of `bytes` bytes per rank into `out` (rank p's at `out + p × bytes`), in LL
// lines: line l carries bytes [8l, 8l + 8) of a rank's input with the call's flag twice. `T`
// only names the sentinel the clearing writes (the flags buffers serve one element type).
template <typename T>
__device__ void all_gather_ll(const ncclDevComm* comm, ncclWindow_t scratch, size_t slot,
                              const unsigned char* in, unsigned char* out, size_t bytes,
                              State* st, unsigned long long timeout_ns) {
  const int peers = comm->lsaSize, me = comm->lsaRank;
  const size_t lines = (bytes + 7) / 8;
  const bool in_aligned = (uintptr_t)in % 8 == 0;
  const bool out_aligned = (uintptr_t)out % 8 == 0 && bytes % 8 == 0;
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t step = (size_t)gridDim.x * blockDim.x;
  const CallStart& start = begin_call(st, st->flags_calls);
  if (start.call == kFailed) {
    poison_lines<T>(out, bytes, first, step, lines, peers, -1, out_aligned);
    return;
  }
  const unsigned long long call = start.call;
  // In [1, 2^31): below the sentinels' top bit, so a cleared slot never holds a valid flag.
  const uint32_t flag = (uint32_t)(call % 0x7fffffffull) + 1u;
  const int buf = (int)(call % 3), prev = (int)((call + 2) % 3);
  const size_t mine = ((size_t)buf * peers + me) * slot;
  char* local = (char*)ncclGetLocalPointer(scratch, 0);

  // Push every line to every peer; this rank's own part straight into the output.
  for (size_t l = first; l < lines; l += step) {
    const uint2 d = load_8(in, l * 8, bytes, in_aligned);
    Vec line;
    line.w[0] = d.x;
    line.w[1] = flag;
    line.w[2] = d.y;
    line.w[3] = flag;
    for (int p = 0; p < peers; p++) {
      if (p != me) store_volatile((char*)ncclGetLsaPointer(scratch, mine + l * 16, p), line);
    }
    store_8(out + (size_t)me * bytes, l * 8, bytes, out_aligned, d);
  }
  // Every peer's lines, as their flags arrive.
  Waiter waiter;
  bool ok = true;
  for (int p = 0; ok && p < peers; p++) {
    if (p == me) continue;
    const char* slot_p = local + ((size_t)buf * peers + p) * slot;
    for (size_t l = first; l < lines; l += step) {
      Vec x = load_volatile(slot_p + l * 16);
      while (x.w[1] != flag || x.w[3] != flag) {
        if (!waiter.go_on(st, timeout_ns)) {
          ok = false;
          break;
        }
        x = load_volatile(slot_p + l * 16);
      }
      if (!ok) break;
      store_8(out + (size_t)p * bytes, l * 8, bytes, out_aligned, make_uint2(x.w[0], x.w[2]));
    }
  }
  if (!ok) poison_lines<T>(out, bytes, first, step, lines, peers, me, out_aligned);
  end_flags_call<T>(local, buf, prev, peers, slot, lines, 0, st, start);
}

// CTA b of every rank meets at barrier b: flags (the call's epoch) stored with release into
// every peer's inbox, awaited with acquire in this rank's; false if the wait gave up. Thread
// t serves peers t, t + blockDim, ...: every peer whatever the team's size and the CTA's
// (first every store, then every wait, so no rank waits before it has signalled them all).
__device__ __forceinline__ bool meet(ncclWindow_t scratch, size_t inboxes, int peers, int me,
                                     unsigned int epoch, State* st,
                                     unsigned long long timeout_ns) {
  __syncthreads();
  for (int p = threadIdx.x; p < peers; p += blockDim.x) {
    if (p == me) continue;
    const size_t to = inboxes + ((size_t)blockIdx.x * peers + me) * 4;
    cuda::atomic_ref<uint32_t, cuda::thread_scope_system> out(
        *(uint32_t*)ncclGetLsaPointer(scratch, to, p));
    out.store(epoch, cuda::memory_order_release);
  }
  bool met = true;
  Waiter waiter;
  for (int p = threadIdx.x; met && p < peers; p += blockDim.x) {
    if (p == me) continue;
    const size_t from = inboxes + ((size_t)blockIdx.x * peers + p) * 4;
    cuda::atomic_ref<uint32_t, cuda::thread_scope_system> in(
        *(uint32_t*)ncclGetLocalPointer(scratch, from));
    // A peer may already be at a later call's barrier (a larger epoch).
    while ((int)(in.load(cuda::memory_order_acquire) - epoch) < 0) {
      if (!waiter.go_on(st, timeout_ns)) {
        met = false;
        break;
      }
    }
  }
  return __syncthreads_and(met);
}

template <typename T>
__device__ void oneshot_barrier(const ncclDevComm* comm, ncclWindow_t scratch, size_t slot,
                                const T* in, T* out, size_t count, State* st,
                                unsigned long long timeout_ns) {
  const unsigned long long call = begin_call(st, st->barrier_calls).call;
  constexpr int n = 16 / sizeof(T);
  const size_t vecs = (count + n - 1) / n;
  const bool aligned = ((uintptr_t)in % 16 == 0) && ((uintptr_t)out % 16 == 0);
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t step = (size_t)gridDim.x * blockDim.x;
  if (call == kFailed) {
    poison(out, first, step, vecs, count, aligned);
    return;
  }
  const int peers = comm->lsaSize, me = comm->lsaRank;
  const size_t base = (size_t)3 * peers * slot + (size_t)(call & 1) * slot;
  const size_t inboxes = (size_t)(3 * peers + 2) * slot;

  char* mine = (char*)ncclGetLocalPointer(scratch, base);
  for (size_t v = first; v < vecs; v += step) {
    *(uint4*)(mine + v * 16) = load_input(in, v, count, aligned).v;
  }
  if (meet(scratch, inboxes, peers, me, (unsigned int)(call + 1), st, timeout_ns)) {
    for (size_t v = first; v < vecs; v += step) {
      float acc[n];
#pragma unroll
      for (int i = 0; i < n; i++) acc[i] = 0.f;
      for (int p = 0; p < peers; p++) {
        Vec x;
        x.v = *(const uint4*)ncclGetLsaPointer(scratch, base + v * 16, p);
        accumulate<T>(acc, x);
      }
      store_output(out, v, count, aligned, acc);
    }
  } else {
    poison(out, first, step, vecs, count, aligned);
  }
  end_call(st->barrier_calls, call, kBarrierMaxCtas);
}

// ---- All-reduce + residual add + RMSNorm (the tensor-parallel epilogue) -------------------
//   s   = T(sum over ranks of x)       (what an all-reduce of T gives, rounded once)
//   h   = T(s + residual_in)           (written to `residual_out`, which may be residual_in)
//   out = T(h * rsqrt(mean(h^2) + eps) * weight)
// over `rows` rows of `hidden` elements (hidden a multiple of the vector, at most
// kMaxChunks × 32 vectors). Fused, `splits` CTAs normalise a row together, each a part of
// it (a multiple of 32 vectors, at most kFusedMaxPerThread a thread); CTAs past the rows
// only push. A
// row's sum of squares is summed in one order whatever the split: each warp's 32 vectors (a
// chunk) in a fixed tree, then the chunks in a fixed tree over kMaxChunks, so every split,
// and the separate kernel, give the same bits.
// The most vectors of a row a thread keeps: the separate kernel's (a CTA a row, 512 threads);
// the fused kernel keeps fewer (its registers also hold the wait) and splits longer rows.
constexpr int kMaxPerThread = 4;
constexpr int kFusedMaxPerThread = 2;

// Vectors [base, end) of a row: the part one CTA normalises.
struct Part {
  size_t base, end;
};

// Lane 0's result is the warp's 32 values summed in a fixed (xor butterfly) order.
__device__ __forceinline__ float warp_tree(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A row's sum of squares from its `chunks` chunk sums (the rest of kMaxChunks count as
// zero), in the fixed order: every lane of the warp gets lane 0's.
__device__ __forceinline__ float chunks_total(float a, float b) {
  return __shfl_sync(0xffffffffu, warp_tree(a + b), 0);
}

// Vectors `part.base + k × blockDim + tid` of a row of `rows × hidden` elements `src`
// (`row` 0 and `len` = hidden: the weight): the ones this thread handles.
template <typename T, int K>
__device__ __forceinline__ void load_part(Vec (&x)[K], const T* src, size_t row,
                                          size_t hidden, Part part, size_t len, bool aligned) {
  constexpr int n = 16 / sizeof(T);
  const size_t vpr = hidden / n;
#pragma unroll
  for (int k = 0; k < K; k++) {
    const size_t v = part.base + (size_t)k * blockDim.x + threadIdx.x;
    if (v < part.end) x[k] = load_input(src, row * vpr + v, len, aligned);
  }
}

// h = T(T(h) + residual) for this thread's vectors (the unfused sequence's two roundings),
// and the part's chunk sums of squares into `chunks` (chunk c of the row at index c; lane
// 0 of each warp writes, volatile where other CTAs read them).
template <typename T, int K, bool kVolatile>
__device__ __forceinline__ void add_residual(float (&h)[K][16 / sizeof(T)], const Vec (&r)[K],
                                             Part part,
                                             float* chunks) {
  constexpr int n = 16 / sizeof(T);
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < K; k++) {
    const size_t first = part.base + (size_t)k * blockDim.x;
    if (first >= part.end) break;  // alike for the whole CTA
    const size_t v = first + threadIdx.x;
    float squares = 0.f;
    if (v < part.end) {
#pragma unroll
      for (int i = 0; i < n; i++) {
        T e;
        memcpy(&e, r[k].b + i * sizeof(T), sizeof(T));
        const float x = Elem<T>::widen(Elem<T>::narrow(h[k][i])) + Elem<T>::widen(e);
        h[k][i] = Elem<T>::widen(Elem<T>::narrow(x));
        squares += h[k][i] * h[k][i];
      }
    }
    const float chunk = warp_tree(squares);
    if (lane == 0 && first + warp * 32 < part.end) {
      const size_t c = first / 32 + warp;
      if (kVolatile) {
        *(volatile float*)&chunks[c] = chunk;
      } else {
        chunks[c] = chunk;
      }
    }
  }
}

// The row's sum of squares from chunk sums other CTAs publish in `chunks` (sentinels, -0,
// until written: a sum of squares is never -0); false on this lane if the wait gave up.
__device__ __forceinline__ bool published_total(const float* chunks, int count, float& total,
                                                Waiter& waiter, State* st,
                                                unsigned long long timeout_ns) {
  const int lane = threadIdx.x % 32;
  float x[2] = {0.f, 0.f};
  bool ok = true;
#pragma unroll
  for (int j = 0; j < 2; j++) {
    const int c = lane + 32 * j;
    if (!ok || c >= count) continue;
    const volatile unsigned int* at = (const volatile unsigned int*)&chunks[c];
    unsigned int bits = *at;
    while (bits == 0x80000000u) {
      if (!waiter.go_on(st, timeout_ns)) {
        ok = false;
        break;
      }
      bits = *at;
    }
    x[j] = __uint_as_float(bits);
  }
  total = chunks_total(x[0], x[1]);
  return ok;
}

// The norm of this thread's vectors of a row, whose h and weights are in `h` and `w`.
template <typename T, int K>
__device__ __forceinline__ void write_row(const float (&h)[K][16 / sizeof(T)],
                                          const Vec (&w)[K], T* residual_out,
                                          T* out, size_t row, size_t hidden, Part part,
                                          size_t len, bool aligned, float inv) {
  constexpr int n = 16 / sizeof(T);
  const size_t vpr = hidden / n;
#pragma unroll
  for (int k = 0; k < K; k++) {
    const size_t v = part.base + (size_t)k * blockDim.x + threadIdx.x;
    if (v >= part.end) continue;
    Vec hr, o;
#pragma unroll
    for (int i = 0; i < n; i++) {
      T we, he = Elem<T>::narrow(h[k][i]);
      memcpy(&we, w[k].b + i * sizeof(T), sizeof(T));
      T oe = Elem<T>::narrow(h[k][i] * inv * Elem<T>::widen(we));
      memcpy(hr.b + i * sizeof(T), &he, sizeof(T));
      memcpy(o.b + i * sizeof(T), &oe, sizeof(T));
    }
    store_vec(residual_out, row * vpr + v, len, aligned, hr);
    store_vec(out, row * vpr + v, len, aligned, o);
  }
}

template <typename T>
__device__ __forceinline__ bool all_aligned(const T* a, const T* b, const T* c, const T* d,
                                            const T* e) {
  return ((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d | (uintptr_t)e) % 16 == 0;
}

// The part of each row CTA `blockIdx.x` normalises, `splits` CTAs a row.
__device__ __forceinline__ Part row_part(size_t vpr, size_t splits) {
  const size_t each = ((vpr + splits - 1) / splits + 31) / 32 * 32;
  const size_t base = (blockIdx.x % splits) * each;
  return Part{base, min(base + each, vpr)};
}

// NaN over this CTA's part of rows `from`, `from + groups`, ... of both outputs of the fused
// epilogue (as `poison`: a call that failed leaves no stale memory there).
template <typename T>
__device__ __forceinline__ void poison_rows(T* residual_out, T* out, size_t from, size_t rows,
                                            size_t groups, size_t splits, size_t hidden,
                                            Part part, size_t len, bool aligned) {
  if (blockIdx.x >= groups * splits) return;
  for (size_t row = from; row < rows; row += groups) {
    poison(residual_out + row * hidden, part.base + threadIdx.x, blockDim.x, part.end, hidden,
           aligned);
    poison(out + row * hidden, part.base + threadIdx.x, blockDim.x, part.end, hidden, aligned);
  }
}

template <typename T>
__device__ void fused_flags(const ncclDevComm* comm, ncclWindow_t scratch, size_t slot,
                            const T* in, const T* residual_in, T* residual_out, const T* weight,
                            T* out, size_t rows, size_t hidden, size_t splits, float eps,
                            State* st, unsigned long long timeout_ns) {
  constexpr int n = 16 / sizeof(T);
  __shared__ float chunks[kMaxChunks];
  const int peers = comm->lsaSize, me = comm->lsaRank;
  const size_t vpr = hidden / n, vecs = rows * vpr, len = rows * hidden;
  const bool aligned = all_aligned(in, residual_in, (const T*)residual_out, weight, (const T*)out);
  // Each CTA pushes one contiguous share of the message (all vectors of all rows), so every
  // CTA of the grid pushes, however few vectors a CTA's threads could take.
  const size_t share = (vecs + gridDim.x - 1) / gridDim.x;
  const size_t first = (size_t)blockIdx.x * share + threadIdx.x;
  const size_t end = min((size_t)(blockIdx.x + 1) * share, vecs);
  // The first vector's load is issued before the call's state is read, to overlap them.
  Vec x0 = first < end ? load_input(in, first, len, aligned) : Vec{};
  const CallStart& start = begin_call(st, st->flags_calls);
  const size_t groups = gridDim.x / splits;
  const Part part = row_part(vpr, splits);
  if (start.call == kFailed) {
    poison_rows<T>(residual_out, out, blockIdx.x / splits, rows, groups, splits, hidden, part,
                   len, aligned);
    return;
  }
  const unsigned long long call = start.call;
  const int buf = (int)(call % 3), prev = (int)((call + 2) % 3);
  const size_t mine = ((size_t)buf * peers + me) * slot;
  char* local = (char*)ncclGetLocalPointer(scratch, 0);

  // Push, then wait: a CTA waits right after its own pushes, for data other CTAs (of every
  // rank) push, so every CTA of the grid must be resident at once. The CTAs past the rows
  // only push.
  for (size_t v = first; v < end; v += blockDim.x) {
    Vec x = v == first ? x0 : load_input(in, v, len, aligned);
    scrub<T>(x);
    for (int p = 0; p < peers; p++) {
      store_volatile((char*)ncclGetLsaPointer(scratch, mine + v * 16, p), x);
    }
  }
  // CTA b < groups × splits normalises part b % splits of rows b / splits, + groups, ...;
  // split (splits > 1: the host gives at most one row a group, at most kMaxSplitRows rows),
  // the group's CTAs publish their chunk sums in the call's partials.
  const int count = (int)((vpr + 31) / 32);
  Waiter waiter;
  size_t row = blockIdx.x / splits;
  bool failed = false;
  for (; blockIdx.x < groups * splits && row < rows; row += groups) {
    // The residual and weight before the wait, to overlap their latency.
    Vec r[kFusedMaxPerThread], w[kFusedMaxPerThread];
    load_part<T, kFusedMaxPerThread>(r, residual_in, row, hidden, part, len, aligned);
    load_part<T, kFusedMaxPerThread>(w, weight, 0, hidden, part, hidden, aligned);
    float h[kFusedMaxPerThread][n];
    bool complete = true;
#pragma unroll
    for (int k = 0; k < kFusedMaxPerThread; k++) {
      const size_t v = part.base + (size_t)k * blockDim.x + threadIdx.x;
      if (v < part.end) {
        complete &= pull<T>(h[k], local, buf, peers, slot, row * vpr + v, waiter, st, timeout_ns);
      } else {
#pragma unroll
        for (int i = 0; i < n; i++) h[k][i] = 0.f;
      }
    }
    // Every thread of the CTA takes part in the exchange, given up or not (the barrier also
    // frees `chunks` from the previous row).
    if (!__syncthreads_and(complete)) {
      failed = true;
      break;
    }
    float total;
    const int lane = threadIdx.x % 32;
    if (splits == 1) {
      add_residual<T, kFusedMaxPerThread, false>(h, r, part, chunks);
      __syncthreads();
      total = chunks_total(lane < count ? chunks[lane] : 0.f,
                           lane + 32 < count ? chunks[lane + 32] : 0.f);
    } else {
      // This row's room (one row a group, so group < kMaxSplitRows).
      float* published = st->partials[buf] + (blockIdx.x / splits) * kMaxChunks;
      add_residual<T, kFusedMaxPerThread, true>(h, r, part, published);
      const bool ok = published_total(published, count, total, waiter, st, timeout_ns);
      if (!__syncthreads_and(ok)) {
        failed = true;
        break;
      }
    }
    write_row<T, kFusedMaxPerThread>(h, w, residual_out, out, row, hidden, part, len, aligned,
                 rsqrtf(total / (float)hidden + eps));
  }
  if (failed) {
    poison_rows<T>(residual_out, out, row, rows, groups, splits, hidden, part, len, aligned);
  }
  end_flags_call<T>(local, buf, prev, peers, slot, vecs, splits > 1 ? rows * kMaxChunks : 0,
                    st, start);
}

// The unfused epilogue, after an all-reduce that left the sums in `sums`: the same math as
// fused_flags from there on, a CTA a row.
template <typename T>
__device__ void add_rms_norm(const T* sums, const T* residual_in, T* residual_out,
                             const T* weight, T* out, size_t rows, size_t hidden, float eps) {
  constexpr int n = 16 / sizeof(T);
  __shared__ float chunks[kMaxChunks];
  const size_t vpr = hidden / n, len = rows * hidden;
  const bool aligned = all_aligned(sums, residual_in, (const T*)residual_out, weight, (const T*)out);
  const Part part = row_part(vpr, 1);
  const int count = (int)((vpr + 31) / 32), lane = threadIdx.x % 32;
  for (size_t row = blockIdx.x; row < rows; row += gridDim.x) {
    Vec r[kMaxPerThread], w[kMaxPerThread];
    load_part<T, kMaxPerThread>(r, residual_in, row, hidden, part, len, aligned);
    load_part<T, kMaxPerThread>(w, weight, 0, hidden, part, hidden, aligned);
    float h[kMaxPerThread][n];
#pragma unroll
    for (int k = 0; k < kMaxPerThread; k++) {
#pragma unroll
      for (int i = 0; i < n; i++) h[k][i] = 0.f;
      const size_t v = (size_t)k * blockDim.x + threadIdx.x;
      if (v >= vpr) continue;
      accumulate<T>(h[k], load_input(sums, row * vpr + v, len, aligned));
    }
    __syncthreads();  // `chunks` free from the previous row
    add_residual<T, kMaxPerThread, false>(h, r, part, chunks);
    __syncthreads();
    const float total = chunks_total(lane < count ? chunks[lane] : 0.f,
                                     lane + 32 < count ? chunks[lane + 32] : 0.f);
    write_row<T, kMaxPerThread>(h, w, residual_out, out, row, hidden, part, len, aligned,
                 rsqrtf(total / (float)hidden + eps));
  }
}
}  // namespace

// The State's layout as compiled, and the limits its arrays are sized by, in this order: what
// the host builds the State from (KernelState in src/device/all_reduce/state.rs), whose tests
// read this table out of the shipped images, so an image built from another State fails them.
// Read by no kernel.
extern "C" __device__ const unsigned long long nccl_rs_allreduce_state_layout[] = {
    sizeof(State),
    offsetof(State, flags_bytes),
    offsetof(State, timed_out),
    offsetof(State, gave_up),
    offsetof(State, partial_floats),
    offsetof(State, flags_calls),
    offsetof(State, barrier_calls),
    offsetof(State, partials),
    kFlagsMaxCtas,
    kBarrierMaxCtas,
    kMaxSplitRows,
    kMaxChunks,
};

#define NCCL_RS_ALLREDUCE(NAME, T)                                                            \
  extern "C" __global__ void __launch_bounds__(512) nccl_rs_oneshot_flags_##NAME(                                    \
      const ncclDevComm* comm, ncclWindow_t scratch, size_t slot, const T* in, T* out,        \
      size_t count, State* st, unsigned long long timeout_ns) {                               \
    oneshot_flags<T>(comm, scratch, slot, in, out, count, st, timeout_ns);                    \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(512) nccl_rs_twoshot_flags_##NAME(             \
      const ncclDevComm* comm, ncclWindow_t scratch, size_t slot, const T* in, T* out,        \
      size_t count, State* st, unsigned long long timeout_ns) {                               \
    twoshot_flags<T>(comm, scratch, slot, in, out, count, st, timeout_ns);                    \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(512) nccl_rs_all_gather_##NAME(                 \
      const ncclDevComm* comm, ncclWindow_t scratch, size_t slot, const T* in, T* out,        \
      size_t count, State* st, unsigned long long timeout_ns) {                               \
    all_gather_ll<T>(comm, scratch, slot, (const unsigned char*)in, (unsigned char*)out,      \
                     count * sizeof(T), st, timeout_ns);                                      \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(512) nccl_rs_oneshot_barrier_##NAME(                                  \
      const ncclDevComm* comm, ncclWindow_t scratch, size_t slot, const T* in, T* out,        \
      size_t count, State* st, unsigned long long timeout_ns) {                               \
    oneshot_barrier<T>(comm, scratch, slot, in, out, count, st, timeout_ns);                  \
  }

#define NCCL_RS_NORM(NAME, T)                                                                 \
  extern "C" __global__ void __launch_bounds__(512) nccl_rs_fused_add_rms_norm_##NAME(        \
      const ncclDevComm* comm, ncclWindow_t scratch, size_t slot, const T* in,                \
      const T* residual_in, T* residual_out, const T* weight, T* out, size_t rows,            \
      size_t hidden, size_t splits, float eps, State* st, unsigned long long timeout_ns) {    \
    fused_flags<T>(comm, scratch, slot, in, residual_in, residual_out, weight, out, rows,     \
                   hidden, splits, eps, st, timeout_ns);                                      \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(512) nccl_rs_add_rms_norm_##NAME(              \
      const T* sums, const T* residual_in, T* residual_out, const T* weight, T* out,          \
      size_t rows, size_t hidden, float eps) {                                                \
    add_rms_norm<T>(sums, residual_in, residual_out, weight, out, rows, hidden, eps);         \
  }

NCCL_RS_ALLREDUCE(f32, float)
NCCL_RS_ALLREDUCE(bf16, __nv_bfloat16)
NCCL_RS_ALLREDUCE(f16, __half)
NCCL_RS_NORM(f32, float)
NCCL_RS_NORM(bf16, __nv_bfloat16)
NCCL_RS_NORM(f16, __half)

// Fills `words` 32-bit words at `p` with `value`: the flags buffers start as sentinels.
extern "C" __global__ void nccl_rs_fill_u32(uint32_t* p, size_t words, uint32_t value) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words;
       i += (size_t)gridDim.x * blockDim.x) {
    p[i] = value;
  }
}
