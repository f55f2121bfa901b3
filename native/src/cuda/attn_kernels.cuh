// attn_kernels.cuh — the fused attention kernels of the quantized KV cache (attn.cu), flash-decoding
// style; instantiated per head size and code widths by attn_rows.cu, launched by attn.cu.
//
// Grid (n_tiles, n_splits), 4 warps per block. A tile is up to NR query rows of one KV head
// of one sequence (its query heads, times its chunk tokens), so the head's codes are read
// once for all of them. Split y reads its share of the head's quantized blocks and its share
// of the fp16 rows (sink, pool, extra pool, window) and of the chunk itself, causally (the
// tensor-core kernel the fp16 rows first, the FFMA kernel last): every block gets the same
// work, and no block reads fp16 rows alone after the others.
// Each warp keeps one online softmax per phase; the block combines them into one partial
// (max, sum, weighted values) per row; attn_merge_kernel combines a tile's partials. Scores
// are kept in the log2 domain (q is scaled by kq_scale·log2 e), so every exponential is an
// exp2.
//
// Quantized blocks, one warp per head-block (warps of a split take turns):
//  - keys: a lane holds one 32-bit word of codes of one channel row (32/BITS slots) for a
//    set of channels and accumulates q_c·scale_c·code over them for its slots; lanes with
//    the same word are summed with shuffles. Loads: a warp reads 128 contiguous bytes.
//  - values: a lane holds one word of one slot row (32/BITS channels) for a set of slots and
//    accumulates p_t·scale_t·code over them; lanes with the same word are summed at the end.
//  - 2-, 4- and 8-bit codes are unpacked in registers without integer-to-float conversion:
//    the byte holding a code is shifted into the float mantissa's top byte, one AND-OR
//    makes the float 1 + code·2^(i·BITS-8) (i: the code's index in its byte), and the
//    constant 1 is taken off the sums afterwards (its sum is accumulated alongside). The
//    sums lose at most 8 bits to that offset, leaving a relative error near 2^-16.
// That is the FFMA path. Head-blocks of head size 128, block 128 and 2- or 4-bit codes run
// their quantized-block phase on integer tensor cores instead (attn_imma.cuh), where the GPU
// has them (ott_cuda_attn_args::tensor_cores).
#pragma once

#include "cuda/warp_ops.cuh"
#include "cuda/ott_cuda.h"

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

namespace {

constexpr int WARPS   = 4;
constexpr float LOG2E = 1.4426950408889634f;

__device__ __forceinline__ float h2f(ott_fp16 x) { return __half2float(__ushort_as_half(x)); }

// Scale and minimum i of a head-block's parameter arrays sc and mn: fp16, or a ufp8 scale
// and an int8 minimum (param_bits 8, kv_layout.h).
__device__ __forceinline__ float2 param_at(const ott_kv_geom & g, const uint8_t * sc, const uint8_t * mn, int i) {
    if (g.param_bits == 8) {
        const float s = ott_kv_scale8(sc[i]);
        return make_float2(s, ott_kv_min8((int8_t)mn[i], s));
    }
    return make_float2(h2f(((const ott_fp16 *)sc)[i]), h2f(((const ott_fp16 *)mn)[i]));
}

// Value parameter i: param_at, or with symmetric value groups (sym_v) the scale and the
// minimum it implies (mn unused).
__device__ __forceinline__ float2 vparam_at(const ott_kv_geom & g, const uint8_t * sc, const uint8_t * mn, int i) {
    if (!g.sym_v) return param_at(g, sc, mn, i);
    const float s = g.param_bits == 8 ? ott_kv_scale8(sc[i]) : h2f(((const ott_fp16 *)sc)[i]);
    return make_float2(s, ott_kv_sym_min(g.bits_v, s));
}

// acc[U0 + u][r] += s[gi][r]·(1 + code_u·2^(i·BITS-8)) for the NB·8/BITS codes u of the
// first NB bytes of word w (i: u's index in its byte, gi: the group of u's byte among the
// word's NGW groups, 1 or 4). Each byte is shifted to bits 15..22; one AND-OR per code makes
// the float.
template <int BITS, int NR, int NGW, int NB = 4, int U0 = 0, int N>
__device__ __forceinline__ void fma_word(uint32_t w, const float (&s)[NGW][NR], float (&acc)[N][NR]) {
    constexpr int CPB = 8 / BITS;
    static_assert(U0 + NB * CPB <= N, "codes past the accumulators");
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        const uint32_t ws = b * 8 <= 15 ? w << (15 - b * 8) : w >> (b * 8 - 15);
        const int gi      = NGW == 1 ? 0 : b;
#pragma unroll
        for (int i = 0; i < CPB; ++i) {
            const float f = __uint_as_float(0x3F800000u | (ws & (((1u << BITS) - 1) << (15 + i * BITS))));
#pragma unroll
            for (int r = 0; r < NR; ++r) acc[U0 + b * CPB + i][r] = fmaf(s[gi][r], f, acc[U0 + b * CPB + i][r]);
        }
    }
}

// The word's group of the codes of byte b: NGW = 1, one group; NGW = 4, a group per byte.
template <int NGW> __device__ __forceinline__ constexpr int group_of_byte(int b) { return NGW == 1 ? 0 : b; }

// The weight of code u's sum: sums over 1 + code·2^(i·BITS-8) give Σ s·code = (sum - Σ s)·2^(8-i·BITS).
template <int BITS> __device__ __forceinline__ constexpr float code_weight(int u) {
    return (float)(1 << (8 - (u % (8 / BITS)) * BITS));
}

// Per-warp online-softmax state of NR rows; every lane holds the same m and l.
template <int NR> struct softmax_rows {
    float m[NR];
    float l[NR];
};

// Softmax states of a block: one per warp and phase, slot w (quantized blocks) and
// WARPS + w (fp16 rows) of warp w.
constexpr int STATES = 2 * WARPS;

// Shared memory of a block: queries and the states' maxima and sums. The dynamic shared
// memory holds the block phase's per-warp buffers (per_warp bytes each; after that phase,
// its states' weighted values red[WARPS][NR][HD]) and, from fp16_values_at on, the fp16
// phase's states' weighted values fv[WARPS][NR][HD]: past the buffers when that phase runs
// first (fp16_first), else right after red.
__host__ __device__ inline size_t fp16_values_at(size_t per_warp, int nr, int hd, bool fp16_first) {
    const size_t red    = (size_t)WARPS * nr * hd * sizeof(float);
    const size_t blocks = (size_t)WARPS * per_warp;
    return fp16_first ? ((blocks > red ? blocks : red) + 15) / 16 * 16 : red;
}

template <int HD, int NR> struct __align__(16) attn_smem {
    float q[NR][HD];
    float m[STATES][NR];
    float l[STATES][NR];
};

// Record the maxima and sums of state slot (its values are in red[slot]).
template <int HD, int NR>
__device__ __forceinline__ void put_state(attn_smem<HD, NR> & S, int slot, const softmax_rows<NR> & sm) {
    if (threadIdx.x % 32 == 0) {
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            S.m[slot][r] = sm.m[r];
            S.l[slot][r] = sm.l[r];
        }
    }
}

