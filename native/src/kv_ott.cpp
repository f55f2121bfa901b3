// kv_ott.cpp — the quantized KV cache (KIVI and OTT modes, DESIGN §2–3): per layer,
// sequence and KV head an fp16 sink, quantized head-blocks (kv_layout.h), an outlier pool,
// an extra pool and an fp16 window. A step's graph gets, per layer, three custom ops
// (ott_ops_cpu.h): attention partials, their merge, and the append that runs after them.
//
// Memory: a sequence's fp16 stores (sink, window of R+block rows, pools) are allocated
// when it receives its first token and freed when it is cleared; quantized storage grows
// by one allocation per event (the n_head_kv head-blocks of a layer side by side), made
// in begin() before the graph runs. Nothing is sized by the context length.
#include "kv_cache.h"
#include "kv_quant.h"
#include "ott_ops_cpu.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int32_t QUERY_TILE      = 32;   // chunk tokens per attention item
constexpr int32_t BLOCKS_PER_PART = 4;    // quantized blocks per attention item

class kv_ott final : public ott_kv_cache {
public:
    kv_ott(const ott_kv_config & cfg, const ott_kv_shape & shape)
        : cfg(cfg), sh(shape), seqs(shape.n_seq_max), layers((size_t) shape.n_layer * shape.n_seq_max),
          scratch(OTT_MAX_THREADS) {
        step.cfg = &this->cfg;
        step.layers = layers.data();
        step.n_seq_max = sh.n_seq_max;
        step.scratch = &scratch;
        step.layer_ops.resize(sh.n_layer);
        for (int il = 0; il < sh.n_layer; ++il) step.layer_ops[il] = { &step, il };
    }

    ~kv_ott() override {
        for (int32_t s = 0; s < sh.n_seq_max; ++s) release(s);
    }

    ott_status begin(const ott_ubatch & ub) override {
        step.seqs.clear();
        for (const ott_run & r : ub.runs) {
            for (int32_t j = 0; j < r.n_seqs; ++j) {
                const int32_t s = r.seq0 + j;
                if (seqs[s].sched.n_tokens + r.n_tokens > sh.n_ctx) {
                    return ott_fail(OTT_ERR_CONTEXT_FULL, "sequence %d would hold %d tokens, more than the context size %d",
                                    s, seqs[s].sched.n_tokens + r.n_tokens, sh.n_ctx);
                }
            }
        }
        for (const ott_run & r : ub.runs) {
            for (int32_t j = 0; j < r.n_seqs; ++j) {
                const int32_t s = r.seq0 + j;
                seq_state & ss = seqs[s];
                if (!ss.allocated) OTT_TRY(allocate(s));
                const bool defer = cfg.prefill_fp16 && r.n_tokens > 1;
                if (!defer && ss.sched.n_win >= cfg.window + cfg.geom.block) OTT_TRY(flush(s));
                const int32_t need_cap = defer ? std::max(base_win_cap(), ss.sched.n_win + r.n_tokens) : base_win_cap();
                if (ss.win_cap < need_cap) set_win_cap(s, need_cap);
                OTT_TRY(reserve_blocks(s, advance(ss.sched, r.n_tokens, defer).n_blocks));
                step.seqs.push_back({ s, r.t0 + j * r.n_tokens, r.n_tokens, defer ? 1 : 0, ss.win_cap, ss.sched });
            }
        }
        plan_items();
        return OTT_OK;
    }

    void build_inputs(ggml_context *) override {}

