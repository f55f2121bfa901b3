// kv_gather.cu — one sequence's KV stores as fp16 rows in position order, for a prompt chunk
// that attends through ggml's flash attention (kv_quant_cuda.cpp): sink rows as stored,
// head-blocks dequantised (fp16 of code·scale + min, each rounded in float), window rows from the
// ring, then the chunk's own K/V rounded to fp16 as ott_cuda_kv_append stores them; rows past
// the chunk are zero. A slot a pool holds (its head-block's mask bit) takes the pool's fp16
// row instead, so every head sees each position once, from the store attention reads it from.
// Keys cached before RoPE (L.rope) are then turned at their positions.
#include "cuda/ott_cuda.h"
#include "cuda/kv_quant.cuh"

#include <cuda_fp16.h>

#include <algorithm>

namespace {

constexpr int SLOTS        = 64;   // positions per thread block (kv_gather_rows_kernel)
constexpr int ROW_OF_BYTES = 256;  // kv_gather_blocks_kernel's static shared memory: head_dim <= 256 with tiers

// Code `i` of a row of `bits`-bit codes packed LSB-first (bits 1, 2, 4 or 8: no byte straddles).
__device__ __forceinline__ uint32_t code_at(const uint8_t * row, int32_t i, int32_t bits) {
    return (row[i * bits / 8] >> (i * bits % 8)) & ((1u << bits) - 1);
}

// The fp16 of f as ott_fp32_to_fp16_ref gives it: the hardware's conversion (round to nearest
// even, overflow to infinity: the same bits for every other value), a NaN as the reference
// writes it.
__device__ __forceinline__ ott_fp16 f16_of(float f) {
    return isnan(f) ? ott_fp32_to_fp16_ref(f) : __half_as_ushort(__float2half_rn(f));
}

// fp16(code·scale + min), the product and the sum each rounded in float
__device__ __forceinline__ ott_fp16 entry_f16(uint32_t code, float2 sm) {
    return f16_of(__fadd_rn(__fmul_rn((float)code, sm.x), sm.y));
}

// Two fp16 bit patterns as one word, a in the low half.
__device__ __forceinline__ uint32_t pair_of(ott_fp16 a, ott_fp16 b) { return (uint32_t)a | (uint32_t)b << 16; }

// grid: (blocks, n_head_kv) for head-blocks j0 ..; head_dim threads, dynamic shared memory
// of one head-block. The head-block is copied into shared memory in 16-byte words first, so
// that the scattered code reads (a key row per channel) hit shared memory. Then each thread
// writes 8 channels c0 .. c0+7 (its octet, tid % (head_dim/8)) of every (8·blockDim/head_dim)-th
// slot from tid / (head_dim/8), as one 16-byte store for keys and one for values: a channel's
// key from the key row of that channel (with tiers, the row its head-block ranked it to; the
// rows, widths and parameters fixed per key group), its value from each slot's code c.
__global__ void kv_gather_blocks_kernel(const ott_cuda_kv_layer L, const ott_cuda_gather G, int32_t j0,
                                        ott_fp16 * __restrict__ ko, ott_fp16 * __restrict__ vo) {
    extern __shared__ uint4 hb_words[];
    __shared__ uint8_t row_of[ROW_OF_BYTES];  // key tiers: the key row of channel c
    const ott_kv_geom & g = L.geom;
    const int32_t j = j0 + blockIdx.x, h = blockIdx.y, hd = g.head_dim, tid = threadIdx.x;
    const uint4 * __restrict__ src = (const uint4 *)ott_cuda_head_block(L, G.seq, j, h);
    for (uint32_t i = tid; i < L.layout.size / 16; i += blockDim.x) hb_words[i] = src[i];
    __syncthreads();
    const uint8_t * hb = (const uint8_t *)hb_words;
    const bool tiered  = ott_kv_tiered(&g);
    if (tiered) {  // each head-block ranks its own channels: row r holds channel k_order[r]
        for (int32_t r = tid; r < hd; r += blockDim.x) row_of[hb[L.layout.k_order + r]] = (uint8_t)r;
        __syncthreads();
    }
    const int32_t octets = hd / 8, c0 = tid % octets * 8, n_gv = (int32_t)ott_kv_n_gv(&g);
    int32_t bits[8];    // the code width of each of the thread's channels
    uint32_t krow[8];   // the byte offset of its key row in the head-block
    int32_t kparam[8];  // the index of its key parameter in the first key group
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const int32_t r = tiered ? row_of[c0 + k] : c0 + k;
        bits[k]         = ott_kv_k_row_bits(&g, r);
        krow[k]         = L.layout.k_codes + ott_kv_k_row_offset(&g, r);
        kparam[k]       = r;
    }
    const size_t row0     = (size_t)h * G.n_rows + G.n_sink + (size_t)j * g.block;
    const uint8_t * vmin  = g.sym_v ? nullptr : hb + L.layout.v_min;
    const bool one_vgroup = c0 / g.group_v == (c0 + 7) / g.group_v;  // the 8 channels share a value group
    float2 kp[8];
    int32_t kgroup = -1;
    for (int32_t t = tid / octets; t < g.block; t += blockDim.x / octets) {
        if (t / g.group_k != kgroup) {  // the key parameters of the thread's channels in this key group
            kgroup = t / g.group_k;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                kp[k] = ott_param_ref(g, hb + L.layout.k_scale, hb + L.layout.k_min, bits[k],
                                      (size_t)kgroup * hd + kparam[k]);
            }
        }
        const uint8_t * vrow = hb + L.layout.v_codes + (size_t)t * ott_kv_v_row_bytes(&g);
        auto vparam          = [&](int32_t c) {
            return ott_param_ref(g, hb + L.layout.v_scale, vmin, g.bits_v, (size_t)t * n_gv + c / g.group_v);
        };
        const float2 vp0 = vparam(c0);  // the octet's value group, unless it spans two
        ott_fp16 kh[8], vh[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float2 vp = one_vgroup ? vp0 : vparam(c0 + k);
            kh[k]           = entry_f16(code_at(hb + krow[k], t, bits[k]), kp[k]);
            vh[k]           = entry_f16(code_at(vrow, c0 + k, g.bits_v), vp);
        }
        *(uint4 *)(ko + (row0 + t) * hd + c0) =
            make_uint4(pair_of(kh[0], kh[1]), pair_of(kh[2], kh[3]), pair_of(kh[4], kh[5]), pair_of(kh[6], kh[7]));
        *(uint4 *)(vo + (row0 + t) * hd + c0) =
            make_uint4(pair_of(vh[0], vh[1]), pair_of(vh[2], vh[3]), pair_of(vh[4], vh[5]), pair_of(vh[6], vh[7]));
    }
}

