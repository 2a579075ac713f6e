//! Trace replay: a workload that comes from a recorded trace, so the simulator and the load
//! generator replay a user's real traffic. Two kinds:
//!
//! * **Timed** — arrival times and lengths: the public Azure LLM inference trace's CSV
//!   (`TIMESTAMP,ContextTokens,GeneratedTokens`) or this project's own `requests.csv`
//!   (`start_s`, `prompt_tokens`, `output_tokens`). Prompts are corpus text of each row's
//!   length (such a trace has lengths, not text); `max_tokens` is the row's output length
//!   (replay with `ignore_eos = true` to reproduce it). The scenario pairs it with
//!   `[arrival] kind = "trace"`.
//! * **Conversations** — ShareGPT's JSON layout (`[{"conversations": [{"from": "human",
//!   "value": …}, {"from": "gpt", "value": …}, …]}, …]`): real text, no times. Turn `t` of a
//!   conversation is one request whose prompt holds the conversation's earlier turns and
//!   replies as recorded, then its own user message; `max_tokens` is the recorded reply's
//!   length. Arrivals come from the scenario's `[arrival]` process.
//!
//! The scenario names the file (`[workload] trace = { path, format, time_scale }`); drivers
//! read it with [`Trace::load`].

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `[workload] trace = { … }`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceSpec {
    /// The trace file: as given if it exists, else relative to the scenario file.
    pub path: String,
    pub format: TraceFormat,
    /// Multiplies every arrival time (0.5 replays twice as fast).
    #[serde(default = "one")]
    pub time_scale: f64,
}

fn one() -> f64 {
    1.0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// Azure LLM inference trace: `TIMESTAMP` (`YYYY-MM-DD HH:MM:SS[.fraction]`),
    /// `ContextTokens`, `GeneratedTokens`.
    Azure,
    /// A run directory's `requests.csv` (`start_s`, `prompt_tokens`, `output_tokens`; rows
    /// whose `success` is `false` are left out, since their answers' lengths are unknown).
    /// Its rows are in id order, so they are replayed in order of their start times.
    Requests,
    /// ShareGPT's conversations (JSON): text, no times.
    Sharegpt,
}

impl TraceFormat {
    /// Whether the trace gives arrival times (`[arrival] kind = "trace"` replays them).
    pub fn is_timed(self) -> bool {
        !matches!(self, TraceFormat::Sharegpt)
    }
}

/// One recorded conversation: an optional system prompt, then (user, reply) turns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chat {
    pub system: Option<String>,
    pub turns: Vec<ChatTurn>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTurn {
    pub user: String,
    pub reply: String,
}

/// One request of a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceRow {
    /// Seconds from the trace's first request, scaled.
    pub t_s: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    /// A run's `requests.csv` records each request's priority (0 where the trace has none).
    pub priority: i64,
}

/// A trace: timed rows in arrival order, or conversations (one of the two is empty).
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub rows: Vec<TraceRow>,
    pub chats: Vec<Chat>,
}

impl TraceSpec {
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if !(self.time_scale > 0.0 && self.time_scale.is_finite()) {
            return Err((
                "time_scale",
                format!("must be a positive number, got {}", self.time_scale),
            ));
        }
        if self.path.is_empty() {
            return Err(("path", "must name the trace file".into()));
        }
        Ok(())
    }

    /// Where the file is: `path` as given if it exists, else next to `scenario_file`.
    pub fn resolve(&self, scenario_file: &str) -> PathBuf {
        super::scenario::resolve_path(&self.path, scenario_file)
    }
}

