// kvq_attn_groups.cuh — the two kinds of query group KVQuant's attention kernels (kvq_attn.cu,
// kvq_attn_split.cuh) read, behind one interface: rows and their queries and outputs, the
// head-blocks from pos0 on, then n_fp fp16 rows (their keys, values and positions) of which
// row r sees the first visible(r). packed_groups are ott_cuda_kvq_attn's (tests/cuda_ops.cpp
// compares them with the CPU); cache_tiles are the runtime cache's tiles (sink, window ring,
// the chunk's own keys causally).
#pragma once

#include "cuda/kvq_cuda.h"

#include <cuda_fp16.h>

namespace {

__device__ __forceinline__ float f16(ott_fp16 h) { return __half2float(__ushort_as_half(h)); }

__device__ __forceinline__ ott_fp16 load16(const uint8_t * p) { return (ott_fp16)(p[0] | p[1] << 8); }

// One group of ott_cuda_kvq_attn: rows q, out [n_q][head_dim], stores st (positions given).
struct packed_group {
    ott_kvq_tables tab;
    ott_kvq_head_stores st;
    const float * q;
    float * out;
    int32_t n_q, hd;

    __device__ int32_t rows() const { return n_q; }
    __device__ const float * query(int32_t r) const { return q + (size_t)r * hd; }
    __device__ float * output(int32_t r) const { return out + (size_t)r * hd; }
    __device__ int32_t n_blocks() const { return st.n_blocks; }
    __device__ const uint8_t * block(int32_t j) const { return st.blocks + (size_t)j * st.block_stride; }
    __device__ int32_t pos0() const { return st.pos0; }
    __device__ int32_t n_fp() const { return st.n; }
    __device__ float fp_k(int32_t t, int32_t c) const { return f16(st.k[(size_t)t * hd + c]); }
    __device__ float fp_v(int32_t t, int32_t c) const { return f16(st.v[(size_t)t * hd + c]); }
    __device__ int32_t fp_pos(int32_t t) const { return st.pos[t]; }
    __device__ int32_t visible(int32_t) const { return st.n; }
};

struct packed_groups {
    const ott_kvq_tables * tabs;
    const ott_kvq_head_stores * stores;
    const float * q;
    float * out;
    int32_t n_q;

    __device__ packed_group at(int32_t i, int32_t hd) const {
        return { tabs[i], stores[i], q + (size_t)i * n_q * hd, out + (size_t)i * n_q * hd, n_q, hd };
    }
};

// One tile of the runtime cache (ott_cuda_attn_tile): its rows' queries in the step's q, its
// stores in layer L — the sink, the window ring from win_pos0, then the chunk's own K/V
// (rounded to fp16 as the appends will store them), row rho seeing the chunk up to its token.
struct cache_tile {
    const ott_cuda_kv_layer * L;
    ott_cuda_attn_tile t;
    ott_kvq_tables tab;
    ott_cuda_f32_3d q, k, v;
    float * out;
    int64_t out_nb1;
    int32_t n_rep, hd;

    __device__ int32_t rows() const { return t.n_rows; }
    __device__ int32_t token(int32_t r) const { return (t.row0 + r) / n_rep; }  // chunk token of row r
    __device__ int32_t q_head(int32_t r) const { return t.head * n_rep + (t.row0 + r) % n_rep; }
    __device__ const float * query(int32_t r) const {
        return q.data + (size_t)(t.t0 + token(r)) * q.nb2 + (size_t)q_head(r) * q.nb1;
    }
    __device__ float * output(int32_t r) const {
        return out + (size_t)(t.t0 + token(r)) * out_nb1 + (size_t)q_head(r) * hd;
    }
    __device__ int32_t n_blocks() const { return t.n_blocks; }
    __device__ const uint8_t * block(int32_t j) const { return ott_cuda_head_block(*L, t.seq, j, t.head); }
    __device__ int32_t pos0() const { return t.n_sink; }
    __device__ int32_t n_fp() const { return t.n_sink + t.n_win + t.n_q; }
    __device__ size_t sh() const { return (size_t)t.seq * L->n_head_kv + t.head; }
    __device__ float fp(const ott_fp16 * sink, const ott_fp16 * win, const ott_cuda_f32_3d & x, int32_t i,
                        int32_t c) const {
        if (i < t.n_sink) return f16(sink[(sh() * L->sink + i) * hd + c]);
        i -= t.n_sink;
        if (i < t.n_win) {
            const int32_t row = (t.win_pos0 + i - L->sink) % L->win_cap;
            return f16(win[(sh() * L->win_cap + row) * hd + c]);
        }
        i -= t.n_win;
        return __half2float(__float2half_rn(x.data[(size_t)(t.t0 + i) * x.nb2 + (size_t)t.head * x.nb1 + c]));
    }
    __device__ float fp_k(int32_t i, int32_t c) const { return fp(L->sink_k, L->win_k, k, i, c); }
    __device__ float fp_v(int32_t i, int32_t c) const { return fp(L->sink_v, L->win_v, v, i, c); }
    __device__ int32_t fp_pos(int32_t i) const { return i < t.n_sink ? i : t.win_pos0 + i - t.n_sink; }
    __device__ int32_t visible(int32_t r) const { return t.n_sink + t.n_win + token(r) + 1; }
};

struct cache_tiles {
    ott_cuda_kv_layer L;
    const ott_kvq_tables * tabs;  // [n_head_kv]
    const ott_cuda_attn_tile * tiles;
    ott_cuda_f32_3d q, k, v;
    float * out;
    int64_t out_nb1;
    int32_t n_rep;

    __device__ cache_tile at(int32_t i, int32_t hd) const {
        const ott_cuda_attn_tile t = tiles[i];
        return { &L, t, tabs[t.head], q, k, v, out, out_nb1, n_rep, hd };
    }
};

}  // namespace
