//! The seed scenarios parse; generation is deterministic and seed-dependent; the shared
//! prefix structures share exactly what they should.

mod common;

use std::sync::Arc;

use common::{drive, simple_cost};
use infer_core::workload::{ApproxTokenizer, ArrivalKind, Scenario, WorkloadGenerator};
use infer_core::Request;

const SEEDS: [&str; 5] = [
    "baseline",
    "continuous_batching",
    "paged_attention",
    "chunked_prefill",
    "prefix_caching",
];

fn load(name: &str, overrides: &[&str]) -> Scenario {
    let path = format!("{}/../scenarios/{name}.toml", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    Scenario::parse(&path, &text, &o).unwrap()
}

fn generator(s: &Scenario) -> WorkloadGenerator {
    WorkloadGenerator::new(s.workload.clone(), Arc::new(ApproxTokenizer::default()))
}

#[test]
fn seed_scenarios_match_the_benchmark_log() {
    let expect = [
        ("baseline", 10, ArrivalKind::Sequential),
        ("continuous_batching", 32, ArrivalKind::Uniform),
        ("paged_attention", 48, ArrivalKind::Burst),
        ("chunked_prefill", 48, ArrivalKind::Poisson),
        ("prefix_caching", 48, ArrivalKind::Uniform),
    ];
    for (name, n, kind) in expect {
        let s = load(name, &[]);
        assert_eq!(s.name, name);
        assert_eq!(s.workload.num_requests, n);
        assert_eq!(s.workload.warmup_requests, 2);
        assert_eq!(s.workload.seed, 42);
        assert_eq!(s.arrival.kind, kind);
        let c = s.server.scheduler_config();
        assert_eq!(
            (c.max_batch_size, c.num_gpu_blocks, c.block_size),
            (24, 2048, 16)
        );
        assert!(c.chunked_prefill && c.prefix_caching);
        assert_eq!(c.prefill_chunk_size, 512);
        // Requests have the log's lengths.
        let g = generator(&s);
        for i in 0..n {
            let r = g.request(i);
            assert_eq!(
                r.prompt_ids.len(),
                expected_len(name, &r.prompt_ids),
                "{name} #{i}"
            );
            assert!(!r.prompt.is_empty());
        }
    }
}

fn expected_len(name: &str, ids: &[u32]) -> usize {
    let n = ids.len();
    let ok = match name {
        "baseline" => n == 256,
        "continuous_batching" => (64..=512).contains(&n),
        "paged_attention" => (128..=384).contains(&n),
        "chunked_prefill" => (64..=128).contains(&n) || (1024..=2048).contains(&n),
        "prefix_caching" => (1024 + 32..=1024 + 128).contains(&n),
        _ => false,
    };
    assert!(ok, "{name}: {n} tokens");
    n
}

#[test]
fn same_seed_same_requests_and_plans_other_seed_differs() {
    for name in SEEDS {
        let s = load(name, &[]);
        let (a, b) = (generator(&s), generator(&s));
        for i in 0..s.workload.num_requests {
            assert_eq!(a.request(i), b.request(i));
        }
        let times = |g: &WorkloadGenerator| -> Option<Vec<f64>> {
            g.arrivals(&s.arrival).times.map(Iterator::collect)
        };
        assert_eq!(times(&a), times(&b));
        let other = load(name, &["workload.seed=43"]);
        let c = generator(&other);
        assert_ne!(a.request(0).prompt_ids, c.request(0).prompt_ids, "{name}");
    }
    // Plans: the same scenario twice gives the same step-by-step schedule.
    let s = load("chunked_prefill", &[]);
    let run = || {
        let g = generator(&s);
        let times = g.arrivals(&s.arrival).times.unwrap();
        let reqs: Vec<(f64, Request)> = times
            .enumerate()
            .map(|(i, t)| {
                let r = g.request(i);
                (t, Request::new(i as u64, r.prompt_ids, r.max_tokens))
            })
            .collect();
        drive(s.server.scheduler_config(), reqs, simple_cost, vec![]).0
    };
    assert_eq!(run(), run());
}

#[test]
fn unrelated_prompts_do_not_share_a_first_block() {
    let s = load("chunked_prefill", &["workload.num_requests=2000"]);
    let g = generator(&s);
    let mut firsts: Vec<Vec<u32>> = (0..2000)
        .map(|i| g.request(i).prompt_ids[..16].to_vec())
        .collect();
    firsts.sort();
    firsts.dedup();
    assert_eq!(firsts.len(), 2000);
}

#[test]
fn groups_share_their_system_prompt_and_conversations_grow() {
    let text = r#"
name = "g"
[workload]
num_requests = 249
prompt_tokens = 100
output_tokens = 50
groups = { count = 83, prompts_per_group = 3, system_tokens = 800, order = "interleaved" }
[arrival]
kind = "poisson"
rate = 3
"#;
    let s = Scenario::parse("g.toml", text, &[]).unwrap();
    let g = generator(&s);
    let (a, b, c) = (g.request(0), g.request(83), g.request(1));
    assert_eq!((a.group, b.group, c.group), (Some(0), Some(0), Some(1)));
    assert_eq!(a.prompt_ids.len(), 900);
    assert_eq!(a.prompt_ids[..800], b.prompt_ids[..800]);
    assert_ne!(a.prompt_ids[800..], b.prompt_ids[800..]);
    assert_ne!(a.prompt_ids[..16], c.prompt_ids[..16]);
    assert_eq!(
        g.request(249).prompt_ids,
        a.prompt_ids,
        "the G x P set repeats"
    );

    let conv = text.replace(
        "groups = { count = 83, prompts_per_group = 3, system_tokens = 800, order = \"interleaved\" }",
        "conversations = { count = 10, min_turns = 8, order = \"interleaved\" }",
    );
    let s = Scenario::parse("c.toml", &conv, &[]).unwrap();
    let g = generator(&s);
    let (t0, t1, t2) = (g.request(3), g.request(13), g.request(23));
    assert_eq!(t1.turn, Some((3, 1)));
    assert!(
        t1.prompt_ids.starts_with(&t0.prompt_ids),
        "turn 1 extends turn 0"
    );
    assert!(t2.prompt_ids.starts_with(&t1.prompt_ids));
    assert_eq!(t2.prompt_ids.len() - t1.prompt_ids.len(), 100 + 50);
    assert!(t1.prompt.starts_with(&t0.prompt));
}

/// By default (SGLang's generated-shared-prefix data is shuffled) each pass over the G×P
/// set, and each round of conversations, comes in its own seeded order: every prompt once
/// a pass, every conversation once a round, turn t of all before turn t+1 of any; the same
/// seed gives the same order. (In turn, a round-robin router over R replicas fell in step
/// with the groups: each group on one replica when R divides G.)
#[test]
fn shuffled_groups_and_conversations_cover_each_pass_once() {
    let text = r#"
name = "g"
[workload]
num_requests = 400
prompt_tokens = 20
output_tokens = 5
groups = { count = 8, prompts_per_group = 5, system_tokens = 40 }
[arrival]
kind = "poisson"
rate = 3
"#;
    let s = Scenario::parse("g.toml", text, &[]).unwrap();
    let g = generator(&s);
    let first_pass: Vec<String> = (0..40).map(|i| g.request(i).prompt).collect();
    let second_pass: Vec<String> = (40..80).map(|i| g.request(i).prompt).collect();
    let mut a = first_pass.clone();
    let mut b = second_pass.clone();
    a.sort();
    b.sort();
    a.dedup();
    assert_eq!(a.len(), 40, "every prompt of the set once a pass");
    assert_eq!(a, b, "the same set each pass");
    assert_ne!(first_pass, second_pass, "in another order");
    let groups: Vec<usize> = (0..8).map(|i| g.request(i).group.unwrap()).collect();
    assert_ne!(groups, (0..8).collect::<Vec<_>>(), "not in turn");
    // Round robin over 4 replicas: each group reaches more than one of them.
    for group in 0..8 {
        let replicas: std::collections::BTreeSet<usize> = (0..400)
            .filter(|&i| g.request(i).group == Some(group))
            .map(|i| i % 4)
            .collect();
        assert!(replicas.len() > 1, "group {group}: {replicas:?}");
    }
    assert_eq!(
        generator(&s).request(17).prompt,
        g.request(17).prompt,
        "seeded"
    );

    let conv = text.replace(
        "groups = { count = 8, prompts_per_group = 5, system_tokens = 40 }",
        "conversations = { count = 8, min_turns = 3, max_turns = 3 }",
    );
    let s = Scenario::parse("c.toml", &conv, &[]).unwrap();
    let g = generator(&s);
    for round in 0..3 {
        let mut seen: Vec<(usize, usize)> = (round * 8..round * 8 + 8)
            .map(|i| g.request(i).turn.unwrap())
            .collect();
        seen.sort();
        assert_eq!(seen, (0..8).map(|c| (c, round)).collect::<Vec<_>>());
    }
    let order = |round: usize| -> Vec<usize> {
        (round * 8..round * 8 + 8)
            .map(|i| g.request(i).group.unwrap())
            .collect()
    };
    assert_ne!(order(0), order(1));
}

/// The keyed permutation behind a shuffled order is one: every position of `0..n` once.
#[test]
fn a_keyed_permutation_is_a_bijection() {
    for n in [1u64, 2, 3, 7, 8, 83, 100, 1000, 4097] {
        for key in [0u64, 1, 0xdead_beef] {
            let mut seen: Vec<u64> = (0..n)
                .map(|i| infer_core::workload::generate::permute(i, n, key))
                .collect();
            seen.sort();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "n {n}, key {key}");
        }
    }
}

