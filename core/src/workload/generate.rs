//! The workload generator shared by the simulator and the load generator: the same
//! scenario and seed give the same prompts (text and token ids) and arrival times.
//!
//! Requests are generated on demand and independently (each from its own seeded stream),
//! so a 100,000-request run never holds every prompt in memory.

use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::arrival::{ArrivalSpec, Arrivals};
use super::corpus::{TokenizedCorpus, Tokenizer};
use super::scenario::{RequestOrder, WorkloadSpec};
use super::trace::{Chat, Trace};

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedRequest {
    /// Position in the run (warm-up requests come after the measured ones in index space).
    pub index: usize,
    pub warmup: bool,
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    /// The shared-prefix group, or the conversation, it belongs to.
    pub group: Option<usize>,
    /// (conversation, turn) for multi-turn workloads.
    pub turn: Option<(usize, usize)>,
    /// Its output follows the structured-output grammar (`workload.structured_output`).
    pub structured: bool,
    /// Its priority (`workload.priorities`; 0 without).
    pub priority: i64,
}

pub struct WorkloadGenerator {
    spec: WorkloadSpec,
    tokenizer: Arc<dyn Tokenizer>,
    corpus: TokenizedCorpus,
    /// The prefix every prompt shares (`shared_prefix_tokens`).
    shared: Option<(String, Vec<u32>)>,
    /// The tokens the server puts before every prompt (see [`Tokenizer::prompt_prefix`]):
    /// each prompt's ids start with them, and its text is that much shorter.
    prefix: Vec<u32>,
    /// Where prompts are assembled: it keeps its capacity, so a prompt of many segments
    /// costs one exact allocation, not a chain of reallocations.
    scratch: std::sync::Mutex<(String, Vec<u32>)>,
    /// The trace being replayed (`[workload] trace`).
    trace: Option<Replay>,
}

/// A trace being replayed.
enum Replay {
    /// Rows with arrival times: request `i` is row `i`.
    Timed {
        trace: Arc<Trace>,
        times: Arc<[f64]>,
    },
    /// Conversations: request `i` is turn `order[i]` = (conversation, turn), every
    /// conversation's turn t before any conversation's turn t + 1 (as the generated
    /// `conversations` workload orders them).
    Chats {
        trace: Arc<Trace>,
        order: Vec<(usize, usize)>,
    },
}

// Independent random streams.
const PLAIN: u64 = 1;
const SHARED: u64 = 2;
const GROUP_SYSTEM: u64 = 3;
const QUESTION: u64 = 4;
const CONV_SYSTEM: u64 = 5;
const USER_TURN: u64 = 6;
const REPLY: u64 = 7;
const ARRIVALS: u64 = 8;
const STRUCTURED: u64 = 9;
const ORDER: u64 = 10;
const PRIORITY: u64 = 11;

impl WorkloadGenerator {
    pub fn new(spec: WorkloadSpec, tokenizer: Arc<dyn Tokenizer>) -> Self {
        let corpus = TokenizedCorpus::new(tokenizer.as_ref());
        let prefix = tokenizer.prompt_prefix();
        let mut g = WorkloadGenerator {
            spec,
            tokenizer,
            corpus,
            shared: None,
            prefix,
            scratch: Default::default(),
            trace: None,
        };
        if let Some(n) = g.spec.shared_prefix_tokens.filter(|&n| n > 0) {
            let mut seg = (String::new(), Vec::new());
            // The first segment of every prompt: it leaves room for the server's prefix.
            g.segment(
                "System instructions: ",
                n.saturating_sub(g.prefix.len()),
                &mut g.rng(SHARED, 0, 0),
                &mut seg,
            );
            g.shared = Some(seg);
        }
        g
    }

    /// Replay `trace` (read by the driver for the spec's `trace`). A timed trace: request
    /// `i` has row `i`'s lengths and arrives at its time. Conversations: request `i` is one
    /// turn, every conversation's turn t before any conversation's turn t + 1. Warm-ups reuse
    /// requests from the start.
    pub fn with_trace(mut self, trace: Arc<Trace>) -> Self {
        self.trace = Some(if trace.chats.is_empty() {
            let times: Arc<[f64]> = trace.rows.iter().map(|r| r.t_s).collect();
            Replay::Timed { trace, times }
        } else {
            let longest = trace.chats.iter().map(|c| c.turns.len()).max().unwrap_or(0);
            let order = (0..longest)
                .flat_map(|t| {
                    let chats = &trace.chats;
                    (0..chats.len())
                        .filter(move |&c| t < chats[c].turns.len())
                        .map(move |c| (c, t))
                })
                .collect();
            Replay::Chats { trace, order }
        });
        self
    }

    pub fn spec(&self) -> &WorkloadSpec {
        &self.spec
    }

    pub fn tokenizer(&self) -> &Arc<dyn Tokenizer> {
        &self.tokenizer
    }

