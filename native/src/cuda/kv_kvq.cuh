// kv_kvq.cuh — device transliterations of kv/kv_kvq.c, line by line under the same names, so
// that a KVQuant event on the GPU equals the CPU's bit for bit (kv/kv_kvq.h states the
// contract). Every float operation is the round-to-nearest intrinsic of that one operation;
// kvq_event.cu is compiled with -fmad=false as well. ott_kvq_quantize_block_ref shares its
// loops over entries, channels and tokens among the threads of the calling block; the
// selections run on thread 0, in the reference's order.
#pragma once

#include "cuda/kv_quant.cuh"
#include "kv/kv_layout.h"

static __device__ uint8_t ott_kvq_code_ref(float t, const float * levels, int32_t n_levels) {
    uint8_t code = 0;
    for (int32_t j = 0; j + 1 < n_levels; ++j) code += __fmul_rn(__fadd_rn(levels[j], levels[j + 1]), 0.5f) < t;
    return code;
}

static __device__ void select_top(const float * score, const uint8_t * exclude, int32_t n, int32_t count,
                                  int32_t * best, uint8_t * flag) {
    int32_t n_best = 0;
    if (count <= 0) return;
    for (int32_t i = 0; i < n; ++i) {
        if (exclude && exclude[i]) continue;
        if (n_best == count && score[i] <= score[best[n_best - 1]]) continue; /* ties: lower index wins */
        int32_t j = n_best < count ? n_best++ : n_best - 1;
        while (j > 0 && score[best[j - 1]] < score[i]) {
            best[j] = best[j - 1];
            --j;
        }
        best[j] = i;
    }
    for (int32_t j = 0; j < n_best; ++j) flag[best[j]] = 1;
}

static __device__ void write_sparse(const ott_fp16 * x, const uint8_t * flag, int32_t n, uint8_t * idx, uint8_t * val) {
    int32_t m = 0;
    for (int32_t i = 0; i < n; ++i) {
        if (!flag[i]) continue;
        idx[2 * m]     = (uint8_t)(i & 0xff);
        idx[2 * m + 1] = (uint8_t)(i >> 8);
        val[2 * m]     = (uint8_t)(x[i] & 0xff);
        val[2 * m + 1] = (uint8_t)(x[i] >> 8);
        ++m;
    }
}

// scratch: float t [n] | int32 best [n_out] | uint8 k_out [n] | v_out [n] | codes [max(block, head_dim) * blockDim.x]
static __device__ void ott_kvq_quantize_block_ref(const ott_kvq_geom * g, const float * k_zero, const float * k_scale,
                                                  const float * levels_k, const float * levels_v, const ott_fp16 * k,
                                                  const ott_fp16 * v, uint8_t * out, uint8_t * scratch) {
    const ott_kvq_block_layout L = ott_kvq_block_layout_of(g);
    const int32_t hd = g->head_dim, block = g->block, n = block * hd;
    const int32_t n_lk = 1 << g->bits_k, n_lv = 1 << g->bits_v;
    const int32_t row = block > hd ? block : hd;
    float * t         = (float *)scratch;
    int32_t * best    = (int32_t *)(t + n);
    uint8_t * k_out   = (uint8_t *)(best + g->n_out);
    uint8_t * v_out   = k_out + n;
    uint8_t * codes   = v_out + n + (size_t)threadIdx.x * row; /* this thread's row of codes */

    for (uint32_t i = threadIdx.x; i < L.size; i += blockDim.x) out[i] = 0;
    for (int32_t i = threadIdx.x; i < 2 * n; i += blockDim.x) k_out[i] = 0;
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
        const int32_t c = i % hd;
        const float inv = k_scale[c] != 0.0f ? __fdiv_rn(1.0f, k_scale[c]) : 0.0f;
        t[i]            = __fmul_rn(__fsub_rn(ott_fp16_to_fp32_ref(k[i]), k_zero[c]), inv);
    }
    __syncthreads();
    for (int32_t c = threadIdx.x; c < hd; c += blockDim.x) {
        for (int32_t s = 0; s < block; ++s) codes[s] = ott_kvq_code_ref(t[s * hd + c], levels_k, n_lk);
        ott_pack_codes_ref(codes, block, g->bits_k, out + L.k_codes + (size_t)c * (size_t)(block * g->bits_k / 8));
    }
    __syncthreads();
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) t[i] = fabsf(t[i]);
    __syncthreads();
    if (threadIdx.x == 0) {
        select_top(t, nullptr, n, g->n_out, best, k_out);
        write_sparse(k, k_out, n, out + L.k_out_idx, out + L.k_out_val);
    }
    __syncthreads();

    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) t[i] = ott_fp16_to_fp32_ref(v[i]);
    __syncthreads();
    if (threadIdx.x == 0) {
        select_top(t, nullptr, n, g->n_out / 2, best, v_out);
        uint8_t * hi = k_out; /* keys' flags are written: reuse */
        for (int32_t i = 0; i < n; ++i) hi[i] = v_out[i];
        for (int32_t i = 0; i < n; ++i) t[i] = -t[i];
        select_top(t, hi, n, g->n_out / 2, best, v_out);
        write_sparse(v, v_out, n, out + L.v_out_idx, out + L.v_out_val);
    }
    __syncthreads();

    for (int32_t s = threadIdx.x; s < block; s += blockDim.x) {
        const ott_fp16 * x = v + (size_t)s * hd;
        const uint8_t * sp = v_out + (size_t)s * hd;
        float mn = INFINITY, mx = -INFINITY;
        for (int32_t c = 0; c < hd; ++c) {
            if (sp[c]) continue;
            const float f = ott_fp16_to_fp32_ref(x[c]);
            mn            = f < mn ? f : mn;
            mx            = f > mx ? f : mx;
        }
        if (mn > mx) mn = mx = 0.0f; /* every entry sparse */
        const ott_fp16 z16 = ott_fp32_to_fp16_ref(__fmul_rn(__fadd_rn(mx, mn), 0.5f));
        const ott_fp16 s16 = ott_fp32_to_fp16_ref(__fmul_rn(__fsub_rn(mx, mn), 0.5f));
        const float z = ott_fp16_to_fp32_ref(z16), sc = ott_fp16_to_fp32_ref(s16);
        const float inv = sc != 0.0f ? __fdiv_rn(1.0f, sc) : 0.0f;
        for (int32_t c = 0; c < hd; ++c) {
            codes[c] = ott_kvq_code_ref(__fmul_rn(__fsub_rn(ott_fp16_to_fp32_ref(x[c]), z), inv), levels_v, n_lv);
        }
        ott_pack_codes_ref(codes, hd, g->bits_v, out + L.v_codes + (size_t)s * (size_t)(hd * g->bits_v / 8));
        out[L.v_zero + 2 * s]      = (uint8_t)(z16 & 0xff);
        out[L.v_zero + 2 * s + 1]  = (uint8_t)(z16 >> 8);
        out[L.v_scale + 2 * s]     = (uint8_t)(s16 & 0xff);
        out[L.v_scale + 2 * s + 1] = (uint8_t)(s16 >> 8);
    }
}
