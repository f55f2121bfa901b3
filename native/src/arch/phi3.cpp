// phi3.cpp — forward pass of Phi-3 / Phi-4-mini: the llama block with Q, K, V from one fused
// matrix and the FFN's gate and up rows fused in ffn_up, as the files store them (graph.cpp
// takes both). NeoX rope, partial when n_rot < head_dim; LongRoPE's factors and attention factor
// come with the builder's rope (model.h: rope_factors); a sliding window, when the file has
// one, makes every layer local (the KV cache applies it).
#include "arch/graph.h"

ggml_tensor * ott_build_phi3(ott_graph_builder & b) {
    const ott_model & m = b.model;
    ggml_context * ctx  = b.ctx;

    ggml_tensor * x = b.build_embd();  // [n_embd, n_tokens]
    for (int il = 0; il < m.hparams.n_layer; ++il) {
        const ott_layer & L = m.layers[il];

        ggml_tensor * cur = b.build_norm(x, L.attn_norm, "attn_norm", il);
        ott_qkv qkv       = b.build_qkv(cur, L, il);
        qkv.q             = b.build_rope(qkv.q, "Qcur", il);
        qkv.k             = b.build_rope_keys(qkv.k, il);
        cur               = b.build_attn(qkv, L, il);
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
