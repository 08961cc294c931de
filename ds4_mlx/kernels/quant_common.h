// Block decoders and dot products shared by the ds4-mlx kernels, written once for both dialects
// (dialect_metal.h / dialect_cuda.cuh come first and give the DS4_* names their meaning).
//
// Two families:
// * ds4_deq8<QT>: 8 weights of a row, scaled, with the same float operations in the same order as
//   ds4_mlx.formats.quants' dequantizers (bit-exact on the host compile; the prefill tiles use them);
// * ds4_dot32<QT>: one 32-weight chunk dotted with 32 activations held in registers, the block scale
//   applied once per chunk (d * sum(q * x)) and, for the K-quants, the minimum folded in as
//   dmin * m * sum(x) with sum(x) computed once per chunk for all rows ("dmin * sum(x)" trick).
//   These reassociate the twin's float operations, so they agree with it within a stated bound, not bit for bit.
//
// Loads: every block size (34, 66, 84, 144 bytes) and every field offset used here is even, so the
// 2-byte loads below are aligned whenever the row base is (the wrappers hand the kernels fresh MLX
// buffers); nothing wider is assumed, because a 66-byte block gives no 4-byte guarantee. MXFP4's
// 17-byte blocks give no 2-byte guarantee either: its bytes are read one by one.
//
// GGML type ids: Q8_0 = 8, Q2_K = 10, Q4_K = 12, IQ2_XXS = 16, MXFP4 = 39 (template constants, so
// branches fold).
// The loader fills the grid table with the 256 words of ds4_mlx.formats.iq2xxs_tables.

DS4_TABLE ds4_u64 ds4_iq2xxs_grid[256] = { @IQ2XXS_GRID@ };

DS4_FN uint ds4_ld16(const DS4_GLOBAL uchar* p) {
    return uint(*(const DS4_GLOBAL ushort*)p);
}

DS4_FN float ds4_f16_at(const DS4_GLOBAL uchar* p) {
    return ds4_half_bits_to_float(ushort(ds4_ld16(p)));
}

// IQ2_XXS tables in threadgroup memory: the 2 KB grid (read with divergent indices, so it must not stay in
// constant memory) and the 128 sign bytes (7 stored bits + the implied parity bit that makes the number
// of minus signs even). Every thread of the group takes part; the caller puts the barrier after.
DS4_FN void ds4_stage_iq2(DS4_TGP ds4_u64* grid, DS4_TGP uchar* signs, uint tid, uint n_threads) {
    for (uint i = tid; i < 256u; i += n_threads) {
        grid[i] = ds4_iq2xxs_grid[i];
    }
    for (uint i = tid; i < 128u; i += n_threads) {
        signs[i] = uchar(i | ((ds4_popcount(i) & 1u) << 7));
    }
}

// Q4_K: the 6-bit scale and min of 32-element sub-block b (0..7) from the 12 packed bytes at sc,
// returned as scale | (min << 8).
DS4_FN uint ds4_q4k_scale_min(const DS4_GLOBAL uchar* sc, uint b) {
    if (b < 4u) {
        return (uint(sc[b]) & 63u) | ((uint(sc[b + 4u]) & 63u) << 8);
    }
    return ((uint(sc[b + 4u]) & 15u) | ((uint(sc[b - 4u]) >> 6) << 4))
         | (((uint(sc[b + 4u]) >> 4) | ((uint(sc[b]) >> 6) << 4)) << 8);
}

// MXFP4 (ds4_mlx.model.mxfp4): ds4's E8M0 scale (2^-127 for e = 0, +inf for 255) and E2M1 value
// (0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign, so code 8 is -0.0). The magnitudes doubled are the
// nibbles of 0xC8643210: computed, not a table, because the codes index it divergently.
DS4_FN float ds4_e8m0(uint e) {
    return ds4_bits_to_float(e == 0u ? 0x00400000u : e << 23);
}

DS4_FN float ds4_e2m1(uint c) {
    const float v = 0.5f * float((0xC8643210u >> (4u * (c & 7u))) & 15u);
    return (c & 8u) ? -v : v;
}

// ---- scaled decoders: w[e] = weight 8 * part + e of 32-element chunk `sub` of `row` -------------------

