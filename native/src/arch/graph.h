// graph.h — shared pieces of the decoder graph (llama.cpp's llm_graph_context in small):
// inputs, norms, the attention block through the KV cache, the FFN and the output head.
// Each architecture file composes these into its forward pass.
#pragma once

#include "kv/kv_cache.h"
#include "kv/kv_rotation.h"
#include "model.h"

struct ott_graph_builder {
    const ott_model  & model;
    const ott_ubatch & ub;
    ott_kv_cache     & kv;
    const ott_kv_rotation * rot;          // rotations around the cache, or null
    ggml_context     * ctx;
    ggml_cgraph      * gf;

    // inputs, created by build_inputs()
    ggml_tensor * inp_tokens  = nullptr;  // I32 [n_tokens]
    ggml_tensor * inp_pos     = nullptr;  // I32 [n_tokens]
    ggml_tensor * inp_out_ids = nullptr;  // I32 [n_outputs]

    void build_inputs();
    void set_inputs();

    ggml_tensor * build_embd();                                           // F32 [n_embd, n_tokens]
    ggml_tensor * build_norm(ggml_tensor * cur, ggml_tensor * w, const char * name, int il);
    ggml_tensor * build_attn(ggml_tensor * cur, const ott_layer & L, int il);  // [n_embd, n_tokens]
    ggml_tensor * build_ffn(ggml_tensor * cur, const ott_layer & L, int il);   // SwiGLU
    ggml_tensor * select_outputs(ggml_tensor * cur);                      // rows of out_idx
    ggml_tensor * build_head(ggml_tensor * cur);                          // F32 [n_vocab, n_outputs]
};

// Forward pass of the llama family (llama, mistral, qwen2). Returns the logits tensor.
ggml_tensor * ott_build_llama(ott_graph_builder & b);

// Node budget of one step's graph.
size_t ott_graph_max_nodes(const ott_model & model, const ott_ubatch & ub, bool rotated);
