// model.h — a GGUF model in memory: hyperparameters and weights in their stored types.
#pragma once

#include "common.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <string>
#include <unordered_set>
#include <vector>

enum ott_arch {
    OTT_ARCH_LLAMA,    // llama, SmolLM, TinyLlama, Llama 2/3
    OTT_ARCH_MISTRAL,  // same graph as llama
    OTT_ARCH_QWEN2,    // llama graph + QKV bias, NeoX rope
    OTT_ARCH_QWEN3,    // llama graph + per-head Q/K RMS norms, NeoX rope
    OTT_ARCH_GEMMA3,   // scaled embedding, Q/K norms, pre- and post-norms, GELU FFN, local layers (arch/gemma3.cpp)
    OTT_ARCH_PHI3,     // llama graph, fused QKV and gate-up, LongRoPE factors
};

struct ott_hparams {
    ott_arch arch;
    std::string arch_name;
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t n_embd_head;  // head_dim
    int32_t n_ff;
    int32_t n_rot;      // rotated dimensions per head
    int32_t rope_type;  // GGML_ROPE_TYPE_NORMAL / GGML_ROPE_TYPE_NEOX
    float rope_freq_base;
    float rope_freq_scale;    // 1 / linear scaling factor
    float rope_ext_factor;    // YaRN: 1 when enabled, 0 otherwise
    float rope_attn_factor;   // scales rope's cos and sin (LongRoPE's attention factor); 1 otherwise
    int32_t rope_n_ctx_orig;  // the context the rope was trained for (YaRN, LongRoPE's long factors beyond it)
    float norm_rms_eps;
    float kq_scale;       // attention logits scale, 1/sqrt(head_dim) unless the architecture says otherwise
    float logit_softcap;  // final logits -> softcap·tanh(logits/softcap); 0: none

    // Sliding-window (local) layers attend to the last n_swa positions, themselves included;
    // global layers to every position. Local layers have their own rope base and scale.
    int32_t n_swa;  // 0: every layer is global
    float rope_freq_base_swa;
    float rope_freq_scale_swa;
    std::vector<uint8_t> swa_layers;  // [n_layer] 1: layer il is local

    int32_t n_embd_gqa() const { return n_embd_head * n_head_kv; }
    bool is_swa(int il) const { return swa_layers[il] != 0; }
};

struct ott_layer {
    ggml_tensor * attn_norm = nullptr;       // F32 [n_embd]
    ggml_tensor * wq        = nullptr;       // [n_embd, n_embd_head*n_head]    (null when fused in wqkv)
    ggml_tensor * wk        = nullptr;       // [n_embd, n_embd_gqa]
    ggml_tensor * wv        = nullptr;       // [n_embd, n_embd_gqa]
    ggml_tensor * wqkv      = nullptr;       // [n_embd, n_embd_head*n_head + 2*n_embd_gqa]: Q, K, V rows
                                             // (phi3's file; elsewhere stacked at load when of one type)
    ggml_tensor * wo             = nullptr;  // [n_embd_head*n_head, n_embd]
    ggml_tensor * bq             = nullptr;  // F32 [n_embd_head*n_head]   (qwen2 only)
    ggml_tensor * bk             = nullptr;  // F32 [n_embd_gqa]           (qwen2 only)
    ggml_tensor * bv             = nullptr;  // F32 [n_embd_gqa]           (qwen2 only)
    ggml_tensor * bqkv           = nullptr;  // F32 [n_embd_head*n_head + 2*n_embd_gqa]: bq, bk, bv with wqkv
    ggml_tensor * attn_q_norm    = nullptr;  // F32 [n_embd_head] per-head RMS norm of Q (qwen3, gemma3)
    ggml_tensor * attn_k_norm    = nullptr;  // F32 [n_embd_head]
    ggml_tensor * attn_post_norm = nullptr;  // F32 [n_embd] on the attention output (gemma3)
    ggml_tensor * ffn_norm       = nullptr;  // F32 [n_embd]
    ggml_tensor * ffn_gate       = nullptr;  // [n_embd, n_ff]                (null when fused in ffn_up)
    ggml_tensor * ffn_up         = nullptr;  // [n_embd, n_ff]; with ffn_gate null [n_embd, 2*n_ff], gate rows
                                             // then up rows (phi3's file; elsewhere stacked at load)
    ggml_tensor * ffn_down      = nullptr;   // [n_ff, n_embd]
    ggml_tensor * ffn_post_norm = nullptr;   // F32 [n_embd] on the FFN output (gemma3)
};

struct ott_model {
    std::string path;
    ott_hparams hparams;

    ggml_backend_dev_t dev  = nullptr;           // the device holding the weights and running the graph
    int32_t cuda_device     = -1;                // its CUDA index; -1: the CPU
    gguf_context * gguf     = nullptr;           // metadata (kept for the whole lifetime)
    ggml_context * ctx_meta = nullptr;           // headers of every tensor in the file (no data)
    std::vector<ggml_context *> ctxs_w;          // headers of the weights, one per buffer type
    std::vector<ggml_backend_buffer_t> buffers;  // weight data

    ggml_tensor * tok_embd    = nullptr;  // [n_embd, n_vocab]
    ggml_tensor * output_norm = nullptr;  // F32 [n_embd]
    ggml_tensor * output      = nullptr;  // [n_embd, n_vocab]; tok_embd (or a repacked copy) when tied
    bool tied_output          = false;    // the file has no output.weight
    ggml_tensor * rope_freqs  = nullptr;  // F32 [n_rot/2] llama3 frequency factors, optional
    ggml_tensor * rope_long   = nullptr;  // F32 [n_rot/2] LongRoPE factors beyond rope_n_ctx_orig (phi3), optional
    ggml_tensor * rope_short  = nullptr;  // F32 [n_rot/2] LongRoPE factors within it
    std::vector<ott_layer> layers;

    int64_t n_params     = 0;
    int64_t weight_bytes = 0;
    // matrices stored in the 8-row layout (cpu/matmul_x8.h), read only by its ops (mul_mat, get_rows)
    std::unordered_set<const ggml_tensor *> x8;
    int64_t x8_bytes = 0;

    // The rope frequency factors for a context of n_ctx tokens per sequence, or null: LongRoPE's
    // long factors when n_ctx exceeds the trained context rope_n_ctx_orig (as llama.cpp picks
    // them), else its short ones; llama3's rope_freqs otherwise.
    ggml_tensor * rope_factors(int32_t n_ctx) const;

    ~ott_model();
};

// The device of ott_model_params.device: "cpu", "cuda", "cuda:N", or "" for cuda:0 when this
// build has CUDA and a GPU is present, else the CPU.
ott_status ott_device_resolve(const char * device, ggml_backend_dev_t & dev, int32_t & cuda_device);

// Load hyperparameters and weights; validates everything before ggml sees it.
ott_status ott_model_load_file(const char * path, const ott_model_params & params, ott_model * model);
