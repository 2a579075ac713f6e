//! A run directory's CSV files (`requests.csv`, `timeseries.csv`) as columns: what the
//! reports read from them — a column's values, a row filter, quantiles and means — and
//! nothing more. The files are ours (`infer_core::metrics` writes them): one header line,
//! comma-separated fields, text fields optionally double-quoted.

use crate::error::ReportError;
use infer_core::FileError;
use std::collections::BTreeMap;
use std::path::Path;

/// How a column's cells are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Number,
    Bool,
    Text,
}

#[derive(Debug, Clone, PartialEq)]
enum Column {
    Number(Vec<Option<f64>>),
    Bool(Vec<Option<bool>>),
    Text(Vec<Option<String>>),
}

impl Column {
    fn filter(&self, mask: &[bool]) -> Column {
        fn keep<T: Clone>(v: &[T], mask: &[bool]) -> Vec<T> {
            v.iter()
                .zip(mask)
                .filter(|(_, &m)| m)
                .map(|(x, _)| x.clone())
                .collect()
        }
        match self {
            Column::Number(v) => Column::Number(keep(v, mask)),
            Column::Bool(v) => Column::Bool(keep(v, mask)),
            Column::Text(v) => Column::Text(keep(v, mask)),
        }
    }
}

/// Rows of named columns; an empty cell is a missing value.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Frame {
    height: usize,
    columns: BTreeMap<String, Column>,
}

/// A CSV row (or the header) that does not fit the columns: its 1-based line and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}")]
pub struct BadRow {
    pub line: usize,
    pub reason: String,
}

impl Frame {
    pub fn empty() -> Frame {
        Frame::default()
    }

    /// Reads `path`; columns named in `kinds` are parsed as such (an unparsable cell is an
    /// error naming the line and column), others are kept as text.
    pub fn read_csv(path: &Path, kinds: &[(&str, Kind)]) -> Result<Frame, ReportError> {
        let text = std::fs::read_to_string(path).map_err(FileError::at(path, "read"))?;
        Frame::parse(&text, kinds).map_err(|e| ReportError::Content {
            path: path.to_path_buf(),
            line: Some(e.line),
            reason: e.reason,
        })
    }

    pub fn parse(text: &str, kinds: &[(&str, Kind)]) -> Result<Frame, BadRow> {
        let mut lines = text.lines().enumerate().filter(|(_, l)| !l.is_empty());
        let Some((_, header)) = lines.next() else {
            return Ok(Frame::empty());
        };
        let names = split_fields(header);
        let kind_of = |name: &str| {
            kinds
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(Kind::Text, |k| k.1)
        };
        let mut cells: Vec<Vec<String>> = vec![Vec::new(); names.len()];
        let mut height = 0;
        for (i, line) in lines {
            let fields = split_fields(line);
            if fields.len() != names.len() {
                return Err(BadRow {
                    line: i + 1,
                    reason: format!("{} fields, the header has {}", fields.len(), names.len()),
                });
            }
            for (c, f) in cells.iter_mut().zip(fields) {
                c.push(f);
            }
            height += 1;
        }
        let mut columns = BTreeMap::new();
        for (name, raw) in names.iter().zip(cells) {
            let bad = |row: usize, cell: &str, what: &str| BadRow {
                line: row + 2, // the header is line 1
                reason: format!("column {name}: `{cell}` is not {what}"),
            };
            let column = match kind_of(name) {
                Kind::Number => Column::Number(
                    raw.iter()
                        .enumerate()
                        .map(|(r, s)| match s.as_str() {
                            "" => Ok(None),
                            s => s.parse().map(Some).map_err(|_| bad(r, s, "a number")),
                        })
                        .collect::<Result<_, _>>()?,
                ),
                Kind::Bool => Column::Bool(
                    raw.iter()
                        .enumerate()
                        .map(|(r, s)| match s.as_str() {
                            "" => Ok(None),
                            "true" => Ok(Some(true)),
                            "false" => Ok(Some(false)),
                            s => Err(bad(r, s, "true or false")),
                        })
                        .collect::<Result<_, _>>()?,
                ),
                Kind::Text => Column::Text(
                    raw.into_iter()
                        .map(|s| (!s.is_empty()).then_some(s))
                        .collect(),
                ),
            };
            columns.insert(name.clone(), column);
        }
        Ok(Frame { height, columns })
    }

