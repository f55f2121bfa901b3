// kvq_attn_cpu.cpp — attention over KVQuant stores on the CPU (see kvq_attn_cpu.h).
#include "cpu/kvq_attn_cpu.h"
#include "cpu/ott_ops_cpu.h"

#include "kv/kv_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

constexpr int32_t TILE = 64;  // fp16 rows per tile

// Code i of a packed row of row_bytes bytes (LSB-first bit stream, kv_quant.h).
inline uint32_t code_at(const uint8_t * row, int32_t i, int32_t bits, int32_t row_bytes) {
    const int32_t at = i * bits, b = at / 8;
    uint32_t w = row[b];
    if (b + 1 < row_bytes) w |= (uint32_t)row[b + 1] << 8;
    return (w >> (at % 8)) & ((1u << bits) - 1);
}

// Pairs (y[ia(i)], y[ib(i)]) of one row rotated by the angles of cs; a loop per pairing so
// that each vectorises.
template <bool NEOX> inline void rope_row(float * y, int32_t half, const float * cs) {
    for (int32_t i = 0; i < half; ++i) {
        const int32_t ia = NEOX ? i : 2 * i, ib = NEOX ? i + half : 2 * i + 1;
        const float a = y[ia], b = y[ib], c = cs[2 * i], s = cs[2 * i + 1];
        y[ia] = a * c - b * s;
        y[ib] = a * s + b * c;
    }
}

// Rows x [n][head_dim] rotated in place, row r at position pos0 + r (pos == nullptr) or pos[r].
void rope_rows(float * x, int32_t n, int32_t hd, int32_t pos0, const int32_t * pos, const ott_rope_table & R) {
    const int32_t half = R.n_rot / 2;
    for (int32_t r = 0; r < n; ++r) {
        float * y        = x + (size_t)r * hd;
        const float * cs = R.cs + (size_t)(pos ? pos[r] : pos0 + r) * half * 2;
        if (R.neox)
            rope_row<true>(y, half, cs);
        else
            rope_row<false>(y, half, cs);
    }
}

// q · k over hd floats in 8 interleaved partial sums (a fixed order the compiler keeps in
// one vector register), then summed.
inline float dot(const float * q, const float * k, int32_t hd) {
    float part[8] = {};
    int32_t c     = 0;
    for (; c + 8 <= hd; c += 8) {
        for (int32_t j = 0; j < 8; ++j) part[j] += q[c + j] * k[c + j];
    }
    float d = 0.0f;
    for (; c < hd; ++c) d += q[c] * k[c];
    for (float p : part) d += p;
    return d;
}

struct softmax_rows {
    int32_t n_q, hd;
    float * m;    // [n_q] running max
    float * l;    // [n_q] running sum
    float * acc;  // [n_q][hd]
    float * s;    // [TILE or block] scores of one row

    // Fold keys kt and values vt [n][hd] of one tile into every query row; row r takes only
    // its first lim[r] of them (lim NULL: all).
    void add(const float * q, float kq_scale, const float * kt, const float * vt, int32_t n_tile, const int32_t * lim) {
        for (int32_t r = 0; r < n_q; ++r) {
            const int32_t n = lim ? std::min(n_tile, std::max(0, lim[r])) : n_tile;
            if (n == 0) continue;
            const float * qr = q + (size_t)r * hd;
            float mt         = -INFINITY;
            for (int32_t t = 0; t < n; ++t) {
                s[t] = dot(qr, kt + (size_t)t * hd, hd) * kq_scale;
                mt   = std::max(mt, s[t]);
            }
            const float m_new = std::max(m[r], mt);
            const float corr  = std::exp(m[r] - m_new);
            float * a         = acc + (size_t)r * hd;
            for (int32_t c = 0; c < hd; ++c) a[c] *= corr;
            l[r] *= corr;
            for (int32_t t = 0; t < n; ++t) {
                const float p = std::exp(s[t] - m_new);
                l[r] += p;
                const float * vr = vt + (size_t)t * hd;
                for (int32_t c = 0; c < hd; ++c) a[c] += p * vr[c];
            }
            m[r] = m_new;
        }
    }
};

