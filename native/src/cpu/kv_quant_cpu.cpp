// kv_quant_cpu.cpp — the quantized KV cache in host memory (KIVI, OTT and KVQuant modes, docs/design.md §2–3):
// per layer, sequence and KV head an fp16 sink, quantized head-blocks (kv/kv_layout.h), an
// outlier pool, an extra pool and an fp16 window ring. It executes the core's plan of a step
// (kv/kv_schedule.h): the deferred events in begin(), then in each layer three custom ops
// (cpu/ott_ops_cpu.h): attention partials, their merge, and the appends with their events.
//
// Memory: a sequence's fp16 stores are allocated when it receives its first token and freed
// when it is cleared; its window ring grows for a deferred prefill_fp16 chunk and shrinks
// back once that chunk's events fired; quantized storage grows by one allocation per event
// (the n_head_kv head-blocks of a layer side by side), made in begin() before the graph
// runs; with recent blocks (cfg.recent) a ring of that many allocations in their layout
// holds the newest blocks, and a block's own allocation is made when it leaves the ring.
// Nothing is sized by the context length.
#include "kv/kv_cache.h"
#include "kv/kv_quant.h"
#include "kv/kv_report.h"
#include "cpu/kvq_attn_cpu.h"
#include "cpu/ott_ops_cpu.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int32_t QUERY_TILE  = 32;   // chunk tokens per attention item
constexpr int32_t PART_TOKENS = 512;  // quantized tokens per attention item (whole blocks, at least one)

class kv_quant_cpu final : public ott_kv_cache {
public:
    kv_quant_cpu(const ott_kv_config & cfg, const ott_kv_shape & shape)
        : cfg(cfg), sh(shape), sched(shape.n_seq_max), win_cap(shape.n_seq_max, 0),
          layers((size_t)shape.n_layer * shape.n_seq_max), scratch(OTT_MAX_THREADS) {
        if (cfg.recent) rcfg = cfg.recent_view();
        step.cfg       = &this->cfg;
        step.rcfg      = cfg.recent ? &rcfg : nullptr;
        step.layers    = layers.data();
        step.win_cap   = win_cap.data();
        step.n_seq_max = sh.n_seq_max;
        step.scratch   = &scratch;
        step.layer_ops.resize(sh.n_layer);
        step.taken = std::make_unique<std::atomic<int32_t>[]>(sh.n_layer);
        for (int il = 0; il < sh.n_layer; ++il) step.layer_ops[il] = { &step, il };
        step.rope = nullptr;
        if (cfg.pre_rope) {  // cos and sin of every position a sequence may hold
            rope_cs.resize((size_t)(shape.n_ctx + OTT_ROPE_TILE) * cfg.rope_n_rot);
            float * tile = rope_cs.data() + (size_t)shape.n_ctx * cfg.rope_n_rot;
            ott_rope_table_fill(cfg.rope_n_rot, cfg.rope_freq_base, cfg.rope_freq_scale, shape.n_ctx, rope_cs.data());
            ott_rope_tile_fill(cfg.rope_n_rot, cfg.rope_freq_base, cfg.rope_freq_scale, tile);
            rope      = { cfg.rope_n_rot, cfg.rope_neox, shape.n_ctx, rope_cs.data(), tile };
            step.rope = &rope;
        }
    }

    ~kv_quant_cpu() override {
        for (int32_t s = 0; s < sh.n_seq_max; ++s) release(s);
    }

    ott_status begin(const ott_ubatch & ub) override {
        step.plan = ott_kv_plan_step(cfg, sched, ub);
        for (const ott_kv_step_seq & S : step.plan.seqs) {
            if (win_cap[S.seq] == 0) OTT_TRY(allocate(S.seq));
            OTT_TRY(reserve_blocks(S.seq, S.after.n_blocks));
            // the events a deferred chunk left, in every layer and KV head, then the ring the
            // step needs
            for (int32_t e = S.ev0; e < S.ev0 + S.n_ev && step.plan.events[e].after < 0; ++e) {
                for (int il = 0; il < sh.n_layer; ++il) {
                    for (int32_t h = 0; h < sh.n_head_kv; ++h) {
                        ott_cpu_kv_event(cfg, ls(il, S.seq), il, h, win_cap[S.seq], step.plan.events[e], scratch[0]);
                    }
                }
            }
            sched[S.seq]       = S.before;
            const int32_t need = ott_kv_win_cap(cfg, S.n_win_max);
            if (need != win_cap[S.seq]) set_win_cap(S.seq, need);
        }
        plan_items();
        return OTT_OK;
    }

