// attn_imma.cuh — the attention kernels' quantized-block phase on integer tensor cores (sm_80+), for
// head-blocks of head_dim 128, block 128, 2-bit values with 2- or 4-bit keys or key tiers, or
// 4-bit keys and values (ott2, kivi2, ottr2, ottr3, ottr2t, ott4, kivi4 and the recent blocks of
// ottr2tg at these sizes): mma.sync m16n8k32 with 8-bit operands and exact int32 sums. Included by
// attn_kernels.cuh after the pieces it shares (attn_smem, softmax_rows, put_state, warp_ops.cuh, split_blocks,
// head_block, WARPS, param_at).
//
// Per head-block (one warp), keys then values, each as D[m][n] = sum_k A[m][k]·B[k][n]:
//  - Each warp copies its head-blocks into shared memory with cp.async in two parts: the
//    values' part lands while the keys are decoded and the next head-block's keys while the
//    values are, so one buffer per warp keeps bytes in flight (and four blocks fit an SM).
//  - B holds codes straight from the packed words, no offset and no conversion: a lane reads
//    one word of each of 8 code rows, a byte transpose (PRMT) gathers the 4 rows' bytes b
//    into one register, and an AND keeps the code at bit 2s of every byte — the value
//    code·4^s, an exact u8. n-tile (b, s) covers column n = word n, i.e. slot 16n + 4b + s
//    (keys: n indexes tokens) or channel 16n + 4b + s (values: n indexes channels). The
//    reduction index k = 4q + i (+16) of lane (g, q) is code row 4i + q (+16) of a k-step,
//    so the 32 lanes' words lie in 32 different shared-memory banks. 4-bit keys: a row's 16
//    slots 16n .. 16n+15 are its words 2n and 2n+1, and n-tile t = 8w + 2b + s holds the
//    code at bit 4s of byte b of word 2n + w (code·16^s <= 240), so t is again the slot's
//    offset 16n + t; two lanes of 32 then share a bank. 4-bit values alike: n-tile t holds
//    channel 16n + t.
//  - Key tiers (rows ranked by weight; 4-, 2- and 1-bit rows, each tier a whole number of
//    k-steps of 32 rows): a k-step's rows have one width, and the code of n-tile t is
//    shifted down to bit 0 of its byte before the AND, so every k-step adds plain codes into
//    the same accumulators. The A rows gather q by the head-block's channel order.
//  - A holds a fixed-point copy Q (|Q| <= 2^14) of the row operand, split into signed
//    high and low bytes in rows m and m + 8: keys q_c·scale_{g,c} per (query row, key group)
//    m, values p_t·scale_{t,g} per (query row, value group) m, each with a power-of-two
//    scale from the head-block's largest magnitude. All 32 lanes compute these values (4 per
//    lane and row) into shared memory; the lanes of row m then load their fragments.
//  - D = 256·D[m] + D[m+8] is exact; both halves stay below 2^22 in magnitude, so the
//    accumulators start at the bit pattern of 1.5·2^23 (the first k-step's C operand) and
//    read as floats 1.5·2^23 + D (no integer conversion). The min terms (sum q·min,
//    sum p·min) are added in float. Row m only means something for the tokens (channels)
//    of its group.
//  - The G rows in use (G <= GKM or GVM, a power of two) are repeated over the 8, so 8/G
//    lanes hold each row's D; each of them converts only its share of the 16 n-tiles (by
//    selects), and writes those results.
//  - Few warp-wide steps per head-block: each A row's exponent comes from one warp-wide
//    integer max of its float exponents (five shuffles); sum q·min reaches the lanes of
//    its row by a reduce-scatter (one butterfly sum for a single row); the softmax sums
//    and sum p·min stay per lane and are summed over the warp once, after the last
//    head-block.
// Error: the fixed-point rounding of A, 2^-15 of the head-block's largest term.
#pragma once

#include <cuda_fp16.h>

#include <utility>

#include "cuda/ott_cuda.h"

