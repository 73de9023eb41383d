//! The command line: flags, the model sizes, their defaults, and the checks.

use std::fmt;

use crate::data::DATASET_LEN;
use crate::model::Config;

pub const USAGE: &str = "\
usage: gpt_ddp [--model tiny|small|large] [--global-batch N] [--steps N] [--lr X] [--seed N]
               [--lr-warmup N] [--check-steps K] [--tolerance X] [--warmup N]
               [--measure-steps N] [--bucket-mb N] [--no-check]

Data-parallel training of a small GPT on generated sequences, one process per GPU (or per rank
of mpirun/srun/torchrun; NCCL_RS_LOCAL_RANKS=N starts N local ranks).

  --model M          tiny: 2 layers, d 64, seq 32, vocab 64 (~0.1 M params, latency-bound)
                     small: 4 layers, d 256, seq 128, vocab 256 (~3.3 M params)
                     large: 8 layers, d 768, seq 256, vocab 512 (~57 M params, compute-bound)
                     (default tiny)
  --global-batch N   sequences per step over all ranks, a multiple of the number of ranks
                     (default 32 tiny and small, 64 large)
  --steps N          training steps (default 300 tiny, 200 small, 100 large)
  --lr X             AdamW learning rate (default 3e-3 tiny, 1e-3 small, 3e-4 large)
  --lr-warmup N      steps of linear learning-rate warm-up from lr/N to lr (default 10)
  --seed N           initial parameters (drawn on rank 0), data and shuffles (default 1)
  --check-steps K    steps that rank 0 also trains alone on the whole global batch, to compare
                     the losses (default 10)
  --tolerance X      relative tolerance of that comparison (default 1e-3)
  --warmup N         steps before the timed window (default 10)
  --measure-steps N  last steps, with the gradient all-reduce timed between synchronisations
                     (default 10)
  --bucket-mb N      largest gradient bucket in MiB (default 25, as PyTorch DDP)
  --no-check         skip the self-checks and rank 0's reference run";

/// The model sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Size {
    Tiny,
    Small,
    Large,
}

impl Size {
    pub fn name(self) -> &'static str {
        match self {
            Size::Tiny => "tiny",
            Size::Small => "small",
            Size::Large => "large",
        }
    }

    pub fn config(self) -> Config {
        match self {
            Size::Tiny => Config {
                vocab: 64,
                seq: 32,
                d_model: 64,
                layers: 2,
                heads: 4,
            },
            Size::Small => Config {
                vocab: 256,
                seq: 128,
                d_model: 256,
                layers: 4,
                heads: 8,
            },
            Size::Large => Config {
                vocab: 512,
                seq: 256,
                d_model: 768,
                layers: 8,
                heads: 12,
            },
        }
    }

    /// (global batch, steps, learning rate)
    fn defaults(self) -> (usize, usize, f64) {
        match self {
            Size::Tiny => (32, 300, 3e-3),
            Size::Small => (32, 200, 1e-3),
            Size::Large => (64, 100, 3e-4),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Options {
    pub size: Size,
    pub global_batch: usize,
    pub steps: usize,
    pub lr: f64,
    pub lr_warmup: usize,
    pub seed: u64,
    pub check_steps: usize,
    pub tolerance: f64,
    pub warmup: usize,
    pub measure_steps: usize,
    pub bucket_bytes: usize,
    pub check: bool,
}

/// What the command line asked for.
pub enum Command {
    Run(Options),
    Help,
}

pub fn parse_options(args: impl IntoIterator<Item = String>) -> Result<Command, String> {
    let mut size = Size::Tiny;
    let (mut global_batch, mut steps, mut lr) = (None, None, None);
    let mut seed = 1;
    let mut lr_warmup = 10;
    let mut check_steps = 10;
    let mut tolerance = 1e-3;
    let mut warmup = 10;
    let mut measure_steps = 10;
    let mut bucket_mb: usize = 25;
    let mut check = true;
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
            "--model" => {
                size = match value()?.as_str() {
                    "tiny" => Size::Tiny,
                    "small" => Size::Small,
                    "large" => Size::Large,
                    other => return Err(format!("--model {other:?}: tiny, small or large")),
                }
            }
            "--global-batch" => global_batch = Some(number(&flag, &value()?)?),
            "--steps" => steps = Some(number(&flag, &value()?)?),
            "--lr" => lr = Some(number(&flag, &value()?)?),
            "--lr-warmup" => lr_warmup = number(&flag, &value()?)?,
            "--seed" => seed = number(&flag, &value()?)?,
            "--check-steps" => check_steps = number(&flag, &value()?)?,
            "--tolerance" => tolerance = number(&flag, &value()?)?,
            "--warmup" => warmup = number(&flag, &value()?)?,
            "--measure-steps" => measure_steps = number(&flag, &value()?)?,
            "--bucket-mb" => bucket_mb = number(&flag, &value()?)?,
            "--no-check" if inline.is_some() => return Err(format!("{flag} takes no value")),
            "--no-check" => check = false,
            "-h" | "--help" => return Ok(Command::Help),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let (default_batch, default_steps, default_lr) = size.defaults();
    let options = Options {
        size,
        global_batch: global_batch.unwrap_or(default_batch),
        steps: steps.unwrap_or(default_steps),
        lr: lr.unwrap_or(default_lr),
        lr_warmup,
        seed,
        check_steps,
        tolerance,
        warmup,
        measure_steps,
        bucket_bytes: bucket_mb
            .checked_mul(1 << 20)
            .ok_or("--bucket-mb is too large")?,
        check,
    };
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
        if self.global_batch == 0 || self.global_batch > DATASET_LEN {
            return Err(format!(
                "--global-batch must be 1..={DATASET_LEN} (the dataset's size)"
            ));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(format!("--lr must be a positive number, got {}", self.lr));
        }
        if !(self.tolerance.is_finite() && self.tolerance >= 0.0) {
            return Err(format!("--tolerance must be >= 0, got {}", self.tolerance));
        }
        if self.steps <= self.warmup + self.measure_steps {
            return Err(format!(
                "--steps {} leaves no timed window after --warmup {} and before the last \
                 --measure-steps {}",
                self.steps, self.warmup, self.measure_steps
            ));
        }
        if self.check && (self.check_steps == 0 || self.check_steps > self.steps) {
            return Err(format!(
                "--check-steps must be 1..={} (the steps)",
                self.steps
            ));
        }
        Ok(())
    }

    /// The learning rate of step `step` (from 0): a linear warm-up over the first
    /// `--lr-warmup` steps, then constant. The same schedule in the distributed run and in
    /// rank 0's reference.
    pub fn lr_at(&self, step: usize) -> f64 {
        match self.lr_warmup {
            0 => self.lr,
            n => self.lr * ((step + 1).min(n) as f64 / n as f64),
        }
    }

    /// Checks what depends on the number of ranks.
    pub fn validate_for(&self, ranks: usize) -> Result<(), String> {
        if !self.global_batch.is_multiple_of(ranks) {
            return Err(format!(
                "--global-batch {} does not split over {ranks} ranks: every rank takes the same \
                 share of each global batch (try --global-batch {})",
                self.global_batch,
                self.global_batch.next_multiple_of(ranks)
            ));
        }
        Ok(())
    }
}