    void build_inputs(ggml_context *) override {}

    ggml_tensor * build_attn(ggml_context * gctx, ggml_cgraph * gf, int il, ggml_tensor * q, ggml_tensor * k,
                             ggml_tensor * v, float kq_scale) override {
        step.n_head          = (int32_t)q->ne[1];
        step.kq_scale        = kq_scale;
        step.rows_max        = max_q * (step.n_head / sh.n_head_kv);
        ott_kv_layer_op * ud = &step.layer_ops[il];
        const int64_t hd = cfg.geom.head_dim, n_tokens = q->ne[2];

        ggml_tensor * args[3] = { q, k, v };
        ggml_tensor * part =
            ggml_custom_4d(gctx, GGML_TYPE_F32, ott_attn_partial_row((int32_t)hd), step.rows_max,
                           (int64_t)step.items.size(), 1, args, 3, ott_cpu_attn_partial, GGML_N_TASKS_MAX, ud);
        ggml_format_name(part, "kq_partial-%d", il);
        ggml_tensor * out = ggml_custom_4d(gctx, GGML_TYPE_F32, hd * q->ne[1], n_tokens, 1, 1, &part, 1,
                                           ott_cpu_attn_merge, GGML_N_TASKS_MAX, ud);
        ggml_format_name(out, "kqv-%d", il);
        return append(gctx, gf, il, k, v, out);
    }

    bool keys_before_rope(int) const override { return cfg.pre_rope; }

    void set_inputs() override {}

    void commit() override {
        for (const ott_kv_step_seq & S : step.plan.seqs) sched[S.seq] = S.after;
    }

    int32_t seq_len(int32_t seq) const override { return sched[seq].n_tokens; }

    ott_status seq_truncate(int32_t seq, int32_t n_keep) override {
        if (n_keep >= sched[seq].n_tokens) return OTT_OK;
        if (n_keep == 0) {
            release(seq);
            return OTT_OK;
        }
        return sched[seq].truncate(cfg, seq, n_keep);
    }

    ott_status seq_copy(int32_t src, int32_t dst) override {
        release(dst);
        if (win_cap[src] == 0) return OTT_OK;
        try {
            for (int il = 0; il < sh.n_layer; ++il) {
                ott_kv_layer_seq copy = ls(il, src);
                copy.blocks.clear();  // dst gets head-blocks of its own
                copy.recent.clear();
                ls(il, dst) = std::move(copy);
            }
        } catch (const std::bad_alloc &) {
            release(dst);
            return ott_fail(OTT_ERR_ALLOC, "cannot allocate the fp16 stores of sequence %d", dst);
        }
        sched[dst]          = sched[src];
        win_cap[dst]        = win_cap[src];
        const ott_status st = reserve_blocks(dst, sched[src].n_blocks);
        if (st != OTT_OK) {
            release(dst);
            return st;
        }
        const int32_t n_blocks = sched[src].n_blocks;
        for (int il = 0; il < sh.n_layer; ++il) {
            for (int32_t b = 0; b < n_blocks; ++b) {
                const bool recent = cfg.recent && cfg.is_recent(b, n_blocks);
                std::memcpy(ott_kv_event_of(cfg, ls(il, dst), b, n_blocks),
                            ott_kv_event_of(cfg, ls(il, src), b, n_blocks),
                            recent ? cfg.recent_event_bytes() : cfg.event_bytes());
            }
        }
        return OTT_OK;
    }

    int32_t tokens_until_event(int32_t seq) const override { return sched[seq].tokens_until_event(cfg); }

