// attn_imma.cuh — attn.cu's quantized-block phase on integer tensor cores (sm_80+), for
// head-blocks of head_dim 128, block 128 and 2-bit keys and values (ott2, kivi2 at these
// sizes): mma.sync m16n8k32 with 8-bit operands and exact int32 sums. Included by attn.cu
// after the pieces it shares (attn_smem, softmax_rows, write_partial, warp_sum_from, WARPS, h2f).
//
// Per head-block (one warp), keys then values, each as D[m][n] = sum_k A[m][k]·B[k][n]:
//  - Each warp copies whole head-blocks into shared memory with cp.async, one ahead of the
//    one it computes (double buffering), so a head-block's bytes are in flight while the
//    previous one is decoded.
//  - B holds codes straight from the packed words, no offset and no conversion: a lane reads
//    one word of each of 8 code rows, a byte transpose (PRMT) gathers the 4 rows' bytes b
//    into one register, and an AND keeps the code at bit 2s of every byte — the value
//    code·4^s, an exact u8. n-tile (b, s) covers column n = word n, i.e. slot 16n + 4b + s
//    (keys: n indexes tokens) or channel 16n + 4b + s (values: n indexes channels). The
//    reduction index k = 4q + i (+16) of lane (g, q) is code row 4i + q (+16) of a k-step,
//    so the 32 lanes' words lie in 32 different shared-memory banks.
//  - A holds a fixed-point copy Q (|Q| <= 2^14) of the row operand, split into signed
//    high and low bytes in rows m and m + 8: keys q_c·scale_{g,c} per (query row, key group)
//    m, values p_t·scale_{t,g} per (query row, value group) m, each with a power-of-two
//    scale from the head-block's largest magnitude. All 32 lanes compute these values (4 per
//    lane and row) into shared memory; the lanes of row m then load their fragments.
//  - D = 256·D[m] + D[m+8] is exact; both halves stay below 2^22 in magnitude, so the
//    accumulators start at the bit pattern of 1.5·2^23 and read as floats 1.5·2^23 + D
//    (no integer conversion). The min terms (sum q·min, sum p·min) are added in float.
//    Row m only means something for the tokens (channels) of its group; the lane holding
//    that row's D writes the result.
// Error: the fixed-point rounding of A, 2^-15 of the head-block's largest term.
#pragma once

#include <cuda_fp16.h>

#include "ott_cuda.h"

namespace imma {

constexpr int HD = 128, BLOCK = 128, WORDS = 8;   // 2-bit rows: 8 words of 16 codes
constexpr int A_STRIDE = 144;                     // bytes per A row in shared memory: rows 36
                                                  // words apart, so lane (g, q) reads bank 4g + q
constexpr int BIAS_BITS = 0x4B400000;             // 1.5·2^23 as float bits
constexpr float BIAS = 12582912.0f;

// D += A·B, m16n8k32, signed bytes times unsigned bytes.
__device__ __forceinline__ void mma(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();                                        // launchers never pick this path below sm_80
#endif
}

// y[b] = byte b of w[0..3] (w[i]'s byte in y's byte i): a 4x4 byte transpose.
__device__ __forceinline__ void transpose4(const uint32_t * w, uint32_t (&y)[4]) {
    const uint32_t t0 = __byte_perm(w[0], w[1], 0x5140), t1 = __byte_perm(w[0], w[1], 0x7362);
    const uint32_t t2 = __byte_perm(w[2], w[3], 0x5140), t3 = __byte_perm(w[2], w[3], 0x7362);
    y[0] = __byte_perm(t0, t2, 0x5410);
    y[1] = __byte_perm(t0, t2, 0x7632);
    y[2] = __byte_perm(t1, t3, 0x5410);
    y[3] = __byte_perm(t1, t3, 0x7632);
}

// 2^e as a float, e in [-126, 127].
__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }

// The exponent e with mx·2^e < 2^14 (so |Q| <= 2^14 after rounding), 0 for mx = 0.
__device__ __forceinline__ int fixed_exp(float mx) {
    if (!(mx > 0.0f)) return 0;
    int x;
    frexpf(mx, &x);                                  // mx < 2^x
    return max(-100, min(100, 14 - x));
}