namespace imma {

constexpr int HD = 128, BLOCK = 128;

// Bytes of a head-block's key (value) codes at BITS bits.
template <int BITS> __host__ __device__ constexpr int code_bytes() { return HD * BLOCK * BITS / 8; }
constexpr int A_STRIDE = 144;          // bytes per A row in shared memory: rows 36
                                       // words apart, so lane (g, q) reads bank 4g + q
constexpr int BIAS_BITS = 0x4B400000;  // 1.5·2^23 as float bits
constexpr float BIAS    = 12582912.0f;

// D += A·B, m16n8k32, signed bytes times unsigned bytes; FIRST: D = A·B + the float bias in
// every element (no register moves to start the sums).
template <bool FIRST>
__device__ __forceinline__ void mma(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (FIRST) {
        asm volatile(
            "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
            : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(BIAS_BITS));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
#else
    __trap();  // launchers never pick this path below sm_80
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

// y[u] = byte b_u of w[0..3] (w[i]'s byte in y's byte i) for the two bytes b_0, b_1 = b_0 + 1
// that sel names (0x5140: bytes 0 and 1, 0x7362: bytes 2 and 3): transpose4's rows b_0, b_1
// alone, in four PRMTs instead of its six and the selects that would pick the two rows.
__device__ __forceinline__ void two_bytes_of(const uint32_t * w, uint32_t sel, uint32_t (&y)[4]) {
    const uint32_t t0 = __byte_perm(w[0], w[1], sel), t1 = __byte_perm(w[2], w[3], sel);
    y[0] = __byte_perm(t0, t1, 0x5410);
    y[1] = __byte_perm(t0, t1, 0x7632);
}

// 2^e as a float, e in [-126, 127].
__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }

// The biased float exponent of |x| (0 for zero and subnormals).
__device__ __forceinline__ uint32_t exp_bits(float x) { return __float_as_uint(x) << 1 >> 24; }

// Fixed-point exponents of the A rows c < rows (<= M <= 8): E[c] is the largest exponent byte
// of row c's values in this lane; e[c] makes the warp's largest |x|·2^e[c] < 2^14 (e[c] for
// c >= rows as if E were 0 there). A five-shuffle integer max a row: packing four rows' bytes
// into a word took a byte-wise max that sm_90 emulates in seven instructions a step, and
// redux.sync made the kernels without tiers 9 % slower at batch 8 (docs/cuda.md).
template <int M> __device__ __forceinline__ void row_exponents(const uint32_t (&E)[8], int rows, int (&e)[8]) {
#pragma unroll
    for (int c = 0; c < M; ++c) {
        uint32_t E_max = 0u;  // max|x| < 2^(E_max - 126)
        if (c < rows) {
            E_max = E[c];
            for (int o = 1; o < 32; o <<= 1) E_max = max(E_max, __shfl_xor_sync(0xffffffffu, E_max, o));
        }
        e[c] = max(-100, min(100, 140 - (int)E_max));
    }
}

// v[c] summed over the warp, for c = the lane's row g = lane / 4 (a reduce-scatter: each
// step keeps the half of the rows that the lane's row lies in and adds the partner's).
__device__ __forceinline__ float sum_of_row(const float (&v)[8], int lane) {
    const bool h4 = lane & 16, h3 = lane & 8, h2 = lane & 4;  // the row's bits 2, 1, 0
    float a4[4], a2[2];
#pragma unroll
    for (int i = 0; i < 4; ++i) a4[i] = (h4 ? v[4 + i] : v[i]) + __shfl_xor_sync(0xffffffffu, h4 ? v[i] : v[4 + i], 16);
#pragma unroll
    for (int i = 0; i < 2; ++i)
        a2[i] = (h3 ? a4[2 + i] : a4[i]) + __shfl_xor_sync(0xffffffffu, h3 ? a4[i] : a4[2 + i], 8);
    float x = (h2 ? a2[1] : a2[0]) + __shfl_xor_sync(0xffffffffu, h2 ? a2[0] : a2[1], 4);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x + __shfl_xor_sync(0xffffffffu, x, 1);
}

// v[i] for i < N (a runtime index into a register array, without local memory).
template <int N, typename T, int M> __device__ __forceinline__ T pick(const T (&v)[M], int i) {
    static_assert(N <= M, "pick: N exceeds the array");
    T x = v[0];
#pragma unroll
    for (int j = 1; j < N; ++j) x = j == i ? v[j] : x;
    return x;
}

// D = A·B plus the float bias over a head-block: all 16 n-tiles of 4 k-steps of 32 rows of
// BITS-bit codes. n-tile t of column n is slot (channel) 16n + t; its register set d[t/4][t%4].
// 2 bits: the lane's B words of k-step ks are rows 32ks + 4i + q and 32ks + 16 + 4i + q
// (i < 4), word g; 4 bits: words 2g and 2g + 1 of those rows.
template <int BITS>
__device__ __forceinline__ void block_mma(const uint32_t * rows, const uint32_t (&a)[4][4], int (&d)[4][4][4], int g,
                                          int q) {
    constexpr int WORDS = BLOCK * BITS / 32, PER_WORD = BITS == 2 ? 1 : 2, CODES = 8 / BITS;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
#pragma unroll
        for (int w = 0; w < PER_WORD; ++w) {
            uint32_t x[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                x[i]     = rows[(32 * ks + 4 * i + q) * WORDS + PER_WORD * g + w];
                x[4 + i] = rows[(32 * ks + 16 + 4 * i + q) * WORDS + PER_WORD * g + w];
            }
            uint32_t lo[4], hi[4];
            transpose4(x, lo);
            transpose4(x + 4, hi);
#pragma unroll
            for (int b = 0; b < 4; ++b)
#pragma unroll
                for (int s = 0; s < CODES; ++s) {
                    const int t      = 4 * CODES * w + CODES * b + s;
                    const uint32_t m = ((1u << BITS) - 1) * 0x01010101u << (BITS * s);
                    if (ks == 0)
                        mma<true>(d[t >> 2][t & 3], a[ks], lo[b] & m, hi[b] & m);
                    else
                        mma<false>(d[t >> 2][t & 3], a[ks], lo[b] & m, hi[b] & m);
                }
        }
    }
}

// 2^-(BITS·s) for n-tile t: its codes stand at bit BITS·s of their bytes, s = t % (8 / BITS).
template <int BITS> __device__ __forceinline__ float tile_scale(int t) { return pow2(-BITS * (t & (8 / BITS - 1))); }

// Whether the tensor-core phase serves key tiers of g: each tier a whole number of k-steps
// and the rows' codes averaging 2 bits, so that they fill code_bytes<2>(). At head size 128
// that is one layout: 32 rows of 4 bits, 32 of 2, 64 of 1 (ottr2t, ottr2tg).
__host__ __device__ inline bool tiers_fit(const ott_kv_geom & g) {
    return g.bits_k == 2 && g.n_hi == HD / 4 && g.n_lo == HD / 2;
}
// The code width of k-step ks's rows in that layout, and the byte offset of its first row.
__host__ __device__ constexpr int tier_bits(int ks) { return ks == 0 ? 4 : ks == 1 ? 2 : 1; }
__host__ __device__ constexpr int tier_offset(int ks) {
    return ks == 0 ? 0 : tier_offset(ks - 1) + 4 * BLOCK * tier_bits(ks - 1);
}
static_assert(tier_offset(4) == code_bytes<2>(), "the tiers fill the 2-bit codes' bytes");

// block_mma over a tiered head-block's key rows (tiers_fit, the layout above; the geometry is
// checked by the launcher): k-step ks has the width of its rows, known at compile time, and
// n-tile t of column n (slot 16n + t) takes codes shifted down to bit 0 of their bytes, so D
// is sum A·code over every k-step (no per-tile scale).
__device__ __forceinline__ void block_mma_tiers(const uint8_t * codes, const uint32_t (&a)[4][4], int (&d)[4][4][4],
                                                int g, int q) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
        const int bits        = tier_bits(ks);      // the same for the k-step's rows
        const int words       = BLOCK * bits / 32;  // per row
        const uint32_t * rows = (const uint32_t *)(codes + tier_offset(ks));
        auto b_of             = [&](const auto & y, int byte, int shift) {
            return (y[byte] >> shift) & ((1u << bits) - 1) * 0x01010101u;
        };
        auto step = [&](int t, uint32_t b0, uint32_t b1) {
            if (ks == 0)
                mma<true>(d[t >> 2][t & 3], a[ks], b0, b1);
            else
                mma<false>(d[t >> 2][t & 3], a[ks], b0, b1);
        };
        // the lane's words: 2g and 2g + 1 (4 bits), g (2 bits), g / 2 (1 bit: bytes 2(g % 2), +1)
        const int n_words = bits == 4 ? 2 : 1, w0 = bits == 4 ? 2 * g : bits == 2 ? g : g >> 1;
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            if (w >= n_words) break;
            uint32_t x[8];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                x[i]     = rows[(4 * i + q) * words + w0 + w];
                x[4 + i] = rows[(16 + 4 * i + q) * words + w0 + w];
            }
            uint32_t lo[4], hi[4];
            if (bits == 1) {  // the lane's bytes 2(g % 2) and 2(g % 2) + 1 alone: lo[u], hi[u]
                two_bytes_of(x, g & 1 ? 0x7362u : 0x5140u, lo);
                two_bytes_of(x + 4, g & 1 ? 0x7362u : 0x5140u, hi);
            } else {
                transpose4(x, lo);
                transpose4(x + 4, hi);
            }
            if (bits == 4) {  // t = 8w + 2b + s
#pragma unroll
                for (int b = 0; b < 4; ++b)
#pragma unroll
                    for (int s = 0; s < 2; ++s) step(8 * w + 2 * b + s, b_of(lo, b, 4 * s), b_of(hi, b, 4 * s));
            } else if (bits == 2) {  // t = 4b + s
#pragma unroll
                for (int b = 0; b < 4; ++b)
#pragma unroll
                    for (int s = 0; s < 4; ++s) step(4 * b + s, b_of(lo, b, 2 * s), b_of(hi, b, 2 * s));
            } else {  // t = 8u + s, byte 2(g % 2) + u
#pragma unroll
                for (int u = 0; u < 2; ++u)
#pragma unroll
                    for (int s = 0; s < 8; ++s) step(8 * u + s, b_of(lo, u, s), b_of(hi, u, s));
            }
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
__device__ __forceinline__ void store_a_row(const float (&x)[4], int e, int cmb, int lane, int8_t * a_hi,
                                            int8_t * a_lo) {
    const float f = pow2(e);
    const int pos = 16 * (lane >> 4) + 4 * (lane & 3) + ((lane >> 2) & 3);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int Q   = __float_as_int(fmaf(x[i], f, BIAS)) - BIAS_BITS;  // rint(x·2^e), |Q| <= 2^14
        const int hi8 = (Q + 128) >> 8;
        a_hi[cmb * A_STRIDE + 32 * i + pos] = (int8_t)hi8;
        a_lo[cmb * A_STRIDE + 32 * i + pos] = (int8_t)(Q - (hi8 << 8));
    }
}

