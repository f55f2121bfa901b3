// kvq_attn_split.cuh — KVQuant's attention for head sizes 64, 128 and 256, blocks of a
// multiple of 32 tokens and equal key and value widths (kvq_attn.cu: split_serves),
// flash-decoding style.
//
// Grid (n_groups, n_splits, row chunks), WARPS warps per block. A block serves NR rows of a
// group (rows NR·blockIdx.z ..) over split y's share of the group's units: the 32-key units
// of its head-blocks, then those of its fp16 rows. The warps take the split's units in turn,
// each with its own online softmax per row (log2 domain: q is scaled by kq_scale·log2 e); the
// block combines them into its partial (max, sum, weighted values per row) and
// kvq_merge_kernel a group's partials.
//
// A unit of a head-block (slots t0 .. t0+31, positions P0 + t): while a warp works on one,
// cp.async copies its next into the other of its two stage buffers: the unit's key and value
// codes, value ranges, sparse entries and RoPE angles at P0 (stage_words). Then
//  - keys: lane (sg, ps) = (lane / 8, lane % 8) holds slots 8·sg .. 8·sg+7 of the channel
//    pairs ps, ps+8, ..: one BITS-byte read per channel gives its 8 codes; each is dequantized
//    (2 bits: a cubic through the codebook's 4 levels, with the channel's scale and zero
//    folded in, at f = 1 + code/4 made from the code's bits without a conversion; 3 and 4
//    bits: the level, held by lane `code`, by shuffle, times scale plus zero); RoPE at the
//    slot's position (the angle at P0 composed with the one at 8·sg, then stepped by the
//    angle at 1) rotates the pair of keys, or with one row the query's pair the other way,
//    and q·k is accumulated per row. The 8 pair lanes' sums are reduce-scattered so that
//    lane t holds slot t's scores. Sparse keys add (exact - dense) times the query rotated to
//    their position to their slot's score.
//  - values: lane (sv, cg) holds channels 8·cg .. 8·cg+7 of slots sv, sv+SVN, ..: the level
//    times p·scale of its slot, summed per channel in registers; the zeros' share Σ p·zero is
//    one sum per row. Sparse values add p·(exact - dense) to a per-warp correction in shared
//    memory, which the online softmax rescales with the registers.
// fp16 units: lane t scores fp16 row t (rotated at its position, causally per row); values
// as above from the fp16 rows.
#pragma once

#include "cuda/warp_ops.cuh"
#include "cuda/kvq_attn_groups.cuh"

namespace {

namespace split {

constexpr int WARPS     = 4;
constexpr int UNIT      = 32;  // keys of a unit
constexpr float LOG2E   = 1.4426950408889634f;
constexpr unsigned FULL = 0xffffffffu;

// The 8 codes of BITS bits from byte `at` of p (4-byte aligned), in the low 8·BITS bits.
template <int BITS> __device__ __forceinline__ uint32_t codes8(const uint8_t * p, uint32_t at) {
    if constexpr (BITS == 2) {
        return *(const uint16_t *)(p + at);
    } else if constexpr (BITS == 4) {
        return *(const uint32_t *)(p + at);
    } else {
        const uint32_t * w = (const uint32_t *)(p + (at & ~3u));
        const uint32_t sh  = (at & 3u) * 8;
        return __funnelshift_r(w[0], sh > 8 ? w[1] : 0u, sh) & 0xffffffu;
    }
}

// f = 1 + code/4 of the 2-bit code j of x, made from its bits (no conversion): a shift and
// one LOP3, (x' & mask) | 1.0f, with 1.0f's bits in a register (two immediates take two LOP3s).
__device__ __forceinline__ float f2(uint32_t x, int j) {
    uint32_t f;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(f) : "r"(x << (21 - 2 * j)), "n"(3u << 21), "r"(0x3F800000u));
    return __uint_as_float(f);
}

__device__ __forceinline__ float cubic(const float4 & a, float f) {
    return fmaf(fmaf(fmaf(a.w, f, a.z), f, a.y), f, a.x);
}

// Coefficients (of f^0 .. f^3) of the cubic through levels lv[k] at f = 1 + k/4, scaled by s,
// plus z: Newton's divided differences, expanded (double).
__device__ float4 cubic_through(const float * lv, double s, double z) {
    constexpr double h = 0.25, f0 = 1.0;
    double d[4] = { lv[0], lv[1], lv[2], lv[3] };
    for (int k = 1; k < 4; ++k)
        for (int i = 3; i >= k; --i) d[i] = (d[i] - d[i - 1]) / (k * h);
    double a[4] = { d[3], 0.0, 0.0, 0.0 };
    for (int i = 2; i >= 0; --i) {  // a = a·(f - f_i) + d_i
        const double fi = f0 + i * h;
        for (int k = 3; k >= 1; --k) a[k] = a[k - 1] - fi * a[k];
        a[0] = -fi * a[0] + d[i];
    }
    return make_float4((float)(s * a[0] + z), (float)(s * a[1]), (float)(s * a[2]), (float)(s * a[3]));
}

// Per row, x summed over each run of lanes with equal keys (runs of consecutive lanes); the
// sum of a run lands in its last lane (a segmented scan).
template <int NR> __device__ __forceinline__ void run_sums(float (&x)[NR], int32_t key, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const bool same = __shfl_up_sync(FULL, key, o) == key && lane >= o;
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            const float y = __shfl_up_sync(FULL, x[r], o);
            if (same) x[r] += y;
        }
    }
}

