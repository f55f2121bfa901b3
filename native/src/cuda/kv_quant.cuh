// kv_quant.cuh — device transliterations of the scalar specification in kv/kv_quant.c, line
// by line and under the same names, so that the GPU's quantization events equal the CPU's bit
// for bit (kv/kv_quant.h states the contract). Every float operation is written as the
// round-to-nearest intrinsic of that one operation (no contraction into FMA, whatever the
// compiler flags); kv_event.cu is compiled with -fmad=false as well.
//
// The event (kv_event.cu) builds on these: ott_substitute_mean_ref shares its channels among
// the calling block's threads; ott_pack_codes_ref stores the reference's bytes in fewer memory
// operations; the block's groups are quantized there, by teams of lanes, from these parts.
#pragma once

#include "kv/fp16_ref.h"
#include "kv/kv_clip.h"
#include "kv/kv_layout.h"

#include <stdint.h>

static __device__ uint8_t code_of(float x, float m32, float inv, float levels) {
    const float t = rintf(__fmul_rn(__fsub_rn(x, m32), inv)); /* half to even */
    return (uint8_t)(t < 0.0f ? 0.0f : (t > levels ? levels : t));
}

typedef struct {
    uint8_t scale[2], min[2]; /* as stored: fp16 (low byte first), or one byte each (sym: min unused) */
    float s, m, inv;          /* decoded; inv = 1/s, or 0 for a zero scale */
} range_enc;

/* The least ufp8 scale >= t (t >= 0), at least 1. */
static __device__ uint32_t scale8_of(float t) {
    uint32_t h = ott_fp32_to_fp16_ref(t);
    if (ott_fp16_to_fp32_ref((ott_fp16)h) < t) h++; /* the least fp16 >= t */
    const uint32_t s8 = (h + 127) >> 7;             /* the least ufp8 >= h */
    return s8 == 0 ? 1 : s8;
}

static __device__ range_enc encode_range(float lo, float hi, float levels, int32_t param_bits, int32_t sym) {
    range_enc r;
    r.min[0] = r.min[1] = 0;
    if (sym) {
        const float t = __fdiv_rn(__fsub_rn(hi, lo), levels);
        if (param_bits == 8) {
            r.scale[0] = (uint8_t)scale8_of(t);
            r.s        = ott_kv_scale8(r.scale[0]);
        } else {
            const ott_fp16 s16 = ott_fp32_to_fp16_ref(t);
            r.scale[0]         = (uint8_t)(s16 & 0xff);
            r.scale[1]         = (uint8_t)(s16 >> 8);
            r.s                = ott_fp16_to_fp32_ref(s16);
        }
        r.m = __fmul_rn(__fmul_rn(-0.5f, levels), r.s); /* ott_kv_sym_min */
    } else if (param_bits == 8) {
        for (uint32_t s8 = scale8_of(__fdiv_rn(__fsub_rn(hi, lo), levels));; ++s8) { /* widen until z reaches lo */
            r.s           = ott_kv_scale8((uint8_t)s8);
            const float z = floorf(__fmul_rn(__fdiv_rn(lo, r.s), 4.0f));
            if (z >= -128.0f && z <= 127.0f) {
                r.scale[0] = (uint8_t)s8;
                r.min[0]   = (uint8_t)(int8_t)z;
                r.m        = __fmul_rn(__fmul_rn((float)(int8_t)z, 0.25f), r.s);
                break;
            }
        }
    } else {
        const ott_fp16 s16 = ott_fp32_to_fp16_ref(__fdiv_rn(__fsub_rn(hi, lo), levels));
        const ott_fp16 m16 = ott_fp32_to_fp16_ref(lo);
        r.scale[0]         = (uint8_t)(s16 & 0xff);
        r.scale[1]         = (uint8_t)(s16 >> 8);
        r.min[0]           = (uint8_t)(m16 & 0xff);
        r.min[1]           = (uint8_t)(m16 >> 8);
        r.s                = ott_fp16_to_fp32_ref(s16);
        r.m                = ott_fp16_to_fp32_ref(m16);
    }
    r.inv = r.s != 0.0f ? __fdiv_rn(1.0f, r.s) : 0.0f;
    return r;
}

// Scale and minimum i of a head-block's parameter arrays sc and mn as the reference decodes
// them (kv_layout.h: fp16, or a ufp8 scale and an int8 minimum; mn null: a symmetric group of
// `bits`-bit codes, the minimum implied).
static __device__ __forceinline__ float2 ott_param_ref(const ott_kv_geom & g, const uint8_t * sc, const uint8_t * mn,
                                                       int32_t bits, size_t i) {
    const float s = g.param_bits == 8 ? ott_kv_scale8(sc[i]) : ott_fp16_to_fp32_ref(((const ott_fp16 *)sc)[i]);
    if (!mn) return make_float2(s, ott_kv_sym_min(bits, s));
    return make_float2(s, g.param_bits == 8 ? ott_kv_min8((int8_t)mn[i], s)
                                            : ott_fp16_to_fp32_ref(((const ott_fp16 *)mn)[i]));
}

