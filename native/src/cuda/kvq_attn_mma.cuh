// kvq_attn_mma.cuh — KVQuant's attention on tensor cores for groups of 5 to 16 query rows
// (a prompt's tiles, GQA heads) of head size 64 or 128 (kvq_attn.cu: mma_serves); the
// split kernel (kvq_attn_split.cuh) keeps 1 to 4 rows and head size 256. Same grid, splits
// and partials as the split kernel, with all rows of a group in one thread block.
//
// A warp takes a 32-key unit at a time and, in its own shared tile:
//  - keys: lane (sg, ps) dequantises slots 8·sg .. 8·sg+7 of the channel pairs ps, ps+8, ..
//    (the split kernel's cubic or shuffle), rotates each pair by RoPE at the slot's
//    position and stores it as fp16 in K [32 slots][HD] (row stride HD+8: conflict-free
//    fragment loads); S = Q·Kᵀ by mma.sync m16n8k16 (fp16 operands, fp32 sums), Q the rows'
//    queries times kq_scale·log2 e in fp16 (rows past the group's are zero); the scores go
//    through shared memory, where sparse keys add (exact − dense)·q rotated to their
//    position as in the split kernel and fp16 units mask what a row may not see;
//  - the online softmax per row in registers (lane (g, t) holds rows g and g+8, slots
//    8j+2t, 8j+2t+1), P rounded to fp16 is the A operand of O += P·V directly (the scores'
//    accumulator layout is the next product's operand layout);
//  - values: lane t dequantises slot t (zero + scale·level) into Vᵀ [HD][32] (row stride 40,
//    in the keys' place), sparse values overwrite their entries exactly; O [16][HD] stays in
//    registers (HD/2 floats a lane).
// fp16 units (sink, window, the chunk's rows): lane t rotates row t at its position.
// Error: fp16 operands (keys after RoPE, queries, probabilities, values), within 2e-3 of
// the CPU's float32 attention in the kernel checks.
#pragma once

#include "cuda/kvq_attn_split.cuh"

