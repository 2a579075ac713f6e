//! Router policies over N replicas: pure, seeded, deterministic. The simulator uses them to
//! predict routing experiments; a real deployment routes with llm-d, KubeAI or vllm-router.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::kv::{hash_block, ROOT_HASH};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RouterKind {
    Random,
    RoundRobin,
    /// Fewest waiting, then fewest running (the replicas' state: a request on its way to a
    /// replica is not in it yet).
    LeastQueue,
    /// vllm-router's `power_of_two`: two different replicas drawn at random, the less
    /// loaded winning (ties to the first drawn); a replica's load is its running and waiting
    /// requests as last polled (`/get_load`, as old as the cluster's metrics delay) plus the
    /// requests this router has sent it and not yet seen end, which a poll may count again
    /// (vllm-router adds the two likewise, so a burst between polls still spreads).
    PowerOfTwo,
    /// Lowest KV-cache usage.
    KvUsage,
    /// llm-d's load-only profile: queue scorer + KV scorer, weights 1 and 1.
    Load,
    /// Prefix affinity from the router's own routing history (no replica state).
    ApproxPrefix,
    /// Prefix affinity from each replica's actual cached blocks, plus load as tie-breaker.
    PrecisePrefix,
    /// llm-d's default: queue + KV + 2 × prefix (prefix from the replicas' caches).
    Weighted,
    /// KubeAI's consistent hashing with bounded loads: key = first 100 characters,
    /// 256 virtual nodes per replica, load factor 125%.
    Chwbl,
}

impl RouterKind {
    pub const ALL: [RouterKind; 10] = [
        RouterKind::Random,
        RouterKind::RoundRobin,
        RouterKind::LeastQueue,
        RouterKind::PowerOfTwo,
        RouterKind::KvUsage,
        RouterKind::Load,
        RouterKind::ApproxPrefix,
        RouterKind::PrecisePrefix,
        RouterKind::Weighted,
        RouterKind::Chwbl,
    ];

    /// Whether the policy reads the replicas' state ([`ReplicaSnapshot`]s). Those that do
    /// not (random, round-robin, consistent hashing) route in time independent of the
    /// number of replicas, so a driver need not gather the snapshots.
    pub fn reads_replica_state(self) -> bool {
        !matches!(
            self,
            RouterKind::Random | RouterKind::RoundRobin | RouterKind::Chwbl
        )
    }
}

/// What the router sees of a replica (possibly stale).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ReplicaSnapshot {
    pub waiting: usize,
    pub running: usize,
    pub kv_usage: f64,
}

/// A request as the router sees it.
pub struct RouteRequest<'a> {
    pub prompt_ids: &'a [u32],
    pub prompt_text: &'a str,
}

const CHWBL_KEY_CHARS: usize = 100;
const CHWBL_VNODES: usize = 256;
const CHWBL_LOAD_FACTOR: f64 = 1.25;
/// Entries the approximate-prefix index keeps before forgetting the oldest.
const APPROX_CAPACITY: usize = 1 << 20;

pub struct Router {
    kind: RouterKind,
    num_replicas: usize,
    block_size: usize,
    rng: ChaCha8Rng,
    next_rr: usize,
    /// Requests routed and not yet finished, per replica (CHWBL's load).
    in_flight: Vec<usize>,
    /// CHWBL ring: (point, replica), sorted.
    ring: Vec<(u64, usize)>,
    /// Approximate prefix index: block hash → (replica, last use).
    approx: HashMap<u64, (usize, u64)>,
    clock: u64,
}

impl Router {
    pub fn new(kind: RouterKind, num_replicas: usize, block_size: usize, seed: u64) -> Self {
        assert!(num_replicas > 0 && block_size > 0);
        let mut ring = Vec::new();
        if kind == RouterKind::Chwbl {
            for r in 0..num_replicas {
                for v in 0..CHWBL_VNODES {
                    ring.push((fnv64(format!("replica-{r}-{v}").as_bytes()), r));
                }
            }
            ring.sort_unstable();
        }
        Router {
            kind,
            num_replicas,
            block_size,
            rng: ChaCha8Rng::seed_from_u64(seed),
            next_rr: 0,
            in_flight: vec![0; num_replicas],
            ring,
            approx: HashMap::new(),
            clock: 0,
        }
    }