    /// The priority of the `i`-th measured request, without making the request: the
    /// workload's draw, or a replayed trace's record.
    pub fn priority_of(&self, i: usize) -> i64 {
        match (&self.spec.priorities, &self.trace) {
            (Some(_), _) => self.priority(i),
            (None, Some(Replay::Timed { trace, .. })) => trace.rows[i % trace.rows.len()].priority,
            _ => 0,
        }
    }

    /// The `i`-th measured request (`i < num_requests`).
    pub fn request(&self, i: usize) -> GeneratedRequest {
        self.build(i, false)
    }

    /// The `i`-th warm-up request: the workload's shape, outside the measured ones.
    pub fn warmup_request(&self, i: usize) -> GeneratedRequest {
        self.build(self.spec.num_requests + i, true)
    }

    /// Release schedule of the measured requests.
    pub fn arrivals(&self, spec: &ArrivalSpec) -> Arrivals {
        if let Some(Replay::Timed { times, .. }) = &self.trace {
            return spec.given(times.clone(), self.spec.num_requests);
        }
        spec.schedule(self.spec.num_requests, self.rng(ARRIVALS, 0, 0))
    }

    fn build(&self, index: usize, warmup: bool) -> GeneratedRequest {
        let w = &self.spec;
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let seg = &mut *scratch;
        seg.0.clear();
        seg.1.clear();
        seg.1.extend_from_slice(&self.prefix);
        // The first segment of the prompt is shorter by the server's prefix tokens.
        let room = |n: usize| n.saturating_sub(self.prefix.len());
        let (mut group, mut turn) = (None, None);
        let max_tokens;
        let mut recorded_priority = 0;
        if let Some(Replay::Chats { trace, order }) = &self.trace {
            let (c, t) = order[index % order.len()];
            let chat = &trace.chats[c];
            self.chat_prompt(chat, t, seg);
            max_tokens = self.tokenizer.encode(&chat.turns[t].reply).len().max(1);
            group = Some(c);
            turn = Some((c, t));
        } else if let Some(Replay::Timed { trace, .. }) = &self.trace {
            let row = trace.rows[index % trace.rows.len()];
            let mut rng = self.rng(PLAIN, index, 0);
            self.segment(
                &format!("Request {index}: "),
                room(row.prompt_tokens),
                &mut rng,
                seg,
            );
            max_tokens = row.output_tokens;
            recorded_priority = row.priority;
        } else if let Some(g) = w.groups {
            // Prompts cycle through the G×P set, groups interleaved (a set too large to
            // count, which validation refuses, never cycles).
            let set = g.count.checked_mul(g.prompts_per_group);
            let p = set.map_or(index, |n| index % n);
            let p = match (g.order, set) {
                (RequestOrder::Shuffled, Some(n)) => self.shuffled(p, n, index / n),
                _ => p,
            };
            let (gi, qi) = (p % g.count, p / g.count);
            let tag = format!("System prompt {gi}: ");
            self.segment(
                &tag,
                room(g.system_tokens),
                &mut self.rng(GROUP_SYSTEM, gi, 0),
                seg,
            );
            let mut rng = self.rng(QUESTION, gi, qi);
            let n = w.prompt_tokens.sample(&mut rng);
            max_tokens = w.output_tokens.sample(&mut rng);
            self.segment(&format!("\n\nQuestion {qi}: "), n, &mut rng, seg);
            group = Some(gi);
        } else if let Some(c) = w.conversations {
            // Turn t of every conversation comes before turn t+1 of any.
            let round = index / c.count;
            let ci = match c.order {
                RequestOrder::Shuffled => self.shuffled(index % c.count, c.count, round),
                RequestOrder::Interleaved => index % c.count,
            };
            let turns = self.turns_of(ci);
            let t = round % turns;
            let tag = format!("Conversation {ci}. ");
            self.segment(
                &tag,
                room(c.system_tokens.max(1)),
                &mut self.rng(CONV_SYSTEM, ci, 0),
                seg,
            );
            for k in 0..=t {
                let mut rng = self.rng(USER_TURN, ci, k);
                let n = w.prompt_tokens.sample(&mut rng);
                self.segment("\n\nUser: ", n, &mut rng, seg);
                if k < t {
                    let mut rng = self.rng(REPLY, ci, k);
                    let n = w.output_tokens.sample(&mut rng);
                    self.segment("\n\nAssistant: ", n, &mut rng, seg);
                }
            }
            max_tokens = w.output_tokens.sample(&mut self.rng(REPLY, ci, t));
            group = Some(ci);
            turn = Some((ci, t));
        } else {
            let mut rng = self.rng(PLAIN, index, 0);
            if let Some((text, ids)) = &self.shared {
                seg.0.push_str(text);
                seg.1.extend_from_slice(ids);
            }
            let n = w.prompt_tokens.sample(&mut rng);
            max_tokens = w.output_tokens.sample(&mut rng);
            let (tag, n) = if self.shared.is_some() {
                ("\n\nRequest ", n) // the shared prefix left the room
            } else {
                ("Request ", room(n))
            };
            self.segment(&format!("{tag}{index}: "), n, &mut rng, seg);
        }
        GeneratedRequest {
            index,
            warmup,
            prompt: seg.0.as_str().to_owned(),
            prompt_ids: seg.1.to_vec(),
            max_tokens,
            ignore_eos: w.ignore_eos,
            group,
            turn,
            // Its own stream: adding structured output changes no other draw.
            structured: w
                .structured_output
                .is_some_and(|s| self.rng(STRUCTURED, index, 0).gen::<f64>() < s.fraction),
            // A trace's own, unless the workload draws them.
            priority: match w.priorities {
                Some(_) => self.priority(index),
                None => recorded_priority,
            },
        }
    }