    ggml_tensor * build_attn(ggml_context * gctx, ggml_cgraph * gf, int il,
                             ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float kq_scale) override {
        step.n_head = (int32_t) q->ne[1];
        step.kq_scale = kq_scale;
        step.rows_max = max_q * (step.n_head / sh.n_head_kv);
        ott_kv_layer_op * ud = &step.layer_ops[il];
        const int64_t hd = cfg.geom.head_dim, n_tokens = q->ne[2];

        ggml_tensor * args[3] = { q, k, v };
        ggml_tensor * part = ggml_custom_4d(gctx, GGML_TYPE_F32, ott_attn_partial_row((int32_t) hd), step.rows_max,
                                            (int64_t) step.items.size(), 1, args, 3, ott_cpu_attn_partial, GGML_N_TASKS_MAX, ud);
        ggml_format_name(part, "kq_partial-%d", il);
        ggml_tensor * out = ggml_custom_4d(gctx, GGML_TYPE_F32, hd * q->ne[1], n_tokens, 1, 1, &part, 1,
                                           ott_cpu_attn_merge, GGML_N_TASKS_MAX, ud);
        ggml_format_name(out, "kqv-%d", il);
        ggml_tensor * app_args[3] = { k, v, out };   // out as a source: append runs after attention
        ggml_tensor * app = ggml_custom_4d(gctx, GGML_TYPE_F32, 1, 1, 1, 1, app_args, 3, ott_cpu_kv_append, GGML_N_TASKS_MAX, ud);
        ggml_format_name(app, "kv_append-%d", il);
        ggml_build_forward_expand(gf, app);
        return out;
    }

    void set_inputs() override {}

    void commit() override {
        for (const ott_kv_step_seq & S : step.seqs) seqs[S.seq].sched = advance(S.before, S.n_new, S.defer != 0);
    }

    int32_t seq_len(int32_t seq) const override { return seqs[seq].sched.n_tokens; }

    ott_status seq_truncate(int32_t seq, int32_t n_keep) override {
        seq_state & ss = seqs[seq];
        ott_kv_sched & sc = ss.sched;
        if (n_keep >= sc.n_tokens) return OTT_OK;
        if (n_keep == 0) {
            release(seq);
            return OTT_OK;
        }
        return sc.truncate(seq, n_keep, cfg.sink, cfg.geom.block);
    }

    ott_status seq_copy(int32_t src, int32_t dst) override {
        release(dst);
        if (!seqs[src].allocated) return OTT_OK;
        try {
            for (int il = 0; il < sh.n_layer; ++il) {
                ott_kv_layer_seq copy = layers[(size_t) il * sh.n_seq_max + src];
                copy.blocks.clear();                     // dst gets head-blocks of its own
                layers[(size_t) il * sh.n_seq_max + dst] = std::move(copy);
            }
        } catch (const std::bad_alloc &) {
            release(dst);
            return ott_fail(OTT_ERR_ALLOC, "cannot allocate the fp16 stores of sequence %d", dst);
        }
        seqs[dst] = seqs[src];
        const ott_status st = reserve_blocks(dst, seqs[src].sched.n_blocks);
        if (st != OTT_OK) {
            release(dst);
            return st;
        }
        for (int il = 0; il < sh.n_layer; ++il) {
            const ott_kv_layer_seq & from = layers[(size_t) il * sh.n_seq_max + src];
            ott_kv_layer_seq & to = layers[(size_t) il * sh.n_seq_max + dst];
            for (int32_t b = 0; b < seqs[src].sched.n_blocks; ++b) std::memcpy(to.blocks[b], from.blocks[b], cfg.event_bytes());
        }
        return OTT_OK;
    }

    int32_t tokens_until_event(int32_t seq) const override {
        const ott_kv_sched & sc = seqs[seq].sched;
        // a deferred prefill_fp16 window holds R+block or more: its events fire at the next
        // single-token step, before it
        return std::max(1, (cfg.sink - sc.n_sink) + (cfg.window + cfg.geom.block - sc.n_win));
    }