    pub fn kind(&self) -> RouterKind {
        self.kind
    }

    /// Chained block hashes of a prompt, as the replicas' prefix caches compute them.
    pub fn block_hashes(&self, prompt_ids: &[u32]) -> Vec<u64> {
        let mut parent = ROOT_HASH;
        prompt_ids
            .chunks_exact(self.block_size)
            .map(|c| {
                parent = hash_block(parent, c);
                parent
            })
            .collect()
    }

    /// Pick a replica. `cached(r, hashes)` tells how many leading blocks replica `r` holds
    /// (only the precise-prefix and weighted policies ask).
    pub fn route(
        &mut self,
        req: &RouteRequest,
        replicas: &[ReplicaSnapshot],
        cached: &dyn Fn(usize, &[u64]) -> usize,
    ) -> usize {
        assert_eq!(replicas.len(), self.num_replicas);
        let n = self.num_replicas;
        let choice = match self.kind {
            RouterKind::Random => self.rng.gen_range(0..n),
            RouterKind::RoundRobin => {
                let r = self.next_rr;
                self.next_rr = (r + 1) % n;
                r
            }
            RouterKind::LeastQueue => (0..n)
                .min_by_key(|&r| (replicas[r].waiting, replicas[r].running, r))
                .expect("n > 0"),
            RouterKind::PowerOfTwo if n == 1 => 0,
            RouterKind::PowerOfTwo => {
                let a = self.rng.gen_range(0..n);
                let b = (a + self.rng.gen_range(1..n)) % n;
                let load = |r: usize| replicas[r].waiting + replicas[r].running + self.in_flight[r];
                if load(a) <= load(b) {
                    a
                } else {
                    b
                }
            }
            RouterKind::KvUsage => (0..n)
                .min_by(|&a, &b| replicas[a].kv_usage.total_cmp(&replicas[b].kv_usage))
                .expect("n > 0"),
            RouterKind::Load => {
                let scores = load_scores(replicas);
                self.pick_max(&scores)
            }
            RouterKind::PrecisePrefix | RouterKind::Weighted => {
                let hashes = self.block_hashes(req.prompt_ids);
                let total = hashes.len().max(1) as f64;
                let prefix: Vec<f64> = (0..n).map(|r| cached(r, &hashes) as f64 / total).collect();
                let load = load_scores(replicas);
                let scores: Vec<f64> = if self.kind == RouterKind::Weighted {
                    (0..n).map(|r| load[r] + 2.0 * prefix[r]).collect()
                } else {
                    // Prefix first; load only separates replicas with equal prefix scores.
                    (0..n).map(|r| prefix[r] * 100.0 + load[r]).collect()
                };
                self.pick_max(&scores)
            }
            RouterKind::ApproxPrefix => self.route_approx(req, replicas),
            RouterKind::Chwbl => self.route_chwbl(req),
        };
        self.in_flight[choice] += 1;
        choice
    }

    /// A request routed to `replica` has ended (the router's own load count: CHWBL's and
    /// power-of-two's).
    pub fn finished(&mut self, replica: usize) {
        self.in_flight[replica] = self.in_flight[replica].saturating_sub(1);
    }

    /// The highest score; ties broken at random (llm-d's max-score picker).
    fn pick_max(&mut self, scores: &[f64]) -> usize {
        let best = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let ties: Vec<usize> = (0..scores.len())
            .filter(|&r| scores[r] >= best - 1e-12)
            .collect();
        ties[self.rng.gen_range(0..ties.len())]
    }

