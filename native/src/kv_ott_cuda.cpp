// kv_ott_cuda.cpp — the quantized KV cache (KIVI and OTT modes) in the memory of a CUDA
// device: the semantics, knobs and accounting of kv_ott.cpp (whose validation it reuses),
// with the stores in device memory and our kernels (cuda/ott_cuda.h) doing the work.
//
// Execution (DESIGN §1): ggml-cuda has no custom ops, so build_attn ends a graph segment
// (q, k, v are that segment's outputs) and returns an input tensor that our kernels fill.
// compute() runs segment il on ggml's stream, then on our stream, ordered by CUDA events
// (no host synchronisation inside a step): pending prefill_fp16 events, attention partials
// and merge into layer il's input, then the appends and quantization events of the step,
// then segment il+1 waits for them. One host synchronisation ends the step.
//
// Memory: every store is allocated at creation for n_seq_max sequences of n_ctx tokens (as
// the fp16 cache is), in one buffer of the device's ggml buffer type. The window of a
// (sequence, KV head) is a ring of win_cap rows, a multiple of block (so a block's rows are
// contiguous): R + block rounded up, or the whole context with prefill_fp16 (a deferred
// prompt stays in the window until its events run).
#include "kv_cache.h"
#include "ott_ops_cpu.h"
#include "cuda/ott_cuda.h"

#include <algorithm>
#include <cstring>

