//! Token-length distributions, as scenario files write them:
//!
//! ```toml
//! prompt_tokens = 256                                   # fixed
//! prompt_tokens = { uniform = [64, 512] }               # inclusive bounds
//! prompt_tokens = { normal = { mean = 300, std = 50, min = 16, max = 1024 } }
//! prompt_tokens = { lognormal = { median = 300, sigma = 0.6, min = 16, max = 4096 } }
//! prompt_tokens = { mix = [ { weight = 0.75, uniform = [1024, 2048] },
//!                           { weight = 0.25, uniform = [64, 128] } ] }
//! ```

use rand::Rng;
use rand_distr::{Distribution, LogNormal, Normal};
use serde::de::{Deserialize, Deserializer, Error as _};

#[derive(Debug, Clone, PartialEq)]
pub enum LengthDist {
    Fixed(usize),
    Uniform {
        lo: usize,
        hi: usize,
    },
    Normal {
        mean: f64,
        std: f64,
        min: usize,
        max: usize,
    },
    LogNormal {
        median: f64,
        sigma: f64,
        min: usize,
        max: usize,
    },
    Mix(Vec<(f64, LengthDist)>),
}

/// Why a length distribution cannot be used (the scenario names the key).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidDist(pub String);

impl LengthDist {
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> usize {
        match self {
            LengthDist::Fixed(n) => *n,
            LengthDist::Uniform { lo, hi } => rng.gen_range(*lo..=*hi),
            LengthDist::Normal {
                mean,
                std,
                min,
                max,
            } => {
                let x: f64 = Normal::new(*mean, *std).expect("validated").sample(rng);
                (x.round().max(0.0) as usize).clamp(*min, *max)
            }
            LengthDist::LogNormal {
                median,
                sigma,
                min,
                max,
            } => {
                let x: f64 = LogNormal::new(median.ln(), *sigma)
                    .expect("validated")
                    .sample(rng);
                (x.round() as usize).clamp(*min, *max)
            }
            LengthDist::Mix(parts) => {
                let total: f64 = parts.iter().map(|(w, _)| w).sum();
                let mut u = rng.gen::<f64>() * total;
                for (w, d) in parts {
                    if u < *w {
                        return d.sample(rng);
                    }
                    u -= w;
                }
                parts.last().expect("validated non-empty").1.sample(rng)
            }
        }
    }

    /// The largest value it can produce.
    pub fn max(&self) -> usize {
        match self {
            LengthDist::Fixed(n) => *n,
            LengthDist::Uniform { hi, .. } => *hi,
            LengthDist::Normal { max, .. } | LengthDist::LogNormal { max, .. } => *max,
            LengthDist::Mix(parts) => parts.iter().map(|(_, d)| d.max()).max().unwrap_or(0),
        }
    }

    /// The smallest value it can produce.
    pub fn min(&self) -> usize {
        match self {
            LengthDist::Fixed(n) => *n,
            LengthDist::Uniform { lo, .. } => *lo,
            LengthDist::Normal { min, .. } | LengthDist::LogNormal { min, .. } => *min,
            LengthDist::Mix(parts) => parts.iter().map(|(_, d)| d.min()).min().unwrap_or(0),
        }
    }

    /// Parse the TOML forms above, with a reason on failure.
    pub fn from_toml(v: &toml::Value) -> Result<Self, InvalidDist> {
        Self::parse(v, false)
    }

