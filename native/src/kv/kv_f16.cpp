// kv_f16.cpp — the fp16 KV cache: one row per (sequence, position), attention by ggml's
// flash-attention op over all sequences of a run at once (on a GPU whose ggml backend has no
// flash attention for the head size: K·Q, masked softmax and V·P as three ops).
//
// With a sliding window of n_swa positions (local layers, kv_layered.h) a query attends to
// the last n_swa positions, itself included, and the rows of a sequence are a ring: position
// p lives in row p % seq_rows, so a ring of n_swa - 1 + (largest chunk) rows holds every
// position a chunk's queries need. Without a window seq_rows >= n_ctx and row = position.
#include "kv/kv_cache.h"
#include "kv/kv_layered.h"

#include "ggml-alloc.h"
#include "ggml-cpu.h"

#include <cmath>
#include <cstring>

namespace {

class kv_f16 final : public ott_kv_cache {
public:
    kv_f16(const ott_kv_shape & shape, int32_t n_swa)
        : sh(shape), n_swa(n_swa), seq_rows(ott_kv_f16_seq_rows(shape)), len(shape.n_seq_max, 0) {}

    ~kv_f16() override {
        if (buf) ggml_backend_buffer_free(buf);
        if (ctx) ggml_free(ctx);
    }

    ott_status init() {
        ggml_init_params ip  = { ggml_tensor_overhead() * (size_t)(2 * sh.n_layer), nullptr, true };
        ctx                  = ggml_init(ip);
        const int64_t n_rows = (int64_t)seq_rows * sh.n_seq_max;
        for (int il = 0; il < sh.n_layer; ++il) {
            k_l.push_back(ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_embd_gqa(), n_rows));
            v_l.push_back(ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_embd_gqa(), n_rows));
            ggml_format_name(k_l.back(), "cache_k_l%d", il);
            ggml_format_name(v_l.back(), "cache_v_l%d", il);
        }
        buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, sh.buft);
        if (!buf) {
            return ott_fail(OTT_ERR_ALLOC, "cannot allocate the fp16 KV cache (%d layers x %d sequences x %d tokens)",
                            sh.n_layer, sh.n_seq_max, sh.n_ctx);
        }
        ggml_backend_buffer_clear(buf, 0);  // masked rows must hold finite values
        use_fa = sh.cuda_device < 0 || ott_kv_flash_attn_supported(sh);
        return OTT_OK;
    }

    ott_status begin(const ott_ubatch & batch) override {
        for (const ott_run & r : batch.runs) {
            for (int32_t s = r.seq0; s < r.seq0 + r.n_seqs; ++s) {
                if (!holds_window(len[s] + r.n_tokens, len[s])) {
                    return ott_fail(OTT_ERR_INVALID_ARG,
                                    "the sliding-window cache of %d rows per sequence takes chunks of at most "
                                    "%d tokens (sequence %d got %d)",
                                    seq_rows, seq_rows - n_swa + 1, s, r.n_tokens);
                }
            }
        }
        ub = &batch;
        plan.clear();
        for (const ott_run & r : batch.runs) {
            int32_t n_kv = 0;
            for (int32_t s = r.seq0; s < r.seq0 + r.n_seqs; ++s)
                n_kv = std::max(n_kv, std::min(len[s] + r.n_tokens, seq_rows));
            if (sh.cuda_device >= 0) n_kv = (n_kv + 255) / 256 * 256;
            plan.push_back({ r, n_kv, nullptr });
        }
        return OTT_OK;
    }

    void build_inputs(ggml_context * gctx) override {
        rows = ggml_new_tensor_1d(gctx, GGML_TYPE_I64, ub->n_tokens());
        ggml_set_name(rows, "kv_rows");
        ggml_set_input(rows);
        for (run_plan & p : plan) {
            // F16 [n_kv, n_tokens, 1, n_seqs]: 0 where the query may attend, -inf elsewhere
            p.mask = ggml_new_tensor_4d(gctx, GGML_TYPE_F16, p.n_kv, p.run.n_tokens, 1, p.run.n_seqs);
            ggml_set_name(p.mask, "kq_mask");
            ggml_set_input(p.mask);
        }
    }

    ggml_tensor * build_attn(ggml_context * gctx, ggml_cgraph * gf, int il, ggml_tensor * q, ggml_tensor * k,
                             ggml_tensor * v, float kq_scale) override {
        const int64_t n_tokens = q->ne[2];
        const int64_t hd       = sh.n_embd_head;
        // rows whole (K or V can be views of a fused projection's rows: graph.cpp's build_qkv)
        auto rows_of = [&](ggml_tensor * x) {
            return ggml_is_contiguous(x) ? ggml_reshape_2d(gctx, x, n_embd_gqa(), n_tokens)
                                         : ggml_cont_2d(gctx, x, n_embd_gqa(), n_tokens);
        };
        ggml_tensor * app_k = ggml_set_rows(gctx, k_l[il], rows_of(k), rows);
        ggml_tensor * app_v = ggml_set_rows(gctx, v_l[il], rows_of(v), rows);
        ggml_format_name(app_k, "kv_append_k-%d", il);
        ggml_format_name(app_v, "kv_append_v-%d", il);
        ggml_build_forward_expand(gf, app_k);
        ggml_build_forward_expand(gf, app_v);

        const size_t row_bytes = k_l[il]->nb[1];
        const size_t seq_bytes = row_bytes * (size_t)seq_rows;
        ggml_tensor * out      = nullptr;
        for (const run_plan & p : plan) {
            const ott_run & r = p.run;
            // [n_embd_head, n_head, n_tokens*n_seqs] -> [n_embd_head, n_tokens, n_head, n_seqs]
            ggml_tensor * qr = ggml_view_3d(gctx, q, hd, q->ne[1], (int64_t)r.n_tokens * r.n_seqs, q->nb[1], q->nb[2],
                                            (size_t)r.t0 * q->nb[2]);
            qr               = ggml_reshape_4d(gctx, qr, hd, q->ne[1], r.n_tokens, r.n_seqs);
            qr               = ggml_permute(gctx, qr, 0, 2, 1, 3);
            // F16 [n_embd_head, n_kv, n_head_kv, n_seqs] views of the cache rows
            ggml_tensor * kr = ggml_view_4d(gctx, k_l[il], hd, p.n_kv, sh.n_head_kv, r.n_seqs, row_bytes,
                                            ggml_row_size(GGML_TYPE_F16, hd), seq_bytes, seq_bytes * r.seq0);
            ggml_tensor * vr = ggml_view_4d(gctx, v_l[il], hd, p.n_kv, sh.n_head_kv, r.n_seqs, row_bytes,
                                            ggml_row_size(GGML_TYPE_F16, hd), seq_bytes, seq_bytes * r.seq0);
            // [n_embd_head, n_head, n_tokens, n_seqs] -> [n_embd_head*n_head, n_tokens*n_seqs]
            ggml_tensor * fa;
            if (use_fa) {
                fa = ggml_flash_attn_ext(gctx, qr, kr, vr, p.mask, kq_scale, 0.0f, 0.0f);
                ggml_flash_attn_ext_set_prec(fa, GGML_PREC_F32);
                ggml_format_name(fa, "kqv_fa-%d", il);
                fa = ggml_reshape_2d(gctx, fa, hd * q->ne[1], (int64_t)r.n_tokens * r.n_seqs);
            } else {
                ggml_tensor * kq = ggml_mul_mat(gctx, kr, qr);  // [n_kv, n_tokens, n_head, n_seqs]
                ggml_mul_mat_set_prec(kq, GGML_PREC_F32);
                ggml_format_name(kq, "kq-%d", il);
                kq = ggml_soft_max_ext(gctx, kq, p.mask, kq_scale, 0.0f);
                ggml_format_name(kq, "kq_soft_max-%d", il);
                ggml_tensor * vt = ggml_cont(gctx, ggml_permute(gctx, vr, 1, 0, 2, 3));  // [n_kv, n_embd_head, ..]
                ggml_format_name(vt, "kq_vt-%d", il);
                ggml_tensor * kqv = ggml_mul_mat(gctx, vt, kq);  // [n_embd_head, n_tokens, n_head, n_seqs]
                ggml_format_name(kqv, "kqv-%d", il);
                fa = ggml_cont_2d(gctx, ggml_permute(gctx, kqv, 0, 2, 1, 3), hd * q->ne[1],
                                  (int64_t)r.n_tokens * r.n_seqs);
                ggml_format_name(fa, "kqv_cont-%d", il);
            }
            out = out ? ggml_concat(gctx, out, fa, 1) : fa;
        }
        return out;
    }

    void set_inputs() override {
        std::vector<int64_t> idx(ub->n_tokens());
        for (int32_t i = 0; i < ub->n_tokens(); ++i) {
            idx[i] = (int64_t)ub->seq_id[i] * seq_rows + ub->pos[i] % seq_rows;
        }
        ggml_backend_tensor_set(rows, idx.data(), 0, idx.size() * sizeof(int64_t));

        // row c may be attended by a query at qpos when the position it holds once the chunk is
        // stored is at most qpos and, with a window, less than n_swa positions back
        const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
        std::vector<ggml_fp16_t> m;
        for (const run_plan & p : plan) {
            const ott_run & r = p.run;
            m.assign((size_t)p.n_kv * r.n_tokens * r.n_seqs, ninf);
            for (int32_t j = 0; j < r.n_seqs; ++j) {
                const int32_t n_held = len[r.seq0 + j] + r.n_tokens;
                for (int32_t i = 0; i < r.n_tokens; ++i) {
                    const int32_t qpos = ub->pos[r.t0 + j * r.n_tokens + i];
                    ggml_fp16_t * row  = m.data() + ((size_t)j * r.n_tokens + i) * p.n_kv;
                    for (int32_t c = 0; c < std::min(p.n_kv, seq_rows); ++c) {
                        const int32_t kpos = held_pos(n_held, c);
                        if (kpos <= qpos && (n_swa == 0 || qpos - kpos < n_swa)) row[c] = zero;
                    }
                }
            }
            ggml_backend_tensor_set(p.mask, m.data(), 0, m.size() * sizeof(ggml_fp16_t));
        }
    }

    void commit() override {
        for (const ott_run & r : ub->runs) {
            for (int32_t s = r.seq0; s < r.seq0 + r.n_seqs; ++s) len[s] += r.n_tokens;
        }
    }

    int32_t seq_len(int32_t seq) const override { return len[seq]; }

    ott_status seq_truncate(int32_t seq, int32_t n_keep) override {
        if (n_keep < len[seq] && !holds_window(len[seq], n_keep)) {
            return ott_fail(OTT_ERR_UNSUPPORTED,
                            "sequence %d: the sliding-window cache no longer holds positions %d.. that "
                            "keeping %d tokens needs (it holds %d..)",
                            seq, std::max(0, n_keep - n_swa + 1), n_keep, len[seq] - seq_rows);
        }
        len[seq] = std::min(len[seq], n_keep);
        return OTT_OK;
    }

    // The rows of src's tokens, every layer, onto dst's rows (on the device that holds them).
    ott_status seq_copy(int32_t src, int32_t dst) override {
        const size_t row_bytes = k_l[0]->nb[1], seq_bytes = row_bytes * (size_t)seq_rows;
        const int64_t n_elem = (int64_t)std::min(len[src], seq_rows) * n_embd_gqa();
        ggml_init_params ip  = { ggml_tensor_overhead() * 2, nullptr, true };
        ggml_context * vc    = ggml_init(ip);
        for (int il = 0; il < sh.n_layer && n_elem > 0; ++il) {
            for (ggml_tensor * t : { k_l[il], v_l[il] }) {
                ggml_reset(vc);
                ggml_tensor * from = ggml_view_1d(vc, t, n_elem, seq_bytes * src);
                ggml_tensor * to   = ggml_view_1d(vc, t, n_elem, seq_bytes * dst);
                ggml_backend_view_init(from);
                ggml_backend_view_init(to);
                ggml_backend_tensor_copy(from, to);
            }
        }
        ggml_free(vc);
        len[dst] = len[src];
        return OTT_OK;
    }

    // Every token the cache holds is in the "window": the K and V rows of KV head h, in
    // position order (no sink, blocks or pools); a ring holds the last seq_rows positions.
    ott_status export_head(int il, int32_t seq, int32_t h, ott_kv_head_state & out) const override {
        out.n_tokens = len[seq];
        out.n_window = std::min(len[seq], seq_rows);
        out.n_sink = out.n_blocks = out.n_pool = out.n_extra = out.tracing = out.block_bytes = 0;
        std::memset(out.block_offsets, 0, sizeof(out.block_offsets));
        const size_t row_bytes = k_l[il]->nb[1], head_bytes = (size_t)sh.n_embd_head * sizeof(ggml_fp16_t);
        std::vector<uint8_t> rows((size_t)out.n_window * row_bytes);
        for (auto [t, dst] : { std::pair { k_l[il], out.window_k }, std::pair { v_l[il], out.window_v } }) {
            if (!dst || rows.empty()) continue;
            ggml_backend_tensor_get(t, rows.data(), (size_t)seq * seq_rows * row_bytes, rows.size());
            for (int32_t i = 0; i < out.n_window; ++i) {
                const int32_t c = (len[seq] - out.n_window + i) % seq_rows;
                std::memcpy((uint8_t *)dst + (size_t)i * head_bytes, rows.data() + c * row_bytes + h * head_bytes,
                            head_bytes);
            }
        }
        return OTT_OK;
    }

    // Used bytes: the rows holding tokens (a ring holds at most seq_rows per sequence).
    ott_kv_stats stats() const override {
        ott_kv_stats st {};
        const double per_token_layer = 2.0 * n_embd_gqa() * sizeof(ggml_fp16_t);  // K and V
        int64_t n_held               = 0;
        for (int32_t l : len) {
            st.n_tokens += l;
            n_held += std::min(l, seq_rows);
        }
        st.bytes_allocated = (int64_t)ggml_backend_buffer_get_size(buf);
        st.bytes_used      = (int64_t)(per_token_layer * sh.n_layer * (double)n_held);
        st.bytes_per_token_layer =
            st.n_tokens ? per_token_layer * (double)n_held / (double)st.n_tokens : per_token_layer;
        st.bits_per_element = st.n_tokens ? 16.0 * (double)n_held / (double)st.n_tokens : 16.0;
        return st;
    }

