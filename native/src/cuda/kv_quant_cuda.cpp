// kv_quant_cuda.cpp — the quantized KV cache (KIVI, OTT and KVQuant modes) in the memory of a
// CUDA device: the core's rules (kv/kv_config.h, kv/kv_schedule.h, kv/kv_report.h) executed by
// our kernels (cuda/ott_cuda.h; cuda/kvq_cuda.h for KVQuant's events and attention, which
// writes the layer's output itself: no partials).
//
// Execution (docs/design.md §1): ggml-cuda has no custom ops, so the attention is external
// (kv_cache.h): build_attn ends a graph segment (q, k, v are that segment's outputs) and
// returns an input tensor that our kernels fill; the context's executor (cuda/executor.h)
// runs the segments and calls run_layer(il) between them: the deferred prefill_fp16 events,
// attention partials and merge into layer il's input, then the step's appends and events.
// A step of one sequence's chunk of FA_MIN_TOKENS or more (a prompt) attends instead by
// ggml's flash attention on tensor cores, in the graph: run_layer gathers the sequence's
// stores and the chunk as fp16 rows in position order (cuda/kv_gather.cu) into two of the
// step's inputs, which the next segment's flash attention reads with a causal mask; the
// rows are what the fused kernels read, dequantised and rounded to fp16.
// A layer's appends and events (KIVI and OTT) run on a stream of their own, after its
// attention and beside the graph's next layers (nothing reads the layer's stores again
// before the next step); the last layer's run_layer joins that stream back. With recent
// blocks, the launch over them runs on a third stream beside the old blocks' launch (its
// blocks fill the other's last wave) and the merge waits for both.
//
// Memory: every store is allocated at creation for n_seq_max sequences of n_ctx tokens (as
// the fp16 cache is), in one buffer of the device's ggml buffer type. The window ring of a
// (sequence, KV head) holds R + block rows, or the whole context with prefill_fp16 (a
// deferred prompt stays in the window until its events), rounded up to a multiple of block:
// the rows of a block being quantized are then contiguous, as the event kernel reads them.
// Keys cached before RoPE (pre_rope, outside KVQuant): one table of every position's angles,
// shared by the layers (ott_cuda_kv_layer::rope); the tensor cores are then not used.
// With recent blocks, each layer also holds the ring of its newest head-blocks (ott_cuda.h),
// and the events share one scratch of n_seq_max x n_head_kv blocks of fp16 rows (their
// re-coding): steps that run deferred events wait for the earlier layers' events first.
#include "kv/kv_cache.h"
#include "kv/kv_report.h"
#include "cuda/kvq_cuda.h"
#include "cuda/ott_cuda.h"
#include "kv/kvq_types.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// A step of one sequence with at least this many new tokens attends by flash attention.
constexpr int32_t FA_MIN_TOKENS = 64;

