// llama.cpp — forward pass of the llama block: llama (SmolLM, TinyLlama, Llama 2/3), mistral,
// qwen2, qwen3 and phi3, whose differences come from the model and the builder (graph.cpp):
// qwen2's QKV biases, NeoX rope (qwen2, qwen3, phi3), qwen3's RMS norm over each head of Q and
// of K before rope, Phi-3's fused QKV and gate/up matrices, its partial rope with LongRoPE's
// factors, and a sliding window that makes every layer local (the KV cache applies it).
#include "arch/graph.h"

ggml_tensor * ott_build_llama(ott_graph_builder & b) {
    const ott_model & m = b.model;
    ggml_context * ctx  = b.ctx;

    ggml_tensor * x = b.build_embd();  // [n_embd, n_tokens]
    for (int il = 0; il < m.hparams.n_layer; ++il) {
        const ott_layer & L = m.layers[il];

        ggml_tensor * cur = b.build_norm(x, L.attn_norm, "attn_norm", il);
        ott_qkv qkv       = b.build_qkv(cur, L, il);
        if (L.attn_q_norm) {  // qwen3, per head: [n_embd_head, n_head, n_tokens]
            qkv.q = b.build_norm(qkv.q, L.attn_q_norm, "Qcur_normed", il);
            qkv.k = b.build_norm(qkv.k, L.attn_k_norm, "Kcur_normed", il);
        }
        qkv.q = b.build_rope(qkv.q, "Qcur", il);
        qkv.k = b.build_rope_keys(qkv.k, il);
        cur   = b.build_attn(qkv, L, il);
        if (il == m.hparams.n_layer - 1) {  // only output rows go on
            cur = b.select_outputs(cur);
            x   = b.select_outputs(x);
        }
        ggml_tensor * ffn_inp = ggml_add(ctx, cur, x);
        ggml_format_name(ffn_inp, "ffn_inp-%d", il);

        cur = b.build_norm(ffn_inp, L.ffn_norm, "ffn_norm", il);
        cur = b.build_ffn(cur, L, OTT_FFN_SILU, il);
        x   = ggml_add(ctx, cur, ffn_inp);
        ggml_format_name(x, "l_out-%d", il);
    }
    return b.build_head(x);  // [n_vocab, n_outputs]
}
