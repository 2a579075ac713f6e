//! Row and column copies: token embedding, row gather (e.g. the last token of each sequence
//! before the LM head), and column slices of a fused projection (QKV, gate/up).

/// Token embedding: row `i` of `out` (`[ids.len(), hidden]`) is `table[ids[i]] * scale`
/// (`table`: `[vocab, hidden]`). Gemma scales by `sqrt(hidden)` (rounded to bf16 by the caller);
/// others pass 1. An id outside `[0, vocab)` gives a row of zeros.
pub fn embedding(out: &mut [f32], table: &[f32], ids: &[i32], hidden: usize, scale: f32) {
    assert_eq!(out.len(), ids.len() * hidden);
    assert_eq!(table.len() % hidden, 0);
    let vocab = table.len() / hidden;
    for (row, &id) in out.chunks_mut(hidden).zip(ids) {
        match usize::try_from(id).ok().filter(|&id| id < vocab) {
            Some(id) => {
                for (o, &t) in row.iter_mut().zip(&table[id * hidden..][..hidden]) {
                    *o = t * scale;
                }
            }
            None => row.fill(0.0),
        }
    }
}

/// `out[i] = x[idx[i]]` for rows of width `cols`; an index outside `x`'s rows gives zeros.
pub fn gather_rows(out: &mut [f32], x: &[f32], idx: &[i32], cols: usize) {
    embedding(out, x, idx, cols, 1.0)
}

/// `out = x[:, col0 .. col0 + width]`, `x`: `[rows, cols]`, `out`: `[rows, width]`.
pub fn copy_columns(out: &mut [f32], x: &[f32], cols: usize, col0: usize) {
    assert_eq!(x.len() % cols, 0);
    let rows = x.len() / cols;
    if rows == 0 {
        assert!(out.is_empty());
        return;
    }
    assert_eq!(out.len() % rows, 0);
    let width = out.len() / rows;
    assert!(
        col0 + width <= cols,
        "columns {col0}..{} of {cols}",
        col0 + width
    );
    for (r, row) in x.chunks(cols).enumerate() {
        out[r * width..][..width].copy_from_slice(&row[col0..col0 + width]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedding_scales_and_zeroes_bad_ids() {
        let table = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]; // vocab 3, hidden 2
        let mut out = [9.0; 8];
        embedding(&mut out, &table, &[2, -1, 0, 3], 2, 2.0);
        assert_eq!(out, [10.0, 12.0, 0.0, 0.0, 2.0, 4.0, 0.0, 0.0]);
        let mut out = [9.0; 4];
        gather_rows(&mut out, &table, &[1, 1], 2);
        assert_eq!(out, [3.0, 4.0, 3.0, 4.0]);
    }

    #[test]
    fn column_slices() {
        // 2 rows of 5 columns; take columns 1..4.
        let x = [0.0, 1.0, 2.0, 3.0, 4.0, 10.0, 11.0, 12.0, 13.0, 14.0];
        let mut out = [0.0; 6];
        copy_columns(&mut out, &x, 5, 1);
        assert_eq!(out, [1.0, 2.0, 3.0, 11.0, 12.0, 13.0]);
    }
}