namespace {

namespace mma {

using split::FULL;
using split::UNIT;
using split::WARPS;

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *(const uint32_t *)&h;
}

// D += A·B for one m16n8k16 tile, fp16 operands, fp32 accumulators.
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

constexpr int ROWS = OTT_CUDA_KVQ_ROWS;  // 16: one m-tile

template <int HD> struct tile_dims {
    static constexpr int KS   = HD + 8;                                     // K row stride (halves)
    static constexpr int VS   = UNIT + 8;                                   // Vᵀ row stride (halves)
    static constexpr int HALF = UNIT * KS > HD * VS ? UNIT * KS : HD * VS;  // a warp's tile (halves)
};

template <int HD> struct smem_t {
    __half q16[ROWS][HD + 8];  // queries times kq_scale·log2 e, fp16 (A operand)
    float q[ROWS][HD];         // the same in fp32 (sparse keys' corrections)
    split::key_tables<HD> tabs;
    float s[WARPS][ROWS][UNIT + 1];
    float m[WARPS][ROWS];
    float l[WARPS][ROWS];
};

// Dynamic shared memory: each warp's K / Vᵀ tile, later its rows' weighted values (float [ROWS][HD]).
template <int HD> __host__ __device__ constexpr size_t warp_tile_bytes() {
    constexpr size_t t = (size_t)tile_dims<HD>::HALF * 2, o = (size_t)ROWS * HD * 4;
    return t > o ? t : o;
}
template <int HD> __host__ __device__ constexpr size_t tile_bytes() { return WARPS * warp_tile_bytes<HD>(); }

template <int HD, int BITS, typename Groups>
__global__ void __launch_bounds__(WARPS * 32, 2)
    kvq_mma_kernel(const ott_kvq_geom g, const Groups groups, const ott_rope_table R, float kq_scale, int32_t n_splits,
                   float * partials) {
    using D                 = tile_dims<HD>;
    constexpr uint32_t MASK = (1u << BITS) - 1;
    constexpr int NK        = HD / 16;  // k-steps of Q·Kᵀ
    constexpr int NO        = HD / 8;   // n-tiles of P·V
    __shared__ smem_t<HD> S;
    extern __shared__ __align__(16) uint8_t tile_mem[];
    const auto G     = groups.at(blockIdx.x, HD);
    const int32_t nr = min(ROWS, G.rows());
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int gq = lane / 4, tq = lane % 4;  // the mma fragments' row and column group
    const int half = R.cs ? R.n_rot / 2 : 0;
    __half * kt    = (__half *)(tile_mem + w * warp_tile_bytes<HD>());  // [UNIT][KS]
    __half * vt    = kt;                                                // [HD][VS]
    for (int e = threadIdx.x; e < ROWS * HD; e += blockDim.x) {
        const int r = e / HD, c = e % HD;
        const float x = r < nr ? G.query(r)[c] * (kq_scale * split::LOG2E) : 0.0f;
        S.q[r][c]     = x;
        S.q16[r][c]   = __float2half_rn(x);
    }
    S.tabs.template fill<BITS>(G.tab, R, half);
    const float4 va = BITS == 2 ? split::cubic_through(G.tab.levels_v, 1.0, 0.0) : make_float4(1.0f, 0.0f, 0.0f, 0.0f);
    const float lk  = BITS == 2 ? 0.0f : G.tab.levels_k[lane & MASK];
    const float lv  = BITS == 2 ? 0.0f : G.tab.levels_v[lane & MASK];
    __syncthreads();

    uint32_t qf[NK][4];  // A fragments of Q
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
        qf[kk][0] = *(const uint32_t *)&S.q16[gq][16 * kk + 2 * tq];
        qf[kk][1] = *(const uint32_t *)&S.q16[gq + 8][16 * kk + 2 * tq];
        qf[kk][2] = *(const uint32_t *)&S.q16[gq][16 * kk + 8 + 2 * tq];
        qf[kk][3] = *(const uint32_t *)&S.q16[gq + 8][16 * kk + 8 + 2 * tq];
    }
    float o[NO][4];
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m[2] = { -INFINITY, -INFINITY }, l[2] = { 0.0f, 0.0f };  // rows gq, gq+8 (l: this lane's share)

    const ott_kvq_block_layout Lb = ott_kvq_block_layout_of(&g);
    const uint32_t k_row = (uint32_t)g.block * BITS / 8, v_row = HD * BITS / 8;
    const int sg = lane / 8, ps = lane % 8;
    const int32_t upb = g.block / UNIT, n_qu = G.n_blocks() * upb;
    const int32_t n_u = n_qu + (G.n_fp() + UNIT - 1) / UNIT, per = (n_u + n_splits - 1) / n_splits;
    const int32_t u_end = min(n_u, (int32_t)(blockIdx.y + 1) * per);