// D = A·B over a head-block: all 16 n-tiles (b, s) of 4 k-steps of 32 rows; D starts at the
// float bias. The lane's B words of k-step ks are rows 32ks + 4i + q and 32ks + 16 + 4i + q
// (i < 4), word g.
__device__ __forceinline__ void block_mma(const uint32_t * rows, const uint32_t (&a)[4][4], int (&d)[4][4][4],
                                          int g, int q) {
#pragma unroll
    for (int b = 0; b < 4; ++b)
#pragma unroll
        for (int s = 0; s < 4; ++s) d[b][s][0] = d[b][s][1] = d[b][s][2] = d[b][s][3] = BIAS_BITS;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        uint32_t w[8];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[i] = rows[(32 * ks + 4 * i + q) * WORDS + g];
            w[4 + i] = rows[(32 * ks + 16 + 4 * i + q) * WORDS + g];
        }
        uint32_t lo[4], hi[4];
        transpose4(w, lo);
        transpose4(w + 4, hi);
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const uint32_t m = 0x03030303u << (2 * s);
                mma(d[b][s], a[ks], lo[b] & m, hi[b] & m);
            }
    }
}

// The value 256·D[m] + D[m+8] of column j of an n-tile, as a float (both start at the bias).
__device__ __forceinline__ float dot_of(const int (&d)[4], int j) {
    return fmaf(__int_as_float(d[j]) - BIAS, 256.0f, __int_as_float(d[2 + j]) - BIAS);
}

// The A row of combination cmb from the lane's 4 values x[i] (code row lane + 32i, i.e. k-step
// i, reduction index 16h + 4q' + i' for lane = 16h + 4i' + q'): fixed point with exponent e,
// high and low bytes to a_hi/a_lo [8][A_STRIDE] at the reduction index's byte.
__device__ __forceinline__ void store_a_row(const float (&x)[4], int e, int cmb, int lane, int8_t * a_hi, int8_t * a_lo) {
    const float f = pow2(e);
    const int pos = 16 * (lane >> 4) + 4 * (lane & 3) + ((lane >> 2) & 3);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int Q = __float_as_int(fmaf(x[i], f, BIAS)) - BIAS_BITS;   // rint(x·2^e), |Q| <= 2^14
        const int hi8 = (Q + 128) >> 8;
        a_hi[cmb * A_STRIDE + 32 * i + pos] = (int8_t) hi8;
        a_lo[cmb * A_STRIDE + 32 * i + pos] = (int8_t) (Q - (hi8 << 8));
    }
}

// Lane (g, q)'s A fragments of row g (zero when the row means nothing).
__device__ __forceinline__ void load_a(const int8_t * a_hi, const int8_t * a_lo, bool row, int g, int q,
                                       uint32_t (&a)[4][4]) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int off = g * A_STRIDE + 32 * ks + 16 * h + 4 * q;
            a[ks][2 * h] = row ? *(const uint32_t *) (a_hi + off) : 0u;
            a[ks][2 * h + 1] = row ? *(const uint32_t *) (a_lo + off) : 0u;
        }
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 1; o < 32; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// Copy one head-block (bytes, a multiple of 16) to shared memory asynchronously, as one
// cp.async group of this lane (an empty group when src is null).
__device__ __forceinline__ void copy_async(uint8_t * dst, const uint8_t * src, int bytes, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if (src) {
        for (int i = lane * 16; i < bytes; i += 32 * 16) {
            const unsigned d = (unsigned) __cvta_generic_to_shared(dst + i);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(d), "l"(src + i));
        }
    }
    asm volatile("cp.async.commit_group;");
#endif
}

// Wait until this lane's cp.async groups but the newest one have landed.
__device__ __forceinline__ void wait_all_but_newest() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 1;");
#endif
}

// Per-warp shared memory: two head-block buffers, scores/probabilities [NR][BLOCK] floats,
// A rows (high and low bytes) [2][8][A_STRIDE].
__host__ __device__ inline size_t warp_smem_bytes(const ott_kv_block_layout & L, int nr) {
    return 2 * (size_t) L.size + (size_t) nr * BLOCK * sizeof(float) + 2 * 8 * A_STRIDE;
}

} // namespace imma

