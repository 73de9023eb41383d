//! The CUDA kernels, compiled at run time with NVRTC.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, LaunchConfig};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};

use crate::Error;

/// Threads per block of every kernel; the `sum` kernel relies on it being exactly this.
pub const BLOCK: u32 = 256;

/// Naive f32 kernels, one thread per output element. Each sum over the samples of a batch runs
/// in a fixed order within one thread, so a run is deterministic on a given GPU. Sample `j` of
/// a batch is row `first + stride * j` of the rank's shard.
const KERNELS: &str = r#"
__device__ __forceinline__ long long sample_row(int first, int stride, int j) {
    return (long long)first + (long long)stride * j;
}

__device__ __forceinline__ float hidden_unit(const float* params, const float* xs, int h,
                                             int inputs) {
    const float* w = params + (long long)h * (inputs + 1);
    float z = w[inputs];
    for (int k = 0; k < inputs; ++k) z = fmaf(w[k], xs[k], z);
    return tanhf(z);
}

// act[j, h] = tanh(b1[h] + W1[h] . x_j)
extern "C" __global__ void hidden_forward(const float* params, const float* x, int first,
                                          int stride, int count, int hidden, int inputs,
                                          float* act) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= count * hidden) return;
    int j = t / hidden, h = t - j * hidden;
    act[t] = hidden_unit(params, x + sample_row(first, stride, j) * inputs, h, inputs);
}

// err[j] = b2 + w2 . act[j] - y_j   (the derivative of (f - y)^2 / 2 with respect to f)
extern "C" __global__ void output_forward(const float* params, const float* act, const float* y,
                                          int first, int stride, int count, int hidden,
                                          int inputs, float* err) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= count) return;
    const float* w2 = params + (long long)hidden * (inputs + 1);
    float out = w2[hidden];
    for (int h = 0; h < hidden; ++h) out = fmaf(w2[h], act[(long long)j * hidden + h], out);
    err[j] = out - y[sample_row(first, stride, j)];
}

// delta[j, h] = err[j] * w2[h] * (1 - act[j, h]^2)   (back through tanh)
extern "C" __global__ void hidden_backward(const float* params, const float* act,
                                           const float* err, int count, int hidden, int inputs,
                                           float* delta) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= count * hidden) return;
    int j = t / hidden, h = t - j * hidden;
    const float* w2 = params + (long long)hidden * (inputs + 1);
    float a = act[t];
    delta[t] = err[j] * w2[h] * (1.0f - a * a);
}

// grad[h, k] = scale * sum_j delta[j, h] * x_j[k]   (k == inputs: the bias, x = 1)
extern "C" __global__ void grad_layer1(const float* x, const float* delta, int first,
                                       int stride, int count, int hidden, int inputs,
                                       float scale, float* grad) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= hidden * (inputs + 1)) return;
    int h = t / (inputs + 1), k = t - h * (inputs + 1);
    float acc = 0.0f;
    for (int j = 0; j < count; ++j) {
        float xk = k == inputs ? 1.0f : x[sample_row(first, stride, j) * inputs + k];
        acc = fmaf(delta[(long long)j * hidden + h], xk, acc);
    }
    grad[t] = acc * scale;
}

// grad[w2[h]] = scale * sum_j err[j] * act[j, h]   (h == hidden: the bias b2)
extern "C" __global__ void grad_layer2(const float* act, const float* err, int count, int hidden,
                                       int inputs, float scale, float* grad) {
    int h = blockIdx.x * blockDim.x + threadIdx.x;
    if (h > hidden) return;
    float acc = 0.0f;
    for (int j = 0; j < count; ++j) {
        float a = h == hidden ? 1.0f : act[(long long)j * hidden + h];
        acc = fmaf(err[j], a, acc);
    }
    grad[(long long)hidden * (inputs + 1) + h] = acc * scale;
}

extern "C" __global__ void sgd(float* params, const float* grad, float lr, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) params[i] = fmaf(-lr, grad[i], params[i]);
}

// loss[j] = (f(x_j) - y_j)^2 / 2 over a whole shard, for the per-epoch loss.
extern "C" __global__ void sample_loss(const float* params, const float* x, const float* y,
                                       int count, int hidden, int inputs, double* loss) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= count) return;
    const float* xs = x + (long long)j * inputs;
    const float* w2 = params + (long long)hidden * (inputs + 1);
    float out = w2[hidden];
    for (int h = 0; h < hidden; ++h) out = fmaf(w2[h], hidden_unit(params, xs, h, inputs), out);
    double e = (double)out - (double)y[j];
    loss[j] = 0.5 * e * e;
}

// out[0] = sum of v[0..n), in a fixed order. One block of exactly 256 threads.
extern "C" __global__ void sum(const double* v, int n, double* out) {
    __shared__ double part[256];
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += v[i];
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[0] = part[0];
}
"#;

#[derive(Clone)]
pub struct Kernels {
    pub hidden_forward: CudaFunction,
    pub output_forward: CudaFunction,
    pub hidden_backward: CudaFunction,
    pub grad_layer1: CudaFunction,
    pub grad_layer2: CudaFunction,
    pub sgd: CudaFunction,
    pub sample_loss: CudaFunction,
    pub sum: CudaFunction,
}

impl Kernels {
    pub fn compile(ctx: &Arc<CudaContext>) -> Result<Kernels, Error> {
        // cudarc loads NVRTC on first use and panics when it is missing; ask first.
        let names = [
            "libnvrtc.so",
            "libnvrtc.so.13",
            "libnvrtc.so.12",
            "libnvrtc.so.11.2",
        ];
        // SAFETY: opening NVRTC runs only its own initialisers; the handle is closed at once.
        if !names
            .iter()
            .any(|name| unsafe { libloading::Library::new(*name) }.is_ok())
        {
            return Err(Error::Kernels(
                "NVRTC (libnvrtc.so) was not found, and this example compiles its kernels at \
                 run time: install the CUDA toolkit's NVRTC (or `pip install nvidia-cuda-nvrtc`) \
                 and add its lib directory (e.g. /usr/local/cuda/lib64) to LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let options = CompileOptions {
            name: Some("data_parallel.cu".into()),
            ..Default::default()
        };
        let ptx = compile_ptx_with_opts(KERNELS, options).map_err(|err| {
            Error::Kernels(match err {
                CompileError::CompileError { log, .. } => format!(
                    "NVRTC could not compile the kernels:\n{}",
                    log.to_string_lossy()
                ),
                other => format!("NVRTC failed: {other}"),
            })
        })?;
        let module = ctx.load_module(ptx)?;
        Ok(Kernels {
            hidden_forward: module.load_function("hidden_forward")?,
            output_forward: module.load_function("output_forward")?,
            hidden_backward: module.load_function("hidden_backward")?,
            grad_layer1: module.load_function("grad_layer1")?,
            grad_layer2: module.load_function("grad_layer2")?,
            sgd: module.load_function("sgd")?,
            sample_loss: module.load_function("sample_loss")?,
            sum: module.load_function("sum")?,
        })
    }
}

/// One thread per element, in blocks of [`BLOCK`].
pub fn grid(threads: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (threads.div_ceil(BLOCK as usize) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A size handed to a kernel's `int` parameter; [`Options::validate`] bounds them all.
pub fn int(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}