/// A trace that cannot be replayed: the file and line where known, and why.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error(transparent)]
    Read(#[from] crate::FileError),
    #[error("{}{}{reason}", path.as_ref().map_or(String::new(), |p| format!("{}: ", p.display())), line.map_or(String::new(), |l| format!("line {l}: ")))]
    Format {
        path: Option<std::path::PathBuf>,
        /// 1-based, counting the header.
        line: Option<usize>,
        reason: String,
    },
    #[error("{scenario_file}: workload.num_requests: {requested} requests but the trace has {available} {unit}")]
    TooShort {
        scenario_file: String,
        requested: usize,
        available: usize,
        /// "rows", or "conversation turns".
        unit: &'static str,
    },
}

/// A bad row (or header) at 1-based `line`.
fn bad(line: usize, reason: String) -> TraceError {
    TraceError::Format {
        path: None,
        line: Some(line),
        reason,
    }
}

/// The most tokens a trace row may give a prompt or an output: the longest `max_model_len`
/// accepted. Past it a prompt of corpus text would be generated before the server refuses
/// it (a row of 1e10 tokens is 40 GB of token ids).
pub const MAX_ROW_TOKENS: usize = crate::scheduler::MAX_MODEL_LEN;

impl Trace {
    /// Reads the trace a scenario names. Errors name the file, and the line of a bad row.
    pub fn load(spec: &TraceSpec, scenario_file: &str) -> Result<Trace, TraceError> {
        let path = spec.resolve(scenario_file);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(error) => return Err(crate::FileError::at(path, "read")(error).into()),
        };
        Trace::parse(&text, spec.format, spec.time_scale).map_err(|e| match e {
            TraceError::Format { line, reason, .. } => TraceError::Format {
                path: Some(path),
                line,
                reason,
            },
            other => other,
        })
    }

    /// The trace `scenario` (read from `scenario_file`) replays, if any; refuses more
    /// measured requests than the trace has rows.
    pub fn of_scenario(
        scenario: &super::Scenario,
        scenario_file: &str,
    ) -> Result<Option<std::sync::Arc<Trace>>, TraceError> {
        let Some(spec) = &scenario.workload.trace else {
            return Ok(None);
        };
        let trace = Trace::load(spec, scenario_file)?;
        let n = scenario.workload.num_requests;
        if n > trace.requests() {
            return Err(TraceError::TooShort {
                scenario_file: scenario_file.to_string(),
                requested: n,
                available: trace.requests(),
                unit: if trace.chats.is_empty() {
                    "rows"
                } else {
                    "conversation turns"
                },
            });
        }
        Ok(Some(std::sync::Arc::new(trace)))
    }

    /// How many requests it holds: its rows, or its conversations' turns.
    pub fn requests(&self) -> usize {
        self.rows.len() + self.chats.iter().map(|c| c.turns.len()).sum::<usize>()
    }

    pub fn parse(text: &str, format: TraceFormat, time_scale: f64) -> Result<Trace, TraceError> {
        if format == TraceFormat::Sharegpt {
            return parse_sharegpt(text);
        }
        let mut lines = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty());
        let (_, header) = lines.next().ok_or(TraceError::Format {
            path: None,
            line: None,
            reason: "the trace is empty".into(),
        })?;
        let columns: Vec<&str> = header.split(',').map(str::trim).collect();
        let find = |name: &str| {
            columns
                .iter()
                .position(|c| *c == name)
                .ok_or_else(|| bad(1, format!("no `{name}` column (found {header})")))
        };
        let (time, prompt, output) = match format {
            TraceFormat::Azure => (
                find("TIMESTAMP")?,
                find("ContextTokens")?,
                find("GeneratedTokens")?,
            ),
            TraceFormat::Requests => (
                find("start_s")?,
                find("prompt_tokens")?,
                find("output_tokens")?,
            ),
            TraceFormat::Sharegpt => unreachable!("parsed above"),
        };
        let success = columns.iter().position(|c| *c == "success");
        // (A requests.csv written before runs recorded priorities has none.)
        let priority = columns.iter().position(|c| *c == "priority");
        let requests = format == TraceFormat::Requests;
        let mut rows = Vec::new();
        let mut first: Option<f64> = None;
        for (i, line) in lines {
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            if requests && success.and_then(|c| fields.get(c)) == Some(&"false") {
                continue;
            }
            let field = |c: usize, name: &str| {
                fields
                    .get(c)
                    .copied()
                    .ok_or_else(|| bad(i + 1, format!("no `{name}` field")))
            };
            let count = |c: usize, name: &str| -> Result<usize, TraceError> {
                let v = field(c, name)?;
                v.parse()
                    .map_err(|_| bad(i + 1, format!("`{name}` = `{v}` is not a token count")))
            };
            let raw_t = field(time, "time")?;
            let t = match format {
                TraceFormat::Azure => timestamp_s(raw_t),
                TraceFormat::Requests => raw_t.parse().ok().filter(|t: &f64| t.is_finite()),
                TraceFormat::Sharegpt => unreachable!("parsed above"),
            }
            .ok_or_else(|| bad(i + 1, format!("`{raw_t}` is not a time")))?;
            let t0 = *first.get_or_insert(t);
            let row = TraceRow {
                t_s: (t - t0) * time_scale,
                prompt_tokens: count(prompt, "prompt length")?,
                output_tokens: count(output, "output length")?,
                priority: match priority.filter(|_| requests) {
                    Some(c) => {
                        let v = field(c, "priority")?;
                        v.parse().map_err(|_| {
                            bad(i + 1, format!("`priority` = `{v}` is not an integer"))
                        })?
                    }
                    None => 0,
                },
            };
            if row.prompt_tokens > MAX_ROW_TOKENS || row.output_tokens > MAX_ROW_TOKENS {
                return Err(bad(
                    i + 1,
                    format!(
                        "{} prompt and {} output tokens: a request has at most {MAX_ROW_TOKENS} \
                         of each (past any model's context)",
                        row.prompt_tokens, row.output_tokens
                    ),
                ));
            }
            if row.prompt_tokens == 0 || row.output_tokens == 0 {
                return Err(bad(
                    i + 1,
                    "a request needs at least one prompt and one output token".into(),
                ));
            }
            if !requests && rows.last().is_some_and(|r: &TraceRow| row.t_s < r.t_s) {
                return Err(bad(
                    i + 1,
                    format!(
                        "arrivals must be in time order ({raw_t} is earlier than the row before)"
                    ),
                ));
            }
            rows.push(row);
        }
        if rows.is_empty() {
            return Err(TraceError::Format {
                path: None,
                line: None,
                reason: "the trace has a header but no requests".into(),
            });
        }
        if requests {
            // A later turn of a conversation, or a closed loop's clients, start out of id
            // order; the first to start is time 0.
            rows.sort_by(|a, b| a.t_s.total_cmp(&b.t_s));
            let t0 = rows[0].t_s;
            for r in &mut rows {
                r.t_s -= t0;
            }
        }
        Ok(Trace {
            rows,
            chats: Vec::new(),
        })
    }
}