template <int QT>
DS4_FN void ds4_deq8(const DS4_GLOBAL uchar* row, uint sub, uint part, DS4_TGP const ds4_u64* grid,
                     DS4_TGP const uchar* signs, DS4_THR float* w) {
    if (QT == 16) {
        const DS4_GLOBAL uchar* blk = row + (sub >> 3) * 66u;
        const DS4_GLOBAL uchar* grp = blk + 2u + 8u * (sub & 7u);
        const float d = ds4_f16_at(blk);
        const uint aux = ds4_ld16(grp + 4) | (ds4_ld16(grp + 6) << 16);
        const float db = d * (0.5f + float(aux >> 28)) * 0.25f;
        const ds4_u64 gv = grid[grp[part]];
        const uint sg = signs[(aux >> (7u * part)) & 127u];
        for (uint k = 0; k < 8u; ++k) {
            const float v = db * float(uint((gv >> (8u * k)) & 0xffu));
            w[k] = ((sg >> k) & 1u) ? -v : v;
        }
    } else if (QT == 10) {
        const DS4_GLOBAL uchar* blk = row + (sub >> 3) * 84u;
        const uint c = sub & 7u;
        const uint h = c >> 2;
        const uint j = c & 3u;
        const float d = ds4_f16_at(blk + 80);
        const float dmin = ds4_f16_at(blk + 82);
        const uint s = blk[8u * h + 2u * j + (part >> 1)];
        const float dl = d * float(s & 15u);
        const float ml = dmin * float(s >> 4);
        const DS4_GLOBAL uchar* qs = blk + 16u + 32u * h + 8u * part;
        for (uint e = 0; e < 8u; e += 2u) {
            const uint q2 = ds4_ld16(qs + e);
            w[e] = dl * float((q2 >> (2u * j)) & 3u) - ml;
            w[e + 1u] = dl * float((q2 >> (8u + 2u * j)) & 3u) - ml;
        }
    } else if (QT == 12) {
        const DS4_GLOBAL uchar* blk = row + (sub >> 3) * 144u;
        const uint b = sub & 7u;
        const float d = ds4_f16_at(blk);
        const float dmin = ds4_f16_at(blk + 2);
        const uint sm = ds4_q4k_scale_min(blk + 4, b);
        const uint s = sm & 63u;
        const uint m = sm >> 8;
        const float ds = d * float(s);
        const float dm = dmin * float(m);
        const DS4_GLOBAL uchar* qs = blk + 16u + 32u * (b >> 1) + 8u * part;
        const uint shift = (b & 1u) * 4u;
        for (uint e = 0; e < 8u; e += 2u) {
            const uint q2 = ds4_ld16(qs + e) >> shift;
            w[e] = ds * float(q2 & 15u) - dm;
            w[e + 1u] = ds * float((q2 >> 8) & 15u) - dm;
        }
    } else if (QT == 39) {
        // weights 8 part .. 8 part + 7: low nibbles of qs[0..16) are weights 0..15, high ones 16..31
        const DS4_GLOBAL uchar* blk = row + sub * 17u;
        const float d = ds4_e8m0(uint(blk[0]));
        const DS4_GLOBAL uchar* qs = blk + 1u + 8u * (part & 1u);
        const uint shift = (part >> 1) * 4u;
        for (uint e = 0; e < 8u; ++e) {
            w[e] = d * ds4_e2m1((uint(qs[e]) >> shift) & 15u);
        }
    } else {
        const DS4_GLOBAL uchar* blk = row + sub * 34u;
        const float d = ds4_f16_at(blk);
        const DS4_GLOBAL uchar* qs = blk + 2u + 8u * part;
        for (uint e = 0; e < 8u; e += 2u) {
            const uint q2 = ds4_ld16(qs + e);
            const uint b0 = q2 & 0xffu;
            const uint b1 = q2 >> 8;
            w[e] = d * float(int(b0) - int(b0 >> 7) * 256);
            w[e + 1u] = d * float(int(b1) - int(b1 >> 7) * 256);
        }
    }
}

// ---- chunk dot products: x[0..32) in registers, xs0 / xs1 = sum of x[0..16) / x[16..32) -------------

