/* fp16_ref.h — IEEE binary16 <-> float32 by integer operations, the conversions of the
 * scalar specification (kv_quant.h): float -> fp16 rounds to nearest even, as numpy and F16C
 * do; NaNs become the quiet NaN 0x7e00 with their sign. One definition for C, C++ and CUDA
 * (the GPU's events and gathers equal the CPU's bit for bit). */
#ifndef OTT_FP16_REF_H
#define OTT_FP16_REF_H

#include "kv/kv_layout.h"

#include <stdint.h>
#include <string.h>

static inline OTT_HD float ott_fp16_to_fp32_ref(ott_fp16 h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exp  = (h >> 10) & 0x1f;
    const uint32_t mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) { /* inf / nan */
        bits = sign | 0x7f800000 | (mant << 13);
    } else if (exp != 0) { /* normal */
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) { /* zero */
        bits = sign;
    } else { /* subnormal: mant * 2^-24, exact in float */
        float f = (float)mant * 0x1p-24f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline OTT_HD ott_fp16 ott_fp32_to_fp16_ref(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax   = x & 0x7fffffff;
    if (ax > 0x7f800000) return (ott_fp16)(sign | 0x7e00);  /* nan */
    if (ax >= 0x477ff000) return (ott_fp16)(sign | 0x7c00); /* >= 65520: inf */
    if (ax >= 0x38800000) {                                 /* fp16 normal */
        uint32_t h          = ((ax >> 23) - 112) << 10 | ((ax >> 13) & 0x3ff);
        const uint32_t rest = ax & 0x1fff;
        if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++; /* carry may raise the exponent */
        return (ott_fp16)(sign | h);
    }
    if (ax <= 0x33000000) return sign; /* <= 2^-25: rounds to 0 */
    /* fp16 subnormal: round(value / 2^-24), value = m * 2^(e-150) */
    const uint32_t m    = (ax & 0x7fffff) | 0x800000;
    const int shift     = 126 - (int)(ax >> 23); /* 14 .. 24 */
    uint32_t h          = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1))) h++;
    return (ott_fp16)(sign | h);
}

#endif
