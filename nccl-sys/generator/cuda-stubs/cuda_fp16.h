/* Empty stand-in for CUDA's cuda_fp16.h (see cuda_runtime.h in this folder):
 * nccl.h includes it but uses none of its declarations in host prototypes. */
#ifndef NCCL_SYS_CUDA_FP16_STUB_H_
#define NCCL_SYS_CUDA_FP16_STUB_H_
#endif
