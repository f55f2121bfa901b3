// kv_kvq.cuh — device transliterations of kv/kv_kvq.c, line by line under the same names, so
// that a KVQuant event on the GPU equals the CPU's bit for bit (kv/kv_kvq.h states the
// contract). Every float operation is the round-to-nearest intrinsic of that one operation;
// kvq_event.cu is compiled with -fmad=false as well. ott_kvq_quantize_block_ref shares its
// loops over entries, channels and tokens among the threads of the calling block, and so do
// the selections of sparse entries (a radix select and scans in place of the reference's
// insertion; the same entries for scores that are not NaN).
#pragma once

#include "cuda/kv_quant.cuh"
#include "kv/kv_layout.h"

static __device__ uint8_t ott_kvq_code_ref(float t, const float * levels, int32_t n_levels) {
    uint8_t code = 0;
    for (int32_t j = 0; j + 1 < n_levels; ++j) code += __fmul_rn(__fadd_rn(levels[j], levels[j + 1]), 0.5f) < t;
    return code;
}

// The order of a score as an unsigned key: a larger score, a larger key; -0 as +0 (they tie, as
// in the reference); NaN below every number (last, as numpy's argsort of the specification).
static __device__ uint32_t score_key(float f) {
    if (f != f) return 0u;
    const uint32_t b = __float_as_uint(f == 0.0f ? 0.0f : f);
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

// Exclusive prefix sum of x over the calling block's threads in thread order (blockDim.x a
// multiple of 32, at most 1024); *total gets the sum. Every thread of the block calls it.
static __device__ uint32_t block_scan(uint32_t x, uint32_t * total) {
    __shared__ uint32_t warp_sum[32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, n_w = blockDim.x >> 5;
    uint32_t inc = x;
    for (int d = 1; d < 32; d <<= 1) {
        const uint32_t y = __shfl_up_sync(0xffffffffu, inc, d);
        if (lane >= d) inc += y;
    }
    if (lane == 31) warp_sum[w] = inc;
    __syncthreads();
    uint32_t before = 0, all = 0;
    for (int i = 0; i < n_w; ++i) {
        before += i < w ? warp_sum[i] : 0u;
        all += warp_sum[i];
    }
    __syncthreads();
    *total = all;
    return before + inc - x;
}

// flag[i] = 1 for the `count` largest score[i] with exclude[i] == 0 (exclude may be NULL),
// equal scores by lower index: the reference's select_top, by the whole block. A radix select
// finds the key of the count-th largest, 8 bits a pass; then every thread flags the larger
// keys of its run of indices and, of the equal ones, those whose rank in index order (a
// scan) is below the number still wanted.
static __device__ void select_top(const float * score, const uint8_t * exclude, int32_t n, int32_t count,
                                  uint8_t * flag) {
    __shared__ uint32_t hist[256];
    __shared__ uint32_t pick[3];  // prefix, rank within it, whether every candidate is taken
    if (count <= 0) return;
    uint32_t prefix = 0, mask = 0, k = (uint32_t)count;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
            if (exclude && exclude[i]) continue;
            const uint32_t key = score_key(score[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (threadIdx.x < 32) {  // warp 0: lane l holds bins 8l .. 8l+7; `above`: the bins over them
            const int lane = threadIdx.x;
            uint32_t mine  = 0;
            for (int b = 0; b < 8; ++b) mine += hist[8 * lane + b];
            uint32_t suffix = mine;  // the sum of lanes >= lane
            for (int d = 1; d < 32; d <<= 1) {
                const uint32_t y = __shfl_down_sync(0xffffffffu, suffix, d);
                suffix += lane + d < 32 ? y : 0u;
            }
            const uint32_t above = suffix - mine, all = __shfl_sync(0xffffffffu, suffix, 0);
            if (lane == 0) pick[2] = shift == 24 && all <= k;
            if (above < k && k <= above + mine) {
                uint32_t b = 8 * lane + 7, a = above;
                while (a + hist[b] < k) a += hist[b--];
                pick[0] = prefix | (b << shift);
                pick[1] = k - a;
            }
        }
        __syncthreads();
        if (pick[2]) break;  // no more candidates than wanted: take them all
        prefix = pick[0];
        k      = pick[1];
        mask |= 255u << shift;
        __syncthreads();
    }
    const bool all    = pick[2] != 0;
    const int32_t per = (n + blockDim.x - 1) / blockDim.x, i0 = min(n, (int32_t)threadIdx.x * per),
                  i1 = min(n, i0 + per);
    uint32_t ties    = 0;
    for (int32_t i = i0; !all && i < i1; ++i) ties += (!exclude || !exclude[i]) && score_key(score[i]) == prefix;
    uint32_t n_ties;
    uint32_t rank = block_scan(ties, &n_ties);
    for (int32_t i = i0; i < i1; ++i) {
        if (exclude && exclude[i]) continue;
        const uint32_t key = score_key(score[i]);
        if (all || key > prefix)
            flag[i] = 1;
        else if (key == prefix)
            flag[i] = rank++ < k;
    }
    __syncthreads();
}

// The flagged entries of x [n] in ascending index: indices and values, by the whole block
// (each thread writes its run of indices at the place a scan of the flag counts gives).
static __device__ void write_sparse(const ott_fp16 * x, const uint8_t * flag, int32_t n, uint8_t * idx, uint8_t * val) {
    const int32_t per = (n + blockDim.x - 1) / blockDim.x, i0 = min(n, (int32_t)threadIdx.x * per),
                  i1 = min(n, i0 + per);
    uint32_t mine    = 0, total;
    for (int32_t i = i0; i < i1; ++i) mine += flag[i] != 0;
    uint32_t m = block_scan(mine, &total);
    for (int32_t i = i0; i < i1; ++i) {
        if (!flag[i]) continue;
        idx[2 * m]     = (uint8_t)(i & 0xff);
        idx[2 * m + 1] = (uint8_t)(i >> 8);
        val[2 * m]     = (uint8_t)(x[i] & 0xff);
        val[2 * m + 1] = (uint8_t)(x[i] >> 8);
        ++m;
    }
    __syncthreads();
}

// scratch: float t [n] | uint8 k_out [n] | v_out [n] | codes [max(block, head_dim) * blockDim.x]
static __device__ void ott_kvq_quantize_block_ref(const ott_kvq_geom * g, const float * k_zero, const float * k_scale,
                                                  const float * levels_k, const float * levels_v, const ott_fp16 * k,
                                                  const ott_fp16 * v, uint8_t * out, uint8_t * scratch) {
    const ott_kvq_block_layout L = ott_kvq_block_layout_of(g);
    const int32_t hd = g->head_dim, block = g->block, n = block * hd;
    const int32_t n_lk = 1 << g->bits_k, n_lv = 1 << g->bits_v;
    const int32_t row = block > hd ? block : hd;
    float * t         = (float *)scratch;
    uint8_t * k_out   = (uint8_t *)(t + n);
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
    select_top(t, nullptr, n, g->n_out, k_out);
    write_sparse(k, k_out, n, out + L.k_out_idx, out + L.k_out_val);

    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) t[i] = ott_fp16_to_fp32_ref(v[i]);
    __syncthreads();
    select_top(t, nullptr, n, g->n_out / 2, v_out);
    uint8_t * hi = k_out; /* keys' flags are written: reuse */
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x) {
        hi[i] = v_out[i];
        t[i]  = -t[i];
    }
    __syncthreads();
    select_top(t, hi, n, g->n_out / 2, v_out);
    write_sparse(v, v_out, n, out + L.v_out_idx, out + L.v_out_val);

    for (int32_t s = threadIdx.x; s < block; s += blockDim.x) {
        const float * x    = t + (size_t)s * hd; /* -f32(v): negated exactly above */
        const uint8_t * sp = v_out + (size_t)s * hd;
        float mn = INFINITY, mx = -INFINITY;
        for (int32_t c = 0; c < hd; ++c) {
            if (sp[c]) continue;
            const float f = -x[c];
            mn            = f < mn ? f : mn;
            mx            = f > mx ? f : mx;
        }
        if (mn > mx) mn = mx = 0.0f; /* every entry sparse */
        const ott_fp16 z16 = ott_fp32_to_fp16_ref(__fmul_rn(__fadd_rn(mx, mn), 0.5f));
        const ott_fp16 s16 = ott_fp32_to_fp16_ref(__fmul_rn(__fsub_rn(mx, mn), 0.5f));
        const float z = ott_fp16_to_fp32_ref(z16), sc = ott_fp16_to_fp32_ref(s16);
        const float inv = sc != 0.0f ? __fdiv_rn(1.0f, sc) : 0.0f;
        for (int32_t c = 0; c < hd; ++c) {
            codes[c] = ott_kvq_code_ref(__fmul_rn(__fsub_rn(-x[c], z), inv), levels_v, n_lv);
        }
        ott_pack_codes_ref(codes, hd, g->bits_v, out + L.v_codes + (size_t)s * (size_t)(hd * g->bits_v / 8));
        out[L.v_zero + 2 * s]      = (uint8_t)(z16 & 0xff);
        out[L.v_zero + 2 * s + 1]  = (uint8_t)(z16 >> 8);
        out[L.v_scale + 2 * s]     = (uint8_t)(s16 & 0xff);
        out[L.v_scale + 2 * s + 1] = (uint8_t)(s16 >> 8);
    }
}