// Channels (a, b) of pair i and whether RoPE rotates them (pairs past n_rot/2: channels
// n_rot + 2(i - n_rot/2) and the next, unrotated; half = 0: none rotated).
struct pair_ch {
    int a, b;
    bool rot;
};

__device__ __forceinline__ pair_ch pair_of(int i, int half, int neox) {
    if (i < half) return { neox ? i : 2 * i, neox ? i + half : 2 * i + 1, true };
    return { 2 * i, 2 * i + 1, false };
}

// cos and sin of pair i at position p.
__device__ __forceinline__ float2 angle(const ott_rope_table & R, int i, int p) {
    const int half = R.n_rot / 2;
    return make_float2(R.cs[(size_t)i * R.n_pos + p], R.cs[(size_t)(half + i) * R.n_pos + p]);
}

// The rotation by angle a, then by b.
__device__ __forceinline__ float2 compose(const float2 & a, const float2 & b) {
    return make_float2(a.x * b.x - a.y * b.y, a.y * b.x + a.x * b.y);
}

// The pair of channel ch (pair_of's i).
__device__ __forceinline__ int pair_index(int ch, int half, int neox) {
    return ch < 2 * half && neox ? (ch < half ? ch : ch - half) : ch / 2;
}

// The weight of a key entry at channel ch (of pair c) in q·k once k's pair is rotated by cs:
// the query's pair rotated back, at ch.
__device__ __forceinline__ float rotated_query(const float * q, const pair_ch & c, int ch, const float2 & cs) {
    const float qa = q[c.a], qb = q[c.b];
    return ch == c.a ? qa * cs.x + qb * cs.y : qb * cs.x - qa * cs.y;
}

// Level j of the 8 codes in x, scaled by a: 2 bits the cubic a at f2(x, j); wider codes
// a.x · level + a.y, the level from the lane that holds it in lev_lane (every lane calls).
template <int BITS> __device__ __forceinline__ float deq(uint32_t x, int j, const float4 & a, float lev_lane) {
    if constexpr (BITS == 2)
        return cubic(a, f2(x, j));
    else
        return fmaf(a.x, __shfl_sync(FULL, lev_lane, (x >> (j * BITS)) & ((1u << BITS) - 1)), a.y);
}

// deq of one code, the levels read from memory.
template <int BITS> __device__ __forceinline__ float level_at(uint32_t code, const float4 & a, const float * levels) {
    if constexpr (BITS == 2)
        return cubic(a, 1.0f + (float)code * 0.25f);
    else
        return fmaf(a.x, levels[code], a.y);
}