    for (int32_t u = blockIdx.y * per + w; u < u_end; u += WARPS) {
        const bool quant = u < n_qu;
        const int32_t jb = u / upb, t0 = (u % upb) * UNIT, f0 = (u - n_qu) * UNIT;
        const uint8_t * b  = quant ? G.block(jb) : nullptr;
        const int32_t n_fp = quant ? UNIT : min(UNIT, G.n_fp() - f0);
        // keys into kt, rotated to their positions
        if (quant) {
            const int32_t P0 = G.pos0() + jb * g.block + t0;
            for (int i = ps; i < HD / 2; i += 8) {
                const split::pair_ch c = split::pair_of(i, half, R.neox);
                const uint8_t *ka_row  = b + Lb.k_codes + (size_t)c.a * k_row,
                              *kb_row  = b + Lb.k_codes + (size_t)c.b * k_row;
                const uint32_t xa      = split::codes8<BITS>(ka_row, (t0 + 8 * sg) * BITS / 8);
                const uint32_t xb      = split::codes8<BITS>(kb_row, (t0 + 8 * sg) * BITS / 8);
                const float4 A = S.tabs.kc[c.a], B = S.tabs.kc[c.b];
                const float2 step = S.tabs.a1[0][i];
                float2 cs = c.rot ? split::compose(split::angle(R, i, P0), S.tabs.a8[sg][i]) : make_float2(1.0f, 0.0f);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const float ka = split::deq<BITS>(xa, j, A, lk), kb = split::deq<BITS>(xb, j, B, lk);
                    __half * row = kt + (8 * sg + j) * D::KS;
                    row[c.a]     = __float2half_rn(ka * cs.x - kb * cs.y);
                    row[c.b]     = __float2half_rn(ka * cs.y + kb * cs.x);
                    cs           = split::compose(cs, step);
                }
            }
        } else {
            const int32_t pos = lane < n_fp ? G.fp_pos(f0 + lane) : 0;
            __half * row      = kt + lane * D::KS;
            for (int i = 0; i < HD / 2; ++i) {
                const split::pair_ch c = split::pair_of(i, half, R.neox);
                const float ka         = lane < n_fp ? G.fp_k(f0 + lane, c.a) : 0.0f;
                const float kb         = lane < n_fp ? G.fp_k(f0 + lane, c.b) : 0.0f;
                const float2 cs        = c.rot ? split::angle(R, i, pos) : make_float2(1.0f, 0.0f);
                row[c.a]               = __float2half_rn(ka * cs.x - kb * cs.y);
                row[c.b]               = __float2half_rn(ka * cs.y + kb * cs.x);
            }
        }
        __syncwarp();
        // S = Q·Kᵀ, into shared memory
        float sc[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
            const __half * krow                       = kt + (8 * j + gq) * D::KS + 2 * tq;
#pragma unroll
            for (int kk = 0; kk < NK; ++kk)
                mma16816(sc[j], qf[kk], *(const uint32_t *)(krow + 16 * kk), *(const uint32_t *)(krow + 16 * kk + 8));
            S.s[w][gq][8 * j + 2 * tq]         = sc[j][0];
            S.s[w][gq][8 * j + 2 * tq + 1]     = sc[j][1];
            S.s[w][gq + 8][8 * j + 2 * tq]     = sc[j][2];
            S.s[w][gq + 8][8 * j + 2 * tq + 1] = sc[j][3];
        }
        __syncwarp();
        if (quant) {  // sparse keys: (exact - dense) times the row's query rotated to the key's position
            for (int e = lane; e < g.n_out; e += 32) {
                const int32_t idx = load16(b + Lb.k_out_idx + 2 * e), tt = idx / HD - t0, ch = idx % HD;
                if (tt < 0 || tt >= UNIT) continue;
                const uint32_t code = ott_kvq_code_at(b + Lb.k_codes + (size_t)ch * k_row, t0 + tt, BITS, k_row);
                const float d =
                    f16(load16(b + Lb.k_out_val + 2 * e)) - split::level_at<BITS>(code, S.tabs.kc[ch], G.tab.levels_k);
                const int i            = split::pair_index(ch, half, R.neox);
                const split::pair_ch c = split::pair_of(i, half, R.neox);
                const int32_t P0       = G.pos0() + jb * g.block + t0;
                const float2 cs        = c.rot ? split::angle(R, i, P0 + tt) : make_float2(1.0f, 0.0f);
                for (int r = 0; r < nr; ++r) atomicAdd(&S.s[w][r][tt], d * split::rotated_query(S.q[r], c, ch, cs));
            }
            __syncwarp();
        }
        // online softmax of rows gq, gq+8 over this lane's 8 slots; P as fp16 A fragments
        uint32_t pf[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = gq + 8 * h;
            float s8[8], mt = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int t     = 8 * j + 2 * tq + e;
                    const bool seen = r < nr && (quant || (t < n_fp && f0 + t < G.visible(r)));
                    s8[2 * j + e]   = seen ? S.s[w][r][t] : -INFINITY;
                    mt              = fmaxf(mt, s8[2 * j + e]);
                }
            mt               = fmaxf(mt, __shfl_xor_sync(FULL, mt, 1));
            mt               = fmaxf(mt, __shfl_xor_sync(FULL, mt, 2));
            const float mn   = fmaxf(m[h], mt);
            const float corr = mn == -INFINITY ? 1.0f : exp2_ftz(m[h] - mn);
            float p8[8], sum = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                p8[e] = mn == -INFINITY ? 0.0f : exp2_ftz(s8[e] - mn);
                sum += p8[e];
            }
            l[h] = l[h] * corr + sum;
            m[h] = mn;
