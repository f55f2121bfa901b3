/* kv_kvq.c — scalar reference of a KVQuant quantization event (see kv_kvq.h for the contract).
 * Compiled with -ffp-contract=off: every float operation below is rounded on its own. */
#include "kv/kv_kvq.h"

#include "kv/kv_quant.h"

#include <math.h>
#include <string.h>

void ott_kvq_channel_params_ref(const float * lo, const float * hi, int32_t n, float * zero, float * scale) {
    for (int32_t c = 0; c < n; ++c) {
        zero[c]  = (hi[c] + lo[c]) * 0.5f;
        scale[c] = (hi[c] - lo[c]) * 0.5f;
    }
}

uint8_t ott_kvq_code_ref(float t, const float * levels, int32_t n_levels) {
    uint8_t code = 0;
    for (int32_t j = 0; j + 1 < n_levels; ++j) code += (levels[j] + levels[j + 1]) * 0.5f < t;
    return code;
}

size_t ott_kvq_scratch_bytes(const ott_kvq_geom * g) {
    const size_t n = (size_t)g->block * (size_t)g->head_dim;
    return n * sizeof(float)                                            /* scores, then normalized values */
           + (size_t)g->n_out * sizeof(int32_t)                         /* selection                     */
           + 2 * n                                                      /* sparse flags of keys, values  */
           + (size_t)(g->block > g->head_dim ? g->block : g->head_dim); /* one row of codes */
}

/* flag[i] = 1 for the `count` largest score[i] with exclude[i] == 0 (exclude may be NULL),
 * equal scores by lower index. best: int32 [count]. */
static void select_top(const float * score, const uint8_t * exclude, int32_t n, int32_t count, int32_t * best,
                       uint8_t * flag) {
    int32_t n_best = 0;
    if (count <= 0) return;
    for (int32_t i = 0; i < n; ++i) {
        if (exclude && exclude[i]) continue;
        if (n_best == count && score[i] <= score[best[n_best - 1]]) continue; /* ties: lower index wins */
        int32_t j = n_best < count ? n_best++ : n_best - 1;
        while (j > 0 && score[best[j - 1]] < score[i]) {
            best[j] = best[j - 1];
            --j;
        }
        best[j] = i;
    }
    for (int32_t j = 0; j < n_best; ++j) flag[best[j]] = 1;
}

/* The flagged entries of x [n] in ascending index: indices and values, n_out of them. */
static void write_sparse(const ott_fp16 * x, const uint8_t * flag, int32_t n, uint8_t * idx, uint8_t * val) {
    int32_t m = 0;
    for (int32_t i = 0; i < n; ++i) {
        if (!flag[i]) continue;
        const uint16_t ix = (uint16_t)i;
        memcpy(idx + 2 * m, &ix, 2);
        memcpy(val + 2 * m, &x[i], 2);
        ++m;
    }
}

void ott_kvq_quantize_block_ref(const ott_kvq_geom * g, const ott_kvq_tables * tab, const ott_fp16 * k,
                                const ott_fp16 * v, uint8_t * out, void * scratch) {
    const ott_kvq_block_layout L = ott_kvq_block_layout_of(g);
    const int32_t hd = g->head_dim, block = g->block, n = block * hd;
    const int32_t n_lk = 1 << g->bits_k, n_lv = 1 << g->bits_v;
    float * t       = (float *)scratch;             /* [n] */
    int32_t * best  = (int32_t *)(t + n);           /* [n_out] */
    uint8_t * k_out = (uint8_t *)(best + g->n_out); /* [n] */
    uint8_t * v_out = k_out + n;                    /* [n] */
    uint8_t * codes = v_out + n;                    /* [max(block, head_dim)] */

    memset(out, 0, L.size);
    memset(k_out, 0, 2 * (size_t)n);

    /* keys: normalized by the channel ranges; sparse: the largest |t| */
    for (int32_t i = 0; i < n; ++i) {
        const int32_t c = i % hd;
        const float inv = tab->k_scale[c] != 0.0f ? 1.0f / tab->k_scale[c] : 0.0f;
        t[i]            = (ott_fp16_to_fp32_ref(k[i]) - tab->k_zero[c]) * inv;
    }
    /* codes from t first, then t becomes the score |t| */
    for (int32_t c = 0; c < hd; ++c) {
        for (int32_t s = 0; s < block; ++s) codes[s] = ott_kvq_code_ref(t[s * hd + c], tab->levels_k, n_lk);
        ott_pack_codes_ref(codes, block, g->bits_k, out + L.k_codes + (size_t)c * (size_t)(block * g->bits_k / 8));
    }
    for (int32_t i = 0; i < n; ++i) t[i] = fabsf(t[i]);
    select_top(t, NULL, n, g->n_out, best, k_out);
    write_sparse(k, k_out, n, out + L.k_out_idx, out + L.k_out_val);

    /* values: sparse by value (largest, then smallest of the rest), then per-token ranges */
    for (int32_t i = 0; i < n; ++i) t[i] = ott_fp16_to_fp32_ref(v[i]);
    select_top(t, NULL, n, g->n_out / 2, best, v_out);
    uint8_t * hi = k_out; /* keys' flags are written: reuse */
    memcpy(hi, v_out, (size_t)n);
    for (int32_t i = 0; i < n; ++i) t[i] = -t[i];
    select_top(t, hi, n, g->n_out / 2, best, v_out);
    write_sparse(v, v_out, n, out + L.v_out_idx, out + L.v_out_val);

    for (int32_t s = 0; s < block; ++s) {
        const ott_fp16 * x = v + (size_t)s * hd;
        const uint8_t * sp = v_out + (size_t)s * hd;
        float mn = INFINITY, mx = -INFINITY;
        for (int32_t c = 0; c < hd; ++c) {
            if (sp[c]) continue;
            const float f = ott_fp16_to_fp32_ref(x[c]);
            mn            = f < mn ? f : mn;
            mx            = f > mx ? f : mx;
        }
        if (mn > mx) mn = mx = 0.0f; /* every entry sparse */
        const ott_fp16 z16 = ott_fp32_to_fp16_ref((mx + mn) * 0.5f), s16 = ott_fp32_to_fp16_ref((mx - mn) * 0.5f);
        const float z = ott_fp16_to_fp32_ref(z16), sc = ott_fp16_to_fp32_ref(s16);
        const float inv = sc != 0.0f ? 1.0f / sc : 0.0f;
        for (int32_t c = 0; c < hd; ++c)
            codes[c] = ott_kvq_code_ref((ott_fp16_to_fp32_ref(x[c]) - z) * inv, tab->levels_v, n_lv);
        ott_pack_codes_ref(codes, hd, g->bits_v, out + L.v_codes + (size_t)s * (size_t)(hd * g->bits_v / 8));
        memcpy(out + L.v_zero + 2 * (size_t)s, &z16, 2);
        memcpy(out + L.v_scale + 2 * (size_t)s, &s16, 2);
    }
}