// A group's tables for dequantising and rotating keys, in shared memory, filled by the block.
template <int HD> struct key_tables {
    float4 kc[HD];         // per channel: 2 bits the cubic (scale, zero folded in), else (scale, zero)
    float2 a8[4][HD / 2];  // per pair the angle at position 8·sg (identity where not rotated)
    float2 a1[3][HD / 2];  // and at 1, 2 and 4

    template <int BITS> __device__ void fill(const ott_kvq_tables & tab, const ott_rope_table & R, int half) {
        for (int c = threadIdx.x; c < HD; c += blockDim.x) {
            const float sc = tab.k_scale[c], z = tab.k_zero[c];
            kc[c] = BITS == 2 ? cubic_through(tab.levels_k, sc, z) : make_float4(sc, z, 0.0f, 0.0f);
        }
        for (int e = threadIdx.x; e < 7 * HD / 2; e += blockDim.x) {  // a8 [4][HD/2], then a1 [3][HD/2]
            const int i = e % (HD / 2), k = e / (HD / 2), p = k < 4 ? 8 * k : 1 << (k - 4);
            const float2 a = i < half && p < R.n_pos ? angle(R, i, p) : make_float2(1.0f, 0.0f);
            if (k < 4)
                a8[k][i] = a;
            else
                a1[k - 4][i] = a;
        }
    }

    // The angle of pair i at slot t (0 .. 31) of a unit, from the tables.
    __device__ float2 at_slot(int i, int t) const {
        float2 a = a8[t >> 3][i];
#pragma unroll
        for (int b = 0; b < 3; ++b)
            if (t >> b & 1) a = compose(a, a1[b][i]);
        return a;
    }
};

// 4- and 16-byte asynchronous copies into shared memory, one group per unit and lane.
__device__ __forceinline__ void cp4(uint32_t * dst, const void * src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
}

__device__ __forceinline__ void cp16(uint32_t * dst, const void * src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
}

// n contiguous words from src into dst, the warp's lanes in turn: 16 bytes a copy where both
// ends are 16-byte aligned and n a multiple of 4 (a head-block's arrays start at multiples of
// OTT_KV_ALIGN), else 4.
__device__ __forceinline__ void copy_words(uint32_t * dst, const uint8_t * src, int32_t n, int lane) {
    if (n % 4 == 0 && (((uintptr_t)src | (uintptr_t)__cvta_generic_to_shared(dst)) & 15) == 0)
        for (int32_t e = 4 * lane; e < n; e += 128) cp16(dst + e, src + 4 * e);
    else
        for (int32_t e = lane; e < n; e += 32) cp4(dst + e, src + 4 * e);
}

// Words of a unit's stage buffer: key codes [HD][BITS] (channel rows of the unit's 32
// slots), value codes [32][HD·BITS/32], value zeros and scales fp16 [32] each, the angles at
// P0 float2 [HD/2] (rotated pairs), then the head-block's sparse entries (k_out_idx,
// k_out_val, v_out_idx, v_out_val, n_out/2 words each).
__host__ __device__ constexpr int32_t stage_words(int32_t hd, int32_t bits, int32_t n_out) {
    return 2 * hd * bits + 32 + hd + 2 * n_out;
}

template <int HD, int NR> struct smem_t {
    float q[NR][HD];  // the rows' queries times kq_scale·log2 e
    key_tables<HD> tabs;
    float s[WARPS][NR][UNIT];   // a unit's scores
    float p[WARPS][NR][UNIT];   // their probabilities
    float pw[WARPS][NR][UNIT];  // the probabilities times their slot's value scale (fp16 rows: 1)
    float vc[WARPS][NR][HD];    // sparse values' corrections; at the end each warp's weighted values
    float m[WARPS][NR];
    float l[WARPS][NR];
};

// One warp's online softmax of NR rows, its value sums (acc: 8 channels of its lane), the
// zeros' share and the lane's part of the sums.
template <int NR> struct warp_rows {
    float m[NR], l[NR], zs[NR];
    float acc[8][NR];

    // Fold scores s (this lane's key) into the rows: p the key's probability per row; the
    // sums so far rescaled, in registers and in vc (the warp's corrections [NR][HD]).
    template <int HD> __device__ void fold(const float (&s)[NR], float (&p)[NR], float (*vc)[HD]) {
        float corr[NR];
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            const float mn = fmaxf(m[r], warp_max(s[r]));
            if (mn == -INFINITY) {  // nothing visible to row r yet
                corr[r] = 1.0f;
                p[r]    = 0.0f;
                continue;
            }
            corr[r] = exp2_ftz(m[r] - mn);
            p[r]    = exp2_ftz(s[r] - mn);
            l[r]    = fmaf(l[r], corr[r], p[r]);
            zs[r] *= corr[r];
            m[r] = mn;
#pragma unroll
            for (int ch = 0; ch < 8; ++ch) acc[ch][r] *= corr[r];
        }
        for (int e = threadIdx.x % 32; e < NR * HD; e += 32) vc[e / HD][e % HD] *= corr[e / HD];
    }
};

