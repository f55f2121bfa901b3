// context.cpp — a decoding context: the model's backend (CPU with a thread pool, or CUDA),
// KV cache, and ott_decode, which splits a batch into ubatches of runs, builds one graph per
// ubatch, computes it (segment by segment around the cache's kernels when its attention is
// external, cuda/executor.h) and collects the logits.
#include "arch/graph.h"
#include "finite_check.h"
#include "kv/kv_calib.h"
#include "kv/kv_layered.h"
#include "kv/kv_rotation.h"
#include "kv/kv_schedule.h"
#ifdef OTT_USE_CUDA
#include "cuda/executor.h"
#endif

#include "ggml-alloc.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <new>
#include <string>

struct ott_context {
    ott_model * model = nullptr;
    ott_context_params params {};

    ggml_backend_t backend       = nullptr;
    ggml_threadpool * threadpool = nullptr;
    ggml_gallocr_t galloc        = nullptr;
    std::vector<uint8_t> graph_meta;  // memory for graph headers
    std::unique_ptr<ott_kv_cache> kv;
    std::unique_ptr<ott_kv_rotation> rot;  // rotations around the cache, or null
#ifdef OTT_USE_CUDA
    ott_cuda_executor * executor = nullptr;  // when the cache's attention is external
#endif

    // [n_outputs, n_vocab]: in the device's host buffer type where it has one (pinned
    // memory on CUDA, which the GPU writes straight into), else in a CPU buffer
    ggml_backend_buffer_t logits_buf = nullptr;
    float * logits                   = nullptr;
    int32_t n_outputs                = 0;

    bool profile = false;  // ott_set_profile
    ott_profile prof {};
    std::vector<uint8_t> prof_meta;  // memory for the segment graph's header

    ~ott_context() {
#ifdef OTT_USE_CUDA
        if (executor) ott_cuda_executor_free(executor);
#endif
        kv.reset();
        rot.reset();
        if (galloc) ggml_gallocr_free(galloc);
        if (logits_buf) ggml_backend_buffer_free(logits_buf);
        if (backend) ggml_backend_free(backend);
        if (threadpool) ggml_threadpool_free(threadpool);
    }
};

namespace {

// Room for n logits; their buffer grows to what a step needs and never shrinks. Pinned
// memory where the device has it and can give it, else ordinary memory.
ott_status reserve_logits(ott_context * c, size_t n) {
    const size_t bytes = std::max<size_t>(n * sizeof(float), 4096);
    if (c->logits_buf && ggml_backend_buffer_get_size(c->logits_buf) >= bytes) return OTT_OK;
    ggml_backend_buffer_type_t pinned = ggml_backend_dev_host_buffer_type(ggml_backend_get_device(c->backend));
    ggml_backend_buffer_t buf         = pinned ? ggml_backend_buft_alloc_buffer(pinned, bytes) : nullptr;
    if (!buf) buf = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), bytes);
    if (!buf) return ott_fail(OTT_ERR_ALLOC, "cannot allocate %zu bytes for the logits", bytes);
    if (c->logits_buf) ggml_backend_buffer_free(c->logits_buf);
    c->logits_buf = buf;
    c->logits     = (float *)ggml_backend_buffer_get_base(buf);
    return OTT_OK;
}

// A sequence id of the context, or one line saying why not.
ott_status check_seq(const ott_context * c, int32_t seq) {
    if (seq < 0 || seq >= c->params.n_seq_max) {
        return ott_fail(OTT_ERR_INVALID_ARG, "sequence id %d is outside [0, %d)", seq, c->params.n_seq_max);
    }
    return OTT_OK;
}