    /// Request `index`'s priority: a class drawn by its fraction, from a stream of its own
    /// (adding priorities changes no other draw).
    fn priority(&self, index: usize) -> i64 {
        let Some(classes) = &self.spec.priorities else {
            return 0;
        };
        let u: f64 = self.rng(PRIORITY, index, 0).gen();
        let mut below = 0.0;
        for c in classes {
            below += c.fraction;
            if u < below {
                return c.priority;
            }
        }
        // (The fractions sum to 1 within rounding.)
        classes.last().map_or(0, |c| c.priority)
    }

    /// Turn `t` of a recorded conversation as its prompt: the system prompt, the earlier
    /// turns with their recorded replies, then turn `t`'s user message — so turn `t + 1`'s
    /// prompt begins with turn `t`'s, as a chat client resends its history.
    fn chat_prompt(&self, chat: &Chat, t: usize, out: &mut (String, Vec<u32>)) {
        if let Some(system) = &chat.system {
            out.0.push_str(system);
            out.0.push_str("\n\n");
        }
        for (k, turn) in chat.turns[..=t].iter().enumerate() {
            out.0.push_str("User: ");
            out.0.push_str(&turn.user);
            if k < t {
                out.0.push_str("\n\nAssistant: ");
                out.0.push_str(&turn.reply);
                out.0.push_str("\n\n");
            }
        }
        out.1.extend(self.tokenizer.encode(&out.0));
    }

    fn turns_of(&self, conversation: usize) -> usize {
        let c = self.spec.conversations.expect("conversations");
        let hi = c.max_turns.unwrap_or(c.min_turns);
        self.rng(CONV_SYSTEM, conversation, 1)
            .gen_range(c.min_turns..=hi)
    }

    /// Append a segment of exactly `n` tokens: a short tag (which makes unrelated
    /// segments differ from their first token), then corpus text from a random offset.
    fn segment(&self, tag: &str, n: usize, rng: &mut ChaCha8Rng, out: &mut (String, Vec<u32>)) {
        if n == 0 {
            return;
        }
        let tag_tokens = self.tokenizer.encode_with_offsets(tag);
        let k = tag_tokens.len().min(n);
        if k > 0 {
            out.0.push_str(&tag[..tag_tokens[k - 1].end]);
            out.1.extend(tag_tokens[..k].iter().map(|t| t.id));
        }
        let offset = rng.gen_range(0..self.corpus.len());
        self.corpus.window(offset, n - k, &mut out.0, &mut out.1);
    }

    /// Position `i` of pass `pass` over `0..n` in that pass's seeded order.
    fn shuffled(&self, i: usize, n: usize, pass: usize) -> usize {
        permute(i as u64, n as u64, self.rng(ORDER, pass, 0).gen()) as usize
    }

    fn rng(&self, stream: u64, a: usize, b: usize) -> ChaCha8Rng {
        let s = mix(self.spec.seed ^ mix(stream ^ mix(a as u64 ^ mix(b as u64))));
        ChaCha8Rng::seed_from_u64(s)
    }
}

/// A permutation of `0..n` chosen by `key`, evaluated at `i < n` in constant memory (the
/// generator builds any request alone): a four-round Feistel network over the smallest
/// even number of bits that holds `n`, walked until it lands inside `0..n` (fewer than
/// four steps on average, since the domain is under 4n).
pub fn permute(i: u64, n: u64, key: u64) -> u64 {
    debug_assert!(i < n);
    if n <= 1 {
        return i;
    }
    let bits = (64 - (n - 1).leading_zeros()).div_ceil(2).max(1);
    let mask = (1u64 << bits) - 1;
    let mut x = i;
    loop {
        let (mut l, mut r) = (x >> bits, x & mask);
        for round in 0..4u64 {
            let f = mix(key ^ mix(round ^ (r << 8))) & mask;
            (l, r) = (r, l ^ f);
        }
        x = (l << bits) | r;
        if x < n {
            return x;
        }
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
