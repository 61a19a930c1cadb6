//! The dense reference transforms of the sampling pipeline (see the parent module).

use super::{Candidate, by_weight_desc};

/// Applies the repetition, frequency and presence penalties to `logits` in place, as
/// [`Sampler::sample`](super::Sampler::sample) does (see the [module documentation](super)).
/// `repetition_penalty` 1 and the other two 0 leave the logits unchanged; ids of `history`
/// out of range are ignored.
pub fn apply_penalties(
    logits: &mut [f32],
    history: &[u32],
    repetition_penalty: f32,
    frequency_penalty: f32,
    presence_penalty: f32,
) {
    let mut scratch = Vec::new();
    penalize(
        logits,
        history,
        repetition_penalty,
        frequency_penalty,
        presence_penalty,
        &mut scratch,
    );
}

pub(super) fn penalize(
    logits: &mut [f32],
    history: &[u32],
    repetition: f32,
    frequency: f32,
    presence: f32,
    scratch: &mut Vec<u32>,
) {
    if history.is_empty() || (repetition == 1.0 && frequency == 0.0 && presence == 0.0) {
        return;
    }
    scratch.clear();
    scratch.extend_from_slice(history);
    scratch.sort_unstable();
    for run in scratch.chunk_by(|a, b| a == b) {
        let Some(l) = logits.get_mut(run[0] as usize) else {
            continue;
        };
        if repetition != 1.0 {
            *l = if *l > 0.0 { *l / repetition } else { *l * repetition };
        }
        *l -= run.len() as f32 * frequency + presence;
    }
}

/// The index of the first maximum of `logits`, as `torch.argmax`; NaN entries never win. An
/// empty slice, or one of NaN and `-inf` only, gives the first `-inf` or 0.
pub fn argmax(logits: &[f32]) -> usize {
    // NaN compares false, so it never replaces the best; `-inf` never beats the start value.
    let mut best = None;
    let mut best_value = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        if l > best_value {
            best = Some(i);
            best_value = l;
        }
    }
    best.unwrap_or_else(|| logits.iter().position(|&l| l == f32::NEG_INFINITY).unwrap_or(0))
}

/// Replaces logits by their softmax probabilities, in place. `-inf` (and NaN) entries get 0;
/// if any entry is `+inf` those share the mass equally; if all are `-inf`, all stay 0.
pub fn softmax(values: &mut [f32]) {
    let max = values
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        values.fill(0.0);
        return;
    }
    for v in values.iter_mut() {
        *v = if v.is_nan() {
            0.0
        } else if max == f32::INFINITY {
            if *v == f32::INFINITY { 1.0 } else { 0.0 }
        } else {
            (*v - max).exp()
        };
    }
    let total: f64 = values.iter().map(|&v| f64::from(v)).sum();
    for v in values.iter_mut() {
        *v = (f64::from(*v) / total) as f32;
    }
}

/// Keeps the `k` largest logits and sets the others to `-inf`; ties at the boundary go to the
/// lower index. `k == 0` or `k >= len` keeps everything.
pub fn top_k_filter(logits: &mut [f32], k: usize) {
    if k == 0 || k >= logits.len() {
        return;
    }
    let mut order: Vec<Candidate> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| Candidate {
            id: i as u32,
            weight: if l.is_nan() { f32::NEG_INFINITY } else { l },
        })
        .collect();
    order.select_nth_unstable_by(k - 1, by_weight_desc);
    for c in &order[k..] {
        logits[c.id as usize] = f32::NEG_INFINITY;
    }
}

/// Nucleus filter on probabilities (they need not sum to 1: the mass is measured against
/// their sum): keeps the smallest set of most likely tokens whose mass is at least `p` of the
/// total, sets the others to 0, and renormalises the kept ones to sum to 1. At least one token
/// is kept; ties are ordered by lower index first. `p >= 1` only renormalises.
pub fn top_p_filter(probs: &mut [f32], p: f32) {
    let total: f64 = probs.iter().map(|&v| f64::from(v)).sum();
    if total <= 0.0 {
        return;
    }
    if p < 1.0 {
        let mut order: Vec<Candidate> = probs
            .iter()
            .enumerate()
            .map(|(i, &v)| Candidate {
                id: i as u32,
                weight: v,
            })
            .collect();
        order.sort_unstable_by(by_weight_desc);
        let target = f64::from(p.max(0.0)) * total;
        let mut acc = 0.0f64;
        let mut keep = order.len();
        for (i, c) in order.iter().enumerate() {
            acc += f64::from(c.weight);
            if acc >= target {
                keep = i + 1;
                break;
            }
        }
        for c in &order[keep..] {
            probs[c.id as usize] = 0.0;
        }
    }
    renormalize(probs);
}

/// Min-p filter on probabilities: sets to 0 every probability below `min_p` times the largest
/// one, and renormalises the kept ones to sum to 1. `min_p <= 0` only renormalises.
pub fn min_p_filter(probs: &mut [f32], min_p: f32) {
    if min_p > 0.0 {
        let max = probs.iter().copied().fold(0.0f32, f32::max);
        let threshold = min_p * max;
        for v in probs.iter_mut() {
            if *v < threshold {
                *v = 0.0;
            }
        }
    }
    renormalize(probs);
}

fn renormalize(probs: &mut [f32]) {
    let total: f64 = probs.iter().map(|&v| f64::from(v)).sum();
    if total > 0.0 {
        for v in probs.iter_mut() {
            *v = (f64::from(*v) / total) as f32;
        }
    }
}
