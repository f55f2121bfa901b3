// kv_quant.cuh — device transliterations of the scalar specification in kv/kv_quant.c, line
// by line and under the same names, so that the GPU's quantization events equal the CPU's bit
// for bit (kv/kv_quant.h states the contract). Every float operation is written as the
// round-to-nearest intrinsic of that one operation (no contraction into FMA, whatever the
// compiler flags); kv_event.cu is compiled with -fmad=false as well.
//
// Three functions loop over independent channels or slots in the reference; here the threads
// of the calling block share those loops (ott_substitute_mean_ref over channels,
// ott_rank_channels_ref over channels for the weights, ott_quantize_block_ref over channels
// or key rows, then slots). Their bodies are unchanged, but for two: ott_pack_codes_ref
// stores the same bytes in fewer memory operations, and ott_quantize_group_ref's search over
// clipped ranges runs before it, for all groups of the head-block at once (ott_clip_pick: a
// team of 16 lanes per group, lane c trying candidate c, the reference's rule applied to
// the 12 sums in candidate order).
#pragma once

#include "kv/kv_clip.h"
#include "kv/kv_layout.h"

#include <stdint.h>

static __device__ __forceinline__ float ott_fp16_to_fp32_ref(ott_fp16 h) {
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
        const float f = __fmul_rn((float)mant, 0x1p-24f);
        bits          = __float_as_uint(f) | sign;
    }
    return __uint_as_float(bits);
}