    ott_status export_head(int il, int32_t seq, int32_t h, ott_kv_head_state & out) const override {
        const ott_kv_sched & sc    = sched[seq];
        const ott_kv_layer_seq & L = ls(il, seq);
        const bool allocated       = win_cap[seq] > 0;
        const int32_t hd           = cfg.geom.head_dim;
        const size_t pc = cfg.pool_cap(il), ec = cfg.extra_cap(il);
        ott_kv_export_header(cfg, sc, out);
        out.n_pool  = allocated && pc ? L.n_pool[h] : 0;
        out.n_extra = allocated && ec ? L.n_extra[h] : 0;
        out.tracing = allocated ? L.tracing[h] : (cfg.traces(il) ? 1 : 0);
        if (!allocated) return OTT_OK;

        auto rows = [hd](uint16_t * dst, const std::vector<ott_fp16> & src, size_t first_row, int32_t n) {
            if (dst && n > 0) std::memcpy(dst, src.data() + first_row * hd, (size_t)n * hd * sizeof(ott_fp16));
        };
        const int32_t n_old = out.n_blocks - out.n_recent;
        for (int32_t b = 0; out.blocks && b < n_old; ++b) {
            std::memcpy(out.blocks + (size_t)b * cfg.layout.size, ott_kv_head_block(L.blocks[b], &cfg.layout, h),
                        cfg.layout.size);
        }
        for (int32_t b = n_old; out.recent && b < out.n_blocks; ++b) {
            std::memcpy(out.recent + (size_t)(b - n_old) * cfg.rlayout.size,
                        ott_kv_head_block(L.recent[b % cfg.recent], &cfg.rlayout, h), cfg.rlayout.size);
        }
        rows(out.sink_k, L.sink_k, (size_t)h * cfg.sink, out.n_sink);
        rows(out.sink_v, L.sink_v, (size_t)h * cfg.sink, out.n_sink);
        rows(out.pool_k, L.pool_k, h * pc, out.n_pool);
        rows(out.pool_v, L.pool_v, h * pc, out.n_pool);
        rows(out.extra_k, L.extra_k, h * ec, out.n_extra);
        rows(out.extra_v, L.extra_v, h * ec, out.n_extra);
        for (int32_t i = 0; i < out.n_window; ++i) {  // in position order, from the ring
            const size_t r = (size_t)h * win_cap[seq] + ott_kv_win_row(cfg, win_cap[seq], sc.win_pos0(cfg) + i);
            rows(out.window_k ? out.window_k + (size_t)i * hd : nullptr, L.win_k, r, 1);
            rows(out.window_v ? out.window_v + (size_t)i * hd : nullptr, L.win_v, r, 1);
        }
        if (out.pool_pos && out.n_pool)
            std::memcpy(out.pool_pos, L.pool_pos.data() + h * pc, out.n_pool * sizeof(int32_t));
        if (out.extra_pos && out.n_extra)
            std::memcpy(out.extra_pos, L.extra_pos.data() + h * ec, out.n_extra * sizeof(int32_t));
        return OTT_OK;
    }

    // Used: kv/kv_report.h's accounting; allocated: every byte held.
    ott_kv_stats stats() const override {
        double used      = 0;
        int64_t n_tokens = 0, allocated = 0;
        for (int32_t s = 0; s < sh.n_seq_max; ++s) {
            n_tokens += sched[s].n_tokens;
            if (win_cap[s] == 0) continue;
            for (int il = 0; il < sh.n_layer; ++il) {
                const ott_kv_layer_seq & L = ls(il, s);
                int64_t n_pooled           = 0;
                for (int32_t h = 0; h < sh.n_head_kv && cfg.traces(il); ++h) n_pooled += L.n_pool[h] + L.n_extra[h];
                used += ott_kv_used_bytes(cfg, il, sched[s], n_pooled);
                allocated += (int64_t)L.blocks.size() * (int64_t)cfg.event_bytes() +
                             (int64_t)L.recent.size() * (int64_t)cfg.recent_event_bytes() + store_bytes(L);
            }
        }
        return ott_kv_stats_of(cfg, used, n_tokens, allocated);
    }

private:
    // The append op of layer il, after the attention output `out` (a source, for the order).
    ggml_tensor * append(ggml_context * gctx, ggml_cgraph * gf, int il, ggml_tensor * k, ggml_tensor * v,
                         ggml_tensor * out) {
        ggml_tensor * app_args[3] = { k, v, out };
        ggml_tensor * app         = ggml_custom_4d(gctx, GGML_TYPE_F32, 1, 1, 1, 1, app_args, 3, ott_cpu_kv_append,
                                                   GGML_N_TASKS_MAX, &step.layer_ops[il]);
        ggml_format_name(app, "kv_append-%d", il);
        ggml_build_forward_expand(gf, app);
        return out;
    }

