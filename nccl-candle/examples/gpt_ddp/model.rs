//! A small GPT from candle-nn pieces: token and position embeddings, pre-norm blocks of
//! causal self-attention and a GELU MLP, a final LayerNorm and an untied head. Initialised
//! as GPT-2 (nanoGPT): weights N(0, 0.02), the projections back into the residual stream
//! N(0, 0.02 / sqrt(2 layers)), biases 0; so the first loss is about ln(vocab).
//!
//! Only operations with a backward pass: candle-nn's fused `softmax_last_dim` and its
//! `LayerNorm` module (which takes the fused `layer_norm` on contiguous input) have none, so
//! this model uses `ops::softmax` and `ops::layer_norm_slow`, which are built from
//! differentiable operations.

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::{Embedding, Init, Linear, VarBuilder};

/// The model's sizes.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    pub vocab: usize,
    /// The sequence length (context).
    pub seq: usize,
    pub d_model: usize,
    pub layers: usize,
    pub heads: usize,
}

/// The standard deviation of the initial weights.
const INIT_STD: f64 = 0.02;

fn normal(stdev: f64) -> Init {
    Init::Randn { mean: 0.0, stdev }
}

/// A linear layer `in_dim -> out_dim` with weights N(0, `stdev`) and a zero bias (or none).
fn dense(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    stdev: f64,
    vb: VarBuilder,
) -> candle_core::Result<Linear> {
    let weight = vb.get_with_hints((out_dim, in_dim), "weight", normal(stdev))?;
    let bias = match bias {
        true => Some(vb.get_with_hints(out_dim, "bias", Init::Const(0.0))?),
        false => None,
    };
    Ok(Linear::new(weight, bias))
}

fn embedding(count: usize, dim: usize, vb: VarBuilder) -> candle_core::Result<Embedding> {
    let table = vb.get_with_hints((count, dim), "weight", normal(INIT_STD))?;
    Ok(Embedding::new(table, dim))
}

/// LayerNorm with a weight and a bias, differentiable.
struct Norm {
    weight: Tensor,
    bias: Tensor,
}

impl Norm {
    fn new(d: usize, vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self {
            weight: vb.get_with_hints(d, "weight", Init::Const(1.0))?,
            bias: vb.get_with_hints(d, "bias", Init::Const(0.0))?,
        })
    }

    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        candle_nn::ops::layer_norm_slow(x, &self.weight, &self.bias, 1e-5)
    }
}

struct Block {
    ln1: Norm,
    qkv: Linear,
    proj: Linear,
    ln2: Norm,
    fc: Linear,
    fc_proj: Linear,
    heads: usize,
}

impl Block {
    fn new(config: &Config, vb: VarBuilder) -> candle_core::Result<Self> {
        let d = config.d_model;
        let residual = INIT_STD / (2.0 * config.layers as f64).sqrt();
        Ok(Self {
            ln1: Norm::new(d, vb.pp("ln1"))?,
            qkv: dense(d, 3 * d, true, INIT_STD, vb.pp("attn.qkv"))?,
            proj: dense(d, d, true, residual, vb.pp("attn.proj"))?,
            ln2: Norm::new(d, vb.pp("ln2"))?,
            fc: dense(d, 4 * d, true, INIT_STD, vb.pp("mlp.fc"))?,
            fc_proj: dense(4 * d, d, true, residual, vb.pp("mlp.proj"))?,
            heads: config.heads,
        })
    }

    /// `x`: (batch, seq, d); `mask`: (seq, seq), 0 on and below the diagonal, a large
    /// negative number above it.
    fn forward(&self, x: &Tensor, mask: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let (h, hd) = (self.heads, d / self.heads);
        let qkv = self
            .qkv
            .forward(&self.ln1.forward(x)?.reshape((b * t, d))?)?
            .reshape((b, t, 3, h, hd))?;
        // (b, h, t, hd) each.
        let part = |i: usize| {
            qkv.narrow(2, i, 1)?
                .squeeze(2)?
                .transpose(1, 2)?
                .contiguous()
        };
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        let scores = (q.matmul(&k.t()?)? * (1.0 / (hd as f64).sqrt()))?.broadcast_add(mask)?;
        let att = candle_nn::ops::softmax(&scores, D::Minus1)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b * t, d))?;
        let x = (x + self.proj.forward(&y)?.reshape((b, t, d))?)?;
        let m = self.ln2.forward(&x)?.reshape((b * t, d))?;
        let m = self.fc_proj.forward(&self.fc.forward(&m)?.gelu()?)?;
        x + m.reshape((b, t, d))?
    }
}

pub struct Gpt {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: Norm,
    head: Linear,
    mask: Tensor,
    positions: Tensor,
    config: Config,
}

impl Gpt {
    /// A model whose variables `vb` makes (drawn from the device's random generator).
    pub fn new(config: &Config, vb: VarBuilder, device: &Device) -> candle_core::Result<Self> {
        let t = config.seq;
        let mask: Vec<f32> = (0..t * t)
            .map(|i| if i % t > i / t { -1e9 } else { 0.0 })
            .collect();
        Ok(Self {
            wte: embedding(config.vocab, config.d_model, vb.pp("wte"))?,
            wpe: embedding(config.seq, config.d_model, vb.pp("wpe"))?,
            blocks: (0..config.layers)
                .map(|i| Block::new(config, vb.pp(format!("h.{i}"))))
                .collect::<candle_core::Result<_>>()?,
            ln_f: Norm::new(config.d_model, vb.pp("ln_f"))?,
            head: dense(config.d_model, config.vocab, false, INIT_STD, vb.pp("head"))?,
            mask: Tensor::from_vec(mask, (t, t), device)?,
            positions: Tensor::arange(0u32, t as u32, device)?,
            config: *config,
        })
    }

    /// The logits of `input` ((batch, seq) u32): (batch * seq, vocab).
    pub fn forward(&self, input: &Tensor) -> candle_core::Result<Tensor> {
        let (b, t) = input.dims2()?;
        let mut x = self
            .wte
            .forward(input)?
            .broadcast_add(&self.wpe.forward(&self.positions)?)?;
        for block in &self.blocks {
            x = block.forward(&x, &self.mask)?;
        }
        let x = self
            .ln_f
            .forward(&x)?
            .reshape((b * t, self.config.d_model))?;
        self.head.forward(&x)
    }

    /// The mean cross-entropy of predicting `target` from `input`, over every token.
    pub fn loss(&self, input: &Tensor, target: &Tensor) -> candle_core::Result<Tensor> {
        let logits = self.forward(input)?;
        candle_nn::loss::cross_entropy(&logits, &target.flatten_all()?)
    }
}

/// The parameters' element type.
pub const DTYPE: DType = DType::F32;