// The quantized-block phase of split blockIdx.y with integer tensor cores (see above); the
// same partial results as attend_blocks. Needs NR·(block/group_k) <= 8 and
// NR·(head_dim/group_v) <= 8 (a row m per query row and group).
template <int NR>
__device__ void attend_blocks_imma(const ott_cuda_attn_args & a, const ott_cuda_attn_tile & T,
                                   attn_smem<imma::HD, NR> & S, uint8_t * dyn) {
    using namespace imma;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    const ott_cuda_kv_layer & L = a.L;
    const int group_k = L.geom.group_k, group_v = L.geom.group_v;
    const int n_gk = BLOCK / group_k, n_gv = HD / group_v;
    const int G_K = NR * n_gk, G_V = NR * n_gv;      // A rows in use: (query row, group)
    const bool k_row = g < G_K, v_row = g < G_V;     // the lane's A row means something
    const int rk = g / n_gk, gk = g % n_gk;          // query row and key group of row g
    const int rv = g / n_gv, gv = g % n_gv;          // query row and value group of row g
    const int t_lo = gk * group_k, t_hi = t_lo + group_k;   // the slots of key group gk
    const int c_lo = gv * group_v, c_hi = c_lo + group_v;   // the channels of value group gv
    const int hb_bytes = (int) L.layout.size;
    uint8_t * wsm = dyn + (size_t) warp * warp_smem_bytes(L.layout, NR);
    float * p_s = (float *) (wsm + 2 * (size_t) hb_bytes);   // [NR][BLOCK] scores, then probabilities
    int8_t * a_hi = (int8_t *) (p_s + NR * BLOCK);           // [8][A_STRIDE]
    int8_t * a_lo = a_hi + 8 * A_STRIDE;

    const int per = (T.n_blocks + a.n_splits - 1) / a.n_splits;
    const int b0 = min(T.n_blocks, (int) blockIdx.y * per), b1 = min(T.n_blocks, b0 + per);

    softmax_rows<NR> sm;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        sm.m[r] = -INFINITY;
        sm.l[r] = 0.0f;
    }
    float acc[4][4][2];                              // values of row rv, channel 16(2q+j) + 4b + s
    float vmin = 0.0f;                               // sum p·min of row rv, value group gv
#pragma unroll
    for (int b = 0; b < 4; ++b)
