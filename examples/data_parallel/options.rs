//! The command line: flags, defaults, and the checks that keep the run's arithmetic exact.

use std::fmt;

use crate::model::INPUTS;

pub const USAGE: &str = "\
usage: data_parallel [--epochs N] [--samples D] [--batch B] [--lr LR] [--hidden H] [--premulsum]

  --epochs N     passes over the dataset (default 20)
  --samples D    dataset size, a multiple of the batch (default 53760)
  --batch B      global batch per step, a multiple of the number of ranks (default 840)
  --lr LR        SGD learning rate (default 0.5)
  --hidden H     hidden units of the MLP 64 -> H -> 1 (default 128)
  --premulsum    average gradients with a PreMulSum by 1/n instead of ncclAvg";

#[derive(Debug, Clone)]
pub struct Options {
    pub epochs: usize,
    pub samples: usize,
    pub batch: usize,
    pub lr: f32,
    pub hidden: usize,
    pub premulsum: bool,
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
pub enum Command {
    Run(Options),
    Help,
}

pub fn parse_options(args: impl IntoIterator<Item = String>) -> Result<Command, String> {
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
        if !self.samples.is_multiple_of(self.batch) {
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
    pub fn validate_for(&self, ranks: usize) -> Result<(), String> {
        if !self.batch.is_multiple_of(ranks) {
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

    pub fn steps_per_epoch(&self) -> usize {
        self.samples / self.batch
    }
}