ott_status set_threads(ott_context * c, int32_t n_threads) {
    if (n_threads <= 0) n_threads = ott_physical_cores();
    if (n_threads > 512) return ott_fail(OTT_ERR_INVALID_ARG, "n_threads = %d is too large", n_threads);
    if (c->model->cuda_device >= 0) {  // the graph runs on the GPU; nothing to thread
        c->params.n_threads = n_threads;
        return OTT_OK;
    }
    ggml_threadpool_params tpp = ggml_threadpool_params_default(n_threads);
    ggml_threadpool * tp       = ggml_threadpool_new(&tpp);
    if (!tp) return ott_fail(OTT_ERR_BACKEND, "cannot create a thread pool of %d threads", n_threads);
    ggml_backend_cpu_set_threadpool(c->backend, tp);
    ggml_backend_cpu_set_n_threads(c->backend, n_threads);
    if (c->threadpool) ggml_threadpool_free(c->threadpool);
    c->threadpool       = tp;
    c->params.n_threads = n_threads;
    return OTT_OK;
}

// Check the batch and return, per sequence, the batch indices of its tokens in order.
ott_status validate_batch(const ott_context * c, const ott_batch * b, std::vector<std::vector<int32_t>> & per_seq) {
    if (!b || b->n_tokens <= 0 || !b->token || !b->pos || !b->seq_id) {
        return ott_fail(OTT_ERR_INVALID_ARG, "empty batch or missing token/pos/seq_id arrays");
    }
    const int32_t n_vocab = c->model->hparams.n_vocab;
    per_seq.assign(c->params.n_seq_max, {});
    for (int32_t i = 0; i < b->n_tokens; ++i) {
        const int32_t s = b->seq_id[i];
        if (check_seq(c, s) != OTT_OK) return ott_fail(OTT_ERR_INVALID_ARG, "batch token %d: %s", i, ott_last_error());
        if (b->token[i] < 0 || b->token[i] >= n_vocab) {
            return ott_fail(OTT_ERR_INVALID_ARG, "batch token %d: id %d is outside the vocabulary [0, %d)", i,
                            b->token[i], n_vocab);
        }
        const int32_t want = c->kv->seq_len(s) + (int32_t)per_seq[s].size();
        if (b->pos[i] != want) {
            return ott_fail(OTT_ERR_INVALID_ARG,
                            "batch token %d: position %d does not continue sequence %d (expected %d)", i, b->pos[i], s,
                            want);
        }
        per_seq[s].push_back(i);
    }
    for (int32_t s = 0; s < c->params.n_seq_max; ++s) {
        OTT_TRY(ott_kv_check_fits(s, c->kv->seq_len(s), (int32_t)per_seq[s].size(), c->params.n_ctx));
    }
    return OTT_OK;
}

// The rotations around the cache that p asks for (kv/kv_rotation.h), on buft.
ott_status make_rotation(ott_context * c, const ott_kv_params & p, ggml_backend_buffer_type_t buft) {
    if (p.rot_k == OTT_KV_ROT_NONE && p.rot_v == OTT_KV_ROT_NONE) return OTT_OK;
    const ott_hparams & hp = c->model->hparams;
    const int32_t hd       = hp.n_embd_head;
    std::vector<ott_kv_rot_layer> layers(hp.n_layer);
    if (p.rot_k == OTT_KV_ROT_CALIBRATED || p.rot_v == OTT_KV_ROT_CALIBRATED) {
        OTT_TRY(ott_kv_calib_load(p.calib_path, *c->model, p.rot_k == OTT_KV_ROT_CALIBRATED,
                                  p.rot_v == OTT_KV_ROT_CALIBRATED, layers));
    }
    for (int il = 0; il < hp.n_layer; ++il) {
        for (bool values : { false, true }) {
            if ((values ? p.rot_v : p.rot_k) != OTT_KV_ROT_HADAMARD) continue;
            std::vector<float> & s = values ? layers[il].s_v : layers[il].s_k;
            s.resize((size_t)hp.n_head_kv * hd);
            for (int h = 0; h < hp.n_head_kv; ++h) ott_kv_hadamard_signs(hd, il, h, values, s.data() + (size_t)h * hd);
        }
    }
    return ott_kv_rotation_create(layers, hp.n_head_kv, hp.n_head, hd, buft, c->rot);
}

