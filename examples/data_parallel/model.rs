//! The MLP: the layout of its flat parameter buffer, a float64 host gradient for the checks,
//! and a replica on one GPU that enqueues the kernels.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use crate::data::{streams, uniform, Data};
use crate::kernels::{grid, int, Kernels, BLOCK};
use crate::Error;

/// Input features per sample.
pub const INPUTS: usize = 64;

/// The parameters are one flat buffer, so that the gradient is one buffer too and a step needs
/// a single all-reduce:
///
/// * `[0, H*(IN+1))`: layer 1, row `h` = `W1[h][0..IN]` then the bias `b1[h]`;
/// * `[H*(IN+1), H*(IN+1) + H)`: layer 2 weights `w2[h]`;
/// * `H*(IN+1) + H`: layer 2 bias `b2`.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub hidden: usize,
}

impl Shape {
    pub fn layer2(self) -> usize {
        self.hidden * (INPUTS + 1)
    }

    pub fn params(self) -> usize {
        self.layer2() + self.hidden + 1
    }

    /// LeCun-uniform weights (unit-variance activations for unit-variance inputs), zero biases.
    pub fn initial_params(self) -> Vec<f32> {
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
    pub fn gradient_f64(self, params: &[f32], data: &Data, samples: &[usize]) -> Vec<f64> {
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

/// One copy of the model with its data on one GPU: a rank's replica in the data-parallel run,
/// or the whole job in the 1-GPU reference.
pub struct Replica {
    pub stream: Arc<CudaStream>,
    kernels: Kernels,
    pub shape: Shape,
    /// Samples held (the shard).
    shard: usize,
    /// Samples per step: this replica's part of the global batch.
    batch: usize,
    /// Steps per epoch; also the stride between a step's samples in the shard.
    pub steps: usize,
    x: CudaSlice<f32>,
    y: CudaSlice<f32>,
    pub params: CudaSlice<f32>,
    pub grads: CudaSlice<f32>,
    act: CudaSlice<f32>,
    delta: CudaSlice<f32>,
    err: CudaSlice<f32>,
    losses: CudaSlice<f64>,
    pub loss_sum: CudaSlice<f64>,
}

impl Replica {
    pub fn new(
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
    pub fn gradients(&mut self, step: usize, scale: f32) -> Result<(), Error> {
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
    pub fn apply(&mut self, lr: f32) -> Result<(), Error> {
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
    pub fn loss(&mut self) -> Result<(), Error> {
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