namespace {

// ggml-backend-impl.h's struct ggml_backend_event: the device, then the backend's event
// (a cudaEvent_t for ggml-cuda). Read only after checking the device field (raw_event).
struct ggml_event_view {
    ggml_backend_dev_t device;
    void * context;
};

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

#define OTT_CUDA_TRY(expr)                                                                          \
    do {                                                                                            \
        const cudaError_t _e = (expr);                                                              \
        if (_e != cudaSuccess) return ott_fail(OTT_ERR_BACKEND, "CUDA: %s: %s", #expr, cudaGetErrorString(_e)); \
    } while (0)

class kv_ott_cuda final : public ott_kv_cache {
public:
    kv_ott_cuda(const ott_kv_config & cfg, const ott_kv_shape & shape) : cfg(cfg), sh(shape), sched(shape.n_seq_max) {
        const int32_t block = cfg.geom.block;
        const int32_t span = cfg.prefill_fp16 ? std::max(shape.n_ctx - cfg.sink, cfg.window + block) : cfg.window + block;
        win_cap = (span + block - 1) / block * block;
        max_blocks = std::max(0, shape.n_ctx - cfg.sink - cfg.window) / block;
    }

    ~kv_ott_cuda() override {
        cudaSetDevice(sh.cuda_device);
        if (stream) cudaStreamSynchronize(stream);
        if (ev_ggml) ggml_backend_event_free(ev_ggml);
        if (ev_ours) ggml_backend_event_free(ev_ours);
        if (d_plan) cudaFree(d_plan);
        if (d_partials) cudaFree(d_partials);
        if (stream) cudaStreamDestroy(stream);
        if (seg_ctx) ggml_free(seg_ctx);
        if (buf) ggml_backend_buffer_free(buf);
    }

    ott_status init() {
        OTT_CUDA_TRY(cudaSetDevice(sh.cuda_device));
        OTT_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        OTT_CUDA_TRY(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, sh.cuda_device));
        int cc_major = 0;
        OTT_CUDA_TRY(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, sh.cuda_device));
        tensor_cores = cc_major >= 8 ? 1 : 0;     // integer mma.sync m16n8k32: sm_80+

        // one buffer: per layer, the arrays of ott_cuda_kv_layer
        const size_t S = sh.n_seq_max, H = sh.n_head_kv, hd = cfg.geom.head_dim;
        std::vector<size_t> offs;
        size_t total = 0;
        auto take = [&](size_t bytes) { offs.push_back(total); total += align256(bytes); };
        for (int il = 0; il < sh.n_layer; ++il) {
            const size_t pc = cfg.pool_cap(il), ec = cfg.extra_cap(il);
            take(S * H * cfg.sink * hd * 2);  take(S * H * cfg.sink * hd * 2);
            take(S * H * win_cap * hd * 2);   take(S * H * win_cap * hd * 2);
            take(S * H * pc * hd * 2);        take(S * H * pc * hd * 2);    take(S * H * pc * 4);
            take(S * H * ec * hd * 2);        take(S * H * ec * hd * 2);    take(S * H * ec * 4);
            take(S * H * 4);                  take(S * H * 4);              take(S * H * 4);
            take(S * max_blocks * H * cfg.layout.size);
        }
        buf = ggml_backend_buft_alloc_buffer(sh.buft, total);
        if (!buf) {
            return ott_fail(OTT_ERR_ALLOC, "cannot allocate the quantized KV cache on cuda:%d (%.2f GiB for %d sequences x %d tokens)",
                            sh.cuda_device, total / 1073741824.0, sh.n_seq_max, sh.n_ctx);
        }
        ggml_backend_buffer_clear(buf, 0);
        uint8_t * base = (uint8_t *) ggml_backend_buffer_get_base(buf);
        size_t k = 0;
        auto next = [&]() { return base + offs[k++]; };
        for (int il = 0; il < sh.n_layer; ++il) {
            ott_cuda_kv_layer L{};
            L.geom = cfg.geom;
            L.layout = cfg.layout;
            L.n_head_kv = sh.n_head_kv;
            L.sink = cfg.sink;
            L.win_cap = win_cap;
            L.pool_cap = cfg.pool_cap(il);
            L.extra_cap = cfg.extra_cap(il);
            L.max_blocks = max_blocks;
            L.sink_k = (ott_fp16 *) next();  L.sink_v = (ott_fp16 *) next();
            L.win_k = (ott_fp16 *) next();   L.win_v = (ott_fp16 *) next();
            L.pool_k = (ott_fp16 *) next();  L.pool_v = (ott_fp16 *) next();  L.pool_pos = (int32_t *) next();
            L.extra_k = (ott_fp16 *) next(); L.extra_v = (ott_fp16 *) next(); L.extra_pos = (int32_t *) next();
            L.n_pool = (int32_t *) next();   L.n_extra = (int32_t *) next();  L.tracing = (int32_t *) next();
            L.blocks = next();
            layers.push_back(L);
        }
        for (int il = 0; il < sh.n_layer; ++il) {     // the buffer is zeroed: tracing flags on
            if (!cfg.traces(il)) continue;
            const std::vector<int32_t> on((size_t) sh.n_seq_max * sh.n_head_kv, 1);
            OTT_CUDA_TRY(cudaMemcpy(layers[il].tracing, on.data(), on.size() * 4, cudaMemcpyHostToDevice));
        }

        // segments are ordered by ggml's events; raw_event checks we read them right
        ggml_backend_dev_t dev = ggml_backend_buft_get_device(sh.buft);
        ggml_backend_dev_props props;
        ggml_backend_dev_get_props(dev, &props);
        if (props.caps.events) {
            ev_ggml = ggml_backend_event_new(dev);
            ev_ours = ggml_backend_event_new(dev);
        }
        events_ok = raw_event(ev_ggml, dev) && raw_event(ev_ours, dev);
        return OTT_OK;
    }

    ott_status begin(const ott_ubatch & ub) override {
        for (const ott_run & r : ub.runs) {
            for (int32_t j = 0; j < r.n_seqs; ++j) {
                const int32_t s = r.seq0 + j;
                if (sched[s].n_tokens + r.n_tokens > sh.n_ctx) {
                    return ott_fail(OTT_ERR_CONTEXT_FULL, "sequence %d would hold %d tokens, more than the context size %d",
                                    s, sched[s].n_tokens + r.n_tokens, sh.n_ctx);
                }
            }
        }
        ub_ = &ub;
        return OTT_OK;
    }

    void build_inputs(ggml_context *) override {}