// Compute a step's graph: whole, or segment by segment around the cache's kernels.
ott_status compute_graph(ott_context * c, ggml_cgraph * gf) {
#ifdef OTT_USE_CUDA
    if (c->kv->external_attention()) {
        if (!c->executor) OTT_TRY(ott_cuda_executor_create(c->backend, c->model->cuda_device, &c->executor));
        return ott_cuda_executor_compute(c->executor, c->backend, gf, *c->kv, c->model->hparams.n_layer);
    }
#endif
    if (ggml_backend_graph_compute(c->backend, gf) != GGML_STATUS_SUCCESS) {
        return ott_fail(OTT_ERR_BACKEND, "graph computation failed");
    }
    return OTT_OK;
}

// Take the next ubatch: sequences in id order, each with up to n_ubatch of its remaining
// tokens, while they fit; neighbouring sequences with equal chunks share a run.
void next_ubatch(const ott_batch * b, const std::vector<std::vector<int32_t>> & per_seq, std::vector<size_t> & cursor,
                 int32_t n_ubatch, ott_ubatch & ub, std::vector<int32_t> & ub_src) {
    ub = ott_ubatch {};
    ub_src.clear();
    for (int32_t s = 0; s < (int32_t)per_seq.size(); ++s) {
        const size_t rem = per_seq[s].size() - cursor[s];
        if (rem == 0) continue;
        const int32_t chunk = (int32_t)std::min(rem, (size_t)n_ubatch);
        if (ub.n_tokens() + chunk > n_ubatch) break;
        ott_run * last = ub.runs.empty() ? nullptr : &ub.runs.back();
        if (last && last->seq0 + last->n_seqs == s && last->n_tokens == chunk) {
            last->n_seqs++;
        } else {
            ub.runs.push_back({ s, 1, chunk, ub.n_tokens() });
        }
        for (int32_t j = 0; j < chunk; ++j) {
            const int32_t i = per_seq[s][cursor[s] + j];
            const bool want = b->logits ? b->logits[i] != 0 : i == b->n_tokens - 1;
            if (want) ub.out_idx.push_back(ub.n_tokens());
            ub.token.push_back(b->token[i]);
            ub.pos.push_back(b->pos[i]);
            ub.seq_id.push_back(s);
            ub_src.push_back(i);
        }
        cursor[s] += chunk;
    }
}

// The profile counter a node's time goes to (ott_profile): by the node's name.
double & profile_slot(ott_profile & p, const ggml_tensor * node) {
    const char * name = ggml_get_name(node);
    if (strncmp(name, "kv_append", 9) == 0) return p.append_ms;
    if (strncmp(name, "kv_rot", 6) == 0) return p.rotate_ms;
    if (strncmp(name, "kq", 2) == 0) return p.attn_ms;
    return p.other_ms;
}

// Compute gf as consecutive runs of nodes of one profile kind, each timed on its own.
ott_status compute_profiled(ott_context * c, ggml_cgraph * gf) {
    const int n = ggml_graph_n_nodes(gf);
    c->prof_meta.resize(ggml_graph_overhead_custom(n, false));
    ggml_init_params ip = { c->prof_meta.size(), c->prof_meta.data(), true };
    ggml_context * pctx = ggml_init(ip);
    std::unique_ptr<ggml_context, decltype(&ggml_free)> guard(pctx, ggml_free);
    ggml_cgraph * seg = ggml_new_graph_custom(pctx, n, false);
    for (int i0 = 0; i0 < n;) {
        double & slot = profile_slot(c->prof, ggml_graph_node(gf, i0));
        ggml_graph_clear(seg);
        int i1 = i0;
        for (; i1 < n && &profile_slot(c->prof, ggml_graph_node(gf, i1)) == &slot; ++i1) {
            ggml_graph_add_node(seg, ggml_graph_node(gf, i1));
        }
        const auto t0 = std::chrono::steady_clock::now();
        if (ggml_backend_graph_compute(c->backend, seg) != GGML_STATUS_SUCCESS) {
            return ott_fail(OTT_ERR_BACKEND, "graph compute failed (nodes %d..%d, profiling)", i0, i1 - 1);
        }
        slot += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        i0 = i1;
    }
    c->prof.n_ubatches++;
    return OTT_OK;
}

