// kvq_ops_cpu.cpp — the KVQuant scheme's attention op in the CPU cache's step (ott_ops_cpu.h).
//
// One work item per (sequence, KV head, tile of chunk tokens): its query rows (the tile's
// tokens times the KV head's query heads) over the head-blocks, then the fp16 rows — sink,
// window in position order, and the chunk's own tokens up to the tile's last, rounded to fp16
// as their appends will store them — each row seeing the chunk's tokens up to its own
// (kvq_attn_cpu.h: n_visible). The item writes its rows of the output itself: it reads every
// store of its KV head, so no partials are merged.
#include "cpu/kvq_attn_cpu.h"
#include "cpu/ott_ops_cpu.h"

#include "kv/kv_quant.h"

#include <cstring>

void ott_cpu_kvq_attn_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ott_kv_layer_op & op = *(const ott_kv_layer_op *)userdata;
    const ott_kv_step & st     = *op.step;
    const ott_kv_config & cfg  = *st.cfg;
    const ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2];
    const int32_t hd = cfg.geom.head_dim, n_rep = st.n_head / cfg.n_head_kv;

    for (size_t it = ith; it < st.items.size(); it += nth) {
        const ott_kv_attn_item & I  = st.items[it];
        const ott_kv_step_seq & S   = st.plan.seqs[I.sq];
        const ott_kv_layer_seq & ls = st.ls(op.il, S.seq);
        const int32_t h = I.head, rows = I.n_q * n_rep;
        const int32_t n_fixed = S.before.n_sink + S.before.n_win, n = n_fixed + I.i0 + I.n_q;

        // per-thread memory: head-block pointers, query and output rows [rows][hd], the
        // attention's scratch, fp16 rows k, v [n][hd], their positions [n], visible [rows]
        const size_t n_att = ott_cpu_kvq_attn_scratch(&cfg.kvq_geom, rows);
        const size_t need  = (size_t)S.before.n_blocks * sizeof(uint8_t *) +
                             (2 * (size_t)rows * hd + n_att) * sizeof(float) + (size_t)n * hd * 2 * sizeof(ott_fp16) +
                             ((size_t)n + rows) * sizeof(int32_t);
        std::vector<uint8_t> & mem = (*st.scratch)[ith];
        if (mem.size() < need) mem.resize(need);
        const uint8_t ** hbs = (const uint8_t **)mem.data();
        float * qr           = (float *)(hbs + S.before.n_blocks);
        float * out          = qr + (size_t)rows * hd;
        float * att          = out + (size_t)rows * hd;
        ott_fp16 * rk        = (ott_fp16 *)(att + n_att);
        ott_fp16 * rv        = rk + (size_t)n * hd;
        int32_t * pos        = (int32_t *)(rv + (size_t)n * hd);
        int32_t * visible    = pos + n;

        // fp16 rows: the sink, the window from its oldest position (the ring wraps once),
        // then the chunk's tokens
        const size_t row_bytes = (size_t)hd * sizeof(ott_fp16);
        for (int32_t i = 0; i < S.before.n_sink; ++i) {
            std::memcpy(rk + (size_t)i * hd, ls.sink_k.data() + ((size_t)h * cfg.sink + i) * hd, row_bytes);
            std::memcpy(rv + (size_t)i * hd, ls.sink_v.data() + ((size_t)h * cfg.sink + i) * hd, row_bytes);
            pos[i] = i;
        }
        const int32_t cap = st.win_cap[S.seq], p0 = S.before.win_pos0(cfg);
        for (int32_t i = 0; i < S.before.n_win; ++i) {
            const size_t r  = (size_t)h * cap + ott_kv_win_row(cfg, cap, p0 + i);
            const size_t at = (size_t)(S.before.n_sink + i) * hd;
            std::memcpy(rk + at, ls.win_k.data() + r * hd, row_bytes);
            std::memcpy(rv + at, ls.win_v.data() + r * hd, row_bytes);
            pos[S.before.n_sink + i] = p0 + i;
        }
        for (int32_t j = 0; j < I.i0 + I.n_q; ++j) {
            const int32_t tok = S.t0 + j;
            const float * kr  = (const float *)((const char *)k->data + (size_t)tok * k->nb[2] + (size_t)h * k->nb[1]);
            const float * vr  = (const float *)((const char *)v->data + (size_t)tok * v->nb[2] + (size_t)h * v->nb[1]);
            ott_fp16 *kd = rk + (size_t)(n_fixed + j) * hd, *vd = rv + (size_t)(n_fixed + j) * hd;
            for (int32_t c = 0; c < hd; ++c) {
                kd[c] = ott_fp32_to_fp16_ref(kr[c]);
                vd[c] = ott_fp32_to_fp16_ref(vr[c]);
            }
            pos[n_fixed + j] = S.before.n_tokens + j;
        }
        for (int32_t b = 0; b < S.before.n_blocks; ++b) hbs[b] = ott_kv_head_block(ls.blocks[b], &cfg.layout, h);

        // row qi*n_rep + r: query of chunk token I.i0 + qi, head h*n_rep + r
        for (int32_t qi = 0; qi < I.n_q; ++qi) {
            for (int32_t r = 0; r < n_rep; ++r) {
                const float * src = (const float *)((const char *)q->data + (size_t)(S.t0 + I.i0 + qi) * q->nb[2] +
                                                    (size_t)(h * n_rep + r) * q->nb[1]);
                std::memcpy(qr + (size_t)(qi * n_rep + r) * hd, src, (size_t)hd * sizeof(float));
                visible[qi * n_rep + r] = n_fixed + I.i0 + qi + 1;
            }
        }
        const ott_kvq_tables tab = cfg.kvq_tables(op.il, h);
        ott_kvq_head_stores hs {};
        hs.n_blocks   = S.before.n_blocks;
        hs.pos0       = S.before.n_sink;
        hs.k          = rk;
        hs.v          = rv;
        hs.pos        = pos;
        hs.n          = n;
        hs.block_list = hbs;
        ott_cpu_kvq_attn(&cfg.kvq_geom, &tab, &hs, st.rope, qr, rows, visible, st.kq_scale, out, att);

        for (int32_t qi = 0; qi < I.n_q; ++qi) {
            float * o = (float *)((char *)dst->data + (size_t)(S.t0 + I.i0 + qi) * dst->nb[1]) + (size_t)h * n_rep * hd;
            std::memcpy(o, out + (size_t)qi * n_rep * hd, (size_t)n_rep * hd * sizeof(float));
        }
    }
}