    ott_status export_head(int il, int32_t seq, int32_t h, ott_kv_head_state & out) const override {
        const seq_state & ss = seqs[seq];
        const ott_kv_layer_seq & ls = layers[(size_t) il * sh.n_seq_max + seq];
        const int32_t hd = cfg.geom.head_dim;
        const size_t pc = cfg.pool_cap(il), ec = cfg.extra_cap(il);
        out.n_tokens = ss.sched.n_tokens;
        out.n_sink   = ss.sched.n_sink;
        out.n_blocks = ss.sched.n_blocks;
        out.n_window = ss.sched.n_win;
        out.n_pool   = ss.allocated && pc ? ls.n_pool[h] : 0;
        out.n_extra  = ss.allocated && ec ? ls.n_extra[h] : 0;
        out.tracing  = ss.allocated ? ls.tracing[h] : (cfg.traces(il) ? 1 : 0);
        out.block_bytes = (int32_t) cfg.layout.size;
        const ott_kv_block_layout & L = cfg.layout;
        const uint32_t offs[7] = { L.k_scale, L.k_min, L.v_scale, L.v_min, L.k_codes, L.v_codes, L.mask };
        for (int i = 0; i < 7; ++i) out.block_offsets[i] = (int32_t) offs[i];
        if (!ss.allocated) return OTT_OK;

        auto rows = [hd](uint16_t * dst, const std::vector<ott_fp16> & src, size_t first_row, int32_t n) {
            if (dst && n > 0) std::memcpy(dst, src.data() + first_row * hd, (size_t) n * hd * sizeof(ott_fp16));
        };
        for (int32_t b = 0; out.blocks && b < out.n_blocks; ++b) {
            std::memcpy(out.blocks + (size_t) b * L.size, ls.blocks[b] + (size_t) h * L.size, L.size);
        }
        rows(out.sink_k, ls.sink_k, (size_t) h * cfg.sink, out.n_sink);
        rows(out.sink_v, ls.sink_v, (size_t) h * cfg.sink, out.n_sink);
        rows(out.pool_k, ls.pool_k, h * pc, out.n_pool);
        rows(out.pool_v, ls.pool_v, h * pc, out.n_pool);
        rows(out.extra_k, ls.extra_k, h * ec, out.n_extra);
        rows(out.extra_v, ls.extra_v, h * ec, out.n_extra);
        rows(out.window_k, ls.win_k, (size_t) h * ss.win_cap, out.n_window);
        rows(out.window_v, ls.win_v, (size_t) h * ss.win_cap, out.n_window);
        if (out.pool_pos && out.n_pool) std::memcpy(out.pool_pos, ls.pool_pos.data() + h * pc, out.n_pool * sizeof(int32_t));
        if (out.extra_pos && out.n_extra) std::memcpy(out.extra_pos, ls.extra_pos.data() + h * ec, out.n_extra * sizeof(int32_t));
        return OTT_OK;
    }

    // Accounting of reference/footprint.py: codes, scales and mins of every block (masks in
    // tracing layers), sink, pools with positions and window; allocation: every byte held.
    ott_kv_stats stats() const override {
        ott_kv_stats st{};
        const int32_t hd = cfg.geom.head_dim;
        const int64_t token = 2 * (int64_t) hd * sizeof(ott_fp16);
        double used = 0;
        for (int32_t s = 0; s < sh.n_seq_max; ++s) {
            const seq_state & ss = seqs[s];
            st.n_tokens += ss.sched.n_tokens;
            if (!ss.allocated) continue;
            for (int il = 0; il < sh.n_layer; ++il) {
                const ott_kv_layer_seq & ls = layers[(size_t) il * sh.n_seq_max + s];
                const int64_t blocks = (int64_t) ss.sched.n_blocks * ott_kv_block_data_bytes(&cfg.geom, cfg.traces(il));
                used += (double) sh.n_head_kv * (blocks + (int64_t) (ss.sched.n_sink + ss.sched.n_win) * token);
                for (int32_t h = 0; h < sh.n_head_kv && cfg.traces(il); ++h) {
                    used += (double) (ls.n_pool[h] + ls.n_extra[h]) * (token + (int64_t) sizeof(int32_t));
                }
                st.bytes_allocated += (int64_t) ls.blocks.size() * (int64_t) cfg.event_bytes() + store_bytes(ls);
            }
        }
        st.bytes_used = (int64_t) used;
        if (st.n_tokens > 0) {
            st.bytes_per_token_layer = used / ((double) st.n_tokens * sh.n_layer);
            st.bits_per_element = 8.0 * used / ((double) st.n_tokens * sh.n_layer * sh.n_head_kv * 2 * hd);
        }
        return st;
    }

private:
    struct seq_state {
        ott_kv_sched sched;
        int32_t win_cap   = 0;        // window rows per KV head
        bool    allocated = false;    // fp16 stores exist
    };