// Dequantize head-block b into kt, vt [block][hd] (keys before RoPE).
void dequantize_block(const ott_kvq_geom & g, const ott_kvq_block_layout & L, const ott_kvq_tables & tab,
                      const uint8_t * b, float * kt, float * vt) {
    const int32_t hd = g.head_dim, block = g.block;
    const int32_t k_row = block * g.bits_k / 8, v_row = hd * g.bits_v / 8;
    for (int32_t c = 0; c < hd; ++c) {
        const uint8_t * row = b + L.k_codes + (size_t)c * k_row;
        for (int32_t t = 0; t < block; ++t) {
            kt[(size_t)t * hd + c] = tab.levels_k[code_at(row, t, g.bits_k, k_row)] * tab.k_scale[c] + tab.k_zero[c];
        }
    }
    for (int32_t t = 0; t < block; ++t) {
        ott_fp16 z16, s16;
        std::memcpy(&z16, b + L.v_zero + 2 * (size_t)t, 2);
        std::memcpy(&s16, b + L.v_scale + 2 * (size_t)t, 2);
        const float z = ott_fp16_to_fp32_ref(z16), s = ott_fp16_to_fp32_ref(s16);
        const uint8_t * row = b + L.v_codes + (size_t)t * v_row;
        for (int32_t c = 0; c < hd; ++c)
            vt[(size_t)t * hd + c] = tab.levels_v[code_at(row, c, g.bits_v, v_row)] * s + z;
    }
    for (int32_t j = 0; j < g.n_out; ++j) {
        uint16_t ik, iv;
        ott_fp16 xk, xv;
        std::memcpy(&ik, b + L.k_out_idx + 2 * (size_t)j, 2);
        std::memcpy(&xk, b + L.k_out_val + 2 * (size_t)j, 2);
        std::memcpy(&iv, b + L.v_out_idx + 2 * (size_t)j, 2);
        std::memcpy(&xv, b + L.v_out_val + 2 * (size_t)j, 2);
        kt[ik] = ott_fp16_to_fp32_ref(xk);
        vt[iv] = ott_fp16_to_fp32_ref(xv);
    }
}

}  // namespace

void ott_rope_table_fill(int32_t n_rot, double freq_base, double freq_scale, int32_t n_pos, float * cs) {
    const int32_t half = n_rot / 2;
    for (int32_t p = 0; p < n_pos; ++p) {
        for (int32_t i = 0; i < half; ++i) {
            const double theta                 = (double)p * freq_scale * std::pow(freq_base, -(double)(2 * i) / n_rot);
            cs[((size_t)p * half + i) * 2]     = (float)std::cos(theta);
            cs[((size_t)p * half + i) * 2 + 1] = (float)std::sin(theta);
        }
    }
}

size_t ott_cpu_kvq_attn_scratch(const ott_kvq_geom * g, int32_t n_q) {
    const size_t rows = (size_t)std::max(g->block, TILE);
    return 2 * rows * g->head_dim + rows + (size_t)n_q * (3 + g->head_dim);
}

OTT_CLONES void ott_cpu_kvq_attn(const ott_kvq_geom * g, const ott_kvq_tables * tab, const ott_kvq_head_stores * st,
                                 const ott_rope_table * rope, const float * q, int32_t n_q, const int32_t * n_visible,
                                 float kq_scale, float * out, float * scratch) {
    const int32_t hd  = g->head_dim;
    const size_t rows = (size_t)std::max(g->block, TILE);
    float *kt = scratch, *vt = kt + rows * hd;
    softmax_rows sm { n_q, hd, vt + rows * hd, nullptr, nullptr, nullptr };
    sm.l          = sm.m + n_q;
    sm.acc        = sm.l + n_q;
    sm.s          = sm.acc + (size_t)n_q * hd;
    int32_t * lim = n_visible ? (int32_t *)(sm.s + rows) : nullptr;  // [n_q] rows left of each tile
    std::fill(sm.m, sm.m + n_q, -INFINITY);
    std::fill(sm.l, sm.l + n_q, 0.0f);
    std::fill(sm.acc, sm.acc + (size_t)n_q * hd, 0.0f);

    const ott_kvq_block_layout L = ott_kvq_block_layout_of(g);
    for (int32_t j = 0; j < st->n_blocks; ++j) {
        const uint8_t * b = st->block_list ? st->block_list[j] : st->blocks + (size_t)j * st->block_stride;
        dequantize_block(*g, L, *tab, b, kt, vt);
        if (rope) rope_rows(kt, g->block, hd, st->pos0 + j * g->block, nullptr, *rope);
        sm.add(q, kq_scale, kt, vt, g->block, nullptr);
    }
    for (int32_t t0 = 0; t0 < st->n; t0 += TILE) {
        const int32_t n = std::min(TILE, st->n - t0);
        for (size_t i = 0; i < (size_t)n * hd; ++i) {
            kt[i] = ott_fp16_to_fp32_ref(st->k[(size_t)t0 * hd + i]);
            vt[i] = ott_fp16_to_fp32_ref(st->v[(size_t)t0 * hd + i]);
        }
        if (rope) rope_rows(kt, n, hd, 0, st->pos + t0, *rope);
        for (int32_t r = 0; lim && r < n_q; ++r) lim[r] = n_visible[r] - t0;
        sm.add(q, kq_scale, kt, vt, n, lim);
    }
    for (int32_t r = 0; r < n_q; ++r) {
        for (int32_t c = 0; c < hd; ++c) out[(size_t)r * hd + c] = sm.acc[(size_t)r * hd + c] / sm.l[r];
    }
}