    ggml_tensor * build_attn(ggml_context * gctx, ggml_cgraph * gf, int il,
                             ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float kq_scale) override {
        // segment il ends with q, k, v; our kernels read them and fill `out`
        for (ggml_tensor * t : { q, k, v }) {
            ggml_set_output(t);
            ggml_build_forward_expand(gf, t);
        }
        ggml_tensor * out = ggml_new_tensor_2d(gctx, GGML_TYPE_F32, q->ne[0] * q->ne[1], q->ne[2]);
        ggml_format_name(out, "kqv-%d", il);
        ggml_set_input(out);
        if ((int) io.size() != sh.n_layer) io.resize(sh.n_layer);
        io[il] = { q, k, v, out, ggml_graph_n_nodes(gf) };
        n_head = (int32_t) q->ne[1];
        this->kq_scale = kq_scale;
        return out;
    }

    // the plan needs the query heads per KV head, known once build_attn has run
    void set_inputs() override { plan_step(*ub_); }

    ott_status compute(ggml_backend_t backend, ggml_cgraph * gf) override {
        OTT_CUDA_TRY(cudaSetDevice(sh.cuda_device));
        OTT_TRY(upload_plan());
        OTT_TRY(build_segments(gf));
        for (int il = 0; il <= sh.n_layer; ++il) {
            if (ggml_graph_n_nodes(segs[il]) > 0 && ggml_backend_graph_compute_async(backend, segs[il]) != GGML_STATUS_SUCCESS) {
                return ott_fail(OTT_ERR_BACKEND, "graph segment %d failed", il);
            }
            if (il == sh.n_layer) break;
            // our stream after ggml's
            if (events_ok) {
                ggml_backend_event_record(ev_ggml, backend);
                OTT_CUDA_TRY(cudaStreamWaitEvent(stream, raw_event(ev_ggml, nullptr), 0));
            } else {
                ggml_backend_synchronize(backend);
            }
            OTT_TRY(run_layer(il));
            // ggml's stream after ours
            if (events_ok) {
                OTT_CUDA_TRY(cudaEventRecord(raw_event(ev_ours, nullptr), stream));
                ggml_backend_event_wait(backend, ev_ours);
            } else {
                OTT_CUDA_TRY(cudaStreamSynchronize(stream));
            }
        }
        ggml_backend_synchronize(backend);
        OTT_CUDA_TRY(cudaStreamSynchronize(stream));
        return OTT_OK;
    }

    void commit() override {
        for (const step_seq & S : step) sched[S.seq] = S.after;
    }

    int32_t seq_len(int32_t seq) const override { return sched[seq].n_tokens; }

    ott_status seq_truncate(int32_t seq, int32_t n_keep) override {
        ott_kv_sched & sc = sched[seq];
        if (n_keep >= sc.n_tokens) return OTT_OK;
        if (n_keep == 0) {
            sc = ott_kv_sched{};
            return reset_counts(seq);
        }
        return sc.truncate(seq, n_keep, cfg.sink, cfg.geom.block);
    }

    ott_status seq_copy(int32_t src, int32_t dst) override {
        OTT_CUDA_TRY(cudaSetDevice(sh.cuda_device));
        const size_t H = sh.n_head_kv, hd = cfg.geom.head_dim;
        for (const ott_cuda_kv_layer & L : layers) {
            auto copy = [&](void * base, size_t per_seq) {
                uint8_t * b = (uint8_t *) base;
                return cudaMemcpyAsync(b + dst * per_seq, b + src * per_seq, per_seq, cudaMemcpyDeviceToDevice, stream);
            };
            OTT_CUDA_TRY(copy(L.sink_k, H * L.sink * hd * 2));
            OTT_CUDA_TRY(copy(L.sink_v, H * L.sink * hd * 2));
            OTT_CUDA_TRY(copy(L.win_k, H * L.win_cap * hd * 2));
            OTT_CUDA_TRY(copy(L.win_v, H * L.win_cap * hd * 2));
            OTT_CUDA_TRY(copy(L.pool_k, H * L.pool_cap * hd * 2));
            OTT_CUDA_TRY(copy(L.pool_v, H * L.pool_cap * hd * 2));
            OTT_CUDA_TRY(copy(L.pool_pos, H * L.pool_cap * 4));
            OTT_CUDA_TRY(copy(L.extra_k, H * L.extra_cap * hd * 2));
            OTT_CUDA_TRY(copy(L.extra_v, H * L.extra_cap * hd * 2));
            OTT_CUDA_TRY(copy(L.extra_pos, H * L.extra_cap * 4));
            OTT_CUDA_TRY(copy(L.n_pool, H * 4));
            OTT_CUDA_TRY(copy(L.n_extra, H * 4));
            OTT_CUDA_TRY(copy(L.tracing, H * 4));
            const size_t per_seq = (size_t) L.max_blocks * H * L.layout.size;
            OTT_CUDA_TRY(cudaMemcpyAsync(L.blocks + dst * per_seq, L.blocks + src * per_seq,
                                         (size_t) sched[src].n_blocks * H * L.layout.size, cudaMemcpyDeviceToDevice, stream));
        }
        OTT_CUDA_TRY(cudaStreamSynchronize(stream));
        sched[dst] = sched[src];
        return OTT_OK;
    }