// A block's partial of nr rows, out [nr][HD+2] (split kernels' layout): per row the largest
// of its warps' maxima m[w][r], then the warps' sums l[w][r] and weighted values
// vals(w, r, c), each rescaled to it.
template <int HD, int N, typename V>
__device__ void write_partial(float * out, int nr, const float (*m)[N], const float (*l)[N], V vals) {
    for (int e = threadIdx.x; e < nr * (HD + 2); e += blockDim.x) {
        const int r = e / (HD + 2), c = e % (HD + 2);
        float mx = -INFINITY;
        for (int ww = 0; ww < WARPS; ++ww) mx = fmaxf(mx, m[ww][r]);
        float x = 0.0f;
        for (int ww = 0; ww < WARPS; ++ww) {
            if (l[ww][r] == 0.0f) continue;
            x += exp2f(m[ww][r] - mx) * (c == 1 ? l[ww][r] : vals(ww, r, c - 2));
        }
        out[e] = c == 0 ? mx : x;
    }
}

template <int HD, int BITS, int NR, typename Groups>
__global__ void __launch_bounds__(WARPS * 32, NR == 1 ? 6 : 3)
    kvq_split_kernel(const ott_kvq_geom g, const Groups groups, const ott_rope_table R, float kq_scale,
                     int32_t n_splits, float * partials) {
    constexpr int CG = HD / 8, SVN = 32 / CG;  // value lanes: channel groups, slots in parallel
    constexpr int KW        = HD * BITS;       // words of a unit's key codes, and of its values'
    constexpr uint32_t MASK = (1u << BITS) - 1;
    __shared__ smem_t<HD, NR> S;
    extern __shared__ __align__(16) uint32_t stage_mem[];  // [WARPS][2][stage_words]
    const auto G     = groups.at(blockIdx.x, HD);
    const int32_t r0 = blockIdx.z * NR, nr = min(NR, G.rows() - r0);
    if (nr <= 0) return;
    const int lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const int half = R.cs ? R.n_rot / 2 : 0;
    for (int e = threadIdx.x; e < NR * HD; e += blockDim.x) {
        const int r    = e / HD;
        S.q[r][e % HD] = r < nr ? G.query(r0 + r)[e % HD] * (kq_scale * LOG2E) : 0.0f;
        for (int ww = 0; ww < WARPS; ++ww) S.vc[ww][r][e % HD] = 0.0f;
    }
    S.tabs.template fill<BITS>(G.tab, R, half);
    // levels: 2 bits the values' cubic; else lane j holds level j (of keys, of values)
    const float4 va = BITS == 2 ? cubic_through(G.tab.levels_v, 1.0, 0.0) : make_float4(1.0f, 0.0f, 0.0f, 0.0f);
    const float lk  = BITS == 2 ? 0.0f : G.tab.levels_k[lane & MASK];
    const float lv  = BITS == 2 ? 0.0f : G.tab.levels_v[lane & MASK];
    __syncthreads();

    warp_rows<NR> W;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        W.m[r] = -INFINITY;
        W.l[r] = W.zs[r] = 0.0f;
#pragma unroll
        for (int ch = 0; ch < 8; ++ch) W.acc[ch][r] = 0.0f;
    }
    const ott_kvq_block_layout Lb = ott_kvq_block_layout_of(&g);
    const uint32_t k_row = (uint32_t)g.block * BITS / 8, v_row = HD * BITS / 8;
    const int32_t n_sp = g.n_out / 2;  // words of one sparse array
    const int sg = lane / 8, ps = lane % 8, cg = lane % CG, sv = lane / CG;
    const int32_t upb = g.block / UNIT, n_qu = G.n_blocks() * upb;
    const int32_t n_u = n_qu + (G.n_fp() + UNIT - 1) / UNIT, per = (n_u + n_splits - 1) / n_splits;
    const int32_t u_end = min(n_u, (int32_t)(blockIdx.y + 1) * per);
    const int32_t sw    = stage_words(HD, BITS, g.n_out);
    uint32_t * stage    = stage_mem + (size_t)w * 2 * sw;
    float s[NR], p[NR];

    // unit u into stage buffer `buf` (nothing for fp16 units), as one cp.async group
    auto stage_unit = [&](int32_t u, int buf) {
        if (u < u_end && u < n_qu) {
            const int32_t jb = u / upb, t0 = (u % upb) * UNIT, P0 = G.pos0() + jb * g.block + t0;
            const uint8_t * b = G.block(jb);
            uint32_t * d      = stage + buf * sw;
            if (k_row == 4 * BITS)  // a unit per block: its key codes are contiguous
                copy_words(d, b + Lb.k_codes, KW, lane);
            else
                for (int e = lane; e < KW; e += 32)
                    cp4(d + e, b + Lb.k_codes + (e / BITS) * k_row + t0 * BITS / 8 + 4 * (e % BITS));
            copy_words(d + KW, b + Lb.v_codes + t0 * v_row, KW, lane);
            copy_words(d + 2 * KW, b + Lb.v_zero + 2 * t0, 16, lane);
            copy_words(d + 2 * KW + 16, b + Lb.v_scale + 2 * t0, 16, lane);
            for (int i = lane; i < half; i += 32) {
                cp4(d + 2 * KW + 32 + 2 * i, R.cs + (size_t)i * R.n_pos + P0);
                cp4(d + 2 * KW + 33 + 2 * i, R.cs + (size_t)(half + i) * R.n_pos + P0);
            }
            const uint32_t sp[4] = { Lb.k_out_idx, Lb.k_out_val, Lb.v_out_idx, Lb.v_out_val };
#pragma unroll
            for (int a = 0; a < 4; ++a) copy_words(d + 2 * KW + 32 + HD + a * n_sp, b + sp[a], n_sp, lane);
        }
        asm volatile("cp.async.commit_group;");
    };

    int buf = 0;
    stage_unit(blockIdx.y * per + w, 0);
    for (int32_t u = blockIdx.y * per + w; u < u_end; u += WARPS, buf ^= 1) {
        stage_unit(u + WARPS, buf ^ 1);
        asm volatile("cp.async.wait_group 1;");  // this lane's copies of unit u have landed
        __syncwarp();                            // and every lane's
        if (u < n_qu) {
            const int32_t t0     = (u % upb) * UNIT;
            const uint32_t * d   = stage + buf * sw;
            const uint8_t *kcode = (const uint8_t *)d, *vcode = (const uint8_t *)(d + KW);
            const uint16_t * vz = (const uint16_t *)(d + 2 * KW);     // [32] value zeros, then scales
            const float2 * a0   = (const float2 *)(d + 2 * KW + 32);  // [HD/2] angles at P0
            const uint16_t * sp = (const uint16_t *)(d + 2 * KW + 32 + HD);
            // keys: this lane's 8 slots over its pairs
            float sc[8][NR];
#pragma unroll
            for (int j = 0; j < 8; ++j)
#pragma unroll
                for (int r = 0; r < NR; ++r) sc[j][r] = 0.0f;
#pragma unroll 2
            for (int i = ps; i < HD / 2; i += 8) {
                const pair_ch c   = pair_of(i, half, R.neox);
                const uint32_t xa = codes8<BITS>(kcode, c.a * BITS * 4 + sg * BITS);
                const uint32_t xb = codes8<BITS>(kcode, c.b * BITS * 4 + sg * BITS);
                const float4 A = S.tabs.kc[c.a], B = S.tabs.kc[c.b];
                const float2 step = S.tabs.a1[0][i];
                float2 cs         = c.rot ? compose(a0[i], S.tabs.a8[sg][i]) : make_float2(1.0f, 0.0f);
                float qa[NR], qb[NR];
#pragma unroll
                for (int r = 0; r < NR; ++r) {
                    qa[r] = S.q[r][c.a];
                    qb[r] = S.q[r][c.b];
                }
                if constexpr (NR == 1) {  // the query's pair rotated back to each slot's position
                    float ua = qa[0] * cs.x + qb[0] * cs.y, ub = qb[0] * cs.x - qa[0] * cs.y;
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        sc[j][0]       = fmaf(deq<BITS>(xa, j, A, lk), ua, fmaf(deq<BITS>(xb, j, B, lk), ub, sc[j][0]));
                        const float un = ua * step.x + ub * step.y;
                        ub             = ub * step.x - ua * step.y;
                        ua             = un;
                    }
                } else {  // the keys' pair rotated to each slot's position
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        const float ka = deq<BITS>(xa, j, A, lk), kb = deq<BITS>(xb, j, B, lk);
                        const float ra = ka * cs.x - kb * cs.y, rb = ka * cs.y + kb * cs.x;
#pragma unroll
                        for (int r = 0; r < NR; ++r) sc[j][r] = fmaf(qa[r], ra, fmaf(qb[r], rb, sc[j][r]));
                        cs = compose(cs, step);
                    }
                }
            }
            // reduce-scatter over the pair lanes (lane bits 0..2): lane ps keeps slot ps
            float s4[4][NR], s2[2][NR];
            const bool b2 = ps & 4, b1 = ps & 2, b0 = ps & 1;