#define OTT_CUDA_TRY(expr)                                                                                             \
    do {                                                                                                               \
        const cudaError_t _e = (expr);                                                                                 \
        if (_e != cudaSuccess) return ott_fail(OTT_ERR_BACKEND, "CUDA: %s: %s", #expr, cudaGetErrorString(_e));        \
    } while (0)

class kv_quant_cuda final : public ott_kv_cache {
public:
    kv_quant_cuda(const ott_kv_config & cfg, const ott_kv_shape & shape)
        : cfg(cfg), sh(shape), win_cap(ott_kv_ring_rows(cfg, shape.n_ctx)),
          max_blocks(ott_kv_max_blocks(cfg, shape.n_ctx)), sched(shape.n_seq_max) {}

    ~kv_quant_cuda() override {
        cudaSetDevice(sh.cuda_device);
        if (stream) cudaStreamSynchronize(stream);
        if (side) cudaStreamSynchronize(side);
        if (aux) cudaStreamSynchronize(aux);
        if (ev_attn) cudaEventDestroy(ev_attn);
        if (ev_side) cudaEventDestroy(ev_side);
        if (ev_fork) cudaEventDestroy(ev_fork);
        if (ev_join) cudaEventDestroy(ev_join);
        if (side) cudaStreamDestroy(side);
        if (aux) cudaStreamDestroy(aux);
        if (d_plan) cudaFree(d_plan);
        if (d_partials) cudaFree(d_partials);
        if (stream) cudaStreamDestroy(stream);
        if (buf) ggml_backend_buffer_free(buf);
    }

    ott_status init() {
        OTT_CUDA_TRY(cudaSetDevice(sh.cuda_device));
        OTT_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        OTT_CUDA_TRY(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
        OTT_CUDA_TRY(cudaEventCreateWithFlags(&ev_attn, cudaEventDisableTiming));
        OTT_CUDA_TRY(cudaEventCreateWithFlags(&ev_side, cudaEventDisableTiming));
        OTT_CUDA_TRY(cudaStreamCreateWithFlags(&aux, cudaStreamNonBlocking));
        OTT_CUDA_TRY(cudaEventCreateWithFlags(&ev_fork, cudaEventDisableTiming));
        OTT_CUDA_TRY(cudaEventCreateWithFlags(&ev_join, cudaEventDisableTiming));
        OTT_CUDA_TRY(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, sh.cuda_device));
        int cc_major = 0;
        OTT_CUDA_TRY(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, sh.cuda_device));
        // integer mma.sync m16n8k32: sm_80+; keys before RoPE are scored by the FFMA kernel
        tensor_cores = cc_major >= 8 && !ott_rope() ? 1 : 0;
        flash_attn   = !cfg.kvq && ott_kv_flash_attn_supported(sh);

        // one buffer: OTT's RoPE angles (keys before RoPE), per layer the arrays of ott_cuda_kv_layer
        const size_t S = sh.n_seq_max, H = sh.n_head_kv, hd = cfg.geom.head_dim;
        std::vector<size_t> offs;
        size_t total = 0;
        auto take    = [&](size_t bytes) {
            offs.push_back(total);
            total += align256(bytes);
        };
        const size_t n_pairs = ott_rope() ? (size_t)sh.n_ctx * hd / 2 : 0;
        take(n_pairs * sizeof(float2));
        for (int il = 0; il < sh.n_layer; ++il) {
            const size_t pc = cfg.pool_cap(il), ec = cfg.extra_cap(il);
            take(S * H * cfg.sink * hd * 2);
            take(S * H * cfg.sink * hd * 2);
            take(S * H * win_cap * hd * 2);
            take(S * H * win_cap * hd * 2);
            take(S * H * pc * hd * 2);
            take(S * H * pc * hd * 2);
            take(S * H * pc * 4);
            take(S * H * ec * hd * 2);
            take(S * H * ec * hd * 2);
            take(S * H * ec * 4);
            take(S * H * 4);
            take(S * H * 4);
            take(S * H * 4);
            take(S * (max_blocks - n_recent()) * H * cfg.layout.size);
            take(cfg.tier_scale.empty() ? 0 : H * hd * sizeof(float));
            take(S * n_recent() * H * cfg.rlayout.size);
        }
        take(cfg.recent ? S * H * 2 * cfg.geom.block * hd * sizeof(ott_fp16) : 0);  // the events' re-coding
        // KVQuant: the calibrated tables, their ott_kvq_tables [n_layer][n_head_kv], the RoPE
        // table of keys cached before it, the events' scratch
        const size_t n_lev = cfg.kvq ? cfg.kvq_levels.size() / sh.n_layer : 0;
        const size_t n_cs  = cfg.kvq && cfg.pre_rope ? (size_t)sh.n_ctx * cfg.rope_n_rot : 0;
        take(cfg.kvq_keys.size() * sizeof(float));
        take(cfg.kvq_levels.size() * sizeof(float));
        take(cfg.kvq ? (size_t)sh.n_layer * H * sizeof(ott_kvq_tables) : 0);
        take(n_cs * sizeof(float));
        take(cfg.kvq ? S * H * ott_cuda_kvq_event_scratch(cfg.kvq_geom) : 0);
        buf = ggml_backend_buft_alloc_buffer(sh.buft, total);
        if (!buf) {
            return ott_fail(OTT_ERR_ALLOC,
                            "cannot allocate the quantized KV cache on cuda:%d (%.2f GiB for %d sequences x %d tokens)",
                            sh.cuda_device, total / 1073741824.0, sh.n_seq_max, sh.n_ctx);
        }
        ggml_backend_buffer_clear(buf, 0);
        uint8_t * base = (uint8_t *)ggml_backend_buffer_get_base(buf);
        size_t k       = 0;
        auto next      = [&]() { return base + offs[k++]; };
        float2 * pairs = (float2 *)next();
        if (n_pairs) {
            std::vector<float2> host(n_pairs);
            ott_cuda_rope_pairs_fill((int32_t)hd, cfg.rope_freq_base, cfg.rope_freq_scale, sh.n_ctx, host.data());
            OTT_CUDA_TRY(cudaMemcpy(pairs, host.data(), n_pairs * sizeof(float2), cudaMemcpyHostToDevice));
        }
        for (int il = 0; il < sh.n_layer; ++il) {
            ott_cuda_kv_layer L {};
            L.geom       = cfg.geom;
            L.layout     = cfg.layout;
            L.n_head_kv  = sh.n_head_kv;
            L.sink       = cfg.sink;
            L.win_cap    = win_cap;
            L.pool_cap   = cfg.pool_cap(il);
            L.extra_cap  = cfg.extra_cap(il);
            L.max_blocks = max_blocks - n_recent();
            L.sink_k     = (ott_fp16 *)next();
            L.sink_v     = (ott_fp16 *)next();
            L.win_k      = (ott_fp16 *)next();
            L.win_v      = (ott_fp16 *)next();
            L.pool_k     = (ott_fp16 *)next();
            L.pool_v     = (ott_fp16 *)next();
            L.pool_pos   = (int32_t *)next();
            L.extra_k    = (ott_fp16 *)next();
            L.extra_v    = (ott_fp16 *)next();
            L.extra_pos  = (int32_t *)next();
            L.n_pool     = (int32_t *)next();
            L.n_extra    = (int32_t *)next();
            L.tracing    = (int32_t *)next();
            L.blocks     = next();
            L.rope       = n_pairs ? pairs : nullptr;
            L.rope_neox  = cfg.rope_neox;
            uint8_t * u  = next();
            if (!cfg.tier_scale.empty()) {
                L.tier_scale = (const float *)u;
                OTT_CUDA_TRY(cudaMemcpy(u, cfg.tier_scale_of(il, 0), H * hd * sizeof(float), cudaMemcpyHostToDevice));
            }
            layers.push_back(L);
            uint8_t * ring = next();
            if (!cfg.recent) continue;
            ott_cuda_kv_layer R = L;  // the recent view: the same stores, the ring as its blocks
            R.geom              = cfg.rgeom;
            R.layout            = cfg.rlayout;
            R.max_blocks        = n_recent();
            R.ring              = cfg.recent;
            R.blocks            = ring;
            R.tier_scale        = nullptr;
            rviews.push_back(R);
        }
        recode_scratch = (ott_fp16 *)next();
        if (cfg.kvq) {
            float * keys   = (float *)next();
            float * levels = (float *)next();
            kvq_tabs       = (ott_kvq_tables *)next();
            float * cs     = (float *)next();
            kvq_scratch    = next();
            std::vector<ott_kvq_tables> tabs((size_t)sh.n_layer * H);
            for (int il = 0; il < sh.n_layer; ++il) {
                for (size_t h = 0; h < H; ++h) {
                    const size_t k0  = ((size_t)il * H + h) * 2 * hd;
                    const float * lv = levels + (size_t)il * n_lev;
                    tabs[il * H + h] = { keys + k0, keys + k0 + hd, lv, lv + (1 << cfg.kvq_geom.bits_k) };
                }
            }
            OTT_CUDA_TRY(
                cudaMemcpy(keys, cfg.kvq_keys.data(), cfg.kvq_keys.size() * sizeof(float), cudaMemcpyHostToDevice));
            OTT_CUDA_TRY(cudaMemcpy(levels, cfg.kvq_levels.data(), cfg.kvq_levels.size() * sizeof(float),
                                    cudaMemcpyHostToDevice));
            OTT_CUDA_TRY(
                cudaMemcpy(kvq_tabs, tabs.data(), tabs.size() * sizeof(ott_kvq_tables), cudaMemcpyHostToDevice));
            if (n_cs) {
                std::vector<float> host(n_cs);
                ott_rope_table_fill(cfg.rope_n_rot, cfg.rope_freq_base, cfg.rope_freq_scale, sh.n_ctx, host.data());
                OTT_CUDA_TRY(cudaMemcpy(cs, host.data(), n_cs * sizeof(float), cudaMemcpyHostToDevice));
                kvq_rope = { cfg.rope_n_rot, cfg.rope_neox, sh.n_ctx, cs, nullptr };
            }
        }
        for (int il = 0; il < sh.n_layer; ++il) {  // the buffer is zeroed: tracing flags on
            if (!cfg.traces(il)) continue;
            const std::vector<int32_t> on((size_t)sh.n_seq_max * sh.n_head_kv, 1);
            OTT_CUDA_TRY(cudaMemcpy(layers[il].tracing, on.data(), on.size() * 4, cudaMemcpyHostToDevice));
        }
        return OTT_OK;
    }

    ott_status begin(const ott_ubatch & ub) override {
        plan    = ott_kv_plan_step(cfg, sched, ub);
        fa_step = flash_attn && plan.seqs.size() == 1 && plan.seqs[0].n_new >= FA_MIN_TOKENS;
        if (fa_step) {
            const ott_kv_step_seq & S = plan.seqs[0];
            const ott_kv_sched & sc   = S.before;
            const int32_t n_kv        = sc.win_pos0(cfg) + sc.n_win + S.n_new;
            gather = { S.seq, sc.n_sink, sc.n_blocks, sc.n_win, S.n_new, S.t0, (int32_t)align256(n_kv) };
        }
        return OTT_OK;
    }

    void build_inputs(ggml_context * gctx) override {
        if (!fa_step) return;
        // F16 [head_dim, n_rows, n_head_kv] (cuda/kv_gather.cu); F16 [n_rows, n_new]: 0 where
        // the chunk's token may attend, -inf elsewhere
        const int64_t hd = cfg.geom.head_dim;
        fa_k             = ggml_new_tensor_3d(gctx, GGML_TYPE_F16, hd, gather.n_rows, sh.n_head_kv);
        fa_v             = ggml_new_tensor_3d(gctx, GGML_TYPE_F16, hd, gather.n_rows, sh.n_head_kv);
        fa_mask          = ggml_new_tensor_2d(gctx, GGML_TYPE_F16, gather.n_rows, gather.n_new);
        ggml_set_name(fa_k, "kv_gather_k");
        ggml_set_name(fa_v, "kv_gather_v");
        ggml_set_name(fa_mask, "kq_mask");
        for (ggml_tensor * t : { fa_k, fa_v, fa_mask }) ggml_set_input(t);
    }

    ggml_tensor * build_attn(ggml_context * gctx, ggml_cgraph * gf, int il, ggml_tensor * q, ggml_tensor * k,
                             ggml_tensor * v, float kq_scale) override {
        // segment il ends with q, k, v; our kernels read them and fill `out`
        for (ggml_tensor * t : { q, k, v }) {
            ggml_set_output(t);
            ggml_build_forward_expand(gf, t);
        }
        if ((int)io.size() != sh.n_layer) io.resize(sh.n_layer);
        n_head         = (int32_t)q->ne[1];
        this->kq_scale = kq_scale;
        if (fa_step) {  // the next segment attends over what run_layer gathers
            io[il]           = { q, k, v, nullptr, ggml_graph_n_nodes(gf) };
            ggml_tensor * qr = ggml_permute(gctx, q, 0, 2, 1, 3);  // [head_dim, n_tokens, n_head]
            ggml_tensor * fa = ggml_flash_attn_ext(gctx, qr, fa_k, fa_v, fa_mask, kq_scale, 0.0f, 0.0f);
            ggml_flash_attn_ext_set_prec(fa, GGML_PREC_F32);
            ggml_format_name(fa, "kqv_fa-%d", il);
            return ggml_reshape_2d(gctx, fa, q->ne[0] * q->ne[1], q->ne[2]);
        }
        ggml_tensor * out = ggml_new_tensor_2d(gctx, GGML_TYPE_F32, q->ne[0] * q->ne[1], q->ne[2]);
        ggml_format_name(out, "kqv-%d", il);
        ggml_set_input(out);
        io[il] = { q, k, v, out, ggml_graph_n_nodes(gf) };
        return out;
    }

    // the launch items need the query heads per KV head, known once build_attn has run
    void set_inputs() override {
        pack_launches();
        if (!fa_step) return;
        // the chunk's token i is position n_kv - n_new + i: it sees the positions up to its own
        const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), ninf = ggml_fp32_to_fp16(-INFINITY);
        const int32_t n_past = gather.n_sink + gather.n_blocks * cfg.geom.block + gather.n_win;
        std::vector<ggml_fp16_t> m((size_t)gather.n_rows * gather.n_new, ninf);
        for (int32_t i = 0; i < gather.n_new; ++i) {
            std::fill_n(m.begin() + (size_t)i * gather.n_rows, n_past + i + 1, zero);
        }
        ggml_backend_tensor_set(fa_mask, m.data(), 0, m.size() * sizeof(ggml_fp16_t));
    }

    void commit() override {
        for (const ott_kv_step_seq & S : plan.seqs) sched[S.seq] = S.after;
    }

    bool external_attention() const override { return true; }
    bool keys_before_rope(int) const override { return cfg.pre_rope; }
    int segment_end(int il) const override { return io[il].cut; }

    ott_status prepare_step(cudaStream_t exec_stream) override {
        if (packed.size() > plan_cap) {
            if (d_plan) OTT_CUDA_TRY(cudaFree(d_plan));
            plan_cap = packed.size() * 2;
            OTT_CUDA_TRY(cudaMalloc(&d_plan, plan_cap));
        }
        const size_t parts =
            cfg.kvq ? ott_cuda_kvq_partial_floats(cfg.kvq_geom, (int32_t)tiles.size(), n_splits)
                    : tiles.size() * (size_t)ott_cuda_attn_n_parts(n_splits, cfg.recent, (int32_t)tiles.size(), n_sm) *
                          OTT_CUDA_ATTN_ROWS * ott_cuda_partial_row(cfg.geom.head_dim);
        if (parts > partials_cap) {
            if (d_partials) OTT_CUDA_TRY(cudaFree(d_partials));
            partials_cap = parts * 2;
            OTT_CUDA_TRY(cudaMalloc(&d_partials, partials_cap * sizeof(float)));
        }
        OTT_CUDA_TRY(cudaMemcpyAsync(d_plan, packed.data(), packed.size(), cudaMemcpyHostToDevice, exec_stream));
        return OTT_OK;
    }

    // Layer il's kernels on the executor's stream.
    ott_status run_layer(int il, cudaStream_t exec_stream) override {
        const ott_cuda_kv_layer & L = layers[il];
        const ott_cuda_kv_layer * R = cfg.recent ? &rviews[il] : nullptr;                        // the recent view
        const ott_kvq_tables * tabs = cfg.kvq ? kvq_tabs + (size_t)il * sh.n_head_kv : nullptr;  // KVQuant
        auto events                 = [&](const span & s, cudaStream_t st) {
            return cfg.kvq
                       ? ott_cuda_kvq_layer_event(cfg.kvq_geom, L, tabs, items<ott_cuda_event>(s), s.n, kvq_scratch, st)
                       : ott_cuda_kv_event(L, R, items<ott_cuda_event>(s), s.n, recode_scratch, st);
        };
        if (R && !pre_spans.empty()) {  // the previous layer's events, on `side`, re-code through the scratch too
            OTT_CUDA_TRY(cudaEventRecord(ev_side, side));
            OTT_CUDA_TRY(cudaStreamWaitEvent(exec_stream, ev_side, 0));
        }
        for (const span & s : pre_spans) OTT_CUDA_TRY(events(s, exec_stream));

        const layer_io & x      = io[il];
        const ott_cuda_f32_3d k = view_of(x.k), v = view_of(x.v);
        if (fa_step) {
            OTT_CUDA_TRY(
                ott_cuda_kv_gather(L, R, k, v, gather, (ott_fp16 *)fa_k->data, (ott_fp16 *)fa_v->data, exec_stream));
        } else if (cfg.kvq) {
            float * out           = (float *)x.out->data;
            const int64_t out_nb1 = (int64_t)(x.out->nb[1] / sizeof(float));
            OTT_CUDA_TRY(ott_cuda_kvq_layer_attn(cfg.kvq_geom, L, tabs, kvq_rope, view_of(x.q), k, v, n_rep(),
                                                 items<ott_cuda_attn_tile>(tiles_span), tiles_span.n, rows_per_tile,
                                                 kq_scale, n_splits, d_partials, out, out_nb1, exec_stream));
        } else {
            float * out           = (float *)x.out->data;
            const int64_t out_nb1 = (int64_t)(x.out->nb[1] / sizeof(float));
            ott_cuda_attn_args a {};
            a.L             = L;
            a.q             = view_of(x.q);
            a.k             = k;
            a.v             = v;
            a.n_rep         = n_rep();
            a.kq_scale      = kq_scale;
            a.traces        = cfg.traces(il) ? 1 : 0;
            a.tiles         = items<ott_cuda_attn_tile>(tiles_span);
            a.n_tiles       = tiles_span.n;
            a.rows_per_tile = rows_per_tile;
            a.n_splits      = n_splits;
            a.tensor_cores  = tensor_cores;
            a.partials      = d_partials;
            a.recent        = cfg.recent;
            a.n_parts       = ott_cuda_attn_n_parts(n_splits, cfg.recent, a.n_tiles, n_sm);
            if (R) {  // the recent blocks' launch (the last partials of every tile) beside the old blocks'
                OTT_CUDA_TRY(cudaEventRecord(ev_fork, exec_stream));
                OTT_CUDA_TRY(cudaStreamWaitEvent(aux, ev_fork, 0));
            }
            OTT_CUDA_TRY(ott_cuda_attn_partial(a, exec_stream));
            if (R) {
                OTT_CUDA_TRY(ott_cuda_attn_recent(a, *R, aux));
                OTT_CUDA_TRY(cudaEventRecord(ev_join, aux));
                OTT_CUDA_TRY(cudaStreamWaitEvent(exec_stream, ev_join, 0));
            }
            OTT_CUDA_TRY(ott_cuda_attn_merge(a, out, out_nb1, exec_stream));
        }

        // the appends and events: KVQuant's share its event scratch between layers, so they
        // stay on the executor's stream; the others go on `side` once the attention is done
        cudaStream_t st = cfg.kvq ? exec_stream : side;
        if (!cfg.kvq) {
            OTT_CUDA_TRY(cudaEventRecord(ev_attn, exec_stream));
            OTT_CUDA_TRY(cudaStreamWaitEvent(side, ev_attn, 0));
        }
        for (const auto & r : round_spans) {
            OTT_CUDA_TRY(ott_cuda_kv_append(L, k, v, items<ott_cuda_append>(r.first), r.first.n, st));
            OTT_CUDA_TRY(events(r.second, st));
        }
        if (!cfg.kvq && il == sh.n_layer - 1) {  // the executor's stream ends the step after them
            OTT_CUDA_TRY(cudaEventRecord(ev_side, side));
            OTT_CUDA_TRY(cudaStreamWaitEvent(exec_stream, ev_side, 0));
        }
        return OTT_OK;
    }

    int32_t seq_len(int32_t seq) const override { return sched[seq].n_tokens; }

    ott_status seq_truncate(int32_t seq, int32_t n_keep) override {
        ott_kv_sched & sc = sched[seq];
        if (n_keep >= sc.n_tokens) return OTT_OK;
        if (n_keep == 0) {
            sc = ott_kv_sched {};
            return reset_counts(seq);
        }
        return sc.truncate(cfg, seq, n_keep);
    }

    ott_status seq_copy(int32_t src, int32_t dst) override {
        OTT_CUDA_TRY(cudaSetDevice(sh.cuda_device));
        const size_t H = sh.n_head_kv, hd = cfg.geom.head_dim;
        for (const ott_cuda_kv_layer & R : rviews) {
            const size_t per_seq = (size_t)R.max_blocks * H * R.layout.size;
            OTT_CUDA_TRY(cudaMemcpyAsync(R.blocks + dst * per_seq, R.blocks + src * per_seq, per_seq,
                                         cudaMemcpyDeviceToDevice, stream));
        }
        for (const ott_cuda_kv_layer & L : layers) {
            auto copy = [&](void * base, size_t per_seq) {
                uint8_t * b = (uint8_t *)base;
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
            const size_t per_seq = (size_t)L.max_blocks * H * L.layout.size;
            const int32_t n_old  = sched[src].n_blocks - cfg.n_recent(sched[src].n_blocks);  // not in the ring
            OTT_CUDA_TRY(cudaMemcpyAsync(L.blocks + dst * per_seq, L.blocks + src * per_seq,
                                         (size_t)n_old * H * L.layout.size, cudaMemcpyDeviceToDevice, stream));
        }
        OTT_CUDA_TRY(cudaStreamSynchronize(stream));
        sched[dst] = sched[src];
        return OTT_OK;
    }

    int32_t tokens_until_event(int32_t seq) const override { return sched[seq].tokens_until_event(cfg); }

    ott_status export_head(int il, int32_t seq, int32_t h, ott_kv_head_state & out) const override {
        const ott_cuda_kv_layer & L = layers[il];
        const ott_kv_sched & sc     = sched[seq];
        const size_t sh_idx = (size_t)seq * sh.n_head_kv + h, hd = cfg.geom.head_dim, row = hd * sizeof(ott_fp16);
        OTT_CUDA_TRY(cudaSetDevice(sh.cuda_device));
        int32_t counts[3] = { 0, 0, 0 };
        OTT_CUDA_TRY(cudaMemcpy(&counts[0], L.n_pool + sh_idx, 4, cudaMemcpyDeviceToHost));
        OTT_CUDA_TRY(cudaMemcpy(&counts[1], L.n_extra + sh_idx, 4, cudaMemcpyDeviceToHost));
        OTT_CUDA_TRY(cudaMemcpy(&counts[2], L.tracing + sh_idx, 4, cudaMemcpyDeviceToHost));
        ott_kv_export_header(cfg, sc, out);
        out.n_pool                    = L.pool_cap ? counts[0] : 0;
        out.n_extra                   = L.extra_cap ? counts[1] : 0;
        out.tracing                   = counts[2];
        const ott_kv_block_layout & B = cfg.layout;

        auto get = [](void * dst, const void * src, size_t n) {
            return dst && n ? cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost) : cudaSuccess;
        };
        const int32_t n_old = out.n_blocks - out.n_recent;
        for (int32_t b = 0; out.blocks && b < n_old; ++b) {
            OTT_CUDA_TRY(get(out.blocks + (size_t)b * B.size, ott_cuda_head_block(L, seq, b, h), B.size));
        }
        for (int32_t b = n_old; out.recent && b < out.n_blocks; ++b) {
            OTT_CUDA_TRY(get(out.recent + (size_t)(b - n_old) * cfg.rlayout.size,
                             ott_cuda_head_block(rviews[il], seq, b, h), cfg.rlayout.size));
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
        for (int32_t i = 0; i < out.n_window; ++i) {
            const size_t r = (size_t)ott_kv_win_row(cfg, win_cap, sc.win_pos0(cfg) + i);
            if (out.window_k) OTT_CUDA_TRY(get(out.window_k + i * hd, L.win_k + (sh_idx * win_cap + r) * hd, row));
            if (out.window_v) OTT_CUDA_TRY(get(out.window_v + i * hd, L.win_v + (sh_idx * win_cap + r) * hd, row));
        }
        return OTT_OK;
    }

    // Used: kv/kv_report.h's accounting (pool counts from the device); allocated: the buffer.
    ott_kv_stats stats() const override {
        const int32_t H = sh.n_head_kv;
        std::vector<int32_t> n_pool((size_t)sh.n_seq_max * H), n_extra(n_pool.size());
        double used      = 0;
        int64_t n_tokens = 0;
        cudaSetDevice(sh.cuda_device);
        for (int il = 0; il < sh.n_layer; ++il) {
            const ott_cuda_kv_layer & L = layers[il];
            if (cfg.traces(il)) {
                cudaMemcpy(n_pool.data(), L.n_pool, n_pool.size() * 4, cudaMemcpyDeviceToHost);
                cudaMemcpy(n_extra.data(), L.n_extra, n_extra.size() * 4, cudaMemcpyDeviceToHost);
            }
            for (int32_t s = 0; s < sh.n_seq_max; ++s) {
                if (sched[s].n_tokens == 0) continue;
                int64_t n_pooled = 0;
                for (int32_t h = 0; h < H && cfg.traces(il); ++h) n_pooled += n_pool[s * H + h] + n_extra[s * H + h];
                used += ott_kv_used_bytes(cfg, il, sched[s], n_pooled);
            }
        }
        for (const ott_kv_sched & sc : sched) n_tokens += sc.n_tokens;
        return ott_kv_stats_of(cfg, used, n_tokens, (int64_t)ggml_backend_buffer_get_size(buf));
    }

private:
    // Offsets (entries) of one launch's items in the uploaded plan.
    struct span {
        size_t off;
        int32_t n;
    };

    struct layer_io {
        ggml_tensor *q, *k, *v, *out;  // out: null when the step attends by flash attention
        int cut;                       // the graph's node count when the layer's q, k, v were added
    };

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

    // An event of the plan as our kernels take it: its window rows start at row0.
    ott_cuda_event event_of(const ott_kv_event & e) const {
        return { e.seq, e.block_idx, e.pos0, ott_kv_win_row(cfg, win_cap, e.pos0) };
    }

    // The plan as launch items (the same for every layer), packed for one upload:
    //   pre[r]     the r-th deferred event of each sequence, before attention
    //   tiles      attention tiles over the stores as they stand after pre
    //   app[r]     each sequence's appends up to its r-th event, then ev[r] those events
    void pack_launches() {
        tiles.clear();
        std::vector<std::vector<ott_cuda_event>> pre(plan.max_events), ev(plan.max_events + 1);
        std::vector<std::vector<ott_cuda_append>> app(plan.max_events + 1);
        int32_t max_rows = 1;
        int64_t max_keys = 0;  // keys a KVQuant tile reads: head-block slots, sink, window, chunk
        for (const ott_kv_step_seq & S : plan.seqs) {
            const ott_kv_sched & sc = S.before;
            const int32_t rows      = S.n_new * n_rep();
            max_rows                = std::max(max_rows, rows);
            max_keys =
                std::max<int64_t>(max_keys, (int64_t)sc.n_blocks * cfg.kvq_geom.block + sc.n_sink + sc.n_win + S.n_new);
            for (int32_t h = 0; h < sh.n_head_kv && !fa_step; ++h) {
                for (int32_t row0 = 0; row0 < rows; row0 += max_tile_rows()) {
                    tiles.push_back({ S.seq, h, S.t0, S.n_new, row0, std::min(max_tile_rows(), rows - row0), sc.n_sink,
                                      sc.n_blocks, sc.n_win, sc.win_pos0(cfg) });
                }
            }
            int32_t n_pre = 0, round = 0, j = 0;
            for (int32_t e = S.ev0; e < S.ev0 + S.n_ev; ++e) {
                const ott_kv_event & E = plan.events[e];
                if (E.after < 0) {
                    pre[n_pre++].push_back(event_of(E));
                    continue;
                }
                for (; j < E.after; ++j) app[round].push_back(append_of(plan.appends[S.app0 + j]));
                ev[round++].push_back(event_of(E));
            }
            for (; j < S.n_app; ++j) app[round].push_back(append_of(plan.appends[S.app0 + j]));
        }
        while (!pre.empty() && pre.back().empty()) pre.pop_back();
        while (!app.empty() && app.back().empty() && ev[app.size() - 1].empty()) app.pop_back();
        // tiles of fewer rows when every tile has fewer (decode: n_rep rows)
        rows_per_tile = std::min(max_tile_rows(), max_rows);
        if (rows_per_tile < max_tile_rows()) {
            for (ott_cuda_attn_tile & t : tiles) t.n_rows = std::min(t.n_rows, rows_per_tile);
        }
        n_splits = cfg.kvq
                       ? ott_cuda_kvq_attn_splits(cfg.kvq_geom, (int32_t)tiles.size(), rows_per_tile, max_keys, n_sm)
                       : ott_cuda_attn_splits(cfg.geom, rows_per_tile, tensor_cores, (int32_t)tiles.size(), n_sm,
                                              plan.max_blocks);

        // pack: tiles | pre rounds | (app, ev) rounds
        packed.clear();
        auto put = [&](const void * p, size_t n_items, size_t item) {
            const size_t off = (packed.size() + 15) / 16 * 16;
            packed.resize(off + n_items * item);
            if (n_items) std::memcpy(packed.data() + off, p, n_items * item);
            return span { off, (int32_t)n_items };
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

    // An append of the plan as our kernels take it: a sink row, or -(ring row) - 1.
    ott_cuda_append append_of(const ott_kv_append & a) const {
        return { a.tok, a.seq, a.sink_row >= 0 ? a.sink_row : -ott_kv_win_row(cfg, win_cap, a.pos) - 1 };
    }

    int32_t n_rep() const { return std::max(1, n_head / sh.n_head_kv); }

    // Query rows of an attention tile, at most (KVQuant's: its kernels take groups of up to 16).
    int32_t max_tile_rows() const { return cfg.kvq ? OTT_CUDA_KVQ_ROWS : OTT_CUDA_ATTN_ROWS; }

    static ott_cuda_f32_3d view_of(const ggml_tensor * t) {
        return { (const float *)t->data, (int64_t)(t->nb[1] / sizeof(float)), (int64_t)(t->nb[2] / sizeof(float)) };
    }

    template <typename T> const T * items(const span & s) const { return (const T *)(d_plan + s.off); }

    ott_kv_config cfg;
    ott_kv_shape sh;
    int32_t win_cap    = 0;  // window ring rows per (sequence, KV head)
    int32_t max_blocks = 0;  // blocks a sequence holds at most
    // Of them, the recent ones at most, in the ring (kv/kv_report.cpp counts the same bytes).
    int32_t n_recent() const { return cfg.n_recent(max_blocks); }
    // OTT's keys before RoPE (KVQuant's have their own table, kvq_rope)
    bool ott_rope() const { return cfg.pre_rope && !cfg.kvq; }
    std::vector<ott_kv_sched> sched;        // [n_seq_max]
    std::vector<ott_cuda_kv_layer> layers;  // [n_layer] device pointers into buf
    std::vector<ott_cuda_kv_layer> rviews;  // [n_layer] their recent views (cfg.recent > 0)
    ott_fp16 * recode_scratch = nullptr;    // the events' re-coding rows (ott_cuda_kv_event)
    ggml_backend_buffer_t buf = nullptr;

    cudaStream_t stream  = nullptr;  // sequence copies and resets, outside steps
    cudaStream_t side    = nullptr;  // a step's appends and events (not KVQuant's)
    cudaEvent_t ev_attn  = nullptr;  // a layer's attention is done (on the executor's stream)
    cudaEvent_t ev_side  = nullptr;  // the last layer's appends and events are done
    cudaStream_t aux     = nullptr;  // a layer's recent blocks' attention, beside its old blocks'
    cudaEvent_t ev_fork  = nullptr;  // the layer's attention may start (on the executor's stream)
    cudaEvent_t ev_join  = nullptr;  // its recent blocks' partials are written (on aux)
    int n_sm             = 1;
    int32_t tensor_cores = 0;      // 1 on sm_80+ (ott_cuda_attn_args::tensor_cores)
    bool flash_attn      = false;  // ggml's flash attention serves this head size (not KVQuant)

    // the step being built and run
    ott_kv_plan plan;  // kv/kv_schedule.h
    std::vector<ott_cuda_attn_tile> tiles;
    int32_t rows_per_tile = 1, n_splits = 1, n_head = 1;
    float kq_scale = 1.0f;
    std::vector<uint8_t> packed;  // launch items, uploaded once per step
    span tiles_span {};
    std::vector<span> pre_spans;
    std::vector<std::pair<span, span>> round_spans;                    // (appends, events)
    std::vector<layer_io> io;                                          // [n_layer]
    bool fa_step = false;                                              // the step attends by flash attention
    ott_cuda_gather gather {};                                         // what run_layer gathers for it
    ggml_tensor *fa_k = nullptr, *fa_v = nullptr, *fa_mask = nullptr;  // its inputs

    uint8_t * d_plan    = nullptr;
    size_t plan_cap     = 0;
    float * d_partials  = nullptr;
    size_t partials_cap = 0;  // floats

    // KVQuant (in buf): tables [n_layer][n_head_kv], the RoPE table (cs null: keys cached after
    // RoPE), event scratch for n_seq_max x n_head_kv blocks
    ott_kvq_tables * kvq_tabs = nullptr;
    ott_rope_table kvq_rope {};
    uint8_t * kvq_scratch = nullptr;
};

}  // namespace

ott_status ott_kv_quant_cuda_create(const ott_kv_config & cfg, const ott_kv_shape & shape,
                                    std::unique_ptr<ott_kv_cache> & out) {
    if (cfg.geom.key_axis) {
        return ott_fail(OTT_ERR_UNSUPPORTED,
                        "kv config on CUDA: key_axis=1 (per-token key groups) runs on the CPU only");
    }
    if (cfg.pre_rope && !cfg.kvq && cfg.rope_n_rot != cfg.geom.head_dim) {
        return ott_fail(OTT_ERR_UNSUPPORTED,
                        "kv config on CUDA: pre_rope=1 needs RoPE over the whole head (n_rot %d, head_dim %d); "
                        "use pre_rope=0",
                        cfg.rope_n_rot, cfg.geom.head_dim);
    }
    for (const ott_kv_geom * g : { &cfg.geom, cfg.recent ? &cfg.rgeom : nullptr }) {
        // KVQuant: any geometry
        const char * why = !g || cfg.kvq ? nullptr : ott_cuda_attn_unsupported(*g, cfg.pre_rope);
        if (why) {
            return ott_fail(OTT_ERR_UNSUPPORTED,
                            "kv config on CUDA: %s (%shead_dim %d, block %d, bits %d/%d, groups %d/%d)", why,
                            g == &cfg.rgeom ? "recent blocks: " : "", g->head_dim, g->block, g->bits_k, g->bits_v,
                            g->group_k, g->group_v);
        }
    }
    auto c = std::make_unique<kv_quant_cuda>(cfg, shape);
    OTT_TRY(c->init());
    out = std::move(c);
    return OTT_OK;
}
