// graph_smoke.cu: a workload of known shape, to check kernel_profile on a GPU before trusting
// its report on a real program (README.md, "Checking it on a GPU").
//
//   nvcc -O2 -arch=sm_90 -o /tmp/graph_smoke graph_smoke.cu
//   CUDA_INJECTION64_PATH=/path/libkernel_profile.so /tmp/graph_smoke
//
// Graph A: kp_spin(5 us), kp_spin(20 us), a 4 KiB memset, kp_spin_tmpl<float>(5 us); launched
//          20 times through the driver's cuGraphLaunch (as candle/cudarc does).
// Graph B: kp_spin(10 us); launched 10 times through the runtime's cudaGraphLaunch.
// Outside graphs: kp_spin(5 us) x 5, two 1 MiB HtoD copies, one DtoH copy.
// The spins wait on %globaltimer, so a kernel lasts about the time it is given.
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x)                                                                             \
    do {                                                                                  \
        cudaError_t e_ = (x);                                                             \
        if (e_ != cudaSuccess) {                                                          \
            fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                      \
            exit(1);                                                                      \
        }                                                                                 \
    } while (0)

__device__ void spin_ns(unsigned long long ns)
{
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < ns);
}
extern "C" __global__ void kp_spin(unsigned long long ns) { spin_ns(ns); }
template <typename T> __global__ void kp_spin_tmpl(T *out, unsigned long long ns)
{
    spin_ns(ns);
    *out = T(1);
}

int main()
{
    typedef CUresult (*launch_fn)(CUgraphExec, CUstream);
    launch_fn cu_graph_launch = NULL;
    cudaDriverEntryPointQueryResult q;
    CK(cudaGetDriverEntryPointByVersion("cuGraphLaunch", (void **)&cu_graph_launch, 12000,
                                        cudaEnableDefault, &q));
    if (!cu_graph_launch || q != cudaDriverEntryPointSuccess) return fprintf(stderr, "no cuGraphLaunch\n"), 1;

    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    float *dev, *host;
    CK(cudaMalloc(&dev, 1 << 20));
    CK(cudaMallocHost(&host, 1 << 20));

    cudaGraph_t ga, gb;
    cudaGraphExec_t ea, eb;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    kp_spin<<<1, 1, 0, s>>>(5000);
    kp_spin<<<1, 1, 0, s>>>(20000);
    CK(cudaMemsetAsync(dev, 0, 4096, s));
    kp_spin_tmpl<float><<<1, 1, 0, s>>>(dev, 5000);
    CK(cudaStreamEndCapture(s, &ga));
    CK(cudaGraphInstantiate(&ea, ga, 0));
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    kp_spin<<<1, 1, 0, s>>>(10000);
    CK(cudaStreamEndCapture(s, &gb));
    CK(cudaGraphInstantiate(&eb, gb, 0));

    for (int i = 0; i < 20; i++)
        if (cu_graph_launch((CUgraphExec)ea, (CUstream)s) != CUDA_SUCCESS) return fprintf(stderr, "cuGraphLaunch failed\n"), 1;
    CK(cudaStreamSynchronize(s));
    for (int i = 0; i < 10; i++) CK(cudaGraphLaunch(eb, s));
    CK(cudaStreamSynchronize(s));

    for (int i = 0; i < 5; i++) kp_spin<<<1, 1, 0, s>>>(5000);
    CK(cudaMemcpyAsync(dev, host, 1 << 20, cudaMemcpyHostToDevice, s));
    CK(cudaMemcpyAsync(dev, host, 1 << 20, cudaMemcpyHostToDevice, s));
    CK(cudaMemcpyAsync(host, dev, 4096, cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    printf("graph_smoke: done (graph A: 20 cuGraphLaunch, graph B: 10 cudaGraphLaunch)\n");
    return 0;
}
