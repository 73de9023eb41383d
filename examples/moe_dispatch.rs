//! Mixture-of-experts dispatch and combine with `all_to_all_v`, verified token by token.
//!
//! Every rank holds `--tokens` tokens of `--hidden` f32 each and `--experts` experts; a
//! router sends each token to one expert somewhere (skewed, as real routers are), the ranks
//! exchange how many tokens each sends where (`Comm::exchange_counts`), the tokens and their
//! expert ids travel with `all_to_all_v`, each expert applies a known transform
//! (`x * (e + 2) + e`), and the results travel back along the reversed layouts. Every token
//! must come home transformed by its own expert and in its original order.
//!
//! Runs unchanged under `mpirun -np N` (or `srun`, torchrun-style launchers), or alone, in
//! which case it starts one process per visible GPU itself:
//!
//! ```text
//! cargo run --release --example moe_dispatch
//! mpirun --allow-run-as-root -np 4 target/release/examples/moe_dispatch --tokens 8192
//! ```

use std::process::ExitCode;

use nccl::bootstrap::spawn_local;
use nccl::{Error, Layout};

struct Options {
    tokens: usize,
    hidden: usize,
    experts: usize,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        tokens: 4096,
        hidden: 64,
        experts: 2,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> Result<usize, String> {
            args.next()
                .ok_or_else(|| format!("{name} needs a value"))?
                .parse()
                .map_err(|e| format!("{name}: {e}"))
        };
        match arg.as_str() {
            "--tokens" => options.tokens = value("--tokens")?,
            "--hidden" => options.hidden = value("--hidden")?.max(1),
            "--experts" => options.experts = value("--experts")?.max(1),
            "-h" | "--help" => {
                return Err(
                    "usage: moe_dispatch [--tokens N] [--hidden N] [--experts PER_RANK]".into(),
                );
            }
            other => return Err(format!("unknown argument {other:?}; try --help")),
        }
    }
    Ok(options)
}

/// SplitMix64 of the token's global id: the router's deterministic "score".
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The expert of a token: the smaller of two uniform picks, so low experts are hot.
fn route(token_id: u64, experts: usize) -> usize {
    let e = experts as u64;
    (mix(token_id) % e).min(mix(token_id ^ 0xabcd) % e) as usize
}

/// A token's value (exact in f32 for any realistic size).
fn value(token_id: u64, k: usize) -> f32 {
    ((token_id % 100_000) + k as u64 % 3) as f32
}

/// What expert `e` does to a value.
fn transform(x: f32, e: usize) -> f32 {
    x * (e % 5 + 2) as f32 + (e % 5) as f32
}

fn invalid(message: String) -> Error {
    Error::InvalidUsage(message)
}

fn run(options: &Options) -> nccl::Result<()> {
    let gpus = nccl::library::cuda_device_count()?;
    let job = spawn_local(gpus)?;
    let (comm, stream) = job.init_comm()?;
    let (rank, n) = (comm.rank(), comm.size());
    let (tokens, hidden) = (options.tokens, options.hidden);
    let experts = options.experts * n;
    if rank == 0 {
        println!(
            "MoE dispatch: {tokens} tokens x {hidden} f32 per rank, {experts} experts over \
             {n} ranks, NCCL {}",
            nccl::version()?
        );
    }

    // Route, and order this rank's tokens by destination rank (then expert, then position):
    // `order[p]` is the token at position `p` of the send buffer.
    let global = |t: usize| (rank * tokens + t) as u64;
    let expert_of: Vec<usize> = (0..tokens).map(|t| route(global(t), experts)).collect();
    let mut order: Vec<usize> = (0..tokens).collect();
    order.sort_by_key(|&t| (expert_of[t], t));
    let mut tokens_to = vec![0usize; n];
    for &e in &expert_of {
        tokens_to[e / options.experts] += 1;
    }

    // Each rank knows only what it sends; the exchange gives what it receives.
    let from = comm.exchange_counts(&tokens_to)?;
    let tokens_from = from.counts().to_vec();
    let received: usize = tokens_from.iter().sum();

    let host_tokens: Vec<f32> = order
        .iter()
        .flat_map(|&t| (0..hidden).map(move |k| value(global(t), k)))
        .collect();
    let host_experts: Vec<i32> = order.iter().map(|&t| expert_of[t] as i32).collect();
    let elements = |counts: &[usize]| counts.iter().map(|c| c * hidden).collect::<Vec<_>>();
    let send_layout = Layout::packed(elements(&tokens_to));
    let recv_layout = Layout::packed(elements(&tokens_from));

    // Dispatch: the tokens, and which expert each is for.
    let send = stream.clone_htod(&host_tokens)?;
    let mut routed = stream.alloc_zeros::<f32>(received * hidden + 1)?;
    let mut routed = routed.slice_mut(..received * hidden);
    comm.all_to_all_v(&send, send_layout.clone(), &mut routed, recv_layout.clone())?;
    let ids = stream.clone_htod(&host_experts)?;
    let mut routed_ids = stream.alloc_zeros::<i32>(received + 1)?;
    let mut routed_ids = routed_ids.slice_mut(..received);
    comm.all_to_all_v(
        &ids,
        tokens_to.clone(),
        &mut routed_ids,
        tokens_from.clone(),
    )?;
    comm.synchronize()?;

    // The experts (on the host: this example is about the communication).
    let mut work = stream.clone_dtoh(&routed)?;
    let work_ids = stream.clone_dtoh(&routed_ids)?;
    for (token, &e) in work.chunks_mut(hidden).zip(&work_ids) {
        let e = e as usize;
        if e / options.experts != rank {
            return Err(invalid(format!(
                "rank {rank} received a token for expert {e}"
            )));
        }
        token.iter_mut().for_each(|x| *x = transform(*x, e));
    }
    let done = stream.clone_htod(&work)?;

    // Combine: the same segments back, the layouts swapped.
    let mut home = stream.alloc_zeros::<f32>(tokens * hidden + 1)?;
    let mut home = home.slice_mut(..tokens * hidden);
    let done = done.slice(..received * hidden);
    comm.all_to_all_v(&done, recv_layout, &mut home, send_layout)?;
    comm.synchronize()?;

    let home = stream.clone_dtoh(&home)?;
    let mut wrong = 0;
    for (p, &t) in order.iter().enumerate() {
        for k in 0..hidden {
            if home[p * hidden + k] != transform(value(global(t), k), expert_of[t]) {
                wrong += 1;
            }
        }
    }
    if wrong > 0 {
        return Err(invalid(format!(
            "rank {rank}: {wrong} of {} values came home wrong",
            tokens * hidden
        )));
    }
    println!(
        "rank {rank}/{n}: sent {tokens_to:?} tokens, received {tokens_from:?}; all {tokens} \
         came home transformed, in order"
    );
    drop(comm);
    job.wait()?;
    Ok(())
}

fn main() -> ExitCode {
    let options = match parse_options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("moe_dispatch: {err}");
            ExitCode::FAILURE
        }
    }
}
