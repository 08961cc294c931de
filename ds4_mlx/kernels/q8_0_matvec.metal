// Q8_0 matrix-vector products on the raw GGUF blocks: y[r, row] = sum_i w[row, i] * x[r, i] with
// `w` uint8 [N_OUT, ROW_BYTES] (34-byte blocks) and `x` float32 [R, N_IN]. One simdgroup per
// (input row r, output row); lanes stride over the blocks. Grid (32, N_OUT, R), threadgroup (32, n, 1).
const uint lane = thread_index_in_simdgroup;
const uint row = thread_position_in_grid.y;
const uint r = thread_position_in_grid.z;
if (row >= uint(N_OUT)) {
    return;
}
const device uchar* wrow = w + ulong(row) * ulong(ROW_BYTES);
const device float* xr = x + ulong(r) * ulong(N_IN);
float wv[32];
float acc = 0.0f;
for (uint b = lane; b < uint(N_IN) / 32u; b += 32u) {
    ds4_deq32_q8_0(wrow, b, wv);
    const device float* xs = xr + 32u * b;
    for (uint l = 0; l < 32u; ++l) {
        acc += wv[l] * xs[l];
    }
}
acc = simd_sum(acc);
if (lane == 0) {
    y[ulong(r) * ulong(N_OUT) + ulong(row)] = acc;
}
