//! Markdown tables padded into columns, so they read as well in a terminal as rendered.

/// A table whose first column is a left-aligned label and whose other columns are
/// right-aligned figures, the layout of the benchmark log (or all left-aligned, for text).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Table {
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
    /// Every column left-aligned: a table of descriptions rather than figures.
    pub text: bool,
}

#[derive(Clone, Copy)]
enum Align {
    Left,
    Right,
}

impl Table {
    pub fn new(header: impl IntoIterator<Item = impl Into<String>>) -> Table {
        Table {
            header: header.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
            text: false,
        }
    }

    /// A table of text: every column left-aligned.
    pub fn text(header: impl IntoIterator<Item = impl Into<String>>) -> Table {
        Table {
            text: true,
            ..Table::new(header)
        }
    }

    fn align(&self, column: usize) -> Align {
        match (self.text, column) {
            (true, _) | (_, 0) => Align::Left,
            _ => Align::Right,
        }
    }

    pub fn row(&mut self, cells: impl IntoIterator<Item = impl Into<String>>) {
        self.rows.push(cells.into_iter().map(Into::into).collect());
    }

    /// The cell in the row whose first cell is `label`, under the column headed `column`.
    pub fn cell(&self, label: &str, column: &str) -> Option<&str> {
        let c = self.header.iter().position(|h| h == column)?;
        let row = self
            .rows
            .iter()
            .find(|r| r.first().map(String::as_str) == Some(label))?;
        row.get(c).map(String::as_str)
    }

    pub fn render(&self) -> String {
        let cols = self.header.len();
        let width = |c: usize| {
            std::iter::once(&self.header)
                .chain(&self.rows)
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
                .max(3)
        };
        let widths: Vec<usize> = (0..cols).map(width).collect();
        let line = |cells: &[String]| {
            let padded: Vec<String> = (0..cols)
                .map(|c| {
                    let s = cells.get(c).map_or("", String::as_str);
                    match self.align(c) {
                        Align::Left => format!("{s:<w$}", w = widths[c]),
                        Align::Right => format!("{s:>w$}", w = widths[c]),
                    }
                })
                .collect();
            format!("| {} |\n", padded.join(" | "))
        };
        let rule: Vec<String> = widths
            .iter()
            .enumerate()
            .map(|(c, &w)| match self.align(c) {
                Align::Left => "-".repeat(w + 2),
                Align::Right => format!("{}:", "-".repeat(w + 1)),
            })
            .collect();
        let mut out = line(&self.header);
        out.push_str(&format!("|{}|\n", rule.join("|")));
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_aligned_columns_like_the_log() {
        let mut t = Table::new(["Metric", "Llama", "Qwen3"]);
        t.row(["Throughput (tok/s)", "88.5", "67.4"]);
        t.row(["TTFT P50 (ms)", "86", "93"]);
        let text = t.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "| Metric             | Llama | Qwen3 |");
        assert_eq!(lines[1], "|--------------------|------:|------:|");
        assert_eq!(lines[3], "| TTFT P50 (ms)      |    86 |    93 |");
        assert_eq!(t.cell("TTFT P50 (ms)", "Qwen3"), Some("93"));
    }
}
