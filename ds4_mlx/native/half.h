/* IEEE half -> float, exactly, as the hardware conversion does it (a NaN comes back quiet).
 * Shared by experts.c and dense.c (the block scales of every GGUF quant type are halves). */

#ifndef DS4N_HALF_H
#define DS4N_HALF_H

#include <stdint.h>
#include <string.h>

static inline float ds4n_half_to_float(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    float out;
    if (exp == 0) {
        out = (float)mant * 5.9604644775390625e-08f; /* mant * 2^-24: exact */
        memcpy(&bits, &out, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13) | (mant ? 0x00400000u : 0);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    memcpy(&out, &bits, 4);
    return out;
}

#endif
