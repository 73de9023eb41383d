//! Text generation with a Hugging Face checkpoint (Llama, Mistral, Qwen2, Qwen3; the mixtures of
//! experts Mixtral and Qwen3-MoE, expert-parallel) split over
//! the GPUs of one host, tensor-parallel (`nccl_candle::models`).
//!
//! One rank per visible GPU, no launcher needed (also under `mpirun -np N`, `srun` or
//! torchrun-style launchers; `NCCL_RS_LOCAL_RANKS=N` forces N ranks):
//!
//! ```text
//! cargo run --release --example generate -- --model-dir Qwen3-0.6B --prompt "The capital of France is"
//! cargo run --release --example generate -- --model-dir DIR --prompt "Once" --temperature 0.8 --top-p 0.95 --seed 7
//! cargo run --release --example generate -- --model-dir DIR --prompt "Hello" --check     # against one GPU
//! cargo run --release --example generate -- --model-dir DIR --prompt "Hello" --lsa --fused
//! cargo run --example hf_checkpoint -- --all --out /tmp/ckpts                        # synthetic checkpoints
//! ```
//!
//! Every rank opens the checkpoint, reads the tokenizer and tokenises the prompt on its own,
//! and the ranks agree on how that went (and on the tokens and options) before any
//! collective that depends on it: a rank that cannot read a file leaves no other waiting.
//! Each then loads its shard (`CausalLm::load`), runs the prompt's pass and the decode steps,
//! and chooses each next token itself with a `Sampler` made alike on every rank: the logits
//! are the same bytes on every rank and the sampler is deterministic, so the ranks choose the
//! same tokens without exchanging them (checked once at the end). Rank 0 prints the text as
//! it comes, then the timings (the slowest rank's) and each rank's memory.
//!
//! `--check`: with more than one rank, rank 0 first loads the whole model on its own GPU (a
//! one-rank group, no collectives) and generates greedily, recording the logits, while the
//! others wait; then every rank decodes the same prompt fed the reference's tokens, and
//! rank 0 compares the choices. A choice may differ only at a near-tie: where the
//! reference's logits of its own choice and of the ranks' choice are within twice the
//! tolerance, 1e-3 (f32) or 5e-2 (bf16) of the reference's largest |logit| (a rank's
//! partial sums round to bf16 before the all-reduce where one GPU rounds once; see
//! `llama_tp`'s `decode::relative_tolerance`). The verdict is agreed on every rank; exit
//! code 1 when it fails.
//!
//! Past 600 lines: the example is one program a reader follows from the options to the
//! check (launch, agreement, loading, sampling, streaming text, timing, memory, `--check`).
//!
//! Why one file past 600 lines: an example is read top to bottom, and each part (options,
//! opening and agreeing, loading and the memory report, the eager and graph decode loops, the
//! check, the streamed text) is a step of the one program a user copies.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use nccl::bootstrap::spawn_local;
use nccl::ReduceOp;
use nccl_candle::decode::{capturable_device, DecodeGraph, StaticDecode};
use nccl_candle::fingerprint;
use nccl_candle::models::{CausalLm, Checkpoint, Sampler, Sampling};
use nccl_candle::tp::{LsaCollectives, TpGroup};
use tokenizers::Tokenizer;

type AnyError = Box<dyn std::error::Error + Send + Sync>;

const USAGE: &str = "\
usage: generate --model-dir DIR --prompt TEXT [--max-new-tokens N] [--temperature T]
                [--top-p P] [--seed S] [--dtype bf16|f32] [--max-seq N] [--lsa] [--fused]
                [--graph] [--check]

  --model-dir       a Hugging Face checkpoint: config.json, model.safetensors (or the shards
                    of model.safetensors.index.json), tokenizer.json
  --prompt          the text to continue
  --max-new-tokens  tokens to generate at most (default 32); generation stops earlier at an
                    end-of-sequence token of config.json
  --temperature     sample from softmax(logits / T) instead of greedy choice (T > 0)
  --top-p           with --temperature: keep the most likely tokens whose probability first
                    reaches P, in (0, 1] (default 1: all)
  --seed            with --temperature: the sampler's seed (default 0)
  --dtype           the weights' type on the GPU (default bf16)
  --max-seq         positions the KV cache holds (default: the prompt's tokens plus
                    --max-new-tokens); fewer limits the tokens generated
  --lsa             sum the decode steps' bf16 row-parallel outputs with the all-reduce
                    kernels nccl-rs ships (tp::LsaCollectives; NCCL 2.29.2+, one LSA team);
                    plain NCCL, with a message, where they are not available
  --fused           run each row-parallel sum, the residual add and the next RMSNorm as one
                    op (one fused kernel with --lsa; the plain NCCL sequence without)
  --graph           decode steps replayed from a CUDA graph of the static decode step
                    (nccl_candle::decode), captured after the prompt's pass
  --check           with more than one rank, compare the greedy choices with the whole model
                    on rank 0's GPU alone (exit code 1 when they differ beyond near-ties);
                    with --graph on one rank, the graph's choices with the host-driven pass's