private:
    struct run_plan {
        ott_run run;
        int32_t n_kv;  // cache rows the run attends over (longest sequence)
        ggml_tensor * mask;
    };

    int64_t n_embd_gqa() const { return (int64_t)sh.n_embd_head * sh.n_head_kv; }

    // The position row c holds while a sequence holds n_held tokens: of the positions
    // n_held - seq_rows .. n_held - 1, the one that maps to c (c itself before the ring wraps).
    int32_t held_pos(int32_t n_held, int32_t c) const {
        if (n_held <= seq_rows) return c;
        const int32_t first = n_held - seq_rows;
        return first + ((c - first) % seq_rows + seq_rows) % seq_rows;
    }

    bool holds_window(int32_t n_held, int32_t pos) const { return ott_kv_ring_holds(n_swa, seq_rows, n_held, pos); }

    ott_kv_shape sh;
    int32_t n_swa;  // sliding window in positions; 0: none
    ggml_context * ctx        = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    int32_t seq_rows;  // cache rows per sequence (shape.n_ctx, padded on a GPU)
    std::vector<ggml_tensor *>
        k_l;  // F16 [n_embd_gqa, seq_rows*n_seq_max] per layer; row = seq*seq_rows + pos % seq_rows
    std::vector<ggml_tensor *> v_l;  // F16 [n_embd_gqa, seq_rows*n_seq_max] per layer
    std::vector<int32_t> len;        // [n_seq_max] tokens held per sequence
    bool use_fa = true;              // flash attention, else K·Q, softmax, V·P

    const ott_ubatch * ub = nullptr;  // the step being built
    std::vector<run_plan> plan;       // one per run of the step
    ggml_tensor * rows = nullptr;     // I64 [n_tokens] cache row of each new token
};

}  // namespace

