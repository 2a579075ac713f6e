//! The measured profiles shipped in `profiles/` (written by `engine profile` on real devices)
//! load and predict every seed workload: a scenario can use one with
//! `--set sim.cost_model="profiled" --set sim.profile="profiles/<file>.json"`.

use std::path::Path;

#[test]
fn shipped_profiles_predict_the_seed_workloads() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut profiles: Vec<_> = std::fs::read_dir(root.join("profiles"))
        .expect("profiles/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    profiles.sort();
    assert!(!profiles.is_empty(), "no profile in profiles/");
    for profile in &profiles {
        for seed in ["baseline", "chunked_prefill", "prefix_caching"] {
            let scenario = root.join(format!("scenarios/{seed}.toml"));
            let overrides = vec![
                "sim.cost_model=\"profiled\"".to_string(),
                format!("sim.profile={:?}", profile.display().to_string()),
            ];
            let setup = infer_sim::load(&scenario.display().to_string(), &overrides)
                .unwrap_or_else(|e| panic!("{}: {e}", profile.display()));
            let r = infer_sim::run(&setup).unwrap();
            let s = &r.summary;
            assert_eq!(s.failed, 0, "{} on {seed}", profile.display());
            assert!(
                s.completed > 0 && s.ttft.median > 0.0 && s.itl.median > 0.0,
                "{} on {seed}: {s:?}",
                profile.display()
            );
        }
    }
}
