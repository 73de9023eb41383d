//! Data-parallel training of a small MLP: the use case this crate grew from.
//!
//! Every rank holds a full copy of a 2-layer MLP (`64 -> hidden -> 1`, tanh), trains it with
//! SGD on its own shard of a synthetic regression dataset, and keeps the copies in lockstep
//! with NCCL:
//!
//! * rank 0 initialises the parameters and `broadcast_in_place` hands them to everyone;
//! * every step each rank computes the gradient of its part of the global batch with NVRTC
//!   kernels, and one `all_reduce_in_place(.., ReduceOp::Avg)` (or a [`PreMulSum`] by `1/n`
//!   with `--premulsum`) over the flattened gradient turns it into the global-batch gradient;
//! * every epoch the loss over the whole dataset is a `Sum` all-reduce of per-rank sums.
//!
//! The example then checks itself and prints PASS/FAIL lines (and exits 1 on a FAIL): the
//! broadcast delivered rank 0's parameters bit for bit; the first averaged gradient equals a
//! float64 host computation on the global batch; all ranks end with bitwise-identical
//! parameters; and rank 0, training the same model alone on its GPU with no NCCL, ends within
//! a stated tolerance of the N-rank run.
//!
//! Runs unchanged under `mpirun -np N`, `srun -n N`, a torchrun-style launcher, or with no
//! launcher at all, in which case it starts one process per visible GPU itself:
//!
//! ```text
//! cargo run --release --example data_parallel                  # one process per local GPU
//! mpirun --allow-run-as-root -np 4 target/release/examples/data_parallel
//! srun -n 4 --gpus-per-task=1 target/release/examples/data_parallel
//! cargo run --release --example data_parallel -- --epochs 40 --hidden 256 --premulsum
//! ```
//!
//! # Why the N-rank run can match the 1-GPU run
//!
//! The global batch of every step is the same set of samples whatever the number of ranks,
//! and each rank takes `batch / n` of it. With `S = samples / batch` steps per epoch, step `s`
//! uses the samples `s, s + S, s + 2S, ...` of the dataset. Rank `r` holds the contiguous
//! shard `r * samples/n .. (r+1) * samples/n`, which is exactly `batch / n` of those (`samples`
//! is a multiple of `batch`, and `batch` of `n`). Every rank scales its gradient sum by
//! `n / batch`; averaging over the `n` ranks gives `1 / batch` times the sum over the global
//! batch, the gradient a single GPU computes. The two runs differ only in the order of float
//! additions, hence the tolerance of the last check.
//!
//! The defaults (`--samples 53760 --batch 840`) divide evenly for every world size from 1 to
//! 8; other sizes must keep `samples % batch == 0` and `batch % n == 0`.
//!
//! The model is tiny (8449 parameters at the default width), so a step costs a few kernel
//! launches and one small all-reduce, and the time per epoch mostly measures latency, not
//! arithmetic: raise `--hidden` and `--batch` to see the compute part shrink with more GPUs.

use std::fmt;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};
use nccl::bootstrap::{spawn_local, BootstrapError};
use nccl::{Comm, PreMulSum, ReduceOp};

/// Input features per sample.
const INPUTS: usize = 64;
/// Hidden units of the teacher network that produces the targets.
const TEACHER_HIDDEN: usize = 8;
/// Amplitude of the label noise, uniform in `[-NOISE, NOISE]`.
const NOISE: f64 = 0.01;
/// Seed of everything random: the dataset, the teacher and the initial parameters.
const SEED: u64 = 0x5eed_da7a_9a2a_11e1;

/// N ranks vs 1 GPU: `max |p_N - p_1| <= PARAM_TOLERANCE * max(1, max |p_1|)`. The runs differ
/// only in the order of float additions, which moves the parameters by about 1e-6 at the
/// defaults (a float32 CPU model of these kernels gives 5e-7), so this leaves a wide margin; a
/// real bug (a wrong scale, a rank's gradient left out) changes the trajectory outright.
const PARAM_TOLERANCE: f32 = 1e-4;
/// N ranks vs 1 GPU: `|loss_N - loss_1| <= LOSS_TOLERANCE * loss_1`, every epoch.
const LOSS_TOLERANCE: f64 = 1e-4;
/// First averaged gradient vs float64 on the host: `max |g - g64| <= GRAD_TOLERANCE * max |g64|`.
const GRAD_TOLERANCE: f64 = 1e-4;

/// Threads per block of every kernel; the `sum` kernel relies on it being exactly this.
const BLOCK: u32 = 256;

const USAGE: &str = "\
usage: data_parallel [--epochs N] [--samples D] [--batch B] [--lr LR] [--hidden H] [--premulsum]

  --epochs N     passes over the dataset (default 20)
  --samples D    dataset size, a multiple of the batch (default 53760)
  --batch B      global batch per step, a multiple of the number of ranks (default 840)
  --lr LR        SGD learning rate (default 0.5)
  --hidden H     hidden units of the MLP 64 -> H -> 1 (default 128)
  --premulsum    average gradients with a PreMulSum by 1/n instead of ncclAvg";

