//! The profiled cost model: step time fitted to measured steps.
//!
//! `engine profile` writes a JSON file of measured steps; this is its format:
//!
//! ```json
//! {
//!   "model": "llama-3.2-3b",
//!   "device": "rtx-5080",
//!   "points": [
//!     { "prefill_tokens": 512, "decode_seqs": 0, "context_tokens": 512, "step_s": 0.061 },
//!     { "prefill_tokens": 0, "decode_seqs": 16, "context_tokens": 6144, "step_s": 0.019,
//!       "attention_pairs": 6144 }
//!   ],
//!   "client": { "request_s": 0.003, "per_prompt_token_s": 1e-6, "stream_s": 0.001 }
//! }
//! ```
//!
//! Field meanings are those of [`StepShape`]: `prefill_tokens` = new prompt tokens in the
//! step, `decode_seqs` = sequences decoding one token, `context_tokens` = Σ context length
//! after the step over scheduled sequences, `step_s` = measured seconds. `attention_pairs`
//! (Σ query × key pairs) is optional; when absent it is taken as a fresh prefill's
//! `prefill_tokens × (prefill_tokens + 1) / 2` plus one pair per context token of the
//! decodes. `client` is optional (the client path outside the GPU).
//!
//! The fit is ordinary least squares of
//!
//! ```text
//! step_s ≈ b0 + b1 × prefill_tokens + b2 × decode_seqs + b3 × context_tokens + b4 × attention_pairs
//! ```
//!
//! (fixed overhead; matmul cost per prompt token; per-sequence decode cost; KV reads;
//! attention compute). Features are scaled to unit magnitude before solving the normal
//! equations, and a prediction never goes below the smallest measured step.

use serde::{Deserialize, Serialize};

