//! Writes synthetic Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3, and the
//! mixture-of-experts Mixtral and Qwen3-MoE) for trying the model loaders without downloading
//! a model:
//!
//! ```text
//! cargo run --example hf_checkpoint -- --list
//! cargo run --example hf_checkpoint -- --preset llama-gqa-bf16 --out /tmp/llama
//! cargo run --example hf_checkpoint -- --preset mixtral-tiny --out /tmp/mixtral
//! cargo run --example hf_checkpoint -- --all --out /tmp/checkpoints   # one folder per preset
//! ```

mod writer;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

const USAGE: &str = "usage: hf_checkpoint --list
       hf_checkpoint --preset NAME --out DIR
       hf_checkpoint --all --out DIR   (writes DIR/NAME for every preset, MoE ones too,
                                        not the large ones)";

enum Command {
    List,
    One { preset: String, out: PathBuf },
    All { out: PathBuf },
    Help,
}

fn parse(args: &[String]) -> Result<Command, String> {
    let (mut list, mut all, mut help) = (false, false, false);
    let (mut preset, mut out) = (None, None);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |flag: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match arg.as_str() {
            "--list" => list = true,
            "--all" => all = true,
            "--help" | "-h" => help = true,
            "--preset" => preset = Some(value("--preset")?),
            "--out" => out = Some(PathBuf::from(value("--out")?)),
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    match (help, list, all, preset, out) {
        (true, ..) => Ok(Command::Help),
        (false, true, false, None, None) => Ok(Command::List),
        (false, false, true, None, Some(out)) => Ok(Command::All { out }),
        (false, false, false, Some(preset), Some(out)) => Ok(Command::One { preset, out }),
        (false, false, true, None, None) => Err("--all needs --out".into()),
        (false, false, false, Some(_), None) => Err("--preset needs --out".into()),
        _ => Err("give one of --list, --preset NAME --out DIR, --all --out DIR".into()),
    }
}

fn list() {
    println!(
        "{:<26} {:<9} {:>5} {:>6} {:>6} {:>6} {:>5} {:>3} {:>8} {:<5} {:>6} {:<5} extras",
        "name",
        "family",
        "vocab",
        "hidden",
        "inter",
        "layers",
        "heads",
        "kv",
        "head_dim",
        "dtype",
        "shards",
        "tied"
    );
    let large: Vec<&str> = writer::large_presets().iter().map(|s| s.name).collect();
    for s in writer::presets()
        .into_iter()
        .chain(writer::moe_presets())
        .chain(writer::large_presets())
    {
        let mut extras = Vec::new();
        if large.contains(&s.name) {
            extras.push("large: not in --all".to_string());
        }
        if s.llama3_rope {
            extras.push("llama3 rope, eos list".to_string());
        }
        if let Some(w) = s.sliding_window {
            extras.push(format!("sliding_window {w}"));
        }
        if s.qkv_bias() {
            extras.push(if s.o_bias() { "qkvo bias" } else { "qkv bias" }.to_string());
        }
        if s.family.is_moe() {
            extras.push(format!(
                "{} experts of {}, top {}{}",
                s.experts,
                s.expert_intermediate,
                s.experts_per_token,
                if s.norm_topk_prob {
                    " renormalised"
                } else {
                    ""
                }
            ));
            if s.sparse_step > 1 {
                extras.push(format!("experts every {} layers", s.sparse_step));
            }
        }
        println!(
            "{:<26} {:<9} {:>5} {:>6} {:>6} {:>6} {:>5} {:>3} {:>8} {:<5} {:>6} {:<5} {}",
            s.name,
            s.family.model_type(),
            s.vocab,
            s.hidden,
            s.intermediate,
            s.layers,
            s.heads,
            s.kv_heads,
            s.head_size(),
            format!("{:?}", s.dtype).to_lowercase(),
            s.shards,
            s.tie_embeddings,
            extras.join(", ")
        );
    }
}

/// Writes one preset and prints its files and their sizes.
fn write_one(spec: &writer::Spec, dir: &Path) -> Result<(), String> {
    writer::write(spec, dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let tensors = writer::tensor_names_and_shapes(spec);
    let params: usize = tensors
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    println!(
        "{} -> {} ({} tensors, {params} parameters)",
        spec.name,
        dir.display(),
        tensors.len()
    );
    // Only the files this preset writes: the folder may hold others.
    let mut names = spec.weight_files();
    if spec.shards > 1 {
        names.push("model.safetensors.index.json".into());
    }
    for name in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        names.push(name.into());
    }
    names.sort();
    let mut total = 0;
    for name in names {
        let path = dir.join(&name);
        let bytes = std::fs::metadata(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?
            .len();
        total += bytes;
        println!("  {name:<36} {bytes:>10} bytes");
    }
    println!("  {:<36} {total:>10} bytes", "total");
    Ok(())
}

fn run(cmd: Command) -> Result<(), String> {
    match cmd {
        Command::Help => println!("{USAGE}"),
        Command::List => list(),
        Command::One { preset, out } => {
            let spec = writer::preset(&preset).ok_or_else(|| {
                let names: Vec<&str> = writer::presets()
                    .iter()
                    .chain(&writer::moe_presets())
                    .chain(&writer::large_presets())
                    .map(|s| s.name)
                    .collect();
                format!("no preset `{preset}`; presets: {}", names.join(", "))
            })?;
            write_one(&spec, &out)?;
        }
        Command::All { out } => {
            for spec in writer::presets().into_iter().chain(writer::moe_presets()) {
                write_one(&spec, &out.join(spec.name))?;
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cmd = match parse(&args) {
        Ok(cmd) => cmd,
        Err(e) => {
            eprintln!("hf_checkpoint: {e}\n{USAGE}");
            return ExitCode::FAILURE;
        }
    };
    match run(cmd) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hf_checkpoint: {e}");
            ExitCode::FAILURE
        }
    }
}