// Lane (g, q)'s A fragments, rows g and g + 8 holding A row c (zero when the row means nothing).
__device__ __forceinline__ void load_a(const int8_t * a_hi, const int8_t * a_lo, bool row, int c, int q,
                                       uint32_t (&a)[4][4]) {
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int off    = c * A_STRIDE + 32 * ks + 16 * h + 4 * q;
            a[ks][2 * h]     = row ? *(const uint32_t *)(a_hi + off) : 0u;
            a[ks][2 * h + 1] = row ? *(const uint32_t *)(a_lo + off) : 0u;
        }
}

// Copy bytes [lo, hi) (multiples of 16; scales and masks, a few hundred bytes) of the
// head-block at src to the same offsets at dst with cp.async (part of this lane's open
// cp.async group). Not unrolled: one or two rounds.
__device__ __forceinline__ void copy_range(uint8_t * dst, const uint8_t * src, uint32_t lo, uint32_t hi, int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#pragma unroll 1
    for (uint32_t i = lo + lane * 16; i < hi; i += 32 * 16) {
        const unsigned d = (unsigned)__cvta_generic_to_shared(dst + i);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src + i));
    }
#endif
}

// 16 bytes at src + OFF to dst + OFF (a shared-memory address) with cp.async, the offset an
// immediate of both addresses (one register pair for all of a head-block's copies).
template <int OFF> __device__ __forceinline__ void copy16_at(unsigned dst, const uint8_t * src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0+%2], [%1+%2], 16;" ::"r"(dst), "l"(src), "n"(OFF));
#endif
}
template <int... I>
__device__ __forceinline__ void copy_runs(unsigned dst, const uint8_t * src, std::integer_sequence<int, I...>) {
    (copy16_at<I * 512>(dst, src), ...);
}

