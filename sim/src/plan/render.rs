//! A plan's outputs: `plan.csv` (a row per configuration), the console's answer and ranked
//! table, and `plan.md`.

use std::fmt::Write as _;

use super::{Configuration, Outcome, Plan, PlanSpec, MAX_REPLICAS};
use crate::sweep;

const HEADER: [&str; 12] = [
    "gpus",
    "goodput_req_per_s",
    "goodput_per_gpu",
    "slo_attainment",
    "meets_slo",
    "out_tok_per_s",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "e2el_p99_ms",
    "pareto",
];

/// The plan as CSV: a row per configuration, in plan order, each with its `rank` (1 the
/// best; the order of `plan.md`'s ranked table).
pub fn csv(plan: &Plan) -> String {
    let mut rank = vec![0; plan.outcomes.len()];
    for (position, &i) in ranked(plan).iter().enumerate() {
        rank[i] = position + 1;
    }
    let mut s = String::new();
    let mut head: Vec<String> = vec!["configuration".into(), "config".into()];
    head.extend(plan.spec.axes.iter().map(|a| a.key.clone()));
    head.extend(HEADER.iter().map(|h| h.to_string()));
    if plan.spec.capacity {
        head.extend(["capacity_req_per_s".into(), "capacity_per_gpu".into()]);
    }
    if plan.spec.target_rate.is_some() {
        head.push("replicas_for_target".into());
    }
    head.extend([
        "rank".into(),
        "best".into(),
        "settings".into(),
        "error".into(),
    ]);
    let _ = writeln!(s, "{}", head.join(","));
    for (i, o) in plan.outcomes.iter().enumerate() {
        let c = &o.configuration;
        let mut row = vec![sweep::csv_field(&c.name), sweep::csv_field(&c.config)];
        row.extend(c.assignment.iter().map(|(_, v)| sweep::csv_field(v)));
        match &o.result {
            Ok(e) => {
                let f = &e.figures;
                row.push(f.gpus.to_string());
                row.extend(
                    [f.goodput, e.goodput_per_gpu(), f.attainment]
                        .iter()
                        .map(|v| format!("{v:.4}")),
                );
                row.push(e.meets(plan.spec.attainment).to_string());
                row.extend(
                    [
                        f.output_throughput,
                        f.ttft_p50_ms,
                        f.ttft_p99_ms,
                        f.tpot_p50_ms,
                        f.tpot_p99_ms,
                        f.e2el_p99_ms,
                    ]
                    .iter()
                    .map(|v| format!("{v:.4}")),
                );
                row.push(plan.pareto[i].to_string());
                if plan.spec.capacity {
                    match e.capacity {
                        Some(cap) => {
                            let bound = if cap.bounded { "" } else { ">=" };
                            row.push(format!("{bound}{:.4}", cap.rate));
                            row.push(format!("{:.4}", cap.rate / f.gpus as f64));
                        }
                        None => row.extend([String::new(), String::new()]),
                    }
                }
                if plan.spec.target_rate.is_some() {
                    row.push(match e.replicas_for_target {
                        Some(Some(n)) => n.to_string(),
                        _ => String::new(),
                    });
                }
                row.push(rank[i].to_string());
                row.push((plan.best == Some(i)).to_string());
                row.push(settings_field(c));
                row.push(String::new());
            }
            Err(err) => {
                let blanks = HEADER.len()
                    + if plan.spec.capacity { 2 } else { 0 }
                    + usize::from(plan.spec.target_rate.is_some());
                row.extend(std::iter::repeat_n(String::new(), blanks));
                row.push(rank[i].to_string());
                row.push(String::new());
                row.push(settings_field(c));
                row.push(sweep::csv_field(&err.to_string()));
            }
        }
        let _ = writeln!(s, "{}", row.join(","));
    }
    s
}

