//! Which GEMMs of a decode batch run through the skinny GEMM kernel (`gemv.cu`) instead of
//! cuBLAS, decided by timing both on the loaded weights at start.
//!
//! A decode step of a few sequences reads every weight once and does little else, so what
//! matters is how close each GEMM comes to the device's read bandwidth; whether cuBLAS or a
//! skinny kernel of ours comes closer depends on the GPU, the shape and the row count (the
//! issue's "a GEMV path for batches ≤ 8 if cuBLAS is not at bandwidth there"). Rather than
//! guess, the CUDA backend times both over every weight of each shape (a layer's weights in
//! turn, as a step streams them, so L2 does not flatter either) and keeps the skinny kernel
//! only where it was clearly faster.
//!
//! Host-side bookkeeping only, so it is tested without a GPU.

use std::collections::BTreeMap;

/// Rows (decode batch) the skinny kernel is timed and used at: 1..=this. Equal to the
/// kernels' `GEMV_MAX_ROWS` (asserted where the CUDA backend uses both).
pub const MAX_ROWS: usize = 8;

/// The skinny kernel is kept only when it takes at most this share of cuBLAS's time: a
/// margin so that timing noise does not pick a kernel that is no faster.
pub const KEEP_BELOW: f64 = 0.97;

/// Where the backend runs a decode batch's GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GemvMode {
    /// The skinny kernel where it was measured faster at start (the default).
    #[default]
    Measured,
    /// The skinny kernel wherever it applies (tests of its path).
    Always,
    /// cuBLAS everywhere (A/B benchmarks).
    Never,
}

/// One shape and row count timed both ways.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemvTiming {
    /// The weight's `[n, k]`: output columns, inputs.
    pub n: usize,
    pub k: usize,
    pub rows: usize,
    /// Seconds for one pass over every weight of the shape, each way.
    pub cublas_s: f64,
    pub gemv_s: f64,
}

impl GemvTiming {
    pub fn gemv_wins(&self) -> bool {
        self.gemv_s <= KEEP_BELOW * self.cublas_s
    }
}

/// The decision: per weight shape, the row counts that run the skinny kernel.
#[derive(Clone, Debug, Default)]
pub struct GemvChoice {
    timings: Vec<GemvTiming>,
    /// Why nothing was timed, when something went wrong.
    untimed: Option<String>,
    /// Bit `rows - 1` set: the skinny kernel at `rows` rows.
    by_shape: BTreeMap<(usize, usize), u32>,
}

impl GemvChoice {
    pub fn from_timings(timings: Vec<GemvTiming>) -> Self {
        let mut by_shape = BTreeMap::new();
        for t in &timings {
            assert!((1..=MAX_ROWS).contains(&t.rows), "{} rows timed", t.rows);
            let bits: &mut u32 = by_shape.entry((t.n, t.k)).or_default();
            if t.gemv_wins() {
                *bits |= 1 << (t.rows - 1);
            }
        }
        Self {
            timings,
            untimed: None,
            by_shape,
        }
    }

    /// cuBLAS everywhere, because the timing could not run (`why`).
    pub fn untimed(why: String) -> Self {
        Self {
            untimed: Some(why),
            ..Self::default()
        }
    }

    /// Whether `x[rows, k] @ w[n, k]^T` runs the skinny kernel under `mode` (`applies`: the
    /// kernel takes these operands at all).
    pub fn uses_gemv(
        &self,
        mode: GemvMode,
        n: usize,
        k: usize,
        rows: usize,
        applies: bool,
    ) -> bool {
        if !applies || !(1..=MAX_ROWS).contains(&rows) {
            return false;
        }
        match mode {
            GemvMode::Never => false,
            GemvMode::Always => true,
            GemvMode::Measured => self
                .by_shape
                .get(&(n, k))
                .is_some_and(|bits| bits & (1 << (rows - 1)) != 0),
        }
    }

