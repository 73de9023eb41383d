/* Empty stand-in for CUDA's cuda_bf16.h (see cuda_runtime.h in this folder):
 * nccl.h includes it but uses none of its declarations in host prototypes. */
#ifndef NCCL_SYS_CUDA_BF16_STUB_H_
#define NCCL_SYS_CUDA_BF16_STUB_H_
#endif
