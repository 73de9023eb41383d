//! The mixture-of-experts exchange nccl-rs ships (`nccl::device::ExpertExchange`) on real
//! GPUs: dispatch and combine on both paths (the LSA kernels, and the all-to-all-v fallback
//! forced), bf16 and f32, checked exactly against a host reference on random data for every
//! routing pattern that matters (random, all tokens to one rank, none to a rank, several
//! experts of one rank per token, skewed onto one expert, an empty batch, dropped choices,
//! full batches), the two paths giving the same bits, CUDA-graph replay of the LSA kernels,
//! bad routing reported as a typed error (its token NaN) without leaving the peers hanging,
//! and a stale `Dispatched` refused.
//!
//! Ranks are threads of one process: one GPU each, or two sharing GPU 0 (NCCL 2.30+, one LSA
//! team); host copies go through page-locked memory (`Staging`). Run on a GPU host with
//! `cargo test --test gpu_expert_exchange -- --include-ignored --test-threads=1` (or
//! `.gpu/run tests`), with NCCL 2.32.3 and the system's 2.28.3 (the fallback only).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::shape::skip;
use common::threaded::{per_rank, Deadline, Staging};
use common::Rng;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream};
use nccl::device::{ExchangePath, ExpertExchange, ExpertShape, LsaElem, DEV_COMM_SINCE};
use nccl::{Comm, Error};

const LIMIT: Duration = Duration::from_secs(240);
/// How long the tests' kernels wait for their peers: a failure shows in seconds.
const TIMEOUT: Duration = Duration::from_secs(20);

/// A test element: conversions from the small integers the data holds.
trait TestElem: LsaElem + Default + std::fmt::Debug + PartialEq {
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
    fn bits(self) -> u32;
}
impl TestElem for f32 {
    fn from_f32(v: f32) -> Self {
        v
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
}
impl TestElem for half::bf16 {
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    fn bits(self) -> u32 {
        u32::from(self.to_bits())
    }
}

/// How the tokens of a case are routed.
#[derive(Debug, Clone, Copy)]
enum Pattern {
    Random,
    AllToRankZero,
    NoneToLastRank,
    OneRankPerToken,
    SkewedOntoExpertZero,
    EmptyOnRankZero,
    SomeDropped,
    Full,
}

/// Every rank's tokens and routing of a case (every rank computes all of them, so each can
/// check its own experts' rows).
struct Case {
    x: Vec<Vec<f32>>,
    routing: Vec<Vec<i32>>,
    weights: Vec<Vec<f32>>,
}

fn distinct(rng: &mut Rng, from: &[i32], k: usize) -> Vec<i32> {
    let mut pool = from.to_vec();
    let mut out = Vec::with_capacity(k);
    for _ in 0..k {
        let i = rng.range(0, pool.len() as i64 - 1) as usize;
        out.push(pool.swap_remove(i));
    }
    out
}

fn case(shape: &ExpertShape, ranks: usize, pattern: Pattern, seed: u64) -> Case {
    let mut rng = Rng::new(seed);
    let (e, k, l) = (
        shape.experts as i32,
        shape.top_k,
        shape.local_experts(ranks) as i32,
    );
    let all: Vec<i32> = (0..e).collect();
    let mut case = Case {
        x: vec![],
        routing: vec![],
        weights: vec![],
    };
    for rank in 0..ranks {
        let tokens = match pattern {
            Pattern::EmptyOnRankZero if rank == 0 => 0,
            Pattern::Full => shape.max_tokens,
            _ => rng.range(1, shape.max_tokens as i64) as usize,
        };
        let x = (0..tokens * shape.hidden)
            .map(|_| rng.range(-8, 8) as f32)
            .collect();
        let mut routing = Vec::with_capacity(tokens * k);
        for _ in 0..tokens {
            let choices = match pattern {
                Pattern::AllToRankZero => distinct(&mut rng, &all[..l as usize], k.min(l as usize)),
                Pattern::NoneToLastRank => distinct(&mut rng, &all[..(e - l) as usize], k),
                Pattern::OneRankPerToken => {
                    let r = rng.range(0, ranks as i64 - 1) as usize;
                    let mine = &all[r * l as usize..(r + 1) * l as usize];
                    distinct(&mut rng, mine, k.min(l as usize))
                }
                Pattern::SkewedOntoExpertZero => {
                    let mut c = vec![0];
                    c.extend(distinct(&mut rng, &all[1..], k - 1));
                    c
                }
                Pattern::SomeDropped => distinct(&mut rng, &all, k)
                    .into_iter()
                    .map(|x| if rng.range(0, 2) == 0 { -1 } else { x })
                    .collect(),
                _ => distinct(&mut rng, &all, k),
            };
            let mut choices = choices;
            choices.resize(k, -1);
            routing.extend(choices);
        }
        let weights = (0..tokens * k)
            .map(|_| [0.25f32, 0.5, 1.0, 2.0][rng.range(0, 3) as usize])
            .collect();
        case.x.push(x);
        case.routing.push(routing);
        case.weights.push(weights);
    }
    case
}

/// What rank `rank`'s local expert `le` receives: rank 0's rows in entry order, then rank
/// 1's, ...
fn expected_rows<'a>(
    case: &'a Case,
    shape: &ExpertShape,
    rank: usize,
    le: usize,
) -> Vec<&'a [f32]> {
    let ranks = case.x.len();
    let e = (rank * shape.local_experts(ranks) + le) as i32;
    let mut rows = vec![];
    for s in 0..ranks {
        for (i, &c) in case.routing[s].iter().enumerate() {
            if c == e {
                let t = i / shape.top_k;
                rows.push(&case.x[s][t * shape.hidden..(t + 1) * shape.hidden]);
            }
        }
    }
    rows
}

