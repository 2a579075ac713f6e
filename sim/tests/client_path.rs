//! The server's request path (HTTP, tokenisation) as the simulator prices it: one request
//! at a time, in the order the requests were sent.

mod common;

/// A burst of prompts of 128-384 tokens, each costing 0.1 ms per token of tokenisation.
/// Were each request's path its own, the shortest prompt would reach the scheduler first;
/// served first come first served (one sequence at a time here), each request's TTFT would
/// then follow its prompt length rather than its place in the burst.
#[test]
fn a_burst_reaches_the_scheduler_in_the_order_it_was_sent() {
    let (request_s, per_token_s) = (1e-3, 1e-4);
    let setup = common::setup(
        "paged_attention",
        &[
            "server.max_batch_size=1",
            &format!("sim.client_request_s={request_s}"),
            &format!("sim.client_per_prompt_token_s={per_token_s}"),
        ],
    );
    let (result, rows) = infer_sim::run_collect(&setup).unwrap();
    assert_eq!(result.summary.failed, 0);
    let mut records = rows.records;
    records.sort_by_key(|r| r.id);
    assert!(records.len() >= 40, "{} requests", records.len());
    let lengths: Vec<usize> = records.iter().map(|r| r.prompt_tokens).collect();
    assert!(
        lengths.windows(2).any(|w| w[0] > w[1]),
        "the burst's prompts must not already be in length order: {lengths:?}"
    );
    // Sent together, so a first token in id order is an admission in id order.
    let sent = records[0].start;
    let mut path_done = 0.0;
    for pair in records.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert!(
            (b.start - sent).abs() < 1e-9,
            "request {} was not sent with the burst",
            b.id
        );
        let (ta, tb) = (a.ttft.unwrap(), b.ttft.unwrap());
        assert!(
            ta < tb,
            "request {} ({} tokens, TTFT {ta:.4} s) was served after request {} ({} tokens, \
             TTFT {tb:.4} s)",
            a.id,
            a.prompt_tokens,
            b.id,
            b.prompt_tokens
        );
    }
    // One at a time: no request reaches the scheduler before every path ahead of it ran.
    for r in &records {
        path_done += request_s + per_token_s * r.prompt_tokens as f64;
        let ttft = r.ttft.unwrap();
        assert!(
            ttft >= path_done,
            "request {} had its first token {ttft:.4} s after the burst, before the request \
             paths ahead of it and its own were done ({path_done:.4} s)",
            r.id
        );
    }
}

/// Behind a router, each replica's server has its own request path: a burst over two
/// replicas reaches each in half the time it takes to reach one.
#[test]
fn each_replica_of_a_cluster_has_its_own_request_path() {
    let (request_s, per_token_s) = (1e-3, 1e-4);
    let first_tokens = |replicas: usize| {
        let setup = common::setup(
            "paged_attention",
            &[
                "server.max_batch_size=1",
                &format!("sim.client_request_s={request_s}"),
                &format!("sim.client_per_prompt_token_s={per_token_s}"),
                &format!("cluster.replicas={replicas}"),
                "cluster.router=\"round-robin\"",
            ],
        );
        let (_, rows) = infer_sim::run_collect(&setup).unwrap();
        let mut records = rows.records;
        records.sort_by_key(|r| r.id);
        records
    };
    let (one, two) = (first_tokens(1), first_tokens(2));
    // Each replica's first request: it waits only for the paths routed before it there.
    let path =
        |r: &infer_core::metrics::RequestRecord| request_s + per_token_s * r.prompt_tokens as f64;
    let on_one = one[1].ttft.unwrap();
    let on_two = two[1].ttft.unwrap();
    assert!(
        on_one >= path(&one[0]) + path(&one[1]),
        "one replica: request 1 reached the scheduler before request 0's path ended"
    );
    assert!(
        on_two < path(&two[0]) + path(&two[1]),
        "two replicas: request 1 ({on_two:.4} s) waited for request 0's path on the other \
         replica"
    );
    assert_eq!(
        two[1].replica,
        Some(1),
        "round robin sends request 1 to the second replica"
    );
}