/// A configuration's overrides as one CSV field, `;`-separated: what `--set` takes, so
/// that a script can serve or measure the configuration (scripts/plan_check.sh).
fn settings_field(c: &Configuration) -> String {
    sweep::csv_field(&c.settings.join(";"))
}

/// The objectives in words, e.g. `TTFT ≤ 2000 ms, TPOT ≤ 60 ms for 99% of requests`.
pub fn describe_slo(spec: &PlanSpec) -> String {
    let mut parts = Vec::new();
    for (name, v) in [
        ("TTFT", spec.slo.ttft_ms),
        ("TPOT", spec.slo.tpot_ms),
        ("E2EL", spec.slo.e2el_ms),
    ] {
        if let Some(v) = v {
            parts.push(format!("{name} ≤ {v} ms"));
        }
    }
    format!(
        "{} for {}% of requests",
        parts.join(", "),
        spec.attainment * 100.0
    )
}

/// A table of the given outcomes (markdown: aligned enough for a console too).
fn table(plan: &Plan, rows: &[usize]) -> String {
    let mut s = String::new();
    let mut head = vec![
        "configuration",
        "GPUs",
        "goodput (req/s)",
        "attainment",
        "TTFT P99 (ms)",
        "TPOT P99 (ms)",
    ];
    if plan.spec.capacity {
        head.push("capacity (req/s)");
    }
    if plan.spec.target_rate.is_some() {
        head.push("replicas for target");
    }
    head.push("");
    let _ = writeln!(s, "| {} |", head.join(" | "));
    let _ = writeln!(s, "|{}", "---|".repeat(head.len()));
    for &i in rows {
        let o = &plan.outcomes[i];
        let mut cells = vec![o.configuration.name.clone()];
        match &o.result {
            Ok(e) => {
                let f = &e.figures;
                cells.push(f.gpus.to_string());
                cells.push(format!("{:.3}", f.goodput));
                cells.push(format!("{:.1}%", f.attainment * 100.0));
                cells.push(format!("{:.0}", f.ttft_p99_ms));
                cells.push(format!("{:.1}", f.tpot_p99_ms));
                if plan.spec.capacity {
                    cells.push(match e.capacity {
                        Some(c) if !c.bounded => format!("≥ {:.2}", c.rate),
                        Some(c) => format!("{:.2}", c.rate),
                        None => String::new(),
                    });
                }
                if plan.spec.target_rate.is_some() {
                    cells.push(match e.replicas_for_target {
                        Some(Some(n)) => n.to_string(),
                        _ => format!("> {MAX_REPLICAS}"),
                    });
                }
                let mut marks = Vec::new();
                if plan.best == Some(i) {
                    marks.push("best");
                }
                if plan.pareto[i] {
                    marks.push("Pareto");
                }
                if !e.meets(plan.spec.attainment) {
                    marks.push("misses SLO");
                }
                cells.push(marks.join(", "));
            }
            Err(err) => {
                cells.push(format!("error: {err}"));
            }
        }
        let _ = writeln!(s, "| {} |", cells.join(" | "));
    }
    s
}

/// Outcomes in rank order: chosen ones by merit (ties as the best is chosen), then the rest
/// in plan order. The best, when there is one, comes first.
pub(super) fn ranked(plan: &Plan) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..plan.outcomes.len()).collect();
    idx.sort_by(|&a, &b| super::rank_order(&plan.spec, &plan.outcomes, a, b));
    idx
}