#pragma unroll
            for (int r = 0; r < NR; ++r) {
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    s4[j][r] = (b2 ? sc[j + 4][r] : sc[j][r]) + __shfl_xor_sync(FULL, b2 ? sc[j][r] : sc[j + 4][r], 4);
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    s2[j][r] = (b1 ? s4[j + 2][r] : s4[j][r]) + __shfl_xor_sync(FULL, b1 ? s4[j][r] : s4[j + 2][r], 2);
                S.s[w][r][lane] = (b0 ? s2[1][r] : s2[0][r]) + __shfl_xor_sync(FULL, b0 ? s2[0][r] : s2[1][r], 1);
            }
            __syncwarp();
            // sparse keys: (exact - dense) times the row's query rotated to the key's position.
            // A slot's entries are consecutive (ascending t·HD + c): their sum per run of lanes
            // is added by the run's last lane.
            for (int32_t e0 = 0; e0 < g.n_out; e0 += 32) {
                const int32_t e = e0 + lane, idx = e < g.n_out ? sp[e] : 0, tt = idx / HD - t0;
                const bool on = e < g.n_out && tt >= 0 && tt < UNIT;
                float x[NR];
#pragma unroll
                for (int r = 0; r < NR; ++r) x[r] = 0.0f;
                if (on) {
                    const int ch        = idx % HD;
                    const uint32_t code = ott_kvq_code_at(kcode + ch * BITS * 4, tt, BITS, BITS * 4);
                    const float d       = f16(sp[g.n_out + e]) - level_at<BITS>(code, S.tabs.kc[ch], G.tab.levels_k);
                    const int i         = pair_index(ch, half, R.neox);
                    const pair_ch c     = pair_of(i, half, R.neox);
                    const float2 cs     = c.rot ? compose(a0[i], S.tabs.at_slot(i, tt)) : make_float2(1.0f, 0.0f);
#pragma unroll
                    for (int r = 0; r < NR; ++r) x[r] = d * rotated_query(S.q[r], c, ch, cs);
                }
                const int32_t key = on ? tt : -1 - lane;
                run_sums<NR>(x, key, lane);
                const int32_t next = __shfl_down_sync(FULL, key, 1);
                if (on && (lane == 31 || next != key)) {
#pragma unroll
                    for (int r = 0; r < NR; ++r) S.s[w][r][tt] += x[r];
                }
                __syncwarp();
            }