/// Every step 1 ms; every request's path 4 ms; a step loses `overlap_step_loss` of its
/// pace while a request is in the path.
struct SharedCores(f64);

impl infer_sim::cost::CostModel for SharedCores {
    fn step_time(&self, _: &infer_core::StepShape) -> f64 {
        1e-3
    }
    fn client_path(&self) -> infer_sim::cost::ClientPath {
        infer_sim::cost::ClientPath {
            request_s: 4e-3,
            overlap_step_loss: self.0,
            ..Default::default()
        }
    }
    fn describe(&self) -> String {
        "1 ms steps, 4 ms paths".into()
    }
}

/// Two requests of 100 prompt and 50 output tokens, sent as `arrival` says, on
/// [`SharedCores`].
fn two_requests(arrival: &str, loss: f64) -> Vec<infer_core::metrics::RequestRecord> {
    let dir = std::env::temp_dir().join(format!("infer-shared-cores-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("two.toml");
    let server = std::fs::read_to_string(common::path("baseline")).unwrap();
    let server = &server[server.find("[server]").unwrap()..];
    std::fs::write(
        &path,
        format!(
            "name = \"two\"\n[workload]\nnum_requests = 2\nprompt_tokens = 100\n\
             output_tokens = 50\nignore_eos = true\n[arrival]\n{arrival}\n{server}"
        ),
    )
    .unwrap();
    let mut setup = infer_sim::load(&path.display().to_string(), &[]).unwrap();
    setup.cost = std::sync::Arc::new(SharedCores(loss));
    let (_, rows) = infer_sim::run_collect(&setup).unwrap();
    rows.records
}

/// On a CPU engine a request's path (parsing, tokenising) shares the cores with the step.
/// Request 0 reaches the scheduler at 4 ms and steps from there, one per ms; request 1 is
/// sent 12.5 ms in, mid-step, its path busy until 16.5 ms. Losing half its pace, the step
/// starting at 13 ms (3.5 ms of path left: overlapped throughout) takes 2 ms, the one at
/// 15 ms (1.5 ms left) 1 + 0.75 ms; request 1's prefill then runs from 16.75 ms: a TTFT
/// of 5.25 ms, against 5.5 with cores to spare (its prefill waits for the step of
/// 16-17 ms), and request 0 ends 1.75 ms later.
#[test]
fn a_step_that_a_request_path_overlaps_runs_late() {
    let uniform = "kind = \"uniform\"\nrate = 80.0";
    let apart = two_requests(uniform, 0.0);
    let shared = two_requests(uniform, 0.5);
    let ms = |s: f64| s * 1e3;
    assert!((apart[1].start - apart[0].start - 0.0125).abs() < 1e-9);
    assert!(
        (shared[1].start - apart[1].start).abs() < 1e-12,
        "sent alike"
    );
    assert!(
        (ms(shared[0].ttft.unwrap()) - 5.0).abs() < 1e-6,
        "no step overlaps its path"
    );
    assert!((ms(apart[1].ttft.unwrap()) - 5.5).abs() < 1e-6);
    assert!(
        (ms(shared[1].ttft.unwrap()) - 5.25).abs() < 1e-6,
        "{:?}",
        shared[1].ttft
    );
    let late = ms(shared[0].e2e - apart[0].e2e);
    assert!(
        (late - 1.75).abs() < 1e-6,
        "request 0 ended {late} ms later"
    );
}

/// Requests sent one after another never overlap a step with their path: nothing changes.
#[test]
fn a_path_that_overlaps_no_step_costs_nothing() {
    let csv = |loss| infer_sim::output::requests_csv(&two_requests("kind = \"sequential\"", loss));
    assert_eq!(csv(0.0), csv(0.9));
}