    /// [`LengthDist::from_toml`]; a `component` of a mix carries its `weight` beside its
    /// form, anywhere else a weight would be ignored and is refused.
    fn parse(v: &toml::Value, component: bool) -> Result<Self, InvalidDist> {
        match v {
            toml::Value::Integer(n) => Ok(LengthDist::Fixed(non_negative(*n)?)),
            toml::Value::Table(t) => {
                if !component && t.contains_key("weight") {
                    return Err(InvalidDist(
                        "`weight` belongs to a mix component ({ mix = [{ weight = …, … }, …] }), \
                         not to a distribution of its own"
                            .into(),
                    ));
                }
                let forms: Vec<&String> = t.keys().filter(|k| k.as_str() != "weight").collect();
                if forms.len() != 1 {
                    return Err(InvalidDist(format!(
                        "expected exactly one of fixed, uniform, normal, lognormal, mix; found {}",
                        if forms.is_empty() {
                            "none".to_string()
                        } else {
                            forms
                                .iter()
                                .map(|s| s.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        }
                    )));
                }
                let key = forms[0].as_str();
                let body = &t[key];
                match key {
                    "fixed" => Ok(LengthDist::Fixed(int(body, "fixed")?)),
                    "uniform" => {
                        let arr = body.as_array().filter(|a| a.len() == 2).ok_or_else(|| {
                            InvalidDist("uniform must be a pair [low, high] of token counts".into())
                        })?;
                        let lo = int(&arr[0], "uniform low")?;
                        let hi = int(&arr[1], "uniform high")?;
                        if lo > hi {
                            return Err(InvalidDist(format!(
                                "uniform low {lo} is above high {hi}"
                            )));
                        }
                        Ok(LengthDist::Uniform { lo, hi })
                    }
                    "normal" | "lognormal" => {
                        let t = body
                            .as_table()
                            .ok_or_else(|| InvalidDist(format!("{key} must be a table")))?;
                        let centre = if key == "normal" { "mean" } else { "median" };
                        let spread = if key == "normal" { "std" } else { "sigma" };
                        for k in t.keys() {
                            if ![centre, spread, "min", "max"].contains(&k.as_str()) {
                                return Err(InvalidDist(format!(
                                    "unknown key `{k}` in {key} (expected {centre}, {spread}, \
                                     min, max)"
                                )));
                            }
                        }
                        let c = float(t.get(centre), centre)?;
                        let s = float(t.get(spread), spread)?;
                        let min = t
                            .get("min")
                            .map(|v| int(v, "min"))
                            .transpose()?
                            .unwrap_or(1);
                        let max = t
                            .get("max")
                            .map(|v| int(v, "max"))
                            .transpose()?
                            .unwrap_or(usize::MAX);
                        if s < 0.0 || !s.is_finite() || !c.is_finite() || c <= 0.0 {
                            return Err(InvalidDist(format!(
                                "{key} needs {centre} > 0 and {spread} >= 0"
                            )));
                        }
                        if min > max {
                            return Err(InvalidDist(format!("min {min} is above max {max}")));
                        }
                        Ok(if key == "normal" {
                            LengthDist::Normal {
                                mean: c,
                                std: s,
                                min,
                                max,
                            }
                        } else {
                            LengthDist::LogNormal {
                                median: c,
                                sigma: s,
                                min,
                                max,
                            }
                        })
                    }
                    "mix" => {
                        let arr = body
                            .as_array()
                            .ok_or_else(|| InvalidDist("mix must be a list".into()))?;
                        if arr.is_empty() {
                            return Err(InvalidDist(
                                "mix is empty: give at least one component".into(),
                            ));
                        }
                        let mut parts = Vec::new();
                        for (i, item) in arr.iter().enumerate() {
                            let w = item.get("weight").ok_or_else(|| {
                                InvalidDist(format!("mix component {i} has no weight"))
                            })?;
                            let w = float(Some(w), "weight")?;
                            if w <= 0.0 || !w.is_finite() {
                                return Err(InvalidDist(format!(
                                    "mix component {i}: weight must be > 0"
                                )));
                            }
                            let d = LengthDist::parse(item, true)
                                .map_err(|e| InvalidDist(format!("mix component {i}: {e}")))?;
                            parts.push((w, d));
                        }
                        // Sampling scales a uniform draw by the total: an infinite one would
                        // pick the last component every time.
                        let total: f64 = parts.iter().map(|(w, _)| w).sum();
                        if !total.is_finite() {
                            return Err(InvalidDist(format!(
                                "mix weights add up to {total}: they must total a finite number"
                            )));
                        }
                        Ok(LengthDist::Mix(parts))
                    }
                    other => Err(InvalidDist(format!(
                        "unknown distribution `{other}` (expected fixed, uniform, normal, \
                         lognormal, mix)"
                    ))),
                }
            }
            other => Err(InvalidDist(format!(
                "expected a token count or a distribution table, found {}",
                other.type_str()
            ))),
        }
    }
}

fn non_negative(n: i64) -> Result<usize, InvalidDist> {
    usize::try_from(n)
        .map_err(|_| InvalidDist(format!("token counts cannot be negative (got {n})")))
}

fn int(v: &toml::Value, what: &str) -> Result<usize, InvalidDist> {
    match v {
        toml::Value::Integer(n) => non_negative(*n),
        other => Err(InvalidDist(format!(
            "{what} must be an integer, found {}",
            other.type_str()
        ))),
    }
}

fn float(v: Option<&toml::Value>, what: &str) -> Result<f64, InvalidDist> {
    match v {
        Some(toml::Value::Integer(n)) => Ok(*n as f64),
        Some(toml::Value::Float(x)) => Ok(*x),
        Some(other) => Err(InvalidDist(format!(
            "{what} must be a number, found {}",
            other.type_str()
        ))),
        None => Err(InvalidDist(format!("missing `{what}`"))),
    }
}

impl<'de> Deserialize<'de> for LengthDist {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = toml::Value::deserialize(d)?;
        LengthDist::from_toml(&v).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn parse(s: &str) -> Result<LengthDist, String> {
        let t: toml::Table = toml::from_str(&format!("d = {s}")).unwrap();
        LengthDist::from_toml(&t["d"]).map_err(|e| e.to_string())
    }