    pub fn height(&self) -> usize {
        self.height
    }

    /// The present values of a numeric column (empty if there is no such column).
    pub fn values(&self, name: &str) -> Vec<f64> {
        match self.columns.get(name) {
            Some(Column::Number(v)) => v.iter().flatten().copied().collect(),
            _ => Vec::new(),
        }
    }

    /// A boolean column, missing cells as `None`.
    pub fn bools(&self, name: &str) -> Option<&[Option<bool>]> {
        match self.columns.get(name) {
            Some(Column::Bool(v)) => Some(v),
            _ => None,
        }
    }

    /// The rows where `mask` is true; an empty frame if the mask does not fit the rows.
    pub fn filter(&self, mask: &[bool]) -> Frame {
        if mask.len() != self.height {
            return Frame::empty();
        }
        Frame {
            height: mask.iter().filter(|&&m| m).count(),
            columns: self
                .columns
                .iter()
                .map(|(n, c)| (n.clone(), c.filter(mask)))
                .collect(),
        }
    }

    /// A quantile (`q` in 0..=1) of a numeric column by linear interpolation between the
    /// closest ranks: numpy's default and core's definition, so it agrees with summary.json.
    pub fn quantile(&self, name: &str, q: f64) -> Option<f64> {
        let mut v = self.values(name);
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let rank = q * (v.len() - 1) as f64;
        let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
        Some(v[lo] + (v[hi] - v[lo]) * (rank - lo as f64))
    }

    pub fn mean(&self, name: &str) -> Option<f64> {
        let v = self.values(name);
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }
}

/// The fields of one line: split at commas outside double quotes; a quoted field loses its
/// quotes and `""` inside it is one `"`.
fn split_fields(line: &str) -> Vec<String> {
    let mut fields = Vec::new();
    let mut field = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => fields.push(std::mem::take(&mut field)),
            (c, _) => field.push(c),
        }
    }
    fields.push(field);
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: &[(&str, Kind)] = &[
        ("x", Kind::Number),
        ("ok", Kind::Bool),
        ("note", Kind::Text),
    ];

    #[test]
    fn reads_numbers_bools_quoted_text_and_missing_cells() {
        let f = Frame::parse(
            "x,ok,note\n1.5,true,\"a, b\"\n,false,\"say \"\"hi\"\"\"\n3,true,\n",
            KINDS,
        )
        .unwrap();
        assert_eq!(f.height(), 3);
        assert_eq!(f.values("x"), vec![1.5, 3.0]);
        assert_eq!(
            f.bools("ok").unwrap(),
            &[Some(true), Some(false), Some(true)]
        );
        assert_eq!(
            f.columns["note"],
            Column::Text(vec![Some("a, b".into()), Some("say \"hi\"".into()), None])
        );
        let ok: Vec<bool> = f
            .bools("ok")
            .unwrap()
            .iter()
            .map(|b| *b == Some(true))
            .collect();
        let g = f.filter(&ok);
        assert_eq!((g.height(), g.values("x")), (2, vec![1.5, 3.0]));
        assert_eq!(
            f.filter(&[true]),
            Frame::empty(),
            "a mask of the wrong length"
        );
        assert!(f.values("absent").is_empty());
    }

    #[test]
    fn quantiles_interpolate_like_numpy() {
        let f = Frame::parse("x\n4\n1\n3\n2\n", KINDS).unwrap();
        assert_eq!(f.quantile("x", 0.5), Some(2.5));
        assert_eq!(f.quantile("x", 0.9), Some(3.7));
        assert_eq!(f.quantile("x", 0.0), Some(1.0));
        assert_eq!(f.mean("x"), Some(2.5));
        assert_eq!(Frame::empty().quantile("x", 0.5), None);
        assert_eq!(Frame::empty().mean("x"), None);
    }

    #[test]
    fn bad_cells_and_ragged_rows_name_the_line() {
        let e = Frame::parse("x,ok,note\n1,maybe,\n", KINDS).unwrap_err();
        assert_eq!(e.line, 2, "{e}");
        assert!(e.reason.contains("column ok"), "{e}");
        let e = Frame::parse("x,ok,note\n1,true\n", KINDS).unwrap_err();
        assert_eq!(e.line, 2, "{e}");
        assert!(e.to_string().starts_with("line 2: 2 fields"), "{e}");
    }
}