    ott_kv_layer_seq & ls(int il, int32_t s) { return layers[(size_t)il * sh.n_seq_max + s]; }
    const ott_kv_layer_seq & ls(int il, int32_t s) const { return layers[(size_t)il * sh.n_seq_max + s]; }

    static int64_t store_bytes(const ott_kv_layer_seq & L) {
        const size_t f16 = L.sink_k.size() + L.sink_v.size() + L.win_k.size() + L.win_v.size() + L.pool_k.size() +
                           L.pool_v.size() + L.extra_k.size() + L.extra_v.size();
        const size_t i32 =
            L.pool_pos.size() + L.extra_pos.size() + L.n_pool.size() + L.n_extra.size() + L.tracing.size();
        return (int64_t)(f16 * sizeof(ott_fp16) + i32 * sizeof(int32_t));
    }

    ott_status allocate(int32_t s) {
        const size_t hd = cfg.geom.head_dim, n_kv = sh.n_head_kv;
        const int32_t cap = ott_kv_win_cap(cfg, 0);
        try {
            for (int il = 0; il < sh.n_layer; ++il) {
                ott_kv_layer_seq & L = ls(il, s);
                const size_t pc = cfg.pool_cap(il), ec = cfg.extra_cap(il);
                L.sink_k.assign(n_kv * cfg.sink * hd, 0);
                L.sink_v.assign(n_kv * cfg.sink * hd, 0);
                L.win_k.assign(n_kv * cap * hd, 0);
                L.win_v.assign(n_kv * cap * hd, 0);
                L.pool_k.assign(n_kv * pc * hd, 0);
                L.pool_v.assign(n_kv * pc * hd, 0);
                L.pool_pos.assign(n_kv * pc, 0);
                L.extra_k.assign(n_kv * ec * hd, 0);
                L.extra_v.assign(n_kv * ec * hd, 0);
                L.extra_pos.assign(n_kv * ec, 0);
                L.n_pool.assign(n_kv, 0);
                L.n_extra.assign(n_kv, 0);
                L.tracing.assign(n_kv, cfg.traces(il) ? 1 : 0);
            }
        } catch (const std::bad_alloc &) {
            release(s);
            return ott_fail(OTT_ERR_ALLOC, "cannot allocate the fp16 stores of sequence %d", s);
        }
        win_cap[s] = cap;
        return OTT_OK;
    }

    void release(int32_t s) {
        for (int il = 0; il < sh.n_layer; ++il) {
            ott_kv_layer_seq & L = ls(il, s);
            for (uint8_t * p : L.blocks) std::free(p);
            for (uint8_t * p : L.recent) std::free(p);
            L = ott_kv_layer_seq {};
        }
        sched[s]   = ott_kv_sched {};
        win_cap[s] = 0;
    }

    // Re-lay the window rings of sequence s with cap rows per KV head (each window row moves
    // to its position's row in the new ring).
    void set_win_cap(int32_t s, int32_t cap) {
        const ott_kv_sched & sc = sched[s];
        const size_t hd = cfg.geom.head_dim, row_bytes = hd * sizeof(ott_fp16);
        for (int il = 0; il < sh.n_layer; ++il) {
            ott_kv_layer_seq & L = ls(il, s);
            for (std::vector<ott_fp16> * w : { &L.win_k, &L.win_v }) {
                std::vector<ott_fp16> nw((size_t)sh.n_head_kv * cap * hd, 0);
                for (int32_t h = 0; h < sh.n_head_kv; ++h) {
                    for (int32_t p = sc.win_pos0(cfg); p < sc.n_tokens; ++p) {
                        std::memcpy(nw.data() + ((size_t)h * cap + ott_kv_win_row(cfg, cap, p)) * hd,
                                    w->data() + ((size_t)h * win_cap[s] + ott_kv_win_row(cfg, win_cap[s], p)) * hd,
                                    row_bytes);
                    }
                }
                w->swap(nw);
            }
        }
        win_cap[s] = cap;
    }