    int32_t base_win_cap() const { return cfg.window + cfg.geom.block; }

    // The schedule after appending n tokens (events fire unless deferred).
    ott_kv_sched advance(ott_kv_sched sc, int32_t n, bool defer) const {
        const int32_t to_sink = std::min(n, cfg.sink - sc.n_sink);
        sc.n_sink += to_sink;
        sc.n_win += n - to_sink;
        sc.n_tokens += n;
        if (!defer) {
            const int32_t over = sc.n_win - cfg.window;
            const int32_t events = over >= cfg.geom.block ? over / cfg.geom.block : 0;
            sc.n_blocks += events;
            sc.n_win -= events * cfg.geom.block;
        }
        return sc;
    }

    static int64_t store_bytes(const ott_kv_layer_seq & ls) {
        const size_t f16 = ls.sink_k.size() + ls.sink_v.size() + ls.win_k.size() + ls.win_v.size()
                         + ls.pool_k.size() + ls.pool_v.size() + ls.extra_k.size() + ls.extra_v.size();
        const size_t i32 = ls.pool_pos.size() + ls.extra_pos.size();
        return (int64_t) (f16 * sizeof(ott_fp16) + i32 * sizeof(int32_t));
    }

    ott_status allocate(int32_t s) {
        const size_t hd = cfg.geom.head_dim, n_kv = sh.n_head_kv;
        try {
            for (int il = 0; il < sh.n_layer; ++il) {
                ott_kv_layer_seq & ls = layers[(size_t) il * sh.n_seq_max + s];
                const size_t pc = cfg.pool_cap(il), ec = cfg.extra_cap(il);
                ls.sink_k.assign(n_kv * cfg.sink * hd, 0);
                ls.sink_v.assign(n_kv * cfg.sink * hd, 0);
                ls.win_k.assign(n_kv * base_win_cap() * hd, 0);
                ls.win_v.assign(n_kv * base_win_cap() * hd, 0);
                ls.pool_k.assign(n_kv * pc * hd, 0);
                ls.pool_v.assign(n_kv * pc * hd, 0);
                ls.pool_pos.assign(n_kv * pc, 0);
                ls.extra_k.assign(n_kv * ec * hd, 0);
                ls.extra_v.assign(n_kv * ec * hd, 0);
                ls.extra_pos.assign(n_kv * ec, 0);
                ls.n_pool.assign(n_kv, 0);
                ls.n_extra.assign(n_kv, 0);
                ls.tracing.assign(n_kv, cfg.traces(il) ? 1 : 0);
            }
        } catch (const std::bad_alloc &) {
            release(s);
            return ott_fail(OTT_ERR_ALLOC, "cannot allocate the fp16 stores of sequence %d", s);
        }
        seqs[s].win_cap = base_win_cap();
        seqs[s].allocated = true;
        return OTT_OK;
    }

    void release(int32_t s) {
        for (int il = 0; il < sh.n_layer; ++il) {
            ott_kv_layer_seq & ls = layers[(size_t) il * sh.n_seq_max + s];
            for (uint8_t * p : ls.blocks) std::free(p);
            ls = ott_kv_layer_seq{};
        }
        seqs[s] = seq_state{};
    }

