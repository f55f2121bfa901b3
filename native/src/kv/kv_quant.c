/* kv_quant.c — scalar reference of quantization events (see kv_quant.h for the contract).
 * Compiled with -ffp-contract=off: every float operation below is rounded on its own. */
#include "kv/kv_quant.h"

#include "kv/kv_clip.h"

#include <math.h>
#include <string.h>

static uint8_t code_of(float x, float m32, float inv, float levels) {
    const float t = rintf((x - m32) * inv); /* default mode: half to even */
    return (uint8_t)(t < 0.0f ? 0.0f : (t > levels ? levels : t));
}

/* The stored parameters of the range [lo, hi] at `levels` steps (reference/quant.py: _encode),
 * and their float values: fp16 scale and min (param_bits 16), or the 8-bit scale and minimum,
 * the scale widened until its int8 minimum reaches lo (param_bits 8); with sym the scale alone,
 * the minimum implied (lo = -hi). */
typedef struct {
    uint8_t scale[2], min[2]; /* as stored: fp16, or one byte each (sym: min unused) */
    float s, m, inv;          /* decoded; inv = 1/s, or 0 for a zero scale */
} range_enc;

/* The least ufp8 scale >= t (t >= 0), at least 1. */
static uint32_t scale8_of(float t) {
    uint32_t h = ott_fp32_to_fp16_ref(t);
    if (ott_fp16_to_fp32_ref((ott_fp16)h) < t) h++; /* the least fp16 >= t */
    const uint32_t s8 = (h + 127) >> 7;             /* the least ufp8 >= h */
    return s8 == 0 ? 1 : s8;
}

static range_enc encode_range(float lo, float hi, float levels, int32_t param_bits, int32_t sym) {
    range_enc r;
    memset(r.min, 0, sizeof r.min);
    if (sym) {
        const float t = (hi - lo) / levels;
        if (param_bits == 8) {
            r.scale[0] = (uint8_t)scale8_of(t);
            r.s        = ott_kv_scale8(r.scale[0]);
        } else {
            const ott_fp16 s16 = ott_fp32_to_fp16_ref(t);
            memcpy(r.scale, &s16, sizeof s16);
            r.s = ott_fp16_to_fp32_ref(s16);
        }
        r.m = (-0.5f * levels) * r.s; /* ott_kv_sym_min */
    } else if (param_bits == 8) {
        for (uint32_t s8 = scale8_of((hi - lo) / levels);; ++s8) { /* widen until z reaches lo */
            r.s           = ott_kv_scale8((uint8_t)s8);
            const float z = floorf((lo / r.s) * 4.0f);
            if (z >= -128.0f && z <= 127.0f) {
                r.scale[0] = (uint8_t)s8;
                r.min[0]   = (uint8_t)(int8_t)z;
                r.m        = ott_kv_min8((int8_t)z, r.s);
                break;
            }
        }
    } else {
        const ott_fp16 s16 = ott_fp32_to_fp16_ref((hi - lo) / levels), m16 = ott_fp32_to_fp16_ref(lo);
        memcpy(r.scale, &s16, sizeof s16);
        memcpy(r.min, &m16, sizeof m16);
        r.s = ott_fp16_to_fp32_ref(s16);
        r.m = ott_fp16_to_fp32_ref(m16);
    }
    r.inv = r.s != 0.0f ? 1.0f / r.s : 0.0f;
    return r;
}