// Combine the block's states (values in red[slot][r][c], slots WARPS.. in fv[slot - WARPS])
// into its partial for split blockIdx.y.
template <int HD, int NR>
__device__ void write_partial(const ott_cuda_attn_args & a, const attn_smem<HD, NR> & S, const float * red,
                              const float * fv, const ott_cuda_attn_tile & T) {
    __syncthreads();
    float * out = a.partials +
                  ((size_t)blockIdx.x * ott_cuda_attn_parts(a) + a.part0 + blockIdx.y) * OTT_CUDA_ATTN_ROWS * (HD + 2);
    for (int r = 0; r < T.n_rows; ++r) {
        float mx = -INFINITY;
        for (int w = 0; w < STATES; ++w) mx = fmaxf(mx, S.m[w][r]);
        float wgt[STATES];
        float l = 0.0f;
        for (int w = 0; w < STATES; ++w) {
            wgt[w] = S.m[w][r] == -INFINITY ? 0.0f : exp2f(S.m[w][r] - mx);
            l += S.l[w][r] * wgt[w];
        }
        float * o = out + (size_t)r * (HD + 2);
        for (int c = threadIdx.x; c < HD; c += blockDim.x) {
            float acc = 0.0f;
            for (int w = 0; w < STATES; ++w) {
                const float * x = w < WARPS ? red + (size_t)w * NR * HD : fv + (size_t)(w - WARPS) * NR * HD;
                acc += x[(size_t)r * HD + c] * wgt[w];
            }
            o[2 + c] = acc;
        }
        if (threadIdx.x == 0) {
            o[0] = mx;
            o[1] = l;
        }
    }
}

// ---- split over quantized blocks ------------------------------------------------------------

// The head-blocks [x, y) of tile T that split blockIdx.y reads: a share of the recent ones
// over the recent view, else of the others.
__device__ __forceinline__ int2 split_blocks(const ott_cuda_attn_args & a, const ott_cuda_attn_tile & T) {
    const int n_old = T.n_blocks - min(a.recent, T.n_blocks);
    const int lo = a.L.ring ? n_old : 0, hi = a.L.ring ? T.n_blocks : n_old;
    const int per = (hi - lo + a.n_splits - 1) / a.n_splits;
    const int b0  = min(hi, lo + (int)blockIdx.y * per);
    return make_int2(b0, min(hi, b0 + per));
}

// Head-block blk of tile T's sequence and KV head.
__device__ __forceinline__ const uint8_t * head_block(const ott_cuda_kv_layer & L, const ott_cuda_attn_tile & T,
                                                      int blk) {
    return ott_cuda_head_block(L, T.seq, blk, T.head);
}

// PF: code words a lane loads before using any (in flight per warp: PF * 128 bytes). Larger
// PF hides more memory latency but unrolls more code (instruction-cache misses, registers);
// the decode kernel's choice is a launch argument (ott_cuda_attn_args::prefetch).

// A channel's key row with key tiers, for rope_scores: its parameters (one group a block),
// the row's byte offset in k_codes and its code width. Filled per head-block (rope_rows).
struct rope_row {
    float2 p;
    uint32_t off;
    int bits;
};

// Per-warp shared memory of the block phase: probabilities [NR][block] floats, then the
// head-block's scales and mins (its bytes before k_codes) and, with key tiers, its k_order,
// staged with coalesced loads (rope: keys before RoPE, a rope_row per channel instead).
__host__ __device__ inline size_t warp_smem_bytes(const ott_kv_geom & g, const ott_kv_block_layout & L, int nr,
                                                  bool rope) {
    const size_t order = ott_kv_tiered(&g) ? (size_t)g.head_dim * (rope ? sizeof(rope_row) : 1) : 0;
    return (size_t)nr * g.block * sizeof(float) + L.k_codes + order;
}

// ---- key tiers ------------------------------------------------------------------------------
// Tiered key rows (kv_layout.h: rows in rank order, runs of 4-bit, 2-bit and 1-bit codes, one
// group of the block per row) in the lane mapping of 2-bit rows: lane (jk, phk) holds slots
// jk*16 .. jk*16+15 of rows phk, phk + nphk, ... of each run, a lane-word of 8, 4 or 2 bytes.
// A run's sums are reduced over the lanes of a slot set and added into p_s [NR][block].

// The 16 codes of lane-word jk of a row of BITS-bit codes (x: the first 4 bytes, y: the rest).
template <int BITS> __device__ __forceinline__ uint2 tier_word(const uint8_t * row, int jk) {
    if constexpr (BITS == 4) return ((const uint2 *)row)[jk];
    if constexpr (BITS == 2) return make_uint2(((const uint32_t *)row)[jk], 0u);
    return make_uint2(((const uint16_t *)row)[jk], 0u);
}

// Key rows [r0, r1) of width BITS, starting at `codes`: p_s[r][t] (+)= q_r·k_t over them
// (`first`: the first run written, then cleared).
template <int BITS, int HD, int NR, int PF>
__device__ __forceinline__ void
tier_run(const ott_kv_geom & g, const uint8_t * codes, int r0, int r1, const uint8_t * ord, const uint8_t * ksc,
         const uint8_t * kmn, const attn_smem<HD, NR> & S, int jk, int phk, int nphk, float * p_s, bool & first) {
    if (r0 >= r1) return;
    const size_t row_bytes = (size_t)g.block * BITS / 8;
    const int n_mine       = max(0, (r1 - r0 - phk + nphk - 1) / nphk);  // rows r0 + phk + i·nphk
    float acc[16][NR], off[1][NR], base[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        off[0][r] = base[r] = 0.0f;
#pragma unroll
        for (int u = 0; u < 16; ++u) acc[u][r] = 0.0f;
    }
#pragma unroll 1
    for (int i0 = 0; i0 < n_mine; i0 += PF) {
        uint2 w[PF];
#pragma unroll
        for (int i = 0; i < PF; ++i) {
            const int row = r0 + phk + (i0 + i) * nphk;
            w[i]          = i0 + i < n_mine ? tier_word<BITS>(codes + (size_t)(row - r0) * row_bytes, jk) : uint2 {};
        }
#pragma unroll
        for (int i = 0; i < PF; ++i) {
            if (i0 + i >= n_mine) break;
            const int row = r0 + phk + (i0 + i) * nphk, c = ord[row];
            const float2 kp = param_at(g, ksc, kmn, row);
            float qs[1][NR];
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                qs[0][r] = S.q[r][c] * kp.x;
                off[0][r] += qs[0][r];
                base[r] = fmaf(S.q[r][c], kp.y, base[r]);
            }
            if constexpr (BITS == 4) {
                fma_word<4, NR, 1, 4, 0>(w[i].x, qs, acc);
                fma_word<4, NR, 1, 4, 8>(w[i].y, qs, acc);
            } else if constexpr (BITS == 2) {
                fma_word<2, NR, 1>(w[i].x, qs, acc);
            } else {
                fma_word<1, NR, 1, 2>(w[i].x, qs, acc);
            }
        }
    }
    const int wk = 32 / nphk;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        warp_sum_from(off[0][r], wk);
        warp_sum_from(base[r], wk);