    int32_t tokens_until_event(int32_t seq) const override {
        const ott_kv_sched & sc = sched[seq];
        return std::max(1, (cfg.sink - sc.n_sink) + (cfg.window + cfg.geom.block - sc.n_win));
    }

    ott_status export_head(int il, int32_t seq, int32_t h, ott_kv_head_state & out) const override {
        const ott_cuda_kv_layer & L = layers[il];
        const ott_kv_sched & sc = sched[seq];
        const size_t sh_idx = (size_t) seq * sh.n_head_kv + h, hd = cfg.geom.head_dim, row = hd * sizeof(ott_fp16);
        OTT_CUDA_TRY(cudaSetDevice(sh.cuda_device));
        int32_t counts[3] = { 0, 0, 0 };
        OTT_CUDA_TRY(cudaMemcpy(&counts[0], L.n_pool + sh_idx, 4, cudaMemcpyDeviceToHost));
        OTT_CUDA_TRY(cudaMemcpy(&counts[1], L.n_extra + sh_idx, 4, cudaMemcpyDeviceToHost));
        OTT_CUDA_TRY(cudaMemcpy(&counts[2], L.tracing + sh_idx, 4, cudaMemcpyDeviceToHost));
        out.n_tokens = sc.n_tokens;
        out.n_sink   = sc.n_sink;
        out.n_blocks = sc.n_blocks;
        out.n_window = sc.n_win;
        out.n_pool   = L.pool_cap ? counts[0] : 0;
        out.n_extra  = L.extra_cap ? counts[1] : 0;
        out.tracing  = counts[2];
        out.block_bytes = (int32_t) cfg.layout.size;
        const ott_kv_block_layout & B = cfg.layout;
        const uint32_t offs[7] = { B.k_scale, B.k_min, B.v_scale, B.v_min, B.k_codes, B.v_codes, B.mask };
        for (int i = 0; i < 7; ++i) out.block_offsets[i] = (int32_t) offs[i];

        auto get = [](void * dst, const void * src, size_t n) {
            return dst && n ? cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost) : cudaSuccess;
        };
        for (int32_t b = 0; out.blocks && b < out.n_blocks; ++b) {
            const uint8_t * hb = L.blocks + (((size_t) seq * L.max_blocks + b) * sh.n_head_kv + h) * B.size;
            OTT_CUDA_TRY(get(out.blocks + (size_t) b * B.size, hb, B.size));
        }
        OTT_CUDA_TRY(get(out.sink_k, L.sink_k + sh_idx * L.sink * hd, out.n_sink * row));
        OTT_CUDA_TRY(get(out.sink_v, L.sink_v + sh_idx * L.sink * hd, out.n_sink * row));
        OTT_CUDA_TRY(get(out.pool_k, L.pool_k + sh_idx * L.pool_cap * hd, out.n_pool * row));
        OTT_CUDA_TRY(get(out.pool_v, L.pool_v + sh_idx * L.pool_cap * hd, out.n_pool * row));
        OTT_CUDA_TRY(get(out.pool_pos, L.pool_pos + sh_idx * L.pool_cap, out.n_pool * 4));
        OTT_CUDA_TRY(get(out.extra_k, L.extra_k + sh_idx * L.extra_cap * hd, out.n_extra * row));
        OTT_CUDA_TRY(get(out.extra_v, L.extra_v + sh_idx * L.extra_cap * hd, out.n_extra * row));
        OTT_CUDA_TRY(get(out.extra_pos, L.extra_pos + sh_idx * L.extra_cap, out.n_extra * 4));
        // window rows in position order, from the ring
        const int32_t p0 = sc.n_sink + sc.n_blocks * cfg.geom.block;
        for (int32_t i = 0; i < out.n_window; ++i) {
            const size_t r = (size_t) ((p0 + i - cfg.sink) % win_cap);
            if (out.window_k) OTT_CUDA_TRY(get(out.window_k + i * hd, L.win_k + (sh_idx * win_cap + r) * hd, row));
            if (out.window_v) OTT_CUDA_TRY(get(out.window_v + i * hd, L.win_v + (sh_idx * win_cap + r) * hd, row));
        }
        return OTT_OK;
    }

    // Accounting of kv_ott.cpp (reference/footprint.py); allocation: the whole buffer.
    ott_kv_stats stats() const override {
        ott_kv_stats st{};
        const int32_t hd = cfg.geom.head_dim, H = sh.n_head_kv;
        const int64_t token = 2 * (int64_t) hd * sizeof(ott_fp16);
        std::vector<int32_t> n_pool((size_t) sh.n_seq_max * H), n_extra(n_pool.size());
        double used = 0;
        cudaSetDevice(sh.cuda_device);
        for (int il = 0; il < sh.n_layer; ++il) {
            const ott_cuda_kv_layer & L = layers[il];
            if (cfg.traces(il)) {
                cudaMemcpy(n_pool.data(), L.n_pool, n_pool.size() * 4, cudaMemcpyDeviceToHost);
                cudaMemcpy(n_extra.data(), L.n_extra, n_extra.size() * 4, cudaMemcpyDeviceToHost);
            }
            for (int32_t s = 0; s < sh.n_seq_max; ++s) {
                const ott_kv_sched & sc = sched[s];
                if (sc.n_tokens == 0) continue;
                const int64_t blocks = (int64_t) sc.n_blocks * ott_kv_block_data_bytes(&cfg.geom, cfg.traces(il));
                used += (double) H * (blocks + (int64_t) (sc.n_sink + sc.n_win) * token);
                for (int32_t h = 0; h < H && cfg.traces(il); ++h) {
                    used += (double) (n_pool[s * H + h] + n_extra[s * H + h]) * (token + (int64_t) sizeof(int32_t));
                }
            }
        }
        for (const ott_kv_sched & sc : sched) st.n_tokens += sc.n_tokens;
        st.bytes_allocated = (int64_t) ggml_backend_buffer_get_size(buf);
        st.bytes_used = (int64_t) used;
        if (st.n_tokens > 0) {
            st.bytes_per_token_layer = used / ((double) st.n_tokens * sh.n_layer);
            st.bits_per_element = 8.0 * used / ((double) st.n_tokens * sh.n_layer * H * 2 * hd);
        }
        return st;
    }