// Copy the BYTES bytes (a multiple of 512) at src to dst with cp.async, unrolled.
template <int BYTES> __device__ __forceinline__ void copy_fixed(uint8_t * dst, const uint8_t * src, int lane) {
    copy_runs((unsigned)__cvta_generic_to_shared(dst + lane * 16), src + lane * 16,
              std::make_integer_sequence<int, BYTES / 512> {});
}

// The key part (scales, mins, codes of BK bits, mask) or the value part (scales, mins,
// codes of BV bits) of the head-block at src (none when null) to dst, as one cp.async group
// of this lane.
template <int BK, int BV>
__device__ __forceinline__ void copy_part(uint8_t * dst, const uint8_t * src, const ott_kv_block_layout & L, bool keys,
                                          int lane) {
    if (src && keys) {
        copy_range(dst, src, L.k_scale, L.v_scale, lane);
        copy_fixed<code_bytes<BK>()>(dst + L.k_codes, src + L.k_codes, lane);
        copy_range(dst, src, L.mask, L.size, lane);
    } else if (src) {
        copy_range(dst, src, L.v_scale, L.k_codes, lane);
        copy_fixed<code_bytes<BV>()>(dst + L.v_codes, src + L.v_codes, lane);
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;");
#endif
}

// Wait until this lane's cp.async groups but the newest one have landed.
__device__ __forceinline__ void wait_all_but_newest() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 1;");
#endif
}

