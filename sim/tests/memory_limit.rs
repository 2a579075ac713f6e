//! `sim.max_memory_mib` holds while requests are generated and replicas built, not only at
//! the event loop's periodic looks. The process's resident memory is what is measured, so
//! these checks live alone in their own test binary (other tests' allocations would blur
//! it) and run one after the other in one test.

#![cfg(target_os = "linux")]

mod common;

fn resident_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib >> 10
}

/// The MiB an error says the simulator's memory reached.
fn reached_mib(e: &str) -> u64 {
    let after = e
        .split("memory reached ")
        .nth(1)
        .unwrap_or_else(|| panic!("{e}"));
    after.split(' ').next().unwrap().parse().unwrap()
}

#[test]
fn memory_stays_near_its_limit_while_requests_are_generated_and_replicas_built() {
    // 100,000 closed-loop clients, all sending at the start: about 1.4 GB of prompts (1 to
    // 4,000 tokens, ids and text) generated in one event. Their fewest tokens (1 each) are
    // too few for the up-front refusal: the generation itself has to stop.
    let limit = resident_mib() + 100;
    let setup = common::setup(
        "baseline",
        &[
            "arrival.kind=concurrency",
            "arrival.max_concurrency=100000",
            "workload.num_requests=100000",
            "workload.prompt_tokens={uniform=[1, 4000]}",
            &format!("sim.max_memory_mib={limit}"),
        ],
    );
    let e = infer_sim::run(&setup).unwrap_err().to_string();
    assert!(e.contains("key `sim.max_memory_mib`"), "{e}");
    // A look every 2^20 generated tokens: about 8 MiB past the limit at most.
    let reached = reached_mib(&e);
    assert!(
        reached <= limit + 32,
        "reached {reached} MiB at a limit of {limit} MiB: {e}"
    );
    drop(setup);

    // Eight KV pools of 12 bytes a block (their free lists), just under the limit alone:
    // with the process's own memory the limit passes while the pools are built, before
    // the first event.
    let limit = resident_mib() + 100;
    let blocks = (limit << 20) / 12 / 8 - 1024;
    let setup = common::setup(
        "baseline",
        &[
            "server.model=qwen2.5-0.5b",
            "server.hardware=h200",
            "server.kv_cache_dtype=fp8",
            "server.block_size=1",
            &format!("server.num_gpu_blocks={blocks}"),
            "cluster={replicas=8, router=\"round-robin\"}",
            &format!("sim.max_memory_mib={limit}"),
        ],
    );
    let e = infer_sim::run(&setup).unwrap_err().to_string();
    assert!(
        e.contains("key `sim.max_memory_mib`") && e.contains("building replica"),
        "{e}"
    );
    // One pool (an eighth of the limit) past it at most.
    assert!(reached_mib(&e) <= limit + limit / 8 + 8, "{e}");
}