template <int QT>
DS4_FN float ds4_dot32(const DS4_GLOBAL uchar* row, uint sub, DS4_THR const float* x, float xs0, float xs1,
                       DS4_TGP const ds4_u64* grid, DS4_TGP const uchar* signs) {
    if (QT == 16) {
        const DS4_GLOBAL uchar* blk = row + (sub >> 3) * 66u;
        const DS4_GLOBAL uchar* grp = blk + 2u + 8u * (sub & 7u);
        const float d = ds4_f16_at(blk);
        const uint idx = ds4_ld16(grp) | (ds4_ld16(grp + 2) << 16);
        const uint aux = ds4_ld16(grp + 4) | (ds4_ld16(grp + 6) << 16);
        float s = 0.0f;
        for (uint l = 0; l < 4u; ++l) {
            const ds4_u64 gv = grid[(idx >> (8u * l)) & 0xffu];
            const uint sg = signs[(aux >> (7u * l)) & 127u];
            for (uint k = 0; k < 8u; ++k) {
                const float g = float(uint((gv >> (8u * k)) & 0xffu));
                s += (((sg >> k) & 1u) ? -g : g) * x[8u * l + k];
            }
        }
        return d * (0.5f + float(aux >> 28)) * 0.25f * s;
    } else if (QT == 10) {
        const DS4_GLOBAL uchar* blk = row + (sub >> 3) * 84u;
        const uint c = sub & 7u;
        const uint h = c >> 2;
        const uint j = c & 3u;
        const float d = ds4_f16_at(blk + 80);
        const float dmin = ds4_f16_at(blk + 82);
        const uint sc = ds4_ld16(blk + 8u * h + 2u * j);  // two scale bytes: halves 0 and 1
        const DS4_GLOBAL uchar* qs = blk + 16u + 32u * h;
        float q0 = 0.0f;
        float q1 = 0.0f;
        for (uint e = 0; e < 16u; e += 2u) {
            const uint a = ds4_ld16(qs + e) >> (2u * j);
            const uint b = ds4_ld16(qs + 16u + e) >> (2u * j);
            q0 += float(a & 3u) * x[e] + float((a >> 8) & 3u) * x[e + 1u];
            q1 += float(b & 3u) * x[16u + e] + float((b >> 8) & 3u) * x[17u + e];
        }
        return d * (float(sc & 15u) * q0 + float((sc >> 8) & 15u) * q1)
             - dmin * (float((sc >> 4) & 15u) * xs0 + float(sc >> 12) * xs1);
    } else if (QT == 12) {
        const DS4_GLOBAL uchar* blk = row + (sub >> 3) * 144u;
        const uint b = sub & 7u;
        const float d = ds4_f16_at(blk);
        const float dmin = ds4_f16_at(blk + 2);
        const uint sm = ds4_q4k_scale_min(blk + 4, b);
        const uint s = sm & 63u;
        const uint m = sm >> 8;
        const DS4_GLOBAL uchar* qs = blk + 16u + 32u * (b >> 1);
        const uint shift = (b & 1u) * 4u;
        float q = 0.0f;
        for (uint e = 0; e < 32u; e += 2u) {
            const uint a = ds4_ld16(qs + e) >> shift;
            q += float(a & 15u) * x[e] + float((a >> 8) & 15u) * x[e + 1u];
        }
        return d * float(s) * q - dmin * float(m) * (xs0 + xs1);
    } else if (QT == 39) {
        const DS4_GLOBAL uchar* blk = row + sub * 17u;
        float q = 0.0f;
        for (uint e = 0; e < 16u; ++e) {
            const uint b = uint(blk[1u + e]);
            q += ds4_e2m1(b & 15u) * x[e] + ds4_e2m1(b >> 4) * x[16u + e];
        }
        return ds4_e8m0(uint(blk[0])) * q;
    } else {
        const DS4_GLOBAL uchar* blk = row + sub * 34u;
        const float d = ds4_f16_at(blk);
        float q = 0.0f;
        for (uint e = 0; e < 32u; e += 2u) {
            const uint a = ds4_ld16(blk + 2u + e);
            const uint b0 = a & 0xffu;
            const uint b1 = a >> 8;
            q += float(int(b0) - int(b0 >> 7) * 256) * x[e] + float(int(b1) - int(b1 >> 7) * 256) * x[e + 1u];
        }
        return d * q;
    }
}

// ---- the decode loop: NR consecutive rows of one or two matrices against one activation row ---------
// Lane `lane` of the SIMD group takes chunks lane, lane + 32, ...; each chunk of x is loaded into registers
// once and used for all NR rows (of both matrices when NMAT == 2, the fused gate+up case). acc[r] (and
// acc[NR + r]) receive this lane's partial sums; rows r >= nvalid are skipped (uniform in the group).

template <int QT, int NR, int NMAT, int N_IN, int ROW_BYTES>
DS4_FN void ds4_matvec_rows(const DS4_GLOBAL uchar* wa, const DS4_GLOBAL uchar* wb, uint nvalid,
                            const DS4_GLOBAL float* xr, uint lane, DS4_TGP const ds4_u64* grid,
                            DS4_TGP const uchar* signs, DS4_THR float* acc) {
    for (uint r = 0; r < uint(NMAT * NR); ++r) {
        acc[r] = 0.0f;
    }
    for (uint sub = lane; sub < uint(N_IN) / 32u; sub += 32u) {
        float xv[32];
        float xs0 = 0.0f;
        float xs1 = 0.0f;
        const DS4_GLOBAL float* xs = xr + 32u * sub;
        for (uint e = 0; e < 16u; ++e) {
            xv[e] = xs[e];
            xv[16u + e] = xs[16u + e];
            xs0 += xv[e];
            xs1 += xv[16u + e];
        }
        for (uint r = 0; r < uint(NR); ++r) {
            if (r < nvalid) {
                acc[r] += ds4_dot32<QT>(wa + ulong(r) * ulong(ROW_BYTES), sub, xv, xs0, xs1, grid, signs);
                if (NMAT == 2) {
                    acc[NR + r] += ds4_dot32<QT>(wb + ulong(r) * ulong(ROW_BYTES), sub, xv, xs0, xs1, grid, signs);
                }
            }
        }
    }
}

// ds4's clamped SwiGLU (ds4_mlx.model.moe): silu(min(g, c)) * clip(u, -c, c), silu through the two-branch
// stable sigmoid.
DS4_FN float ds4_swiglu(float g, float u, float c) {
    const float gc = g < c ? g : c;
    const float e = ds4_exp(-(gc < 0.0f ? -gc : gc));
    const float sig = gc >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
    const float uc = u < -c ? -c : (u > c ? c : u);
    return gc * sig * uc;
}