// grid: (n_fp16 / SLOTS, n_head_kv); threads over channels. The other positions: sink rows
// as stored, window rows from the ring, the chunk's own K/V, then zero rows.
__global__ void kv_gather_rows_kernel(const ott_cuda_kv_layer L, const ott_cuda_f32_3d k, const ott_cuda_f32_3d v,
                                      const ott_cuda_gather G, ott_fp16 * ko, ott_fp16 * vo) {
    const int32_t h = blockIdx.y, hd = L.geom.head_dim, c = threadIdx.x;
    const int64_t sh = (int64_t)G.seq * L.n_head_kv + h;
    const int32_t q0 = G.n_sink + G.n_blocks * L.geom.block, w1 = q0 + G.n_win, n1 = w1 + G.n_new;
    const int32_t n_fp16 = G.n_sink + G.n_rows - q0;
    const int32_t i1     = min(n_fp16, (int32_t)(blockIdx.x + 1) * SLOTS);
    for (int32_t i = blockIdx.x * SLOTS; i < i1; ++i) {
        const int32_t p = i < G.n_sink ? i : q0 + (i - G.n_sink);  // the same in every thread
        ott_fp16 kh = 0, vh = 0;
        if (p < G.n_sink) {
            kh = L.sink_k[((size_t)sh * L.sink + p) * hd + c];
            vh = L.sink_v[((size_t)sh * L.sink + p) * hd + c];
        } else if (p < w1) {
            const size_t r = (size_t)sh * L.win_cap + (p - L.sink) % L.win_cap;
            kh             = L.win_k[r * hd + c];
            vh             = L.win_v[r * hd + c];
        } else if (p < n1) {
            const int64_t tok = G.t0 + (p - w1);
            kh                = ott_fp32_to_fp16_ref(k.data[tok * k.nb2 + h * k.nb1 + c]);
            vh                = ott_fp32_to_fp16_ref(v.data[tok * v.nb2 + h * v.nb1 + c]);
        }
        ko[((size_t)h * G.n_rows + p) * hd + c] = kh;
        vo[((size_t)h * G.n_rows + p) * hd + c] = vh;
    }
}