    // Re-lay the windows of sequence s with cap rows per KV head.
    void set_win_cap(int32_t s, int32_t cap) {
        seq_state & ss = seqs[s];
        const size_t hd = cfg.geom.head_dim;
        for (int il = 0; il < sh.n_layer; ++il) {
            ott_kv_layer_seq & ls = layers[(size_t) il * sh.n_seq_max + s];
            for (std::vector<ott_fp16> * w : { &ls.win_k, &ls.win_v }) {
                std::vector<ott_fp16> nw((size_t) sh.n_head_kv * cap * hd, 0);
                for (int32_t h = 0; h < sh.n_head_kv; ++h) {
                    std::memcpy(nw.data() + h * cap * hd, w->data() + h * ss.win_cap * hd, ss.sched.n_win * hd * sizeof(ott_fp16));
                }
                w->swap(nw);
            }
        }
        ss.win_cap = cap;
    }

    // Head-blocks for events up to n_blocks in every layer of sequence s.
    ott_status reserve_blocks(int32_t s, int32_t n_blocks) {
        for (int il = 0; il < sh.n_layer; ++il) {
            ott_kv_layer_seq & ls = layers[(size_t) il * sh.n_seq_max + s];
            while ((int32_t) ls.blocks.size() < n_blocks) {
                void * p = std::aligned_alloc(OTT_KV_ALIGN, cfg.event_bytes());
                if (!p) return ott_fail(OTT_ERR_ALLOC, "cannot allocate a quantized block of sequence %d (%zu bytes)", s, cfg.event_bytes());
                ls.blocks.push_back((uint8_t *) p);
            }
        }
        return OTT_OK;
    }

    // Fire the events a prefill_fp16 chunk deferred, in every layer and KV head.
    ott_status flush(int32_t s) {
        seq_state & ss = seqs[s];
        OTT_TRY(reserve_blocks(s, advance(ss.sched, 0, false).n_blocks));
        ott_kv_sched after = ss.sched;
        for (int il = 0; il < sh.n_layer; ++il) {
            ott_kv_layer_seq & ls = layers[(size_t) il * sh.n_seq_max + s];
            for (int32_t h = 0; h < sh.n_head_kv; ++h) after = ott_kv_run_events(cfg, ls, il, h, ss.win_cap, ss.sched, scratch[0]);
        }
        ss.sched = after;
        if (ss.win_cap > base_win_cap()) set_win_cap(s, base_win_cap());
        return OTT_OK;
    }

    // Attention items: per sequence, KV head and tile of QUERY_TILE chunk tokens, the
    // quantized blocks split in parts of BLOCKS_PER_PART; the last part also reads the fp16
    // stores and the chunk. Items of one query tile are consecutive (one merge group).
    void plan_items() {
        step.items.clear();
        step.groups.clear();
        max_q = 1;
        for (int32_t sq = 0; sq < (int32_t) step.seqs.size(); ++sq) {
            const ott_kv_step_seq & S = step.seqs[sq];
            const int32_t n_blocks = S.before.n_blocks;
            const int32_t n_parts = std::max(1, (n_blocks + BLOCKS_PER_PART - 1) / BLOCKS_PER_PART);
            for (int32_t h = 0; h < sh.n_head_kv; ++h) {
                for (int32_t i0 = 0; i0 < S.n_new; i0 += QUERY_TILE) {
                    const int32_t n_q = std::min(QUERY_TILE, S.n_new - i0);
                    max_q = std::max(max_q, n_q);
                    step.groups.push_back((int32_t) step.items.size());
                    for (int32_t p = 0; p < n_parts; ++p) {
                        const int32_t b0 = std::min(n_blocks, p * BLOCKS_PER_PART);
                        const int32_t b1 = std::min(n_blocks, (p + 1) * BLOCKS_PER_PART);
                        step.items.push_back({ sq, h, i0, n_q, b0, b1, p == n_parts - 1 ? 1 : 0 });
                    }
                }
            }
        }
        step.groups.push_back((int32_t) step.items.size());
    }