// An element of a group as the reference reads it: fp16 decoded, float as it is.
static __device__ float ott_value_of(ott_fp16 x) { return ott_fp16_to_fp32_ref(x); }
static __device__ float ott_value_of(float x) { return x; }

// The reference's range of a group, fp16 (stores) or float (decoded groups) elements.
template <class T>
static __device__ void ott_range_ref(const T * x, int64_t stride, int32_t n, float * mn, float * mx) {
    *mn = ott_value_of(x[0]);
    *mx = *mn;
    for (int32_t i = 1; i < n; ++i) {
        const float xi = ott_value_of(x[i * stride]);
        *mn            = xi < *mn ? xi : *mn;
        *mx            = xi > *mx ? xi : *mx;
    }
}

// The reference's bytes (n·bits a multiple of 8), each assembled in a register and stored
// once: OR-ing codes into global memory byte by byte made every event a chain of dependent
// loads and stores.
static __device__ void ott_pack_codes_ref(const uint8_t * codes, int32_t n, int32_t bits, uint8_t * out) {
    uint32_t acc = 0; /* bits not yet stored, LSB first */
    int32_t held = 0, j = 0;
    for (int32_t i = 0; i < n; ++i) {
        acc |= (uint32_t)codes[i] << held;
        for (held += bits; held >= 8; held -= 8, acc >>= 8) out[j++] = (uint8_t)acc;
    }
}

static __device__ int64_t ott_l1_score_ref(const ott_fp16 * k, int32_t head_dim) {
    int64_t s = 0;
    for (int32_t c = 0; c < head_dim; ++c) {
        const uint32_t e = (k[c] >> 10) & 0x1f, m = k[c] & 0x3ff;
        s += e == 0 ? (int64_t)m : (int64_t)(1024 + m) << (e - 1); /* |k_c| / 2^-24 */
    }
    return s;
}

static __device__ void ott_select_pool_ref(const int64_t * score, int32_t n_cand, int32_t capacity, uint8_t * keep,
                                           int32_t * best) {
    /* best[0 .. n_best-1]: indices of the smallest scores so far, ascending (score, index) */
    int32_t n_best = 0;
    for (int32_t i = 0; i < n_cand; ++i) keep[i] = 0;
    if (capacity <= 0) return;
    for (int32_t i = 0; i < n_cand; ++i) {
        if (n_best == capacity && score[i] >= score[best[n_best - 1]]) continue; /* ties: older wins */
        int32_t j = n_best < capacity ? n_best++ : n_best - 1;
        while (j > 0 && score[best[j - 1]] > score[i]) {
            best[j] = best[j - 1];
            --j;
        }
        best[j] = i;
    }
    for (int32_t j = 0; j < n_best; ++j) keep[best[j]] = 1;
}

// Channels shared by the block's threads; every thread must call it.
static __device__ void ott_substitute_mean_ref(ott_fp16 * x, int32_t n, int32_t head_dim, const uint8_t * masked) {
    int32_t n_other = 0;
    for (int32_t t = 0; t < n; ++t) n_other += masked[t] == 0;
    if (n_other == n) return;
    for (int32_t c = threadIdx.x; c < head_dim; c += blockDim.x) {
        int64_t units = 0; /* exact sum, in 2^-24; branch-free, so the loads run ahead */
#pragma unroll 8
        for (int32_t t = 0; t < n; ++t) {
            const ott_fp16 h = x[(int64_t)t * head_dim + c];
            const int64_t a  = ott_l1_score_ref(&h, 1);
            units += masked[t] ? 0 : (h & 0x8000) ? -a : a;
        }
        const double mean  = __ddiv_rn(__dmul_rn((double)units, 0x1p-24), (double)n_other);
        const ott_fp16 m16 = ott_fp32_to_fp16_ref(__double2float_rn(mean));
        for (int32_t t = 0; t < n; ++t) {
            if (masked[t]) x[(int64_t)t * head_dim + c] = m16;
        }
    }
}

// A head-block's groups: one per key row with tiers, else [gk][c]; then the values' [t][gv].
static __host__ __device__ int32_t ott_kv_n_key_groups(const ott_kv_geom * g) {
    return ott_kv_tiered(g) ? g->head_dim : g->head_dim * (int32_t)ott_kv_n_gk(g);
}

static __host__ __device__ int32_t ott_kv_n_groups(const ott_kv_geom * g) {
    return ott_kv_n_key_groups(g) + g->block * (int32_t)ott_kv_n_gv(g);
}
