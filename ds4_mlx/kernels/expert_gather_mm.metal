// Prefill: pairs are sorted by expert and cut into tiles of at most TP pairs of one expert. One
// simdgroup per (tile, output row) dequantizes each 32-element chunk of the row once and uses it for
// every pair of the tile. Tile t covers sorted pairs [tile_start[t], tile_start[t] + tile_count[t]) of
// expert slab tile_slot[t]; sorted pair i reads input row rows[i] of `x` and writes y[i, row].
// Grid (32, N_OUT, n_tiles), threadgroup (32, n, 1).
const uint lane = thread_index_in_simdgroup;
const uint row = thread_position_in_grid.y;
const uint tile = thread_position_in_grid.z;
if (row >= uint(N_OUT)) {
    return;
}
const uint start = uint(tile_start[tile]);
const uint count = uint(tile_count[tile]);
const device uchar* wrow = w + (ulong(tile_slot[tile]) * ulong(N_OUT) + ulong(row)) * ulong(ROW_BYTES);
float wv[32];
float acc[TP];
for (uint i = 0; i < uint(TP); ++i) {
    acc[i] = 0.0f;
}
for (uint sub = lane; sub < uint(N_IN) / 32u; sub += 32u) {
    ds4_deq32(QT, wrow, sub, wv);
    for (uint i = 0; i < uint(TP); ++i) {
        if (i < count) {
            const device float* xs = x + ulong(rows[start + i]) * ulong(N_IN) + 32u * sub;
            float s = 0.0f;
            for (uint l = 0; l < 32u; ++l) {
                s += wv[l] * xs[l];
            }
            acc[i] += s;
        }
    }
}
for (uint i = 0; i < uint(TP); ++i) {
    const float s = simd_sum(acc[i]);
    if (lane == 0 && i < count) {
        y[ulong(start + i) * ulong(N_OUT) + ulong(row)] = s;
    }
}