#pragma unroll
        for (int s = 0; s < 4; ++s) acc[b][s][0] = acc[b][s][1] = 0.0f;

    auto head_block = [&](int blk) {
        return L.blocks + (((size_t) T.seq * L.max_blocks + blk) * L.n_head_kv + T.head) * L.layout.size;
    };
    if (b0 + warp < b1) copy_async(wsm, head_block(b0 + warp), hb_bytes, lane);
    int cur = 0;                                     // the buffer of the head-block computed now
    for (int blk = b0 + warp; blk < b1; blk += WARPS, cur ^= 1) {
        copy_async(wsm + (size_t) (cur ^ 1) * hb_bytes, blk + WARPS < b1 ? head_block(blk + WARPS) : nullptr,
                   hb_bytes, lane);
        wait_all_but_newest();
        __syncwarp();
        const uint8_t * hb = wsm + (size_t) cur * hb_bytes;      // this head-block, in shared memory
        const ott_fp16 * ksc = (const ott_fp16 *) (hb + L.layout.k_scale);   // [n_gk][HD]
        const ott_fp16 * kmn = (const ott_fp16 *) (hb + L.layout.k_min);
        const ott_fp16 * vsc = (const ott_fp16 *) (hb + L.layout.v_scale);   // [BLOCK][n_gv]
        const ott_fp16 * vmn = (const ott_fp16 *) (hb + L.layout.v_min);

        // keys: A row (r, group) = q_r·scale over channels lane + 32i; the sum q_r·min
        float kbase = 0.0f, kscale = 1.0f;           // of the lane's row g: sum q·min, 2^-e
        for (int cmb = 0; cmb < G_K; ++cmb) {
            const int r = cmb / n_gk, gi = cmb % n_gk;
            float x[4], mx = 0.0f, base = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int c = lane + 32 * i;
                const float qc = S.q[r][c];
                x[i] = qc * h2f(ksc[gi * HD + c]);
                base = fmaf(qc, h2f(kmn[gi * HD + c]), base);
                mx = fmaxf(mx, fabsf(x[i]));
            }
            const int e = fixed_exp(warp_max(mx));
            warp_sum_from(base, 1);
            store_a_row(x, e, cmb, lane, a_hi, a_lo);
            if (cmb == g) {
                kbase = base;
                kscale = pow2(-e);
            }
        }
        __syncwarp();
        uint32_t af[4][4];
        load_a(a_hi, a_lo, k_row, g, q, af);
        int d[4][4][4];
        block_mma((const uint32_t *) (hb + L.layout.k_codes), af, d, g, q);

        // scores of the slots of the lane's row: slot 16(2q+j) + 4b + s
        // bit t%32 of mask word t/32 = 1: slot t lives in a pool; the lane's slots are in word q
        const uint32_t mask_q = a.traces ? ((const uint32_t *) (hb + L.layout.mask))[q] : 0u;
        __syncwarp();                                // a_hi/a_lo are rewritten below
        if (k_row) {
#pragma unroll
            for (int b = 0; b < 4; ++b)
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    const float sc = kscale * (1.0f / (float) (1 << (2 * s)));
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const int t = 16 * (2 * q + j) + 4 * b + s;
                        if (t < t_lo || t >= t_hi) continue;
                        const bool masked = (mask_q >> (16 * j + 4 * b + s)) & 1;
                        p_s[rk * BLOCK + t] = masked ? -INFINITY : fmaf(dot_of(d[b][s], j), sc, kbase);
                    }
                }
        }
        __syncwarp();

        // online softmax over the block's slots, lane-parallel; then the values' A rows
        // (r, group) = p_r·scale over slots lane + 32i, and the sums p·min
        float corr[NR];
        float vscale = 1.0f;                         // of the lane's row g: 2^-e
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            float p[4], mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                p[i] = p_s[r * BLOCK + lane + 32 * i];
                mx = fmaxf(mx, p[i]);
            }
            mx = warp_max(mx);
            const float m_new = fmaxf(sm.m[r], mx);
            corr[r] = m_new == -INFINITY ? 1.0f : exp2f(sm.m[r] - m_new);
            float psum = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                p[i] = m_new == -INFINITY ? 0.0f : exp2f(p[i] - m_new);
                psum += p[i];
            }
            warp_sum_from(psum, 1);
            sm.l[r] = sm.l[r] * corr[r] + psum;
            sm.m[r] = m_new;
            for (int gi = 0; gi < n_gv; ++gi) {
                const int cmb = r * n_gv + gi;
                float x[4], mxv = 0.0f, pm = 0.0f;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int t = lane + 32 * i;
                    x[i] = p[i] * h2f(vsc[t * n_gv + gi]);
                    pm = fmaf(p[i], h2f(vmn[t * n_gv + gi]), pm);
                    mxv = fmaxf(mxv, x[i]);
                }
                const int e = fixed_exp(warp_max(mxv));
                warp_sum_from(pm, 1);
                store_a_row(x, e, cmb, lane, a_hi, a_lo);
                if (cmb == g) {
                    vmin = vmin * corr[r] + pm;
                    vscale = pow2(-e);
                }
            }
        }
        __syncwarp();
        load_a(a_hi, a_lo, v_row, g, q, af);
        block_mma((const uint32_t *) (hb + L.layout.v_codes), af, d, g, q);
        float rcorr = 1.0f;                          // corr[rv], without indexing registers
#pragma unroll
        for (int r = 0; r < NR; ++r) rcorr = r == rv ? corr[r] : rcorr;
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                const float sc = vscale * (1.0f / (float) (1 << (2 * s)));
#pragma unroll
                for (int j = 0; j < 2; ++j) acc[b][s][j] = fmaf(acc[b][s][j], rcorr, dot_of(d[b][s], j) * sc);
            }
        __syncwarp();                                // the buffer is refilled next iteration
    }

    // this warp's weighted values into shared memory, by the lane that owns each (row, channel)
    __syncthreads();                                   // the per-warp regions become red
    float * red = (float *) dyn;                       // [WARPS][NR][HD]
    if (v_row) {
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int s = 0; s < 4; ++s)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int c = 16 * (2 * q + j) + 4 * b + s;
                    if (c >= c_lo && c < c_hi) red[((size_t) warp * NR + rv) * HD + c] = acc[b][s][j] + vmin;
                }
    }
    write_partial<HD, NR>(a, S, red, T, sm);
}
