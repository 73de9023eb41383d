//! Tensor-parallel inference of a Llama-style decoder on candle over nccl-rs, checked
//! against one GPU and timed.
//!
//! One rank per visible GPU (no launcher needed; also under `mpirun -np N`, `srun`, or
//! torchrun-style launchers; `NCCL_RS_LOCAL_RANKS=N` forces N ranks):
//!
//! ```text
//! cargo run --release --example llama_tp                          # small model, bf16
//! cargo run --release --example llama_tp -- --model large --batch 1,8
//! CUDA_VISIBLE_DEVICES=0,1 cargo run --release --example llama_tp -- --model large
//! mpirun --allow-run-as-root -np 4 target/release/examples/llama_tp --model large
//! cargo run --release --example llama_tp -- --model xl --lsa --fused  # one fused kernel a sum
//! cargo run --release --example llama_tp -- --model large --graph     # decode in a CUDA graph
//! ```
//!
//! `--graph` decodes through the static step (`nccl_candle::decode`): after the prompt, each
//! step reads its ids and position from device memory, and is captured once into a CUDA
//! graph (collectives and shipped kernels included) and replayed per token. The check then
//! also compares the replays with the same step run eagerly, logit for logit (bit-identical
//! expected: the same kernels in the same order).
//!
//! The row-parallel sums (two a layer) run one of three ways, named in the output's `path`:
//! `nccl` (`ncclAllReduce`, the default), `lsa` (`--lsa`: the decode steps' bf16 sums through
//! nccl-rs's shipped all-reduce kernels, `tp::LsaCollectives`), `lsa+fused` (`--lsa --fused`:
//! each sum, the residual add and the next RMSNorm as one shipped kernel,
//! `TpGroup::all_reduce_add_rms_norm`; the forward pass arranged for it, see `model.rs`).
//!
//! 1. Weights: each rank draws the same weights from `--seed` on the host (see
//!    `weights.rs`) and writes its own safetensors file in a private temporary directory
//!    (removed at the end), so nothing is shared between ranks or hosts; or every rank reads
//!    `--weights FILE`. The ranks then agree on a fingerprint of the configuration, the
//!    flags and the file (its header and samples of its bytes) before any collective that
//!    depends on them.
//! 2. Each rank loads its shard through candle's `ShardedVarBuilder`.
//! 3. Check (unless `--no-check`): with more than one rank, rank 0 first loads the whole
//!    model on its own GPU (a one-rank group, no collectives) and decodes every batch
//!    greedily, while the other ranks wait in the all-reduce that agrees on how that went.
//!    Then all ranks decode the same prompts fed the reference's tokens, and rank 0
//!    compares: the choices must be the reference's and every logit within a tolerance of
//!    the reference's: 1e-3 (f32) or 5e-2 (bf16) times the reference's largest |logit|
//!    (bf16 sums in another order round differently; `decode::relative_tolerance` says
//!    why these numbers). A choice may differ only where the reference's two logits are
//!    within twice the tolerance, which the logit bound then allows: a "near-tie". Fed the
//!    reference's tokens, the ranks' decode is the greedy one wherever the choices agree,
//!    and a near-tie does not derail the comparison of the steps after it. With one rank
//!    it checks that the logits are finite. The ranks agree on the verdict before anyone
//!    exits.
//! 4. Timing per batch size: a warm-up decode, a greedy decode, and one with the layers'
//!    collectives skipped (wrong tokens, timing only). Rank 0 prints the slowest rank's
//!    prefill time, median per-token decode latency after `--warmup` steps, and the share
//!    of it the collectives take: (latency - latency without them) / latency. Without them
//!    `lsa+fused` still adds and normalises, with candle's kernels, so its share also counts
//!    what fusing the add and the norm saves.
//!
//! Why past 600 lines: the program's steps in order (options, weights, loading, the check with
//! its graph comparisons, the timing table); the model, the decode loops and the weights are
//! modules of their own.

mod decode;
mod model;
mod weights;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use candle_nn::var_builder::ShardedSafeTensors;
use nccl::bootstrap::spawn_local;
use nccl::ReduceOp;
use nccl_candle::fingerprint;
use nccl_candle::tp::{LsaCollectives, TpGroup};

use decode::{compare, decode, decode_static, median_ms, non_finite, prompt, Feed, Run, Steps};
use model::{Config, Llama};

type AnyError = Box<dyn std::error::Error + Send + Sync>;

