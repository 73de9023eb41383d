// A small-message all-reduce (sum of f32) written against NCCL's device API: every rank of
// the LSA team reads each peer's input window through load/store pointers, sums, and writes
// its own output window. Compiled at run time by nccl::device::kernel::Toolchain (nvcc with
// the loaded NCCL's headers); used through examples/device_allreduce/lsa.rs.
//
// Launch: one CTA per LSA barrier index (grid <= lsaBarrierCount), the same grid on every
// rank; `input` and `output` are symmetric windows of at least `count` floats.
#include <nccl_device.h>

extern "C" __global__ void lsa_allreduce_sum_f32(const ncclDevComm* comm, ncclWindow_t input,
                                                 ncclWindow_t output, size_t count) {
  // CTA b of every rank meets at barrier b: the peers' kernels have started, so their
  // inputs (written before on their streams) are complete and visible.
  ncclLsaBarrierSession<ncclCoopCta> bar{ncclCoopCta(), *comm, ncclTeamLsa(*comm),
                                         comm->lsaBarrier, blockIdx.x};
  bar.sync(ncclCoopCta(), cuda::memory_order_acquire);

  const int peers = comm->lsaSize;
  float* out = (float*)ncclGetLocalPointer(output, 0);
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t step = (size_t)gridDim.x * blockDim.x;
  if (count % 4 == 0) {
    // Windows start 4096-byte aligned: float4 loads and stores.
    const size_t count4 = count / 4;
    for (size_t i = first; i < count4; i += step) {
      float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int peer = 0; peer < peers; peer++) {
        const float4 v = ((const float4*)ncclGetLsaPointer(input, 0, peer))[i];
        sum.x += v.x;
        sum.y += v.y;
        sum.z += v.z;
        sum.w += v.w;
      }
      ((float4*)out)[i] = sum;
    }
  } else {
    for (size_t i = first; i < count; i += step) {
      float sum = 0.f;
      for (int peer = 0; peer < peers; peer++) {
        sum += ((const float*)ncclGetLsaPointer(input, 0, peer))[i];
      }
      out[i] = sum;
    }
  }

  // No rank leaves (and lets its next input be written) while a peer still reads it.
  bar.sync(ncclCoopCta(), cuda::memory_order_release);
}