#pragma unroll
        for (int u = 0; u < 16; ++u) {
            warp_sum_from(acc[u][r], wk);
            const float x = (acc[u][r] - off[0][r]) * code_weight<BITS>(u) + base[r];
            float & dst   = p_s[(size_t)r * g.block + jk * 16 + u];
            if (phk == 0) dst = first ? x : dst + x;
        }
    }
    __syncwarp();
    first = false;
}

// s[u][r]: the score of slot jk*16 + u for row r of a tiered head-block (hb; its parameters
// and k_order staged at ksc, kmn, ord), -inf where masked; p_s is scratch.
template <int HD, int NR, int PF>
__device__ __forceinline__ void tiered_scores(const ott_cuda_attn_args & a, const uint8_t * hb, const uint8_t * ord,
                                              const uint8_t * ksc, const uint8_t * kmn, const attn_smem<HD, NR> & S,
                                              int jk, int phk, int nphk, float * p_s, float (&s)[16][NR]) {
    const ott_kv_geom & g = a.L.geom;
    const uint8_t * kc    = hb + a.L.layout.k_codes;
    const int lo0         = HD - g.n_lo;
    bool first            = true;
    tier_run<4, HD, NR, PF>(g, kc, 0, g.n_hi, ord, ksc, kmn, S, jk, phk, nphk, p_s, first);
    tier_run<2, HD, NR, PF>(g, kc + ott_kv_k_row_offset(&g, g.n_hi), g.n_hi, lo0, ord, ksc, kmn, S, jk, phk, nphk, p_s,
                            first);
    tier_run<1, HD, NR, PF>(g, kc + ott_kv_k_row_offset(&g, lo0), lo0, HD, ord, ksc, kmn, S, jk, phk, nphk, p_s, first);
    const uint8_t * mask = hb + a.L.layout.mask;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
#pragma unroll
        for (int u = 0; u < 16; ++u) {
            const int t       = jk * 16 + u;
            const bool masked = a.traces && ((mask[t >> 3] >> (t & 7)) & 1);
            s[u][r]           = masked ? -INFINITY : p_s[(size_t)r * g.block + t];
        }
    }
    __syncwarp();  // p_s is read before it takes the probabilities
}

// ---- keys cached before RoPE ----------------------------------------------------------------
// The scores need each key turned by RoPE at its own position, which no fold of the query
// into a key group's scale survives: a lane dequantizes its slots' keys pair by pair, turns
// them, and dots them with the rows' query pairs.

// The n·bits bits of codes n0 .. n0+n-1 of a row of `bits`-bit codes (n·bits = 8, 16, 32 or
// 64, aligned to their size: n0 is a multiple of n), code u at bit u·bits.
__device__ __forceinline__ uint64_t row_codes(const uint8_t * row, int bits, int n0, int n) {
    const uint8_t * at = row + n0 * bits / 8;
    switch (n * bits) {
        case 64: return *(const uint64_t *)at;
        case 32: return *(const uint32_t *)at;
        case 16: return *(const uint16_t *)at;
        default: return *at;
    }
}

// rows[c] for every channel c of head-block hb (its parameters staged at ksc, kmn); the
// warp's lanes in turn.
template <int HD>
__device__ __forceinline__ void rope_rows(const ott_kv_geom & g, const ott_kv_block_layout & l, const uint8_t * hb,
                                          const uint8_t * ksc, const uint8_t * kmn, rope_row * rows, int lane) {
    for (int r = lane; r < HD; r += 32)
        rows[hb[l.k_order + r]] = { param_at(g, ksc, kmn, r), ott_kv_k_row_offset(&g, r), ott_kv_k_row_bits(&g, r) };
}

// What a lane of rope_scores loads for RoPE pair i: the codes of its slots in the pair's two
// key rows (widths ba, bb) and the pair's angles at its first slot (cs) and at position 1
// (st). Fetched a pair ahead of their use, so that the loads are in flight while the lane
// works on the pair before.
struct rope_pair {
    uint64_t wa, wb;
    float2 cs, st;
    int ba, bb;
};

// The key row of channel c: with key tiers from rows, else row c of BK-bit codes.
template <int BK, bool TIERS>
__device__ __forceinline__ void row_of(const ott_kv_geom & g, const rope_row * rows, int c, uint32_t & off,
                                       int & bits) {
    if constexpr (TIERS) {
        off  = rows[c].off;
        bits = rows[c].bits;
    } else {
        off  = (uint32_t)c * g.block * BK / 8;
        bits = BK;
    }
}

template <int HD, int BK, int TPK, bool TIERS>
__device__ __forceinline__ rope_pair fetch_pair(const ott_cuda_kv_layer & L, const uint8_t * kc, const rope_row * rows,
                                                const float2 * at, int t0, int i) {
    constexpr int HALF = HD / 2;
    const int ca = L.rope_neox ? i : 2 * i, cb = L.rope_neox ? i + HALF : 2 * i + 1;
    rope_pair p;
    uint32_t oa, ob;
    row_of<BK, TIERS>(L.geom, rows, ca, oa, p.ba);
    row_of<BK, TIERS>(L.geom, rows, cb, ob, p.bb);
    p.wa = row_codes(kc + oa, p.ba, t0, TPK);
    p.wb = row_codes(kc + ob, p.bb, t0, TPK);
    p.cs = at[i];
    p.st = L.rope[HALF + i];
    return p;
}