void ott_quantize_group_ref(const ott_fp16 * x, int64_t stride, int32_t n, int32_t bits, int32_t clip,
                            int32_t param_bits, int32_t sym, uint8_t * codes, uint8_t * scale, uint8_t * min) {
    float xf[8192]; /* the group as float, read once for the range, each candidate and the codes */
    xf[0] = ott_fp16_to_fp32_ref(x[0]);
    for (int32_t i = 1; i < n; ++i) xf[i] = ott_fp16_to_fp32_ref(x[i * stride]);
    float mn = xf[0], mx = mn;
    for (int32_t i = 1; i < n; ++i) {
        mn = xf[i] < mn ? xf[i] : mn;
        mx = xf[i] > mx ? xf[i] : mx;
    }
    if (sym) { /* [-a, a], a = max(-mn, mx) + 0 (no -0) */
        mx = (-mn > mx ? -mn : mx) + 0.0f;
        mn = -mx;
    }
    const float levels = (float)((1 << bits) - 1);
    const float width  = mx - mn;
    int32_t best       = 0;
    double best_err    = 0.0;
    for (int32_t c = 0; clip && c < OTT_CLIP_N; ++c) {
        const float d      = ott_clip_shrink(c) * width;
        const range_enc rc = encode_range(mn + d, mx - d, levels, param_bits, sym);
        double err         = 0.0;
        for (int32_t i = 0; i < n; ++i) {
            const float p = (float)code_of(xf[i], rc.m, rc.inv, levels) * rc.s;
            const float e = (p + rc.m) - xf[i];
            err += (double)e * (double)e;
        }
        if (c == 0 || err < best_err) {
            best     = c;
            best_err = err;
        }
    }
    float lo = mn, hi = mx; /* min-max: exactly mn (also -0) */
    if (clip) {
        const float d = ott_clip_shrink(best) * width;
        lo            = mn + d;
        hi            = mx - d;
    }
    const range_enc r = encode_range(lo, hi, levels, param_bits, sym);
    for (int32_t i = 0; i < n; ++i) codes[i] = code_of(xf[i], r.m, r.inv, levels);
    const size_t pb = param_bits == 8 ? 1 : 2;
    memcpy(scale, r.scale, pb);
    if (!sym) memcpy(min, r.min, pb);
}

void ott_pack_codes_ref(const uint8_t * codes, int32_t n, int32_t bits, uint8_t * out) {
    memset(out, 0, (size_t)(n * bits / 8));
    for (int32_t i = 0; i < n; ++i) {
        const int32_t at = i * bits; /* first bit of code i */
        const uint32_t w = (uint32_t)codes[i] << (at % 8);
        out[at / 8] |= (uint8_t)w;
        if (at % 8 + bits > 8) out[at / 8 + 1] |= (uint8_t)(w >> 8); /* 3 bits: a code may cross a byte */
    }
}

int64_t ott_l1_score_ref(const ott_fp16 * k, int32_t head_dim) {
    int64_t s = 0;
    for (int32_t c = 0; c < head_dim; ++c) {
        const uint32_t e = (k[c] >> 10) & 0x1f, m = k[c] & 0x3ff;
        s += e == 0 ? (int64_t)m : (int64_t)(1024 + m) << (e - 1); /* |k_c| / 2^-24 */
    }
    return s;
}