/// The expert the test runs: its input plus its number (exact in bf16 for the data's range).
fn expert(e: usize, x: f32) -> f32 {
    x + e as f32
}

/// Rank `rank`'s combined output, as the kernels compute it: f32 fused multiply-adds in k
/// order, rounded once.
fn expected_out<T: TestElem>(case: &Case, shape: &ExpertShape, rank: usize) -> Vec<T> {
    let (k, h) = (shape.top_k, shape.hidden);
    let tokens = case.x[rank].len() / h;
    let mut out = Vec::with_capacity(tokens * h);
    for t in 0..tokens {
        for j in 0..h {
            let mut acc = 0f32;
            for c in 0..k {
                let e = case.routing[rank][t * k + c];
                if e < 0 {
                    continue;
                }
                let y = T::from_f32(expert(e as usize, case.x[rank][t * h + j])).to_f32();
                acc = case.weights[rank][t * k + c].mul_add(y, acc);
            }
            out.push(T::from_f32(acc));
        }
    }
    out
}

/// A rank's device buffers and page-locked rooms for one shape, made before any kernel runs.
struct Buffers<T> {
    x: CudaSlice<T>,
    routing: CudaSlice<i32>,
    recv: CudaSlice<T>,
    counts: CudaSlice<i32>,
    expert_out: CudaSlice<T>,
    weights: CudaSlice<f32>,
    out: CudaSlice<T>,
    rows: Staging<T>,
    ints: Staging<i32>,
    floats: Staging<f32>,
}

impl<T: TestElem> Buffers<T> {
    fn new(stream: &Arc<CudaStream>, shape: &ExpertShape, ranks: usize) -> Self {
        let rows = shape.received_rows(ranks) * shape.hidden;
        let entries = shape.max_tokens * shape.top_k;
        let alloc = |n: usize| stream.alloc_zeros::<T>(n).expect("device memory");
        Buffers {
            x: alloc(shape.max_tokens * shape.hidden),
            routing: stream.alloc_zeros(entries).expect("routing"),
            recv: alloc(rows),
            counts: stream
                .alloc_zeros(shape.local_experts(ranks))
                .expect("counts"),
            expert_out: alloc(rows),
            weights: stream.alloc_zeros(entries).expect("weights"),
            out: alloc(shape.max_tokens * shape.hidden),
            rows: Staging::new(stream, rows),
            ints: Staging::new(stream, entries.max(shape.experts)),
            floats: Staging::new(stream, entries),
        }
    }
}