    fn route_approx(&mut self, req: &RouteRequest, replicas: &[ReplicaSnapshot]) -> usize {
        self.clock += 1;
        let hashes = self.block_hashes(req.prompt_ids);
        let matched: Vec<usize> = (0..self.num_replicas)
            .map(|r| {
                hashes
                    .iter()
                    .take_while(|h| self.approx.get(h).is_some_and(|&(owner, _)| owner == r))
                    .count()
            })
            .collect();
        let total = hashes.len().max(1) as f64;
        let load = load_scores(replicas);
        let scores: Vec<f64> = (0..self.num_replicas)
            .map(|r| load[r] + 2.0 * matched[r] as f64 / total)
            .collect();
        let choice = self.pick_max(&scores);
        for h in hashes {
            self.approx.insert(h, (choice, self.clock));
        }
        if self.approx.len() > APPROX_CAPACITY {
            // Forget the older half (rare; keeps memory bounded).
            let mut ages: Vec<u64> = self.approx.values().map(|&(_, t)| t).collect();
            ages.sort_unstable();
            let cutoff = ages[ages.len() / 2];
            self.approx.retain(|_, &mut (_, t)| t > cutoff);
        }
        choice
    }

    fn route_chwbl(&mut self, req: &RouteRequest) -> usize {
        let key_end = req
            .prompt_text
            .char_indices()
            .nth(CHWBL_KEY_CHARS)
            .map_or(req.prompt_text.len(), |(i, _)| i);
        let h = fnv64(&req.prompt_text.as_bytes()[..key_end]);
        let total: usize = self.in_flight.iter().sum();
        let avg = (total + 1) as f64 / self.num_replicas as f64;
        let bound = (avg * CHWBL_LOAD_FACTOR).ceil() as usize;
        let start = self.ring.partition_point(|&(p, _)| p < h);
        for i in 0..self.ring.len() {
            let (_, r) = self.ring[(start + i) % self.ring.len()];
            if self.in_flight[r] < bound {
                return r;
            }
        }
        (0..self.num_replicas)
            .min_by_key(|&r| self.in_flight[r])
            .expect("n > 0")
    }
}

/// llm-d's queue scorer plus KV-cache scorer, each in [0, 1].
fn load_scores(replicas: &[ReplicaSnapshot]) -> Vec<f64> {
    let q = |r: &ReplicaSnapshot| r.waiting as f64;
    let max_q = replicas.iter().map(q).fold(0.0, f64::max);
    let min_q = replicas.iter().map(q).fold(f64::INFINITY, f64::min);
    replicas
        .iter()
        .map(|r| {
            let queue = if max_q > min_q {
                (max_q - q(r)) / (max_q - min_q)
            } else {
                1.0
            };
            queue + (1.0 - r.kv_usage)
        })
        .collect()
}