use super::{ClientPath, CostModel, StepShape};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfilePoint {
    pub prefill_tokens: usize,
    pub decode_seqs: usize,
    pub context_tokens: usize,
    #[serde(default)]
    pub attention_pairs: Option<f64>,
    pub step_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileClient {
    pub request_s: f64,
    #[serde(default)]
    pub per_prompt_token_s: f64,
    pub stream_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub model: String,
    pub device: String,
    pub points: Vec<ProfilePoint>,
    #[serde(default)]
    pub client: Option<ProfileClient>,
}

const FEATURES: usize = 5;

impl ProfilePoint {
    fn pairs(&self) -> f64 {
        self.attention_pairs.unwrap_or_else(|| {
            let p = self.prefill_tokens as f64;
            let decode_ctx = self.context_tokens.saturating_sub(self.prefill_tokens) as f64;
            p * (p + 1.0) / 2.0 + decode_ctx
        })
    }
}

fn features(prefill: f64, decode: f64, context: f64, pairs: f64) -> [f64; FEATURES] {
    [1.0, prefill, decode, context, pairs]
}

#[derive(Debug, Clone)]
pub struct Profiled {
    name: String,
    coef: [f64; FEATURES],
    floor: f64,
    client: ClientPath,
    /// Root-mean-square relative error of the fit over the profile's points.
    pub rms_rel_error: f64,
}

impl Profiled {
    /// Fit `profile`; `client` is used when the profile has none.
    pub fn fit(profile: &Profile, client: ClientPath) -> Result<Profiled, String> {
        let pts = &profile.points;
        if pts.len() < FEATURES {
            return Err(format!(
                "a profile needs at least {FEATURES} points to fit {FEATURES} coefficients, it has {}",
                pts.len()
            ));
        }
        if let Some(p) = pts
            .iter()
            .find(|p| !(p.step_s > 0.0 && p.step_s.is_finite()))
        {
            return Err(format!("step_s must be positive, found {}", p.step_s));
        }
        let rows: Vec<[f64; FEATURES]> = pts
            .iter()
            .map(|p| {
                features(
                    p.prefill_tokens as f64,
                    p.decode_seqs as f64,
                    p.context_tokens as f64,
                    p.pairs(),
                )
            })
            .collect();
        // Scale each column to max |value| = 1 so the normal equations are well conditioned.
        let mut scale = [0.0f64; FEATURES];
        for r in &rows {
            for j in 0..FEATURES {
                scale[j] = scale[j].max(r[j].abs());
            }
        }
        for s in scale.iter_mut() {
            if *s == 0.0 {
                *s = 1.0; // an unexercised feature: its coefficient ends up 0
            }
        }
        // Least squares on *relative* error (each row divided by its step time), so that a
        // 1 ms decode step weighs as much as a 1 s prefill; and no negative coefficient (a
        // cost term cannot save time): a feature whose coefficient comes out negative is
        // dropped and the rest refitted (an active-set method, at most FEATURES rounds).
        let mut active = [true; FEATURES];
        let mut coef = [0.0; FEATURES];
        for _ in 0..FEATURES {
            let mut ata = [[0.0f64; FEATURES]; FEATURES];
            let mut atb = [0.0f64; FEATURES];
            for (r, p) in rows.iter().zip(pts) {
                let x: Vec<f64> = (0..FEATURES)
                    .map(|j| {
                        if active[j] {
                            r[j] / scale[j] / p.step_s
                        } else {
                            0.0
                        }
                    })
                    .collect();
                for i in 0..FEATURES {
                    atb[i] += x[i];
                    for j in 0..FEATURES {
                        ata[i][j] += x[i] * x[j];
                    }
                }
            }
            // A tiny ridge keeps unexercised or dropped features (zero columns) solvable at 0.
            for (i, row) in ata.iter_mut().enumerate() {
                row[i] += 1e-12;
            }
            let beta =
                solve(ata, atb).ok_or("the profile's points do not determine a fit (singular)")?;
            for j in 0..FEATURES {
                coef[j] = beta[j] / scale[j];
            }
            match (0..FEATURES)
                .filter(|&j| active[j] && coef[j] < 0.0)
                .min_by(|&a, &b| (coef[a] * scale[a]).total_cmp(&(coef[b] * scale[b])))
            {
                Some(j) => active[j] = false,
                None => break,
            }
        }
        for j in 0..FEATURES {
            if !active[j] {
                coef[j] = 0.0;
            }
        }
        let floor = pts.iter().map(|p| p.step_s).fold(f64::INFINITY, f64::min);
        let client = profile.client.map_or(client, |c| ClientPath {
            request_s: c.request_s,
            per_prompt_token_s: c.per_prompt_token_s,
            stream_s: c.stream_s,
        });
        let mut fit = Profiled {
            name: format!("{} on {}", profile.model, profile.device),
            coef,
            floor,
            client,
            rms_rel_error: 0.0,
        };
        let sq: f64 = rows
            .iter()
            .zip(pts)
            .map(|(r, p)| ((fit.predict(r) - p.step_s) / p.step_s).powi(2))
            .sum();
        fit.rms_rel_error = (sq / pts.len() as f64).sqrt();
        Ok(fit)
    }

    pub fn from_json(text: &str, client: ClientPath) -> Result<Profiled, String> {
        let profile: Profile =
            serde_json::from_str(text).map_err(|e| format!("invalid profile JSON: {e}"))?;
        Profiled::fit(&profile, client)
    }

    pub fn coefficients(&self) -> [f64; FEATURES] {
        self.coef
    }

    fn predict(&self, x: &[f64; FEATURES]) -> f64 {
        let y: f64 = x.iter().zip(&self.coef).map(|(a, b)| a * b).sum();
        y.max(self.floor)
    }
}

impl CostModel for Profiled {
    fn step_time(&self, s: &StepShape) -> f64 {
        self.predict(&features(
            s.prefill_tokens as f64,
            s.decode_seqs as f64,
            s.context_tokens as f64,
            s.attention_pairs,
        ))
    }

    fn client_path(&self) -> ClientPath {
        self.client
    }

    fn describe(&self) -> String {
        let c = &self.coef;
        format!(
            "profiled ({}): step = {:.3} ms + {:.4} ms/prefill tok + {:.4} ms/decode seq + {:.6} ms/ctx tok \
             + {:.3e} ms/attn pair (fit rms error {:.1}%)",
            self.name,
            c[0] * 1e3,
            c[1] * 1e3,
            c[2] * 1e3,
            c[3] * 1e3,
            c[4] * 1e3,
            self.rms_rel_error * 100.0
        )
    }
}

/// Gaussian elimination with partial pivoting.
fn solve(mut a: [[f64; FEATURES]; FEATURES], mut b: [f64; FEATURES]) -> Option<[f64; FEATURES]> {
    for col in 0..FEATURES {
        let pivot = (col..FEATURES).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-15 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..FEATURES {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (x, p) in a[row][col..].iter_mut().zip(&pivot_row[col..]) {
                *x -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; FEATURES];
    for i in (0..FEATURES).rev() {
        let s: f64 = (i + 1..FEATURES).map(|k| a[i][k] * x[k]).sum();
        x[i] = (b[i] - s) / a[i][i];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A synthetic GPU with known coefficients.
    fn truth(p: usize, d: usize, c: usize, pairs: f64) -> f64 {
        0.004 + 60e-6 * p as f64 + 0.2e-3 * d as f64 + 0.5e-6 * c as f64 + 2e-9 * pairs
    }

    fn profile() -> Profile {
        let mut points = Vec::new();
        for &p in &[0usize, 128, 512, 2048] {
            for &d in &[0usize, 1, 8, 24] {
                if p == 0 && d == 0 {
                    continue;
                }
                let c = p + d * 700;
                let pairs = (p * (p + 1) / 2) as f64 + (d * 700) as f64;
                points.push(ProfilePoint {
                    prefill_tokens: p,
                    decode_seqs: d,
                    context_tokens: c,
                    attention_pairs: None,
                    step_s: truth(p, d, c, pairs),
                });
            }
        }
        Profile {
            model: "m".into(),
            device: "d".into(),
            points,
            client: None,
        }
    }

    #[test]
    fn the_fit_recovers_a_linear_truth() {
        let fit = Profiled::fit(&profile(), ClientPath::default()).unwrap();
        assert!(fit.rms_rel_error < 1e-6, "{}", fit.rms_rel_error);
        let s = StepShape {
            prefill_tokens: 300,
            decode_seqs: 5,
            context_tokens: 3800,
            attention_pairs: 50_000.0,
            ..StepShape::default()
        };
        let want = truth(300, 5, 3800, 50_000.0);
        assert!((fit.step_time(&s) - want).abs() / want < 1e-6);
        let json = serde_json::to_string(&profile()).unwrap();
        let again = Profiled::from_json(&json, ClientPath::default()).unwrap();
        // This grid makes context = prefill + 700 × decodes, so the coefficients are not
        // unique; the predictions are.
        for shape in [
            s,
            StepShape {
                prefill_tokens: 0,
                decode_seqs: 12,
                context_tokens: 8400,
                attention_pairs: 8400.0,
                ..StepShape::default()
            },
        ] {
            let (a, b) = (again.step_time(&shape), fit.step_time(&shape));
            assert!((a - b).abs() / b < 1e-9, "{a} vs {b}");
        }
    }

    #[test]
    fn too_few_or_bad_points_are_refused() {
        let mut p = profile();
        p.points.truncate(3);
        assert!(Profiled::fit(&p, ClientPath::default())
            .unwrap_err()
            .contains("at least 5"));
        let e = Profiled::from_json("{\"model\": 1}", ClientPath::default()).unwrap_err();
        assert!(e.contains("invalid profile JSON"), "{e}");
    }
}