ott_status fail_nonfinite(ott_context * c, ggml_cgraph * gf, ott_graph_builder & b) {
    if (c->kv->external_attention()) {  // the graph runs in segments around our CUDA kernels
        return ott_fail(OTT_ERR_BACKEND, "the logits are not finite (NaN or infinite)");
    }
    b.set_inputs();  // the allocator reused the inputs' memory once they were consumed
    int32_t il = -1;
    OTT_TRY(ott_first_nonfinite_layer(c->backend, gf, &il));
    if (il < 0)
        return ott_fail(OTT_ERR_BACKEND, "the logits are not finite (NaN or infinite) though every layer's output is: "
                                         "check the output norm and matrix");
    return ott_fail(
        OTT_ERR_BACKEND,
        "the logits are not finite: layer %d is the first whose output holds a NaN or an infinity (check its weights)",
        il);
}

ott_status compute_ubatch(ott_context * c, const ott_ubatch & ub, const std::vector<int32_t> & ub_src,
                          const std::vector<int32_t> & out_row) {
    OTT_TRY(c->kv->begin(ub));

    const size_t max_nodes = ott_graph_max_nodes(*c->model, ub, c->rot != nullptr);
    c->graph_meta.resize(ggml_tensor_overhead() * max_nodes + ggml_graph_overhead_custom(max_nodes, false));
    ggml_init_params ip = { c->graph_meta.size(), c->graph_meta.data(), true };
    ggml_context * gctx = ggml_init(ip);
    std::unique_ptr<ggml_context, decltype(&ggml_free)> guard(gctx, ggml_free);
    ggml_cgraph * gf = ggml_new_graph_custom(gctx, max_nodes, false);

    ott_graph_builder b { *c->model, ub, *c->kv, c->rot.get(), c->model->rope_factors(c->params.n_ctx), gctx, gf };
    b.build_inputs();
    ggml_tensor * logits = ott_build_graph(b);
    ggml_build_forward_expand(gf, logits);

    if (c->model->cuda_device >= 0) {  // ggml-cuda aborts on an op it lacks: refuse it here
        for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
            const ggml_tensor * node = ggml_graph_node(gf, i);
            if (!ggml_backend_supports_op(c->backend, node)) {
                return ott_fail(OTT_ERR_UNSUPPORTED, "%s cannot compute node '%s' (%s%s%s)",
                                ggml_backend_name(c->backend), ggml_get_name(node), ggml_op_desc(node),
                                node->op == GGML_OP_FLASH_ATTN_EXT ? ", head_dim " : "",
                                node->op == GGML_OP_FLASH_ATTN_EXT ? std::to_string(node->src[0]->ne[0]).c_str() : "");
            }
        }
    }
    if (!ggml_gallocr_alloc_graph(c->galloc, gf)) {
        return ott_fail(OTT_ERR_ALLOC, "cannot allocate the compute buffer for %d tokens", ub.n_tokens());
    }
    b.set_inputs();
    OTT_TRY(c->profile ? compute_profiled(c, gf) : compute_graph(c, gf));

    // logits rows go to their batch rows; consecutive rows are fetched in one copy
    const int32_t n_vocab  = c->model->hparams.n_vocab;
    const size_t row_bytes = (size_t)n_vocab * sizeof(float);
    bool finite            = true;
    for (size_t j = 0; j < ub.out_idx.size();) {
        const int32_t row = out_row[ub_src[ub.out_idx[j]]];
        size_t n          = 1;
        while (j + n < ub.out_idx.size() && out_row[ub_src[ub.out_idx[j + n]]] == row + (int32_t)n) ++n;
        float * dst = c->logits + (size_t)row * n_vocab;
        ggml_backend_tensor_get(logits, dst, j * row_bytes, n * row_bytes);
        finite = finite && ott_all_finite(dst, n * (size_t)n_vocab);
        j += n;
    }
    // NaN or infinite logits (NaN weights, an overflow): the step is not committed, so the
    // sequences keep their length, and the error names the first layer that produced them
    if (!finite) return fail_nonfinite(c, gf, b);
    c->kv->commit();
    return OTT_OK;
}

