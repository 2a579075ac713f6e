//! When requests are sent: open-loop arrival times, or closed-loop concurrency.

use rand_chacha::ChaCha8Rng;
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
    /// The arrival times of the workload's trace (`[workload] trace`).
    Trace,
}

impl ArrivalKind {
    /// The kind as scenario files write it.
    pub fn name(self) -> &'static str {
        match self {
            ArrivalKind::Sequential => "sequential",
            ArrivalKind::Uniform => "uniform",
            ArrivalKind::Poisson => "poisson",
            ArrivalKind::Gamma => "gamma",
            ArrivalKind::Burst => "burst",
            ArrivalKind::Concurrency => "concurrency",
            ArrivalKind::Stages => "stages",
            ArrivalKind::Trace => "trace",
        }
    }
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
#[derive(Debug, Clone)]
pub struct Arrivals {
    /// Send times, drawn as they are needed; `None` for closed-loop kinds (sent as earlier
    /// requests end).
    pub times: Option<ArrivalTimes>,
    /// Requests in flight at most.
    pub max_concurrency: Option<usize>,
}

/// Open-loop send times in seconds from the start, non-decreasing, drawn one at a time so
/// that a run of any length holds none of them in memory. A staged schedule may end before
/// `num_requests`.
#[derive(Debug, Clone)]
pub struct ArrivalTimes {
    gaps: Gaps,
    rng: ChaCha8Rng,
    /// Times still to give.
    left: usize,
    /// Times given so far.
    given: usize,
    t: f64,
}

#[derive(Debug, Clone)]
enum Gaps {
    Burst,
    Uniform(f64),
    /// The first request at 0, then sampled gaps.
    Sampled(GapDistribution),
    /// Given times (a trace's).
    Given(std::sync::Arc<[f64]>),
    /// Poisson within each stage; `end` is the current stage's end.
    Stages {
        stages: Vec<Stage>,
        stage: usize,
        end: f64,
    },
}

#[derive(Debug, Clone)]
enum GapDistribution {
    Exp(Exp<f64>),
    Gamma(Gamma<f64>),
}

impl Iterator for ArrivalTimes {
    type Item = f64;

