// phi3.cpp — forward pass of Phi-3 / Phi-4-mini: the llama block with Q, K, V from one fused
// matrix and the FFN's gate and up rows fused in ffn_up (silu of the first half times the
// second). NeoX rope, partial when n_rot < head_dim; LongRoPE's factors and attention factor
// come with the builder's rope (model.h: rope_factors); a sliding window, when the file has
// one, makes every layer local (the KV cache applies it).
#include "arch/graph.h"

namespace {

// Q, K, V as views of the fused projection's rows [n_q | n_embd_gqa | n_embd_gqa].
ott_qkv fused_qkv(ott_graph_builder & b, ggml_tensor * cur, const ott_layer & L, int il) {
    const ott_hparams & hp = b.model.hparams;
    const int64_t n_tokens = cur->ne[1], hd = hp.n_embd_head;
    const size_t es   = sizeof(float);
    ggml_tensor * qkv = ggml_mul_mat(b.ctx, L.wqkv, cur);  // [n_q + 2*n_embd_gqa, n_tokens]
    ggml_format_name(qkv, "wqkv-%d", il);
    const size_t off_k = (size_t)hd * hp.n_head * es, off_v = off_k + (size_t)hp.n_embd_gqa() * es;
    ggml_tensor * q = ggml_view_3d(b.ctx, qkv, hd, hp.n_head, n_tokens, hd * es, qkv->nb[1], 0);
    ggml_tensor * k = ggml_view_3d(b.ctx, qkv, hd, hp.n_head_kv, n_tokens, hd * es, qkv->nb[1], off_k);
    ggml_tensor * v = ggml_view_3d(b.ctx, qkv, hd, hp.n_head_kv, n_tokens, hd * es, qkv->nb[1], off_v);
    v               = ggml_cont(b.ctx, v);  // the cache stores V rows whole
    ggml_format_name(v, "Vcur-%d", il);
    return { q, k, v };
}

// down(silu(gate) · up) with [gate; up] = ffn_up · cur.
ggml_tensor * fused_ffn(ott_graph_builder & b, ggml_tensor * cur, const ott_layer & L, int il) {
    cur = ggml_mul_mat(b.ctx, L.ffn_up, cur);  // [2*n_ff, n_tokens]
    cur = ggml_swiglu(b.ctx, cur);             // [n_ff, n_tokens]
    ggml_format_name(cur, "ffn_swiglu-%d", il);
    cur = ggml_mul_mat(b.ctx, L.ffn_down, cur);
    ggml_format_name(cur, "ffn_out-%d", il);
    return cur;
}

}  // namespace

ggml_tensor * ott_build_phi3(ott_graph_builder & b) {
    const ott_model & m = b.model;
    ggml_context * ctx  = b.ctx;

    ggml_tensor * x = b.build_embd();  // [n_embd, n_tokens]
    for (int il = 0; il < m.hparams.n_layer; ++il) {
        const ott_layer & L = m.layers[il];

        ggml_tensor * cur = b.build_norm(x, L.attn_norm, "attn_norm", il);
        ott_qkv qkv       = L.wqkv ? fused_qkv(b, cur, L, il) : b.build_qkv(cur, L, il);
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
        cur = fused_ffn(b, cur, L, il);
        x   = ggml_add(ctx, cur, ffn_inp);
        ggml_format_name(x, "l_out-%d", il);
    }
    return b.build_head(x);  // [n_vocab, n_outputs]
}