/// One dispatch and combine of `case` on this rank, checked against the host; returns the
/// combined output's bits.
fn run_case<T: TestElem>(
    ex: &mut ExpertExchange<'_, T>,
    b: &mut Buffers<T>,
    case: &Case,
    label: &str,
) -> Vec<u32> {
    let none = vec![vec![]; case.x.len()];
    run_case_with(ex, b, case, label, &none)
}

/// [`run_case`] with routing entries of each rank replaced by bad values (`corrupt[rank]`:
/// entry, value) in what is uploaded: the kernels must drop them alike on every rank, write
/// NaN over their tokens, and report the first on its rank's `check`.
fn run_case_with<T: TestElem>(
    ex: &mut ExpertExchange<'_, T>,
    b: &mut Buffers<T>,
    sent: &Case,
    label: &str,
    corrupt: &[Vec<(usize, i32)>],
) -> Vec<u32> {
    let (rank, ranks) = (ex.comm().rank(), ex.comm().size());
    let shape = ex.shape();
    let (h, k, l) = (shape.hidden, shape.top_k, ex.local_experts());
    // What the ranks must see: every corrupted entry dropped.
    let dropped = Case {
        x: sent.x.clone(),
        routing: (0..ranks)
            .map(|r| {
                let mut routing = sent.routing[r].clone();
                for &(entry, _) in &corrupt[r] {
                    routing[entry] = -1;
                }
                routing
            })
            .collect(),
        weights: sent.weights.clone(),
    };
    let case = &dropped;
    let mut routing = sent.routing[rank].clone();
    for &(entry, value) in &corrupt[rank] {
        routing[entry] = value;
    }
    let nan_tokens: Vec<usize> = corrupt[rank].iter().map(|&(entry, _)| entry / k).collect();
    let tokens = case.x[rank].len() / h;
    let x: Vec<T> = case.x[rank].iter().map(|&v| T::from_f32(v)).collect();
    b.rows.upload(&x, &mut b.x.slice_mut(..tokens * h));
    b.ints
        .upload(&routing, &mut b.routing.slice_mut(..tokens * k));
    let dispatched = ex
        .dispatch(
            &b.x.slice(..tokens * h),
            &b.routing.slice(..tokens * k),
            &mut b.recv,
            &mut b.counts,
        )
        .unwrap_or_else(|e| panic!("rank {rank} {label}: dispatch: {e}"));
    let counts = b.ints.download(&b.counts);
    let recv = b.rows.download(&b.recv);
    match (ex.check(), corrupt[rank].first()) {
        (Ok(()), None) => {}
        (Err(Error::InvalidArgument(msg)), Some(&(entry, value))) => {
            let at = format!(
                "entry {entry} (token {}, choice {}) is {value}:",
                entry / k,
                entry % k
            );
            assert!(msg.contains(&at), "rank {rank} {label}: {msg} (want {at})");
        }
        (other, first) => panic!("rank {rank} {label}: dispatch: {other:?}, bad entry {first:?}"),
    }
    let block = ranks * shape.max_tokens;
    let mut expert_out = vec![T::default(); recv.len()];
    for (le, &count) in counts.iter().enumerate().take(l) {
        let want = expected_rows(case, &shape, rank, le);
        assert_eq!(
            count as usize,
            want.len(),
            "rank {rank} {label}: local expert {le}'s count"
        );
        let e = rank * l + le;
        for (j, row) in want.iter().enumerate() {
            let at = (le * block + j) * h;
            let got: Vec<f32> = recv[at..at + h].iter().map(|v| v.to_f32()).collect();
            assert_eq!(&got[..], *row, "rank {rank} {label}: expert {e} row {j}");
            for c in 0..h {
                expert_out[at + c] = T::from_f32(expert(e, row[c]));
            }
        }
    }
    b.rows.upload(&expert_out, &mut b.expert_out);
    b.floats
        .upload(&case.weights[rank], &mut b.weights.slice_mut(..tokens * k));
    ex.combine(
        dispatched,
        &b.expert_out,
        &b.weights.slice(..tokens * k),
        &mut b.out.slice_mut(..tokens * h),
    )
    .unwrap_or_else(|e| panic!("rank {rank} {label}: combine: {e}"));
    let out = b.rows.download(&b.out.slice(..tokens * h));
    ex.check()
        .unwrap_or_else(|e| panic!("rank {rank} {label}: combine failed: {e}"));
    let want = expected_out::<T>(case, &shape, rank);
    let wrong: Vec<usize> = (0..want.len())
        .filter(|&i| {
            if nan_tokens.contains(&(i / h)) {
                !out[i].to_f32().is_nan()
            } else {
                out[i] != want[i]
            }
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "rank {rank} {label}: {} of {} combined elements wrong, first {}: {:?} want {:?}",
        wrong.len(),
        want.len(),
        wrong[0],
        out[wrong[0]],
        want[wrong[0]]
    );
    out.iter().map(|v| v.bits()).collect()
}

const PATTERNS: [Pattern; 8] = [
    Pattern::Random,
    Pattern::AllToRankZero,
    Pattern::NoneToLastRank,
    Pattern::OneRankPerToken,
    Pattern::SkewedOntoExpertZero,
    Pattern::EmptyOnRankZero,
    Pattern::SomeDropped,
    Pattern::Full,
];

fn lsa_possible(test: &str) -> bool {
    let lib = nccl::library::get().expect("NCCL loads");
    if lib.version() < DEV_COMM_SINCE {
        skip(
            test,
            &format!(
                "the LSA path needs NCCL {DEV_COMM_SINCE}+, loaded {} (the fallback tests run)",
                lib.version()
            ),
        );
        return false;
    }
    true
}

fn comms(test: &str) -> Option<Vec<Comm>> {
    common::shape::setup();
    let layout = common::shape::threaded(test)?;
    Some(Comm::init_all(&layout.streams()).expect("ncclCommInitAll"))
}

/// Every pattern on `path`, in `T`, for a few shapes; returns each rank's outputs' bits.
fn patterns_on<T: TestElem>(test: &'static str, path: ExchangePath) -> Option<Vec<Vec<u32>>> {
    let comms = comms(test)?;
    let _deadline = Deadline::new(test, LIMIT);
    let ranks = comms.len();
    let outs = per_rank(comms, |comm, _| {
        let mut bits = vec![];
        // Rows of 64 bf16 (8 vectors: fewer than a warp's lanes) and of 1 040 (past them);
        // top-1, top-2 and top-4; experts 2 and 8 a rank.
        for (shape_no, shape) in [
            ExpertShape::new(8 * ranks, 2, 64, 24),
            ExpertShape::new(2 * ranks, 1, 1040, 7),
            ExpertShape::new(8 * ranks, 4, 256, 32),
            // top-8: two batches of rows in the combine's sum.
            ExpertShape::new(16 * ranks, 8, 1040, 12),
        ]
        .into_iter()
        .enumerate()
        {
            let stream = comm.stream().clone();
            let mut b = Buffers::<T>::new(&stream, &shape, ranks);
            let mut ex = ExpertExchange::<T>::new(&comm, shape, path)
                .unwrap_or_else(|e| panic!("rank {}: new: {e}", comm.rank()));
            ex.set_timeout(TIMEOUT);
            if path != ExchangePath::Auto {
                assert_eq!(ex.path(), path);
            }
            for (i, pattern) in PATTERNS.into_iter().enumerate() {
                if shape.top_k == 1 && matches!(pattern, Pattern::SkewedOntoExpertZero) {
                    continue;
                }
                let seed = 1000 * shape_no as u64 + i as u64;
                let case = case(&shape, ranks, pattern, seed);
                let label = format!("{shape:?} {pattern:?} on {path:?}");
                bits.extend(run_case(&mut ex, &mut b, &case, &label));
            }
        }
        bits
    });
    common::shape::ran(test, &format!("{ranks} ranks, {path:?}"));
    Some(outs)
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn every_pattern_exact_on_the_lsa_kernels_bf16() {
    const TEST: &str = "every_pattern_exact_on_the_lsa_kernels_bf16";
    if lsa_possible(TEST) {
        patterns_on::<half::bf16>(TEST, ExchangePath::Lsa);
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn every_pattern_exact_on_the_lsa_kernels_f32() {
    const TEST: &str = "every_pattern_exact_on_the_lsa_kernels_f32";
    if lsa_possible(TEST) {
        patterns_on::<f32>(TEST, ExchangePath::Lsa);
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn every_pattern_exact_on_the_all_to_all_v_fallback() {
    const TEST: &str = "every_pattern_exact_on_the_all_to_all_v_fallback";
    let fallback = patterns_on::<half::bf16>(TEST, ExchangePath::AllToAllV);
    // Where the LSA kernels run too, both paths give the same bits.
    if let (Some(fallback), true) = (fallback, lsa_possible(TEST)) {
        let lsa = patterns_on::<half::bf16>(TEST, ExchangePath::Lsa).expect("same layout");
        assert_eq!(fallback, lsa, "the two paths' combined outputs differ");
    }
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn lsa_calls_replay_from_a_cuda_graph() {
    const TEST: &str = "lsa_calls_replay_from_a_cuda_graph";
    if !lsa_possible(TEST) {
        return;
    }
    let Some(comms) = comms(TEST) else { return };
    let _deadline = Deadline::new(TEST, LIMIT);
    let ranks = comms.len();
    per_rank(comms, |comm, barrier| {
        let rank = comm.rank();
        let shape = ExpertShape::new(4 * ranks, 2, 128, 16);
        let stream = comm.stream().clone();
        // Capture needs no cross-stream events: this test's work is all on this stream.
        // SAFETY: every buffer below is used on `stream` only.
        unsafe { stream.context().disable_event_tracking() };
        let mut b = Buffers::<half::bf16>::new(&stream, &shape, ranks);
        let mut ex =
            ExpertExchange::<half::bf16>::new(&comm, shape, ExchangePath::Lsa).expect("new");
        ex.set_timeout(TIMEOUT);
        // A full batch every replay (the graph's buffers are fixed), new data each time.
        let cases: Vec<Case> = (0..3)
            .map(|i| case(&shape, ranks, Pattern::Full, 77 + i))
            .collect();
        let (h, k) = (shape.hidden, shape.top_k);
        let tokens = shape.max_tokens;
        // The experts' outputs for the graph: identity here (the graph holds dispatch then
        // combine with nothing between), so out = sum of weight × x over the routed choices.
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .expect("begin capture");
        let issued = ex
            .dispatch(&b.x, &b.routing, &mut b.recv, &mut b.counts)
            .and_then(|d| ex.combine(d, &b.recv, &b.weights, &mut b.out));
        let graph = stream
            .end_capture(CUgraphInstantiate_flags(0))
            .expect("end capture")
            .expect("a graph");
        issued.expect("captured dispatch and combine");
        barrier.wait();
        for (i, case) in cases.iter().enumerate() {
            let x: Vec<half::bf16> = case.x[rank]
                .iter()
                .map(|&v| half::bf16::from_f32(v))
                .collect();
            b.rows.upload(&x, &mut b.x);
            b.ints.upload(&case.routing[rank], &mut b.routing);
            b.floats.upload(&case.weights[rank], &mut b.weights);
            barrier.wait();
            graph.launch().expect("replay");
            let out = b.rows.download(&b.out);
            ex.check()
                .unwrap_or_else(|e| panic!("rank {rank} replay {i}: {e}"));
            for t in 0..tokens {
                for j in 0..h {
                    let mut acc = 0f32;
                    for c in 0..k {
                        let y = x[t * h + j].to_f32();
                        acc = case.weights[rank][t * k + c].mul_add(y, acc);
                    }
                    assert_eq!(
                        out[t * h + j],
                        half::bf16::from_f32(acc),
                        "rank {rank} replay {i} token {t} element {j}"
                    );
                }
            }
            barrier.wait();
        }
        drop(graph);
    });
    common::shape::ran(TEST, &format!("{ranks} ranks"));
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn bad_routing_is_dropped_alike_reported_and_the_ranks_stay_in_step() {
    const TEST: &str = "bad_routing_is_dropped_alike_reported_and_the_ranks_stay_in_step";
    let lsa = lsa_possible(TEST);
    let Some(comms) = comms(TEST) else { return };
    let _deadline = Deadline::new(TEST, LIMIT);
    let ranks = comms.len();
    per_rank(comms, |comm, _| {
        let rank = comm.rank();
        let paths: &[ExchangePath] = if lsa {
            &[ExchangePath::Lsa, ExchangePath::AllToAllV]
        } else {
            &[ExchangePath::AllToAllV]
        };
        for &path in paths {
            let shape = ExpertShape::new(4 * ranks, 2, 64, 8);
            let stream = comm.stream().clone();
            let mut b = Buffers::<half::bf16>::new(&stream, &shape, ranks);
            let mut ex = ExpertExchange::<half::bf16>::new(&comm, shape, path).expect("new");
            ex.set_timeout(TIMEOUT);
            let c = case(&shape, ranks, Pattern::Full, 5);
            // Rank 0: token 1's first choice past the experts, token 3's second a repeat of
            // its first, token 5's first below -1; the last rank: token 2's second at -7.
            let mut corrupt = vec![vec![]; ranks];
            corrupt[0] = vec![(2, 99), (7, c.routing[0][6]), (10, -5)];
            corrupt[ranks - 1].push((5, -7));
            let mut routing = c.routing[0].clone();
            for &(entry, value) in &corrupt[0] {
                routing[entry] = value;
            }
            assert!(ex.check_routing(&routing).is_err());
            let label = format!("bad routing on {path:?}");
            run_case_with(&mut ex, &mut b, &c, &label, &corrupt);
            // Reported once: the next check is clean, and the instance goes on in step.
            ex.check().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            let next = case(&shape, ranks, Pattern::Random, 6);
            run_case(
                &mut ex,
                &mut b,
                &next,
                &format!("after bad routing on {path:?}"),
            );
        }
    });
    common::shape::ran(TEST, &format!("{ranks} ranks"));
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn a_stale_dispatch_is_refused_on_every_rank() {
    const TEST: &str = "a_stale_dispatch_is_refused_on_every_rank";
    let Some(comms) = comms(TEST) else { return };
    let _deadline = Deadline::new(TEST, LIMIT);
    let ranks = comms.len();
    per_rank(comms, |comm, _| {
        let shape = ExpertShape::new(2 * ranks, 1, 64, 4);
        let stream = comm.stream().clone();
        let mut b = Buffers::<half::bf16>::new(&stream, &shape, ranks);
        let mut ex =
            ExpertExchange::<half::bf16>::new(&comm, shape, ExchangePath::Auto).expect("new");
        ex.set_timeout(TIMEOUT);
        let first = ex
            .dispatch(
                &b.x.slice(..0),
                &b.routing.slice(..0),
                &mut b.recv,
                &mut b.counts,
            )
            .expect("empty dispatch");
        let _second = ex
            .dispatch(
                &b.x.slice(..0),
                &b.routing.slice(..0),
                &mut b.recv,
                &mut b.counts,
            )
            .expect("empty dispatch");
        let err = ex
            .combine(
                first,
                &b.recv,
                &b.weights.slice(..0),
                &mut b.out.slice_mut(..0),
            )
            .unwrap_err();
        assert!(err.to_string().contains("latest dispatch"), "{err}");
        ex.check().expect_err("out of step after the refusal");
    });
    common::shape::ran(TEST, &format!("{ranks} ranks"));
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn shapes_that_differ_between_ranks_are_refused_on_every_rank() {
    const TEST: &str = "shapes_that_differ_between_ranks_are_refused_on_every_rank";
    let Some(comms) = comms(TEST) else { return };
    let _deadline = Deadline::new(TEST, LIMIT);
    let ranks = comms.len();
    per_rank(comms, |comm, _| {
        let hidden = if comm.rank() == 0 { 64 } else { 128 };
        let shape = ExpertShape::new(2 * ranks, 1, hidden, 4);
        match ExpertExchange::<half::bf16>::new(&comm, shape, ExchangePath::Auto) {
            Err(Error::RankMismatch { field, .. }) => assert_eq!(field, "hidden"),
            other => panic!("rank {}: {other:?}", comm.rank()),
        }
    });
    common::shape::ran(TEST, &format!("{ranks} ranks"));
}

const CHILD_ENV: &str = "NCCL_RS_MOE_CHILD";

/// The all-to-all-v path where the ranks form no LSA team: processes on simulated hosts
/// (each its own `NCCL_HOSTID`: NET/Socket) or one GPU each, NCCL 2.28.3 included, where
/// `Auto` must take the fallback (simulated hosts, or an NCCL without the device API) and
/// every pattern is exact. The parent re-executes this binary once per rank
/// (`child_moe_fallback`).
#[test]
#[ignore = "needs CUDA GPUs"]
fn the_fallback_across_processes_every_pattern_exact() {
    const TEST: &str = "the_fallback_across_processes_every_pattern_exact";
    use common::procs::{var, Children};
    use common::shape::{processes, Shape};
    let Some(layout) = processes(TEST, &[Shape::Hosts, Shape::Gpus], 3) else {
        return;
    };
    let n = layout.size();
    let id = nccl::UniqueId::new().expect("ncclGetUniqueId");
    let hosts = layout.describe().contains("hosts");
    let ranks: Vec<usize> = (0..n).collect();
    let children = Children::spawn("child_moe_fallback", &ranks, |rank| {
        let mut vars = layout.env(rank);
        vars.push(var(
            CHILD_ENV,
            format!("{rank},{n},{id},{}", u8::from(hosts)),
        ));
        vars
    });
    let lines = children.finish(LIMIT);
    let done = lines
        .iter()
        .filter(|(_, l)| l.starts_with("MOE_DONE"))
        .count();
    assert_eq!(done, n, "every rank finished its patterns: {lines:?}");
}

#[test]
#[ignore = "needs CUDA GPUs"]
fn child_moe_fallback() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let parts: Vec<&str> = spec.split(',').collect();
    let rank: usize = parts[0].parse().expect("rank");
    let size: usize = parts[1].parse().expect("size");
    let id: nccl::UniqueId = parts[2].parse().expect("id hex");
    let hosts = parts[3] == "1";
    let device = common::shape::child_device(rank);
    let stream = cudarc::driver::CudaContext::new(device)
        .and_then(|ctx| ctx.new_stream())
        .expect("a stream");
    let comm = Comm::init_rank(stream.clone(), &id, rank, size).expect("init");
    let old = nccl::library::get().expect("NCCL").version() < DEV_COMM_SINCE;
    for (shape_no, shape) in [
        ExpertShape::new(4 * size, 2, 64, 16),
        ExpertShape::new(2 * size, 2, 520, 9),
        ExpertShape::new(16 * size, 8, 1040, 12),
    ]
    .into_iter()
    .enumerate()
    {
        let mut b = Buffers::<half::bf16>::new(&stream, &shape, size);
        let mut ex = ExpertExchange::<half::bf16>::new(&comm, shape, ExchangePath::Auto)
            .unwrap_or_else(|e| panic!("rank {rank}: new: {e}"));
        ex.set_timeout(TIMEOUT);
        if hosts || old {
            assert_eq!(ex.path(), ExchangePath::AllToAllV, "rank {rank}");
        }
        for (i, pattern) in PATTERNS.into_iter().enumerate() {
            let case = case(
                &shape,
                size,
                pattern,
                500 + 100 * shape_no as u64 + i as u64,
            );
            let label = format!("{shape:?} {pattern:?} on {:?}", ex.path());
            run_case(&mut ex, &mut b, &case, &label);
        }
        println!(
            "rank {rank}: {:?} passed every pattern on {:?}",
            shape,
            ex.path()
        );
    }
    println!("MOE_DONE rank {rank}");
}

/// The flight recorder numbers the exchange's launches among its instance's calls, so that
/// comparing the ranks' records names one that skipped a dispatch: rank 0 makes an extra
/// dispatch of one token, which rank 1's next (of four) pairs with; rank 0's next then waits
/// alone and gives up.
#[test]
#[ignore = "needs CUDA GPUs"]
fn the_flight_record_names_a_rank_that_skipped_a_dispatch() {
    use nccl::diagnostics::flight::{compare, Finding, OpKind};
    const TEST: &str = "the_flight_record_names_a_rank_that_skipped_a_dispatch";
    if !lsa_possible(TEST) {
        return;
    }
    let Some(comms) = comms(TEST) else { return };
    if comms.len() != 2 {
        skip(
            TEST,
            &format!("written for 2 ranks, the layout has {}", comms.len()),
        );
        return;
    }
    let _deadline = Deadline::new(TEST, LIMIT);
    let records = per_rank(comms, |comm, barrier| {
        let rank = comm.rank();
        let shape = ExpertShape::new(8, 2, 64, 8);
        let stream = comm.stream().clone();
        let mut b = Buffers::<half::bf16>::new(&stream, &shape, 2);
        let mut ex =
            ExpertExchange::<half::bf16>::new(&comm, shape, ExchangePath::Lsa).expect("new");
        ex.set_timeout(Duration::from_secs(1));
        let c = case(&shape, 2, Pattern::Full, 9);
        run_case(&mut ex, &mut b, &c, "in step");
        barrier.wait();
        let (h, k) = (shape.hidden, shape.top_k);
        if rank == 0 {
            let _extra = ex
                .dispatch(
                    &b.x.slice(..h),
                    &b.routing.slice(..k),
                    &mut b.recv,
                    &mut b.counts,
                )
                .expect("the extra dispatch");
        }
        let _next = ex
            .dispatch(
                &b.x.slice(..4 * h),
                &b.routing.slice(..4 * k),
                &mut b.recv,
                &mut b.counts,
            )
            .expect("the next dispatch");
        let checked = ex.check();
        if rank == 0 {
            assert!(
                matches!(checked, Err(Error::Timeout { .. })),
                "rank 0's last dispatch waits alone: {checked:?}"
            );
        }
        barrier.wait();
        let record = comm.flight_record().expect("the recorder is on by default");
        let kinds: Vec<(OpKind, u64)> =
            record.shipped_calls(1).map(|e| (e.kind, e.count)).collect();
        println!("NOTE {TEST}: rank {rank}: instance 1's calls {kinds:?}");
        assert_eq!(
            kinds[0],
            (OpKind::LsaExpertDispatch, shape.max_tokens as u64)
        );
        assert_eq!(
            kinds[1],
            (OpKind::LsaExpertCombine, shape.max_tokens as u64)
        );
        drop(ex);
        record
    });
    let comparison = compare(&records).expect("comparable");
    println!("NOTE {TEST}: {comparison:?}");
    let shipped = comparison
        .shipped
        .iter()
        .find(|c| c.instance == 1)
        .expect("instance 1 compared");
    assert_eq!(shipped.diverged_at, Some(3), "{shipped:?}");
    assert!(
        shipped.findings.iter().any(|f| matches!(
            f,
            Finding::Skipped {
                rank: 1,
                seq: 3,
                count: 1,
                ..
            }
        )),
        "{shipped:?}"
    );
    common::shape::ran(TEST, "2 ranks");
}