// s[u][r]: the score of slot t = jk*TPK + u (position p0 + t) for row r of head-block hb, keys
// before RoPE (its parameters staged at ksc, kmn; with key tiers, rows[c] the key row of
// channel c, rope_rows), -inf where masked. Lane (jk, phk) takes the pairs phk, phk + nphk, ..:
// its slots' codes of the pair's two key rows, dequantized, turned by the angle at
// p0 + jk*TPK stepped by the angle at 1 (a complex product per slot), dotted with each row's
// query pair; the Wk-strided lanes of a slot set sum their pairs with shuffles. A pair's loads
// are issued while the lane works on the pair before (fetch_pair). SPLIT: a lane's TPK slots
// may span key groups (group_k not a multiple of TPK); otherwise each pair's parameters are
// read once, with no test per slot (key tiers have one group a block).
template <int HD, int BK, int NR, int TPK, bool TIERS, bool SPLIT>
__device__ __forceinline__ void rope_scores(const ott_cuda_attn_args & a, const uint8_t * hb, const rope_row * rows,
                                            const uint8_t * ksc, const uint8_t * kmn, const attn_smem<HD, NR> & S,
                                            int p0, int jk, int phk, int nphk, int Wk, float (&s)[TPK][NR]) {
    constexpr int HALF    = HD / 2;
    const ott_kv_geom & g = a.L.geom;
    const uint8_t * kc    = hb + a.L.layout.k_codes;
    const int t0          = jk * TPK;
    const float2 * at     = a.L.rope + (size_t)(p0 + t0) * HALF;          // the angles at the lane's first slot
    const int grp0 = t0 / g.group_k, end0 = (grp0 + 1) * g.group_k - t0;  // the first key group, its end
#pragma unroll
    for (int r = 0; r < NR; ++r) {
#pragma unroll
        for (int u = 0; u < TPK; ++u) s[u][r] = 0.0f;
    }
    rope_pair next = fetch_pair<HD, BK, TPK, TIERS>(a.L, kc, rows, at, t0, phk);  // nphk <= HALF: phk < HALF
#pragma unroll 1
    for (int i = phk; i < HALF; i += nphk) {
        const rope_pair cur = next;
        if (i + nphk < HALF) next = fetch_pair<HD, BK, TPK, TIERS>(a.L, kc, rows, at, t0, i + nphk);
        const int ca = a.L.rope_neox ? i : 2 * i, cb = a.L.rope_neox ? i + HALF : 2 * i + 1;
        const uint32_t ma = (1u << cur.ba) - 1, mb = (1u << cur.bb) - 1;
        float qa[NR], qb[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            qa[r] = S.q[r][ca];
            qb[r] = S.q[r][cb];
        }
        float2 cs       = cur.cs, pa {}, pb {};
        const float2 st = cur.st;
        // one row: its query pair turned back by the slot's angle, R(θ)ᵀ·q, is stepped instead of
        // the key (8 operations a slot instead of 12); several rows share the key's turn
        float2 w {};
        if constexpr (NR == 1) w = make_float2(qa[0] * cs.x + qb[0] * cs.y, qb[0] * cs.x - qa[0] * cs.y);
        int grp = grp0, end = end0;  // the key group of slot t0 + u, and the u where it ends
#pragma unroll
        for (int u = 0; u < TPK; ++u) {
            if (u == 0 || (SPLIT && u == end)) {  // the pair's key groups from slot t0 + u: (S, M)
                if (u) {
                    ++grp;
                    end += g.group_k;
                }
                if constexpr (TIERS) {
                    pa = rows[ca].p;
                    pb = rows[cb].p;
                } else {
                    pa = param_at(g, ksc, kmn, grp * HD + ca);
                    pb = param_at(g, ksc, kmn, grp * HD + cb);
                }
            }
            const float ka = fmaf((float)((uint32_t)(cur.wa >> (u * cur.ba)) & ma), pa.x, pa.y);
            const float kb = fmaf((float)((uint32_t)(cur.wb >> (u * cur.bb)) & mb), pb.x, pb.y);
            if constexpr (NR == 1) {
                s[u][0] = fmaf(ka, w.x, fmaf(kb, w.y, s[u][0]));
                w       = make_float2(w.x * st.x + w.y * st.y, w.y * st.x - w.x * st.y);
            } else {
                const float xa = ka * cs.x - kb * cs.y, xb = ka * cs.y + kb * cs.x;
#pragma unroll
                for (int r = 0; r < NR; ++r) s[u][r] = fmaf(qa[r], xa, fmaf(qb[r], xb, s[u][r]));
                cs = make_float2(cs.x * st.x - cs.y * st.y, cs.x * st.y + cs.y * st.x);
            }
        }
    }
    const uint8_t * mask = hb + a.L.layout.mask;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
#pragma unroll
        for (int u = 0; u < TPK; ++u) {
            warp_sum_from(s[u][r], Wk);
            const int t = t0 + u;
            if (a.traces && ((mask[t >> 3] >> (t & 7)) & 1)) s[u][r] = -INFINITY;
        }
    }
}

// The lane's channels 2(lane + 32i), +1 (i < HD/64) of a key at position p, turned by RoPE
// (L.rope non-null). NeoX pairs channel c with c ± HD/2: for head sizes from 128 that is the
// lane's own entry i ± HD/128, for 64 the entry of lane ^ 16 (all 32 lanes take part).
template <int HD> __device__ __forceinline__ void rope_lane(const ott_cuda_kv_layer & L, int p, int lane, float * k) {
    constexpr int HALF = HD / 2;
    const float2 * at  = L.rope + (size_t)p * HALF;
    if (!L.rope_neox) {  // pair j = lane + 32i: channels 2j, 2j+1
#pragma unroll
        for (int i = 0; i < HD / 64; ++i) {
            const float2 cs = at[lane + 32 * i];
            const float x = k[2 * i], y = k[2 * i + 1];
            k[2 * i]     = x * cs.x - y * cs.y;
            k[2 * i + 1] = x * cs.y + y * cs.x;
        }
        return;
    }
    if constexpr (HD >= 128) {
        constexpr int DI = HD / 128;
#pragma unroll
        for (int i = 0; i < DI; ++i) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float2 cs = at[2 * (lane + 32 * i) + e];
                const float x = k[2 * i + e], y = k[2 * (i + DI) + e];
                k[2 * i + e]        = x * cs.x - y * cs.y;
                k[2 * (i + DI) + e] = x * cs.y + y * cs.x;
            }
        }
    } else {
        const bool first = lane < 16;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float2 cs = at[2 * (lane % 16) + e];
            const float y   = __shfl_xor_sync(0xffffffffu, k[e], 16);
            k[e]            = first ? k[e] * cs.x - y * cs.y : y * cs.y + k[e] * cs.x;
        }
    }
}

// A head-block's group parameters (its first k_codes bytes, a multiple of 16) copied into the
// warp's slice of shared memory, 16 bytes a lane at a time.
__device__ __forceinline__ void stage_params(const ott_kv_block_layout & l, const uint8_t * hb, uint8_t * sc_s,
                                             int lane) {
    for (int i = lane; i < (int)(l.k_codes / 16); i += 32) ((uint4 *)sc_s)[i] = ((const uint4 *)hb)[i];
}