    // Head-blocks for events up to n_blocks in every layer of sequence s: the recent ring's
    // slots for the newest min(recent, n_blocks), the others' own.
    ott_status reserve_blocks(int32_t s, int32_t n_blocks) {
        const int32_t n_recent = cfg.n_recent(n_blocks);
        for (int il = 0; il < sh.n_layer; ++il) {
            ott_kv_layer_seq & L = ls(il, s);
            OTT_TRY(grow(L.blocks, n_blocks - n_recent, cfg.event_bytes(), s));
            OTT_TRY(grow(L.recent, n_recent, cfg.recent_event_bytes(), s));
        }
        return OTT_OK;
    }

    static ott_status grow(std::vector<uint8_t *> & events, int32_t n, size_t bytes, int32_t s) {
        while ((int32_t)events.size() < n) {
            void * p = std::aligned_alloc(OTT_KV_ALIGN, bytes);
            if (!p)
                return ott_fail(OTT_ERR_ALLOC, "cannot allocate a quantized block of sequence %d (%zu bytes)", s,
                                bytes);
            events.push_back((uint8_t *)p);
        }
        return OTT_OK;
    }

    // Attention items: per sequence, KV head and tile of QUERY_TILE chunk tokens, the
    // quantized blocks split in parts of PART_TOKENS; the last part also reads the fp16
    // stores and the chunk. Items of one query tile are consecutive (one merge group).
    void plan_items() {
        step.items.clear();
        step.groups.clear();
        max_q = 1;
        for (int32_t sq = 0; sq < (int32_t)step.plan.seqs.size(); ++sq) {
            const ott_kv_step_seq & S = step.plan.seqs[sq];
            const int32_t n_blocks    = S.before.n_blocks;
            const int32_t per_part    = std::max(1, PART_TOKENS / cfg.geom.block);
            const int32_t n_parts     = std::max(1, (n_blocks + per_part - 1) / per_part);
            for (int32_t h = 0; h < sh.n_head_kv; ++h) {
                for (int32_t i0 = 0; i0 < S.n_new; i0 += QUERY_TILE) {
                    const int32_t n_q = std::min(QUERY_TILE, S.n_new - i0);
                    max_q             = std::max(max_q, n_q);
                    step.groups.push_back((int32_t)step.items.size());
                    for (int32_t p = 0; p < n_parts; ++p) {
                        const int32_t b0 = std::min(n_blocks, p * per_part);
                        const int32_t b1 = std::min(n_blocks, (p + 1) * per_part);
                        step.items.push_back({ sq, h, i0, n_q, b0, b1, p == n_parts - 1 ? 1 : 0 });
                    }
                }
            }
        }
        step.groups.push_back((int32_t)step.items.size());
        for (int il = 0; il < sh.n_layer; ++il) step.taken[il].store(0, std::memory_order_relaxed);
    }

    ott_kv_config cfg;
    ott_kv_config rcfg;  // cfg as it reads recent blocks (cfg.recent > 0)
    ott_kv_shape sh;
    std::vector<ott_kv_sched> sched;            // [n_seq_max]
    std::vector<int32_t> win_cap;               // [n_seq_max] window ring rows; 0: stores not allocated
    std::vector<ott_kv_layer_seq> layers;       // [n_layer][n_seq_max]
    std::vector<std::vector<uint8_t>> scratch;  // [OTT_MAX_THREADS]
    ott_kv_step step;
    int32_t max_q = 1;           // most chunk tokens of one attention item this step
    std::vector<float> rope_cs;  // keys before RoPE: [2][n_rot/2][n_ctx] cos, sin, then the tiles' angles
    ott_rope_table rope {};
};

}  // namespace

ott_status ott_kv_quant_cpu_create(const ott_kv_config & cfg, const ott_kv_shape & shape,
                                   std::unique_ptr<ott_kv_cache> & out) {
    out = std::make_unique<kv_quant_cpu>(cfg, shape);
    return OTT_OK;
}
