// kv_cache.h — the KV cache interface every cache mode implements, and the ubatch it sees.
//
// Per layer and per sequence a cache appends the K/V of new tokens, attends queries over
// everything the sequence holds, truncates or clears a sequence and reports its bytes.
// The graph builder calls, per ubatch:
//   begin(ub)            validate capacity, plan the step
//   build_inputs(ctx)    create the step's input tensors (indices, masks) in the graph
//   build_attn(...)      once per layer: store K/V, return the attention output
//   set_inputs()         after allocation: fill the input tensors
//   compute(backend, gf) run the step's graph (and the cache's own kernels, if any)
//   commit()             after a successful compute: sequences grow
#pragma once

#include "common.h"
#include "model.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <memory>
#include <vector>

// A run: sequences seq0 .. seq0+n_seqs-1, each contributing n_tokens consecutive tokens,
// laid out sequence-major in the ubatch from token t0.
struct ott_run {
    int32_t seq0;
    int32_t n_seqs;
    int32_t n_tokens;
    int32_t t0;
};

struct ott_ubatch {
    std::vector<int32_t> token;     // [n_tokens]
    std::vector<int32_t> pos;       // [n_tokens]
    std::vector<int32_t> seq_id;    // [n_tokens]
    std::vector<int32_t> out_idx;   // ubatch indices whose logits are returned, in order
    std::vector<ott_run> runs;      // covering every token, in token order

    int32_t n_tokens() const { return (int32_t) token.size(); }
};

class ott_kv_cache {
public:
    virtual ~ott_kv_cache() = default;

    virtual ott_status begin(const ott_ubatch & ub) = 0;
    virtual void build_inputs(ggml_context * ctx) = 0;
    // q: F32 [n_embd_head, n_head,    n_tokens] (rotated)
    // k: F32 [n_embd_head, n_head_kv, n_tokens] (rotated)
    // v: F32 [n_embd_head, n_head_kv, n_tokens]
    // returns F32 [n_embd_head*n_head, n_tokens]
    virtual ggml_tensor * build_attn(ggml_context * ctx, ggml_cgraph * gf, int il,
                                     ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, float kq_scale) = 0;
    virtual void set_inputs() = 0;
    // The default runs the whole graph on the backend. A cache whose attention runs outside
    // ggml (the CUDA quantized cache: ggml-cuda has no custom ops, DESIGN §1) runs the graph
    // in segments and launches its kernels between them.
    virtual ott_status compute(ggml_backend_t backend, ggml_cgraph * gf) {
        if (ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS) {
            return ott_fail(OTT_ERR_BACKEND, "graph computation failed");
        }
        return OTT_OK;
    }
    virtual void commit() = 0;

    virtual int32_t    seq_len(int32_t seq) const = 0;
    virtual ott_status seq_truncate(int32_t seq, int32_t n_keep) = 0;
    // dst becomes a copy of src (src != dst, both valid).
    virtual ott_status seq_copy(int32_t src, int32_t dst) {
        return ott_fail(OTT_ERR_UNSUPPORTED, "this KV cache mode cannot copy sequences on this backend");
    }
    virtual ott_kv_stats stats() const = 0;

    // Appends until the next quantization event of sequence seq; 0: the cache never quantizes.
    virtual int32_t tokens_until_event(int32_t seq) const { return 0; }
    // Copy of the stores of one KV head (ott.h: ott_kv_export); quantized caches only.
    virtual ott_status export_head(int il, int32_t seq, int32_t head, ott_kv_head_state & out) const {
        return ott_fail(OTT_ERR_UNSUPPORTED, "the fp16 KV cache has no quantized stores to export");
    }
};

struct ott_kv_shape {
    int32_t n_layer;
    int32_t n_head_kv;
    int32_t n_embd_head;
    int32_t n_ctx;       // tokens per sequence
    int32_t n_seq_max;
    ggml_backend_buffer_type_t buft;  // memory of the context's backend, where stores live
    int32_t cuda_device;              // the backend's CUDA device; -1: the CPU backend
};

// Create the cache selected by params.type; reports unsupported or invalid settings.
ott_status ott_kv_cache_create(const ott_kv_params & params, const ott_kv_shape & shape,
                               std::unique_ptr<ott_kv_cache> & out);

// The fp16 cache (kv_f16.cpp).
ott_status ott_kv_f16_create(const ott_kv_shape & shape, std::unique_ptr<ott_kv_cache> & out);
// The quantized cache, KIVI and OTT modes (kv_ott.cpp); validates every knob.
ott_status ott_kv_ott_create(const ott_kv_params & params, const ott_kv_shape & shape, std::unique_ptr<ott_kv_cache> & out);
// The same cache in the memory of a CUDA device, attention and events by our kernels
// (kv_ott_cuda.cpp; builds with OTT_CUDA only).
ott_status ott_kv_ott_cuda_create(const ott_kv_params & params, const ott_kv_shape & shape, std::unique_ptr<ott_kv_cache> & out);