// TIERS: head-blocks with key tiers (tiered_scores; BK = 2), a kernel of its own so that the
// others keep their registers. ROPE: keys cached before RoPE (rope_scores).
template <int HD, int BK, int BV, int NR, int NGW, int PF, bool TIERS, bool ROPE>
__device__ void attend_blocks(const ott_cuda_attn_args & a, const ott_cuda_attn_tile & T, attn_smem<HD, NR> & S,
                              uint8_t * dyn) {
    constexpr int TPK = 32 / BK, CPBK = 8 / BK;       // key codes per 32-bit word, per byte
    constexpr int TPV = 32 / BV, CPBV = 8 / BV;       // value codes per 32-bit word, per byte
    constexpr int WV = HD * BV / 32, NPHV = 32 / WV;  // words per value row, lanes per word
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const ott_cuda_kv_layer & L = a.L;
    const ott_kv_geom & g       = L.geom;
    const int block = g.block, n_gv = HD / g.group_v;
    const int Wk = block * BK / 32, nphk = 32 / Wk;                  // words per key row, lanes per word
    const int jk = lane % Wk, phk = lane / Wk, cplk = HD / nphk;     // a lane's key word, its channels
    const int jv = lane % WV, phv = lane / WV, tplv = block / NPHV;  // a lane's value word, its slots
    const int c_first = phk * cplk, t_first = phv * tplv;
    int gk[NGW], gv[NGW];  // groups of the lane's key slots / value channels
#pragma unroll
    for (int gi = 0; gi < NGW; ++gi) {
        gk[gi] = (jk * TPK + gi * (TPK / NGW)) / g.group_k;
        gv[gi] = (jv * TPV + gi * (TPV / NGW)) / g.group_v;
    }
    uint8_t * wsm       = dyn + (size_t)warp * warp_smem_bytes(g, L.layout, NR, ROPE);
    float * p_s         = (float *)wsm;  // [NR][block] this warp's probabilities
    uint8_t * sc_s      = wsm + (size_t)NR * block * sizeof(float);
    const uint8_t * ksc = sc_s + L.layout.k_scale;  // [block/group_k][HD] parameters
    const uint8_t * kmn = sc_s + L.layout.k_min;
    const uint8_t * vsc = sc_s + L.layout.v_scale;  // [block][n_gv]
    const uint8_t * vmn = sc_s + L.layout.v_min;
    uint8_t * ord_s     = sc_s + L.layout.k_codes;  // [HD] k_order with key tiers (ROPE: rope_row [HD])

    const int2 range = split_blocks(a, T);
    const int b0 = range.x, b1 = range.y;

    softmax_rows<NR> sm;
    float accv[TPV][NR], sv[NGW][NR], mv[NGW][NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        sm.m[r] = -INFINITY;
        sm.l[r] = 0.0f;
#pragma unroll
        for (int gi = 0; gi < NGW; ++gi) sv[gi][r] = mv[gi][r] = 0.0f;
#pragma unroll
        for (int u = 0; u < TPV; ++u) accv[u][r] = 0.0f;
    }

    for (int b = b0 + warp; b < b1; b += WARPS) {
        const uint8_t * hb  = head_block(L, T, b);
        const uint32_t * kc = (const uint32_t *)(hb + L.layout.k_codes);  // [HD][Wk]
        const uint32_t * vc = (const uint32_t *)(hb + L.layout.v_codes);  // [block][WV]

        // keys: scores of slots jk*TPK .. jk*TPK+TPK-1 over the lane's channels, in s
        float s[TPK][NR];
        if constexpr (ROPE) {
            __syncwarp();  // scales and mins of the head-block; with tiers, the key row of each channel
            stage_params(L.layout, hb, sc_s, lane);
            rope_row * rows = (rope_row *)ord_s;
            if constexpr (TIERS) {
                __syncwarp();
                rope_rows<HD>(g, L.layout, hb, ksc, kmn, rows, lane);
            }
            __syncwarp();
            const int p0 = T.n_sink + b * block;
            if (TIERS || g.group_k % TPK == 0)
                rope_scores<HD, BK, NR, TPK, TIERS, false>(a, hb, rows, ksc, kmn, S, p0, jk, phk, nphk, Wk, s);
            else
                rope_scores<HD, BK, NR, TPK, TIERS, true>(a, hb, rows, ksc, kmn, S, p0, jk, phk, nphk, Wk, s);
        } else if constexpr (TIERS) {
            static_assert(BK == 2, "key tiers keep bits_k = 2 for the middle rows");
            __syncwarp();  // scales, mins and k_order of the head-block
            stage_params(L.layout, hb, sc_s, lane);
            for (int i = lane; i < HD / 16; i += 32) ((uint4 *)ord_s)[i] = ((const uint4 *)(hb + L.layout.k_order))[i];
            __syncwarp();
            tiered_scores<HD, NR, PF>(a, hb, ord_s, ksc, kmn, S, jk, phk, nphk, p_s, s);
        } else {
            float off[NGW][NR], base[NGW][NR];
#pragma unroll
            for (int r = 0; r < NR; ++r) {
#pragma unroll
                for (int gi = 0; gi < NGW; ++gi) off[gi][r] = base[gi][r] = 0.0f;
#pragma unroll
                for (int u = 0; u < TPK; ++u) s[u][r] = 0.0f;
            }
#pragma unroll 1
            for (int c0 = 0; c0 < cplk; c0 += PF) {
                uint32_t w[PF];
#pragma unroll
                for (int i = 0; i < PF; ++i) w[i] = c0 + i < cplk ? kc[(c_first + c0 + i) * Wk + jk] : 0u;
                if (c0 == 0) {  // scales and mins of the head-block
                    __syncwarp();
                    stage_params(L.layout, hb, sc_s, lane);
                    __syncwarp();
                }
#pragma unroll
                for (int i = 0; i < PF; ++i) {
                    if (c0 + i >= cplk) break;
                    const int c = c_first + c0 + i;
                    float qs[NGW][NR];
#pragma unroll
                    for (int gi = 0; gi < NGW; ++gi) {
                        const float2 kp = param_at(g, ksc, kmn, gk[gi] * HD + c);
                        const float ks = kp.x, km = kp.y;
#pragma unroll
                        for (int r = 0; r < NR; ++r) {
                            qs[gi][r] = S.q[r][c] * ks;
                            off[gi][r] += qs[gi][r];
                            base[gi][r] = fmaf(S.q[r][c], km, base[gi][r]);
                        }
                    }
                    fma_word<BK, NR, NGW>(w[i], qs, s);
                }
            }
            const uint8_t * mask = hb + L.layout.mask;
#pragma unroll
            for (int r = 0; r < NR; ++r) {
#pragma unroll
                for (int gi = 0; gi < NGW; ++gi) {
                    warp_sum_from(off[gi][r], Wk);
                    warp_sum_from(base[gi][r], Wk);
                }
#pragma unroll
                for (int u = 0; u < TPK; ++u) {
                    const int gi = group_of_byte<NGW>(u / CPBK);
                    warp_sum_from(s[u][r], Wk);
                    const int t       = jk * TPK + u;
                    const bool masked = a.traces && ((mask[t >> 3] >> (t & 7)) & 1);
                    s[u][r]           = masked ? -INFINITY : (s[u][r] - off[gi][r]) * code_weight<BK>(u) + base[gi][r];
                }
            }
        }

        // online softmax over the block's slots
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            float mx = -INFINITY;
#pragma unroll
            for (int u = 0; u < TPK; ++u) mx = fmaxf(mx, s[u][r]);
            for (int o = 1; o < Wk; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_new = fmaxf(sm.m[r], mx);
            const float corr  = m_new == -INFINITY ? 1.0f : exp2_ftz(sm.m[r] - m_new);
            float psum        = 0.0f;
#pragma unroll
            for (int u = 0; u < TPK; ++u) {
                s[u][r] = m_new == -INFINITY ? 0.0f : exp2_ftz(s[u][r] - m_new);
                psum += s[u][r];
            }
            for (int o = 1; o < Wk; o <<= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o);
            sm.l[r] = sm.l[r] * corr + psum;
            sm.m[r] = m_new;
#pragma unroll
            for (int gi = 0; gi < NGW; ++gi) {
                sv[gi][r] *= corr;
                mv[gi][r] *= corr;
            }
#pragma unroll
            for (int u = 0; u < TPV; ++u) accv[u][r] *= corr;
        }
        if (phk == 0) {
#pragma unroll
            for (int r = 0; r < NR; ++r) {
#pragma unroll
                for (int u = 0; u < TPK; ++u) p_s[(size_t)r * block + jk * TPK + u] = s[u][r];
            }
        }
        __syncwarp();

        // values: the lane's slots t_first .., channels jv*TPV .. jv*TPV+TPV-1
#pragma unroll 1
        for (int t0 = 0; t0 < tplv; t0 += PF) {
            uint32_t w[PF];
#pragma unroll
            for (int i = 0; i < PF; ++i) w[i] = t0 + i < tplv ? vc[(t_first + t0 + i) * WV + jv] : 0u;
#pragma unroll
            for (int i = 0; i < PF; ++i) {
                if (t0 + i >= tplv) break;
                const int t = t_first + t0 + i;
                float pv[NGW][NR];
#pragma unroll
                for (int gi = 0; gi < NGW; ++gi) {
                    const float2 vp = vparam_at(g, vsc, vmn, t * n_gv + gv[gi]);
                    const float vs = vp.x, vm = vp.y;
#pragma unroll
                    for (int r = 0; r < NR; ++r) {
                        const float p = p_s[(size_t)r * block + t];
                        pv[gi][r]     = p * vs;
                        sv[gi][r] += pv[gi][r];
                        mv[gi][r] = fmaf(p, vm, mv[gi][r]);
                    }
                }
                fma_word<BV, NR, NGW>(w[i], pv, accv);
            }
        }
        __syncwarp();
    }

    // this warp's weighted values, summed over its lanes' slot sets, into shared memory
    __syncthreads();             // the per-warp regions become red
    float * red = (float *)dyn;  // [WARPS][NR][HD]
#pragma unroll
    for (int r = 0; r < NR; ++r) {
#pragma unroll
        for (int u = 0; u < TPV; ++u) {
            const int gi = group_of_byte<NGW>(u / CPBV);
            float x      = (accv[u][r] - sv[gi][r]) * code_weight<BV>(u) + mv[gi][r];
            warp_sum_from(x, WV);
            if (phv == 0) red[((size_t)warp * NR + r) * HD + jv * TPV + u] = x;
        }
    }
    put_state<HD, NR>(S, warp, sm);
}