// Per-warp shared memory: one head-block, scores [NR][BLOCK] floats, A rows (high and low
// bytes) [2][8][A_STRIDE].
__host__ __device__ inline size_t warp_smem_bytes(const ott_kv_block_layout & L, int nr) {
    return (size_t)L.size + (size_t)nr * BLOCK * sizeof(float) + 2 * 8 * A_STRIDE;
}

// The key part of this warp's first head-block of split blockIdx.y, as the first cp.async
// group of its lanes (attend_blocks_imma then waits for it).
template <int NR, int BK, int BV>
__device__ void copy_first_keys(const ott_cuda_attn_args & a, const ott_cuda_attn_tile & T, uint8_t * dyn) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int2 range = split_blocks(a, T);
    const int blk    = range.x + warp;
    copy_part<BK, BV>(dyn + (size_t)warp * warp_smem_bytes(a.L.layout, NR),
                      blk < range.y ? head_block(a.L, T, blk) : nullptr, a.L.layout, true, lane);
}

// The lane's n-tile i when REP lanes share an A row: tile t = REP·i + h (h: the lane's share
// of the tiles), its 4 D registers chosen by selects (static indices, no local memory).
template <int REP> __device__ __forceinline__ void tile_of(const int (&d)[4][4][4], int i, int h, int (&v)[4]) {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = d[(REP * i) >> 2][(REP * i) & 3][k];
#pragma unroll
    for (int hh = 1; hh < REP; ++hh) {
        const int t = REP * i + hh;
#pragma unroll
        for (int k = 0; k < 4; ++k) v[k] = h == hh ? d[t >> 2][t & 3][k] : v[k];
    }
}

