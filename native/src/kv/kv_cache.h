// kv_cache.h — the KV cache interface every cache mode implements, and the ubatch it sees.
//
// Per layer and per sequence a cache appends the K/V of new tokens, attends queries over
// everything the sequence holds, truncates or clears a sequence and reports its bytes.
// The graph builder calls, per ubatch:
//   begin(ub)            validate capacity, plan the step
//   build_inputs(ctx)    create the step's input tensors (indices, masks) in the graph
//   build_attn(...)      once per layer: store K/V, return the attention output
//   set_inputs()         after allocation: fill the input tensors
//   (the context computes the graph; see external_attention)
//   commit()             after a successful compute: sequences grow
// The context checks beforehand that every sequence has room for its tokens.
#pragma once

#include "common.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <memory>
#include <vector>

struct ott_kv_config;

// A run: sequences seq0 .. seq0+n_seqs-1, each contributing n_tokens consecutive tokens,
// laid out sequence-major in the ubatch from token t0.
struct ott_run {
    int32_t seq0;
    int32_t n_seqs;
    int32_t n_tokens;
    int32_t t0;
};

// A CUDA stream (cudaStream_t), named without the CUDA headers.
struct CUstream_st;

struct ott_ubatch {
    std::vector<int32_t> token;    // [n_tokens]
    std::vector<int32_t> pos;      // [n_tokens]
    std::vector<int32_t> seq_id;   // [n_tokens]
    std::vector<int32_t> out_idx;  // ubatch indices whose logits are returned, in order
    std::vector<ott_run> runs;     // covering every token, in token order

    int32_t n_tokens() const { return (int32_t)token.size(); }
};

class ott_kv_cache {
public:
    virtual ~ott_kv_cache() = default;

    virtual ott_status begin(const ott_ubatch & ub) = 0;
    virtual void build_inputs(ggml_context * ctx)   = 0;
    // q: F32 [n_embd_head, n_head,    n_tokens] (rotated)
    // k: F32 [n_embd_head, n_head_kv, n_tokens] (rotated; not with keys_before_rope(il))
    // v: F32 [n_embd_head, n_head_kv, n_tokens]
    // returns F32 [n_embd_head*n_head, n_tokens]
    virtual ggml_tensor * build_attn(ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * q, ggml_tensor * k,
                                     ggml_tensor * v, float kq_scale) = 0;
    virtual void set_inputs()                                         = 0;
    virtual void commit()                                             = 0;

    // Attention outside ggml's graph (the CUDA quantized cache: ggml-cuda has no custom ops,
    // docs/design.md §1). Then build_attn ends a graph segment at layer il — q, k, v are that
    // segment's outputs — and returns an input tensor; the context's executor runs the graph
    // segment by segment, calling prepare_step before the first and run_layer(il) after
    // segment il, all on its stream.
    virtual bool external_attention() const { return false; }
    // The graph's node count when layer il's q, k, v were added: where segment il ends.
    virtual int segment_end(int il) const { return 0; }
    virtual ott_status prepare_step(CUstream_st * stream) { return OTT_OK; }
    virtual ott_status run_layer(int il, CUstream_st * stream) { return OTT_OK; }

    virtual int32_t seq_len(int32_t seq) const                   = 0;
    virtual ott_status seq_truncate(int32_t seq, int32_t n_keep) = 0;
    // dst becomes a copy of src (src != dst, both valid).
    virtual ott_status seq_copy(int32_t src, int32_t dst) = 0;
    virtual ott_kv_stats stats() const                    = 0;

    // Whether layer il takes its keys before RoPE (build_attn's k and the queries' q then
    // differ: q is rotated, k is not; the cache rotates keys at their positions).
    virtual bool keys_before_rope(int il) const { return false; }

    // Appends until the next quantization event of sequence seq; 0: the cache never quantizes.
    virtual int32_t tokens_until_event(int32_t seq) const { return 0; }
    // Copy of the stores of one KV head (ott.h: ott_kv_export).
    virtual ott_status export_head(int il, int32_t seq, int32_t head, ott_kv_head_state & out) const = 0;
};

struct ott_kv_shape {
    int32_t n_layer;
    int32_t n_head_kv;
    int32_t n_embd_head;
    int32_t n_ctx;  // tokens per sequence
    int32_t n_seq_max;
    ggml_backend_buffer_type_t buft;  // memory of the context's backend, where stores live
    int32_t cuda_device;              // the backend's CUDA device; -1: the CPU backend
    // the global layers' RoPE, for a cache that applies it itself (KVQuant's pre-RoPE keys);
    // rope_plain = 0 when it is more than a rotation by p · freq_scale · base^(-2i/n_rot)
    // (YaRN, frequency factors, an attention factor)
    int32_t rope_n_rot, rope_neox, rope_plain;
    float rope_freq_base, rope_freq_scale;
};

// Create the cache selected by params.type; reports unsupported or invalid settings.
ott_status ott_kv_cache_create(const ott_kv_params & params, const ott_kv_shape & shape,
                               std::unique_ptr<ott_kv_cache> & out);

// Bytes the cache ott_kv_cache_create would make holds at most for one sequence of
// shape.n_ctx tokens: the fp16 cache's rows, or ott_kv_quant_seq_bytes (geometry only).
ott_status ott_kv_cache_seq_bytes(const ott_kv_params & params, const ott_kv_shape & shape, int64_t & out);

// Whether the device of shape.buft runs ggml's flash attention (fp32 precision, fp16 K/V)
// at this head size (kv_f16.cpp).
bool ott_kv_flash_attn_supported(const ott_kv_shape & shape);

// The fp16 cache (kv_f16.cpp).
ott_status ott_kv_f16_create(const ott_kv_shape & shape, std::unique_ptr<ott_kv_cache> & out);
// The quantized cache, KIVI and OTT modes, in host memory with CPU custom ops (cpu/kv_quant_cpu.cpp).
ott_status ott_kv_quant_cpu_create(const ott_kv_config & cfg, const ott_kv_shape & shape,
                                   std::unique_ptr<ott_kv_cache> & out);
// The same cache in the memory of a CUDA device, attention and events by our kernels
// (cuda/kv_quant_cuda.cpp; builds with OTT_CUDA only).
ott_status ott_kv_quant_cuda_create(const ott_kv_config & cfg, const ott_kv_shape & shape,
                                    std::unique_ptr<ott_kv_cache> & out);