// ---- fp16 rows and the chunk ------------------------------------------------------------------

// Rows [t0, t1) of one source, G at a time, into a warp's online softmax (sm, acc; lane
// channels 2(lane + 32i), +1). load(t, k, v) fills row t's K and V (the lane's channels);
// valid(t, r) says whether row r may see it. A round loads its G rows, scores them, and then
// moves the softmax once: one rescale, G exponentials.
template <int HD, int NR, int G, typename LOAD, typename VALID>
__device__ __forceinline__ void attend_rows(int t0, int t1, LOAD load, VALID valid, const float (&q)[NR][HD / 32],
                                            softmax_rows<NR> & sm, float (&acc)[HD / 32][NR]) {
    constexpr int CPL = HD / 32;
    for (int t = t0; t < t1; t += G) {
        float k[G][CPL], v[G][CPL];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (t + g < t1) {
                load(t + g, k[g], v[g]);
            } else {
#pragma unroll
                for (int i = 0; i < CPL; ++i) k[g][i] = v[g][i] = 0.0f;
            }
        }
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            float d[G];
            float mx = -INFINITY;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                d[g] = 0.0f;
#pragma unroll
                for (int i = 0; i < CPL; ++i) d[g] = fmaf(q[r][i], k[g][i], d[g]);
                warp_sum_from(d[g], 1);
                d[g] = t + g < t1 && valid(t + g, r) ? d[g] : -INFINITY;
                mx   = fmaxf(mx, d[g]);
            }
            const float m_new = fmaxf(sm.m[r], mx);
            if (m_new == -INFINITY) continue;  // nothing this row may see yet
            const float corr = exp2_ftz(sm.m[r] - m_new);
            sm.l[r] *= corr;
#pragma unroll
            for (int i = 0; i < CPL; ++i) acc[i][r] *= corr;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float p = exp2_ftz(d[g] - m_new);
                sm.l[r] += p;
#pragma unroll
                for (int i = 0; i < CPL; ++i) acc[i][r] = fmaf(p, v[g][i], acc[i][r]);
            }
            sm.m[r] = m_new;
        }
    }
}

// The fp16 phase of split blockIdx.y: its share of the tile's rows in the order sink, pool,
// extra pool, window, chunk (the chunk's own K/V, rounded to fp16, causally), each warp a
// contiguous part of it; as state slot WARPS + warp, its values in fv[warp]. ROPE: keys
// cached before RoPE, turned at their positions (rope_lane).
template <int HD, int NR, bool ROPE>
__device__ void attend_fp16(const ott_cuda_attn_args & a, const ott_cuda_attn_tile & T, attn_smem<HD, NR> & S,
                            float * fv) {
    constexpr int CPL = HD / 32;    // channels per lane: 2(lane + 32i), +1
    constexpr int G   = 1024 / HD;  // rows in flight per warp: 2 KB
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const ott_cuda_kv_layer & L = a.L;
    const int64_t sh            = (int64_t)T.seq * L.n_head_kv + T.head;
    const int n_pool            = L.pool_cap > 0 ? L.n_pool[sh] : 0;
    const int n_extra           = L.extra_cap > 0 ? L.n_extra[sh] : 0;
    const int e_sink = T.n_sink, e_pool = e_sink + n_pool, e_extra = e_pool + n_extra, e_win = e_extra + T.n_win;
    const int n_all = L.ring ? 0 : e_win + T.n_q;  // the recent view's launch: none
    const int per   = (n_all + a.n_splits - 1) / a.n_splits;
    const int f0 = min(n_all, (int)blockIdx.y * per), f1 = min(n_all, f0 + per);
    const int per_w = (f1 - f0 + WARPS - 1) / WARPS;
    const int u0 = min(f1, f0 + warp * per_w), u1 = min(f1, u0 + per_w);  // this warp's rows

    softmax_rows<NR> sm;
    float acc[CPL][NR], q[NR][CPL];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        sm.m[r] = -INFINITY;
        sm.l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < CPL / 2; ++i) {
            const float2 qq = *(const float2 *)&S.q[r][2 * (lane + 32 * i)];
            q[r][2 * i]     = qq.x;
            q[r][2 * i + 1] = qq.y;
            acc[2 * i][r] = acc[2 * i + 1][r] = 0.0f;
        }
    }

    // the fp16 stores, in 5 pieces (the window's rows start at row (win_pos0 - sink) % win_cap
    // of its ring and wrap once): row t of a piece at k + t·HD, v + t·HD, position pos[t] (the
    // pools) or p0 + t
    const int w0 = (T.win_pos0 - L.sink) % max(1, L.win_cap), n_w1 = min(T.n_win, L.win_cap - w0);
    const auto all = [](int, int) { return true; };