    #[test]
    fn parses_every_form_and_samples_in_range() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for (src, lo, hi) in [
            ("256", 256, 256),
            ("{ uniform = [64, 512] }", 64, 512),
            (
                "{ normal = { mean = 300, std = 50, min = 16, max = 400 } }",
                16,
                400,
            ),
            (
                "{ lognormal = { median = 300, sigma = 0.6, min = 16, max = 4096 } }",
                16,
                4096,
            ),
            (
                "{ mix = [ { weight = 0.75, uniform = [1024, 2048] }, \
                 { weight = 0.25, uniform = [64, 128] } ] }",
                64,
                2048,
            ),
        ] {
            let d = parse(src).unwrap();
            for _ in 0..200 {
                let x = d.sample(&mut rng);
                assert!((lo..=hi).contains(&x), "{src}: {x}");
            }
        }
    }

    #[test]
    fn mixture_weights_are_respected() {
        let d = parse(
            "{ mix = [ { weight = 3, uniform = [1000, 2000] }, { weight = 1, fixed = 10 } ] }",
        )
        .unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let short = (0..4000).filter(|_| d.sample(&mut rng) == 10).count();
        assert!((800..1200).contains(&short), "{short} of 4000 short");
    }

    #[test]
    fn errors_say_why() {
        assert!(parse("{ mix = [] }").unwrap_err().contains("empty"));
        assert!(parse("-3").unwrap_err().contains("negative"));
        assert!(parse("{ uniform = [9, 3] }").unwrap_err().contains("above"));
        assert!(parse("{ gauss = 3 }")
            .unwrap_err()
            .contains("unknown distribution"));
        assert!(parse("\"long\"").unwrap_err().contains("found string"));
    }

    #[test]
    fn weights_belong_to_mix_components_and_must_total_a_finite_number() {
        for outside in [
            "{ weight = 0.5, uniform = [64, 512] }",
            "{ weight = 2, fixed = 8 }",
        ] {
            let e = parse(outside).unwrap_err();
            assert!(
                e.starts_with("`weight` belongs to a mix component"),
                "{outside}: {e}"
            );
        }
        // A mix inside a component: each level weighs its own components.
        let e = parse("{ mix = [ { weight = 1, mix = [ { weight = 1, fixed = 4 } ] } ] }");
        assert!(e.is_ok(), "{e:?}");
        let e = parse("{ mix = [ { weight = 1e308, fixed = 4 }, { weight = 1e308, fixed = 8 } ] }")
            .unwrap_err();
        assert_eq!(
            e,
            "mix weights add up to inf: they must total a finite number"
        );
    }
}