// grid: n_head_kv; threads over channels. Pool and extra-pool rows over their slots.
__global__ void kv_gather_pools_kernel(const ott_cuda_kv_layer L, const ott_cuda_gather G, ott_fp16 * ko,
                                       ott_fp16 * vo) {
    const int32_t h = blockIdx.x, hd = L.geom.head_dim, c = threadIdx.x;
    const int64_t sh = (int64_t)G.seq * L.n_head_kv + h;
    auto put         = [&](const ott_fp16 * sk, const ott_fp16 * sv, const int32_t * pos, int32_t n, int32_t cap) {
        for (int32_t i = 0; i < n; ++i) {
            const size_t src = ((size_t)sh * cap + i) * hd + c,
                         dst = ((size_t)h * G.n_rows + pos[sh * cap + i]) * hd + c;
            ko[dst]          = sk[src];
            vo[dst]          = sv[src];
        }
    };
    if (L.pool_cap) put(L.pool_k, L.pool_v, L.pool_pos, L.n_pool[sh], L.pool_cap);
    if (L.extra_cap) put(L.extra_k, L.extra_v, L.extra_pos, L.n_extra[sh], L.extra_cap);
}

// grid: (n_keys / SLOTS, n_head_kv); threads over RoPE pairs. Keys cached before RoPE: the
// gathered key rows 0 .. n_keys-1 turned by RoPE at their positions (the row index), in
// float, rounded to fp16 again.
__global__ void kv_gather_rope_kernel(const ott_cuda_kv_layer L, int32_t n_keys, int32_t n_rows, ott_fp16 * ko) {
    const int32_t h = blockIdx.y, hd = L.geom.head_dim, half = hd / 2, i = threadIdx.x;
    const int32_t ca = L.rope_neox ? i : 2 * i, cb = L.rope_neox ? i + half : 2 * i + 1;
    const int32_t p1 = min(n_keys, (int32_t)(blockIdx.x + 1) * SLOTS);
    for (int32_t p = blockIdx.x * SLOTS; p < p1; ++p) {
        ott_fp16 * row  = ko + ((size_t)h * n_rows + p) * hd;
        const float2 cs = L.rope[(size_t)p * half + i];
        const float x = __half2float(__ushort_as_half(row[ca])), y = __half2float(__ushort_as_half(row[cb]));
        row[ca] = f16_of(x * cs.x - y * cs.y);
        row[cb] = f16_of(x * cs.y + y * cs.x);
    }
}

}  // namespace

cudaError_t ott_cuda_kv_gather(const ott_cuda_kv_layer & L, const ott_cuda_kv_layer * R, ott_cuda_f32_3d k,
                               ott_cuda_f32_3d v, const ott_cuda_gather & G, ott_fp16 * ko, ott_fp16 * vo,
                               cudaStream_t stream) {
    const int32_t n_fp16 = G.n_rows - G.n_blocks * L.geom.block;
    const int32_t n_old  = R ? G.n_blocks - std::min(R->ring, G.n_blocks) : G.n_blocks;
    auto blocks          = [&](const ott_cuda_kv_layer & B, int32_t j0, int32_t n) {
        const cudaError_t e = ott_cuda_allow_smem((const void *)kv_gather_blocks_kernel, B.layout.size, ROW_OF_BYTES);
        if (e != cudaSuccess || n == 0) return e;
        kv_gather_blocks_kernel<<<dim3(n, L.n_head_kv), L.geom.head_dim, B.layout.size, stream>>>(B, G, j0, ko, vo);
        return cudaGetLastError();
    };
    cudaError_t e = blocks(L, 0, n_old);
    if (e == cudaSuccess && G.n_blocks > n_old) e = blocks(*R, n_old, G.n_blocks - n_old);
    if (e != cudaSuccess) return e;
    kv_gather_rows_kernel<<<dim3((n_fp16 + SLOTS - 1) / SLOTS, L.n_head_kv), L.geom.head_dim, 0, stream>>>(L, k, v, G,
                                                                                                           ko, vo);
    if (L.pool_cap || L.extra_cap) kv_gather_pools_kernel<<<L.n_head_kv, L.geom.head_dim, 0, stream>>>(L, G, ko, vo);
    const int32_t n_keys = G.n_sink + G.n_blocks * L.geom.block + G.n_win + G.n_new;
    if (L.rope && n_keys > 0) {  // after every row is in place (a stream orders the kernels)
        kv_gather_rope_kernel<<<dim3((n_keys + SLOTS - 1) / SLOTS, L.n_head_kv), L.geom.head_dim / 2, 0, stream>>>(
            L, n_keys, G.n_rows, ko);
    }
    return cudaGetLastError();
}