#pragma unroll 1
    for (int pc = 0; pc < 5; ++pc) {
        const ott_fp16 *kb, *vb;
        const int32_t * pos = nullptr;
        int first, n, p0 = 0;
        if (pc == 0) {
            kb    = L.sink_k + sh * L.sink * HD;
            vb    = L.sink_v + sh * L.sink * HD;
            first = 0;
            n     = e_sink;
        } else if (pc == 1) {
            kb    = L.pool_k + sh * L.pool_cap * HD;
            vb    = L.pool_v + sh * L.pool_cap * HD;
            pos   = L.pool_pos + sh * L.pool_cap;
            first = e_sink;
            n     = n_pool;
        } else if (pc == 2) {
            kb    = L.extra_k + sh * L.extra_cap * HD;
            vb    = L.extra_v + sh * L.extra_cap * HD;
            pos   = L.extra_pos + sh * L.extra_cap;
            first = e_pool;
            n     = n_extra;
        } else if (pc == 3) {
            kb    = L.win_k + (sh * L.win_cap + w0) * HD;
            vb    = L.win_v + (sh * L.win_cap + w0) * HD;
            first = e_extra;
            n     = n_w1;
            p0    = T.win_pos0;
        } else {
            kb    = L.win_k + sh * L.win_cap * HD;
            vb    = L.win_v + sh * L.win_cap * HD;
            first = e_extra + n_w1;
            n     = T.n_win - n_w1;
            p0    = T.win_pos0 + n_w1;
        }
        const int t0 = max(u0, first) - first, t1 = min(u1, first + n) - first;
        if (t0 >= t1) continue;
        const auto load = [&](int t, float (&k)[CPL], float (&v)[CPL]) {
            const __half2 *kr = (const __half2 *)(kb + (size_t)t * HD), *vr = (const __half2 *)(vb + (size_t)t * HD);
#pragma unroll
            for (int i = 0; i < CPL / 2; ++i) {
                const float2 kf = __half22float2(kr[lane + 32 * i]), vf = __half22float2(vr[lane + 32 * i]);
                k[2 * i]     = kf.x;
                k[2 * i + 1] = kf.y;
                v[2 * i]     = vf.x;
                v[2 * i + 1] = vf.y;
            }
            if constexpr (ROPE) rope_lane<HD>(L, pos ? pos[t] : p0 + t, lane, k);
        };
        attend_rows<HD, NR, G>(t0, t1, load, all, q, sm, acc);
    }

    // the chunk: its token j may be seen by the rows whose chunk token is j or later
    int last_q[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) last_q[r] = r < T.n_rows ? (T.row0 + r) / a.n_rep : -1;
    const auto load_chunk = [&](int j, float (&k)[CPL], float (&v)[CPL]) {
        const float * kr = a.k.data + (int64_t)(T.t0 + j) * a.k.nb2 + (int64_t)T.head * a.k.nb1;
        const float * vr = a.v.data + (int64_t)(T.t0 + j) * a.v.nb2 + (int64_t)T.head * a.v.nb1;
#pragma unroll
        for (int i = 0; i < CPL / 2; ++i) {
            const float2 kf = ((const float2 *)kr)[lane + 32 * i], vf = ((const float2 *)vr)[lane + 32 * i];
            k[2 * i]     = __half2float(__float2half_rn(kf.x));
            k[2 * i + 1] = __half2float(__float2half_rn(kf.y));
            v[2 * i]     = __half2float(__float2half_rn(vf.x));
            v[2 * i + 1] = __half2float(__float2half_rn(vf.y));
        }
        if constexpr (ROPE) rope_lane<HD>(L, T.win_pos0 + T.n_win + j, lane, k);
    };
    const auto causal = [&](int j, int r) { return j <= last_q[r]; };
    attend_rows<HD, NR, G>(max(u0, e_win) - e_win, min(u1, n_all) - e_win, load_chunk, causal, q, sm, acc);

    float * red = fv + (size_t)warp * NR * HD;  // [NR][HD]
#pragma unroll
    for (int r = 0; r < NR; ++r) {
#pragma unroll
        for (int i = 0; i < CPL / 2; ++i)
            *(float2 *)&red[(size_t)r * HD + 2 * (lane + 32 * i)] = make_float2(acc[2 * i][r], acc[2 * i + 1][r]);
    }
    put_state<HD, NR>(S, WARPS + warp, sm);
}

}  // namespace

#include "cuda/attn_imma.cuh"