#pragma unroll
            for (int j = 0; j < NO; ++j) {
                o[j][2 * h] *= corr;
                o[j][2 * h + 1] *= corr;
            }
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {  // keys 16kk .. 16kk+15: n-tiles 2kk and 2kk+1
                pf[kk][h]     = pack_half2(p8[4 * kk], p8[4 * kk + 1]);
                pf[kk][2 + h] = pack_half2(p8[4 * kk + 2], p8[4 * kk + 3]);
            }
        }
        // values into vt (Vᵀ), in the keys' place
        __syncwarp();
        if (quant) {
            const int32_t slot = t0 + lane;
            const float z = f16(load16(b + Lb.v_zero + 2 * slot)), vs = f16(load16(b + Lb.v_scale + 2 * slot));
            const uint8_t * vrow = b + Lb.v_codes + (size_t)slot * v_row;
#pragma unroll 4
            for (int c0 = 0; c0 < HD; c0 += 8) {
                const uint32_t x = split::codes8<BITS>(vrow, c0 * BITS / 8);
#pragma unroll
                for (int ch = 0; ch < 8; ++ch)
                    vt[(c0 + ch) * D::VS + lane] = __float2half_rn(fmaf(split::deq<BITS>(x, ch, va, lv), vs, z));
            }
            __syncwarp();
            for (int e = lane; e < g.n_out; e += 32) {
                const int32_t idx = load16(b + Lb.v_out_idx + 2 * e), tt = idx / HD - t0, ch = idx % HD;
                if (tt >= 0 && tt < UNIT) vt[ch * D::VS + tt] = __ushort_as_half(load16(b + Lb.v_out_val + 2 * e));
            }
        } else {
            for (int c = 0; c < HD; ++c)
                vt[c * D::VS + lane] = __float2half_rn(lane < n_fp ? G.fp_v(f0 + lane, c) : 0.0f);
        }
        __syncwarp();
        // O += P·V
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            const __half * vrow = vt + (8 * j + gq) * D::VS + 2 * tq;
#pragma unroll
            for (int kk = 0; kk < 2; ++kk)
                mma16816(o[j], pf[kk], *(const uint32_t *)(vrow + 16 * kk), *(const uint32_t *)(vrow + 16 * kk + 8));
        }
        __syncwarp();
    }

    // the warp's rows: sums over the quads, weighted values into its tile, then the warps combined
    float * ow = (float *)kt;  // [ROWS][HD]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(FULL, l[h], 1);
        l[h] += __shfl_xor_sync(FULL, l[h], 2);
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            ow[(gq + 8 * h) * HD + 8 * j + 2 * tq]     = o[j][2 * h];
            ow[(gq + 8 * h) * HD + 8 * j + 2 * tq + 1] = o[j][2 * h + 1];
        }
        if (tq == 0) {
            S.m[w][gq + 8 * h] = m[h];
            S.l[w][gq + 8 * h] = l[h];
        }
    }
    __syncthreads();
    float * out = partials + ((size_t)blockIdx.x * n_splits + blockIdx.y) * ROWS * (HD + 2);
    split::write_partial<HD>(out, nr, S.m, S.l, [&](int ww, int r, int c) {
        return ((const float *)(tile_mem + ww * warp_tile_bytes<HD>()))[r * HD + c];
    });
}

}  // namespace mma

}  // namespace
