//! When requests are sent: open-loop arrival times, or closed-loop concurrency.

use rand::Rng;
use rand_distr::{Distribution, Exp, Gamma};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArrivalKind {
    /// One at a time: the next request is sent when the previous one ends.
    Sequential,
    /// Evenly spaced at `rate` per second.
    Uniform,
    /// Exponential gaps at `rate` per second.
    Poisson,
    /// Gamma gaps: mean 1/`rate`, shape `burstiness` (1 = Poisson, < 1 burstier).
    Gamma,
    /// All at time 0.
    Burst,
    /// Closed loop: `max_concurrency` clients, each sending its next request when its
    /// previous one ends.
    Concurrency,
    /// Piecewise Poisson rates: `stages = [{ rate, duration_s }, …]`.
    Stages,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stage {
    pub rate: f64,
    pub duration_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArrivalSpec {
    pub kind: ArrivalKind,
    #[serde(default)]
    pub rate: Option<f64>,
    #[serde(default)]
    pub burstiness: Option<f64>,
    /// For `concurrency`: the number of clients. For open-loop kinds: a cap on requests in
    /// flight (vLLM's `--max-concurrency`), arrivals beyond it wait.
    #[serde(default)]
    pub max_concurrency: Option<usize>,
    #[serde(default)]
    pub stages: Vec<Stage>,
}

/// How a run's requests are released.
#[derive(Debug, Clone, PartialEq)]
pub struct Arrivals {
    /// Send times in seconds from the start, one per request, non-decreasing;
    /// `None` for closed-loop kinds (sent as earlier requests end).
    pub times: Option<Vec<f64>>,
    /// Requests in flight at most.
    pub max_concurrency: Option<usize>,
}

impl Arrivals {
    /// Number of requests released (a staged schedule may end before `num_requests`).
    pub fn count(&self, num_requests: usize) -> usize {
        self.times.as_ref().map_or(num_requests, |t| t.len())
    }
}

impl ArrivalSpec {
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        let needs_rate = matches!(
            self.kind,
            ArrivalKind::Uniform | ArrivalKind::Poisson | ArrivalKind::Gamma
        );
        match self.rate {
            Some(r) if !(r > 0.0 && r.is_finite()) => {
                return Err((
                    "rate",
                    format!("must be a positive number of requests/s, got {r}"),
                ))
            }
            None if needs_rate => {
                return Err((
                    "rate",
                    format!("is required for kind = \"{:?}\"", self.kind),
                ))
            }
            _ => {}
        }
        if let Some(b) = self.burstiness {
            if !(b > 0.0 && b.is_finite()) {
                return Err(("burstiness", format!("must be positive, got {b}")));
            }
        }
        if self.max_concurrency == Some(0) {
            return Err(("max_concurrency", "must be at least 1".into()));
        }
        if self.kind == ArrivalKind::Concurrency && self.max_concurrency.is_none() {
            return Err((
                "max_concurrency",
                "is required for kind = \"concurrency\"".into(),
            ));
        }
        if self.kind == ArrivalKind::Stages {
            if self.stages.is_empty() {
                return Err((
                    "stages",
                    "kind = \"stages\" needs at least one stage".into(),
                ));
            }
            for s in &self.stages {
                if !(s.rate > 0.0 && s.rate.is_finite()) {
                    return Err((
                        "stages",
                        format!("stage rate must be positive, got {}", s.rate),
                    ));
                }
                if !(s.duration_s > 0.0 && s.duration_s.is_finite()) {
                    return Err((
                        "stages",
                        format!("stage duration_s must be positive, got {}", s.duration_s),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The release schedule of `num_requests` requests.
    pub fn schedule<R: Rng + ?Sized>(&self, num_requests: usize, rng: &mut R) -> Arrivals {
        let rate = self.rate.unwrap_or(1.0);
        let times = match self.kind {
            ArrivalKind::Sequential => {
                return Arrivals {
                    times: None,
                    max_concurrency: Some(1),
                };
            }
            ArrivalKind::Concurrency => {
                return Arrivals {
                    times: None,
                    max_concurrency: self.max_concurrency,
                };
            }
            ArrivalKind::Burst => vec![0.0; num_requests],
            ArrivalKind::Uniform => (0..num_requests).map(|i| i as f64 / rate).collect(),
            ArrivalKind::Poisson => {
                let exp = Exp::new(rate).expect("validated rate");
                cumulative(num_requests, || exp.sample(rng))
            }
            ArrivalKind::Gamma => {
                let shape = self.burstiness.unwrap_or(1.0);
                let gamma = Gamma::new(shape, 1.0 / (rate * shape)).expect("validated");
                cumulative(num_requests, || gamma.sample(rng))
            }
            ArrivalKind::Stages => {
                let mut times = Vec::new();
                let mut stage_start = 0.0;
                'stages: for s in &self.stages {
                    let exp = Exp::new(s.rate).expect("validated stage rate");
                    let end = stage_start + s.duration_s;
                    let mut t = stage_start;
                    loop {
                        t += exp.sample(rng);
                        if t >= end {
                            break;
                        }
                        if times.len() == num_requests {
                            break 'stages;
                        }
                        times.push(t);
                    }
                    stage_start = end;
                }
                times
            }
        };
        Arrivals {
            times: Some(times),
            max_concurrency: self.max_concurrency,
        }
    }

    /// Total length of a staged schedule, in seconds.
    pub fn stages_duration(&self) -> f64 {
        self.stages.iter().map(|s| s.duration_s).sum()
    }

    /// The stage a send time falls in (for per-stage reports).
    pub fn stage_of(&self, t: f64) -> Option<usize> {
        let mut end = 0.0;
        for (i, s) in self.stages.iter().enumerate() {
            end += s.duration_s;
            if t < end {
                return Some(i);
            }
        }
        None
    }
}

/// First request at 0, then the sampled gaps.
fn cumulative(n: usize, mut gap: impl FnMut() -> f64) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += gap();
            }
            t
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn spec(kind: ArrivalKind, rate: Option<f64>) -> ArrivalSpec {
        ArrivalSpec {
            kind,
            rate,
            burstiness: None,
            max_concurrency: None,
            stages: vec![],
        }
    }

    #[test]
    fn rates_come_out_right() {
        let mut rng = ChaCha8Rng::seed_from_u64(42);
        let t = spec(ArrivalKind::Uniform, Some(4.0))
            .schedule(9, &mut rng)
            .times
            .unwrap();
        assert_eq!(t[8], 2.0);
        let t = spec(ArrivalKind::Poisson, Some(6.0))
            .schedule(6001, &mut rng)
            .times
            .unwrap();
        let rate = 6000.0 / t[6000];
        assert!((rate - 6.0).abs() < 0.3, "poisson rate {rate}");
        let mut g = spec(ArrivalKind::Gamma, Some(5.0));
        g.burstiness = Some(0.5);
        let t = g.schedule(6001, &mut rng).times.unwrap();
        assert!((6000.0 / t[6000] - 5.0).abs() < 0.4);
        assert!(t.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn stages_follow_their_rates_and_end() {
        let mut s = spec(ArrivalKind::Stages, None);
        s.stages = vec![
            Stage {
                rate: 3.0,
                duration_s: 100.0,
            },
            Stage {
                rate: 20.0,
                duration_s: 50.0,
            },
        ];
        let t = s
            .schedule(usize::MAX, &mut ChaCha8Rng::seed_from_u64(1))
            .times
            .unwrap();
        let first = t.iter().filter(|&&x| x < 100.0).count();
        let second = t.len() - first;
        assert!((250..350).contains(&first), "{first}");
        assert!((900..1100).contains(&second), "{second}");
        assert!(*t.last().unwrap() < 150.0);
        assert_eq!(s.stage_of(120.0), Some(1));
    }

    #[test]
    fn invalid_specs_are_refused() {
        assert_eq!(
            spec(ArrivalKind::Poisson, Some(-1.0))
                .validate()
                .unwrap_err()
                .0,
            "rate"
        );
        assert_eq!(
            spec(ArrivalKind::Poisson, None).validate().unwrap_err().0,
            "rate"
        );
        assert_eq!(
            spec(ArrivalKind::Stages, None).validate().unwrap_err().0,
            "stages"
        );
        assert_eq!(
            spec(ArrivalKind::Concurrency, None)
                .validate()
                .unwrap_err()
                .0,
            "max_concurrency"
        );
    }
}