    fn next(&mut self) -> Option<f64> {
        if self.left == 0 {
            return None;
        }
        let t = match &mut self.gaps {
            Gaps::Burst => 0.0,
            Gaps::Uniform(rate) => self.given as f64 / *rate,
            Gaps::Given(times) => *times.get(self.given)?,
            Gaps::Sampled(d) => {
                if self.given > 0 {
                    self.t += match d {
                        GapDistribution::Exp(e) => e.sample(&mut self.rng),
                        GapDistribution::Gamma(g) => g.sample(&mut self.rng),
                    };
                }
                self.t
            }
            Gaps::Stages { stages, stage, end } => loop {
                let s = stages.get(*stage)?;
                self.t += Exp::new(s.rate)
                    .expect("validated stage rate")
                    .sample(&mut self.rng);
                if self.t < *end {
                    break self.t;
                }
                // The next stage starts at this one's end.
                self.t = *end;
                *stage += 1;
                *end += stages.get(*stage).map_or(0.0, |s| s.duration_s);
            },
        };
        self.left -= 1;
        self.given += 1;
        Some(t)
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
                    format!("is required for kind = \"{}\"", self.kind.name()),
                ))
            }
            _ => {}
        }
        if let Some(b) = self.burstiness {
            if !(b > 0.0 && b.is_finite()) {
                return Err(("burstiness", format!("must be positive, got {b}")));
            }
        }
        if self.kind == ArrivalKind::Gamma {
            // The gaps' scale, 1 / (rate × burstiness), must be a positive float.
            let (rate, shape) = (self.rate.unwrap_or(1.0), self.burstiness.unwrap_or(1.0));
            let scale = 1.0 / (rate * shape);
            if !(scale > 0.0 && scale.is_finite()) {
                return Err((
                    "burstiness",
                    format!(
                        "rate {rate} x burstiness {shape} is out of range (the mean gap, \
                         1 / rate, is split into gaps of scale 1 / (rate x burstiness))"
                    ),
                ));
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
        if self.kind == ArrivalKind::Stages && self.stages.is_empty() {
            return Err((
                "stages",
                "kind = \"stages\" needs at least one stage".into(),
            ));
        }
        // Checked whatever the kind, so a typo in a schedule not (yet) selected is caught.
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
        Ok(())
    }

    /// Warnings for keys set that the kind does not read: `rate` with a kind that takes no
    /// rate, `burstiness` with a kind other than `gamma`, `stages` with a kind other than
    /// `stages`. Noted, not refused: an override (`--set arrival.kind=concurrency`) cannot
    /// unset a key its file sets.
    pub fn unused_keys(&self) -> Vec<String> {
        let reads_rate = matches!(
            self.kind,
            ArrivalKind::Uniform | ArrivalKind::Poisson | ArrivalKind::Gamma
        );
        let mut out = Vec::new();
        if let (Some(rate), false) = (self.rate, reads_rate) {
            out.push(format!(
                "warning: arrival.rate = {rate} has no effect: kind = \"{}\" does not read it",
                self.kind.name()
            ));
        }
        if let (Some(b), false) = (self.burstiness, self.kind == ArrivalKind::Gamma) {
            out.push(format!(
                "warning: arrival.burstiness = {b} has no effect: kind = \"{}\" does not read \
                 it (vLLM's --burstiness with a --request-rate is kind = \"gamma\" here)",
                self.kind.name()
            ));
        }
        if !self.stages.is_empty() && self.kind != ArrivalKind::Stages {
            out.push(format!(
                "warning: arrival.stages has no effect: kind = \"{}\" does not read it",
                self.kind.name()
            ));
        }
        out
    }

    /// The release schedule of `num_requests` requests, drawing from `rng`.
    pub fn schedule(&self, num_requests: usize, rng: ChaCha8Rng) -> Arrivals {
        let rate = self.rate.unwrap_or(1.0);
        let gaps = match self.kind {
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
            // The generator gives a trace's times (`WorkloadGenerator::arrivals`); without
            // them, everything at once.
            ArrivalKind::Trace | ArrivalKind::Burst => Gaps::Burst,
            ArrivalKind::Uniform => Gaps::Uniform(rate),
            ArrivalKind::Poisson => Gaps::Sampled(GapDistribution::Exp(
                Exp::new(rate).expect("validated rate"),
            )),
            ArrivalKind::Gamma => {
                let shape = self.burstiness.unwrap_or(1.0);
                let gamma = Gamma::new(shape, 1.0 / (rate * shape)).expect("validated");
                Gaps::Sampled(GapDistribution::Gamma(gamma))
            }
            ArrivalKind::Stages => Gaps::Stages {
                end: self.stages.first().map_or(0.0, |s| s.duration_s),
                stages: self.stages.clone(),
                stage: 0,
            },
        };
        Arrivals {
            times: Some(ArrivalTimes {
                gaps,
                rng,
                left: num_requests,
                given: 0,
                t: 0.0,
            }),
            max_concurrency: self.max_concurrency,
        }
    }

    /// The schedule of a trace's `times` (its first `num_requests`).
    pub fn given(&self, times: std::sync::Arc<[f64]>, num_requests: usize) -> Arrivals {
        Arrivals {
            times: Some(ArrivalTimes {
                left: num_requests.min(times.len()),
                gaps: Gaps::Given(times),
                rng: rand::SeedableRng::seed_from_u64(0),
                given: 0,
                t: 0.0,
            }),
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn times(spec: &ArrivalSpec, n: usize, seed: u64) -> Vec<f64> {
        spec.schedule(n, ChaCha8Rng::seed_from_u64(seed))
            .times
            .unwrap()
            .collect()
    }

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
        let t = times(&spec(ArrivalKind::Uniform, Some(4.0)), 9, 42);
        assert_eq!(t[8], 2.0);
        assert_eq!(times(&spec(ArrivalKind::Burst, None), 3, 42), [0.0; 3]);
        let t = times(&spec(ArrivalKind::Poisson, Some(6.0)), 6001, 42);
        assert_eq!(t.len(), 6001);
        assert_eq!(t[0], 0.0);
        let rate = 6000.0 / t[6000];
        assert!((rate - 6.0).abs() < 0.3, "poisson rate {rate}");
        let mut g = spec(ArrivalKind::Gamma, Some(5.0));
        g.burstiness = Some(0.5);
        let t = times(&g, 6001, 43);
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
        let t = times(&s, usize::MAX, 1);
        let first = t.iter().filter(|&&x| x < 100.0).count();
        let second = t.len() - first;
        assert!((250..350).contains(&first), "{first}");
        assert!((900..1100).contains(&second), "{second}");
        assert!(*t.last().unwrap() < 150.0);
        assert_eq!(s.stage_of(120.0), Some(1));
        assert_eq!(
            times(&s, 10, 1),
            t[..10],
            "a cap takes the schedule's first times"
        );
    }

    #[test]
    fn keys_the_kind_does_not_read_are_warned_of() {
        let mut closed = spec(ArrivalKind::Concurrency, Some(6.0));
        closed.max_concurrency = Some(4);
        closed.stages = vec![Stage {
            rate: 1.0,
            duration_s: 1.0,
        }];
        let w = closed.unused_keys();
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("arrival.rate = 6 has no effect: kind = \"concurrency\""));
        assert!(w[1].contains("arrival.stages"));
        assert!(spec(ArrivalKind::Poisson, Some(6.0))
            .unused_keys()
            .is_empty());
    }

    /// A burstiness the kind does not read is warned of: Poisson gaps for a user who asked
    /// for bursts would otherwise pass unnoticed.
    #[test]
    fn burstiness_belongs_to_gamma_arrivals() {
        let mut poisson = spec(ArrivalKind::Poisson, Some(4.0));
        poisson.burstiness = Some(0.5);
        poisson.validate().unwrap();
        let w = poisson.unused_keys();
        assert!(
            w.len() == 1 && w[0].contains("kind = \"gamma\"") && w[0].contains("\"poisson\""),
            "{w:?}"
        );
        let mut gamma = poisson.clone();
        gamma.kind = ArrivalKind::Gamma;
        gamma.validate().unwrap();
        assert!(gamma.unused_keys().is_empty());
        // Names as scenario files write them.
        for kind in [
            ArrivalKind::Sequential,
            ArrivalKind::Uniform,
            ArrivalKind::Poisson,
            ArrivalKind::Gamma,
            ArrivalKind::Burst,
            ArrivalKind::Concurrency,
            ArrivalKind::Stages,
            ArrivalKind::Trace,
        ] {
            let written = toml::Value::try_from(kind).unwrap();
            assert_eq!(written.as_str(), Some(kind.name()));
        }
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
        // Each valid alone, their product overflows: the gaps' scale would be 0.
        let mut g = spec(ArrivalKind::Gamma, Some(1e300));
        g.burstiness = Some(1e10);
        assert_eq!(g.validate().unwrap_err().0, "burstiness");
    }
}
