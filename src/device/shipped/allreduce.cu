// The all-reduce kernels nccl-rs ships (src/device/shipped/mod.rs): sum over the ranks of one
// LSA team, f32/bf16/f16, accumulated in f32 in rank order, so every rank gets the same bits;
// and the tensor-parallel epilogue (all-reduce, residual add, RMSNorm) fused into one kernel.
// Compiled ahead of time by generate.sh against NCCL 2.29.2's headers (the oldest versioned
// device ABI; LSA code runs on every later library). Peers never touch the caller's buffers:
// each rank copies its input into its own scratch window, and peers read or receive only that.
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
#include <stdint.h>

namespace {

// Mirrored by `State` in src/device/all_reduce.rs (8 words, written at creation).
struct State {
  unsigned long long flags_call;
  unsigned long long barrier_call;
  unsigned long long flags_bytes[3];  // bytes per slot the flags call that used buffer i wrote
  unsigned int flags_done;            // blocks of the current flags call that have finished
  unsigned int barrier_done;
  unsigned int timed_out;             // a kernel of this instance gave up waiting
  unsigned int pad;
  unsigned int* gave_up;              // host-mapped: set with timed_out, read by the host
};

template <typename T> struct Elem;
template <> struct Elem<float> {
  static constexpr int kWidth = 4;
  static constexpr uint32_t kSentinelWord = 0x80000000u;
  __device__ static float widen(float x) { return x; }
  __device__ static float narrow(float x) { return x; }
};
template <> struct Elem<__nv_bfloat16> {
  static constexpr int kWidth = 2;
  static constexpr uint32_t kSentinelWord = 0x80008000u;
  __device__ static float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ static __nv_bfloat16 narrow(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Elem<__half> {
  static constexpr int kWidth = 2;
  static constexpr uint32_t kSentinelWord = 0x80008000u;
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
__device__ __noinline__ void give_up(State* st) {
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

// Whether an earlier kernel of this instance gave up (read once per CTA, so every thread of
// the CTA leaves together).
__device__ __forceinline__ bool instance_failed(const State* st) {
  __shared__ unsigned int failed;
  if (threadIdx.x == 0) failed = *(const volatile unsigned int*)&st->timed_out;
  __syncthreads();
  return failed != 0;
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

// The last block of a call to finish advances the call counter for the next launch.
__device__ __forceinline__ void finish_call(unsigned int* done, unsigned long long* call) {
  __syncthreads();
  if (gridDim.x == 1) {
    // One block (every small message): no other block to count.
    if (threadIdx.x == 0) *call += 1;
    return;
  }
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(done, 1u) == gridDim.x - 1) {
      *done = 0;
      *call += 1;
      __threadfence();
    }
  }
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
// slot) for the call after next, records how many vectors of each slot this call wrote
// (`vecs`), and advances the call counter.
template <typename T>
__device__ __forceinline__ void end_flags_call(char* local, int buf, int prev, int peers,
                                               size_t slot, size_t vecs, State* st) {
  const size_t prev_vecs = st->flags_bytes[prev] / 16;
  Vec sentinel;
  sentinel.v = make_uint4(Elem<T>::kSentinelWord, Elem<T>::kSentinelWord,
                          Elem<T>::kSentinelWord, Elem<T>::kSentinelWord);
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < prev_vecs * peers;
       i += (size_t)gridDim.x * blockDim.x) {
    const size_t p = i / prev_vecs, v = i % prev_vecs;
    store_volatile(local + ((size_t)prev * peers + p) * slot + v * 16, sentinel);
  }
  // Another entry than the one read above (buf != prev); read by the next call.
  if (blockIdx.x == 0 && threadIdx.x == 0) st->flags_bytes[buf] = vecs * 16;
  finish_call(&st->flags_done, &st->flags_call);
}

template <typename T>
__device__ void oneshot_flags(const ncclDevComm* comm, ncclWindow_t scratch, size_t slot,
                              const T* in, T* out, size_t count, State* st,
                              unsigned long long timeout_ns) {
  constexpr int n = 16 / sizeof(T);
  const int peers = comm->lsaSize, me = comm->lsaRank;
  const unsigned long long call = st->flags_call;
  const size_t vecs = (count + n - 1) / n;
  const bool aligned = ((uintptr_t)in % 16 == 0) && ((uintptr_t)out % 16 == 0);
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t step = (size_t)gridDim.x * blockDim.x;
  // The first vector's load is issued before the failure check, so their latencies overlap.
  Vec x0 = first < vecs ? load_input(in, first, count, aligned) : Vec{};
  if (instance_failed(st)) return;
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
    if (!pull<T>(acc, local, buf, peers, slot, v, waiter, st, timeout_ns)) break;
    store_output(out, v, count, aligned, acc);
  }
  end_flags_call<T>(local, buf, prev, peers, slot, vecs, st);
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
  const unsigned long long call = st->flags_call;
  const size_t vecs = (count + n - 1) / n;
  const size_t chunk = (vecs + peers - 1) / peers;
  const bool aligned = ((uintptr_t)in % 16 == 0) && ((uintptr_t)out % 16 == 0);
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t step = (size_t)gridDim.x * blockDim.x;
  Vec x0 = first < vecs ? load_input(in, first, count, aligned) : Vec{};
  if (instance_failed(st)) return;
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
  // One rank pushes no sums: its slot holds the chunk alone.
  end_flags_call<T>(local, buf, prev, peers, slot, peers > 1 ? 2 * chunk : chunk, st);
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

// All-gather of `bytes` bytes per rank into `out` (rank p's at `out + p × bytes`), in LL
// lines: line l carries bytes [8l, 8l + 8) of a rank's input with the call's flag twice. `T`
// only names the sentinel the clearing writes (the flags buffers serve one element type).
template <typename T>
__device__ void all_gather_ll(const ncclDevComm* comm, ncclWindow_t scratch, size_t slot,
                              const unsigned char* in, unsigned char* out, size_t bytes,
                              State* st, unsigned long long timeout_ns) {
  const int peers = comm->lsaSize, me = comm->lsaRank;
  const unsigned long long call = st->flags_call;
  const size_t lines = (bytes + 7) / 8;
  // In [1, 2^31): below the sentinels' top bit, so a cleared slot never holds a valid flag.
  const uint32_t flag = (uint32_t)(call % 0x7fffffffull) + 1u;
  const bool in_aligned = (uintptr_t)in % 8 == 0;
  const bool out_aligned = (uintptr_t)out % 8 == 0 && bytes % 8 == 0;
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t step = (size_t)gridDim.x * blockDim.x;
  if (instance_failed(st)) return;
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
  end_flags_call<T>(local, buf, prev, peers, slot, lines, st);
}

// CTA b of every rank meets at barrier b: flags (the call's epoch) stored with release into
// every peer's inbox, awaited with acquire in this rank's; false if the wait gave up.
__device__ __forceinline__ bool meet(ncclWindow_t scratch, size_t inboxes, int peers, int me,
                                     unsigned int epoch, State* st,
                                     unsigned long long timeout_ns) {
  __syncthreads();
  const int p = threadIdx.x;
  bool met = true;
  if (p < peers && p != me) {
    const size_t to = inboxes + ((size_t)blockIdx.x * peers + me) * 4;
    cuda::atomic_ref<uint32_t, cuda::thread_scope_system> out(
        *(uint32_t*)ncclGetLsaPointer(scratch, to, p));
    out.store(epoch, cuda::memory_order_release);
    const size_t from = inboxes + ((size_t)blockIdx.x * peers + p) * 4;
    cuda::atomic_ref<uint32_t, cuda::thread_scope_system> in(
        *(uint32_t*)ncclGetLocalPointer(scratch, from));
    Waiter waiter;
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
  if (instance_failed(st)) return;
  constexpr int n = 16 / sizeof(T);
  const int peers = comm->lsaSize, me = comm->lsaRank;
  const unsigned long long call = st->barrier_call;
  const size_t base = (size_t)3 * peers * slot + (size_t)(call & 1) * slot;
  const size_t inboxes = (size_t)(3 * peers + 2) * slot;
  const size_t vecs = (count + n - 1) / n;
  const bool aligned = ((uintptr_t)in % 16 == 0) && ((uintptr_t)out % 16 == 0);
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t step = (size_t)gridDim.x * blockDim.x;

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
  }
  finish_call(&st->barrier_done, &st->barrier_call);
}

// ---- All-reduce + residual add + RMSNorm (the tensor-parallel epilogue) -------------------
//   s   = T(sum over ranks of x)       (what an all-reduce of T gives, rounded once)
//   h   = T(s + residual)              (written back to `residual`)
//   out = T(h * rsqrt(mean(h^2) + eps) * weight)
// over `rows` rows of `hidden` elements (hidden a multiple of the vector, at most
// kMaxPerThread vectors per thread), one CTA per row in turn (CTAs past the rows help push).
constexpr int kMaxPerThread = 4;

__device__ __forceinline__ float block_sum(float v, float* shared) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  __syncthreads();  // `shared` free from the previous row
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < warps; w++) total += shared[w];
  return total;
}

// The residual and weight vectors of one row this thread handles (vectors
// `k * blockDim + tid`), loaded before anything waits, so their latency overlaps the rest.
template <typename T>
__device__ __forceinline__ void load_row(Vec (&r)[kMaxPerThread], Vec (&w)[kMaxPerThread],
                                         const T* residual, const T* weight, size_t row,
                                         size_t hidden, size_t len, bool aligned) {
  constexpr int n = 16 / sizeof(T);
  const size_t vpr = hidden / n;
#pragma unroll
  for (int k = 0; k < kMaxPerThread; k++) {
    const size_t v = k * blockDim.x + threadIdx.x;
    if (v >= vpr) continue;
    r[k] = load_input(residual, row * vpr + v, len, aligned);
    w[k] = load_input(weight, v, hidden, aligned);
  }
}

// The norm of one row whose sums (as T, widened) are in `h`, with the row's residual and
// weight vectors from load_row.
template <typename T>
__device__ __forceinline__ void norm_row(float (&h)[kMaxPerThread][16 / sizeof(T)],
                                         const Vec (&r)[kMaxPerThread],
                                         const Vec (&w)[kMaxPerThread], T* residual, T* out,
                                         size_t row, size_t hidden, size_t len, bool aligned,
                                         float eps, float* shared) {
  constexpr int n = 16 / sizeof(T);
  const size_t vpr = hidden / n;
  float squares = 0.f;
#pragma unroll
  for (int k = 0; k < kMaxPerThread; k++) {
    const size_t v = k * blockDim.x + threadIdx.x;
    if (v >= vpr) continue;
#pragma unroll
    for (int i = 0; i < n; i++) {
      T e;
      memcpy(&e, r[k].b + i * sizeof(T), sizeof(T));
      // The sum as T, plus the residual, as T: the unfused sequence's two roundings.
      const float x = Elem<T>::widen(Elem<T>::narrow(h[k][i])) + Elem<T>::widen(e);
      h[k][i] = Elem<T>::widen(Elem<T>::narrow(x));
      squares += h[k][i] * h[k][i];
    }
  }
  const float inv = rsqrtf(block_sum(squares, shared) / (float)hidden + eps);
#pragma unroll
  for (int k = 0; k < kMaxPerThread; k++) {
    const size_t v = k * blockDim.x + threadIdx.x;
    if (v >= vpr) continue;
    Vec hr, o;
#pragma unroll
    for (int i = 0; i < n; i++) {
      T we, he = Elem<T>::narrow(h[k][i]);
      memcpy(&we, w[k].b + i * sizeof(T), sizeof(T));
      T oe = Elem<T>::narrow(h[k][i] * inv * Elem<T>::widen(we));
      memcpy(hr.b + i * sizeof(T), &he, sizeof(T));
      memcpy(o.b + i * sizeof(T), &oe, sizeof(T));
    }
    store_vec(residual, row * vpr + v, len, aligned, hr);
    store_vec(out, row * vpr + v, len, aligned, o);
  }
}

template <typename T>
__device__ __forceinline__ bool all_aligned(const T* a, const T* b, const T* c, const T* d) {
  return ((uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d) % 16 == 0;
}

template <typename T>
__device__ void fused_flags(const ncclDevComm* comm, ncclWindow_t scratch, size_t slot,
                            const T* in, T* residual, const T* weight, T* out, size_t rows,
                            size_t hidden, float eps, State* st, unsigned long long timeout_ns) {
  constexpr int n = 16 / sizeof(T);
  __shared__ float shared[32];
  const int peers = comm->lsaSize, me = comm->lsaRank;
  const unsigned long long call = st->flags_call;
  const size_t vpr = hidden / n, vecs = rows * vpr, len = rows * hidden;
  const bool aligned = all_aligned(in, (const T*)residual, weight, (const T*)out);
  // Each CTA pushes one contiguous chunk of the message (all vectors of all rows), so every
  // CTA of the grid pushes, however few vectors a CTA's threads could take.
  const size_t chunk = (vecs + gridDim.x - 1) / gridDim.x;
  const size_t first = (size_t)blockIdx.x * chunk + threadIdx.x;
  const size_t end = min((size_t)(blockIdx.x + 1) * chunk, vecs);
  // The first vector's load is issued before the failure check, so their latencies overlap.
  Vec x0 = first < end ? load_input(in, first, len, aligned) : Vec{};
  if (instance_failed(st)) return;
  const int buf = (int)(call % 3), prev = (int)((call + 2) % 3);
  const size_t mine = ((size_t)buf * peers + me) * slot;
  char* local = (char*)ncclGetLocalPointer(scratch, 0);

  // Push first, then wait: no CTA waits before every CTA of every peer has pushed all it
  // pushes. The CTAs past the rows only push.
  for (size_t v = first; v < end; v += blockDim.x) {
    Vec x = v == first ? x0 : load_input(in, v, len, aligned);
    scrub<T>(x);
    for (int p = 0; p < peers; p++) {
      store_volatile((char*)ncclGetLsaPointer(scratch, mine + v * 16, p), x);
    }
  }
  Waiter waiter;
  for (size_t row = blockIdx.x; row < rows; row += gridDim.x) {
    Vec r[kMaxPerThread], w[kMaxPerThread];
    load_row<T>(r, w, residual, weight, row, hidden, len, aligned);
    float h[kMaxPerThread][n];
    bool complete = true;
#pragma unroll
    for (int k = 0; k < kMaxPerThread; k++) {
      const size_t v = k * blockDim.x + threadIdx.x;
      if (v < vpr) {
        complete &= pull<T>(h[k], local, buf, peers, slot, row * vpr + v, waiter, st, timeout_ns);
      } else {
#pragma unroll
        for (int i = 0; i < n; i++) h[k][i] = 0.f;
      }
    }
    // Every thread of the CTA takes part in the norm's block sum, given up or not.
    if (!__syncthreads_and(complete)) break;
    norm_row<T>(h, r, w, residual, out, row, hidden, len, aligned, eps, shared);
  }
  end_flags_call<T>(local, buf, prev, peers, slot, vecs, st);
}

// The unfused epilogue, after an all-reduce that left the sums in `sums`: the same math as
// fused_flags from there on.
template <typename T>
__device__ void add_rms_norm(const T* sums, T* residual, const T* weight, T* out, size_t rows,
                             size_t hidden, float eps) {
  constexpr int n = 16 / sizeof(T);
  __shared__ float shared[32];
  const size_t vpr = hidden / n, len = rows * hidden;
  const bool aligned = all_aligned(sums, (const T*)residual, weight, (const T*)out);
  for (size_t row = blockIdx.x; row < rows; row += gridDim.x) {
    Vec r[kMaxPerThread], w[kMaxPerThread];
    load_row<T>(r, w, residual, weight, row, hidden, len, aligned);
    float h[kMaxPerThread][n];
#pragma unroll
    for (int k = 0; k < kMaxPerThread; k++) {
#pragma unroll
      for (int i = 0; i < n; i++) h[k][i] = 0.f;
      const size_t v = k * blockDim.x + threadIdx.x;
      if (v >= vpr) continue;
      accumulate<T>(h[k], load_input(sums, row * vpr + v, len, aligned));
    }
    norm_row<T>(h, r, w, residual, out, row, hidden, len, aligned, eps, shared);
  }
}
}  // namespace

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
  extern "C" __global__ void __launch_bounds__(512) nccl_rs_fused_add_rms_norm_##NAME(                               \
      const ncclDevComm* comm, ncclWindow_t scratch, size_t slot, const T* in, T* residual,   \
      const T* weight, T* out, size_t rows, size_t hidden, float eps, State* st,              \
      unsigned long long timeout_ns) {                                                        \
    fused_flags<T>(comm, scratch, slot, in, residual, weight, out, rows, hidden, eps, st,     \
                   timeout_ns);                                                               \
  }                                                                                           \
  extern "C" __global__ void __launch_bounds__(512) nccl_rs_add_rms_norm_##NAME(const T* sums, T* residual,          \
                                                         const T* weight, T* out, size_t rows,\
                                                         size_t hidden, float eps) {          \
    add_rms_norm<T>(sums, residual, weight, out, rows, hidden, eps);                          \
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