// The KV cache's shape for a context of n_ctx tokens and n_seq_max sequences.
ott_kv_shape kv_shape_of(const ott_model * model, int32_t n_ctx, int32_t n_seq_max, ggml_backend_buffer_type_t buft) {
    const ott_hparams & hp = model->hparams;
    ott_kv_shape shape {};
    shape.n_layer     = hp.n_layer;
    shape.n_head_kv   = hp.n_head_kv;
    shape.n_embd_head = hp.n_embd_head;
    shape.n_ctx       = n_ctx;
    shape.n_seq_max   = n_seq_max;
    shape.buft        = buft;
    shape.cuda_device = model->cuda_device;
    shape.rope_n_rot  = hp.n_rot;
    shape.rope_neox   = hp.rope_type == GGML_ROPE_TYPE_NEOX;
    shape.rope_plain =
        hp.rope_ext_factor == 0.0f && hp.rope_attn_factor == 1.0f && model->rope_factors(n_ctx) == nullptr;
    shape.rope_freq_base  = hp.rope_freq_base;
    shape.rope_freq_scale = hp.rope_freq_scale;
    return shape;
}

// A sliding-window layer is local (an fp16 ring of the window) when its window is shorter
// than the context; otherwise the window never masks anything and the layer is global.
std::vector<uint8_t> local_layers(const ott_hparams & hp, int32_t n_ctx) {
    std::vector<uint8_t> local(hp.n_layer, 0);
    for (int il = 0; il < hp.n_layer; ++il) local[il] = hp.is_swa(il) && hp.n_swa < n_ctx;
    return local;
}

}  // namespace

