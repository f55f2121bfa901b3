// graph.h — shared pieces of the decoder graph (llama.cpp's llm_graph_context in small):
// inputs, norms, Q/K/V projections, rope, the attention through the KV cache, the FFN and the
// output head. Each architecture file composes these into its forward pass.
#pragma once

#include "kv/kv_cache.h"
#include "kv/kv_rotation.h"
#include "model.h"

// The FFN's activation: SwiGLU (silu(gate)·up) or GeGLU with GELU's tanh approximation.
enum ott_ffn_act {
    OTT_FFN_SILU,
    OTT_FFN_GELU,
};

struct ott_qkv {
    ggml_tensor * q;  // F32 [n_embd_head, n_head,    n_tokens]
    ggml_tensor * k;  // F32 [n_embd_head, n_head_kv, n_tokens]
    ggml_tensor * v;  // F32 [n_embd_head, n_head_kv, n_tokens]
};

struct ott_graph_builder {
    const ott_model & model;
    const ott_ubatch & ub;
    ott_kv_cache & kv;
    const ott_kv_rotation * rot;  // rotations around the cache, or null
    ggml_tensor * rope_factors;   // F32 [n_rot/2] frequency factors for this context, or null
    ggml_context * ctx;
    ggml_cgraph * gf;

    // inputs, created by build_inputs()
    ggml_tensor * inp_tokens  = nullptr;  // I32 [n_tokens]
    ggml_tensor * inp_pos     = nullptr;  // I32 [n_tokens]
    ggml_tensor * inp_out_ids = nullptr;  // I32 [n_outputs]

    void build_inputs();
    void set_inputs();

    // w·x (F32 [w->ne[1], n_tokens]): ggml's product, or this library's for a matrix stored in
    // its 8-row layout (cpu/matmul_x8.h; the same bits)
    ggml_tensor * mm(ggml_tensor * w, ggml_tensor * x);
    ggml_tensor * build_embd();  // F32 [n_embd, n_tokens]
    // RMS norm over dimension 0 times w (rows of any shape: [n_embd, ...] or [n_embd_head, n_head, ...])
    ggml_tensor * build_norm(ggml_tensor * cur, ggml_tensor * w, const char * name, int il);
    // Q, K, V of cur [n_embd, n_tokens] by the layer's wq, wk, wv and their biases where it has them
    ott_qkv build_qkv(ggml_tensor * cur, const ott_layer & L, int il);
    // Rope at the ubatch positions with layer il's base and scale (local layers have their own)
    ggml_tensor * build_rope(ggml_tensor * x, const char * name, int il);
    // The keys as the cache takes them: roped, or as they are for a cache that ropes them
    // itself (kv_cache.h: keys_before_rope).
    ggml_tensor * build_rope_keys(ggml_tensor * k, int il);
    // Attention of roped q, k, v through the KV cache (rotated around it), then the output
    // projection: F32 [n_embd, n_tokens]
    ggml_tensor * build_attn(const ott_qkv & qkv, const ott_layer & L, int il);
    // Gated FFN: down(act(gate·cur) · up·cur)
    ggml_tensor * build_ffn(ggml_tensor * cur, const ott_layer & L, ott_ffn_act act, int il);
    ggml_tensor * select_outputs(ggml_tensor * cur);  // rows of out_idx
    ggml_tensor * build_head(ggml_tensor * cur);      // F32 [n_vocab, n_outputs]
};

// Forward passes, one file per block; they return the logits tensor.
ggml_tensor * ott_build_llama(ott_graph_builder & b);  // llama, mistral, qwen2, qwen3, phi3
ggml_tensor * ott_build_gemma3(ott_graph_builder & b);

// The forward pass of the model's architecture.
ggml_tensor * ott_build_graph(ott_graph_builder & b);

// Node budget of one step's graph.
size_t ott_graph_max_nodes(const ott_model & model, const ott_ubatch & ub, bool rotated);
