// kvq_attn.cu — attention over KVQuant stores on the GPU, the steps of cpu/kvq_attn_cpu.cpp:
// one thread block per query group (the query rows of one KV head of one sequence); per tile
// of KT keys the threads dequantize keys and values from their codes into shared memory
// (codebook level times scale plus zero, sparse entries put back), rotate the keys by RoPE at
// their positions, score every row, and fold the tile into each row's online softmax.
#include "cuda/kvq_cuda.h"

#include <cuda_fp16.h>

namespace {

constexpr int ATTN_THREADS = 128;
constexpr int KT           = 32;  // keys per tile

__device__ __forceinline__ float f16(ott_fp16 h) { return __half2float(__ushort_as_half(h)); }

__device__ __forceinline__ ott_fp16 load16(const uint8_t * p) { return (ott_fp16)(p[0] | p[1] << 8); }

// Code i of a packed row of row_bytes bytes (LSB-first bit stream).
__device__ __forceinline__ uint32_t code_at(const uint8_t * row, int32_t i, int32_t bits, int32_t row_bytes) {
    const int32_t at = i * bits, b = at / 8;
    uint32_t w = row[b];
    if (b + 1 < row_bytes) w |= (uint32_t)row[b + 1] << 8;
    return (w >> (at % 8)) & ((1u << bits) - 1);
}

struct tile_smem {
    float * kt;     // [KT][hd]
    float * vt;     // [KT][hd]
    float * s;      // [n_q][KT] scores, then probabilities
    float * acc;    // [n_q][hd]
    float * m;      // [n_q]
    float * l;      // [n_q]
    float * corr;   // [n_q]
    int32_t * pos;  // [KT]
};

__host__ __device__ size_t smem_bytes(int32_t hd, int32_t n_q) {
    return ((size_t)2 * KT * hd + (size_t)n_q * KT + (size_t)n_q * hd + 3 * (size_t)n_q) * 4 + KT * 4;
}

// Rotate the n keys of the tile at their positions, then fold them into every row.
__device__ void fold_tile(const tile_smem & S, int32_t n, int32_t hd, int32_t n_q, const ott_rope_table & R,
                          const float * q, float kq_scale) {
    const int32_t half = R.n_rot / 2;
    for (int32_t e = threadIdx.x; e < n * half; e += blockDim.x) {
        const int32_t t = e / half, i = e % half;
        const int32_t ia = R.neox ? i : 2 * i, ib = R.neox ? i + half : 2 * i + 1;
        const float * cs = R.cs + ((size_t)S.pos[t] * half + i) * 2;
        float * y        = S.kt + (size_t)t * hd;
        const float a = y[ia], b = y[ib];
        y[ia] = a * cs[0] - b * cs[1];
        y[ib] = a * cs[1] + b * cs[0];
    }
    __syncthreads();
    for (int32_t e = threadIdx.x; e < n_q * n; e += blockDim.x) {
        const int32_t r = e / n, t = e % n;
        const float *qr = q + (size_t)r * hd, *kr = S.kt + (size_t)t * hd;
        float d = 0.0f;
        for (int32_t c = 0; c < hd; ++c) d += qr[c] * kr[c];
        S.s[r * KT + t] = d * kq_scale;
    }
    __syncthreads();
    for (int32_t r = threadIdx.x; r < n_q; r += blockDim.x) {
        float mt = -INFINITY;
        for (int32_t t = 0; t < n; ++t) mt = fmaxf(mt, S.s[r * KT + t]);
        const float m_new = fmaxf(S.m[r], mt);
        S.corr[r]         = expf(S.m[r] - m_new);
        float l           = S.l[r] * S.corr[r];
        for (int32_t t = 0; t < n; ++t) {
            const float p   = expf(S.s[r * KT + t] - m_new);
            S.s[r * KT + t] = p;
            l += p;
        }
        S.l[r] = l;
        S.m[r] = m_new;
    }
    __syncthreads();
    for (int32_t e = threadIdx.x; e < n_q * hd; e += blockDim.x) {
        const int32_t r = e / hd, c = e % hd;
        float a = S.acc[e] * S.corr[r];
        for (int32_t t = 0; t < n; ++t) a += S.s[r * KT + t] * S.vt[(size_t)t * hd + c];
        S.acc[e] = a;
    }
    __syncthreads();
}

// grid: n_groups
__global__ void __launch_bounds__(ATTN_THREADS)
    kvq_attn_kernel(const ott_kvq_geom g, const ott_kvq_tables * tabs, const ott_kvq_head_stores * stores,
                    const ott_rope_table R, const float * q_all, int32_t n_q, float kq_scale, float * out_all) {
    extern __shared__ __align__(16) float smem[];
    const int32_t hd             = g.head_dim;
    const ott_kvq_tables tab     = tabs[blockIdx.x];
    const ott_kvq_head_stores st = stores[blockIdx.x];
    const float * q              = q_all + (size_t)blockIdx.x * n_q * hd;
    tile_smem S;
    S.kt   = smem;
    S.vt   = S.kt + KT * hd;
    S.s    = S.vt + KT * hd;
    S.acc  = S.s + n_q * KT;
    S.m    = S.acc + n_q * hd;
    S.l    = S.m + n_q;
    S.corr = S.l + n_q;
    S.pos  = (int32_t *)(S.corr + n_q);
    for (int32_t e = threadIdx.x; e < n_q * hd; e += blockDim.x) S.acc[e] = 0.0f;
    for (int32_t r = threadIdx.x; r < n_q; r += blockDim.x) {
        S.m[r] = -INFINITY;
        S.l[r] = 0.0f;
    }
    __syncthreads();

    const ott_kvq_block_layout L = ott_kvq_block_layout_of(&g);
    const int32_t k_row = g.block * g.bits_k / 8, v_row = hd * g.bits_v / 8;
    for (int32_t j = 0; j < st.n_blocks; ++j) {
        const uint8_t * b = st.blocks + (size_t)j * st.block_stride;
        for (int32_t t0 = 0; t0 < g.block; t0 += KT) {
            const int32_t n = min(KT, g.block - t0);
            for (int32_t e = threadIdx.x; e < n * hd; e += blockDim.x) {
                const int32_t t = e / hd, c = e % hd, slot = t0 + t;
                S.kt[e] =
                    tab.levels_k[code_at(b + L.k_codes + (size_t)c * k_row, slot, g.bits_k, k_row)] * tab.k_scale[c] +
                    tab.k_zero[c];
                S.vt[e] = tab.levels_v[code_at(b + L.v_codes + (size_t)slot * v_row, c, g.bits_v, v_row)] *
                              f16(load16(b + L.v_scale + 2 * slot)) +
                          f16(load16(b + L.v_zero + 2 * slot));
            }
            for (int32_t t = threadIdx.x; t < n; t += blockDim.x) S.pos[t] = st.pos0 + j * g.block + t0 + t;
            __syncthreads();
            for (int32_t e = threadIdx.x; e < g.n_out; e += blockDim.x) {
                const int32_t ik = load16(b + L.k_out_idx + 2 * e) - t0 * hd,
                              iv = load16(b + L.v_out_idx + 2 * e) - t0 * hd;
                if (ik >= 0 && ik < n * hd) S.kt[ik] = f16(load16(b + L.k_out_val + 2 * e));
                if (iv >= 0 && iv < n * hd) S.vt[iv] = f16(load16(b + L.v_out_val + 2 * e));
            }
            __syncthreads();
            fold_tile(S, n, hd, n_q, R, q, kq_scale);
        }
    }
    for (int32_t t0 = 0; t0 < st.n; t0 += KT) {
        const int32_t n = min(KT, st.n - t0);
        for (int32_t e = threadIdx.x; e < n * hd; e += blockDim.x) {
            S.kt[e] = f16(st.k[(size_t)t0 * hd + e]);
            S.vt[e] = f16(st.v[(size_t)t0 * hd + e]);
        }
        for (int32_t t = threadIdx.x; t < n; t += blockDim.x) S.pos[t] = st.pos[t0 + t];
        __syncthreads();
        fold_tile(S, n, hd, n_q, R, q, kq_scale);
    }
    float * out = out_all + (size_t)blockIdx.x * n_q * hd;
    for (int32_t e = threadIdx.x; e < n_q * hd; e += blockDim.x) out[e] = S.acc[e] / S.l[e / hd];
}

}  // namespace

cudaError_t ott_cuda_kvq_attn(const ott_kvq_geom & g, const ott_kvq_tables * tabs, const ott_kvq_head_stores * st,
                              int32_t n_groups, const ott_rope_table & rope, const float * q, int32_t n_q,
                              float kq_scale, float * out, cudaStream_t stream) {
    if (n_groups <= 0) return cudaSuccess;
    if (n_q <= 0 || n_q > OTT_CUDA_KVQ_ROWS) return cudaErrorInvalidValue;
    const size_t smem = smem_bytes(g.head_dim, n_q);
    if (smem > 48 * 1024) {
        const cudaError_t e =
            cudaFuncSetAttribute(kvq_attn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    kvq_attn_kernel<<<n_groups, ATTN_THREADS, smem, stream>>>(g, tabs, st, rope, q, n_q, kq_scale, out);
    return cudaGetLastError();
}
