// Block decoders shared by the ds4-mlx kernels (header part of every mx.fast.metal_kernel).
//
// Each ds4_deq32_* writes the 32 float32 weights of one 32-element chunk ("sub") of a quantized row,
// with the same float operations, in the same order, as ds4_mlx.formats.quants' dequantizers, so a
// kernel and its MLX-ops twin differ only by the order of the final dot-product sums.
// The loader (metal_kernels.kernel_sources) fills the grid table below with the 256 words of
// ds4_mlx.formats.iq2xxs_tables.

constant ulong ds4_iq2xxs_grid[256] = { @IQ2XXS_GRID@ };

inline float ds4_f16_at(const device uchar* p) {
    return float(as_type<half>(ushort(ushort(p[0]) | (ushort(p[1]) << 8))));
}

// Q8_0: chunk `sub` is block `sub` (34 bytes: f16 d, 32 int8).
inline void ds4_deq32_q8_0(const device uchar* row, uint sub, thread float* w) {
    const device uchar* blk = row + sub * 34u;
    const float d = ds4_f16_at(blk);
    for (uint l = 0; l < 32u; ++l) {
        const uint b = blk[2u + l];
        w[l] = d * float(int(b) - int(b >> 7) * 256);
    }
}

// IQ2_XXS: 66-byte blocks of 256 (f16 d, 8 groups of 8 bytes); chunk = one group of 32.
inline void ds4_deq32_iq2_xxs(const device uchar* row, uint sub, thread float* w) {
    const device uchar* blk = row + (sub >> 3) * 66u;
    const device uchar* grp = blk + 2u + 8u * (sub & 7u);
    const float d = ds4_f16_at(blk);
    const uint aux = uint(grp[4]) | (uint(grp[5]) << 8) | (uint(grp[6]) << 16) | (uint(grp[7]) << 24);
    const float db = d * (0.5f + float(aux >> 28)) * 0.25f;
    for (uint l = 0; l < 4u; ++l) {
        const ulong gv = ds4_iq2xxs_grid[grp[l]];
        const uint s7 = (aux >> (7u * l)) & 127u;
        // the 8th sign bit is implied: it makes the number of minus signs even
        const uint signs = s7 | ((popcount(s7) & 1u) << 7);
        for (uint k = 0; k < 8u; ++k) {
            const float v = db * float(uint((gv >> (8u * k)) & 0xffu));
            w[8u * l + k] = ((signs >> k) & 1u) ? -v : v;
        }
    }
}

// Q2_K: 84-byte blocks of 256 (16 scale bytes, 64 bytes of 2-bit codes, f16 d, f16 dmin).
// Element 128h + 32j + l is bits 2j of qs[32h + l], with scale byte 8h + 2j + l/16.
inline void ds4_deq32_q2_k(const device uchar* row, uint sub, thread float* w) {
    const device uchar* blk = row + (sub >> 3) * 84u;
    const uint c = sub & 7u;
    const uint h = c >> 2;
    const uint j = c & 3u;
    const float d = ds4_f16_at(blk + 80);
    const float dmin = ds4_f16_at(blk + 82);
    const device uchar* qs = blk + 16u + 32u * h;
    for (uint half_idx = 0; half_idx < 2u; ++half_idx) {
        const uint s = blk[8u * h + 2u * j + half_idx];
        const float dl = d * float(s & 15u);
        const float ml = dmin * float(s >> 4);
        for (uint l = 0; l < 16u; ++l) {
            const uint li = 16u * half_idx + l;
            w[li] = dl * float((uint(qs[li]) >> (2u * j)) & 3u) - ml;
        }
    }
}

// Q4_K: 144-byte blocks of 256 (f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles);
// chunk = sub-block b of 32, the low (b even) or high (b odd) nibbles of qs[32 * (b/2) ...].
inline void ds4_deq32_q4_k(const device uchar* row, uint sub, thread float* w) {
    const device uchar* blk = row + (sub >> 3) * 144u;
    const uint b = sub & 7u;
    const float d = ds4_f16_at(blk);
    const float dmin = ds4_f16_at(blk + 2);
    const device uchar* sc = blk + 4;
    uint s;
    uint m;
    if (b < 4u) {
        s = uint(sc[b]) & 63u;
        m = uint(sc[b + 4u]) & 63u;
    } else {
        s = (uint(sc[b + 4u]) & 15u) | ((uint(sc[b - 4u]) >> 6) << 4);
        m = (uint(sc[b + 4u]) >> 4) | ((uint(sc[b]) >> 6) << 4);
    }
    const float ds = d * float(s);
    const float dm = dmin * float(m);
    const device uchar* qs = blk + 16u + 32u * (b >> 1);
    const uint shift = (b & 1u) * 4u;
    for (uint l = 0; l < 32u; ++l) {
        w[l] = ds * float((uint(qs[l]) >> shift) & 15u) - dm;
    }
}

// GGML type ids: Q8_0 = 8, Q2_K = 10, Q4_K = 12, IQ2_XXS = 16 (a template constant, so this folds).
inline void ds4_deq32(int qt, const device uchar* row, uint sub, thread float* w) {
    if (qt == 16) {
        ds4_deq32_iq2_xxs(row, sub, w);
    } else if (qt == 10) {
        ds4_deq32_q2_k(row, sub, w);
    } else if (qt == 12) {
        ds4_deq32_q4_k(row, sub, w);
    } else {
        ds4_deq32_q8_0(row, sub, w);
    }
}