#pragma unroll
            for (int r = 0; r < NR; ++r) s[r] = S.s[w][r][lane];
            W.template fold<HD>(s, p, S.vc[w]);
            const float zv = f16(vz[lane]), vs = f16(vz[32 + lane]);  // slot `lane`'s value range
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                W.zs[r]          = fmaf(p[r], zv, W.zs[r]);
                S.p[w][r][lane]  = p[r];
                S.pw[w][r][lane] = p[r] * vs;
            }
            __syncwarp();
            // sparse values
            for (int e = lane; e < g.n_out; e += 32) {
                const int32_t idx = sp[2 * g.n_out + e], tt = idx / HD - t0, ch = idx % HD;
                if (tt < 0 || tt >= UNIT) continue;
                const uint32_t code = ott_kvq_code_at(vcode + tt * v_row, ch, BITS, v_row);
                const float dense   = fmaf(level_at<BITS>(code, va, G.tab.levels_v), f16(vz[32 + tt]), f16(vz[tt]));
                const float d       = f16(sp[3 * g.n_out + e]) - dense;
                for (int r = 0; r < NR; ++r) atomicAdd(&S.vc[w][r][ch], S.p[w][r][tt] * d);
            }
            // values: this lane's channels over its slots
#pragma unroll 4
            for (int tt = sv; tt < UNIT; tt += SVN) {
                const uint32_t x = codes8<BITS>(vcode, tt * v_row + cg * BITS);
                float wt[NR];
#pragma unroll
                for (int r = 0; r < NR; ++r) wt[r] = S.pw[w][r][tt];
#pragma unroll
                for (int ch = 0; ch < 8; ++ch) {
                    const float lev = deq<BITS>(x, ch, va, lv);
#pragma unroll
                    for (int r = 0; r < NR; ++r) W.acc[ch][r] = fmaf(wt[r], lev, W.acc[ch][r]);
                }
            }
        } else {
            const int32_t f0 = (u - n_qu) * UNIT, n = min(UNIT, G.n_fp() - f0), i = f0 + lane;
#pragma unroll
            for (int r = 0; r < NR; ++r) s[r] = 0.0f;
            if (lane < n) {
                const int32_t pos = G.fp_pos(i);
                for (int pi = 0; pi < HD / 2; ++pi) {
                    const pair_ch c = pair_of(pi, half, R.neox);
                    const float ka = G.fp_k(i, c.a), kb = G.fp_k(i, c.b);
                    const float2 cs = c.rot ? angle(R, pi, pos) : make_float2(1.0f, 0.0f);
                    const float ra = ka * cs.x - kb * cs.y, rb = ka * cs.y + kb * cs.x;
#pragma unroll
                    for (int r = 0; r < NR; ++r) s[r] = fmaf(S.q[r][c.a], ra, fmaf(S.q[r][c.b], rb, s[r]));
                }
            }
#pragma unroll
            for (int r = 0; r < NR; ++r) {
                if (lane >= n || i >= G.visible(r0 + min(r, nr - 1))) s[r] = -INFINITY;
            }
            W.template fold<HD>(s, p, S.vc[w]);
#pragma unroll
            for (int r = 0; r < NR; ++r) S.p[w][r][lane] = p[r];
            __syncwarp();
            for (int tt = sv; tt < n; tt += SVN) {
#pragma unroll
                for (int ch = 0; ch < 8; ++ch) {
                    const float x = G.fp_v(f0 + tt, cg * 8 + ch);
#pragma unroll
                    for (int r = 0; r < NR; ++r) W.acc[ch][r] = fmaf(S.p[w][r][tt], x, W.acc[ch][r]);
                }
            }
        }
        __syncwarp();
    }

    // the warp's state: values summed over its slot lanes, plus the zeros' share and corrections
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        warp_sum_from(W.l[r], 1);
        warp_sum_from(W.zs[r], 1);