private:
    // One sequence of the step: its schedule before and after, its chunk.
    struct step_seq {
        int32_t seq;
        int32_t t0;
        int32_t n_new;
        ott_kv_sched after;
    };

    // Offsets (entries) of one launch's items in the uploaded plan.
    struct span {
        size_t off;
        int32_t n;
    };

    struct layer_io {
        ggml_tensor * q, * k, * v, * out;
        int cut;              // the graph's node count when the layer's q, k, v were added
    };

    static cudaEvent_t raw_event(ggml_backend_event_t e, ggml_backend_dev_t dev) {
        if (!e) return nullptr;
        const ggml_event_view * v = (const ggml_event_view *) e;
        return !dev || v->device == dev ? (cudaEvent_t) v->context : nullptr;
    }

    // Counts, pools and tracing flags of sequence s as at its start.
    ott_status reset_counts(int32_t s) {
        const size_t H = sh.n_head_kv;
        std::vector<int32_t> on(H, 1);
        for (int il = 0; il < sh.n_layer; ++il) {
            const ott_cuda_kv_layer & L = layers[il];
            OTT_CUDA_TRY(cudaMemsetAsync(L.n_pool + s * H, 0, H * 4, stream));
            OTT_CUDA_TRY(cudaMemsetAsync(L.n_extra + s * H, 0, H * 4, stream));
            if (cfg.traces(il)) {
                OTT_CUDA_TRY(cudaMemcpyAsync(L.tracing + s * H, on.data(), H * 4, cudaMemcpyHostToDevice, stream));
            } else {
                OTT_CUDA_TRY(cudaMemsetAsync(L.tracing + s * H, 0, H * 4, stream));
            }
        }
        OTT_CUDA_TRY(cudaStreamSynchronize(stream));
        return OTT_OK;
    }

    // The window row of position p (p >= sink).
    int32_t win_row(int32_t p) const { return (p - cfg.sink) % win_cap; }

    // An event of sequence s at schedule sc (n_win >= R + block): the next block.
    ott_cuda_event event_of(int32_t s, const ott_kv_sched & sc) const {
        const int32_t pos0 = sc.n_sink + sc.n_blocks * cfg.geom.block;
        return { s, sc.n_blocks, pos0, win_row(pos0) };
    }

    // Everything a step does, as lists of launch items (the same for every layer):
    //   pre[r]     r-th pending (prefill_fp16) event of each sequence, before attention
    //   tiles      attention tiles over the stores as they stand after pre
    //   app[r]     appends up to each sequence's r-th event, then ev[r] those events
    void plan_step(const ott_ubatch & ub) {
        step.clear();
        tiles.clear();
        std::vector<std::vector<ott_cuda_event>> pre, ev;
        std::vector<std::vector<ott_cuda_append>> app;
        const int32_t block = cfg.geom.block, full = cfg.window + block;
        int32_t max_rows = 1, max_blocks_step = 0;

        for (const ott_run & r : ub.runs) {
            for (int32_t j = 0; j < r.n_seqs; ++j) {
                const int32_t s = r.seq0 + j;
                ott_kv_sched sc = sched[s];
                const bool defer = cfg.prefill_fp16 && r.n_tokens > 1;
                for (int32_t e = 0; !defer && sc.n_win >= full; ++e) {
                    if ((int32_t) pre.size() <= e) pre.emplace_back();
                    pre[e].push_back(event_of(s, sc));
                    sc.n_blocks++;
                    sc.n_win -= block;
                }
                step.push_back({ s, r.t0 + j * r.n_tokens, r.n_tokens, sc });

                const int32_t rows = r.n_tokens * n_rep();
                max_rows = std::max(max_rows, rows);
                max_blocks_step = std::max(max_blocks_step, sc.n_blocks);
                const int32_t win_pos0 = sc.n_sink + sc.n_blocks * block;
                for (int32_t h = 0; h < sh.n_head_kv; ++h) {
                    for (int32_t row0 = 0; row0 < rows; row0 += OTT_CUDA_ATTN_ROWS) {
                        tiles.push_back({ s, h, step.back().t0, r.n_tokens, row0, std::min(OTT_CUDA_ATTN_ROWS, rows - row0),
                                          sc.n_sink, sc.n_blocks, sc.n_win, win_pos0 });
                    }
                }

                int32_t round = 0;
                for (int32_t i = 0; i < r.n_tokens; ++i) {
                    if ((int32_t) app.size() <= round) app.emplace_back();
                    const int32_t tok = step.back().t0 + i;
                    if (sc.n_sink < cfg.sink) {
                        app[round].push_back({ tok, s, sc.n_sink++ });
                    } else {
                        app[round].push_back({ tok, s, -win_row(sc.n_tokens) - 1 });
                        sc.n_win++;
                    }
                    sc.n_tokens++;
                    if (!defer && sc.n_win == full) {
                        if ((int32_t) ev.size() <= round) ev.resize(round + 1);
                        ev[round].push_back(event_of(s, sc));
                        sc.n_blocks++;
                        sc.n_win -= block;
                        round++;
                    }
                }
                step.back().after = sc;
            }
        }
        ev.resize(app.size());
        // tiles of fewer rows when every tile has fewer (decode: n_rep rows)
        rows_per_tile = std::min(OTT_CUDA_ATTN_ROWS, max_rows);
        if (rows_per_tile < OTT_CUDA_ATTN_ROWS) {
            for (ott_cuda_attn_tile & t : tiles) t.n_rows = std::min(t.n_rows, rows_per_tile);
        }
        n_splits = ott_cuda_attn_splits(cfg.geom, rows_per_tile, tensor_cores, (int32_t) tiles.size(), n_sm, max_blocks_step);

        // pack: tiles | pre rounds | (app, ev) rounds
        plan.clear();
        auto put = [&](const void * p, size_t n_items, size_t item) {
            const size_t off = (plan.size() + 15) / 16 * 16;
            plan.resize(off + n_items * item);
            if (n_items) std::memcpy(plan.data() + off, p, n_items * item);
            return span{ off, (int32_t) n_items };
        };
        tiles_span = put(tiles.data(), tiles.size(), sizeof(ott_cuda_attn_tile));
        pre_spans.clear();
        for (const auto & e : pre) pre_spans.push_back(put(e.data(), e.size(), sizeof(ott_cuda_event)));
        round_spans.clear();
        for (size_t i = 0; i < app.size(); ++i) {
            const span a = put(app[i].data(), app[i].size(), sizeof(ott_cuda_append));
            round_spans.push_back({ a, put(ev[i].data(), ev[i].size(), sizeof(ott_cuda_event)) });
        }
    }

    int32_t n_rep() const { return std::max(1, n_head / sh.n_head_kv); }

    ott_status upload_plan() {
        if (plan.size() > plan_cap) {
            if (d_plan) OTT_CUDA_TRY(cudaFree(d_plan));
            plan_cap = plan.size() * 2;
            OTT_CUDA_TRY(cudaMalloc(&d_plan, plan_cap));
        }
        const size_t parts = tiles.size() * (size_t) n_splits * OTT_CUDA_ATTN_ROWS * ott_cuda_partial_row(cfg.geom.head_dim);
        if (parts > partials_cap) {
            if (d_partials) OTT_CUDA_TRY(cudaFree(d_partials));
            partials_cap = parts * 2;
            OTT_CUDA_TRY(cudaMalloc(&d_partials, partials_cap * sizeof(float)));
        }
        OTT_CUDA_TRY(cudaMemcpyAsync(d_plan, plan.data(), plan.size(), cudaMemcpyHostToDevice, stream));
        return OTT_OK;
    }

    // Segment il: the nodes added between layer il-1's cut and layer il's (the last one:
    // everything after the last layer's attention).
    ott_status build_segments(ggml_cgraph * gf) {
        const int n_nodes = ggml_graph_n_nodes(gf);
        std::vector<int> bounds(1, 0);
        for (const layer_io & x : io) bounds.push_back(x.cut);
        bounds.push_back(n_nodes);
        size_t mem = 0;
        for (int i = 0; i <= sh.n_layer; ++i) mem += ggml_graph_overhead_custom(std::max(1, bounds[i + 1] - bounds[i]), false);
        if (seg_ctx) ggml_free(seg_ctx);
        ggml_init_params ip = { mem + 1024, nullptr, true };
        seg_ctx = ggml_init(ip);
        if (!seg_ctx) return ott_fail(OTT_ERR_ALLOC, "cannot allocate the graph segments");
        segs.clear();
        for (int i = 0; i <= sh.n_layer; ++i) {
            ggml_cgraph * g = ggml_new_graph_custom(seg_ctx, std::max(1, bounds[i + 1] - bounds[i]), false);
            for (int n = bounds[i]; n < bounds[i + 1]; ++n) ggml_graph_add_node(g, ggml_graph_node(gf, n));
            segs.push_back(g);
        }
        return OTT_OK;
    }

    static ott_cuda_f32_3d view_of(const ggml_tensor * t) {
        return { (const float *) t->data, (int64_t) (t->nb[1] / sizeof(float)), (int64_t) (t->nb[2] / sizeof(float)) };
    }

    template <typename T>
    const T * items(const span & s) const { return (const T *) (d_plan + s.off); }

    // Layer il's kernels on our stream.
    ott_status run_layer(int il) {
        const ott_cuda_kv_layer & L = layers[il];
        for (const span & s : pre_spans) OTT_CUDA_TRY(ott_cuda_kv_event(L, items<ott_cuda_event>(s), s.n, stream));

        const layer_io & x = io[il];
        ott_cuda_attn_args a{};
        a.L = L;
        a.q = view_of(x.q);
        a.k = view_of(x.k);
        a.v = view_of(x.v);
        a.n_rep = n_rep();
        a.kq_scale = kq_scale;
        a.traces = cfg.traces(il) ? 1 : 0;
        a.tiles = items<ott_cuda_attn_tile>(tiles_span);
        a.n_tiles = tiles_span.n;
        a.rows_per_tile = rows_per_tile;
        a.n_splits = n_splits;
        a.tensor_cores = tensor_cores;
        a.partials = d_partials;
        OTT_CUDA_TRY(ott_cuda_attn_partial(a, stream));
        OTT_CUDA_TRY(ott_cuda_attn_merge(a, (float *) x.out->data, (int64_t) (x.out->nb[1] / sizeof(float)), stream));

        for (const auto & r : round_spans) {
            OTT_CUDA_TRY(ott_cuda_kv_append(L, a.k, a.v, items<ott_cuda_append>(r.first), r.first.n, stream));
            OTT_CUDA_TRY(ott_cuda_kv_event(L, items<ott_cuda_event>(r.second), r.second.n, stream));
        }
        return OTT_OK;
    }

    ott_kv_config cfg;
    ott_kv_shape  sh;
    int32_t win_cap = 0;                     // window ring rows per (sequence, KV head)
    int32_t max_blocks = 0;                  // head-block slots per (sequence, KV head)
    std::vector<ott_kv_sched> sched;         // [n_seq_max]
    std::vector<ott_cuda_kv_layer> layers;   // [n_layer] device pointers into buf
    ggml_backend_buffer_t buf = nullptr;

    cudaStream_t stream = nullptr;
    int n_sm = 1;
    int32_t tensor_cores = 0;                // 1 on sm_80+ (ott_cuda_attn_args::tensor_cores)
    ggml_backend_event_t ev_ggml = nullptr;  // recorded on ggml's stream, waited on by ours
    ggml_backend_event_t ev_ours = nullptr;  // recorded on ours, waited on by ggml's
    bool events_ok = false;                  // else segments and kernels are ordered by host syncs

    // the step being built and run
    const ott_ubatch * ub_ = nullptr;
    std::vector<step_seq> step;
    std::vector<ott_cuda_attn_tile> tiles;
    int32_t rows_per_tile = 1, n_splits = 1, n_head = 1;
    float kq_scale = 1.0f;
    std::vector<uint8_t> plan;               // packed launch items, uploaded once per step
    span tiles_span{};
    std::vector<span> pre_spans;
    std::vector<std::pair<span, span>> round_spans;  // (appends, events)
    std::vector<layer_io> io;                // [n_layer]
    ggml_context * seg_ctx = nullptr;
    std::vector<ggml_cgraph *> segs;         // [n_layer + 1]

    uint8_t * d_plan = nullptr;
    size_t plan_cap = 0;
    float * d_partials = nullptr;
    size_t partials_cap = 0;                 // floats
};

} // namespace

ott_status ott_kv_ott_cuda_create(const ott_kv_params & p, const ott_kv_shape & shape, std::unique_ptr<ott_kv_cache> & out) {
    ott_kv_config cfg;
    OTT_TRY(ott_kv_config_resolve(p, shape, cfg));
    if (const char * why = ott_cuda_attn_unsupported(cfg.geom)) {
        return ott_fail(OTT_ERR_UNSUPPORTED, "kv config on CUDA: %s (head_dim %d, block %d, bits %d/%d, groups %d/%d)", why,
                        cfg.geom.head_dim, cfg.geom.block, cfg.geom.bits_k, cfg.geom.bits_v, cfg.geom.group_k, cfg.geom.group_v);
    }
    auto c = std::make_unique<kv_ott_cuda>(cfg, shape);
    OTT_TRY(c->init());
    out = std::move(c);
    return OTT_OK;
}
