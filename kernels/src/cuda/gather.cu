// Row and column copies: token embedding, row gather, column slice. bf16 in and out; a copy is
// exact (the embedding's scale multiply is f32, rounded once).
//
// Bounds: an index outside its table (id outside [0, vocab), idx outside [0, rows)) writes a row
// of zeros and reads nothing. Grid: one block per output row.

// out: [n, hidden]; table: [vocab, hidden]; ids: [n]. out[i] = table[ids[i]] * scale.
extern "C" __global__ void embedding_bf16(
    bf16* __restrict__ out,
    const bf16* __restrict__ table,
    const int* __restrict__ ids,
    int n,
    int hidden,
    int vocab,
    float scale) {
    pdl_begin();
    const int row = blockIdx.x;
    if (row >= n) {
        return;
    }
    const int id = ids[row];
    const long long dst = (long long)row * hidden;
    if (id < 0 || id >= vocab) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            out[dst + i] = 0;
        }
        return;
    }
    const long long src = (long long)id * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        out[dst + i] = f32_to_bf16(bf16_to_f32(table[src + i]) * scale);
    }
}

// out: [n, cols]; x: [rows, cols]; idx: [n]. out[i] = x[idx[i]].
extern "C" __global__ void gather_rows_bf16(
    bf16* __restrict__ out,
    const bf16* __restrict__ x,
    const int* __restrict__ idx,
    int n,
    int cols,
    int rows) {
    pdl_begin();
    const int row = blockIdx.x;
    if (row >= n) {
        return;
    }
    const int r = idx[row];
    const long long dst = (long long)row * cols;
    const bool valid = r >= 0 && r < rows;
    const long long src = (long long)(valid ? r : 0) * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        out[dst + i] = valid ? x[src + i] : (bf16)0;
    }
}

// out: [rows, width]; x: [rows, cols]. out = x[:, col0 .. col0 + width] (splitting a fused
// QKV or gate/up product). The host checks col0 + width <= cols.
extern "C" __global__ void copy_columns_bf16(
    bf16* __restrict__ out,
    const bf16* __restrict__ x,
    int rows,
    int cols,
    int col0,
    int width) {
    pdl_begin();
    const int row = blockIdx.x;
    if (row >= rows) {
        return;
    }
    const long long dst = (long long)row * width;
    const long long src = (long long)row * cols + col0;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        out[dst + i] = x[src + i];
    }
}