/// The plan's answer in words: the best configuration and its settings, or why none.
pub fn answer(plan: &Plan) -> String {
    let spec = &plan.spec;
    let n = plan.outcomes.len();
    let mut s = format!(
        "{n} configurations, {} meet {} at the scenario's rate\n",
        plan.meeting(),
        describe_slo(spec)
    );
    let failed: Vec<&Outcome> = plan.outcomes.iter().filter(|o| o.result.is_err()).collect();
    if let Some(first) = failed.first() {
        let _ = writeln!(
            s,
            "{} configurations failed to simulate; the first, {}: {}",
            failed.len(),
            first.configuration.name,
            first.result.as_ref().expect_err("failed")
        );
    }
    match plan.best {
        Some(i) => {
            let o = &plan.outcomes[i];
            let e = o.result.as_ref().expect("the best ran");
            let why =
                if let (Some(Some(r)), Some(gpus)) = (e.replicas_for_target, e.gpus_for_target()) {
                    format!(
                        "holds {} req/s on {r} replica(s), {gpus} GPU(s), the fewest GPUs",
                        spec.target_rate.unwrap_or_default(),
                    )
                } else if let Some(c) = e.capacity {
                    format!(
                        "capacity {}{:.2} req/s on {} GPU(s), the most per GPU",
                        if c.bounded { "" } else { "≥ " },
                        c.rate,
                        e.figures.gpus
                    )
                } else {
                    format!(
                        "goodput {:.3} req/s per GPU, attainment {:.1}%, the most goodput per GPU",
                        e.goodput_per_gpu(),
                        e.figures.attainment * 100.0
                    )
                };
            let _ = writeln!(s, "best: {} ({why})", o.configuration.name);
            if !o.configuration.settings.is_empty() {
                let _ = writeln!(s, "  settings: {}", o.configuration.settings.join(" "));
            }
        }
        None => {
            let _ = writeln!(
                s,
                "no configuration holds the SLO{}",
                if spec.target_rate.is_some() {
                    format!(" at the target rate with up to {MAX_REPLICAS} replicas")
                } else {
                    String::new()
                }
            );
        }
    }
    s
}

/// The configurations' warnings, each once with how many configurations it concerns
/// (`first_line`: the first line of each, for a console).
fn warnings(plan: &Plan, first_line: bool) -> String {
    let mut seen: Vec<(&str, usize)> = Vec::new();
    for e in plan.outcomes.iter().filter_map(|o| o.result.as_ref().ok()) {
        for w in &e.warnings {
            let w = if first_line {
                w.lines().next().unwrap_or(w)
            } else {
                w.as_str()
            };
            match seen.iter_mut().find(|(v, _)| *v == w) {
                Some((_, n)) => *n += 1,
                None => seen.push((w, 1)),
            }
        }
    }
    let n = plan.outcomes.len();
    seen.iter()
        .map(|(w, k)| format!("{w} ({k} of {n} configurations)\n"))
        .collect()
}

/// What `sim plan` prints: the answer, then the ranked table (the first `limit` rows) and
/// the Pareto front.
pub fn console(plan: &Plan, limit: usize) -> String {
    let mut s = answer(plan);
    s.push_str(&warnings(plan, true));
    let order = ranked(plan);
    let shown: Vec<usize> = order.iter().copied().take(limit).collect();
    s.push('\n');
    s.push_str(&table(plan, &shown));
    if order.len() > limit {
        let _ = writeln!(s, "({} more in plan.csv)", order.len() - limit);
    }
    s
}

/// `plan.md`: the question, the answer, the Pareto front and every configuration ranked.
pub fn report(plan: &Plan, scenario: &str, command: &str) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Plan: {scenario}\n");
    let _ = writeln!(s, "Command: `{command}`\n");
    let _ = writeln!(s, "Objectives: {}.\n", describe_slo(&plan.spec));
    let _ = writeln!(s, "```\n{}{}```\n", answer(plan), warnings(plan, false));
    let front: Vec<usize> = ranked(plan)
        .into_iter()
        .filter(|&i| plan.pareto[i])
        .collect();
    let _ = writeln!(
        s,
        "## Pareto front\n\nGoodput per GPU against the P99 of each metric the objectives name, \
         at the scenario's rate: no other configuration is better on all of them at once.\n"
    );
    s.push_str(&table(plan, &front));
    let _ = writeln!(s, "\n## Every configuration, ranked\n");
    s.push_str(&table(plan, &ranked(plan)));
    s
}