    ott_kv_config cfg;
    ott_kv_shape  sh;
    std::vector<seq_state>        seqs;      // [n_seq_max]
    std::vector<ott_kv_layer_seq> layers;    // [n_layer][n_seq_max]
    std::vector<std::vector<uint8_t>> scratch;  // [OTT_MAX_THREADS]
    ott_kv_step step;
    int32_t max_q = 1;                       // most chunk tokens of one attention item this step
};

} // namespace

ott_status ott_kv_config_resolve(const ott_kv_params & p, const ott_kv_shape & shape, ott_kv_config & cfg) {
    const int32_t hd = shape.n_embd_head;
    auto bad = [](const char * what, int32_t value, const char * rule) {
        return ott_fail(OTT_ERR_INVALID_ARG, "kv config: %s=%d %s", what, value, rule);
    };
    for (const auto & [name, bits] : { std::pair{ "bits_k", p.bits_k }, std::pair{ "bits_v", p.bits_v } }) {
        if (bits != 2 && bits != 4 && bits != 8) return bad(name, bits, "is not one of 2, 4, 8");
    }
    if (p.block < 8 || p.block % 8 || p.block > 8192) return bad("block", p.block, "must be a multiple of 8 in 8..8192");
    if (p.group_k <= 0 || p.block % p.group_k) return bad("group_k", p.group_k, "must divide block");
    if (p.group_k * p.bits_k % 8) return bad("group_k", p.group_k, "does not fill whole bytes at bits_k");
    if (p.group_v <= 0 || p.group_v * p.bits_v % 8) return bad("group_v", p.group_v, "must be > 0 and fill whole bytes at bits_v");
    const int32_t group_v = std::min(p.group_v, hd);
    if (hd > 8192 || hd % group_v) return bad("group_v", group_v, "does not divide head_dim");
    if (p.window < 0) return bad("window", p.window, "must be >= 0");
    if (p.sink < 0) return bad("sink", p.sink, "must be >= 0");
    if (p.skip_layers < 0) return bad("skip_layers", p.skip_layers, "must be >= 0");
    if (p.pool < 0 || p.pool >= p.block) return bad("pool", p.pool, "must be in 0..block-1");
    if (p.extra_pool < 0 || (p.extra_pool && !p.pool)) return bad("extra_pool", p.extra_pool, "needs pool > 0 and must be >= 0");
    if (p.type == OTT_KV_KIVI && p.pool) return bad("pool", p.pool, "must be 0 in KIVI mode");
    if (p.type == OTT_KV_OTT && !p.pool) return bad("pool", p.pool, "must be > 0 in OTT mode");
    if (p.prefill_fp16 != 0 && p.prefill_fp16 != 1) return bad("prefill_fp16", p.prefill_fp16, "must be 0 or 1");

    cfg = ott_kv_config{};
    cfg.geom = { hd, p.block, p.bits_k, p.bits_v, p.group_k, group_v };
    cfg.layout = ott_kv_block_layout_of(&cfg.geom);
    cfg.window = p.window;
    cfg.pool = p.pool;
    cfg.extra_pool = p.extra_pool;
    cfg.skip_layers = p.skip_layers;
    cfg.sink = p.sink;
    cfg.prefill_fp16 = p.prefill_fp16;
    cfg.n_layer = shape.n_layer;
    cfg.n_head_kv = shape.n_head_kv;
    return OTT_OK;
}

ott_status ott_kv_ott_create(const ott_kv_params & p, const ott_kv_shape & shape, std::unique_ptr<ott_kv_cache> & out) {
    ott_kv_config cfg;
    OTT_TRY(ott_kv_config_resolve(p, shape, cfg));
    out = std::make_unique<kv_ott>(cfg, shape);
    return OTT_OK;
}