#[derive(Debug, Clone)]
struct Options {
    epochs: usize,
    samples: usize,
    batch: usize,
    lr: f32,
    hidden: usize,
    premulsum: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            epochs: 20,
            // 840 = lcm(1..=8): the defaults work for every world size up to 8.
            samples: 64 * 840,
            batch: 840,
            lr: 0.5,
            hidden: 128,
            premulsum: false,
        }
    }
}

/// What the command line asked for.
enum Command {
    Run(Options),
    Help,
}

fn parse_options(args: impl IntoIterator<Item = String>) -> Result<Command, String> {
    let mut options = Options::default();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        // `--flag value` and `--flag=value` both work.
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => (flag.to_owned(), Some(value.into())),
            _ => (arg, None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "--epochs" => options.epochs = number(&flag, &value()?)?,
            "--samples" => options.samples = number(&flag, &value()?)?,
            "--batch" => options.batch = number(&flag, &value()?)?,
            "--hidden" => options.hidden = number(&flag, &value()?)?,
            "--lr" => options.lr = number(&flag, &value()?)?,
            "--premulsum" if inline.is_none() => options.premulsum = true,
            "--premulsum" => return Err("--premulsum takes no value".into()),
            "-h" | "--help" => return Ok(Command::Help),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    options.validate()?;
    Ok(Command::Run(options))
}

fn number<T: std::str::FromStr>(flag: &str, text: &str) -> Result<T, String>
where
    T::Err: fmt::Display,
{
    text.parse().map_err(|e| format!("{flag} {text:?}: {e}"))
}

impl Options {
    /// Checks what does not depend on the number of ranks.
    fn validate(&self) -> Result<(), String> {
        if self.epochs == 0 || self.samples == 0 || self.batch == 0 || self.hidden == 0 {
            return Err("--epochs, --samples, --batch and --hidden must be at least 1".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(format!("--lr must be a positive number, got {}", self.lr));
        }
        if self.samples % self.batch != 0 {
            return Err(format!(
                "--samples {} is not a multiple of --batch {}: every step must see a full \
                 global batch",
                self.samples, self.batch
            ));
        }
        // Kernels index with 32-bit counts; the sample offsets themselves are 64-bit.
        let fits = |n: usize| i32::try_from(n).is_ok();
        if !fits(self.samples)
            || !fits(self.batch.saturating_mul(self.hidden))
            || !fits(self.hidden.saturating_mul(INPUTS + 2))
        {
            return Err("--samples, --batch x --hidden or --hidden is too large".into());
        }
        Ok(())
    }

    /// Checks what depends on the number of ranks.
    fn validate_for(&self, ranks: usize) -> Result<(), String> {
        if self.batch % ranks != 0 {
            return Err(format!(
                "--batch {} is not a multiple of the {ranks} ranks: every rank must take the \
                 same share of the global batch (try --batch {} --samples {})",
                self.batch,
                self.batch.next_multiple_of(ranks),
                self.samples / self.batch * self.batch.next_multiple_of(ranks)
            ));
        }
        Ok(())
    }

    fn steps_per_epoch(&self) -> usize {
        self.samples / self.batch
    }
}

/// Why the example stopped.
#[derive(Debug)]
enum Error {
    /// NCCL, the CUDA driver or the bootstrap failed.
    Nccl(nccl::Error),
    /// The kernels could not be compiled (NVRTC missing or a compile error).
    Kernels(String),
    /// The options do not fit this job (exit status 2, like a bad flag).
    Usage(String),
    /// Checks failed; the FAIL lines were printed by rank 0.
    Failed { rank: usize, count: u32 },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Nccl(err) => write!(f, "{err}"),
            Error::Kernels(msg) | Error::Usage(msg) => f.write_str(msg),
            Error::Failed { rank: 0, count } => write!(f, "{count} check(s) failed"),
            Error::Failed { rank, count } => write!(
                f,
                "rank {rank}: {count} check(s) failed (rank 0 printed the FAIL lines)"
            ),
        }
    }
}

impl From<nccl::Error> for Error {
    fn from(err: nccl::Error) -> Self {
        Error::Nccl(err)
    }
}

impl From<DriverError> for Error {
    fn from(err: DriverError) -> Self {
        Error::Nccl(err.into())
    }
}

impl From<BootstrapError> for Error {
    fn from(err: BootstrapError) -> Self {
        Error::Nccl(err.into())
    }
}

// ---------------------------------------------------------------------------------------------
// Synthetic data, identical on every rank
// ---------------------------------------------------------------------------------------------

