// graph.cpp — shared graph helpers.
#include "arch/graph.h"

#include "cpu/matmul_x8.h"

#include <algorithm>
#include <cmath>

void ott_graph_builder::build_inputs() {
    inp_tokens = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, ub.n_tokens());
    ggml_set_name(inp_tokens, "inp_tokens");
    ggml_set_input(inp_tokens);
    inp_pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, ub.n_tokens());
    ggml_set_name(inp_pos, "inp_pos");
    ggml_set_input(inp_pos);
    if (ub.out_idx.size() != (size_t)ub.n_tokens()) {
        // a ubatch with no outputs still computes the head for one row (then ignored)
        inp_out_ids = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, std::max<int64_t>(1, (int64_t)ub.out_idx.size()));
        ggml_set_name(inp_out_ids, "inp_out_ids");
        ggml_set_input(inp_out_ids);
    }
    kv.build_inputs(ctx);
}

void ott_graph_builder::set_inputs() {
    ggml_backend_tensor_set(inp_tokens, ub.token.data(), 0, ub.token.size() * sizeof(int32_t));
    ggml_backend_tensor_set(inp_pos, ub.pos.data(), 0, ub.pos.size() * sizeof(int32_t));
    if (inp_out_ids) {
        const int32_t last  = ub.n_tokens() - 1;
        const int32_t * ids = ub.out_idx.empty() ? &last : ub.out_idx.data();
        ggml_backend_tensor_set(inp_out_ids, ids, 0, ggml_nbytes(inp_out_ids));
    }
    kv.set_inputs();
}

ggml_tensor * ott_graph_builder::mm(ggml_tensor * w, ggml_tensor * x) {
    if (!model.x8.count(w)) return ggml_mul_mat(ctx, w, x);
    if (x->nb[0] != sizeof(float)) x = ggml_cont(ctx, x);  // the kernel reads a column's floats in a row
    return ott_x8_mul_mat(ctx, w, x);
}

ggml_tensor * ott_graph_builder::build_embd() {
    ggml_tensor * cur = model.x8.count(model.tok_embd) ? ott_x8_get_rows(ctx, model.tok_embd, inp_tokens)
                                                       : ggml_get_rows(ctx, model.tok_embd, inp_tokens);
    ggml_set_name(cur, "inp_embd");
    return cur;
}

ggml_tensor * ott_graph_builder::build_norm(ggml_tensor * cur, ggml_tensor * w, const char * name, int il) {
    cur = ggml_rms_norm(ctx, cur, model.hparams.norm_rms_eps);
    cur = ggml_mul(ctx, cur, w);
    if (il >= 0)
        ggml_format_name(cur, "%s-%d", name, il);
    else
        ggml_set_name(cur, name);
    return cur;
}

ott_qkv ott_graph_builder::build_qkv(ggml_tensor * cur, const ott_layer & L, int il) {
    const ott_hparams & hp = model.hparams;
    const int64_t n_tokens = cur->ne[1];
    if (L.wqkv) {  // Q, K, V as views of one product's rows [n_q | n_embd_gqa | n_embd_gqa]
        const int64_t hd  = hp.n_embd_head;
        const size_t es   = sizeof(float);
        ggml_tensor * qkv = mm(L.wqkv, cur);  // [n_q + 2*n_embd_gqa, n_tokens]
        if (L.bqkv) qkv = ggml_add(ctx, qkv, L.bqkv);
        ggml_format_name(qkv, "wqkv-%d", il);
        const size_t off_k = (size_t)hd * hp.n_head * es, off_v = off_k + (size_t)hp.n_embd_gqa() * es;
        ggml_tensor * q = ggml_view_3d(ctx, qkv, hd, hp.n_head, n_tokens, hd * es, qkv->nb[1], 0);
        ggml_tensor * k = ggml_view_3d(ctx, qkv, hd, hp.n_head_kv, n_tokens, hd * es, qkv->nb[1], off_k);
        ggml_tensor * v = ggml_view_3d(ctx, qkv, hd, hp.n_head_kv, n_tokens, hd * es, qkv->nb[1], off_v);
        ggml_format_name(v, "Vcur-%d", il);
        return { q, k, v };
    }
    ggml_tensor * q = mm(L.wq, cur);
    ggml_tensor * k = mm(L.wk, cur);
    ggml_tensor * v = mm(L.wv, cur);
    if (L.bq) q = ggml_add(ctx, q, L.bq);
    if (L.bk) k = ggml_add(ctx, k, L.bk);
    if (L.bv) v = ggml_add(ctx, v, L.bv);
    q = ggml_reshape_3d(ctx, q, hp.n_embd_head, hp.n_head, n_tokens);
    k = ggml_reshape_3d(ctx, k, hp.n_embd_head, hp.n_head_kv, n_tokens);
    v = ggml_reshape_3d(ctx, v, hp.n_embd_head, hp.n_head_kv, n_tokens);
    ggml_format_name(v, "Vcur-%d", il);
    return { q, k, v };
}

