/* Minimal stand-in for the CUDA runtime header, used only by the nccl-sys
 * bindings generator when no CUDA toolkit is given (--cuda-home / CUDA_HOME).
 * nccl.h needs just these two handle types, CUDART_VERSION and size_t; the handles are
 * declared exactly as CUDA's driver_types.h declares them (pointers to opaque
 * structs), so the generated Rust types are identical either way. */
#ifndef NCCL_SYS_CUDA_RUNTIME_STUB_H_
#define NCCL_SYS_CUDA_RUNTIME_STUB_H_

#include <stddef.h> /* the real header provides size_t too */

#define CUDART_VERSION 13000

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;

#endif