// v[c] summed over the warp, for the lane's A row c < M.
template <int M> __device__ __forceinline__ float row_sum(const float (&v)[8], int c, int lane) {
    if constexpr (M == 1) {
        float x = v[0];
        warp_sum_from(x, 1);
        return x;
    } else {
        return __shfl_sync(0xffffffffu, sum_of_row(v, lane), c << 2);  // lane (c, 0) holds row c
    }
}

}  // namespace imma

// The quantized-block phase of split blockIdx.y with integer tensor cores (see above); the
// same partial results as attend_blocks. Needs G_K = NR·(block/group_k) <= GKM and
// G_V = NR·(head_dim/group_v) <= GVM (a row m per query row and group; GKM, GVM <= 8 bound
// the unrolled row loops, so the common shapes get short code). A row c is repeated in rows
// c + GKM·h (c + GVM·h) of the 8: lane (g, q) of row c = g % GKM converts n-tiles
// t = (8/GKM)·i + g / GKM only, and every lane has work.
template <int NR, int GKM, int GVM, int BK, int BV, bool TIERS>
__device__ void attend_blocks_imma(const ott_cuda_attn_args & a, const ott_cuda_attn_tile & T,
                                   attn_smem<imma::HD, NR> & S, uint8_t * dyn) {
    using namespace imma;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    const ott_cuda_kv_layer & L = a.L;
    const int lg_k = 31 - __clz(L.geom.group_k), lg_v = 31 - __clz(L.geom.group_v);  // groups are powers of two
    const int lg_nk = 7 - lg_k, lg_nv = 7 - lg_v;  // log2 of the groups per head-block: BLOCK = HD = 2^7
    const int n_gk = 1 << lg_nk, n_gv = 1 << lg_nv;
    const int G_K = NR << lg_nk, G_V = NR << lg_nv;    // A rows in use: (query row, group)
    constexpr int REPK = 8 / GKM, REPV = 8 / GVM;      // lanes sharing a key / value A row
    const int ck = g % GKM, hk = g / GKM;              // the lane's key A row, its share of the n-tiles
    const int cv = g % GVM, hv = g / GVM;              // the same for the values
    const bool k_row = ck < G_K, v_row = cv < G_V;     // the lane's A row means something
    const int rk = ck >> lg_nk, gk = ck & (n_gk - 1);  // query row and key group of row ck
    const int rv = cv >> lg_nv, gv = cv & (n_gv - 1);  // query row and value group of row cv
    // the lane's D columns 16(2q+j) + t (n-tile t) lie in group (32q + 16j) / group of their slots / channels
    bool k_own[2], v_own[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        k_own[j] = k_row && (32 * q + 16 * j) >> lg_k == gk;
        v_own[j] = v_row && (32 * q + 16 * j) >> lg_v == gv;
    }
    const int hb_bytes = (int)L.layout.size;
    uint8_t * wsm      = dyn + (size_t)warp * warp_smem_bytes(L.layout, NR);
    float * p_s        = (float *)(wsm + (size_t)hb_bytes);  // [NR][BLOCK] scores
    int8_t * a_hi      = (int8_t *)(p_s + NR * BLOCK);       // [8][A_STRIDE]
    int8_t * a_lo      = a_hi + 8 * A_STRIDE;

    const int2 range = split_blocks(a, T);
    const int b0 = range.x, b1 = range.y;

    // Per lane, summed over the warp at the end: the softmax sums of the lane's slots (row r)
    // and sum p·min of the lane's slots (A row c); every lane holds the same maxima m[r].
    float m[NR], l[NR], vmin[8];  // vmin[c >= GVM] stay 0
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
#pragma unroll
    for (int c = 0; c < 8; ++c) vmin[c] = 0.0f;
    constexpr int TV = 16 / REPV;  // value n-tiles of a lane
    float acc[TV][2];              // values of row rv, channel 16(2q+j) + REPV·i + hv
#pragma unroll
    for (int i = 0; i < TV; ++i) acc[i][0] = acc[i][1] = 0.0f;

    // The warp's buffer holds one head-block, its key part and value part loaded in turns: the
    // values' part while the keys are decoded, the next head-block's keys while the values are
    // (the first head-block's keys: copy_first_keys, before the queries and fp16 rows were loaded).
    const uint8_t * hb = wsm;
    for (int blk = b0 + warp; blk < b1; blk += WARPS) {
        copy_part<BK, BV>(wsm, head_block(L, T, blk), L.layout, false, lane);
        wait_all_but_newest();  // the keys' part
        __syncwarp();
        const uint8_t * ksc    = hb + L.layout.k_scale;  // [n_gk][HD] parameters
        const uint8_t * kmn    = hb + L.layout.k_min;
        const uint8_t * korder = hb + L.layout.k_order;  // key tiers: the channel of each key row
        const uint8_t * vsc    = hb + L.layout.v_scale;  // [BLOCK][n_gv]
        const uint8_t * vmn    = hb + L.layout.v_min;

        // keys: A row c = (r, group) is q_r·scale over channels lane + 32i; kbase[c] its sum q_r·min
        float x[8][4], kbase[8];
        uint32_t E[8];
        int e[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            kbase[c] = 0.0f;
            E[c]     = 0u;
            if (c >= GKM || c >= G_K) continue;
            const int r = min(c >> lg_nk, NR - 1), gi = c & (n_gk - 1);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row   = lane + 32 * i;  // with tiers, the key row of channel order[row]
                const float qc  = S.q[r][TIERS ? korder[row] : row];
                const float2 kp = param_at(L.geom, ksc, kmn, gi * HD + row);
                x[c][i]         = qc * kp.x;
                kbase[c]        = fmaf(qc, kp.y, kbase[c]);
                E[c]            = max(E[c], exp_bits(x[c][i]));
            }
        }
        row_exponents<GKM>(E, G_K, e);
#pragma unroll
        for (int c = 0; c < GKM; ++c) {
            if (c < G_K) store_a_row(x[c], e[c], c, lane, a_hi, a_lo);
        }
        const float kb     = row_sum<GKM>(kbase, ck, lane);
        const float kscale = pow2(-pick<GKM>(e, ck));
        __syncwarp();
        uint32_t af[4][4];
        load_a(a_hi, a_lo, k_row, ck, q, af);
        int d[4][4][4];
        if constexpr (TIERS)
            block_mma_tiers(hb + L.layout.k_codes, af, d, g, q);
        else
            block_mma<BK>((const uint32_t *)(hb + L.layout.k_codes), af, d, g, q);

        // scores of the lane's slots 16(2q+j) + t (its n-tiles t), where its row's group holds
        // them (bit t%32 of mask word t/32 = 1: slot t lives in a pool; the lane's slots are in word q)
        const uint32_t mask_q = a.traces ? ((const uint32_t *)(hb + L.layout.mask))[q] : 0u;
        __syncwarp();  // a_hi/a_lo are rewritten below
        constexpr int TK = 16 / REPK;
        float sc[2][TK];
#pragma unroll
        for (int i = 0; i < TK; ++i) {
            int v[4];
            tile_of<REPK>(d, i, hk, v);
            const int t   = REPK * i + hk;
            const float f = TIERS ? kscale : kscale * tile_scale<BK>(t);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const bool masked = (mask_q >> (16 * j + t)) & 1;
                sc[j][i]          = masked ? -INFINITY : fmaf(dot_of(v, j), f, kb);
            }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            if (!k_own[j]) continue;
            float * row = p_s + rk * BLOCK + 16 * (2 * q + j);
            if constexpr (REPK == 1) {  // consecutive slots: float4 stores
#pragma unroll
                for (int i = 0; i < TK; i += 4)
                    *(float4 *)&row[i] = make_float4(sc[j][i], sc[j][i + 1], sc[j][i + 2], sc[j][i + 3]);
            } else {
#pragma unroll
                for (int i = 0; i < TK; ++i) row[REPK * i + hk] = sc[j][i];
            }
        }
        __syncwarp();

        // online softmax over the block's slots lane + 32i; then the values' A rows c =
        // (r, group) = p_r·scale over those slots, and their sums p·min
        float corr[NR], p[NR][4];