bool ott_kv_flash_attn_supported(const ott_kv_shape & shape) {
    ggml_init_params ip = { ggml_tensor_overhead() * 8, nullptr, true };
    ggml_context * c    = ggml_init(ip);
    ggml_tensor * q     = ggml_new_tensor_4d(c, GGML_TYPE_F32, shape.n_embd_head, 1, shape.n_head_kv, 1);
    ggml_tensor * k     = ggml_new_tensor_4d(c, GGML_TYPE_F16, shape.n_embd_head, 256, shape.n_head_kv, 1);
    ggml_tensor * v     = ggml_new_tensor_4d(c, GGML_TYPE_F16, shape.n_embd_head, 256, shape.n_head_kv, 1);
    ggml_tensor * m     = ggml_new_tensor_4d(c, GGML_TYPE_F16, 256, 1, 1, 1);
    ggml_tensor * fa    = ggml_flash_attn_ext(c, q, k, v, m, 1.0f, 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(fa, GGML_PREC_F32);
    const bool ok = ggml_backend_dev_supports_op(ggml_backend_buft_get_device(shape.buft), fa);
    ggml_free(c);
    return ok;
}

// On a GPU a sequence's rows are padded to a multiple of 256: ggml-cuda's fastest
// flash-attention kernels want n_kv a multiple of 256 (the extra rows are masked out).
int32_t ott_kv_f16_seq_rows(const ott_kv_shape & shape) {
    return shape.cuda_device >= 0 ? (shape.n_ctx + 255) / 256 * 256 : shape.n_ctx;
}

ott_status ott_kv_f16_create(const ott_kv_shape & shape, std::unique_ptr<ott_kv_cache> & out) {
    return ott_kv_f16_window_create(shape, 0, out);
}

ott_status ott_kv_f16_window_create(const ott_kv_shape & shape, int32_t n_swa, std::unique_ptr<ott_kv_cache> & out) {
    auto c = std::make_unique<kv_f16>(shape, n_swa);
    OTT_TRY(c->init());
    out = std::move(c);
    return OTT_OK;
}
