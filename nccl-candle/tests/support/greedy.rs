//! Greedy decoding and its comparison, shared by the CPU model tests (`models_cpu`,
//! `moe_cpu`): a checkpoint written to a private directory, the logits of a pass, a run of
//! greedy steps, and the near-tie rule that compares two runs.

// Each test binary that includes this file uses some of it.
#![allow(dead_code)]

use candle_core::{Device, Tensor};
use nccl_candle::models::CausalLm;

use super::writer::{self, Spec};

/// Largest |logit difference| allowed in f32, relative to the largest |logit| (at least 1).
/// Both sides compute in f32 from the same f32 (or bf16-exact) weights; they differ in the
/// rotary tables (f64 on the host here, f32 in candle-transformers: ~1e-7 relative at the
/// test's positions), the order of the matmuls' and sums' additions, and (several ranks) the
/// all-reduce's order: each a few ulps of the activations, grown through 2–3 layers. 1e-4 is
/// about 800 f32 ulps, far below the logits' spread (std ~2–3), far above what was seen.
pub const F32_TOLERANCE: f32 = 1e-4;

pub fn written(spec: &Spec) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    writer::write(spec, dir.path()).unwrap_or_else(|e| panic!("{}: {e}", spec.name));
    dir
}

/// The best logit's id and its lead over the second.
pub fn top2(logits: &[f32]) -> (u32, f32) {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    (order[0] as u32, logits[order[0]] - logits[order[1]])
}

pub fn last_logits(model: &mut CausalLm, ids: &[u32], offset: usize) -> Vec<f32> {
    let input = Tensor::new(ids, &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let logits = model.forward(&input, offset).unwrap();
    assert_eq!(logits.dims(), [1, model.config().vocab_size]);
    logits.flatten_all().unwrap().to_vec1().unwrap()
}

/// A run: each step's logits (the prompt's pass first) and the tokens chosen.
pub struct Run {
    pub logits: Vec<Vec<f32>>,
    pub tokens: Vec<u32>,
}

/// Greedy decoding of `steps` tokens after `prompt` by `forward`, fed `feed`'s tokens
/// when given (so that a near-tie does not derail the comparison of later steps).
pub fn decode(
    mut forward: impl FnMut(&[u32], usize) -> Vec<f32>,
    prompt: &[u32],
    steps: usize,
    feed: Option<&[u32]>,
) -> Run {
    let mut run = Run {
        logits: vec![forward(prompt, 0)],
        tokens: Vec::new(),
    };
    for step in 0..steps {
        let (chosen, _) = top2(&run.logits[step]);
        run.tokens.push(chosen);
        let next = feed.map_or(chosen, |f| f[step]);
        if step + 1 < steps {
            run.logits.push(forward(&[next], prompt.len() + step));
        }
    }
    run
}

/// Checks `run` against `reference`: every logit within the tolerance (relative to the
/// reference's largest |logit|), every token the same unless the reference's two best
/// were within twice the tolerance (a near-tie the logit bound then covers).
pub fn compare(what: &str, reference: &Run, run: &Run) {
    let worst = compare_within(what, reference, run, F32_TOLERANCE);
    println!("{what}: worst |logit difference| {worst:.2e} of the largest |logit|");
}

/// [`compare`] with another relative tolerance.
pub fn compare_within(what: &str, reference: &Run, run: &Run, relative: f32) -> f32 {
    assert_eq!(reference.logits.len(), run.logits.len(), "{what}: steps");
    let mut worst_seen = 0f32;
    for (step, (want, got)) in reference.logits.iter().zip(&run.logits).enumerate() {
        assert_eq!(want.len(), got.len(), "{what}: step {step}: vocabulary");
        let scale = want.iter().fold(1f32, |m, x| m.max(x.abs()));
        let worst = want
            .iter()
            .zip(got)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst <= relative * scale,
            "{what}: step {step}: max |logit difference| {worst} > {} (scale {scale})",
            relative * scale
        );
        worst_seen = worst_seen.max(worst / scale);
        let (want_token, gap) = top2(want);
        let (got_token, _) = top2(got);
        assert!(
            want_token == got_token || gap <= 2.0 * relative * scale,
            "{what}: step {step}: token {got_token}, reference {want_token} (lead {gap})"
        );
    }
    worst_seen
}