/// SplitMix64's output function: a good 64-bit mixer, so `mix(key)` is a counter-based RNG.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Uniform in `[-1, 1)`, a pure function of `(stream, index)`: any rank can produce any sample
/// (or parameter) on its own, with no state to keep in sync and bitwise the same everywhere.
fn uniform(stream: u64, index: u64) -> f64 {
    let bits = mix(SEED ^ mix(stream.wrapping_mul(0x632b_e59b_d9b4_e019) ^ index));
    (bits >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
}

/// Random streams, one per kind of value.
mod streams {
    pub const TEACHER: u64 = 1;
    pub const FEATURES: u64 = 2;
    pub const NOISE: u64 = 3;
    pub const LAYER1: u64 = 4;
    pub const LAYER2: u64 = 5;
}

/// The network that labels the data: `y = c + sum_h v_h softsign(b_h + W_h . x) + noise`.
/// Softsign (`z / (1 + |z|)`) rather than tanh so that the labels use only correctly rounded
/// IEEE operations and come out bitwise the same on every machine, whatever its libm.
struct Teacher {
    w: Vec<f64>,
    b: Vec<f64>,
    v: Vec<f64>,
    c: f64,
}

impl Teacher {
    fn new() -> Self {
        let mut next = (0u64..).map(|i| uniform(streams::TEACHER, i));
        let scale = 2.0 / (INPUTS as f64).sqrt(); // pre-activations of about unit size
        let w = next
            .by_ref()
            .take(TEACHER_HIDDEN * INPUTS)
            .map(|u| u * scale);
        let w: Vec<f64> = w.collect();
        let b: Vec<f64> = next.by_ref().take(TEACHER_HIDDEN).collect();
        let v: Vec<f64> = next.by_ref().take(TEACHER_HIDDEN).collect();
        let c = next.next().unwrap_or_default();
        Teacher { w, b, v, c }
    }

    fn label(&self, x: &[f32]) -> f64 {
        let mut y = self.c;
        for h in 0..TEACHER_HIDDEN {
            let row = &self.w[h * INPUTS..(h + 1) * INPUTS];
            let z = self.b[h]
                + row
                    .iter()
                    .zip(x)
                    .map(|(w, &x)| w * f64::from(x))
                    .sum::<f64>();
            y += self.v[h] * (z / (1.0 + z.abs()));
        }
        y
    }
}

/// Samples `range` of the global dataset: features row-major (`INPUTS` per sample), labels.
struct Data {
    x: Vec<f32>,
    y: Vec<f32>,
}

impl Data {
    fn generate(teacher: &Teacher, range: std::ops::Range<usize>) -> Data {
        let mut x = Vec::with_capacity(range.len() * INPUTS);
        let mut y = Vec::with_capacity(range.len());
        for i in range {
            let start = x.len();
            // Unit-variance features: uniform in [-sqrt 3, sqrt 3).
            x.extend((0..INPUTS).map(|k| {
                (3f64.sqrt() * uniform(streams::FEATURES, (i * INPUTS + k) as u64)) as f32
            }));
            let noise = NOISE * uniform(streams::NOISE, i as u64);
            y.push((teacher.label(&x[start..]) + noise) as f32);
        }
        Data { x, y }
    }
}

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

/// The parameters are one flat buffer, so that the gradient is one buffer too and a step needs
/// a single all-reduce:
///
/// * `[0, H*(IN+1))`: layer 1, row `h` = `W1[h][0..IN]` then the bias `b1[h]`;
/// * `[H*(IN+1), H*(IN+1) + H)`: layer 2 weights `w2[h]`;
/// * `H*(IN+1) + H`: layer 2 bias `b2`.
#[derive(Debug, Clone, Copy)]
struct Shape {
    hidden: usize,
}

impl Shape {
    fn layer2(self) -> usize {
        self.hidden * (INPUTS + 1)
    }

    fn params(self) -> usize {
        self.layer2() + self.hidden + 1
    }

    /// LeCun-uniform weights (unit-variance activations for unit-variance inputs), zero biases.
    fn initial_params(self) -> Vec<f32> {
        let mut p = vec![0f32; self.params()];
        let a1 = (3.0 / INPUTS as f64).sqrt();
        for h in 0..self.hidden {
            for k in 0..INPUTS {
                let i = h * (INPUTS + 1) + k;
                p[i] = (a1 * uniform(streams::LAYER1, i as u64)) as f32;
            }
        }
        let a2 = (3.0 / self.hidden as f64).sqrt();
        for h in 0..self.hidden {
            p[self.layer2() + h] = (a2 * uniform(streams::LAYER2, h as u64)) as f32;
        }
        p
    }

    /// The gradient of the mean of `(f(x) - y)^2 / 2` over `samples`, in float64: an
    /// independent check of the kernels and of the gradient averaging.
    fn gradient_f64(self, params: &[f32], data: &Data, samples: &[usize]) -> Vec<f64> {
        let h_n = self.hidden;
        let p: Vec<f64> = params.iter().map(|&v| f64::from(v)).collect();
        let (l2, b2) = (self.layer2(), self.layer2() + h_n);
        let mut g = vec![0f64; self.params()];
        let mut act = vec![0f64; h_n];
        for &s in samples {
            let x = &data.x[s * INPUTS..(s + 1) * INPUTS];
            let mut out = p[b2];
            for (h, a) in act.iter_mut().enumerate() {
                let row = &p[h * (INPUTS + 1)..(h + 1) * (INPUTS + 1)];
                let z = row[INPUTS]
                    + row
                        .iter()
                        .zip(x)
                        .map(|(w, &x)| w * f64::from(x))
                        .sum::<f64>();
                *a = z.tanh();
                out += p[l2 + h] * *a;
            }
            let err = out - f64::from(data.y[s]);
            g[b2] += err;
            for (h, &a) in act.iter().enumerate() {
                g[l2 + h] += err * a;
                let delta = err * p[l2 + h] * (1.0 - a * a);
                let row = &mut g[h * (INPUTS + 1)..(h + 1) * (INPUTS + 1)];
                for (gk, &xk) in row.iter_mut().zip(x) {
                    *gk += delta * f64::from(xk);
                }
                row[INPUTS] += delta;
            }
        }
        let scale = 1.0 / samples.len() as f64;
        g.iter_mut().for_each(|v| *v *= scale);
        g
    }
}

// ---------------------------------------------------------------------------------------------
// GPU kernels
// ---------------------------------------------------------------------------------------------

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
struct Kernels {
    hidden_forward: CudaFunction,
    output_forward: CudaFunction,
    hidden_backward: CudaFunction,
    grad_layer1: CudaFunction,
    grad_layer2: CudaFunction,
    sgd: CudaFunction,
    sample_loss: CudaFunction,
    sum: CudaFunction,
}

impl Kernels {
    fn compile(ctx: &Arc<CudaContext>) -> Result<Kernels, Error> {
        // cudarc loads NVRTC on first use and panics when it is missing; ask first.
        // SAFETY: only tries to dlopen libnvrtc under its usual names.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
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
fn grid(threads: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (threads.div_ceil(BLOCK as usize) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A size handed to a kernel's `int` parameter; [`Options::validate`] bounds them all.
fn int(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// One copy of the model with its data on one GPU: a rank's replica in the data-parallel run,
/// or the whole job in the 1-GPU reference.
struct Replica {
    stream: Arc<CudaStream>,
    kernels: Kernels,
    shape: Shape,
    /// Samples held (the shard).
    shard: usize,
    /// Samples per step: this replica's part of the global batch.
    batch: usize,
    /// Steps per epoch; also the stride between a step's samples in the shard.
    steps: usize,
    x: CudaSlice<f32>,
    y: CudaSlice<f32>,
    params: CudaSlice<f32>,
    grads: CudaSlice<f32>,
    act: CudaSlice<f32>,
    delta: CudaSlice<f32>,
    err: CudaSlice<f32>,
    losses: CudaSlice<f64>,
    loss_sum: CudaSlice<f64>,
}

impl Replica {
    fn new(
        stream: &Arc<CudaStream>,
        kernels: &Kernels,
        shape: Shape,
        data: &Data,
        batch: usize,
        params: &[f32],
    ) -> Result<Replica, Error> {
        let shard = data.y.len();
        let width = batch * shape.hidden;
        Ok(Replica {
            stream: stream.clone(),
            kernels: kernels.clone(),
            shape,
            shard,
            batch,
            steps: shard / batch,
            x: stream.clone_htod(&data.x)?,
            y: stream.clone_htod(&data.y)?,
            params: stream.clone_htod(params)?,
            grads: stream.alloc_zeros(shape.params())?,
            act: stream.alloc_zeros(width)?,
            delta: stream.alloc_zeros(width)?,
            err: stream.alloc_zeros(batch)?,
            losses: stream.alloc_zeros(shard)?,
            loss_sum: stream.alloc_zeros(1)?,
        })
    }

    /// Enqueues the gradient of this replica's part of step `step`'s batch into `grads`,
    /// scaled by `scale` (`n / global batch`, so that averaging over `n` ranks gives the mean
    /// over the global batch).
    fn gradients(&mut self, step: usize, scale: f32) -> Result<(), Error> {
        let (first, stride, count) = (int(step), int(self.steps), int(self.batch));
        let (hidden, inputs) = (int(self.shape.hidden), int(INPUTS));
        let width = self.batch * self.shape.hidden;
        let s = &self.stream;
        let k = &self.kernels;

        let mut launch = s.launch_builder(&k.hidden_forward);
        launch
            .arg(&self.params)
            .arg(&self.x)
            .arg(&first)
            .arg(&stride)
            .arg(&count)
            .arg(&hidden)
            .arg(&inputs)
            .arg(&mut self.act);
        // SAFETY: the arguments match the kernel's parameters in type and order; it reads
        // rows first + stride*j < shard of `x` (j < batch, first < steps, steps * batch ==
        // shard) and writes batch * hidden elements of `act`, which has that many.
        unsafe { launch.launch(grid(width)) }?;

        let mut launch = s.launch_builder(&k.output_forward);
        launch
            .arg(&self.params)
            .arg(&self.act)
            .arg(&self.y)
            .arg(&first)
            .arg(&stride)
            .arg(&count)
            .arg(&hidden)
            .arg(&inputs)
            .arg(&mut self.err);
        // SAFETY: as above; `err` holds `batch` elements, `params` holds shape.params().
        unsafe { launch.launch(grid(self.batch)) }?;

        let mut launch = s.launch_builder(&k.hidden_backward);
        launch
            .arg(&self.params)
            .arg(&self.act)
            .arg(&self.err)
            .arg(&count)
            .arg(&hidden)
            .arg(&inputs)
            .arg(&mut self.delta);
        // SAFETY: as above; `delta` has the batch * hidden elements of `act`.
        unsafe { launch.launch(grid(width)) }?;

        let mut launch = s.launch_builder(&k.grad_layer1);
        launch
            .arg(&self.x)
            .arg(&self.delta)
            .arg(&first)
            .arg(&stride)
            .arg(&count)
            .arg(&hidden)
            .arg(&inputs)
            .arg(&scale)
            .arg(&mut self.grads);
        // SAFETY: as above; it writes grads[0 .. hidden * (inputs + 1)), inside shape.params().
        unsafe { launch.launch(grid(self.shape.layer2())) }?;

        let mut launch = s.launch_builder(&k.grad_layer2);
        launch
            .arg(&self.act)
            .arg(&self.err)
            .arg(&count)
            .arg(&hidden)
            .arg(&inputs)
            .arg(&scale)
            .arg(&mut self.grads);
        // SAFETY: as above; it writes the last hidden + 1 elements of `grads`.
        unsafe { launch.launch(grid(self.shape.hidden + 1)) }?;
        Ok(())
    }

    /// Enqueues `params -= lr * grads`.
    fn apply(&mut self, lr: f32) -> Result<(), Error> {
        let n = int(self.shape.params());
        let mut launch = self.stream.launch_builder(&self.kernels.sgd);
        launch
            .arg(&mut self.params)
            .arg(&self.grads)
            .arg(&lr)
            .arg(&n);
        // SAFETY: matching arguments; `params` and `grads` both hold `n` elements.
        unsafe { launch.launch(grid(self.shape.params())) }?;
        Ok(())
    }

    /// Enqueues the sum of the per-sample losses over the shard into `loss_sum`.
    fn loss(&mut self) -> Result<(), Error> {
        let (count, hidden, inputs) = (int(self.shard), int(self.shape.hidden), int(INPUTS));
        let mut launch = self.stream.launch_builder(&self.kernels.sample_loss);
        launch
            .arg(&self.params)
            .arg(&self.x)
            .arg(&self.y)
            .arg(&count)
            .arg(&hidden)
            .arg(&inputs)
            .arg(&mut self.losses);
        // SAFETY: matching arguments; it reads `shard` rows of `x` and `y` and writes `shard`
        // elements of `losses`, which all have that many.
        unsafe { launch.launch(grid(self.shard)) }?;

        let mut launch = self.stream.launch_builder(&self.kernels.sum);
        launch.arg(&self.losses).arg(&count).arg(&mut self.loss_sum);
        let one_block = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matching arguments; one block of exactly 256 threads, the size of the
        // kernel's shared array; it reads `shard` elements and writes one.
        unsafe { launch.launch(one_block) }?;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Training
// ---------------------------------------------------------------------------------------------

/// How the ranks average their gradients.
enum Averaging<'c> {
    Avg,
    PreMulSum(PreMulSum<'c, f32>),
}

impl Averaging<'_> {
    fn name(&self) -> &'static str {
        match self {
            Averaging::Avg => "ncclAvg",
            Averaging::PreMulSum(_) => "PreMulSum(1/n)",
        }
    }
}

/// The communicator side of a replica: `None` for the 1-GPU reference.
type Link<'a, 'c> = Option<(&'a Comm, &'a Averaging<'c>)>;

/// Waits for the replica's stream: through the communicator when there is one, which returns
/// with NCCL's error instead of hanging if a peer died.
fn sync(replica: &Replica, link: &Link<'_, '_>) -> Result<(), Error> {
    match link {
        Some((comm, _)) => comm.synchronize()?,
        None => replica.stream.synchronize()?,
    }
    Ok(())
}

/// Loss over the whole dataset: the sum over the shards, divided by the dataset size.
fn global_loss(replica: &mut Replica, link: &Link<'_, '_>, samples: usize) -> Result<f64, Error> {
    replica.loss()?;
    if let Some((comm, _)) = link {
        comm.all_reduce_in_place(&mut replica.loss_sum, ReduceOp::Sum)?;
    }
    sync(replica, link)?;
    let sum = replica.stream.clone_dtoh(&replica.loss_sum)?;
    Ok(sum[0] / samples as f64)
}

/// Enqueues step `s`'s gradient: this replica's part, then the average over the ranks. Every
/// rank scales its sum by `n / global batch`, so the average is the mean over the global batch.
fn gradient(
    replica: &mut Replica,
    link: &Link<'_, '_>,
    s: usize,
    options: &Options,
) -> Result<(), Error> {
    let ranks = link.map_or(1, |(comm, _)| comm.size());
    replica.gradients(s, ranks as f32 / options.batch as f32)?;
    if let Some((comm, averaging)) = link {
        // One all-reduce per step: the whole gradient is one flat buffer.
        match averaging {
            Averaging::Avg => comm.all_reduce_in_place(&mut replica.grads, ReduceOp::Avg)?,
            Averaging::PreMulSum(op) => comm.all_reduce_in_place(&mut replica.grads, op)?,
        }
    }
    Ok(())
}

struct Epoch {
    loss: f64,
    /// Training steps only.
    train_s: f64,
    /// Steps plus the loss evaluation.
    total_s: f64,
}

/// Trains for `options.epochs`, returning the loss before training and each epoch's record.
fn train(
    replica: &mut Replica,
    link: &Link<'_, '_>,
    options: &Options,
    mut on_epoch: impl FnMut(usize, &Epoch),
) -> Result<(f64, Vec<Epoch>), Error> {
    let initial = global_loss(replica, link, options.samples)?;
    let mut epochs = Vec::with_capacity(options.epochs);
    for epoch in 1..=options.epochs {
        let start = Instant::now();
        for s in 0..replica.steps {
            gradient(replica, link, s, options)?;
            replica.apply(options.lr)?;
        }
        sync(replica, link)?;
        let train_s = start.elapsed().as_secs_f64();
        let loss = global_loss(replica, link, options.samples)?;
        let record = Epoch {
            loss,
            train_s,
            total_s: start.elapsed().as_secs_f64(),
        };
        on_epoch(epoch, &record);
        epochs.push(record);
    }
    Ok((initial, epochs))
}

/// The largest of `values`, or NaN if any is NaN (`f64::max` would drop it, and a NaN must fail
/// a check, never pass it).
fn largest(values: impl IntoIterator<Item = f64>) -> f64 {
    values.into_iter().fold(0.0, |m: f64, v| {
        if m.is_nan() || v.is_nan() {
            f64::NAN
        } else {
            m.max(v)
        }
    })
}

/// Samples per second over the epochs given.
fn throughput(epochs: &[Epoch], samples: usize) -> f64 {
    let seconds: f64 = epochs.iter().map(|e| e.train_s).sum();
    (epochs.len() * samples) as f64 / seconds
}

/// "1 rank", "4 ranks".
fn ranks(n: usize) -> String {
    format!("{n} rank{}", if n == 1 { "" } else { "s" })
}

/// Counts failed checks; rank 0 prints every verdict.
struct Verdicts {
    print: bool,
    failed: u32,
}

impl Verdicts {
    fn check(&mut self, ok: bool, what: fmt::Arguments<'_>) {
        if !ok {
            self.failed += 1;
        }
        if self.print {
            println!("{} {what}", if ok { "PASS" } else { "FAIL" });
        }
    }
}

/// Everything between joining the communicator and leaving it. Every rank makes the same
/// NCCL calls in the same order; returns the number of failed checks, which all ranks agree on.
fn session(
    comm: &Comm,
    stream: &Arc<CudaStream>,
    kernels: &Kernels,
    options: &Options,
) -> Result<u32, Error> {
    let (rank, n) = (comm.rank(), comm.size());
    let shape = Shape {
        hidden: options.hidden,
    };
    let averaging = if options.premulsum {
        Averaging::PreMulSum(PreMulSum::with_host_scalar(comm, 1.0 / n as f32)?)
    } else {
        Averaging::Avg
    };
    let link: Link<'_, '_> = Some((comm, &averaging));
    let shard_len = options.samples / n;
    let shard = rank * shard_len..(rank + 1) * shard_len;
    if rank == 0 {
        println!(
            "data_parallel: MLP {INPUTS} -> {} -> 1 (tanh), {} parameters; {} samples, global \
             batch {}, lr {}, {} epochs",
            shape.hidden,
            shape.params(),
            options.samples,
            options.batch,
            options.lr,
            options.epochs
        );
        println!(
            "{}, NCCL {}, gradients averaged by {}; per rank: {shard_len} samples, {} per step, \
             {} steps per epoch",
            ranks(n),
            nccl::version()?,
            averaging.name(),
            options.batch / n,
            options.steps_per_epoch()
        );
    }
    println!(
        "rank {rank}/{n}: GPU {}, samples {}..{}",
        comm.device(),
        shard.start,
        shard.end
    );
    let mut verdicts = Verdicts {
        print: rank == 0,
        failed: 0,
    };

    let teacher = Teacher::new();
    let data = Data::generate(&teacher, shard);
    // Rank 0 also needs the whole dataset, for the host gradient check and the reference.
    let full = (rank == 0).then(|| Data::generate(&teacher, 0..options.samples));
    // Rank 0 draws the initial parameters; the others start from garbage (NaN) and receive rank
    // 0's values in the broadcast. (They compute the expected values too, but only to check
    // what arrived; a real job would load rank 0's checkpoint instead.)
    let init = shape.initial_params();
    let start = if rank == 0 {
        init.clone()
    } else {
        vec![f32::NAN; init.len()]
    };
    let mut replica = Replica::new(stream, kernels, shape, &data, options.batch / n, &start)?;
    comm.broadcast_in_place(&mut replica.params, 0)?;
    if !check_broadcast(comm, &replica, &init, &mut verdicts)? {
        return Ok(verdicts.failed);
    }

    // The first averaged gradient is the gradient of global batch 0, which rank 0 recomputes
    // in float64 on the host: this checks the kernels and the averaging in one go.
    gradient(&mut replica, &link, 0, options)?;
    sync(&replica, &link)?;
    if let Some(full) = &full {
        check_gradient(&replica, full, &init, options, &mut verdicts)?;
    }

    let print = rank == 0;
    let (initial, epochs) = train(&mut replica, &link, options, |epoch, e| {
        if print {
            println!(
                "epoch {epoch:>3}/{}  loss {:.9}  {:8.3} ms  (train {:.3} ms, {:.2} M samples/s)",
                options.epochs,
                e.loss,
                e.total_s * 1e3,
                e.train_s * 1e3,
                options.samples as f64 / e.train_s / 1e6
            );
        }
    })?;
    let final_loss = epochs.last().map_or(initial, |e| e.loss);
    if rank == 0 {
        let steady = match epochs.get(1..) {
            Some(rest) if !rest.is_empty() => format!(
                " (epochs 2..{}: {:.2} M samples/s)",
                epochs.len(),
                throughput(rest, options.samples) / 1e6
            ),
            _ => String::new(),
        };
        println!(
            "{}: {} epochs in {:.1} ms of training, {:.2} M samples/s{steady}",
            ranks(n),
            epochs.len(),
            epochs.iter().map(|e| e.train_s).sum::<f64>() * 1e3,
            throughput(&epochs, options.samples) / 1e6
        );
    }
    verdicts.check(
        final_loss < initial,
        format_args!("training: the loss fell from {initial:.9} to {final_loss:.9}"),
    );

    let steps = epochs.len() * options.steps_per_epoch();
    let params = check_identical(comm, &replica, steps, &mut verdicts)?;
    drop(replica);

    // Meanwhile the other ranks wait in the broadcast below.
    if let Some(full) = &full {
        let run = Run {
            ranks: n,
            params,
            epochs,
        };
        check_reference(comm, kernels, options, full, &init, &run, &mut verdicts)?;
    }

    // Rank 0's count covers every check; hand it to all ranks so that they exit alike.
    let mut failed = stream.clone_htod(&[verdicts.failed])?;
    comm.broadcast_in_place(&mut failed, 0)?;
    comm.synchronize()?;
    Ok(stream.clone_dtoh(&failed)?[0])
}

/// After the broadcast: did every rank receive rank 0's parameters bit for bit? Every rank
/// learns the total number of wrong values, so that all take the same branch afterwards.
fn check_broadcast(
    comm: &Comm,
    replica: &Replica,
    init: &[f32],
    verdicts: &mut Verdicts,
) -> Result<bool, Error> {
    let stream = &replica.stream;
    comm.synchronize()?;
    let received = stream.clone_dtoh(&replica.params)?;
    let wrong = received
        .iter()
        .zip(init)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    let mut total = stream.clone_htod(&[wrong as u64])?;
    comm.all_reduce_in_place(&mut total, ReduceOp::Sum)?;
    comm.synchronize()?;
    let total = stream.clone_dtoh(&total)?[0];
    verdicts.check(
        total == 0,
        format_args!(
            "broadcast: every rank holds rank 0's {} initial parameters bit for bit (values \
             differing, all ranks together: {total})",
            init.len()
        ),
    );
    Ok(total == 0)
}

/// Rank 0: the averaged gradient now in `replica.grads` against float64 on the host, over the
/// samples of global batch 0 (`0, S, 2S, ...`).
fn check_gradient(
    replica: &Replica,
    full: &Data,
    init: &[f32],
    options: &Options,
    verdicts: &mut Verdicts,
) -> Result<(), Error> {
    let steps = options.steps_per_epoch();
    let batch0: Vec<usize> = (0..options.batch).map(|j| j * steps).collect();
    let expected = replica.shape.gradient_f64(init, full, &batch0);
    let got = replica.stream.clone_dtoh(&replica.grads)?;
    let scale = largest(expected.iter().map(|g| g.abs()));
    let err = largest(
        got.iter()
            .zip(&expected)
            .map(|(&a, &b)| (f64::from(a) - b).abs()),
    );
    verdicts.check(
        err <= GRAD_TOLERANCE * scale,
        format_args!(
            "gradient: the averaged gradient of batch 0 matches float64 on the host (max error \
             {err:.2e} <= {GRAD_TOLERANCE:.0e} x max |g| {scale:.3e})"
        ),
    );
    Ok(())
}

/// Gathers every rank's parameters and compares them bit for bit with this rank's, which it
/// returns. All ranks receive the same gathered buffer, so they reach the same verdict.
fn check_identical(
    comm: &Comm,
    replica: &Replica,
    steps: usize,
    verdicts: &mut Verdicts,
) -> Result<Vec<f32>, Error> {
    let stream = &replica.stream;
    let n = comm.size();
    let mut gathered = stream.alloc_zeros::<f32>(n * replica.params.len())?;
    comm.all_gather(&replica.params, &mut gathered)?;
    comm.synchronize()?;
    let params = stream.clone_dtoh(&replica.params)?;
    let gathered = stream.clone_dtoh(&gathered)?;
    let differing: Vec<usize> = gathered
        .chunks(params.len())
        .enumerate()
        .filter(|(_, other)| {
            other
                .iter()
                .zip(&params)
                .any(|(a, b)| a.to_bits() != b.to_bits())
        })
        .map(|(r, _)| r)
        .collect();
    let detail = if differing.is_empty() {
        String::new()
    } else {
        format!(" (ranks {differing:?} differ from rank {})", comm.rank())
    };
    verdicts.check(
        differing.is_empty(),
        format_args!(
            "identical: all {} hold bitwise-identical parameters after {steps} steps{detail}",
            ranks(n)
        ),
    );
    Ok(params)
}

/// The outcome of the data-parallel training, on rank 0.
struct Run {
    ranks: usize,
    params: Vec<f32>,
    epochs: Vec<Epoch>,
}

/// Rank 0: trains the same model alone, on the whole dataset with the whole global batch per
/// step, the same kernels and initial parameters and no NCCL, and compares it with the run.
fn check_reference(
    comm: &Comm,
    kernels: &Kernels,
    options: &Options,
    full: &Data,
    init: &[f32],
    run: &Run,
    verdicts: &mut Verdicts,
) -> Result<(), Error> {
    println!(
        "reference: rank 0 trains the same model alone on GPU {} ({} samples per step, no NCCL)",
        comm.device(),
        options.batch
    );
    let stream = comm.stream();
    let shape = Shape {
        hidden: options.hidden,
    };
    let mut alone = Replica::new(stream, kernels, shape, full, options.batch, init)?;
    let (_, reference) = train(&mut alone, &None, options, |_, _| {})?;
    let expected = stream.clone_dtoh(&alone.params)?;
    let (loss_n, loss_1) = match (run.epochs.last(), reference.last()) {
        (Some(a), Some(b)) => (a.loss, b.loss),
        _ => (f64::NAN, f64::NAN),
    };
    println!(
        "reference: final loss {loss_1:.9}; {} epochs in {:.1} ms of training, {:.2} M samples/s",
        reference.len(),
        reference.iter().map(|e| e.train_s).sum::<f64>() * 1e3,
        throughput(&reference, options.samples) / 1e6
    );

    let n = ranks(run.ranks);
    let magnitude = largest(expected.iter().map(|p| f64::from(p.abs()))).max(1.0);
    let max_diff = largest(
        run.params
            .iter()
            .zip(&expected)
            .map(|(a, b)| f64::from((a - b).abs())),
    );
    let bound = f64::from(PARAM_TOLERANCE) * magnitude;
    verdicts.check(
        max_diff <= bound,
        format_args!(
            "{n} vs 1 GPU: max |parameter difference| {max_diff:.2e} <= {bound:.2e} \
             ({PARAM_TOLERANCE:.0e} x max(1, max |parameter|))"
        ),
    );
    let worst = largest(
        run.epochs
            .iter()
            .zip(&reference)
            .map(|(a, b)| (a.loss - b.loss).abs() / b.loss),
    );
    verdicts.check(
        worst <= LOSS_TOLERANCE,
        format_args!(
            "{n} vs 1 GPU: final loss {loss_n:.9} vs {loss_1:.9}; largest relative loss \
             difference over the epochs {worst:.2e} <= {LOSS_TOLERANCE:.0e}"
        ),
    );
    Ok(())
}

fn run(options: &Options) -> Result<(), Error> {
    // Under a launcher this only reads the environment; without one it re-executes this
    // program once per extra GPU and makes this process rank 0.
    let gpus = nccl::library::cuda_device_count()?;
    let job = spawn_local(gpus)?;
    let launch = job.launch().clone();
    options
        .validate_for(launch.world_size)
        .map_err(Error::Usage)?;
    // A launcher that binds one GPU per task (`srun --gpus-per-task=1`) leaves each rank a
    // single visible device, whatever its local rank.
    let device = if gpus == 1 {
        0
    } else {
        launch.device_ordinal(gpus)?
    };
    let ctx = CudaContext::new(device)?;
    // Compute and communication share the GPU's default stream: with no stream of its own
    // the context keeps no per-buffer events, so no synchronisation is added to any call.
    let stream = ctx.default_stream();
    let kernels = Kernels::compile(&ctx)?;
    let id = job.exchange_id()?;
    let comm = Comm::init_rank(stream.clone(), &id, launch.rank, launch.world_size)?;
    let rank = comm.rank();

    let failed = session(&comm, &stream, &kernels, options)?;

    drop(comm);
    let waited = job.wait();
    if failed > 0 {
        // The spawned ranks failed the same checks; report those, not their exit status.
        return Err(Error::Failed {
            rank,
            count: failed,
        });
    }
    waited?;
    if rank == 0 {
        println!("data_parallel: all checks passed");
    }
    Ok(())
}

fn main() -> ExitCode {
    let options = match parse_options(std::env::args().skip(1)) {
        Ok(Command::Run(options)) => options,
        Ok(Command::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("data_parallel: {message}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Error::Usage(message)) => {
            eprintln!("data_parallel: {message}");
            ExitCode::from(2)
        }
        Err(err) => {
            eprintln!("data_parallel: {err}");
            ExitCode::FAILURE
        }
    }
}
