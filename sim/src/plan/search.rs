//! Searches of a plan: the highest arrival rate a configuration holds, and the fewest
//! replicas that hold a rate. Each assumes what it searches is monotone (holds below some
//! rate, above some replica count) and says what it returns where it is not.

use crate::error::SimError;

/// The most replicas `--target-rate` tries.
pub const MAX_REPLICAS: usize = 256;
/// Capacity is found to within this ratio of rates.
const RATE_PRECISION: f64 = 1.02;
/// Doublings (or halvings) of the rate tried before giving up on a bracket: a factor of
/// 1,024 either way (lower, a run of the same requests outlasts any sensible clock).
const MAX_BRACKET_STEPS: usize = 10;

/// The highest rate at which a configuration holds its SLO attainment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    /// Requests per second; 0 when even the lowest rate tried misses the target.
    pub rate: f64,
    /// False when the attainment held at the highest rate tried (the capacity is at least
    /// `rate`).
    pub bounded: bool,
    /// Simulations the search ran.
    pub simulations: usize,
}

/// Bracket then bisect the rate (geometrically, to within [`RATE_PRECISION`]) for the
/// highest at which `holds` is true, starting from `start`. Assumes `holds` is true below
/// some rate and false above it; where a simulation is not monotone the answer is a rate
/// that holds with a higher one within the precision that does not.
pub fn search_capacity(
    start: f64,
    mut holds: impl FnMut(f64) -> Result<bool, SimError>,
) -> Result<Capacity, SimError> {
    let mut simulations = 0;
    let mut test = |r: f64| {
        simulations += 1;
        holds(r)
    };
    let (mut lo, mut hi);
    if test(start)? {
        lo = start;
        hi = start * 2.0;
        let mut steps = 0;
        while test(hi)? {
            lo = hi;
            hi *= 2.0;
            steps += 1;
            if steps == MAX_BRACKET_STEPS {
                return Ok(Capacity {
                    rate: lo,
                    bounded: false,
                    simulations,
                });
            }
        }
    } else {
        hi = start;
        lo = start / 2.0;
        let mut steps = 0;
        while !test(lo)? {
            hi = lo;
            lo /= 2.0;
            steps += 1;
            if steps == MAX_BRACKET_STEPS {
                return Ok(Capacity {
                    rate: 0.0,
                    bounded: true,
                    simulations,
                });
            }
        }
    }
    while hi / lo > RATE_PRECISION {
        let mid = (lo * hi).sqrt();
        if test(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Capacity {
        rate: lo,
        bounded: true,
        simulations,
    })
}

/// The fewest replicas in `1..=max` for which `holds` is true (doubling, then bisecting);
/// `None` when even `max` does not hold.
pub fn search_replicas(
    max: usize,
    mut holds: impl FnMut(usize) -> Result<bool, SimError>,
) -> Result<Option<usize>, SimError> {
    let mut lo = 0; // the most replicas known not to hold
    let mut hi = 1;
    while !holds(hi)? {
        if hi >= max {
            return Ok(None);
        }
        lo = hi;
        hi = (hi * 2).min(max);
    }
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if holds(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(Some(hi))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The search finds a monotone threshold to within its precision, from either side,
    /// and says when the threshold is beyond what it tried.
    #[test]
    fn capacity_search_brackets_the_threshold() {
        for threshold in [0.013, 0.7, 3.0, 5.9, 6.0, 6.1, 47.0, 1000.0] {
            let c = search_capacity(6.0, |r| Ok(r <= threshold)).unwrap();
            assert!(c.bounded);
            assert!(c.rate <= threshold, "{threshold}: {c:?}");
            assert!(c.rate * RATE_PRECISION > threshold, "{threshold}: {c:?}");
            assert!(c.simulations < 30, "{threshold}: {c:?}");
        }
        let always = search_capacity(1.0, |_| Ok(true)).unwrap();
        assert!(!always.bounded && always.rate >= 1000.0);
        let never = search_capacity(1.0, |_| Ok(false)).unwrap();
        assert_eq!(never.rate, 0.0);
    }

    #[test]
    fn replica_search_finds_the_fewest() {
        for need in 1..=40 {
            let mut tried = Vec::new();
            let n = search_replicas(64, |n| {
                tried.push(n);
                Ok(n >= need)
            })
            .unwrap();
            assert_eq!(n, Some(need));
            assert!(tried.len() <= 14, "{need}: {tried:?}");
        }
        assert_eq!(search_replicas(64, |n| Ok(n > 64)).unwrap(), None);
    }
}
