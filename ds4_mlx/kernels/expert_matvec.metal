// Decode: one simdgroup per (pair, output row). Pair p multiplies expert slab pair_slot[p] of `w`
// (uint8 [u, N_OUT, ROW_BYTES], the selected experts' raw blocks) by input row pair_row[p] of `x`
// (float32 [R, N_IN]) into y[p, row]. Lanes stride over the 32-element chunks of the row.
// Grid (32, N_OUT, P), threadgroup (32, n, 1): x is the lane, so each simdgroup has a single row.
const uint lane = thread_index_in_simdgroup;
const uint row = thread_position_in_grid.y;
const uint p = thread_position_in_grid.z;
if (row >= uint(N_OUT)) {
    return;
}
const device uchar* wrow = w + (ulong(pair_slot[p]) * ulong(N_OUT) + ulong(row)) * ulong(ROW_BYTES);
const device float* xr = x + ulong(pair_row[p]) * ulong(N_IN);
float wv[32];
float acc = 0.0f;
for (uint sub = lane; sub < uint(N_IN) / 32u; sub += 32u) {
    ds4_deq32(QT, wrow, sub, wv);
    const device float* xs = xr + 32u * sub;
    for (uint l = 0; l < 32u; ++l) {
        acc += wv[l] * xs[l];
    }
}
acc = simd_sum(acc);
if (lane == 0) {
    y[ulong(p) * ulong(N_OUT) + ulong(row)] = acc;
}