static __device__ __forceinline__ ott_fp16 ott_fp32_to_fp16_ref(float f) {
    const uint32_t x    = __float_as_uint(f);
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

static __device__ uint8_t code_of(float x, float m32, float inv, float levels) {
    const float t = rintf(__fmul_rn(__fsub_rn(x, m32), inv)); /* half to even */
    return (uint8_t)(t < 0.0f ? 0.0f : (t > levels ? levels : t));
}

typedef struct {
    uint8_t scale[2], min[2]; /* as stored: fp16 (low byte first), or one byte each */
    float s, m, inv;          /* decoded; inv = 1/s, or 0 for a zero scale */
} range_enc;

static __device__ range_enc encode_range(float lo, float hi, float levels, int32_t param_bits) {
    range_enc r;
    if (param_bits == 8) {
        const float t = __fdiv_rn(__fsub_rn(hi, lo), levels);
        uint32_t h    = ott_fp32_to_fp16_ref(t);
        if (ott_fp16_to_fp32_ref((ott_fp16)h) < t) h++; /* the least fp16 >= t */
        uint32_t s8 = (h + 127) >> 7;                   /* the least ufp8 >= h */
        if (s8 == 0) s8 = 1;
        for (;; ++s8) { /* widen until z reaches lo */
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

static __device__ void ott_range_ref(const ott_fp16 * x, int64_t stride, int32_t n, float * mn, float * mx) {
    *mn = ott_fp16_to_fp32_ref(x[0]);
    *mx = *mn;
    for (int32_t i = 1; i < n; ++i) {
        const float xi = ott_fp16_to_fp32_ref(x[i * stride]);
        *mn            = xi < *mn ? xi : *mn;
        *mx            = xi > *mx ? xi : *mx;
    }
}

// The clipped candidate the reference's search picks for a group (the first of the least
// squared errors). Called by all 32 lanes of a warp alike, two groups to a warp: lanes
// 0..15 and 16..31 are a team, `live` false for a team without a group; lane c of a team
// sums candidate c's error in the reference's order.
static __device__ int32_t ott_clip_pick(const ott_fp16 * x, int64_t stride, int32_t n, int32_t bits, int32_t param_bits,
                                        bool live) {
    const int32_t c = threadIdx.x % 16;
    double err      = 0.0;
    if (live && c < OTT_CLIP_N) {
        float mn, mx;
        ott_range_ref(x, stride, n, &mn, &mx);
        const float levels = (float)((1 << bits) - 1);
        const float d      = __fmul_rn(ott_clip_shrink(c), __fsub_rn(mx, mn));
        const range_enc rc = encode_range(__fadd_rn(mn, d), __fsub_rn(mx, d), levels, param_bits);
        for (int32_t i = 0; i < n; ++i) {
            const float xi = ott_fp16_to_fp32_ref(x[i * stride]);
            const float p  = __fmul_rn((float)code_of(xi, rc.m, rc.inv, levels), rc.s);
            const float e  = __fsub_rn(__fadd_rn(p, rc.m), xi);
            err            = __dadd_rn(err, __dmul_rn((double)e, (double)e));
        }
    }
    int32_t best    = 0;
    double best_err = 0.0;
    for (int32_t j = 0; j < OTT_CLIP_N; ++j) {
        const double e = __shfl_sync(0xffffffffu, err, j, 16);
        if (j == 0 || e < best_err) {
            best     = j;
            best_err = e;
        }
    }
    return best;
}

// `pick`: ott_clip_pick's candidate when `clip`, else unused.
static __device__ void ott_quantize_group_ref(const ott_fp16 * x, int64_t stride, int32_t n, int32_t bits, int32_t clip,
                                              int32_t pick, int32_t param_bits, uint8_t * codes, uint8_t * scale,
                                              uint8_t * min) {
    float mn, mx;
    ott_range_ref(x, stride, n, &mn, &mx);
    const float levels = (float)((1 << bits) - 1);
    const float width  = __fsub_rn(mx, mn);
    float lo = mn, hi = mx; /* min-max: exactly mn (also -0) */
    if (clip) {
        const float d = __fmul_rn(ott_clip_shrink(pick), width);
        lo            = __fadd_rn(mn, d);
        hi            = __fsub_rn(mx, d);
    }
    const range_enc r = encode_range(lo, hi, levels, param_bits);
    for (int32_t i = 0; i < n; ++i) codes[i] = code_of(ott_fp16_to_fp32_ref(x[i * stride]), r.m, r.inv, levels);
    const int32_t pb = param_bits == 8 ? 1 : 2;
    for (int32_t i = 0; i < pb; ++i) {
        scale[i] = r.scale[i];
        min[i]   = r.min[i];
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
        int64_t units = 0; /* exact sum, in 2^-24 */
        for (int32_t t = 0; t < n; ++t) {
            if (masked[t]) continue;
            const ott_fp16 h = x[(int64_t)t * head_dim + c];
            const int64_t a  = ott_l1_score_ref(&h, 1);
            units += (h & 0x8000) ? -a : a;
        }
        const double mean  = __ddiv_rn(__dmul_rn((double)units, 0x1p-24), (double)n_other);
        const ott_fp16 m16 = ott_fp32_to_fp16_ref(__double2float_rn(mean));
        for (int32_t t = 0; t < n; ++t) {
            if (masked[t]) x[(int64_t)t * head_dim + c] = m16;
        }
    }
}

// Key tiers: the weights w_c in parallel, then thread 0 sorts as the reference does (the
// same insertion, so NaN weights land where they land on the CPU). Every thread must call it.
static __device__ void ott_rank_channels_ref(const ott_kv_geom * g, const ott_fp16 * k, const float * tier_scale,
                                             uint8_t * order) {
    __shared__ float width[256]; /* w_c */
    for (int32_t c = threadIdx.x; c < g->head_dim; c += blockDim.x) {
        float mn = ott_fp16_to_fp32_ref(k[c]), mx = mn;
        for (int32_t t = 1; t < g->block; ++t) {
            const float x = ott_fp16_to_fp32_ref(k[(int64_t)t * g->head_dim + c]);
            mn            = x < mn ? x : mn;
            mx            = x > mx ? x : mx;
        }
        width[c] = __fsub_rn(mx, mn);
        if (tier_scale) width[c] = __fmul_rn(width[c], tier_scale[c]);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int32_t c = 0; c < g->head_dim; ++c) {
            int32_t j = c; /* insertion: after every channel of a weight >= this one */
            while (j > 0 && width[order[j - 1]] < width[c]) {
                order[j] = order[j - 1];
                --j;
            }
            order[j] = (uint8_t)c;
        }
    }
    __syncthreads();
}

// A head-block's groups: the key groups (key rows when tiered, else [gk][c]), then the value
// groups [t][gv]; group i of them as ott_quantize_group_ref reads it.
typedef struct {
    const ott_fp16 * x;
    int64_t stride;
    int32_t n, bits;
} ott_group;

static __host__ __device__ int32_t ott_kv_n_key_groups(const ott_kv_geom * g) {
    return ott_kv_tiered(g) ? g->head_dim : g->head_dim * (int32_t)ott_kv_n_gk(g);
}

static __host__ __device__ int32_t ott_kv_n_groups(const ott_kv_geom * g) {
    return ott_kv_n_key_groups(g) + g->block * (int32_t)ott_kv_n_gv(g);
}

static __device__ ott_group ott_group_of(const ott_kv_geom * g, const ott_fp16 * k, const ott_fp16 * v,
                                         const uint8_t * order, int32_t i) {
    const int32_t hd = g->head_dim, n_kg = ott_kv_n_key_groups(g);
    if (i >= n_kg) {
        const int32_t j = i - n_kg, n_gv = (int32_t)ott_kv_n_gv(g);
        return { v + (int64_t)(j / n_gv) * hd + (j % n_gv) * g->group_v, 1, g->group_v, g->bits_v };
    }
    if (ott_kv_tiered(g)) return { k + order[i], hd, g->block, ott_kv_k_row_bits(g, i) };
    return { k + (int64_t)(i / hd) * g->group_k * hd + i % hd, hd, g->group_k, g->bits_k };
}

// Channels, then slots, shared by the block's threads; every thread must call it. codes:
// shared memory of block*head_dim bytes (one unpacked row per thread's channel or slot).
// tier_scale: with key tiers the query scale u [head_dim], or NULL (1).
// picks: shared, uint8 [ott_kv_n_groups(g)] when g->clip (the candidate of every group).
static __device__ void ott_quantize_block_ref(const ott_kv_geom * g, const ott_fp16 * k, const ott_fp16 * v,
                                              const uint8_t * masked, const float * tier_scale, uint8_t * out,
                                              uint8_t * codes, uint8_t * picks) {
    const ott_kv_block_layout L = ott_kv_block_layout_of(g);
    const int32_t hd = g->head_dim, block = g->block;
    const uint32_t pb     = ott_kv_param_bytes(g);
    const uint8_t * order = out + L.k_order;

    for (uint32_t i = threadIdx.x; i < L.size / 4; i += blockDim.x) ((uint32_t *)out)[i] = 0;
    __syncthreads();
    if (ott_kv_tiered(g)) ott_rank_channels_ref(g, k, tier_scale, out + L.k_order);
    const int32_t n_kg = ott_kv_n_key_groups(g), n_gv = (int32_t)ott_kv_n_gv(g);
    if (g->clip) {
        __syncthreads(); /* order is complete */
        const int32_t n_g = ott_kv_n_groups(g), teams = (int32_t)blockDim.x / 16;
        for (int32_t i = threadIdx.x / 16; i < (n_g + teams - 1) / teams * teams; i += teams) {
            const ott_group q = ott_group_of(g, k, v, order, i < n_g ? i : 0);
            const int32_t c   = ott_clip_pick(q.x, q.stride, q.n, q.bits, g->param_bits, i < n_g);
            if (i < n_g && threadIdx.x % 16 == 0) picks[i] = (uint8_t)c;
        }
        __syncthreads();
    }
    auto pick = [&](int32_t i) { return g->clip ? (int32_t)picks[i] : 0; };
    if (ott_kv_tiered(g)) {
        /* key tiers: row r = the channel of rank r, one group of the block at its tier's width */
        for (int32_t r = threadIdx.x; r < hd; r += blockDim.x) {
            const ott_group q = ott_group_of(g, k, v, order, r);
            uint8_t * row     = codes + (size_t)r * block;
            ott_quantize_group_ref(q.x, q.stride, q.n, q.bits, g->clip, pick(r), g->param_bits, row,
                                   out + L.k_scale + (size_t)r * pb, out + L.k_min + (size_t)r * pb);
            ott_pack_codes_ref(row, block, q.bits, out + L.k_codes + ott_kv_k_row_offset(g, r));
        }
    } else {
        /* keys: row c = channel c, groups of group_k slots; parameter [gk][c] */
        for (int32_t c = threadIdx.x; c < hd; c += blockDim.x) {
            uint8_t * row = codes + (size_t)c * block;
            for (int32_t gk = 0; gk < (int32_t)ott_kv_n_gk(g); ++gk) {
                const int32_t i   = gk * hd + c;
                const ott_group q = ott_group_of(g, k, v, order, i);
                ott_quantize_group_ref(q.x, q.stride, q.n, q.bits, g->clip, pick(i), g->param_bits,
                                       row + gk * g->group_k, out + L.k_scale + (size_t)i * pb,
                                       out + L.k_min + (size_t)i * pb);
            }
            ott_pack_codes_ref(row, block, g->bits_k, out + L.k_codes + (size_t)c * ott_kv_k_row_bytes(g));
        }
    }
    __syncthreads();
    /* values: row t = slot t, groups of group_v channels; parameter [t][gv] */
    for (int32_t t = threadIdx.x; t < block; t += blockDim.x) {
        uint8_t * row = codes + (size_t)t * hd;
        for (int32_t gv = 0; gv < n_gv; ++gv) {
            const int32_t j   = t * n_gv + gv; /* the value parameter's index */
            const ott_group q = ott_group_of(g, k, v, order, n_kg + j);
            ott_quantize_group_ref(q.x, q.stride, q.n, q.bits, g->clip, pick(n_kg + j), g->param_bits,
                                   row + gv * g->group_v, out + L.v_scale + (size_t)j * pb,
                                   out + L.v_min + (size_t)j * pb);
        }
        ott_pack_codes_ref(row, hd, g->bits_v, out + L.v_codes + (size_t)t * ott_kv_v_row_bytes(g));
    }
    if (threadIdx.x == 0) {
        for (int32_t t = 0; t < block; ++t) {
            if (masked[t]) out[L.mask + t / 8] |= (uint8_t)(1u << (t % 8));
        }
    }
    __syncthreads();
}