#pragma unroll
        for (int r = 0; r < NR; ++r) {
            float mx = -INFINITY;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                p[r][i] = p_s[r * BLOCK + lane + 32 * i];
                mx      = fmaxf(mx, p[r][i]);
            }
            mx                = warp_max(mx);
            const float m_new = fmaxf(m[r], mx);
            corr[r]           = m_new == -INFINITY ? 1.0f : exp2_ftz(m[r] - m_new);
            float psum        = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                p[r][i] = m_new == -INFINITY ? 0.0f : exp2_ftz(p[r][i] - m_new);
                psum += p[r][i];
            }
            l[r] = l[r] * corr[r] + psum;
            m[r] = m_new;
        }
        copy_part<BK, BV>(wsm, blk + WARPS < b1 ? head_block(L, T, blk + WARPS) : nullptr, L.layout, true, lane);
        wait_all_but_newest();  // the values' part
        __syncwarp();
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            E[c] = 0u;
            if (c >= GVM || c >= G_V) continue;
            const int r = min(c >> lg_nv, NR - 1), gi = c & (n_gv - 1);
            float pr[4] = { p[0][0], p[0][1], p[0][2], p[0][3] };  // p[r], without indexing registers
#pragma unroll
            for (int rr = 1; rr < NR; ++rr)