#[test]
fn a_groups_set_too_large_to_count_never_cycles() {
    // Validation refuses it; a spec built in code reaches the generator anyway.
    let mut s = load("baseline", &[]);
    s.workload.shared_prefix_tokens = None;
    s.workload.groups = Some(infer_core::workload::GroupsSpec {
        count: usize::MAX / 2 + 1,
        prompts_per_group: 2,
        system_tokens: 100,
        order: Default::default(),
    });
    let g = generator(&s);
    assert_eq!(g.request(5).group, Some(5));
}

#[test]
fn scenario_errors_name_file_key_and_reason() {
    let path = format!(
        "{}/../scenarios/chunked_prefill.toml",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap();
    let cases: [(&[&str], &str, &str); 5] = [
        (
            &["workload.colour=\"red\""],
            "workload",
            "unknown field `colour`",
        ),
        (
            &["server.max_batch_size=\"lots\""],
            "server.max_batch_size",
            "invalid type",
        ),
        (
            &["server.prefill_chunk_size=0"],
            "server.prefill_chunk_size",
            "at least 1",
        ),
        (
            &["workload.prompt_tokens={ mix = [] }"],
            "workload.prompt_tokens",
            "empty",
        ),
        (&["arrival.rate=-6"], "arrival.rate", "positive"),
    ];
    for (set, key, reason) in cases {
        let o: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        let e = Scenario::parse(&path, &text, &o).unwrap_err();
        let msg = e.to_string();
        assert!(msg.starts_with(&path), "{msg}");
        assert!(e.key.starts_with(key), "{set:?}: key {} in {msg}", e.key);
        assert!(e.reason.contains(reason), "{set:?}: {msg}");
    }
}

/// A trace scenario's mistakes name the key: kind and trace go together, a trace gives the
/// lengths, more requests than rows; the shipped fixture replays its rows in order.
#[test]
fn trace_scenarios_refuse_what_does_not_fit_and_replay_their_rows() {
    use infer_core::workload::{ApproxTokenizer, Trace, WorkloadGenerator};
    let path = format!(
        "{}/../scenarios/trace_replay.toml",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap();
    let parse = |set: &[&str]| {
        let o: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        Scenario::parse(&path, &text, &o)
    };
    for (set, key, reason) in [
        (
            &["arrival.kind=\"poisson\"", "arrival.rate=2"][..],
            "arrival.kind",
            "go together",
        ),
        (
            &["workload.prompt_tokens=100"][..],
            "workload.prompt_tokens",
            "leave it out",
        ),
        (
            &["workload.trace.time_scale=0"][..],
            "workload.trace.time_scale",
            "positive",
        ),
        (
            &["workload.trace.format=\"csv\""][..],
            "workload.trace.format",
            "unknown variant",
        ),
    ] {
        let e = parse(set).unwrap_err();
        assert_eq!(e.key, key, "{set:?}: {e}");
        assert!(e.reason.contains(reason), "{set:?}: {e}");
    }
    let too_many = parse(&["workload.num_requests=41"]).unwrap();
    let e = Trace::of_scenario(&too_many, &path)
        .unwrap_err()
        .to_string();
    assert!(e.contains("num_requests") && e.contains("40 rows"), "{e}");
    let missing = parse(&["workload.trace.path=\"no/such.csv\""]).unwrap();
    assert!(Trace::of_scenario(&missing, &path)
        .unwrap_err()
        .to_string()
        .contains("no/such.csv"));

    let sc = parse(&[]).unwrap();
    let trace = Trace::of_scenario(&sc, &path).unwrap().unwrap();
    let gen = WorkloadGenerator::new(
        sc.workload.clone(),
        std::sync::Arc::new(ApproxTokenizer::default()),
    )
    .with_trace(trace.clone());
    let times: Vec<f64> = gen.arrivals(&sc.arrival).times.unwrap().collect();
    assert_eq!(times, trace.rows.iter().map(|r| r.t_s).collect::<Vec<_>>());
    for (i, row) in trace.rows.iter().enumerate() {
        let r = gen.request(i);
        assert_eq!(
            (r.prompt_ids.len(), r.max_tokens),
            (row.prompt_tokens, row.output_tokens)
        );
    }
}

#[test]
fn sharegpt_conversations_replay_turn_by_turn_with_their_history() {
    use infer_core::workload::{Tokenizer, Trace};
    let path = format!(
        "{}/../scenarios/sharegpt_replay.toml",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap();
    let parse = |set: &[&str]| {
        let o: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        Scenario::parse(&path, &text, &o)
    };
    let sc = parse(&[]).unwrap();
    let trace = Trace::of_scenario(&sc, &path).unwrap().unwrap();
    assert_eq!((trace.chats.len(), trace.requests()), (10, 25));
    let tok = Arc::new(ApproxTokenizer::default());
    let gen = WorkloadGenerator::new(sc.workload.clone(), tok.clone()).with_trace(trace.clone());
    // No times in the trace: the scenario's Poisson process sends them.
    let times: Vec<f64> = gen.arrivals(&sc.arrival).times.unwrap().collect();
    assert_eq!(times.len(), 25);
    let requests: Vec<_> = (0..25).map(|i| gen.request(i)).collect();
    let mut seen = std::collections::BTreeMap::new();
    for r in &requests {
        let (c, t) = r.turn.unwrap();
        let turn = &trace.chats[c].turns[t];
        assert!(r.prompt.ends_with(&turn.user), "{c}/{t}");
        assert_eq!(r.prompt_ids, tok.encode(&r.prompt));
        assert_eq!(r.max_tokens, tok.encode(&turn.reply).len());
        if t > 0 {
            // The history as a chat client resends it: the previous turn's prompt, its
            // recorded reply, then this message — so the prefix cache can hit.
            let prev: &infer_core::workload::GeneratedRequest = seen[&(c, t - 1)];
            assert!(r.prompt.starts_with(&prev.prompt), "{c}/{t}");
            assert!(r.prompt.contains(&trace.chats[c].turns[t - 1].reply));
            assert!(r.prompt_ids.starts_with(&prev.prompt_ids), "{c}/{t}");
        } else if let Some(system) = &trace.chats[c].system {
            assert!(r.prompt.starts_with(system.as_str()));
        }
        seen.insert((c, t), r);
    }
    assert_eq!(seen.len(), 25, "every turn once");
    let turns: Vec<usize> = requests.iter().map(|r| r.turn.unwrap().1).collect();
    assert!(
        turns.windows(2).all(|w| w[0] <= w[1]),
        "turn t of every conversation before turn t + 1 of any: {turns:?}"
    );

    for (set, key, reason) in [
        (&["arrival.kind=\"trace\""][..], "arrival.kind", "no times"),
        (
            &["workload.trace.time_scale=0.5"][..],
            "workload.trace.time_scale",
            "no times to scale",
        ),
    ] {
        let e = parse(set).unwrap_err();
        assert_eq!(e.key, key, "{set:?}: {e}");
        assert!(e.reason.contains(reason), "{set:?}: {e}");
    }
    let e = Trace::of_scenario(&parse(&["workload.num_requests=26"]).unwrap(), &path)
        .unwrap_err()
        .to_string();
    assert!(e.contains("25 conversation turns"), "{e}");
}

#[test]
fn malformed_sharegpt_is_refused_naming_the_conversation_and_message() {
    use infer_core::workload::{Chat, ChatTurn, Trace, TraceFormat};
    let parse = |json: &str| Trace::parse(json, TraceFormat::Sharegpt, 1.0);
    for (json, want) in [
        ("{", "not a ShareGPT JSON list"),
        (r#"[{"id": 1}]"#, "conversation 0: no `conversations` list"),
        (
            r#"[{"conversations": [{"from": "gpt", "value": "hi"}]}]"#,
            "message 0 (`gpt`) is out of turn",
        ),
        (
            r#"[{"conversations": [{"from": "robot", "value": "hi"}]}]"#,
            "unknown role `robot`",
        ),
        (
            r#"[{"conversations": [{"from": "human"}]}]"#,
            "message 0 has no string `value`",
        ),
        (
            r#"[{"conversations": [{"from": "human", "value": "hi"}]}]"#,
            "no conversation has a complete turn",
        ),
    ] {
        let e = parse(json).unwrap_err().to_string();
        assert!(e.contains(want), "{json}: {e}");
    }
    // A system prompt is kept; a last message without its reply is dropped.
    let t = parse(
        r#"[{"conversations": [{"from": "system", "value": "Be brief."},
            {"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
            {"from": "human", "value": "c"}]}]"#,
    )
    .unwrap();
    assert_eq!(
        t.chats,
        vec![Chat {
            system: Some("Be brief.".into()),
            turns: vec![ChatTurn {
                user: "a".into(),
                reply: "b".into()
            }],
        }]
    );
}

#[test]
fn prompts_leave_room_for_the_tokens_a_server_puts_first() {
    use infer_core::workload::{Token, Tokenizer};
    /// A tokenizer whose server puts a BOS (id 7) before every prompt.
    struct WithBos(ApproxTokenizer);
    impl Tokenizer for WithBos {
        fn encode_with_offsets(&self, text: &str) -> Vec<Token> {
            self.0.encode_with_offsets(text)
        }
        fn name(&self) -> String {
            "with a BOS".into()
        }
        fn prompt_prefix(&self) -> Vec<u32> {
            vec![7]
        }
    }
    let text = ApproxTokenizer::default();
    // Plain prompts, a shared prefix, groups of system prompts, conversations.
    for name in [
        "baseline",
        "prefix_caching",
        "llmd_shared_prefix",
        "kubeai_prefix_routing",
    ] {
        let s = load(name, &[]);
        let plain = generator(&s);
        let bos = WorkloadGenerator::new(s.workload.clone(), Arc::new(WithBos(text.clone())));
        for i in 0..6 {
            let (a, b) = (plain.request(i), bos.request(i));
            assert_eq!(b.prompt_ids.len(), a.prompt_ids.len(), "{name} {i}");
            assert_eq!(b.prompt_ids[0], 7, "{name} {i}");
            // One text token fewer (re-encoding a whole prompt may merge across the
            // boundary of its segments: within one more).
            let (ta, tb) = (text.encode(&a.prompt).len(), text.encode(&b.prompt).len());
            assert!(ta.abs_diff(tb + 1) <= 1, "{name} {i}: {ta} vs {tb} + 1");
            assert!(b.prompt.len() < a.prompt.len(), "{name} {i}");
        }
    }
}