extern "C" ott_status ott_context_init(ott_model * model, const ott_context_params * params, ott_context ** out) {
    if (!model || !params || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_context_init: null argument");
    *out                   = nullptr;
    const ott_hparams & hp = model->hparams;

    auto c = std::unique_ptr<ott_context>(new (std::nothrow) ott_context());
    if (!c) return ott_fail(OTT_ERR_ALLOC, "out of memory creating a context");
    c->model  = model;
    c->params = *params;
    if (c->params.n_ctx <= 0) c->params.n_ctx = hp.n_ctx_train;
    if (c->params.n_ctx > (1 << 24)) return ott_fail(OTT_ERR_INVALID_ARG, "n_ctx = %d is too large", c->params.n_ctx);
    if (c->params.n_seq_max <= 0 || c->params.n_seq_max > 4096) {
        return ott_fail(OTT_ERR_INVALID_ARG, "n_seq_max = %d must be in [1, 4096]", c->params.n_seq_max);
    }
    if (c->params.n_ubatch <= 0 || c->params.n_ubatch > 8192) {
        return ott_fail(OTT_ERR_INVALID_ARG, "n_ubatch = %d must be in [1, 8192]", c->params.n_ubatch);
    }

    c->backend = ggml_backend_dev_init(model->dev, nullptr);
    if (!c->backend)
        return ott_fail(OTT_ERR_BACKEND, "cannot initialise the %s backend", ggml_backend_dev_name(model->dev));
    OTT_TRY(set_threads(c.get(), params->n_threads));
    ggml_backend_buffer_type_t buft = ggml_backend_get_default_buffer_type(c->backend);
    c->galloc                       = ggml_gallocr_new(buft);

    const ott_kv_shape shape = kv_shape_of(model, c->params.n_ctx, c->params.n_seq_max, buft);
    OTT_TRY(ott_kv_layered_create(params->kv, shape, local_layers(hp, c->params.n_ctx), hp.n_swa, c->params.n_ubatch,
                                  c->kv));
    OTT_TRY(make_rotation(c.get(), params->kv, buft));
    *out = c.release();
    return OTT_OK;
}

extern "C" void ott_context_free(ott_context * ctx) { delete ctx; }

extern "C" ott_status ott_kv_seq_bytes(const ott_model * model, const ott_context_params * params, int64_t * out) {
    if (!model || !params || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_kv_seq_bytes: null argument");
    const ott_hparams & hp = model->hparams;
    const int32_t n_ctx    = params->n_ctx <= 0 ? hp.n_ctx_train : params->n_ctx;
    if (n_ctx > (1 << 24)) return ott_fail(OTT_ERR_INVALID_ARG, "n_ctx = %d is too large", n_ctx);
    if (params->n_ubatch <= 0 || params->n_ubatch > 8192) {
        return ott_fail(OTT_ERR_INVALID_ARG, "n_ubatch = %d must be in [1, 8192]", params->n_ubatch);
    }
    return ott_kv_layered_seq_bytes(params->kv, kv_shape_of(model, n_ctx, 1, nullptr), local_layers(hp, n_ctx),
                                    hp.n_swa, params->n_ubatch, *out);
}

extern "C" ott_status ott_context_set_threads(ott_context * ctx, int32_t n_threads) {
    if (!ctx) return ott_fail(OTT_ERR_INVALID_ARG, "ott_context_set_threads: null context");
    return set_threads(ctx, n_threads);
}

// One batch: validated, split into ubatches, each computed; on failure every sequence is
// left as it was.
static ott_status decode_batch(ott_context * c, const ott_batch * b) {
    c->n_outputs = 0;
    std::vector<std::vector<int32_t>> per_seq;
    OTT_TRY(validate_batch(c, b, per_seq));

    // output row of each batch token (batch order), -1 when it returns no logits
    std::vector<int32_t> out_row(b->n_tokens, -1);
    int32_t n_out = 0;
    for (int32_t i = 0; i < b->n_tokens; ++i) {
        if (b->logits ? b->logits[i] != 0 : i == b->n_tokens - 1) out_row[i] = n_out++;
    }
    OTT_TRY(reserve_logits(c, (size_t)n_out * c->model->hparams.n_vocab));

    std::vector<int32_t> len_before(c->params.n_seq_max);
    for (int32_t s = 0; s < c->params.n_seq_max; ++s) len_before[s] = c->kv->seq_len(s);

    std::vector<size_t> cursor(per_seq.size(), 0);
    ott_ubatch ub;
    std::vector<int32_t> ub_src;
    for (;;) {
        next_ubatch(b, per_seq, cursor, c->params.n_ubatch, ub, ub_src);
        if (ub.n_tokens() == 0) break;
        const ott_status st = compute_ubatch(c, ub, ub_src, out_row);
        if (st != OTT_OK) {  // leave every sequence as it was before this call
            for (int32_t s = 0; s < c->params.n_seq_max; ++s) c->kv->seq_truncate(s, len_before[s]);
            return st;
        }
    }
    c->n_outputs = n_out;
    return OTT_OK;
}

// The batch, then the CPU thread pool put to sleep: its workers would otherwise spin for a
// while waiting for the next graph, taking cores from other contexts of the process (and
// from the caller between steps); the next graph wakes them.
extern "C" ott_status ott_decode(ott_context * c, const ott_batch * b) {
    if (!c) return ott_fail(OTT_ERR_INVALID_ARG, "ott_decode: null context");
    const ott_status st = decode_batch(c, b);
    if (c->threadpool) ggml_threadpool_pause(c->threadpool);
    return st;
}

extern "C" ott_status ott_get_logits(ott_context * ctx, const float ** out, int32_t * n_outputs) {
    if (!ctx || !out || !n_outputs) return ott_fail(OTT_ERR_INVALID_ARG, "ott_get_logits: null argument");
    *out       = ctx->logits;
    *n_outputs = ctx->n_outputs;
    return OTT_OK;
}

extern "C" ott_status ott_seq_len(const ott_context * ctx, int32_t seq_id, int32_t * out) {
    if (!ctx || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_seq_len: null argument");
    OTT_TRY(check_seq(ctx, seq_id));
    *out = ctx->kv->seq_len(seq_id);
    return OTT_OK;
}

extern "C" ott_status ott_seq_truncate(ott_context * ctx, int32_t seq_id, int32_t n_keep) {
    if (!ctx) return ott_fail(OTT_ERR_INVALID_ARG, "ott_seq_truncate: null context");
    OTT_TRY(check_seq(ctx, seq_id));
    if (n_keep < 0) return ott_fail(OTT_ERR_INVALID_ARG, "n_keep = %d is negative", n_keep);
    return ctx->kv->seq_truncate(seq_id, n_keep);
}

extern "C" ott_status ott_seq_copy(ott_context * ctx, int32_t src, int32_t dst) {
    if (!ctx) return ott_fail(OTT_ERR_INVALID_ARG, "ott_seq_copy: null context");
    for (int32_t s : { src, dst }) OTT_TRY(check_seq(ctx, s));
    if (src == dst) return OTT_OK;
    return ctx->kv->seq_copy(src, dst);
}

extern "C" ott_status ott_seq_tokens_until_event(const ott_context * ctx, int32_t seq_id, int32_t * out) {
    if (!ctx || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_seq_tokens_until_event: null argument");
    OTT_TRY(check_seq(ctx, seq_id));
    *out = ctx->kv->tokens_until_event(seq_id);
    return OTT_OK;
}

extern "C" ott_status ott_kv_export(const ott_context * ctx, int32_t il, int32_t seq_id, int32_t head,
                                    ott_kv_head_state * out) {
    if (!ctx || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_kv_export: null argument");
    const ott_hparams & hp = ctx->model->hparams;
    if (il < 0 || il >= hp.n_layer || seq_id < 0 || seq_id >= ctx->params.n_seq_max || head < 0 ||
        head >= hp.n_head_kv) {
        return ott_fail(OTT_ERR_INVALID_ARG,
                        "ott_kv_export: layer %d, sequence %d, KV head %d outside [0, %d) x [0, %d) x [0, %d)", il,
                        seq_id, head, hp.n_layer, ctx->params.n_seq_max, hp.n_head_kv);
    }
    return ctx->kv->export_head(il, seq_id, head, *out);
}

extern "C" ott_status ott_get_kv_stats(const ott_context * ctx, ott_kv_stats * out) {
    if (!ctx || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_get_kv_stats: null argument");
    *out = ctx->kv->stats();
    return OTT_OK;
}

extern "C" ott_status ott_set_profile(ott_context * ctx, int32_t on) {
    if (!ctx) return ott_fail(OTT_ERR_INVALID_ARG, "ott_set_profile: null context");
    if (on && ctx->model->cuda_device >= 0) {
        return ott_fail(OTT_ERR_UNSUPPORTED, "profiling runs on the CPU backend only (this context runs on %s)",
                        ggml_backend_name(ctx->backend));
    }
    if (on) ctx->prof = ott_profile {};
    ctx->profile = on != 0;
    return OTT_OK;
}

extern "C" ott_status ott_get_profile(const ott_context * ctx, ott_profile * out) {
    if (!ctx || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_get_profile: null argument");
    *out = ctx->prof;
    return OTT_OK;
}