    /// One line for the start-up log: per shape, the row counts the skinny kernel took and
    /// its speed-up over cuBLAS at the first of them.
    pub fn describe(&self) -> String {
        if let Some(why) = &self.untimed {
            return format!("decode GEMMs: cuBLAS ({why})");
        }
        if self.timings.is_empty() {
            return "decode GEMMs: cuBLAS (the skinny kernel was not timed)".into();
        }
        let shapes: Vec<String> = self
            .by_shape
            .iter()
            .map(|(&(n, k), &bits)| {
                let rows: Vec<usize> = (1..=MAX_ROWS)
                    .filter(|r| bits & (1 << (r - 1)) != 0)
                    .collect();
                match rows.first() {
                    None => format!("{n}x{k} cuBLAS"),
                    Some(&first) => {
                        let t = self
                            .timings
                            .iter()
                            .find(|t| (t.n, t.k, t.rows) == (n, k, first))
                            .expect("a chosen row count was timed");
                        format!(
                            "{n}x{k} gemv at rows {} ({:.2}x at {first})",
                            ranges(&rows),
                            t.cublas_s / t.gemv_s
                        )
                    }
                }
            })
            .collect();
        format!("decode GEMMs (timed at start): {}", shapes.join(", "))
    }
}

/// `[1, 2, 3, 5, 7, 8]` as `1-3,5,7-8`.
fn ranges(rows: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < rows.len() {
        let mut j = i;
        while j + 1 < rows.len() && rows[j + 1] == rows[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            rows[i].to_string()
        } else {
            format!("{}-{}", rows[i], rows[j])
        });
        i = j + 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(n: usize, k: usize, rows: usize, cublas_s: f64, gemv_s: f64) -> GemvTiming {
        GemvTiming {
            n,
            k,
            rows,
            cublas_s,
            gemv_s,
        }
    }

    #[test]
    fn the_skinny_kernel_only_where_clearly_faster() {
        let choice = GemvChoice::from_timings(vec![
            timing(2048, 2048, 1, 10.0, 7.0),
            timing(2048, 2048, 2, 10.0, 9.8), // within the margin: cuBLAS
            timing(2048, 2048, 3, 10.0, 9.0),
            timing(2048, 2048, 8, 10.0, 12.0),
            timing(128_256, 2048, 1, 10.0, 11.0),
        ]);
        let measured = |n, k, rows| choice.uses_gemv(GemvMode::Measured, n, k, rows, true);
        assert!(measured(2048, 2048, 1));
        assert!(!measured(2048, 2048, 2));
        assert!(measured(2048, 2048, 3));
        assert!(!measured(2048, 2048, 8));
        assert!(!measured(2048, 2048, 4), "not timed: cuBLAS");
        assert!(!measured(128_256, 2048, 1));
        assert!(!measured(1024, 2048, 1), "a shape never timed");
        assert_eq!(
            choice.describe(),
            "decode GEMMs (timed at start): 2048x2048 gemv at rows 1,3 (1.43x at 1), \
             128256x2048 cuBLAS"
        );
    }

    #[test]
    fn modes_override_the_timings_but_not_what_the_kernel_takes() {
        let choice = GemvChoice::from_timings(vec![timing(64, 64, 1, 1.0, 2.0)]);
        assert!(choice.uses_gemv(GemvMode::Always, 64, 64, 1, true));
        assert!(choice.uses_gemv(GemvMode::Always, 99, 99, 8, true));
        assert!(
            !choice.uses_gemv(GemvMode::Always, 64, 64, 9, true),
            "past MAX_ROWS"
        );
        assert!(!choice.uses_gemv(GemvMode::Always, 64, 64, 0, true));
        assert!(
            !choice.uses_gemv(GemvMode::Always, 64, 64, 1, false),
            "operands it refuses"
        );
        let wins = GemvChoice::from_timings(vec![timing(64, 64, 1, 2.0, 1.0)]);
        assert!(!wins.uses_gemv(GemvMode::Never, 64, 64, 1, true));
        assert!(GemvChoice::default().describe().contains("was not timed"));
        let failed = GemvChoice::untimed("timing failed: out of memory".into());
        assert!(!failed.uses_gemv(GemvMode::Measured, 64, 64, 1, true));
        assert_eq!(
            failed.describe(),
            "decode GEMMs: cuBLAS (timing failed: out of memory)"
        );
    }

    #[test]
    fn row_ranges_read_compactly() {
        assert_eq!(ranges(&[1, 2, 3, 5, 7, 8]), "1-3,5,7-8");
        assert_eq!(ranges(&[4]), "4");
        assert_eq!(ranges(&[1, 2, 3, 4, 5, 6, 7, 8]), "1-8");
    }
}