#pragma unroll
                for (int i = 0; i < 4; ++i) pr[i] = rr == r ? p[rr][i] : pr[i];
            float pm = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int t     = lane + 32 * i;
                const float2 vp = vparam_at(L.geom, vsc, vmn, t * n_gv + gi);
                x[c][i]         = pr[i] * vp.x;
                pm              = fmaf(pr[i], vp.y, pm);
                E[c]            = max(E[c], exp_bits(x[c][i]));
            }
            vmin[c] = fmaf(vmin[c], pick<NR>(corr, r), pm);
        }
        row_exponents<GVM>(E, G_V, e);
#pragma unroll
        for (int c = 0; c < GVM; ++c) {
            if (c < G_V) store_a_row(x[c], e[c], c, lane, a_hi, a_lo);
        }
        const float vscale = pow2(-pick<GVM>(e, cv));
        __syncwarp();
        load_a(a_hi, a_lo, v_row, cv, q, af);
        block_mma<BV>((const uint32_t *)(hb + L.layout.v_codes), af, d, g, q);
        const float rcorr = pick<NR>(corr, rv);
#pragma unroll
        for (int i = 0; i < TV; ++i) {
            int v[4];
            tile_of<REPV>(d, i, hv, v);
            const float f = vscale * tile_scale<BV>(REPV * i + hv);
#pragma unroll
            for (int j = 0; j < 2; ++j) acc[i][j] = fmaf(acc[i][j], rcorr, dot_of(v, j) * f);
        }
        __syncwarp();  // the values' part is refilled next iteration
    }

    // the warp's sums; then its weighted values into shared memory, by the lane that owns
    // each (row, channel)
    softmax_rows<NR> sm;
#pragma unroll
    for (int r = 0; r < NR; ++r) {
        warp_sum_from(l[r], 1);
        sm.m[r] = m[r];
        sm.l[r] = l[r];
    }
    const float vm = row_sum<GVM>(vmin, cv, lane);
    __syncthreads();             // the per-warp regions become red
    float * red = (float *)dyn;  // [WARPS][NR][HD]
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        if (!v_own[j]) continue;
        float * row = red + ((size_t)warp * NR + rv) * HD + 16 * (2 * q + j);
#pragma unroll
        for (int i = 0; i < TV; ++i) row[REPV * i + hv] = acc[i][j] + vm;
    }
    put_state<HD, NR>(S, warp, sm);
}