One rank per visible GPU; NCCL_RS_LOCAL_RANKS=N forces N ranks.";

/// The command line.
#[derive(Debug, Clone)]
struct Options {
    model_dir: PathBuf,
    prompt: String,
    max_new_tokens: usize,
    sampling: Sampling,
    dtype: DType,
    max_seq: Option<usize>,
    lsa: bool,
    fused: bool,
    graph: bool,
    check: bool,
}

impl Options {
    /// The name of the way the row-parallel sums run, for the output.
    fn path(&self, lsa: bool) -> &'static str {
        match (lsa, self.fused) {
            (false, false) => "nccl",
            (false, true) => "nccl+fused (the unfused sequence through the fused API)",
            (true, false) => "lsa",
            (true, true) => "lsa+fused",
        }
    }
}

/// The options, or `None` after printing the usage for `--help`.
fn parse_options() -> Result<Option<Options>, String> {
    let (mut model_dir, mut prompt) = (None, None);
    let (mut temperature, mut top_p, mut seed) = (None, None, None);
    let mut options = Options {
        model_dir: PathBuf::new(),
        prompt: String::new(),
        max_new_tokens: 32,
        sampling: Sampling::Greedy,
        dtype: DType::BF16,
        max_seq: None,
        lsa: false,
        fused: false,
        graph: false,
        check: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        fn number<T: std::str::FromStr>(name: &str, text: String) -> Result<T, String>
        where
            T::Err: std::fmt::Display,
        {
            text.parse().map_err(|e| format!("{name} {text:?}: {e}"))
        }
        match arg.as_str() {
            "--model-dir" => model_dir = Some(PathBuf::from(value(&arg)?)),
            "--prompt" => prompt = Some(value(&arg)?),
            "--max-new-tokens" => options.max_new_tokens = number(&arg, value(&arg)?)?,
            "--temperature" => temperature = Some(number::<f64>(&arg, value(&arg)?)?),
            "--top-p" => top_p = Some(number::<f64>(&arg, value(&arg)?)?),
            "--seed" => seed = Some(number::<u64>(&arg, value(&arg)?)?),
            "--max-seq" => options.max_seq = Some(number(&arg, value(&arg)?)?),
            "--dtype" => {
                options.dtype = match value(&arg)?.as_str() {
                    "bf16" => DType::BF16,
                    "f32" => DType::F32,
                    other => return Err(format!("--dtype {other:?}: bf16 or f32")),
                }
            }
            "--lsa" => options.lsa = true,
            "--fused" => options.fused = true,
            "--check" => options.check = true,
            "--graph" => options.graph = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(None);
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    options.model_dir = model_dir.ok_or("--model-dir is required; try --help")?;
    options.prompt = prompt.ok_or("--prompt is required; try --help")?;
    if options.max_new_tokens == 0 {
        return Err("--max-new-tokens must be at least 1".into());
    }
    if options.max_seq == Some(0) {
        return Err("--max-seq must be at least 1".into());
    }
    options.sampling = match temperature {
        Some(temperature) => Sampling::Random {
            temperature,
            top_p: top_p.unwrap_or(1.0),
            seed: seed.unwrap_or(0),
        },
        None if top_p.is_some() || seed.is_some() => {
            return Err("--top-p and --seed need --temperature (greedy otherwise)".into())
        }
        None => Sampling::Greedy,
    };
    // The sampler's own refusal (temperature, top_p), before any rank starts.
    Sampler::new(options.sampling).map_err(|e| e.to_string())?;
    Ok(Some(options))
}

/// Whether every rank's `ok` is true (an all-reduce: every rank must call it).
fn all_ok(group: &TpGroup, device: &Device, ok: bool) -> Result<bool, AnyError> {
    let flag = Tensor::new(&[u32::from(ok)], device)?;
    let min = group.all_reduce(&flag, ReduceOp::Min)?.to_vec1::<u32>()?;
    Ok(min.first() == Some(&1))
}

/// `result` where every rank succeeded at `what`; otherwise an error on every rank (its own,
/// or word that another failed), so no rank goes on into a collective its peers left.
fn agreed<T>(
    group: &TpGroup,
    device: &Device,
    what: &str,
    result: Result<T, AnyError>,
) -> Result<T, AnyError> {
    let everyone = all_ok(group, device, result.is_ok())?;
    match result {
        Err(err) => Err(format!("{what}: {err}").into()),
        Ok(_) if !everyone => {
            Err(format!("{what}: another rank failed (its error says why)").into())
        }
        Ok(value) => Ok(value),
    }
}

/// The checkpoint, its tokenizer and the prompt's tokens, read by this rank alone.
fn open(options: &Options) -> Result<(Checkpoint, Tokenizer, Vec<u32>), AnyError> {
    let checkpoint = Checkpoint::open(&options.model_dir)?;
    let tokenizer = checkpoint.tokenizer()?;
    let encoding = tokenizer
        .encode(options.prompt.as_str(), true)
        .map_err(|e| nccl_candle::Error::Argument {
            op: "Tokenizer::encode",
            why: format!("the prompt: {e}"),
        })?;
    let ids = encoding.get_ids().to_vec();
    if ids.is_empty() {
        return Err("the prompt gives no token".into());
    }
    Ok((checkpoint, tokenizer, ids))
}

/// The KV cache's positions and the tokens to generate, for a prompt of `prompt` tokens:
/// the last token generated is never fed back, so `prompt + new - 1` positions suffice.
/// The same on every rank (its inputs are agreed).
fn lengths(
    options: &Options,
    prompt: usize,
    max_positions: usize,
) -> Result<(usize, usize), AnyError> {
    let room = options.max_seq.unwrap_or(max_positions);
    if prompt > room {
        return Err(format!(
            "the prompt's {prompt} tokens do not fit {room} positions ({})",
            match options.max_seq {
                Some(_) => "--max-seq",
                None => "max_position_embeddings",
            }
        )
        .into());
    }
    let new = options.max_new_tokens.min(room - prompt + 1);
    let max_seq = options.max_seq.unwrap_or(prompt + new - 1);
    Ok((max_seq, new))
}

/// This rank's peak resident host memory (VmHWM), in bytes, where /proc says.
fn host_peak() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// The GPU's memory in use (total minus free, every process's), in bytes.
fn gpu_used(device: &Device) -> Result<u64, AnyError> {
    device.synchronize()?;
    device
        .as_cuda_device()?
        .cuda_stream()
        .context()
        .bind_to_thread()?;
    let (free, total) = nccl::cudarc::driver::result::mem_get_info()?;
    Ok(total.saturating_sub(free) as u64)
}

const MB: f64 = 1e6;

/// One generation: the choices, their logits when recorded, the times.
#[derive(Debug, Default)]
struct Run {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    /// The prompt's pass and its choice, on the host.
    prefill: Duration,
    /// Each decode step and its choice, on the host.
    steps: Vec<Duration>,
}

/// What the steps after the prompt are fed.
#[derive(Debug, Clone, Copy)]
enum Feed<'a> {
    /// The token chosen, up to `new_tokens` choices, ending after one of `eos`.
    Chosen { new_tokens: usize, eos: &'a [u32] },
    /// `tokens[k]` after choice `k`: one choice for each of them (another run's tokens,
    /// so that two runs see the same inputs even where a near-tie made them choose apart).
    Forced(&'a [u32]),
}

/// Generates after `prompt` from an empty cache. Each step's time runs until its choice is
/// on the host (device work included); `shown` sees the tokens after each choice, outside
/// the times. A failure here is the same on every rank (the logits are), so none is left
/// waiting.
#[allow(clippy::too_many_arguments)]
fn decode(
    model: &mut CausalLm,
    sampler: &mut Sampler,
    prompt: &[u32],
    feed: Feed<'_>,
    record: bool,
    device: &Device,
    graph: bool,
    mut shown: impl FnMut(&[u32]),
) -> Result<Run, AnyError> {
    if graph {
        return decode_graph(model, sampler, prompt, feed, record, device, shown);
    }
    model.reset()?;
    let mut run = Run::default();
    let mut input = prompt.to_vec();
    loop {
        let start = Instant::now();
        let ids = Tensor::new(input.as_slice(), device)?.unsqueeze(0)?;
        let logits = model.forward(&ids, model.cached())?;
        let token = *sampler
            .sample(&logits)?
            .first()
            .ok_or("the sampler chose nothing")?;
        match run.tokens.is_empty() {
            true => run.prefill = start.elapsed(),
            false => run.steps.push(start.elapsed()),
        }
        if record {
            run.logits.push(logits.flatten_all()?.to_vec1::<f32>()?);
        }
        run.tokens.push(token);
        shown(&run.tokens);
        let done = run.tokens.len();
        match next_input(feed, done, token) {
            Some(next) => input = vec![next],
            None => return Ok(run),
        }
    }
}

/// Prints generated text as it comes (rank 0): decodes a short window of tokens around the
/// new ones, so that spaces come out as in the whole text, and holds back text that ends in
/// an incomplete character (a byte-level token's first bytes).
struct Stream<'a> {
    tokenizer: &'a Tokenizer,
    /// The prompt's tokens, then the generated ones.
    tokens: Vec<u32>,
    /// The window's start: text before it is printed.
    prev: usize,
    /// The tokens whose text is printed.
    current: usize,
}

impl<'a> Stream<'a> {
    fn new(tokenizer: &'a Tokenizer, prompt: &[u32]) -> Self {
        // The window starts at the prompt's last token: the first new token's leading space
        // depends on what precedes it.
        let prev = prompt.len().saturating_sub(1);
        Self {
            tokenizer,
            tokens: prompt.to_vec(),
            prev,
            current: prompt.len(),
        }
    }

    fn text(&self, tokens: &[u32]) -> String {
        // A token the tokenizer cannot decode is shown as nothing rather than stopping the
        // generation on this rank alone.
        self.tokenizer.decode(tokens, true).unwrap_or_default()
    }

    /// The text of the tokens after `current`, if it can be shown yet (`all`: whatever it
    /// holds).
    fn advance(&mut self, all: bool) -> Option<String> {
        let before = self.text(&self.tokens[self.prev..self.current]);
        let text = self.text(&self.tokens[self.prev..]);
        if !all && (text.len() <= before.len() || text.ends_with('\u{FFFD}')) {
            return None;
        }
        let new = match text.strip_prefix(before.as_str()) {
            Some(new) => new.to_string(),
            None => text.get(before.len()..).unwrap_or(&text).to_string(),
        };
        self.prev = self.current;
        self.current = self.tokens.len();
        Some(new)
    }

    fn push(&mut self, generated: &[u32]) {
        if let Some(&token) = generated.last() {
            self.tokens.push(token);
        }
        if let Some(new) = self.advance(false) {
            print(&new);
        }
    }

    fn finish(&mut self) {
        if self.current < self.tokens.len() {
            if let Some(new) = self.advance(true) {
                print(&new);
            }
        }
        println!();
    }
}

fn print(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    // Output that cannot be written (a closed pipe) is not the generation's failure.
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

/// The median of `times`, in milliseconds (`None` when there is none).
fn median_ms(times: &[Duration]) -> Option<f64> {
    let mut ms: Vec<f64> = times.iter().map(|t| t.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    ms.get(ms.len() / 2).copied()
}

/// The check's logit tolerance for `dtype`, relative to the reference's largest |logit|:
/// the same sums in another order differ by ~1e-6 relative in f32; in bf16 each rank's
/// partial sum is rounded before the all-reduce, and those 1-ulp (2^-8) differences travel
/// through every layer (llama_tp measured up to 1.7% on CPU).
fn relative_tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 | DType::F64 => 1e-3,
        _ => 5e-2,
    }
}

/// How the ranks' choices compare with the reference's, fed the same tokens.
#[derive(Debug, Default)]
struct Verdict {
    compared: usize,
    /// Different choices where the reference's two logits are within twice the tolerance.
    near_ties: usize,
    /// Different choices otherwise (and a different number of steps).
    mismatches: usize,
    max_diff: f32,
    non_finite: usize,
}

fn compare(reference: &Run, run: &Run, tolerance: f32) -> Verdict {
    let mut verdict = Verdict::default();
    let steps = reference.tokens.iter().zip(&run.tokens);
    for ((&want, &got), (want_logits, got_logits)) in
        steps.zip(reference.logits.iter().zip(&run.logits))
    {
        for (&a, &b) in want_logits.iter().zip(got_logits) {
            if !a.is_finite() || !b.is_finite() {
                verdict.non_finite += 1;
            } else {
                verdict.max_diff = verdict.max_diff.max((a - b).abs());
            }
        }
        verdict.compared += 1;
        if want == got {
            continue;
        }
        let logit = |token: u32| want_logits.get(token as usize).copied().unwrap_or(f32::NAN);
        // NaN (a token outside the logits) is no near-tie.
        if logit(want) - logit(got) <= 2.0 * tolerance {
            verdict.near_ties += 1;
        } else {
            verdict.mismatches += 1;
        }
    }
    if reference.tokens.len() != run.tokens.len() || reference.logits.len() != run.logits.len() {
        verdict.mismatches += 1;
    }
    verdict
}

/// The reference's tokens (rank 0's) on every rank: an all-reduce (max) of
/// `[count, tokens..]` in which the other ranks give zeros.
fn share_tokens(
    group: &TpGroup,
    device: &Device,
    mine: Option<&Run>,
    most: usize,
) -> Result<Vec<u32>, AnyError> {
    let mut flat = vec![0u32; most + 1];
    if let Some(run) = mine {
        let n = run.tokens.len().min(most);
        flat[0] = n as u32;
        flat[1..=n].copy_from_slice(&run.tokens[..n]);
    }
    let shared = group
        .all_reduce(&Tensor::new(flat.as_slice(), device)?, ReduceOp::Max)?
        .to_vec1::<u32>()?;
    let n = (shared[0] as usize).min(most);
    Ok(shared[1..=n].to_vec())
}

/// Where the next choice comes from after `done` choices ending with `token` (`None`: the
/// run is over).
fn next_input(feed: Feed<'_>, done: usize, token: u32) -> Option<u32> {
    match feed {
        Feed::Chosen { new_tokens, eos } => {
            (done < new_tokens && !eos.contains(&token)).then_some(token)
        }
        Feed::Forced(tokens) => match done < tokens.len() {
            true => tokens.get(done - 1).copied(),
            false => None,
        },
    }
}

/// [`decode`] with the steps replayed from a CUDA graph of the static decode step, captured
/// after the prompt's pass (the capture is in no time). A step's time runs from the upload
/// of its input to its choice on the host, as the eager steps'.
fn decode_graph(
    model: &mut CausalLm,
    sampler: &mut Sampler,
    prompt: &[u32],
    feed: Feed<'_>,
    record: bool,
    device: &Device,
    mut shown: impl FnMut(&[u32]),
) -> Result<Run, AnyError> {
    let mut run = Run::default();
    let start = Instant::now();
    let ids = Tensor::new(prompt, device)?.unsqueeze(0)?;
    let logits = model.prefill(&ids)?;
    let mut token = *sampler
        .sample(&logits)?
        .first()
        .ok_or("the sampler chose nothing")?;
    run.prefill = start.elapsed();
    if record {
        run.logits.push(logits.flatten_all()?.to_vec1::<f32>()?);
    }
    run.tokens.push(token);
    shown(&run.tokens);
    let Some(mut next) = next_input(feed, 1, token) else {
        return Ok(run);
    };
    let mut graph = DecodeGraph::capture(model, 1)?;
    loop {
        let start = Instant::now();
        graph.step(&[next])?;
        // The stream first, then the copy (ranks sharing a GPU share its staging buffer).
        device.synchronize()?;
        let logits = graph.logits()?;
        token = *sampler
            .sample(&logits)?
            .first()
            .ok_or("the sampler chose nothing")?;
        run.steps.push(start.elapsed());
        if record {
            run.logits.push(logits.flatten_all()?.to_vec1::<f32>()?);
        }
        run.tokens.push(token);
        shown(&run.tokens);
        match next_input(feed, run.tokens.len(), token) {
            Some(n) => next = n,
            None => return Ok(run),
        }
    }
}

/// Rank 0's generation with the whole model on its GPU: greedy, logits recorded.
fn reference_run(
    checkpoint: &Checkpoint,
    options: &Options,
    prompt: &[u32],
    new_tokens: usize,
    max_seq: usize,
    device: &Device,
) -> Result<Run, AnyError> {
    let mut whole = CausalLm::load(
        checkpoint,
        &TpGroup::single(),
        options.dtype,
        device,
        max_seq,
    )?;
    let mut greedy = Sampler::new(Sampling::Greedy)?;
    let eos = &checkpoint.config().eos_token_ids;
    let feed = Feed::Chosen { new_tokens, eos };
    decode(
        &mut whole,
        &mut greedy,
        prompt,
        feed,
        true,
        device,
        false,
        |_| {},
    )
}

/// `--check` (see the module's description); true when it passed, on every rank.
#[allow(clippy::too_many_arguments)]
fn check(
    options: &Options,
    group: &TpGroup,
    device: &Device,
    checkpoint: &Checkpoint,
    model: &mut CausalLm,
    prompt: &[u32],
    new_tokens: usize,
    max_seq: usize,
) -> Result<bool, AnyError> {
    let (rank, world) = (group.rank(), group.size());
    if world == 1 && !options.graph {
        println!(
            "check: one rank, nothing to compare with; the logits were finite (the sampler \
             refuses others): PASS"
        );
        return Ok(true);
    }
    let reference = if world == 1 {
        println!("check: the host-driven pass of the same model generates greedily...");
        let mut greedy = Sampler::new(Sampling::Greedy)?;
        let eos = &checkpoint.config().eos_token_ids;
        let feed = Feed::Chosen { new_tokens, eos };
        Some(decode(
            model,
            &mut greedy,
            prompt,
            feed,
            true,
            device,
            false,
            |_| {},
        )?)
    } else {
        if rank == 0 {
            println!("check: rank 0 loads the whole model on its GPU and generates greedily...");
        }
        // The other ranks wait in the agreement while rank 0 runs the reference.
        let reference = match rank {
            0 => reference_run(checkpoint, options, prompt, new_tokens, max_seq, device).map(Some),
            _ => Ok(None),
        };
        agreed(group, device, "the single-GPU reference", reference)?
    };
    let forced = share_tokens(group, device, reference.as_ref(), new_tokens)?;
    let mut greedy = Sampler::new(Sampling::Greedy)?;
    let run = decode(
        model,
        &mut greedy,
        prompt,
        Feed::Forced(&forced),
        rank == 0,
        device,
        options.graph,
        |_| {},
    )?;
    let mut passed = true;
    if let Some(reference) = &reference {
        let relative = relative_tolerance(options.dtype);
        let largest = reference
            .logits
            .iter()
            .flatten()
            .filter(|v| v.is_finite())
            .fold(0f32, |m, v| m.max(v.abs()));
        let tolerance = relative * largest;
        let verdict = compare(reference, &run, tolerance);
        passed = verdict.mismatches == 0 && verdict.non_finite == 0;
        let first = |run: &Run| run.tokens.iter().take(8).copied().collect::<Vec<_>>();
        println!(
            "check: {world} ranks chose {:?}.., 1 GPU {:?}..; {} choices: {} identical, {} \
             near-ties, {} different; max |logit diff| {:.2e} (tolerance {tolerance:.2e}: \
             {relative:.0e} of the largest |logit|{}), {} non-finite: {}",
            first(&run),
            first(reference),
            verdict.compared,
            verdict
                .compared
                .saturating_sub(verdict.near_ties + verdict.mismatches),
            verdict.near_ties,
            verdict.mismatches,
            verdict.max_diff,
            if verdict.max_diff > tolerance {
                "; beyond it, which the near-tie rule assumes does not happen"
            } else {
                ""
            },
            verdict.non_finite,
            if passed { "PASS" } else { "FAIL" }
        );
    }
    all_ok(group, device, passed)
}

/// A group over `comm` for the model: with `--lsa`, `LsaCollectives` on a copy of it
/// (split off before the plain group took it), or the plain group where they cannot be made.
/// Returns the group and whether it sums through the shipped kernels.
fn model_group(
    plain: TpGroup,
    spare: Option<nccl::Comm>,
    hidden: usize,
) -> Result<(TpGroup, bool), AnyError> {
    let Some(spare) = spare else {
        return Ok((plain, false));
    };
    // A decode step's sums are one row of `hidden`; the prompt's pass goes through NCCL.
    match LsaCollectives::new(spare, hidden) {
        Ok(lsa) => {
            // Every rank made its kernels (the creation agrees over the ranks): the plain
            // communicator is no longer needed, on every rank alike.
            drop(plain);
            Ok((TpGroup::new(lsa)?, true))
        }
        Err(err) => {
            // The creation fails on every rank alike, so every rank falls back together.
            if plain.rank() == 0 {
                eprintln!("generate: --lsa is not available here ({err}); summing with plain NCCL");
            }
            Ok((plain, false))
        }
    }
}

/// Everything after the communicator, on one rank.
fn generate(
    options: &Options,
    plain: TpGroup,
    spare: Option<nccl::Comm>,
    device: &Device,
    launcher: &str,
) -> Result<(), AnyError> {
    let (rank, world) = (plain.rank(), plain.size());

    // 1. Checkpoint, tokenizer, prompt: each rank alone, then agreed before anything else.
    let (checkpoint, tokenizer, prompt) = agreed(
        &plain,
        device,
        "opening the checkpoint and tokenising the prompt",
        open(options),
    )?;
    plain.agree(
        "the prompt's tokens and the options",
        fingerprint(&(&prompt, format!("{options:?}"))),
        device,
    )?;
    let cfg = checkpoint.config().clone();
    let (max_seq, new_tokens) = lengths(options, prompt.len(), cfg.max_position_embeddings)?;
    let (group, lsa) = model_group(plain, spare, cfg.hidden_size)?;
    let dtype = format!("{:?}", options.dtype).to_lowercase();
    if rank == 0 {
        println!(
            "generate: {} from {}, {world} ranks ({launcher}), {dtype}, path {}, {:?}, NCCL {}",
            cfg.family.architecture(),
            options.model_dir.display(),
            options.path(lsa),
            options.sampling,
            // Only for the record: the communicator works, whatever this says.
            nccl::version().map_or_else(|_| "unknown".to_string(), |v| v.to_string()),
        );
        if new_tokens < options.max_new_tokens {
            println!(
                "generate: {new_tokens} new tokens at most: the prompt's {} and they fill the \
                 {} positions",
                prompt.len(),
                options.max_seq.unwrap_or(cfg.max_position_embeddings)
            );
        }
        println!(
            "loading {} tensors of {:.1} MB over {world} ranks...",
            checkpoint.tensors().len(),
            checkpoint.weight_bytes() as f64 / MB
        );
    }

    // 2. This rank's shard (the load agrees over the ranks itself).
    let start = Instant::now();
    let mut model = CausalLm::load(&checkpoint, &group, options.dtype, device, max_seq)?;
    model.set_fused(options.fused);
    device.synchronize()?;
    let load_time = start.elapsed().as_secs_f64();
    let shard = model.shard_bytes();
    if rank == 0 {
        println!(
            "loaded in {load_time:.1} s ({:.0} MB/s of this rank's shard)",
            shard as f64 / MB / load_time.max(1e-9)
        );
    }
    // Each rank's memory, gathered so that rank 0 prints them in order (a failure to read
    // it is a rank's own: -1, not an error every rank must agree on).
    let host = host_peak().map_or(-1.0, |b| b as f64 / MB);
    let gpu = gpu_used(device).map_or(-1.0, |b| b as f64 / MB);
    let mut row = vec![0f64; 3 * world];
    row[3 * rank..3 * rank + 3].copy_from_slice(&[host, gpu, shard as f64 / MB]);
    let table = group
        .all_reduce(&Tensor::new(row.as_slice(), device)?, ReduceOp::Sum)?
        .to_vec1::<f64>()?;
    if rank == 0 {
        let mb = |v: f64| match v < 0.0 {
            true => "n/a".to_string(),
            false => format!("{v:.1} MB"),
        };
        for (r, m) in table.chunks(3).enumerate() {
            println!(
                "rank {r}: host peak {}, GPU used {}, shard {} of the checkpoint's {:.1} MB",
                mb(m[0]),
                mb(m[1]),
                mb(m[2]),
                checkpoint.weight_bytes() as f64 / MB
            );
        }
    }

    // 3. Generation, streamed on rank 0, after an untimed pass of the prompt and two steps
    //    (every rank alike): kernels load on their first use (a one-rank prefill without it
    //    took 17.9 s on one H200, where warmed-up ones took 0.2 s).
    let warm_up = Feed::Chosen {
        new_tokens: 3,
        eos: &[],
    };
    let mut greedy = Sampler::new(Sampling::Greedy)?;
    decode(
        &mut model,
        &mut greedy,
        &prompt,
        warm_up,
        false,
        device,
        options.graph,
        |_| {},
    )?;
    let mut sampler = Sampler::new(options.sampling)?;
    let mut stream = Stream::new(&tokenizer, &prompt);
    if rank == 0 {
        print(&options.prompt);
    }
    let feed = Feed::Chosen {
        new_tokens,
        eos: &cfg.eos_token_ids,
    };
    let run = decode(
        &mut model,
        &mut sampler,
        &prompt,
        feed,
        false,
        device,
        options.graph,
        |tokens| {
            if rank == 0 {
                stream.push(tokens);
            }
        },
    )?;
    if rank == 0 {
        stream.finish();
    }
    // The ranks chose alone; a difference would be a broken promise of the model or the
    // sampler, found here rather than in a later step's collectives.
    group.agree("the generated tokens", fingerprint(&run.tokens), device)?;
    let mine = [
        run.prefill.as_secs_f64() * 1e3,
        median_ms(&run.steps).unwrap_or(0.0),
    ];
    let slowest = group
        .all_reduce(&Tensor::new(&mine, device)?, ReduceOp::Max)?
        .to_vec1::<f64>()?;
    if rank == 0 {
        let (prefill, step) = (slowest[0], slowest[1]);
        let decode = match run.steps.len() {
            0 => "decode: 0 tokens".to_string(),
            n => format!(
                "decode: {n} tokens, median {step:.2} ms/token ({:.1} tok/s)",
                1e3 / step.max(1e-9)
            ),
        };
        let stop = match run.tokens.last() {
            Some(t) if cfg.eos_token_ids.contains(t) => ", stopped at end of sequence",
            _ => "",
        };
        println!(
            "prefill: {} tokens in {prefill:.1} ms ({:.0} tok/s); {decode}{stop} (slowest rank)",
            prompt.len(),
            prompt.len() as f64 * 1e3 / prefill.max(1e-9),
        );
    }

    // 4. The check.
    if options.check
        && !check(
            options,
            &group,
            device,
            &checkpoint,
            &mut model,
            &prompt,
            new_tokens,
            max_seq,
        )?
    {
        return Err("the check failed (see rank 0's lines above)".into());
    }
    Ok(())
}

fn run(options: &Options) -> Result<(), AnyError> {
    let gpus = nccl::library::cuda_device_count().map_err(|err| {
        format!("finding the GPUs: {err} (generate runs one rank per GPU and needs at least one)")
    })?;
    // Under a launcher this only reads the environment; without one it re-executes this
    // program once per extra GPU and makes this process rank 0.
    let job = spawn_local(gpus)?;
    job.on_failure(|err| {
        // Rank 0 may be blocked on its communicator, which nothing else can interrupt.
        eprintln!("generate: a rank failed: {err}");
        std::process::exit(1)
    });
    let rank = job.placement().rank;
    let launcher = job.placement().launcher.to_string();
    let joined = (|| -> Result<(), AnyError> {
        let device = match options.graph {
            // Its own stream and no cross-stream events: what a capture needs.
            // SAFETY: every use of this device's tensors here is candle's and nccl-candle's,
            // on its one stream.
            true => unsafe { capturable_device(job.device()?)? },
            false => Device::new_cuda_with_stream(job.device()?)?,
        };
        let comm = job.init_comm_on(device.as_cuda_device()?.cuda_stream())?;
        // --lsa's communicator, split off now: LsaCollectives takes its communicator and
        // can only be tried once the checkpoint says the hidden size, and the plain one
        // must stay for the agreements before that (and as the fallback).
        let spare = match options.lsa {
            true => Some(
                comm.split(Some(0), 0)?
                    .ok_or("splitting the communicator for --lsa gave none")?,
            ),
            false => None,
        };
        let plain = TpGroup::new(comm)?;
        generate(options, plain, spare, &device, &launcher)
    })();
    joined.map_err(|err| format!("rank {rank}: {err}"))?;
    job.wait()?;
    Ok(())
}

fn main() -> ExitCode {
    let options = match parse_options() {
        Ok(Some(options)) => options,
        Ok(None) => return ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("generate: {message}");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("generate: {err}");
            ExitCode::FAILURE
        }
    }
}
