//! `nccl_candle::decode` on the CPU: the static decode step (the one a CUDA graph captures,
//! run eagerly here through `DecodeGraph::eager`) against the host-driven pass, on
//! checkpoints the `hf_checkpoint` example writes (every f32 preset: GQA, biases, Mistral's
//! window shorter than the sequence, Qwen3's norms and head width), at 1 and 2 ranks
//! (threads); and its refusals.

#[path = "../examples/hf_checkpoint/writer.rs"]
mod writer;

use candle_core::{DType, Device, Tensor};
use nccl_candle::decode::{DecodeGraph, KvCache, StaticDecode, StepInputs};
use nccl_candle::models::{CausalLm, Checkpoint};
use nccl_candle::tp::{ThreadedCollectives, TpGroup};
use nccl_candle::Error;

/// Largest |logit difference| relative to the largest |logit|: the static step attends over
/// every position of the cache with the later ones masked (softmax's sums over more
/// elements, grouped heads in another product shape), the same model otherwise.
const TOLERANCE: f32 = 1e-4;
/// Decode steps after the prompt.
const STEPS: usize = 12;

fn on_threads<T: Send>(n: usize, body: impl Fn(TpGroup) -> T + Sync) -> Vec<T> {
    let ranks = ThreadedCollectives::group(n).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| {
                let body = &body;
                scope.spawn(move || body(TpGroup::new(rank).unwrap()))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Two rows of prompt ids below the vocabulary.
fn prompt(vocab: usize, len: usize) -> Vec<u32> {
    (0..2 * len)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect()
}

/// Each step's logits, `[2 * vocab]`, the prompt's first; steps fed the given tokens.
fn host_driven(model: &mut CausalLm, prompt: &[u32], feed: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let len = prompt.len() / 2;
    let ids = Tensor::from_vec(prompt.to_vec(), (2, len), &Device::Cpu).unwrap();
    let mut out = vec![flat(&model.forward(&ids, 0).unwrap())];
    for (step, tokens) in feed.iter().enumerate() {
        let ids = Tensor::from_vec(tokens.clone(), (2, 1), &Device::Cpu).unwrap();
        out.push(flat(&model.forward(&ids, len + step).unwrap()));
    }
    out
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn static_steps(model: &mut CausalLm, prompt: &[u32], feed: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let len = prompt.len() / 2;
    let ids = Tensor::from_vec(prompt.to_vec(), (2, len), &Device::Cpu).unwrap();
    let mut graph = DecodeGraph::eager(model, 2).unwrap();
    assert!(!graph.is_captured());
    let mut out = vec![flat(&graph.prefill(&ids).unwrap())];
    for tokens in feed {
        graph.step(tokens).unwrap();
        let logits = flat(&graph.logits().unwrap());
        let greedy = graph.greedy_tokens().unwrap();
        let vocab = logits.len() / 2;
        for (row, &token) in greedy.iter().enumerate() {
            let row_logits = &logits[row * vocab..(row + 1) * vocab];
            let best = row_logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(
                row_logits[token as usize], best,
                "greedy token not the best logit"
            );
        }
        out.push(logits);
    }
    assert_eq!(graph.model().cached(), len + feed.len());
    out
}

fn greedy_feed(logits: &[Vec<f32>], vocab: usize) -> Vec<Vec<u32>> {
    logits
        .iter()
        .take(STEPS)
        .map(|step| {
            (0..2)
                .map(|row| {
                    let r = &step[row * vocab..(row + 1) * vocab];
                    (0..vocab)
                        .max_by(|&a, &b| r[a].total_cmp(&r[b]).then(b.cmp(&a)))
                        .unwrap() as u32
                })
                .collect()
        })
        .collect()
}

#[test]
fn the_static_step_matches_the_host_driven_pass_on_every_f32_preset() {
    let mut checked = 0;
    // The mixtures of experts too: the step runs every local expert on every token, the
    // host-driven pass only the routed ones.
    for spec in writer::presets().into_iter().chain(writer::moe_presets()) {
        if spec.dtype != DType::F32 {
            continue;
        }
        let dir = tempfile::tempdir().unwrap();
        writer::write(&spec, dir.path()).unwrap();
        let checkpoint = Checkpoint::open(dir.path()).unwrap();
        let vocab = checkpoint.config().vocab_size;
        // Longer than Mistral's window, so that the step's mask hides old keys too.
        let len = 9;
        let max_seq = len + STEPS + 3;
        let ids = prompt(vocab, len);
        for ranks in [1usize, 2] {
            let splits = spec.heads.is_multiple_of(ranks)
                && spec.intermediate.is_multiple_of(ranks)
                && (spec.kv_heads.is_multiple_of(ranks) || ranks.is_multiple_of(spec.kv_heads));
            if !splits {
                continue;
            }
            let worst = on_threads(ranks, |group| {
                let load = || {
                    CausalLm::load(&checkpoint, &group, DType::F32, &Device::Cpu, max_seq).unwrap()
                };
                let mut reference = load();
                let first = host_driven(&mut reference, &ids, &[]);
                // Fed the host-driven pass's own greedy tokens.
                let mut tokens = greedy_feed(&first, vocab);
                reference.reset().unwrap();
                let mut want = host_driven(&mut reference, &ids, &[]);
                for step in 0..STEPS {
                    let next = host_driven_step(&mut reference, &tokens[step], len + step);
                    tokens.push(greedy_feed(std::slice::from_ref(&next), vocab)[0].clone());
                    want.push(next);
                }
                let mut model = load();
                let got = static_steps(&mut model, &ids, &tokens[..STEPS]);
                assert_eq!(got.len(), want.len());
                let mut worst = 0f32;
                for (step, (w, g)) in want.iter().zip(&got).enumerate() {
                    let scale = w.iter().fold(1f32, |m, x| m.max(x.abs()));
                    let diff = w
                        .iter()
                        .zip(g)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0f32, f32::max);
                    assert!(
                        diff <= TOLERANCE * scale,
                        "{}: {ranks} rank(s): step {step}: |logit difference| {diff} (scale {scale})",
                        spec.name
                    );
                    worst = worst.max(diff / scale);
                }
                worst
            });
            println!("{}: {ranks} rank(s): worst {:.2e}", spec.name, worst[0]);
            checked += 1;
        }
    }
    assert!(checked >= 12, "{checked} preset/rank pairs");
}

fn host_driven_step(model: &mut CausalLm, tokens: &[u32], offset: usize) -> Vec<f32> {
    let ids = Tensor::from_vec(tokens.to_vec(), (2, 1), &Device::Cpu).unwrap();
    flat(&model.forward(&ids, offset).unwrap())
}

#[test]
fn static_steps_are_refused_with_typed_errors() {
    let spec = writer::presets()
        .into_iter()
        .find(|s| s.dtype == DType::F32)
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    writer::write(&spec, dir.path()).unwrap();
    let checkpoint = Checkpoint::open(dir.path()).unwrap();
    let group = TpGroup::single();
    let mut model = CausalLm::load(&checkpoint, &group, DType::F32, &Device::Cpu, 8).unwrap();
    // Capture needs a CUDA device with its own stream: refused on the CPU, before anything.
    match DecodeGraph::capture(&mut model, 1) {
        Err(Error::Graph { op: "check", why }) => {
            assert!(why.contains("not a CUDA device"), "{why}")
        }
        other => panic!("capture on the CPU: {other:?}"),
    }
    // A step before any prompt, a prompt of another batch, ids of another count.
    let mut graph = DecodeGraph::eager(&mut model, 1).unwrap();
    assert!(matches!(graph.step(&[1]), Err(Error::Argument { .. })));
    let two_rows = Tensor::zeros((2, 3), DType::U32, &Device::Cpu).unwrap();
    assert!(matches!(
        graph.prefill(&two_rows),
        Err(Error::Argument { .. })
    ));
    let one_row = Tensor::zeros((1, 3), DType::U32, &Device::Cpu).unwrap();
    graph.prefill(&one_row).unwrap();
    assert!(matches!(graph.step(&[1, 2]), Err(Error::Argument { .. })));
    // Steps up to max_seq, then a typed refusal instead of a write past the caches.
    for _ in 3..8 {
        graph.step(&[1]).unwrap();
    }
    assert_eq!(graph.model().cached(), 8);
    assert!(matches!(graph.step(&[1]), Err(Error::Argument { .. })));
    drop(graph);
    // Inputs of another length or batch than the caches': refused by the model itself.
    let mut longer = StepInputs::new(1, model.vocab(), 9, &Device::Cpu).unwrap();
    longer.write(&[1], 8).unwrap();
    assert!(matches!(
        model.decode_step(&longer),
        Err(Error::Argument { .. })
    ));
    let wider = StepInputs::new(2, model.vocab(), 8, &Device::Cpu).unwrap();
    assert!(matches!(
        model.decode_step(&wider),
        Err(Error::Argument { .. })
    ));
    assert!(matches!(longer.write(&[1], 9), Err(Error::Argument { .. })));
}

#[test]
fn the_cache_keeps_its_memory_and_refuses_what_does_not_fit() {
    let dev = Device::Cpu;
    let mut cache = KvCache::new(4);
    let k = Tensor::ones((1, 2, 3, 4), DType::F32, &dev).unwrap();
    let (keys, _) = cache.append(&k, &k).unwrap();
    assert_eq!(keys.dims(), [1, 2, 3, 4]);
    assert_eq!(cache.batch(), Some(1));
    assert!(matches!(cache.append(&k, &k), Err(Error::Argument { .. })));
    let wide = Tensor::ones((2, 2, 1, 4), DType::F32, &dev).unwrap();
    assert!(matches!(
        cache.append(&wide, &wide),
        Err(Error::Shape { .. })
    ));
    cache.reset().unwrap();
    // Reset keeps the memory and clears it (a masked position must not hold a NaN).
    let (cleared, _) = cache
        .append(&k.narrow(2, 0, 1).unwrap(), &k.narrow(2, 0, 1).unwrap())
        .unwrap();
    let whole: Vec<f32> = cleared.flatten_all().unwrap().to_vec1().unwrap();
    assert!(whole.iter().all(|&x| x == 1.0));
    cache.reset().unwrap();
    let (keys, values) = cache.append(&wide, &wide).unwrap();
    assert_eq!(
        (keys.dims(), values.dims()),
        ([2, 2, 1, 4].as_slice(), [2, 2, 1, 4].as_slice())
    );
    assert!(matches!(cache.set_len(5), Err(Error::Argument { .. })));
    // The device-positioned write lands at the inputs' position.
    let mut inputs = StepInputs::new(2, 3, 4, &dev).unwrap();
    inputs.write(&[0, 0], 2).unwrap();
    let two = (Tensor::ones((2, 2, 1, 4), DType::F32, &dev).unwrap() * 2.0).unwrap();
    let index = inputs.position_index((2, 2, 1, 4)).unwrap();
    let (keys, _) = cache.write_at(&two, &two, &index).unwrap();
    // An index made for longer inputs than the cache is refused.
    let longer = StepInputs::new(2, 3, 5, &dev).unwrap();
    let index = longer.position_index((2, 2, 1, 4)).unwrap();
    assert!(matches!(
        cache.write_at(&two, &two, &index),
        Err(Error::Shape { .. })
    ));
    let at: Vec<f32> = keys
        .narrow(2, 2, 1)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert!(at.iter().all(|&x| x == 2.0));
    let mask: Vec<f32> = inputs
        .mask(None, DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(mask, [0.0, 0.0, 0.0, f32::NEG_INFINITY]);
    let window: Vec<f32> = inputs
        .mask(Some(2), DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(window, [f32::NEG_INFINITY, 0.0, 0.0, f32::NEG_INFINITY]);
}
