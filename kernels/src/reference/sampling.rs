//! Sampling, written to be obviously right: sorts where the kernel selects by radix, walks
//! the vocabulary where it scans. Same thresholds, same fixed-point draw (see
//! [`crate::sampling`]), so given the same logits both pick the same token up to the last bit
//! of `exp`.

use crate::sampling::MAX_TOP_LOGPROBS;
use crate::sampling::{fixed_weight, Adjustment, RowParams, SampledRows, SamplingBatch};

/// Samples every row of `logits` (`[batch.rows(), vocab]`), adjusting and masking them in
/// place as the kernel does. An adjustment naming a token outside the vocabulary is skipped.
pub fn sample_rows(logits: &mut [f32], vocab: usize, batch: &SamplingBatch) -> SampledRows {
    assert_eq!(
        logits.len(),
        batch.rows() * vocab,
        "logits are not [rows, vocab]"
    );
    let mut out = SampledRows::new(batch.rows());
    for (r, row) in logits.chunks_mut(vocab).enumerate() {
        let (p, adjust) = batch.row(r);
        let raw = row.to_vec();
        if let Some(n) = p.top_logprobs {
            let top = top_logprobs(&raw, n);
            for (j, (t, lp)) in top.into_iter().enumerate() {
                out.top_ids[r * MAX_TOP_LOGPROBS + j] = t as i32;
                out.top_logprobs[r * MAX_TOP_LOGPROBS + j] = lp;
            }
        }
        adjust_logits(row, &adjust);
        if batch.mask(r).is_some() {
            for (t, x) in row.iter_mut().enumerate() {
                if !batch.allows(r, t) {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
        let token = match p.temperature > 0.0 {
            true => draw(row, &p),
            false => argmax(row),
        };
        out.tokens[r] = token as i32;
        if p.top_logprobs.is_some() {
            out.logprobs[r] = raw[token] - log_z(&raw);
        }
    }
    out
}

/// `rep(x) - penalty + bias` for each adjusted token.
pub fn adjust_logits(row: &mut [f32], adjust: &[Adjustment]) {
    for a in adjust {
        let Some(x) = row.get_mut(a.token as usize) else {
            continue;
        };
        if a.repetition != 1.0 {
            *x = if *x > 0.0 {
                *x / a.repetition
            } else {
                *x * a.repetition
            };
        }
        *x -= a.penalty;
        *x += a.bias;
    }
}

/// The largest logit's index; ties go to the lowest id.
fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best
}

/// `max + ln Σ exp(x - max)`.
fn log_z(row: &[f32]) -> f32 {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    max + row.iter().map(|&x| (x - max).exp()).sum::<f32>().ln()
}

/// The `n` largest logits as logprobs, largest first, ties to the lowest id.
fn top_logprobs(row: &[f32], n: usize) -> Vec<(u32, f32)> {
    let z = log_z(row);
    let mut ids: Vec<usize> = (0..row.len()).collect();
    ids.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    ids.into_iter()
        .take(n)
        .map(|i| (i as u32, row[i] - z))
        .collect()
}

/// Each token's weight `exp((x - max) / T)` (the most likely token's is exactly 1).
pub fn weights(row: &[f32], temperature: f32) -> Vec<f32> {
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    row.iter()
        .map(|&x| ((x - max) / temperature).exp())
        .collect()
}

/// The smallest weight a token may have and still be drawn: min-p, then top-k, then top-p,
/// each a threshold on the weights (as bits: positive floats order as their bit patterns).
pub fn keep_threshold(w: &[f32], p: &RowParams) -> u32 {
    // A weight of 0 is never drawn; min-p at or below 0 (either zero) is off.
    let mut floor = if p.min_p > 0.0 { p.min_p.to_bits() } else { 1 };
    let mut kept: Vec<u32> = w
        .iter()
        .map(|x| x.to_bits())
        .filter(|&b| b >= floor)
        .collect();
    kept.sort_unstable_by(|a, b| b.cmp(a));
    if p.top_k > 0 && (p.top_k as usize) < kept.len() {
        floor = kept[p.top_k as usize - 1];
        kept.retain(|&b| b >= floor);
    }
    if p.top_p < 1.0 {
        let total: u64 = kept.iter().map(|&b| fixed_weight(f32::from_bits(b))).sum();
        let target = mass_target(p.top_p, total);
        let mut acc = 0;
        for &b in &kept {
            acc += fixed_weight(f32::from_bits(b));
            if acc >= target {
                // Every token tied with this one is kept too: the threshold is a value.
                floor = floor.max(b);
                break;
            }
        }
    }
    floor
}

/// The mass top-p must reach: `ceil(p · total)`, at least 1 unit.
pub fn mass_target(top_p: f32, total: u64) -> u64 {
    ((top_p as f64 * total as f64).ceil() as u64).max(1)
}

/// The kept token at which the cumulative weight, in id order, first exceeds
/// `uniform · total`.
fn draw(row: &[f32], p: &RowParams) -> usize {
    let w = weights(row, p.temperature);
    let floor = keep_threshold(&w, p);
    let kept = |x: f32| {
        if x.to_bits() >= floor {
            fixed_weight(x)
        } else {
            0
        }
    };
    let total: u64 = w.iter().map(|&x| kept(x)).sum();
    if total == 0 {
        return argmax(row);
    }
    let target = draw_target(p.uniform, total);
    let mut acc = 0;
    for (i, &x) in w.iter().enumerate() {
        acc += kept(x);
        if acc > target {
            return i;
        }
    }
    unreachable!("the target is below the total")
}

/// `floor(uniform · total)`, below `total`.
pub fn draw_target(uniform: f32, total: u64) -> u64 {
    ((uniform as f64 * total as f64) as u64).min(total - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> RowParams {
        RowParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            uniform: 0.5,
            top_logprobs: None,
        }
    }

    fn one_row(logits: &[f32], p: RowParams, adjust: &[Adjustment]) -> (i32, SampledRows) {
        let mut batch = SamplingBatch::new();
        batch.push(&p, adjust).unwrap();
        let out = sample_rows(&mut logits.to_vec(), logits.len(), &batch);
        (out.tokens[0], out)
    }

    /// The exact probabilities the filters leave, from a sort by probability (ties by id):
    /// the host sampler's definition, written once more.
    fn filtered(logits: &[f32], p: &RowParams) -> Vec<f64> {
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = logits
            .iter()
            .map(|&x| ((x - max) as f64 / p.temperature as f64).exp())
            .collect();
        let mut order: Vec<usize> = (0..w.len()).filter(|&i| w[i] >= p.min_p as f64).collect();
        order.sort_by(|&a, &b| w[b].total_cmp(&w[a]).then(a.cmp(&b)));
        if p.top_k > 0 {
            order.truncate(p.top_k as usize);
        }
        let total: f64 = order.iter().map(|&i| w[i]).sum();
        let mut keep = order.len();
        let mut acc = 0.0;
        for (j, &i) in order.iter().enumerate() {
            acc += w[i] / total;
            if acc >= p.top_p as f64 {
                keep = j + 1;
                break;
            }
        }
        let mut prob = vec![0.0; w.len()];
        let kept_total: f64 = order[..keep].iter().map(|&i| w[i]).sum();
        for &i in &order[..keep] {
            prob[i] = w[i] / kept_total;
        }
        prob
    }

    /// Draws with uniforms on a fine grid: a deterministic histogram whose frequencies must
    /// match the filtered distribution to within the grid's resolution.
    fn frequencies(logits: &[f32], p: RowParams, n: usize) -> Vec<f64> {
        let mut batch = SamplingBatch::new();
        for k in 0..n {
            let uniform = (k as f32 + 0.5) / n as f32;
            batch.push(&RowParams { uniform, ..p }, &[]).unwrap();
        }
        let mut all: Vec<f32> = (0..n).flat_map(|_| logits.iter().cloned()).collect();
        let out = sample_rows(&mut all, logits.len(), &batch);
        let mut freq = vec![0.0; logits.len()];
        for t in out.tokens {
            freq[t as usize] += 1.0 / n as f64;
        }
        freq
    }

    const LOGITS: [f32; 8] = [1.0, 3.0, 2.5, 0.0, -1.0, 2.9, 0.5, 1.5];

    #[test]
    fn every_filter_gives_the_host_samplers_distribution() {
        let cases = [
            params(1.0),
            params(0.6),
            RowParams {
                top_k: 3,
                ..params(1.0)
            },
            RowParams {
                top_p: 0.6,
                ..params(1.0)
            },
            RowParams {
                top_p: 0.9,
                ..params(2.0)
            },
            RowParams {
                min_p: 0.5,
                ..params(1.0)
            },
            RowParams {
                top_k: 4,
                top_p: 0.8,
                min_p: 0.1,
                ..params(0.8)
            },
        ];
        for p in cases {
            let want = filtered(&LOGITS, &p);
            let got = frequencies(&LOGITS, p, 20_000);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() < 1e-3,
                    "{p:?}: token {i} drawn {g:.4} of the time, expected {w:.4}"
                );
            }
        }
    }

    #[test]
    fn greedy_is_the_lowest_id_argmax_of_the_adjusted_logits() {
        let row = [1.0, 3.0, 3.0, -2.0];
        assert_eq!(one_row(&row, params(0.0), &[]).0, 1);
        // A repetition penalty divides a positive logit and multiplies a negative one.
        let rep = |token, repetition| Adjustment {
            token,
            repetition,
            penalty: 0.0,
            bias: 0.0,
        };
        assert_eq!(one_row(&row, params(0.0), &[rep(1, 1.5)]).0, 2);
        let bias = Adjustment {
            token: 3,
            repetition: 2.0,
            penalty: -0.5,
            bias: 8.0,
        };
        // -2 · 2 + 0.5 + 8 = 4.5 beats 3.
        assert_eq!(one_row(&row, params(0.0), &[bias]).0, 3);
        // Tokens outside the vocabulary are skipped, not written.
        assert_eq!(one_row(&row, params(0.0), &[rep(9, 0.1)]).0, 1);
    }

    /// A grammar mask keeps only its tokens, after the adjustments: greedy takes the best
    /// allowed one, draws follow the filtered distribution over the allowed ones, and the
    /// logprobs stay the raw model's.
    #[test]
    fn a_mask_keeps_only_its_tokens_after_the_adjustments() {
        // Tokens 0, 2, 5 and 7 allowed.
        let mask = [0b1010_0101u32];
        let masked = |p: RowParams, adjust: &[Adjustment]| {
            let mut batch = SamplingBatch::new();
            batch.push_masked(&p, adjust, Some(&mask)).unwrap();
            let mut row = LOGITS.to_vec();
            let out = sample_rows(&mut row, LOGITS.len(), &batch);
            (out, row)
        };
        // Token 1 (3.0) is the best, but not allowed; 5 (2.9) is.
        let (out, row) = masked(
            RowParams {
                top_logprobs: Some(1),
                ..params(0.0)
            },
            &[],
        );
        assert_eq!(out.tokens[0], 5);
        let z = log_z(&LOGITS);
        assert!((out.logprobs[0] - (2.9 - z)).abs() < 1e-6);
        assert_eq!(
            out.top(0)[0].0,
            1,
            "the top logprob is the raw model's best"
        );
        let kept: Vec<usize> = (0..8).filter(|&t| row[t] > f32::NEG_INFINITY).collect();
        assert_eq!(kept, vec![0, 2, 5, 7]);
        // A bias on an allowed token applies before the mask; one on a masked token is moot.
        let bias = |token| Adjustment {
            token,
            repetition: 1.0,
            penalty: 0.0,
            bias: 5.0,
        };
        assert_eq!(masked(params(0.0), &[bias(0)]).0.tokens[0], 0);
        assert_eq!(masked(params(0.0), &[bias(3)]).0.tokens[0], 5);
        // Draws: the filtered distribution of the masked row.
        let p = RowParams {
            top_p: 0.9,
            ..params(1.0)
        };
        let n = 20_000;
        let mut batch = SamplingBatch::new();
        for k in 0..n {
            let uniform = (k as f32 + 0.5) / n as f32;
            batch
                .push_masked(&RowParams { uniform, ..p }, &[], Some(&mask))
                .unwrap();
        }
        let mut all: Vec<f32> = (0..n).flat_map(|_| LOGITS.iter().cloned()).collect();
        let out = sample_rows(&mut all, LOGITS.len(), &batch);
        let only_allowed: Vec<f32> = LOGITS
            .iter()
            .enumerate()
            .map(|(t, &x)| {
                if mask[0] >> t & 1 == 1 {
                    x
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let want = filtered(&only_allowed, &p);
        let mut got = [0.0f64; 8];
        for t in out.tokens {
            got[t as usize] += 1.0 / n as f64;
        }
        for (t, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() < 1e-3, "token {t}: {g:.4}, expected {w:.4}");
        }
    }

    #[test]
    fn logprobs_are_raw_and_the_top_sorted_with_ties_by_id() {
        let row = [2.0, 1.0, 2.0, -1.0];
        let p = RowParams {
            top_logprobs: Some(3),
            ..params(0.0)
        };
        // The bias moves the choice to token 3; its logprob stays the raw model's.
        let bias = Adjustment {
            token: 3,
            repetition: 1.0,
            penalty: 0.0,
            bias: 10.0,
        };
        let (token, out) = one_row(&row, p, &[bias]);
        assert_eq!(token, 3);
        let z = row.iter().map(|x: &f32| x.exp()).sum::<f32>().ln();
        assert!((out.logprobs[0] - (-1.0 - z)).abs() < 1e-6);
        let top = out.top(0);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![0, 2, 1]);
        assert!((top[2].1 - (1.0 - z)).abs() < 1e-6);
        // No logprobs asked: none given.
        let (_, out) = one_row(&row, params(0.0), &[]);
        assert!(out.logprobs[0].is_nan() && out.top(0).is_empty());
    }

    #[test]
    fn a_top_k_boundary_keeps_every_tied_token() {
        let w = [1.0, 0.5, 0.5, 0.25];
        let p = RowParams {
            top_k: 2,
            ..params(1.0)
        };
        assert_eq!(keep_threshold(&w, &p), 0.5f32.to_bits());
        // top-p reaching its mass inside a tie keeps the whole tie.
        let p = RowParams {
            top_p: 0.5,
            ..params(1.0)
        };
        assert_eq!(keep_threshold(&w, &p), 0.5f32.to_bits());
        let p = RowParams {
            top_p: 0.4,
            ..params(1.0)
        };
        assert_eq!(keep_threshold(&w, &p), 1.0f32.to_bits());
    }

    #[test]
    fn the_most_likely_token_survives_every_filter() {
        let w = weights(&LOGITS, 0.01);
        let p = RowParams {
            top_k: 1,
            top_p: 0.01,
            min_p: 1.0,
            ..params(0.01)
        };
        assert_eq!(keep_threshold(&w, &p), 1.0f32.to_bits());
        for u in [0.0, 0.5, 0.999_999_9] {
            let (token, _) = one_row(&LOGITS, RowParams { uniform: u, ..p }, &[]);
            assert_eq!(token, 1);
        }
    }

    #[test]
    fn min_p_at_either_zero_is_off() {
        let w = [1.0, 0.5, 1e-30];
        for min_p in [0.0, -0.0, -1.0] {
            let p = RowParams {
                min_p,
                ..params(1.0)
            };
            assert_eq!(keep_threshold(&w, &p), 1, "min_p {min_p}");
        }
    }

    #[test]
    fn targets_stay_inside_the_mass() {
        assert_eq!(draw_target(0.999_999_9, 3), 2);
        assert_eq!(draw_target(0.0, 3), 0);
        assert_eq!(mass_target(0.0, 100), 1);
        assert_eq!(mass_target(0.5, 101), 51);
    }
}