#pragma unroll
        for (int ch = 0; ch < 8; ++ch) warp_sum_from(W.acc[ch][r], CG);
    }
    __syncwarp();
    if (lane < CG) {
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
            for (int ch = 0; ch < 8; ++ch) S.vc[w][r][cg * 8 + ch] += W.acc[ch][r] + W.zs[r];
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            S.m[w][r] = W.m[r];
            S.l[w][r] = W.l[r];
        }
    }
    __syncthreads();
    // the warps' states combined: split y's partial of rows r0 ..
    float * out = partials + (((size_t)blockIdx.x * n_splits + blockIdx.y) * OTT_CUDA_KVQ_ROWS + r0) * (HD + 2);
    write_partial<HD>(out, nr, S.m, S.l, [&](int ww, int r, int c) { return S.vc[ww][r][c]; });
}

// grid: n_groups; threads over channels. Each group's rows from its n_splits partials.
template <typename Groups>
__global__ void kvq_merge_kernel(const Groups groups, int32_t hd, int32_t n_splits, const float * partials) {
    const auto G      = groups.at(blockIdx.x, hd);
    const float * grp = partials + (size_t)blockIdx.x * n_splits * OTT_CUDA_KVQ_ROWS * (hd + 2);
    for (int r = 0; r < G.rows(); ++r) {
        auto part = [&](int s) { return grp + ((size_t)s * OTT_CUDA_KVQ_ROWS + r) * (hd + 2); };
        float mx = -INFINITY, l = 0.0f;
        for (int s = 0; s < n_splits; ++s)
            if (part(s)[1] != 0.0f) mx = fmaxf(mx, part(s)[0]);
        for (int s = 0; s < n_splits; ++s)
            if (part(s)[1] != 0.0f) l += part(s)[1] * exp2f(part(s)[0] - mx);
        float * o = G.output(r);
        for (int c = threadIdx.x; c < hd; c += blockDim.x) {
            float acc = 0.0f;
            for (int s = 0; s < n_splits; ++s)
                if (part(s)[1] != 0.0f) acc += part(s)[2 + c] * exp2f(part(s)[0] - mx);
            o[c] = acc / l;
        }
    }
}

}  // namespace split

}  // namespace
