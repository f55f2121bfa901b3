// kv_rotation.h — rotations of the KV cache as ggml ops around it (docs/design.md §8;
// ott_gguf/reference/rotation.py is the specification): per layer and KV head an orthogonal R
// and a centre c, for keys and for values,
//
//   k' = R_k (k - c_k)    q' = R_k q    v' = R_v (v - c_v)    o = R_vᵀ o' + c_v
//
// so scores move by q·c_k for every key of a query (the softmax does not change) and the
// output is that of the unrotated values. A calibrated R is one batched ggml_mul_mat over the
// heads (a head's vectors times its d x d matrix). The Hadamard R = H_d·diag(s)/√d is a sign
// flip then ggml's fast Walsh–Hadamard transform (a mul_mat hinted GGML_HINT_SRC0_IS_HADAMARD),
// which rounds each vector alike however many tokens a step holds, and alike on CPU and CUDA:
// a token's rotated key does not depend on the chunk or the batch it came in.
#pragma once

#include "common.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <memory>
#include <vector>

// A kind of rotation (ott_kv_params::rot_k / rot_v).
enum ott_kv_rot_kind {
    OTT_KV_ROT_NONE       = 0,
    OTT_KV_ROT_HADAMARD   = 1,  // H_d · diag(s) / √d, fixed signs per (layer, head, K or V)
    OTT_KV_ROT_CALIBRATED = 2,  // R and c from the model's own keys and values (sidecar)
};

// One layer's rotations, host side. Calibrated: R row-major [n_head_kv][d][d], c [n_head_kv][d]
// (empty: no centre). Hadamard: the signs s [n_head_kv][d] (±1), R empty.
struct ott_kv_rot_layer {
    std::vector<float> r_k, c_k, r_v, c_v;
    std::vector<float> s_k, s_v;
};

struct ott_kv_rotation {
    int n_layer = 0, n_head_kv = 0, n_head = 0, head_dim = 0;
    bool keys = false, values = false;
    ggml_context * ctx        = nullptr;
    ggml_backend_buffer_t buf = nullptr;
    std::vector<ggml_tensor *> rk;   // [n_layer] F32 [d, d, n_head_kv]: R_k, row m of head h at (·, m, h)
    std::vector<ggml_tensor *> ck;   // [n_layer] F32 [d, 1, n_head_kv] or null
    std::vector<ggml_tensor *> rv;   // [n_layer] F32 [d, d, n_head_kv]: R_v
    std::vector<ggml_tensor *> rvt;  // [n_layer] F32 [d, d, n_head_kv]: R_vᵀ
    std::vector<ggml_tensor *> cv;   // [n_layer] F32 [d, 1, n_head_kv] or null
    std::vector<ggml_tensor *> cvq;  // [n_layer] F32 [d, 1, n_head]: c_v of each query head's KV head, or null
    // Hadamard rotations (R_k, R_v null): the signs, by KV head and by query head
    std::vector<ggml_tensor *> sk, sq;   // [n_layer] F32 [d, n_head_kv], [d, n_head]: s of R_k, or null
    std::vector<ggml_tensor *> sv, svq;  // [n_layer] F32 [d, n_head_kv], [d, n_head]: s of R_v, or null
    ggml_tensor * had = nullptr;         // F32 [d, d]: H_d / √d, what ggml's transform stands for

    ~ott_kv_rotation();

    // q: F32 [d, n_head, n_tokens], k, v: F32 [d, n_head_kv, n_tokens], out: F32 [d*n_head, n_tokens]
    ggml_tensor * queries(ggml_context * g, ggml_tensor * q, int il) const;
    ggml_tensor * keys_of(ggml_context * g, ggml_tensor * k, int il) const;
    ggml_tensor * values_of(ggml_context * g, ggml_tensor * v, int il) const;
    ggml_tensor * output(ggml_context * g, ggml_tensor * out, int il) const;
};

// The signs s [d] of the Hadamard rotation of (layer il, KV head h, keys or values).
void ott_kv_hadamard_signs(int32_t head_dim, int il, int h, bool values, float * s);

// Build the rotation tensors on buft from per-layer host data (layers[il].r_k and s_k empty:
// keys not rotated, likewise values).
ott_status ott_kv_rotation_create(const std::vector<ott_kv_rot_layer> & layers, int n_head_kv, int n_head, int head_dim,
                                  ggml_backend_buffer_type_t buft, std::unique_ptr<ott_kv_rotation> & out);
