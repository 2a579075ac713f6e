//! Non-negative least squares, for fitting cost-model coefficients to measured step times
//! (a coefficient — seconds per token, per pair — cannot be negative), and the ordinary
//! least-squares line through points.

/// The least-squares line through points: it passes through their mean.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Line {
    pub mean_x: f64,
    pub mean_y: f64,
    /// 0 when the points share one x.
    pub slope: f64,
}

impl Line {
    /// The line through `points` (`None` without any).
    pub fn fit(points: &[(f64, f64)]) -> Option<Line> {
        if points.is_empty() {
            return None;
        }
        let n = points.len() as f64;
        let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
        let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.0 - mean_x).powi(2)).sum();
        let sxy: f64 = points.iter().map(|p| (p.0 - mean_x) * (p.1 - mean_y)).sum();
        Some(Line {
            mean_x,
            mean_y,
            slope: if sxx > 0.0 { sxy / sxx } else { 0.0 },
        })
    }
}

/// Non-negative least squares, min ‖A x − b‖ subject to x ≥ 0 (Lawson and Hanson's
/// active-set method). `a` is row-major, every row of the same length.
pub(crate) fn nnls(a: &[Vec<f64>], b: &[f64]) -> Option<Vec<f64>> {
    let n = a.first().map_or(0, Vec::len);
    let mut x = vec![0.0; n];
    let mut passive = vec![false; n];
    let gradient = |x: &[f64]| -> Vec<f64> {
        let mut g = vec![0.0; n];
        for (row, &bi) in a.iter().zip(b) {
            let r = bi - row.iter().zip(x).map(|(p, q)| p * q).sum::<f64>();
            for j in 0..n {
                g[j] += row[j] * r;
            }
        }
        g
    };
    for _ in 0..3 * n + 10 {
        let g = gradient(&x);
        let Some(j) = (0..n)
            .filter(|&j| !passive[j] && g[j] > 1e-10)
            .max_by(|&p, &q| g[p].total_cmp(&g[q]))
        else {
            break;
        };
        passive[j] = true;
        loop {
            let z = least_squares_on(a, b, &passive)?;
            if (0..n).all(|j| !passive[j] || z[j] > 0.0) {
                x = z;
                break;
            }
            // Step from x towards z as far as feasibility allows, then free the variables
            // that hit zero.
            let alpha = (0..n)
                .filter(|&j| passive[j] && z[j] <= 0.0)
                .map(|j| x[j] / (x[j] - z[j]))
                .fold(f64::INFINITY, f64::min);
            for j in 0..n {
                x[j] += alpha * (z[j] - x[j]);
                if passive[j] && x[j] <= 1e-14 {
                    passive[j] = false;
                    x[j] = 0.0;
                }
            }
        }
    }
    Some(x)
}

/// Unconstrained least squares over the `active` columns (others fixed at 0), by the
/// normal equations with a tiny ridge.
fn least_squares_on(a: &[Vec<f64>], b: &[f64], active: &[bool]) -> Option<Vec<f64>> {
    let cols: Vec<usize> = (0..active.len()).filter(|&j| active[j]).collect();
    let m = cols.len();
    let mut ata = vec![vec![0.0; m]; m];
    let mut atb = vec![0.0; m];
    for (row, &bi) in a.iter().zip(b) {
        for (p, &cp) in cols.iter().enumerate() {
            atb[p] += row[cp] * bi;
            for (q, &cq) in cols.iter().enumerate() {
                ata[p][q] += row[cp] * row[cq];
            }
        }
    }
    for (i, r) in ata.iter_mut().enumerate() {
        r[i] += 1e-12;
    }
    let sol = solve(ata, atb)?;
    let mut x = vec![0.0; active.len()];
    for (p, &c) in cols.iter().enumerate() {
        x[c] = sol[p];
    }
    Some(x)
}

/// Gaussian elimination with partial pivoting.
fn solve(mut a: Vec<Vec<f64>>, mut b: Vec<f64>) -> Option<Vec<f64>> {
    let n = b.len();
    for col in 0..n {
        let pivot = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-15 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..n {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col].clone();
            for (x, p) in a[row][col..].iter_mut().zip(&pivot_row[col..]) {
                *x -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = vec![0.0; n];
    for i in (0..n).rev() {
        let s: f64 = (i + 1..n).map(|k| a[i][k] * x[k]).sum();
        x[i] = (b[i] - s) / a[i][i];
    }
    Some(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovers_an_exact_non_negative_solution() {
        // b = 2·x0 + 0·x1 + 0.5·x2 on rows that determine it.
        let a = vec![
            vec![1.0, 0.0, 0.0],
            vec![0.0, 1.0, 0.0],
            vec![0.0, 0.0, 1.0],
            vec![1.0, 1.0, 1.0],
        ];
        let b = vec![2.0, 0.0, 0.5, 2.5];
        let x = nnls(&a, &b).unwrap();
        for (got, want) in x.iter().zip([2.0, 0.0, 0.5]) {
            assert!((got - want).abs() < 1e-9, "{x:?}");
        }
    }

    #[test]
    fn a_coefficient_the_data_would_make_negative_is_held_at_zero() {
        // Unconstrained, b = 3·x0 − 1·x1 fits exactly; with x ≥ 0 the best is x1 = 0 and
        // x0 the least-squares value over the rows: (1·2 + 2·5) / (1 + 4) = 2.4.
        let a = vec![vec![1.0, 1.0], vec![2.0, 1.0]];
        let b = vec![2.0, 5.0];
        let x = nnls(&a, &b).unwrap();
        assert_eq!(x[1], 0.0, "{x:?}");
        assert!((x[0] - 2.4).abs() < 1e-9, "{x:?}");
    }

    #[test]
    fn a_line_through_points_passes_their_mean() {
        let line = Line::fit(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]).unwrap();
        assert_eq!((line.mean_x, line.mean_y, line.slope), (1.0, 3.0, 2.0));
        assert_eq!(Line::fit(&[(4.0, 1.0), (4.0, 2.0)]).unwrap().slope, 0.0);
        assert_eq!(Line::fit(&[]), None);
    }

    #[test]
    fn gaussian_elimination_pivots_and_refuses_a_singular_system() {
        let x = solve(vec![vec![0.0, 1.0], vec![2.0, 0.0]], vec![3.0, 4.0]).unwrap();
        assert_eq!(x, vec![2.0, 3.0]);
        assert!(solve(vec![vec![1.0, 2.0], vec![2.0, 4.0]], vec![1.0, 2.0]).is_none());
    }
}
