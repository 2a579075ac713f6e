//! The black-box probes against the simulator: what a probe measures is what it was made to
//! measure (here, not in `loadgen`, which drives servers and knows nothing of the simulator).

use infer_core::workload::Scenario;
use infer_engine::loadgen::probe::{scenario_text, PROBES};

/// The decode-long probe exists to measure the decode attention where it matters: its
/// median ITL, simulated, must be a step of eight decodes at 1,024+ tokens of context.
#[test]
fn the_decode_long_probes_median_gap_is_a_step_of_eight_long_decodes() {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/baseline.toml");
    let base = Scenario::parse(file, &std::fs::read_to_string(file).unwrap(), &[]).unwrap();
    let probe = PROBES.iter().find(|p| p.name == "decode-long").unwrap();
    let path = std::env::temp_dir().join(format!("probe-decode-long-{}.toml", std::process::id()));
    std::fs::write(&path, scenario_text(&base, probe).unwrap()).unwrap();
    let setup = infer_sim::load(path.to_str().unwrap(), &[]).unwrap();
    std::fs::remove_file(&path).unwrap();
    let itl = infer_sim::run(&setup).unwrap().summary.itl.median;
    let step = |decodes: usize| {
        let context = decodes * (1024 + 64);
        setup.cost.step_time(&infer_core::StepShape {
            num_seqs: decodes,
            decode_seqs: decodes,
            sampled: decodes,
            context_tokens: context,
            decode_context_tokens: context,
            attention_pairs: context as f64,
            ..Default::default()
        })
    };
    let (eight, four) = (step(8), step(4));
    assert!(
        four < 0.85 * eight,
        "the shapes differ: {four} vs {eight} s"
    );
    assert!(
        (itl / eight - 1.0).abs() < 0.1,
        "ITL P50 {itl} s; a step of eight long decodes {eight} s, of four {four} s"
    );
}