/// ShareGPT's layout: a list of `{"conversations": [{"from", "value"}, …]}`. A leading
/// `system` message is the conversation's system prompt; then user messages (`human`,
/// `user`) and replies (`gpt`, `assistant`, `chatgpt`) alternate. A last user message
/// without a reply is dropped (nothing says how long its answer was), and so is a
/// conversation without one complete turn, as vLLM's ShareGPT loader drops those.
fn parse_sharegpt(text: &str) -> Result<Trace, TraceError> {
    let bad = |line: Option<usize>, reason: String| TraceError::Format {
        path: None,
        line,
        reason,
    };
    let all: Vec<serde_json::Value> = serde_json::from_str(text)
        .map_err(|e| bad(Some(e.line()), format!("not a ShareGPT JSON list: {e}")))?;
    let mut chats = Vec::new();
    for (i, entry) in all.iter().enumerate() {
        let in_entry = |reason: String| bad(None, format!("conversation {i}: {reason}"));
        let messages = entry
            .get("conversations")
            .and_then(|c| c.as_array())
            .ok_or_else(|| in_entry("no `conversations` list".into()))?;
        let mut chat = Chat {
            system: None,
            turns: Vec::new(),
        };
        let mut pending_user: Option<String> = None;
        for (j, m) in messages.iter().enumerate() {
            let field = |k: &str| {
                m.get(k)
                    .and_then(|v| v.as_str())
                    .ok_or_else(|| in_entry(format!("message {j} has no string `{k}`")))
            };
            let (from, value) = (field("from")?, field("value")?.to_string());
            match (from, &pending_user) {
                ("system", None) if j == 0 => chat.system = Some(value),
                ("human" | "user", None) => pending_user = Some(value),
                ("gpt" | "assistant" | "chatgpt", Some(_)) => chat.turns.push(ChatTurn {
                    user: pending_user.take().unwrap_or_default(),
                    reply: value,
                }),
                ("system" | "human" | "user" | "gpt" | "assistant" | "chatgpt", _) => {
                    return Err(in_entry(format!(
                        "message {j} (`{from}`) is out of turn: user messages and replies \
                         alternate, a system prompt comes first"
                    )))
                }
                (other, _) => {
                    return Err(in_entry(format!(
                        "message {j}: unknown role `{other}` (expected system, human/user, \
                         gpt/assistant)"
                    )))
                }
            }
        }
        if !chat.turns.is_empty() {
            chats.push(chat);
        }
    }
    if chats.is_empty() {
        return Err(bad(None, "no conversation has a complete turn".into()));
    }
    Ok(Trace {
        rows: Vec::new(),
        chats,
    })
}