const USAGE: &str = "\
usage: llama_tp [--model small|large|xl] [--dtype bf16|f32] [--prompt-len N] [--new-tokens N]
                [--batch 1,8] [--seed N] [--warmup N] [--weights FILE] [--no-check] [--lsa]
                [--fused] [--graph]

  --model       small: vocab 8192, hidden 512, 4 layers, 16 heads (8 key/value), MLP 1408,
                ~20M parameters (default); large: vocab 32000, hidden 4096, 8 layers,
                32 heads, MLP 11008, ~1.9G parameters (3.8 GB in bf16); xl: vocab 32000,
                hidden 8192, 8 layers, 64 heads (8 key/value), MLP 28672, ~7.4G parameters
                (14.8 GB in bf16)
  --dtype       type on the GPU (default bf16); the file holds bf16 either way
  --prompt-len  prompt tokens per row (default 32)
  --new-tokens  tokens generated per row, the first from the prompt's pass (default 32)
  --batch       batch sizes to check and time, comma-separated (default 1,8)
  --seed        seed of the weights and prompts (default 42)
  --warmup      decode steps left out of the median latency (default 3)
  --weights     read this safetensors file (Hugging Face Llama names, the --model's shapes)
                instead of drawing the weights
  --no-check    skip the comparison with the single-GPU model
  --lsa         sum the row-parallel layers' bf16 outputs of decode steps (up to the largest
                batch's rows) with the all-reduce kernels nccl-rs ships
                (nccl::device::LsaAllReduce; NCCL 2.29.2+, every rank in one LSA team)
                instead of ncclAllReduce; the prompt's pass still uses NCCL
  --fused       with --lsa: run each of those sums, the residual add and the RMSNorm after it
                as one kernel nccl-rs ships (the fused tensor-parallel epilogue,
                TpGroup::all_reduce_add_rms_norm); the prompt's pass runs them unfused
  --graph       decode steps replayed from a CUDA graph of the static decode step (captured
                after each prompt), checked against the same step run eagerly

Each rank writes its weights (3.8 GB for large, 14.8 GB for xl) under $TMPDIR (default
/tmp), removed at the end. One rank per visible GPU; NCCL_RS_LOCAL_RANKS=N forces N ranks.";

#[derive(Debug, Clone)]
struct Options {
    model: &'static str,
    dtype: DType,
    prompt_len: usize,
    new_tokens: usize,
    batches: Vec<usize>,
    seed: u64,
    warmup: usize,
    weights: Option<PathBuf>,
    check: bool,
    lsa: bool,
    fused: bool,
    graph: bool,
}

impl Options {
    fn config(&self) -> Config {
        match self.model {
            "large" => Config::large(),
            "xl" => Config::xl(),
            _ => Config::small(),
        }
    }

    /// Which way the row-parallel sums run: the name the output gives it, and what it is.
    fn path(&self) -> (&'static str, &'static str) {
        match (self.lsa, self.fused, self.graph) {
            (false, _, false) => ("nccl", "row-parallel sums through ncclAllReduce"),
            (false, _, true) => (
                "nccl+graph",
                "row-parallel sums through ncclAllReduce, decode steps replayed from a CUDA \
                 graph (--graph)",
            ),
            (true, false, false) => (
                "lsa",
                "decode sums through nccl-rs's shipped all-reduce kernels (--lsa)",
            ),
            (true, false, true) => (
                "lsa+graph",
                "decode sums through nccl-rs's shipped all-reduce kernels, decode steps \
                 replayed from a CUDA graph (--lsa --graph)",
            ),
            (true, true, false) => (
                "lsa+fused",
                "decode sums, residual adds and RMSNorms as nccl-rs's fused epilogue kernel \
                 (--lsa --fused)",
            ),
            (true, true, true) => (
                "fused+graph",
                "decode sums, residual adds and RMSNorms as nccl-rs's fused epilogue kernel, \
                 decode steps replayed from a CUDA graph (--lsa --fused --graph)",
            ),
        }
    }
}

/// The options, or `None` after printing the usage for `--help`.
fn parse_options() -> Result<Option<Options>, String> {
    let mut options = Options {
        model: "small",
        dtype: DType::BF16,
        prompt_len: 32,
        new_tokens: 32,
        batches: vec![1, 8],
        seed: 42,
        warmup: 3,
        weights: None,
        check: true,
        lsa: false,
        fused: false,
        graph: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let number = |name: &str, text: String| -> Result<usize, String> {
            text.parse().map_err(|e| format!("{name} {text:?}: {e}"))
        };
        match arg.as_str() {
            "--model" => {
                options.model = match value("--model")?.as_str() {
                    "small" => "small",
                    "large" => "large",
                    "xl" => "xl",
                    other => return Err(format!("--model {other:?}: small, large or xl")),
                }
            }
            "--dtype" => {
                options.dtype = match value("--dtype")?.as_str() {
                    "bf16" => DType::BF16,
                    "f32" => DType::F32,
                    other => return Err(format!("--dtype {other:?}: bf16 or f32")),
                }
            }
            "--prompt-len" => options.prompt_len = number(&arg, value(&arg)?)?,
            "--new-tokens" => options.new_tokens = number(&arg, value(&arg)?)?,
            "--warmup" => options.warmup = number(&arg, value(&arg)?)?,
            "--seed" => options.seed = number(&arg, value(&arg)?)? as u64,
            "--batch" => {
                options.batches = value(&arg)?
                    .split(',')
                    .map(|b| number("--batch", b.trim().to_string()))
                    .collect::<Result<_, _>>()?
            }
            "--weights" => options.weights = Some(PathBuf::from(value(&arg)?)),
            "--no-check" => options.check = false,
            "--lsa" => options.lsa = true,
            "--fused" => options.fused = true,
            "--graph" => options.graph = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                return Ok(None);
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    if options.prompt_len == 0 || options.new_tokens == 0 {
        return Err("--prompt-len and --new-tokens must be at least 1".into());
    }
    if options.batches.is_empty() || options.batches.contains(&0) {
        return Err("--batch needs sizes of at least 1".into());
    }
    if options.fused && !options.lsa {
        return Err(concat!(
            "--fused needs --lsa: the fused all-reduce + residual add + RMSNorm is a kernel ",
            "nccl-rs ships, run through tp::LsaCollectives (NCCL's own path has no fused ",
            "epilogue)"
        )
        .into());
    }
    Ok(Some(options))
}

/// Whether every rank's `ok` is true (an all-reduce: every rank must call it).
fn all_ok(group: &TpGroup, device: &Device, ok: bool) -> Result<bool, AnyError> {
    let flag = Tensor::new(&[u32::from(ok)], device)?;
    let min = group.all_reduce(&flag, ReduceOp::Min)?.to_vec1::<u32>()?;
    Ok(min.first() == Some(&1))
}

/// `result` where every rank succeeded at `what`; otherwise an error on every rank (this
/// rank's own, or word that another failed), so no rank goes on to wait for a peer that
/// left.
fn agreed<T>(
    group: &TpGroup,
    device: &Device,
    what: &str,
    result: Result<T, AnyError>,
) -> Result<T, AnyError> {
    let everyone = all_ok(group, device, result.is_ok())?;
    match result {
        Err(err) => Err(format!("{what}: {err}").into()),
        Ok(_) if !everyone => Err(format!("{what}: another rank failed").into()),
        Ok(value) => Ok(value),
    }
}

/// A `ShardedVarBuilder` over the weights file, in `dtype` on `device`.
fn var_builder(
    path: &std::path::Path,
    dtype: DType,
    device: &Device,
) -> Result<candle_nn::var_builder::ShardedVarBuilder<'static>, AnyError> {
    // SAFETY: the file is mapped; it is this process's own (in its private temporary
    // directory) or the caller's --weights, which must not change while the program runs.
    Ok(unsafe { ShardedSafeTensors::var_builder(&[path], dtype, device) }?)
}

/// Rank 0's single-GPU decode of every batch, greedy, logits recorded.
fn reference_runs(
    options: &Options,
    path: &std::path::Path,
    device: &Device,
) -> Result<Vec<Run>, AnyError> {
    let cfg = options.config();
    let vb = var_builder(path, options.dtype, device)?;
    let max_seq = options.prompt_len + options.new_tokens;
    let mut model = Llama::load(&vb, &TpGroup::single(), &cfg, max_seq)?;
    let mut runs = Vec::new();
    for &batch in &options.batches {
        let ids = prompt(cfg.vocab, batch, options.prompt_len, options.seed);
        let run = decode(
            &mut model,
            &ids,
            batch,
            options.new_tokens,
            Feed::Greedy,
            true,
            device,
        )?;
        runs.push(run);
    }
    Ok(runs)
}

/// The reference's tokens of a batch (on rank 0) on every rank: an all-reduce (max) in
/// which the other ranks give zeros.
fn share_tokens(
    group: &TpGroup,
    device: &Device,
    mine: Option<&Run>,
    steps: usize,
    batch: usize,
) -> Result<Vec<Vec<u32>>, AnyError> {
    let mut flat = vec![0u32; steps * batch];
    if let Some(run) = mine {
        for (step, row) in run.tokens.iter().take(steps).enumerate() {
            flat[step * batch..][..row.len().min(batch)]
                .copy_from_slice(&row[..row.len().min(batch)]);
        }
    }
    let shared = group
        .all_reduce(&Tensor::new(flat.as_slice(), device)?, ReduceOp::Max)?
        .to_vec1::<u32>()?;
    Ok(shared.chunks(batch).map(<[u32]>::to_vec).collect())
}

/// The check of item 3 in the module's description; true when it passed on every rank.
fn check(
    options: &Options,
    group: &TpGroup,
    device: &Device,
    model: &mut Llama,
    reference: Option<&[Run]>,
) -> Result<bool, AnyError> {
    let (cfg, rank, world) = (options.config(), group.rank(), group.size());
    let relative = decode::relative_tolerance(options.dtype);
    let mut passed = true;
    for (i, &batch) in options.batches.iter().enumerate() {
        let ids = prompt(cfg.vocab, batch, options.prompt_len, options.seed);
        let mine = reference.and_then(|runs| runs.get(i));
        let forced = match world > 1 {
            true => Some(share_tokens(
                group,
                device,
                mine,
                options.new_tokens,
                batch,
            )?),
            false => None,
        };
        let feed = forced.as_deref().map_or(Feed::Greedy, Feed::Forced);
        let record = rank == 0 || world == 1;
        let run = match options.graph {
            true => {
                let graph = decode_static(
                    model,
                    &ids,
                    batch,
                    options.new_tokens,
                    feed,
                    record,
                    device,
                    Steps::Graph,
                )?;
                // What the replays were fed (the reference's tokens, or their own choices),
                // fed again to the same step eagerly (bit for bit) and to the host-driven pass.
                let own = &graph.tokens[..graph.tokens.len().saturating_sub(1)];
                let fed = forced.as_deref().unwrap_or(own);
                let eager = decode_static(
                    model,
                    &ids,
                    batch,
                    options.new_tokens,
                    Feed::Forced(fed),
                    record,
                    device,
                    Steps::Eager,
                )?;
                if rank == 0 {
                    let differ = graph
                        .logits
                        .iter()
                        .flatten()
                        .zip(eager.logits.iter().flatten())
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    let same_tokens = graph.tokens == eager.tokens;
                    let ok = differ == 0 && same_tokens;
                    passed &= ok;
                    if let Some(nodes) = graph.nodes {
                        println!("graph of batch {batch}: {nodes}");
                    }
                    println!(
                        "check batch {batch}: graph replays vs the same step eager: {} logits, {differ} \
                         differ in any bit, tokens {}: {}",
                        graph.logits.iter().map(Vec::len).sum::<usize>(),
                        if same_tokens { "equal" } else { "differ" },
                        if ok { "PASS" } else { "FAIL" }
                    );
                }
                // And the host-driven pass of this model fed the same tokens: the static
                // step attends over the whole cache (later positions masked), so sums may
                // round differently; the tolerance and near-tie rule of the check apply.
                let host = decode(
                    model,
                    &ids,
                    batch,
                    options.new_tokens,
                    Feed::Forced(fed),
                    record,
                    device,
                )?;
                if rank == 0 {
                    let tolerance = decode::tolerance(&host, relative);
                    let verdict = compare(&host, &graph, cfg.vocab, tolerance);
                    let ok = verdict.passed(tolerance);
                    passed &= ok;
                    println!(
                        "check batch {batch}: graph replays vs the host-driven pass: {} choices, {} \
                         near-ties, {} different; max |logit diff| {:.2e} (tolerance {tolerance:.2e}): {}",
                        verdict.compared,
                        verdict.near_ties,
                        verdict.mismatches,
                        verdict.max_diff,
                        if ok { "PASS" } else { "FAIL" }
                    );
                }
                graph
            }
            false => decode(model, &ids, batch, options.new_tokens, feed, record, device)?,
        };
        let wanted = if world > 1 { mine } else { None };
        if rank != 0 {
            continue;
        }
        let first: Vec<u32> = run
            .tokens
            .iter()
            .take(8)
            .filter_map(|row| row.first().copied())
            .collect();
        match wanted {
            Some(reference) => {
                let tolerance = decode::tolerance(reference, relative);
                let verdict = compare(reference, &run, cfg.vocab, tolerance);
                let ok = verdict.passed(tolerance);
                passed &= ok;
                let want: Vec<u32> = reference
                    .tokens
                    .iter()
                    .take(8)
                    .filter_map(|row| row.first().copied())
                    .collect();
                println!(
                    "check batch {batch}: row 0 starts {first:?} ({world} ranks), {want:?} (1 GPU); \
                     {} choices: {} identical, {} near-ties, {} different; max |logit diff| {:.2e} \
                     (tolerance {tolerance:.2e}: {relative:.0e} of the largest), {} non-finite: {}",
                    verdict.compared,
                    verdict.compared - verdict.near_ties - verdict.mismatches,
                    verdict.near_ties,
                    verdict.mismatches,
                    verdict.max_diff,
                    verdict.non_finite,
                    if ok { "PASS" } else { "FAIL" }
                );
            }
            None => {
                let bad = non_finite(&run);
                passed &= bad == 0;
                println!(
                    "check batch {batch}: row 0 starts {first:?}; one rank, nothing to compare; \
                     {bad} non-finite logits: {}",
                    if bad == 0 { "PASS" } else { "FAIL" }
                );
            }
        }
    }
    all_ok(group, device, passed)
}

/// How many times each batch's decode is timed with and without the collectives, in turn.
const TIMING_ROUNDS: usize = 5;

/// One row of the timing table: the slowest rank's prefill ms, decode ms per token, and
/// decode ms per token without the collectives.
fn time_batch(
    options: &Options,
    group: &TpGroup,
    device: &Device,
    model: &mut Llama,
    batch: usize,
) -> Result<[f64; 3], AnyError> {
    let cfg = options.config();
    let ids = prompt(cfg.vocab, batch, options.prompt_len, options.seed);
    let short = options.new_tokens.min(options.warmup + 2);
    let graph = options.graph;
    let mut timed = |skip: bool| -> Result<Run, AnyError> {
        group.set_skip_collectives(skip);
        let one = |model: &mut Llama, tokens: usize| match graph {
            true => decode_static(
                model,
                &ids,
                batch,
                tokens,
                Feed::Greedy,
                false,
                device,
                Steps::Graph,
            ),
            false => decode(model, &ids, batch, tokens, Feed::Greedy, false, device),
        };
        let run = one(model, short).and_then(|_| one(model, options.new_tokens));
        group.set_skip_collectives(false);
        Ok(run?)
    };
    // Alternated, several times over, and pooled: one run after the other showed order
    // effects of +-40% between identical runs on one rank (2xH100, 2026-11-26).
    let (mut with, mut without, mut prefill) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..TIMING_ROUNDS {
        let run = timed(false)?;
        prefill.push(run.prefill);
        with.extend(run.steps.into_iter().skip(options.warmup));
        without.extend(timed(true)?.steps.into_iter().skip(options.warmup));
    }
    let mine = [
        median_ms(&prefill, 0),
        median_ms(&with, 0),
        median_ms(&without, 0),
    ];
    let slowest = group
        .all_reduce(&Tensor::new(&mine, device)?, ReduceOp::Max)?
        .to_vec1::<f64>()?;
    Ok([slowest[0], slowest[1], slowest[2]])
}

fn run(options: &Options) -> Result<(), AnyError> {
    // Under a launcher this only reads the environment; without one it re-executes this
    // program once per extra GPU and makes this process rank 0.
    let gpus = nccl::library::cuda_device_count()?;
    let job = spawn_local(gpus)?;
    job.on_failure(|err| {
        // Rank 0 may be blocked on its communicator, which nothing else can interrupt.
        eprintln!("llama_tp: a rank failed: {err}");
        std::process::exit(1)
    });
    let launcher = job.placement().launcher;
    let device = match options.graph {
        // Its own stream and no cross-stream events: what a capture needs.
        // SAFETY: every use of this device's tensors here is candle's and nccl-candle's, on its
        // one stream.
        true => unsafe { nccl_candle::decode::capturable_device(job.device()?)? },
        false => Device::new_cuda_with_stream(job.device()?)?,
    };
    let comm = job.init_comm_on(device.as_cuda_device()?.cuda_stream())?;
    let (rank, world) = (comm.rank(), comm.size());
    let cfg = options.config();
    let group = if options.lsa {
        // A decode step's all-reduces carry one row per sequence of the batch.
        let rows = options.batches.iter().copied().max().unwrap_or(1);
        TpGroup::new(LsaCollectives::new(comm, rows * cfg.hidden)?)?
    } else {
        TpGroup::new(comm)?
    };
    // The same verdict on every rank, before any collective.
    cfg.check(world)?;
    let dtype = format!("{:?}", options.dtype).to_lowercase();
    if rank == 0 {
        println!(
            "llama_tp: {} model ({:.2}G parameters) in {dtype}, {world} ranks ({launcher}), \
             prompt {} tokens, {} new tokens, NCCL {}; path {}: {}",
            options.model,
            cfg.parameters() as f64 / 1e9,
            options.prompt_len,
            options.new_tokens,
            nccl::version()?,
            options.path().0,
            options.path().1,
        );
    }

    // 1. The weights, a file of this rank's own unless --weights.
    let start = Instant::now();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) / gpus.max(1);
    let made: Result<_, AnyError> = (|| {
        let (path, dir) = match &options.weights {
            Some(path) => (path.clone(), None),
            None => {
                let dir = tempfile::Builder::new().prefix("llama_tp-").tempdir()?;
                let path = dir.path().join("weights.safetensors");
                weights::write(&cfg, options.seed, &path, threads.max(1))?;
                (path, Some(dir))
            }
        };
        let file = weights::file_fingerprint(&path)?;
        Ok((path, dir, file))
    })();
    let (path, _dir, file) = agreed(&group, &device, "writing the weights", made)?;
    let settings = (
        cfg,
        &dtype,
        options.prompt_len,
        options.new_tokens,
        &options.batches,
    );
    let flags = (
        (options.seed, options.warmup, options.check, file),
        (options.lsa, options.fused, options.graph),
    );
    group.agree(
        "configuration, flags and weights",
        fingerprint(&(settings, flags)),
        &device,
    )?;
    let written = start.elapsed();

    // 2. This rank's shard.
    let start = Instant::now();
    let max_seq = options.prompt_len + options.new_tokens;
    let loaded = var_builder(&path, options.dtype, &device)
        .and_then(|vb| Ok(Llama::load(&vb, &group, &cfg, max_seq)?));
    let mut model = agreed(&group, &device, "loading the model", loaded)?;
    model.set_fused(options.fused);
    let load_time = start.elapsed();

    // 3. The check; the other ranks wait in `agreed` while rank 0 runs the reference.
    let start = Instant::now();
    let reference = match options.check && world > 1 && rank == 0 {
        true => reference_runs(options, &path, &device).map(Some),
        false => Ok(None),
    };
    let reference = agreed(&group, &device, "the single-GPU reference", reference)?;
    if options.check && !check(options, &group, &device, &mut model, reference.as_deref())? {
        return Err("the check failed (see rank 0's lines above)".into());
    }
    if rank == 0 {
        println!(
            "weights drawn and written in {:.1} s, shard loaded in {:.1} s, check took {:.1} s",
            written.as_secs_f64(),
            load_time.as_secs_f64(),
            start.elapsed().as_secs_f64()
        );
    }

    // 4. Timing.
    let mut rows = Vec::new();
    for &batch in &options.batches {
        rows.push((
            batch,
            time_batch(options, &group, &device, &mut model, batch)?,
        ));
    }
    if rank == 0 {
        println!(
            "world | batch | path        | prefill ms | decode ms/token | tokens/s | no-collectives ms/token | collective share"
        );
        for (batch, [prefill, decode, without]) in rows {
            // One rank runs no collective: its two columns differ by noise alone.
            let share = match world {
                1 => "none".to_string(),
                _ => format!("{:.1}%", 100.0 * (decode - without) / decode),
            };
            println!(
                "{world:>5} | {batch:>5} | {:<11} | {prefill:>10.2} | {decode:>15.3} | {:>8.0} | {without:>23.3} | {share:>16}",
                options.path().0,
                batch as f64 * 1e3 / decode,
            );
        }
        println!(
            "(slowest rank; medians over {TIMING_ROUNDS} decodes with and {TIMING_ROUNDS} without the \
             collectives, in turn, each after {} warm-up steps; the runs without compute wrong \
             tokens and only time the rest{})",
            options.warmup,
            if options.fused {
                "; without the collectives, lsa+fused adds and normalises with candle's kernels"
            } else {
                ""
            }
        );
    }
    drop(model);
    drop(group);
    job.wait()?;
    Ok(())
}

fn main() -> ExitCode {
    let options = match parse_options() {
        Ok(Some(options)) => options,
        Ok(None) => return ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("llama_tp: {message}");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("llama_tp: {err}");
            ExitCode::FAILURE
        }
    }
}