void ott_select_pool_ref(const int64_t * score, int32_t n_cand, int32_t capacity, uint8_t * keep, int32_t * best) {
    /* best[0 .. n_best-1]: indices of the smallest scores so far, ascending (score, index) */
    int32_t n_best = 0;
    memset(keep, 0, (size_t)n_cand);
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

void ott_substitute_mean_ref(ott_fp16 * x, int32_t n, int32_t head_dim, const uint8_t * masked) {
    int32_t n_other = 0;
    for (int32_t t = 0; t < n; ++t) n_other += masked[t] == 0;
    if (n_other == n) return;
    for (int32_t c = 0; c < head_dim; ++c) {
        int64_t units = 0; /* exact sum, in 2^-24 */
        for (int32_t t = 0; t < n; ++t) {
            if (masked[t]) continue;
            const ott_fp16 h = x[(int64_t)t * head_dim + c];
            const int64_t a  = ott_l1_score_ref(&h, 1);
            units += (h & 0x8000) ? -a : a;
        }
        const double mean  = (double)units * 0x1p-24 / (double)n_other;
        const ott_fp16 m16 = ott_fp32_to_fp16_ref((float)mean);
        for (int32_t t = 0; t < n; ++t) {
            if (masked[t]) x[(int64_t)t * head_dim + c] = m16;
        }
    }
}

/* Per-token groups of x fp16 [block][head_dim]: row t = slot t, groups of `group` channels;
 * parameters [t][g] into scale/mn, codes packed per row into codes_out. */
static void quantize_rows(const ott_kv_geom * g, const ott_fp16 * x, int32_t bits, int32_t group, int32_t sym,
                          uint8_t * scale, uint8_t * mn, uint8_t * codes_out) {
    const int32_t hd = g->head_dim, n_g = hd / group;
    const uint32_t pb = ott_kv_param_bytes(g);
    uint8_t codes[8192]; /* one row: head_dim codes */
    for (int32_t t = 0; t < g->block; ++t) {
        for (int32_t gi = 0; gi < n_g; ++gi) {
            const size_t at = ((size_t)t * n_g + gi) * pb;
            ott_quantize_group_ref(x + (int64_t)t * hd + gi * group, 1, group, bits, g->clip, g->param_bits, sym,
                                   codes + gi * group, scale + at, mn + at);
        }
        ott_pack_codes_ref(codes, hd, bits, codes_out + (size_t)t * hd * bits / 8);
    }
}

/* Key tiers: the channels of keys fp16 [block][head_dim] by descending weight
 * w_c = (f32(max) - f32(min)) times u_c (u = tier_scale, or 1 when NULL), ties by ascending
 * channel (block.py), into order[head_dim]. */
static void rank_channels(const ott_kv_geom * g, const ott_fp16 * k, const float * tier_scale, uint8_t * order) {
    float width[256]; /* w_c */
    for (int32_t c = 0; c < g->head_dim; ++c) {
        float mn = ott_fp16_to_fp32_ref(k[c]), mx = mn;
        for (int32_t t = 1; t < g->block; ++t) {
            const float x = ott_fp16_to_fp32_ref(k[(int64_t)t * g->head_dim + c]);
            mn            = x < mn ? x : mn;
            mx            = x > mx ? x : mx;
        }
        width[c] = mx - mn;
        if (tier_scale) width[c] = width[c] * tier_scale[c];
        int32_t j = c; /* insertion: after every channel of a weight >= this one */
        while (j > 0 && width[order[j - 1]] < width[c]) {
            order[j] = order[j - 1];
            --j;
        }
        order[j] = (uint8_t)c;
    }
}

void ott_quantize_block_ref(const ott_kv_geom * g, const ott_fp16 * k, const ott_fp16 * v, const uint8_t * masked,
                            const float * tier_scale, uint8_t * out) {
    const ott_kv_block_layout L = ott_kv_block_layout_of(g);
    const int32_t hd = g->head_dim, block = g->block;
    const uint32_t pb = ott_kv_param_bytes(g);
    uint8_t codes[8192]; /* one channel: block codes */

    memset(out, 0, L.size);
    if (g->key_axis) {
        /* keys per token, as values: row t = slot t, groups of group_k channels; parameter [t][gk] */
        quantize_rows(g, k, g->bits_k, g->group_k, 0, out + L.k_scale, out + L.k_min, out + L.k_codes);
    } else if (ott_kv_tiered(g)) {
        /* key tiers: row r = the channel of rank r, one group of the block at its tier's width */
        uint8_t * order = out + L.k_order;
        rank_channels(g, k, tier_scale, order);
        for (int32_t r = 0; r < hd; ++r) {
            const int32_t bits = ott_kv_k_row_bits(g, r);
            ott_quantize_group_ref(k + order[r], hd, block, bits, g->clip, g->param_bits, 0, codes,
                                   out + L.k_scale + (size_t)r * pb, out + L.k_min + (size_t)r * pb);
            ott_pack_codes_ref(codes, block, bits, out + L.k_codes + ott_kv_k_row_offset(g, r));
        }
    } else {
        /* keys: row c = channel c, groups of group_k slots; parameter [gk][c] */
        for (int32_t c = 0; c < hd; ++c) {
            for (int32_t gk = 0; gk < block / g->group_k; ++gk) {
                const size_t at = ((size_t)gk * hd + c) * pb;
                ott_quantize_group_ref(k + (int64_t)gk * g->group_k * hd + c, hd, g->group_k, g->bits_k, g->clip,
                                       g->param_bits, 0, codes + gk * g->group_k, out + L.k_scale + at,
                                       out + L.k_min + at);
            }
            ott_pack_codes_ref(codes, block, g->bits_k, out + L.k_codes + (size_t)c * ott_kv_k_row_bytes(g));
        }
    }
    /* values: row t = slot t, groups of group_v channels; parameter [t][gv] */
    quantize_rows(g, v, g->bits_v, g->group_v, g->sym_v, out + L.v_scale, out + L.v_min, out + L.v_codes);
    for (int32_t t = 0; t < block; ++t) {
        if (masked[t]) out[L.mask + t / 8] |= (uint8_t)(1u << (t % 8));
    }
}

size_t ott_kv_event_scratch_bytes(const ott_kv_geom * g, int32_t pool_cap) {
    const size_t n_cand = (size_t)pool_cap + (size_t)g->block;
    return n_cand * sizeof(int64_t)             /* scores      */
           + (size_t)pool_cap * sizeof(int32_t) /* selection   */
           + n_cand;                            /* keep flags  */
}

static void rows_copy(ott_kv_rows * dst, int32_t i, const ott_fp16 * k, const ott_fp16 * v, int32_t pos, int32_t hd) {
    memmove(dst->k + (size_t)i * hd, k, (size_t)hd * sizeof(ott_fp16)); /* may be in place */
    memmove(dst->v + (size_t)i * hd, v, (size_t)hd * sizeof(ott_fp16));
    dst->pos[i] = pos;
}

void ott_kv_event_ref(const ott_kv_geom * g, ott_fp16 * blk_k, ott_fp16 * blk_v, int32_t pos0, ott_kv_rows * pool,
                      ott_kv_rows * extra, int32_t * tracing, const float * tier_scale, uint8_t * out, void * scratch) {
    const int32_t hd = g->head_dim, block = g->block;
    const int32_t n_old = pool->n, n_cand = n_old + block;
    int64_t * score = (int64_t *)scratch;            /* [n_cand] */
    int32_t * best  = (int32_t *)(score + n_cand);   /* [pool->cap] */
    uint8_t * keep  = (uint8_t *)(best + pool->cap); /* [n_cand]; keep + n_old = masked */

    if (*tracing && extra->cap - extra->n < n_old) *tracing = 0; /* the stop rule */
    memset(keep, 0, (size_t)n_cand);
    if (*tracing && pool->cap > 0) {
        for (int32_t i = 0; i < n_old; ++i) score[i] = ott_l1_score_ref(pool->k + (size_t)i * hd, hd);
        for (int32_t t = 0; t < block; ++t) score[n_old + t] = ott_l1_score_ref(blk_k + (size_t)t * hd, hd);
        ott_select_pool_ref(score, n_cand, pool->cap, keep, best);

        /* evicted pool tokens go to the extra pool, kept ones move to the front, in order */
        int32_t n_pool = 0;
        for (int32_t i = 0; i < n_old; ++i) {
            const ott_fp16 *k = pool->k + (size_t)i * hd, *v = pool->v + (size_t)i * hd;
            if (keep[i])
                rows_copy(pool, n_pool++, k, v, pool->pos[i], hd);
            else
                rows_copy(extra, extra->n++, k, v, pool->pos[i], hd);
        }
        for (int32_t t = 0; t < block; ++t) {
            if (keep[n_old + t])
                rows_copy(pool, n_pool++, blk_k + (size_t)t * hd, blk_v + (size_t)t * hd, pos0 + t, hd);
        }
        pool->n = n_pool;
        ott_substitute_mean_ref(blk_k, block, hd, keep + n_old);
        ott_substitute_mean_ref(blk_v, block, hd, keep + n_old);
    }
    ott_quantize_block_ref(g, blk_k, blk_v, keep + n_old, tier_scale, out);
}

size_t ott_kv_recode_scratch_bytes(const ott_kv_geom * rg) {
    return 2 * (size_t)rg->block * rg->head_dim * sizeof(ott_fp16) + (size_t)rg->block;
}

/* Parameter i of an array of fp16 or 8-bit (scale, min) pairs, decoded to double; mn NULL:
 * symmetric groups of `bits`-bit codes. */
static void param_at(const ott_kv_geom * g, const uint8_t * sc, const uint8_t * mn, int32_t bits, size_t i, double * s,
                     double * m) {
    const float s32 = g->param_bits == 8 ? ott_kv_scale8(sc[i]) : ott_fp16_to_fp32_ref(((const ott_fp16 *)sc)[i]);
    *s              = (double)s32;
    if (!mn)
        *m = (double)ott_kv_sym_min(bits, s32);
    else if (g->param_bits == 8)
        *m = (double)ott_kv_min8((int8_t)mn[i], s32);
    else
        *m = (double)ott_fp16_to_fp32_ref(((const ott_fp16 *)mn)[i]);
}

static ott_fp16 decode_code(uint32_t code, double s, double m) {
    return ott_fp32_to_fp16_ref((float)((double)code * s + m));
}

/* Per-token groups of one array of rows (values; keys with key_axis 1): x fp16 [block][head_dim]. */
static void dequant_rows(const ott_kv_geom * g, const uint8_t * sc, const uint8_t * mn, const uint8_t * codes,
                         int32_t bits, int32_t group, ott_fp16 * x) {
    const int32_t hd = g->head_dim, n_g = hd / group;
    const size_t row_bytes = (size_t)hd * bits / 8;
    for (int32_t t = 0; t < g->block; ++t) {
        for (int32_t c = 0; c < hd; ++c) {
            double s, m;
            param_at(g, sc, mn, bits, (size_t)t * n_g + c / group, &s, &m);
            const uint32_t code   = ott_kvq_code_at(codes + t * row_bytes, c, bits, row_bytes);
            x[(size_t)t * hd + c] = decode_code(code, s, m);
        }
    }
}

void ott_kv_recode_ref(const ott_kv_geom * rg, const uint8_t * src, const ott_kv_geom * g, const float * tier_scale,
                       uint8_t * out, void * scratch) {
    const ott_kv_block_layout R = ott_kv_block_layout_of(rg);
    const int32_t hd = rg->head_dim, block = rg->block;
    ott_fp16 * k     = (ott_fp16 *)scratch; /* [block][head_dim] */
    ott_fp16 * v     = k + (size_t)block * hd;
    uint8_t * masked = (uint8_t *)(v + (size_t)block * hd); /* [block] */

    if (rg->key_axis) {
        dequant_rows(rg, src + R.k_scale, src + R.k_min, src + R.k_codes, rg->bits_k, rg->group_k, k);
    } else { /* row c = channel c, groups of group_k slots */
        const size_t row_bytes = (size_t)block * rg->bits_k / 8;
        for (int32_t c = 0; c < hd; ++c) {
            for (int32_t t = 0; t < block; ++t) {
                double s, m;
                param_at(rg, src + R.k_scale, src + R.k_min, rg->bits_k, (size_t)(t / rg->group_k) * hd + c, &s, &m);
                const uint32_t code   = ott_kvq_code_at(src + R.k_codes + c * row_bytes, t, rg->bits_k, row_bytes);
                k[(size_t)t * hd + c] = decode_code(code, s, m);
            }
        }
    }
    dequant_rows(rg, src + R.v_scale, rg->sym_v ? NULL : src + R.v_min, src + R.v_codes, rg->bits_v, rg->group_v, v);
    for (int32_t t = 0; t < block; ++t) masked[t] = (uint8_t)((src[R.mask + t / 8] >> (t % 8)) & 1);
    ott_substitute_mean_ref(k, block, hd, masked); /* nothing masked: unchanged */
    ott_substitute_mean_ref(v, block, hd, masked);
    ott_quantize_block_ref(g, k, v, masked, tier_scale, out);
}