fn fnv64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle(n: usize) -> Vec<ReplicaSnapshot> {
        vec![ReplicaSnapshot::default(); n]
    }

    #[test]
    fn load_policies_avoid_the_busy_replica() {
        let mut snaps = idle(3);
        snaps[0] = ReplicaSnapshot {
            waiting: 9,
            running: 4,
            kv_usage: 0.9,
        };
        snaps[1] = ReplicaSnapshot {
            waiting: 2,
            running: 4,
            kv_usage: 0.5,
        };
        let ids = [1u32; 40];
        let req = RouteRequest {
            prompt_ids: &ids,
            prompt_text: "x",
        };
        for kind in [
            RouterKind::LeastQueue,
            RouterKind::KvUsage,
            RouterKind::Load,
        ] {
            let mut r = Router::new(kind, 3, 16, 1);
            assert_eq!(r.route(&req, &snaps, &|_, _| 0), 2, "{kind:?}");
        }
    }

    /// A burst routed before any replica shows it: least-queue, reading the replicas'
    /// state, sends all of it to the first; power-of-two, adding what it sent, spreads it
    /// (the most loaded replica never wins a draw it is not tied in), a replica whose
    /// requests end is preferred again, and one whose polled load is high is avoided.
    #[test]
    fn power_of_two_spreads_a_burst_by_its_own_count() {
        let snaps = vec![ReplicaSnapshot::default(); 4];
        let ids = [1u32; 40];
        let req = RouteRequest {
            prompt_ids: &ids,
            prompt_text: "x",
        };
        let burst = |kind| {
            let mut r = Router::new(kind, 4, 16, 7);
            let mut counts = [0usize; 4];
            for _ in 0..40 {
                counts[r.route(&req, &snaps, &|_, _| 0)] += 1;
            }
            (r, counts)
        };
        assert_eq!(burst(RouterKind::LeastQueue).1, [40, 0, 0, 0]);
        let (mut r, counts) = burst(RouterKind::PowerOfTwo);
        assert!(counts.iter().all(|&c| (5..=15).contains(&c)), "{counts:?}");
        let least = (0..4).min_by_key(|&i| counts[i]).unwrap();
        for _ in 0..counts[least] {
            r.finished(least);
        }
        // It wins every draw it is in, about half of them, until it catches up.
        let mut again = [0usize; 4];
        for _ in 0..16 {
            again[r.route(&req, &snaps, &|_, _| 0)] += 1;
        }
        assert_eq!(again.iter().max(), Some(&again[least]), "{again:?}");
        assert!(again[least] >= 5, "{again:?}");
        let mut busy = snaps.clone();
        busy[1].waiting = 1000;
        let mut r = Router::new(RouterKind::PowerOfTwo, 4, 16, 7);
        for _ in 0..40 {
            assert_ne!(r.route(&req, &busy, &|_, _| 0), 1);
        }
    }

    #[test]
    fn prefix_policies_follow_the_cache() {
        let ids: Vec<u32> = (0..64).collect();
        let req = RouteRequest {
            prompt_ids: &ids,
            prompt_text: "x",
        };
        let mut snaps = idle(4);
        snaps[3].waiting = 1; // the cache holder is a little busier
        for kind in [RouterKind::PrecisePrefix, RouterKind::Weighted] {
            let mut r = Router::new(kind, 4, 16, 1);
            let cached = |rep: usize, h: &[u64]| if rep == 3 { h.len() } else { 0 };
            assert_eq!(r.route(&req, &snaps, &cached), 3, "{kind:?}");
        }
        // Approximate prefix learns from its own history.
        let mut r = Router::new(RouterKind::ApproxPrefix, 4, 16, 1);
        let first = r.route(&req, &idle(4), &|_, _| 0);
        for _ in 0..5 {
            assert_eq!(r.route(&req, &idle(4), &|_, _| 0), first);
        }
    }

    #[test]
    fn chwbl_is_sticky_but_bounded() {
        let mut r = Router::new(RouterKind::Chwbl, 8, 16, 1);
        let text = "Conversation 5. The town of Kestrel Bay sits at the mouth of a shallow river";
        let req = RouteRequest {
            prompt_ids: &[1, 2, 3],
            prompt_text: text,
        };
        let snaps = idle(8);
        let first = r.route(&req, &snaps, &|_, _| 0);
        r.finished(first);
        assert_eq!(
            r.route(&req, &snaps, &|_, _| 0),
            first,
            "same key, same replica"
        );
        // Piling the same key on: the bound spreads it once the holder is 25% over average.
        let mut counts = [0usize; 8];
        for _ in 0..80 {
            counts[r.route(&req, &snaps, &|_, _| 0)] += 1;
        }
        let max = *counts.iter().max().unwrap();
        assert!(max <= 14, "bounded load: {counts:?}");
    }

    #[test]
    fn round_robin_and_random_are_deterministic() {
        let snaps = idle(3);
        let req = RouteRequest {
            prompt_ids: &[1],
            prompt_text: "a",
        };
        let mut rr = Router::new(RouterKind::RoundRobin, 3, 16, 1);
        let seq: Vec<usize> = (0..6).map(|_| rr.route(&req, &snaps, &|_, _| 0)).collect();
        assert_eq!(seq, vec![0, 1, 2, 0, 1, 2]);
        let run = |seed| {
            let mut r = Router::new(RouterKind::Random, 3, 16, seed);
            (0..20)
                .map(|_| r.route(&req, &snaps, &|_, _| 0))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }
}