/// Seconds since 1970 of `YYYY-MM-DD HH:MM:SS[.fraction]` (UTC): a real date of the years
/// 1 to 9999, hours 0-23, minutes 0-59, seconds from 0 to 60 (a leap second).
fn timestamp_s(s: &str) -> Option<f64> {
    let (date, time) = s.split_once([' ', 'T'])?;
    let mut d = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let (h, min) = (
        t.next()?.parse::<i64>().ok()?,
        t.next()?.parse::<i64>().ok()?,
    );
    let sec: f64 = t.next()?.parse().ok()?;
    // NaN fails the range test too.
    if !(1..=9999).contains(&y)
        || !(1..=12).contains(&m)
        || !(1..=days_in_month(y, m)).contains(&day)
        || !(0..=23).contains(&h)
        || !(0..=59).contains(&min)
        || !(0.0..=60.0).contains(&sec)
    {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + h * 3_600 + min * 60) as f64 + sec)
}

/// Days in month `m` (1-12) of year `y`, Gregorian.
fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if y % 4 == 0 && (y % 100 != 0 || y % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn azure_rows_become_offsets_from_the_first_request() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 18:15:46.6805900,374,44\n\
                    2023-11-16 18:15:50.9951690,396,109\n\
                    2023-11-17 00:00:00,10,1\n";
        let t = Trace::parse(text, TraceFormat::Azure, 0.5).unwrap();
        assert_eq!(t.rows.len(), 3);
        assert_eq!(
            (
                t.rows[0].t_s,
                t.rows[0].prompt_tokens,
                t.rows[0].output_tokens
            ),
            (0.0, 374, 44)
        );
        assert!(
            (t.rows[1].t_s - 4.314579 * 0.5).abs() < 1e-6,
            "{}",
            t.rows[1].t_s
        );
        let to_midnight = 86_400.0 - (18.0 * 3600.0 + 15.0 * 60.0 + 46.68059);
        assert!(
            (t.rows[2].t_s - to_midnight * 0.5).abs() < 1e-6,
            "{}",
            t.rows[2].t_s
        );
    }

    #[test]
    fn a_requests_csv_replays_its_own_start_times() {
        let text = "id,start_s,ttft_s,prompt_tokens,output_tokens\n0,1.5,0.1,12,3\n1,2.0,,30,7\n";
        let t = Trace::parse(text, TraceFormat::Requests, 1.0).unwrap();
        assert_eq!(
            t.rows,
            vec![
                TraceRow {
                    t_s: 0.0,
                    prompt_tokens: 12,
                    output_tokens: 3,
                    priority: 0,
                },
                TraceRow {
                    t_s: 0.5,
                    prompt_tokens: 30,
                    output_tokens: 7,
                    priority: 0,
                },
            ]
        );
    }

    /// A run's own requests.csv replays: rows out of start order (a conversation's later
    /// turn, a closed loop's clients) are put in order, and failed requests (0 output
    /// tokens, their answers' lengths unknown) are left out.
    #[test]
    fn a_requests_csv_replays_in_start_order_without_its_failures() {
        let text = format!(
            "{}\n0,0.5,,,,,,10,4,0,0,,,0,true,\n1,0.2,,,,,,20,5,0,0,,,1,true,\n\
             2,0.3,,,,,,30,0,0,0,,,0,false,\"HTTP 500: a, b\"\n",
            crate::metrics::RequestRecord::CSV_HEADER
        );
        let t = Trace::parse(&text, TraceFormat::Requests, 1.0).unwrap();
        let priorities: Vec<i64> = t.rows.iter().map(|r| r.priority).collect();
        assert_eq!(priorities, [1, 0], "each row's own, in start order");
        let got: Vec<(f64, usize)> = t.rows.iter().map(|r| (r.t_s, r.prompt_tokens)).collect();
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0], (0.0, 20));
        assert!((got[1].0 - 0.3).abs() < 1e-12 && got[1].1 == 10, "{got:?}");
    }

    #[test]
    fn bad_traces_name_the_line_and_the_reason() {
        let bad = |text: &str| {
            Trace::parse(text, TraceFormat::Azure, 1.0)
                .unwrap_err()
                .to_string()
        };
        assert!(bad("").contains("empty"));
        assert!(bad("A,B\n").contains("TIMESTAMP"));
        let h = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
        assert!(bad(h).contains("no requests"));
        assert!(bad(&format!("{h}2023-11-16 18:15:46,x,4\n")).contains("line 2"));
        assert!(bad(&format!("{h}yesterday,3,4\n")).contains("not a time"));
        assert!(bad(&format!("{h}2023-11-16 18:15:46,0,4\n")).contains("at least one"));
        let order = format!("{h}2023-11-16 18:15:46,3,4\n2023-11-16 18:15:40,3,4\n");
        assert!(bad(&order).contains("line 3") && bad(&order).contains("time order"));
    }

    #[test]
    fn timestamps_must_be_real_dates_and_times() {
        let h = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
        for stamp in [
            "2023-11-16 18:15:NaN",
            "2023-11-16 18:15:inf",
            "2023-11-16 18:15:-1",
            "2023-11-16 18:15:60.5",
            "2023-11-16 18:-5:00",
            "2023-11-16 -1:15:00",
            "2023-11-16 24:00:00",
            "2023-02-31 00:00:00",
            "2023-02-29 00:00:00",
            "2023-04-31 00:00:00",
            "99999999999999-01-01 00:00:00",
            "0-01-01 00:00:00",
        ] {
            let text = format!("{h}2023-11-16 18:15:46,3,4\n{stamp},3,4\n");
            let e = Trace::parse(&text, TraceFormat::Azure, 1.0)
                .unwrap_err()
                .to_string();
            assert_eq!(e, format!("line 3: `{stamp}` is not a time"), "{stamp}");
        }
        // A leap day and a leap second are times.
        assert!(timestamp_s("2024-02-29 23:59:60").is_some());
        assert_eq!(
            timestamp_s("2000-03-01 00:00:00").unwrap()
                - timestamp_s("2000-02-28 00:00:00").unwrap(),
            2.0 * 86_400.0
        );
    }
}