namespace {

// Per-warp bytes of the block phase: the tensor-core kernel's buffers (attn_imma.cuh) or the
// FFMA kernel's.
__host__ __device__ inline size_t block_phase_bytes(const ott_kv_geom & g, const ott_kv_block_layout & L, int nr,
                                                    bool tensor_cores, bool rope) {
    return tensor_cores ? imma::warp_smem_bytes(L, nr) : warp_smem_bytes(g, L, nr, rope);
}

// The merge kernel is a programmatic dependent launch (sm_90+): it may start once every
// partial block has started (let_merge_start) and waits for the partial kernel's completion
// and memory (wait_for_partials), so its launch overlaps the partial kernel's last blocks.
__device__ __forceinline__ void let_merge_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

__device__ __forceinline__ void wait_for_partials() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// GKM > 0: the quantized-block phase on integer tensor cores (attn_imma.cuh; HD 128, BK/BV 2/2, 4/2, 4/4)
// for up to GKM key and GVM value A rows. One-row tiles there keep to 128 registers, so that
// four blocks share a multiprocessor: on the H200 batches of 16 and more ran faster that way
// than with three blocks at 168 registers (no spills), batches of 8 a little slower. The one-row
// keys-before-RoPE kernels (ROPE) keep to 128 as well (no spills at head size 128; a few
// outside the block loop at head size 64 without key tiers): on an H100 their old blocks took
// 0.49 ms instead of 0.54 at batch 8, 3.63 instead of 4.04 at batch 64.
template <int HD, int BK, int BV, int NR, int NGW, int PF, int GKM = 0, int GVM = 0, bool TIERS = false,
          bool ROPE = false>
__global__ void __launch_bounds__(WARPS * 32, (GKM || ROPE) && NR == 1 ? 4 : 1)
    attn_partial_kernel(const ott_cuda_attn_args a) {
    extern __shared__ __align__(16) uint8_t dyn[];
    __shared__ attn_smem<HD, NR> S;
    let_merge_start();
    const ott_cuda_attn_tile T = a.tiles[blockIdx.x];
    if constexpr (GKM > 0)
        imma::copy_first_keys<NR, BK, BV>(a, T, dyn);  // in flight while the queries and fp16 rows load

    // queries of the tile's rows, times kq_scale·log2 e; rows past n_rows are 0
    for (int i = threadIdx.x; i < NR * HD; i += blockDim.x) {
        const int r = i / HD, c = i % HD;
        float x = 0.0f;
        if (r < T.n_rows) {
            const int rho = T.row0 + r;
            const int tok = T.t0 + rho / a.n_rep, hq = T.head * a.n_rep + rho % a.n_rep;
            x = a.q.data[(int64_t)tok * a.q.nb2 + (int64_t)hq * a.q.nb1 + c] * (a.kq_scale * LOG2E);
        }
        S.q[r][c] = x;
    }
    __syncthreads();
    // Tensor cores: the fp16 rows first, their loads overlapping the first head-block's copy.
    // FFMA: after the quantized blocks (first, they cost the one-row kernel 5 registers more,
    // past the 168 that let three blocks share a multiprocessor).
    constexpr bool fp16_first = GKM > 0;
    const size_t per_warp     = block_phase_bytes(a.L.geom, a.L.layout, NR, GKM > 0, ROPE);
    float * fv                = (float *)(dyn + fp16_values_at(per_warp, NR, HD, fp16_first));
    if constexpr (fp16_first) attend_fp16<HD, NR, false>(a, T, S, fv);
    if constexpr (GKM > 0)
        attend_blocks_imma<NR, GKM, GVM, BK, BV, TIERS>(a, T, S, dyn);
    else
        attend_blocks<HD, BK, BV, NR, NGW, PF, TIERS, ROPE>(a, T, S, dyn);
    if constexpr (!fp16_first) attend_fp16<HD, NR, ROPE>(a, T, S, fv);
    write_partial<HD, NR>(a, S, (const float *)dyn, fv, T);
}

inline bool pow2_upto_32(int x) { return x >= 1 && x <= 32 && (x & (x - 1)) == 0; }

// dynamic shared memory (attn_smem; tensor_cores: the tensor-core kernel's; rope: keys before RoPE)
inline size_t dyn_smem(const ott_kv_geom & g, int nr, bool tensor_cores = false, bool rope = false) {
    const ott_kv_block_layout L = ott_kv_block_layout_of(&g);
    const size_t per_warp       = block_phase_bytes(g, L, nr, tensor_cores, rope);
    const size_t fv_end =
        fp16_values_at(per_warp, nr, g.head_dim, tensor_cores) + (size_t)WARPS * nr * g.head_dim * sizeof(float);
    return std::max(WARPS * per_warp, fv_end);
}

// Launch the kernel, or with occupancy, store how many of its blocks fit a multiprocessor.
template <int HD, int BK, int BV, int NR, int NGW, int PF, int GKM = 0, int GVM = 0, bool TIERS = false,
          bool ROPE = false>
cudaError_t launch_partial(const ott_cuda_attn_args & a, cudaStream_t stream, int * occupancy) {
    if constexpr (HD * BV > 32 * 32) {  // a value row of more than 32 words: unsupported
        return cudaErrorInvalidValue;
    } else {
        const auto kernel               = attn_partial_kernel<HD, BK, BV, NR, NGW, PF, GKM, GVM, TIERS, ROPE>;
        const size_t smem               = dyn_smem(a.L.geom, NR, GKM > 0, ROPE);
        static const size_t static_smem = [&] {
            cudaFuncAttributes fa {};
            return cudaFuncGetAttributes(&fa, kernel) == cudaSuccess ? fa.sharedSizeBytes : 0;
        }();
        const cudaError_t e = ott_cuda_allow_smem((const void *)kernel, smem, static_smem);
        if (e != cudaSuccess) return e;
        if (occupancy) return cudaOccupancyMaxActiveBlocksPerMultiprocessor(occupancy, kernel, WARPS * 32, smem);
        kernel<<<dim3(a.n_tiles, a.n_splits), WARPS * 32, smem, stream>>>(a);
        return cudaGetLastError();
    }
}

// Whether the integer tensor-core block phase serves tiles of nr rows of geometry g.
inline bool imma_applies(const ott_kv_geom & g, int32_t tensor_cores, int nr) {
    return tensor_cores && (!ott_kv_tiered(&g) || imma::tiers_fit(g)) && g.head_dim == imma::HD &&
           g.block == imma::BLOCK && (g.bits_k == 2 || g.bits_k == 4) && (g.bits_v == 2 || g.bits_v == 4) &&
           nr * (g.block / g.group_k) <= 8 && nr * (g.head_dim / g.group_v) <= 8;
}

// The kernel's rows per tile for tiles of at most rows_per_tile rows: 1, 2 or 4.
inline int kernel_rows(int32_t rows_per_tile) {
    int rows = 1;
    while (rows < OTT_CUDA_ATTN_ROWS && rows < rows_per_tile) rows *= 2;
    return rows;
}

// The tensor-core kernels: one key row and up to two or four value rows (decode with the
// design's groups), else up to 8 each.
template <int HD, int BK, int BV, int NR, bool TIERS>
cudaError_t launch_imma(const ott_cuda_attn_args & a, cudaStream_t stream, int * occ) {
    const ott_kv_geom & g = a.L.geom;
    if constexpr (NR == 1) {
        if (g.group_k == imma::BLOCK && g.group_v >= imma::HD / 2)
            return launch_partial<HD, BK, BV, 1, 1, 8, 1, 2, TIERS>(a, stream, occ);
        if (g.group_k == imma::BLOCK && g.group_v >= imma::HD / 4)
            return launch_partial<HD, BK, BV, 1, 1, 8, 1, 4, TIERS>(a, stream, occ);
    }
    return launch_partial<HD, BK, BV, NR, 1, 8, 8, 8, TIERS>(a, stream, occ);
}

// one group per code word (groups of at least 32 bits of codes), else a group per byte
template <int HD, int BK, int BV, int NR>
cudaError_t launch_groups(const ott_cuda_attn_args & a, cudaStream_t stream, int * occ) {
    const ott_kv_geom & g = a.L.geom;
    if (a.L.rope) {  // keys before RoPE: the FFMA kernel with rope_scores, on every GPU
        const bool tiers = BK == 2 && ott_kv_tiered(&g), word = g.group_v * BV >= 32;
        if (tiers) {
            return word ? launch_partial<HD, BK, BV, NR, 1, 8, 0, 0, BK == 2, true>(a, stream, occ)
                        : launch_partial<HD, BK, BV, NR, 4, 8, 0, 0, BK == 2, true>(a, stream, occ);
        }
        return word ? launch_partial<HD, BK, BV, NR, 1, 8, 0, 0, false, true>(a, stream, occ)
                    : launch_partial<HD, BK, BV, NR, 4, 8, 0, 0, false, true>(a, stream, occ);
    }
    if constexpr (HD == imma::HD && (BK == 2 || BK == 4) && (BV == 2 || BV == 4)) {
        if (imma_applies(g, a.tensor_cores, NR)) {
            if constexpr (BK == 2) {
                if (ott_kv_tiered(&g)) return launch_imma<HD, BK, BV, NR, true>(a, stream, occ);
            }
            return launch_imma<HD, BK, BV, NR, false>(a, stream, occ);
        }
    }
    if constexpr (BK == 2 && BV == 2) {
        if (ott_kv_tiered(&g)) {
            return g.group_v * BV >= 32 ? launch_partial<HD, BK, BV, NR, 1, 8, 0, 0, true>(a, stream, occ)
                                        : launch_partial<HD, BK, BV, NR, 4, 8, 0, 0, true>(a, stream, occ);
        }
    }
    if (g.group_k * BK >= 32 && g.group_v * BV >= 32) {
        if constexpr (NR == 1) {  // decode: the prefetch depth is tunable
            switch (a.prefetch) {
                case 16: return launch_partial<HD, BK, BV, 1, 1, 16>(a, stream, occ);
                case 32: return launch_partial<HD, BK, BV, 1, 1, 32>(a, stream, occ);
                default: return launch_partial<HD, BK, BV, 1, 1, 8>(a, stream, occ);
            }
        }
        return launch_partial<HD, BK, BV, NR, 1, 16>(a, stream, occ);
    }
    return launch_partial<HD, BK, BV, NR, 4, 16>(a, stream, occ);
}

}  // namespace

namespace ott_attn {
// The partial kernel of head size HD and key/value code widths BK/BV for tiles of nr rows
// (1, 2 or 4): launched, or with occ, its blocks per multiprocessor. Defined in attn_rows.cu,
// which is compiled once per (HD, BK, BV) so that the kernels build in parallel.
template <int HD, int BK, int BV>
cudaError_t launch_rows(const ott_cuda_attn_args & a, int nr, cudaStream_t stream, int * occ);
}  // namespace ott_attn
