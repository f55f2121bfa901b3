// model.h — a GGUF model in memory: hyperparameters and weights in their stored types.
#pragma once

#include "common.h"

#include "ggml.h"
#include "ggml-backend.h"
#include "gguf.h"

#include <string>
#include <vector>

enum ott_arch {
    OTT_ARCH_LLAMA,    // llama, SmolLM, TinyLlama, Llama 2/3
    OTT_ARCH_MISTRAL,  // same graph as llama
    OTT_ARCH_QWEN2,    // llama graph + QKV bias, NeoX rope
};

struct ott_hparams {
    ott_arch    arch;
    std::string arch_name;
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t n_embd_head;      // head_dim
    int32_t n_ff;
    int32_t n_rot;            // rotated dimensions per head
    int32_t rope_type;        // GGML_ROPE_TYPE_NORMAL / GGML_ROPE_TYPE_NEOX
    float   rope_freq_base;
    float   rope_freq_scale;  // 1 / linear scaling factor
    float   rope_ext_factor;  // YaRN: 1 when enabled, 0 otherwise
    int32_t rope_n_ctx_orig;
    float   norm_rms_eps;

    int32_t n_embd_gqa() const { return n_embd_head * n_head_kv; }
};

struct ott_layer {
    ggml_tensor * attn_norm;   // F32 [n_embd]
    ggml_tensor * wq;          // [n_embd, n_embd_head*n_head]
    ggml_tensor * wk;          // [n_embd, n_embd_gqa]
    ggml_tensor * wv;          // [n_embd, n_embd_gqa]
    ggml_tensor * wo;          // [n_embd_head*n_head, n_embd]
    ggml_tensor * bq;          // F32 [n_embd_head*n_head]   (qwen2 only)
    ggml_tensor * bk;          // F32 [n_embd_gqa]           (qwen2 only)
    ggml_tensor * bv;          // F32 [n_embd_gqa]           (qwen2 only)
    ggml_tensor * ffn_norm;    // F32 [n_embd]
    ggml_tensor * ffn_gate;    // [n_embd, n_ff]
    ggml_tensor * ffn_up;      // [n_embd, n_ff]
    ggml_tensor * ffn_down;    // [n_ff, n_embd]
};

struct ott_model {
    std::string path;
    ott_hparams hparams;

    ggml_backend_dev_t dev    = nullptr;  // the device holding the weights and running the graph
    int32_t cuda_device       = -1;       // its CUDA index; -1: the CPU
    gguf_context * gguf       = nullptr;  // metadata (kept for the whole lifetime)
    ggml_context * ctx_meta   = nullptr;  // headers of every tensor in the file (no data)
    std::vector<ggml_context *> ctxs_w;   // headers of the weights, one per buffer type
    std::vector<ggml_backend_buffer_t> buffers;  // weight data

    ggml_tensor * tok_embd    = nullptr;  // [n_embd, n_vocab]
    ggml_tensor * output_norm = nullptr;  // F32 [n_embd]
    ggml_tensor * output      = nullptr;  // [n_embd, n_vocab]; tok_embd (or a repacked copy) when tied
    bool          tied_output = false;    // the file has no output.weight
    ggml_tensor * rope_freqs  = nullptr;  // F32 [n_rot/2] llama3 frequency factors, optional
    std::vector<ott_layer> layers;

    int64_t n_params     = 0;
    int64_t weight_bytes = 0;

    ~ott_model();
};

// The device of ott_model_params.device: "cpu", "cuda", "cuda:N", or "" for cuda:0 when this
// build has CUDA and a GPU is present, else the CPU.
ott_status ott_device_resolve(const char * device, ggml_backend_dev_t & dev, int32_t & cuda_device);

// Load hyperparameters and weights; validates everything before ggml sees it.
ott_status ott_model_load_file(const char * path, const ott_model_params & params, ott_model * model);
