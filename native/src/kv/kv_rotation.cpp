// kv_rotation.cpp — rotation tensors of the KV cache and the graph ops around it (kv_rotation.h).
#include "kv/kv_rotation.h"

#include "ggml-alloc.h"

#include <cmath>

namespace {

constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull;

// One step of splitmix64: advances state, returns the output.
uint64_t splitmix64(uint64_t & state) {
    uint64_t z = (state += GOLDEN);
    z          = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z          = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// x [d, heads, n] times each head's matrix of m [d, d, heads_m] (head h takes m's head
// h / (heads / heads_m)). One token: a mat-vec per head in one batched product. More tokens:
// the tokens of a head side by side, so that each head is one matrix product (batched over
// the heads) instead of a mat-vec per head and token.
ggml_tensor * per_head(ggml_context * g, ggml_tensor * m, ggml_tensor * x) {
    const int64_t d = x->ne[0], heads = x->ne[1], n = x->ne[2];
    if (!ggml_is_contiguous(x)) x = ggml_cont(g, x);  // K or V: views of a stacked projection
    if (n == 1) {
        ggml_tensor * y = ggml_mul_mat(g, m, ggml_reshape_4d(g, x, d, 1, heads, n));  // [d, 1, heads, 1]
        ggml_format_name(y, "kv_rot_%s", ggml_get_name(m));
        return ggml_reshape_3d(g, y, d, heads, n);
    }
    ggml_tensor * xt = ggml_cont(g, ggml_permute(g, x, 0, 2, 1, 3));  // [d, n, heads]
    ggml_tensor * y  = ggml_mul_mat(g, m, xt);                        // [d, n, heads]
    ggml_tensor * yt = ggml_cont(g, ggml_permute(g, y, 0, 2, 1, 3));  // [d, heads, n]
    ggml_format_name(xt, "kv_rot_%s_in", ggml_get_name(m));
    ggml_format_name(y, "kv_rot_%s", ggml_get_name(m));
    ggml_format_name(yt, "kv_rot_%s_out", ggml_get_name(m));
    return yt;
}

// x [d, heads, n] minus (add = false) or plus c [d, 1, heads, 1]
ggml_tensor * shift(ggml_context * g, ggml_tensor * x, ggml_tensor * c, bool add) {
    if (!ggml_is_contiguous(x)) x = ggml_cont(g, x);
    ggml_tensor * x4 = ggml_reshape_4d(g, x, x->ne[0], 1, x->ne[1], x->ne[2]);
    x4               = add ? ggml_add(g, x4, c) : ggml_sub(g, x4, c);
    ggml_format_name(x4, "kv_rot_%s", ggml_get_name(c));
    return ggml_reshape_3d(g, x4, x->ne[0], x->ne[1], x->ne[2]);
}

// x [d, heads, n] times H_d / √d row by row: ggml's fast Walsh–Hadamard transform, which
// both backends run on each row alone (a backend without it multiplies by had).
ggml_tensor * fwht(ggml_context * g, ggml_tensor * had, ggml_tensor * x, const char * name) {
    ggml_tensor * y = ggml_mul_mat(g, had, x);
    ggml_mul_mat_set_hint(y, GGML_HINT_SRC0_IS_HADAMARD);
    ggml_format_name(y, "kv_rot_%s", name);
    return y;
}

// x [d, heads, n] times diag(s) row by row, s [d, heads]
ggml_tensor * flip(ggml_context * g, ggml_tensor * x, ggml_tensor * s) {
    ggml_tensor * y = ggml_mul(g, x, s);
    ggml_format_name(y, "kv_rot_%s", ggml_get_name(s));
    return y;
}

}  // namespace

void ott_kv_hadamard_signs(int32_t head_dim, int il, int h, bool values, float * s) {
    uint64_t state = GOLDEN * (uint64_t)(2 * ((int64_t)il * 65536 + h) + (values ? 1 : 0) + 1);
    for (int32_t c = 0; c < head_dim; ++c) s[c] = (splitmix64(state) >> 63) ? -1.0f : 1.0f;
}

ott_kv_rotation::~ott_kv_rotation() {
    if (buf) ggml_backend_buffer_free(buf);
    if (ctx) ggml_free(ctx);
}

ggml_tensor * ott_kv_rotation::queries(ggml_context * g, ggml_tensor * q, int il) const {
    if (!keys) return q;
    return sq[il] ? fwht(g, had, flip(g, q, sq[il]), "q") : per_head(g, rk[il], q);
}

ggml_tensor * ott_kv_rotation::keys_of(ggml_context * g, ggml_tensor * k, int il) const {
    if (!keys) return k;
    if (sk[il]) return fwht(g, had, flip(g, k, sk[il]), "k");
    return per_head(g, rk[il], ck[il] ? shift(g, k, ck[il], false) : k);
}

ggml_tensor * ott_kv_rotation::values_of(ggml_context * g, ggml_tensor * v, int il) const {
    if (!values) return v;
    if (sv[il]) return fwht(g, had, flip(g, v, sv[il]), "v");
    return per_head(g, rv[il], cv[il] ? shift(g, v, cv[il], false) : v);
}

ggml_tensor * ott_kv_rotation::output(ggml_context * g, ggml_tensor * out, int il) const {
    if (!values) return out;
    ggml_tensor * o = ggml_reshape_3d(g, out, head_dim, n_head, out->ne[1]);  // [d, n_head, n_tokens]
    if (svq[il]) {
        o = flip(g, fwht(g, had, o, "o"), svq[il]);  // R_vᵀ = diag(s) H_d / √d
    } else {
        o = per_head(g, rvt[il], o);
        if (cvq[il]) o = shift(g, o, cvq[il], true);
    }
    return ggml_reshape_2d(g, o, (int64_t)head_dim * n_head, out->ne[1]);
}

ott_status ott_kv_rotation_create(const std::vector<ott_kv_rot_layer> & layers, int n_head_kv, int n_head, int head_dim,
                                  ggml_backend_buffer_type_t buft, std::unique_ptr<ott_kv_rotation> & out) {
    auto rot          = std::make_unique<ott_kv_rotation>();
    const int n_layer = (int)layers.size(), d = head_dim, rep = n_head / n_head_kv;
    rot->n_layer   = n_layer;
    rot->n_head_kv = n_head_kv;
    rot->n_head    = n_head;
    rot->head_dim  = d;
    if (!layers.empty()) {
        rot->keys   = !layers[0].r_k.empty() || !layers[0].s_k.empty();
        rot->values = !layers[0].r_v.empty() || !layers[0].s_v.empty();
    }
    const bool signs    = !layers.empty() && (!layers[0].s_k.empty() || !layers[0].s_v.empty());
    ggml_init_params ip = { ggml_tensor_overhead() * (size_t)(10 * n_layer + 1), nullptr, true };
    rot->ctx            = ggml_init(ip);
    if (!rot->ctx) return ott_fail(OTT_ERR_ALLOC, "cannot allocate the KV rotation tensors");

    // tensors, then one buffer, then the data
    std::vector<std::pair<ggml_tensor *, std::vector<float>>> fill;
    auto tensor = [&](int64_t ne1, int64_t ne2, std::vector<float> data, const char * name, int il) {
        ggml_tensor * t = ggml_new_tensor_3d(rot->ctx, GGML_TYPE_F32, d, ne1, ne2);
        ggml_format_name(t, "%s-%d", name, il);
        fill.emplace_back(t, std::move(data));
        return t;
    };
    // per KV head [n_head_kv][d] -> per query head [n_head][d], each its KV head's
    auto by_query_head = [&](const std::vector<float> & x) {
        std::vector<float> y;
        for (int hq = 0; hq < n_head; ++hq)
            y.insert(y.end(), x.begin() + (size_t)(hq / rep) * d, x.begin() + (size_t)(hq / rep + 1) * d);
        return y;
    };
    if (signs) {
        std::vector<float> h((size_t)d * d);
        const float norm = 1.0f / std::sqrt((float)d);
        for (int i = 0; i < d; ++i) {
            for (int j = 0; j < d; ++j)
                h[(size_t)i * d + j] = (__builtin_popcount((unsigned)(i & j)) & 1) ? -norm : norm;
        }
        rot->had = tensor(d, 1, std::move(h), "had", 0);
    }
    for (int il = 0; il < n_layer; ++il) {
        const ott_kv_rot_layer & L = layers[il];
        const bool sk = !L.s_k.empty(), sv = !L.s_v.empty();
        rot->rk.push_back(rot->keys && !sk ? tensor(d, n_head_kv, L.r_k, "k", il) : nullptr);
        rot->ck.push_back(rot->keys && !L.c_k.empty() ? tensor(1, n_head_kv, L.c_k, "ck", il) : nullptr);
        rot->sk.push_back(sk ? tensor(n_head_kv, 1, L.s_k, "sk", il) : nullptr);
        rot->sq.push_back(sk ? tensor(n_head, 1, by_query_head(L.s_k), "sq", il) : nullptr);
        std::vector<float> rvt;
        if (rot->values && !sv) {
            rvt.resize(L.r_v.size());
            for (int h = 0; h < n_head_kv; ++h) {
                const float * r = L.r_v.data() + (size_t)h * d * d;
                for (int i = 0; i < d; ++i) {
                    for (int j = 0; j < d; ++j) rvt[((size_t)h * d + i) * d + j] = r[(size_t)j * d + i];
                }
            }
        }
        rot->rv.push_back(rot->values && !sv ? tensor(d, n_head_kv, L.r_v, "v", il) : nullptr);
        rot->rvt.push_back(rot->values && !sv ? tensor(d, n_head_kv, rvt, "vt", il) : nullptr);
        rot->cv.push_back(rot->values && !L.c_v.empty() ? tensor(1, n_head_kv, L.c_v, "cv", il) : nullptr);
        rot->cvq.push_back(rot->values && !L.c_v.empty() ? tensor(1, n_head, by_query_head(L.c_v), "cvq", il)
                                                         : nullptr);
        rot->sv.push_back(sv ? tensor(n_head_kv, 1, L.s_v, "sv", il) : nullptr);
        rot->svq.push_back(sv ? tensor(n_head, 1, by_query_head(L.s_v), "svq", il) : nullptr);
    }
    rot->buf = ggml_backend_alloc_ctx_tensors_from_buft(rot->ctx, buft);
    if (!rot->buf) return ott_fail(OTT_ERR_ALLOC, "cannot allocate the KV rotation tensors on the backend");
    for (auto & [t, data] : fill) {
        if ((int64_t)data.size() != ggml_nelements(t)) {
            return ott_fail(OTT_ERR_INVALID_ARG, "KV rotation kv_rot_%s: %zu values, expected %lld", ggml_get_name(t),
                            data.size(), (long long)ggml_nelements(t));
        }
        ggml_backend_tensor_set(t, data.data(), 0, ggml_nbytes(t));
    }
    out = std::move(rot);
    return OTT_OK;
}
