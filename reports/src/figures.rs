//! The charts of a report, built from runs: CDFs, queue and KV usage over time, per-replica
//! load, and the figures against offered load (QPS) and against concurrency.

use std::collections::BTreeMap;

use crate::chart::{Figure, Panel, Series};
use crate::load::LoadPoint;
use crate::run::{Frame, Run};

/// Empirical CDF of one requests.csv column (ms) per run: fraction of successful requests
/// at or below each value.
pub fn cdf_panel(runs: &[&Run], labels: &[String], column: &str, what: &str) -> Panel {
    Panel {
        title: format!("{what} CDF"),
        x_label: format!("{what} (ms)"),
        y_label: "Fraction of requests".into(),
        series: runs
            .iter()
            .zip(labels)
            .map(|(r, l)| Series {
                name: l.clone(),
                points: cdf(r.successful().values(column)),
                band: Vec::new(),
            })
            .collect(),
        markers: false,
    }
}

fn cdf(mut v: Vec<f64>) -> Vec<(f64, f64)> {
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.into_iter()
        .enumerate()
        .map(|(i, x)| (x, (i + 1) as f64 / n))
        .collect()
}

pub fn ttft_cdf(runs: &[&Run], labels: &[String]) -> Figure {
    Figure::single("ttft_cdf", cdf_panel(runs, labels, "ttft_ms", "TTFT"))
}

/// requests.csv keeps each request's mean gap, not every gap, so this is the CDF of
/// per-request mean ITL: each request counts once, where the tables' pooled ITL
/// percentiles weight requests by their token count.
pub fn itl_cdf(runs: &[&Run], labels: &[String]) -> Figure {
    let mut p = cdf_panel(runs, labels, "itl_mean_ms", "ITL");
    p.title = "ITL CDF (per-request mean ITL)".into();
    p.x_label = "Mean inter-token latency of a request (ms)".into();
    Figure::single("itl_cdf", p)
}

/// A timeseries.csv column over time, combined across replicas at each sample time.
fn over_time(run: &Run, column: &str, combine: Combine) -> Vec<(f64, f64)> {
    let t = run.timeseries.values("t_s");
    let v = run.timeseries.values(column);
    // Sample times are the same on every replica; key them in microseconds to group.
    let mut at: BTreeMap<i64, (f64, f64, usize)> = BTreeMap::new();
    for (t, v) in t.into_iter().zip(v) {
        let e = at.entry((t * 1e6).round() as i64).or_insert((t, 0.0, 0));
        e.1 += v;
        e.2 += 1;
    }
    at.into_values()
        .map(|(t, sum, n)| match combine {
            Combine::Sum => (t, sum),
            Combine::Mean => (t, sum / n as f64),
        })
        .collect()
}

#[derive(Clone, Copy)]
enum Combine {
    Sum,
    Mean,
}

/// Requests waiting for admission, over all replicas.
pub fn waiting_vs_time(runs: &[&Run], labels: &[String]) -> Figure {
    Figure::single(
        "waiting_queue_vs_time",
        Panel {
            title: "Waiting queue vs time".into(),
            x_label: "Time since start (s)".into(),
            y_label: "Requests waiting (all replicas)".into(),
            series: series(runs, labels, |r| over_time(r, "waiting", Combine::Sum)),
            markers: false,
        },
    )
}

/// KV cache usage, the mean over replicas.
pub fn kv_usage_vs_time(runs: &[&Run], labels: &[String]) -> Figure {
    Figure::single(
        "kv_cache_usage_vs_time",
        Panel {
            title: "KV cache usage vs time".into(),
            x_label: "Time since start (s)".into(),
            y_label: "KV cache usage (%, mean over replicas)".into(),
            series: series(runs, labels, |r| {
                let pts = over_time(r, "kv_usage", Combine::Mean);
                pts.into_iter().map(|(t, u)| (t, u * 100.0)).collect()
            }),
            markers: false,
        },
    )
}

fn series(runs: &[&Run], labels: &[String], f: impl Fn(&Run) -> Vec<(f64, f64)>) -> Vec<Series> {
    runs.iter()
        .zip(labels)
        .map(|(r, l)| Series {
            name: l.clone(),
            points: f(r),
            band: Vec::new(),
        })
        .collect()
}