ggml_tensor * ott_graph_builder::build_rope(ggml_tensor * x, const char * name, int il) {
    const ott_hparams & hp = model.hparams;
    const bool local       = hp.is_swa(il);
    x = ggml_rope_ext(ctx, x, inp_pos, rope_factors, hp.n_rot, hp.rope_type, hp.rope_n_ctx_orig,
                      local ? hp.rope_freq_base_swa : hp.rope_freq_base,
                      local ? hp.rope_freq_scale_swa : hp.rope_freq_scale, hp.rope_ext_factor, hp.rope_attn_factor,
                      32.0f, 1.0f);
    ggml_format_name(x, "%s-%d", name, il);
    return x;
}

ggml_tensor * ott_graph_builder::build_rope_keys(ggml_tensor * k, int il) {
    if (!kv.keys_before_rope(il)) return build_rope(k, "Kcur", il);
    ggml_format_name(k, "Kcur-%d", il);
    return k;
}

ggml_tensor * ott_graph_builder::build_attn(const ott_qkv & qkv, const ott_layer & L, int il) {
    ggml_tensor *q = qkv.q, *k = qkv.k, *v = qkv.v;
    if (rot) {
        q = rot->queries(ctx, q, il);
        k = rot->keys_of(ctx, k, il);
        v = rot->values_of(ctx, v, il);
    }
    ggml_tensor * cur = kv.build_attn(ctx, gf, il, q, k, v, model.hparams.kq_scale);
    if (rot) cur = rot->output(ctx, cur, il);
    ggml_format_name(cur, "kqv_out-%d", il);
    cur = mm(L.wo, cur);
    ggml_format_name(cur, "attn_out-%d", il);
    return cur;
}

ggml_tensor * ott_graph_builder::build_ffn(ggml_tensor * cur, const ott_layer & L, ott_ffn_act act, int il) {
    const bool silu = act == OTT_FFN_SILU;
    if (!L.ffn_gate) {            // [gate; up] = ffn_up · cur, the activation of the first half times the second
        cur = mm(L.ffn_up, cur);  // [2*n_ff, n_tokens]
        cur = silu ? ggml_swiglu(ctx, cur) : ggml_geglu(ctx, cur);
    } else {
        ggml_tensor * gate = mm(L.ffn_gate, cur);
        ggml_tensor * up   = mm(L.ffn_up, cur);
        cur                = silu ? ggml_swiglu_split(ctx, gate, up) : ggml_geglu_split(ctx, gate, up);
    }
    ggml_format_name(cur, silu ? "ffn_swiglu-%d" : "ffn_geglu-%d", il);
    cur = mm(L.ffn_down, cur);
    ggml_format_name(cur, "ffn_out-%d", il);
    return cur;
}

ggml_tensor * ott_graph_builder::select_outputs(ggml_tensor * cur) {
    if (!inp_out_ids) return cur;  // every row is an output
    return ggml_get_rows(ctx, cur, inp_out_ids);
}

ggml_tensor * ott_graph_builder::build_head(ggml_tensor * cur) {
    const float softcap = model.hparams.logit_softcap;
    cur                 = build_norm(cur, model.output_norm, "result_norm", -1);
    cur                 = mm(model.output, cur);
    if (softcap > 0.0f) { cur = ggml_scale(ctx, ggml_tanh(ctx, ggml_scale(ctx, cur, 1.0f / softcap)), softcap); }
    ggml_set_name(cur, "result_output");
    ggml_set_output(cur);
    return cur;
}

ggml_tensor * ott_build_graph(ott_graph_builder & b) {
    switch (b.model.hparams.arch) {
        case OTT_ARCH_LLAMA:
        case OTT_ARCH_MISTRAL:
        case OTT_ARCH_QWEN2:
        case OTT_ARCH_QWEN3:
        case OTT_ARCH_PHI3:    return ott_build_llama(b);
        case OTT_ARCH_GEMMA3:  return ott_build_gemma3(b);
    }
    return nullptr;
}

size_t ott_graph_max_nodes(const ott_model & model, const ott_ubatch & ub, bool rotated) {
    size_t per_layer = 64 + 8 * ub.runs.size() + (rotated ? 32 : 0);  // rotations: 4 products, 3 shifts
    for (const ott_run & r : ub.runs) {
        if (r.n_tokens == 1) per_layer += 10 * (size_t)r.n_seqs;  // the fp16 cache on a GPU: an attention per sequence
    }
    return 256 + (size_t)model.hparams.n_layer * per_layer;
}
