// gemma3.cpp — forward pass of Gemma 3 (text): the embedding scaled by sqrt(n_embd), RMS
// norms before and after both attention and FFN, per-head Q/K norms, a GELU-gated FFN.
// Local layers attend over a sliding window with their own rope base (the KV cache and
// build_rope know which layers are local); queries are scaled by hparams.kq_scale. The norm
// weights in the file already include Gemma's "1 +" (llama.cpp's converter adds it).
#include "arch/graph.h"

#include <cmath>

ggml_tensor * ott_build_gemma3(ott_graph_builder & b) {
    const ott_model & m = b.model;
    ggml_context * ctx  = b.ctx;

    ggml_tensor * x = ggml_scale(ctx, b.build_embd(), sqrtf((float)m.hparams.n_embd));  // [n_embd, n_tokens]
    ggml_set_name(x, "inp_scaled");
    for (int il = 0; il < m.hparams.n_layer; ++il) {
        const ott_layer & L = m.layers[il];

        ggml_tensor * cur = b.build_norm(x, L.attn_norm, "attn_norm", il);
        ott_qkv qkv       = b.build_qkv(cur, L, il);
        qkv.q = b.build_norm(qkv.q, L.attn_q_norm, "Qcur_normed", il);  // per head: [n_embd_head, n_head, n_tokens]
        qkv.k = b.build_norm(qkv.k, L.attn_k_norm, "Kcur_normed", il);
        qkv.q = b.build_rope(qkv.q, "Qcur", il);
        qkv.k = b.build_rope_keys(qkv.k, il);
        cur   = b.build_attn(qkv, L, il);
        if (il == m.hparams.n_layer - 1) {  // only output rows go on
            cur = b.select_outputs(cur);
            x   = b.select_outputs(x);
        }
        cur                  = b.build_norm(cur, L.attn_post_norm, "attn_post_norm", il);
        ggml_tensor * sa_out = ggml_add(ctx, cur, x);
        ggml_format_name(sa_out, "sa_out-%d", il);

        cur = b.build_norm(sa_out, L.ffn_norm, "ffn_norm", il);
        cur = b.build_ffn(cur, L, OTT_FFN_GELU, il);
        cur = b.build_norm(cur, L.ffn_post_norm, "ffn_post_norm", il);
        x   = ggml_add(ctx, cur, sa_out);
        ggml_format_name(x, "l_out-%d", il);
    }
    return b.build_head(x);  // [n_vocab, n_outputs]
}