/// A routed run's load on each replica over time (as llm-d's per-pod charts): requests in
/// the server (running + waiting), and KV usage.
pub fn replica_load(run: &Run, label: &str, name: &str) -> Figure {
    let ts = &run.timeseries;
    let mut ids: Vec<i64> = ts.values("replica").iter().map(|&r| r as i64).collect();
    ids.sort_unstable();
    ids.dedup();
    let per_replica = |f: &dyn Fn(&Frame) -> Vec<(f64, f64)>| -> Vec<Series> {
        ids.iter()
            .map(|&id| {
                let mask: Vec<bool> = ts
                    .values("replica")
                    .iter()
                    .map(|&r| r as i64 == id)
                    .collect();
                let rows = ts.filter(&mask);
                Series {
                    name: format!("replica {id}"),
                    points: f(&rows),
                    band: Vec::new(),
                }
            })
            .collect()
    };
    let load = per_replica(&|df| {
        let t = df.values("t_s");
        let w = df.values("waiting");
        let r = df.values("running");
        t.into_iter()
            .zip(w.into_iter().zip(r))
            .map(|(t, (w, r))| (t, w + r))
            .collect()
    });
    let kv = per_replica(&|df| {
        let t = df.values("t_s");
        let u = df.values("kv_usage");
        t.into_iter().zip(u).map(|(t, u)| (t, u * 100.0)).collect()
    });
    Figure {
        name: name.into(),
        title: format!("Per-replica load — {label}"),
        panels: vec![
            Panel {
                title: format!("Requests per replica — {label}"),
                x_label: "Time since start (s)".into(),
                y_label: "Requests running + waiting".into(),
                series: load,
                markers: false,
            },
            Panel {
                title: format!("KV cache usage per replica — {label}"),
                x_label: "Time since start (s)".into(),
                y_label: "KV cache usage (%)".into(),
                series: kv,
                markers: false,
            },
        ],
    }
}

/// The three inference-perf charts against offered load: latency, throughput and TTFT P90
/// vs QPS, one series per configuration (router), each point a stage or a run.
pub fn qps_figures(series: &[(String, Vec<LoadPoint>)]) -> Vec<Figure> {
    let panel = |title: &str, y_label: &str, y: fn(&LoadPoint) -> f64| Panel {
        title: title.into(),
        x_label: "Offered load (QPS, requests/s)".into(),
        y_label: y_label.into(),
        series: series
            .iter()
            .map(|(name, pts)| Series {
                name: name.clone(),
                points: pts.iter().map(|p| (p.qps, y(p))).collect(),
                band: Vec::new(),
            })
            .collect(),
        markers: true,
    };
    vec![
        Figure::single(
            "latency_vs_qps",
            panel("Latency vs QPS", "End-to-end latency P50 (s)", |p| {
                p.e2e_p50_s
            }),
        ),
        Figure::single(
            "throughput_vs_qps",
            panel("Throughput vs QPS", "Output throughput (tok/s)", |p| {
                p.output_throughput
            }),
        ),
        Figure::single(
            "ttft_p90_vs_qps",
            panel("TTFT P90 vs QPS", "TTFT P90 (s)", |p| p.ttft_p90_s),
        ),
    ]
}

/// Throughput and latency against closed-loop concurrency (the L4 sweep's chart). `runs`
/// holds the sweep's runs, `names` their series (one per configuration).
pub fn concurrency_figure(runs: &[&Run], names: &[String]) -> Figure {
    let mut groups: Vec<(String, Vec<(f64, &Run)>)> = Vec::new();
    for (r, name) in runs.iter().zip(names) {
        let Some(c) = r.concurrency() else { continue };
        match groups.iter_mut().find(|(n, _)| n == name) {
            Some((_, g)) => g.push((c as f64, r)),
            None => groups.push((name.clone(), vec![(c as f64, r)])),
        }
    }
    for (_, g) in &mut groups {
        g.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let single = groups.len() == 1;
    let line = |name: &str, what: &str, key: &str| Series {
        band: groups
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, g)| {
                g.iter()
                    .filter_map(|(c, r)| {
                        let lo = r.metric(&format!("{key}_lo"))?;
                        Some((*c, lo, r.metric(&format!("{key}_hi"))?))
                    })
                    .collect()
            })
            .unwrap_or_default(),
        name: match single {
            true => what.to_string(),
            false => format!("{name} {what}"),
        },
        points: groups
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, g)| {
                g.iter()
                    .filter_map(|(c, r)| Some((*c, r.metric(key)?)))
                    .collect()
            })
            .unwrap_or_default(),
    };
    let names: Vec<&String> = groups.iter().map(|(n, _)| n).collect();
    let lines = |pairs: &[(&str, &str)]| -> Vec<Series> {
        names
            .iter()
            .flat_map(|n| pairs.iter().map(|(what, key)| line(n, what, key)))
            .collect()
    };
    let x_label = "Concurrency (requests in flight)".to_string();
    Figure {
        name: "concurrency_sweep".into(),
        title: "Concurrency sweep: throughput and latency vs concurrency".into(),
        panels: vec![
            Panel {
                title: "Output throughput vs concurrency".into(),
                x_label: x_label.clone(),
                y_label: "Output throughput (tok/s)".into(),
                series: lines(&[("output tok/s", "output_throughput")]),
                markers: true,
            },
            Panel {
                title: "TTFT and E2E latency vs concurrency".into(),
                x_label: x_label.clone(),
                y_label: "Latency P50 (ms)".into(),
                series: lines(&[
                    ("TTFT P50", "median_ttft_ms"),
                    ("E2E P50", "median_e2el_ms"),
                ]),
                markers: true,
            },
            Panel {
                title: "ITL vs concurrency".into(),
                x_label,
                y_label: "ITL (ms)".into(),
                series: lines(&[("ITL P50", "median_itl_ms"), ("ITL P95", "p95_itl_ms")]),
                markers: true,
            },
        ],
    }
}
