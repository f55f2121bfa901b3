// matmul_x8.cpp — see matmul_x8.h. Compiled for every x86-64 target with function-level
// target attributes, like attn_vnni.cpp; the CPU's features pick the kernels at run time.
#include "cpu/matmul_x8.h"

#include "cpu/attn_vnni.h"
#include "cpu/ott_ops_cpu.h"  // OTT_VERSIONS
#include "ggml-cpu.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int ROWS = 8;  // rows stored together

// ggml's blocks (ggml-common.h): fp16 d (and m, s) before 32 codes
struct block_q4_1 {
    uint16_t d, m;
    uint8_t qs[16];  // byte i: code i (low nibble), code i + 16 (high nibble)
};
struct block_q8_1 {
    uint16_t d, s;  // s = d·Σ qs
    int8_t qs[32];
};
struct block_q8_0 {
    uint16_t d;
    int8_t qs[32];
};
static_assert(sizeof(block_q4_1) == 20 && sizeof(block_q8_1) == 36 && sizeof(block_q8_0) == 34, "ggml's layout");

// A group's block (matmul_x8.h): the rows' fp16 d at D_AT, Q4_1's fp16 m at M_AT, then the
// rows' codes, row r's at codes_at(type) + r·code_bytes(type).
constexpr int D_AT = 0, M_AT = 2 * ROWS;
constexpr int codes_at(ggml_type type) { return type == GGML_TYPE_Q4_1 ? 4 * ROWS : 2 * ROWS; }
constexpr int code_bytes(ggml_type type) { return type == GGML_TYPE_Q4_1 ? 16 : 32; }

// Whether a kernel below runs on this CPU: AVX-512 VNNI's, else AVX2's (with FMA and F16C).
bool x8_available() {
#if OTT_VERSIONS
    static const bool ok = ott_vnni_available() || __builtin_cpu_supports("x86-64-v3");
    return ok;
#else
    return false;
#endif
}

std::atomic<bool> g_avx2 { false };  // ott_set_cpu_x8_vnni(0)

// Whether the VNNI kernels multiply: available and not turned off.
bool x8_vnni() { return ott_vnni_available() && !g_avx2.load(std::memory_order_relaxed); }

}  // namespace

extern "C" ott_status ott_set_cpu_x8_vnni(int32_t vnni, int32_t * out) {
    return ott_vnni_switch(g_avx2, vnni, out, "the 8-row weight kernels");
}

bool ott_x8_packable(ggml_type type, int64_t ne0, int64_t ne1) {
    return x8_available() && (type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q8_0) && ne0 % 32 == 0 && ne1 % ROWS == 0;
}

void ott_x8_pack(ggml_type type, int64_t ne0, int64_t ne1, uint8_t * data) {
    const int64_t nb = ne0 / 32;
    const size_t bs = ggml_type_size(type), rs = bs * (size_t)nb, gs = rs * ROWS;
    std::vector<uint8_t> rows(gs);  // one group of 8 rows in the file's layout
    for (int64_t g = 0; g < ne1 / ROWS; ++g) {
        uint8_t * out = data + g * gs;
        std::memcpy(rows.data(), out, gs);
        for (int64_t ib = 0; ib < nb; ++ib, out += bs * ROWS) {
            for (int r = 0; r < ROWS; ++r) {
                const uint8_t * blk = rows.data() + r * rs + ib * bs;  // d, (m,) then the codes
                std::memcpy(out + D_AT + 2 * r, blk, 2);
                if (type == GGML_TYPE_Q4_1) std::memcpy(out + M_AT + 2 * r, blk + 2, 2);
                std::memcpy(out + codes_at(type) + code_bytes(type) * r, blk + bs - code_bytes(type), code_bytes(type));
            }
        }
    }
}

namespace {

// dst[:, i] = row ids[i] of the 8-row layout, dequantized as ggml's to_float does
void get_rows_op(ggml_tensor * dst, int ith, int nth, void *) {
    const ggml_tensor * w   = dst->src[0];
    const ggml_tensor * ids = dst->src[1];
    const int64_t K = w->ne[0], nb = K / 32, n = ggml_nelements(ids);
    const size_t bs = ggml_type_size(w->type), gs = ggml_row_size(w->type, K) * ROWS;
    for (int64_t i = n * ith / nth; i < n * (ith + 1) / nth; ++i) {
        const int64_t r   = ((const int32_t *)ids->data)[i];
        const int s       = (int)(r % ROWS);
        const uint8_t * g = (const uint8_t *)w->data + r / ROWS * gs;
        float * y         = (float *)((char *)dst->data + i * dst->nb[1]);
        for (int64_t ib = 0; ib < nb; ++ib, g += bs * ROWS, y += 32) {
            uint16_t h;
            std::memcpy(&h, g + D_AT + 2 * s, 2);
            const float d     = ggml_fp16_to_fp32(h);
            const uint8_t * q = g + codes_at(w->type) + code_bytes(w->type) * s;
            if (w->type == GGML_TYPE_Q4_1) {
                std::memcpy(&h, g + M_AT + 2 * s, 2);
                const float m = ggml_fp16_to_fp32(h);
                for (int j = 0; j < 16; ++j) {
                    y[j]      = (float)(q[j] & 0x0F) * d + m;
                    y[j + 16] = (float)(q[j] >> 4) * d + m;
                }
            } else {
                for (int j = 0; j < 32; ++j) y[j] = (float)(int8_t)q[j] * d;
            }
        }
    }
}

}  // namespace

ggml_tensor * ott_x8_get_rows(ggml_context * ctx, ggml_tensor * w, ggml_tensor * ids) {
    ggml_tensor * args[2] = { w, ids };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[0], ggml_nelements(ids), 1, 1, args, 2, get_rows_op,
                          GGML_N_TASKS_MAX, nullptr);
}

#if OTT_VERSIONS
#include <immintrin.h>

// GCC 12's _mm512_undefined_ps() and kin, inside the extract, permute and convert intrinsics,
// initialise themselves from themselves on purpose
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define OTT_X8_ISA "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma"
#define OTT_X8 __attribute__((target(OTT_X8_ISA)))
#define OTT_X8_INLINE inline __attribute__((always_inline, target(OTT_X8_ISA)))
#define OTT_X8_AVX2_ISA "avx2,fma,f16c"
#define OTT_X8_AVX2 __attribute__((target(OTT_X8_AVX2_ISA)))
#define OTT_X8_AVX2_INLINE inline __attribute__((always_inline, target(OTT_X8_AVX2_ISA)))

namespace {

constexpr int COLS = 16;  // columns quantized at a time, each then read by every row group
// The group kernels prefetch the blocks 8 ahead of the one they read (the next group's, at the
// end of a group: groups lie one after the other).

OTT_X8_AVX2_INLINE float f16(uint16_t h) { return _cvtsh_ss(h); }

// ggml's hsum_float_8 of the lanes a[0..3] | b[0..3] (its lanes 0-3 and 4-7): b + a, then the
// upper pair onto the lower, then lane 1 onto lane 0.
OTT_X8_AVX2_INLINE float hsum8(__m128 a, __m128 b) {
    __m128 v = _mm_add_ps(b, a);
    v        = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v        = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

// A column's blocks as the kernels read them, COL_BYTES a block.
constexpr int COL_BYTES = 128;

// ---- AVX-512 VNNI: one vpdpbusd takes the lane sums of 4 rows (Q4_1, one nibble half) or 2
// rows (Q8_0). The column: Q4_1's partner Q8_1 as [codes 0-15 four times | codes 16-31 four
// times]; Q8_0 as [codes | codes] and −128·(each lane's four codes' sum), the start of the sums
// of codes + 128 (the weights' codes enter vpdpbusd unsigned, by an XOR).

OTT_X8_INLINE __m128 quarter(__m512 v, int q) {
    switch (q) {
        case 0:  return _mm512_extractf32x4_ps(v, 0);
        case 1:  return _mm512_extractf32x4_ps(v, 1);
        case 2:  return _mm512_extractf32x4_ps(v, 2);
        default: return _mm512_extractf32x4_ps(v, 3);
    }
}

OTT_X8 void arrange_vnni(ggml_type wtype, const void * y, int64_t nb, uint8_t * out) {
    for (int64_t ib = 0; ib < nb; ++ib, out += COL_BYTES) {
        if (wtype == GGML_TYPE_Q4_1) {
            const int8_t * qs = ((const block_q8_1 *)y)[ib].qs;
            _mm512_storeu_si512(out, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)qs)));
            _mm512_storeu_si512(out + 64, _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(qs + 16))));
        } else {
            const __m256i v  = _mm256_loadu_si256((const __m256i *)((const block_q8_0 *)y)[ib].qs);
            const __m512i vv = _mm512_inserti64x4(_mm512_zextsi256_si512(v), v, 1);
            const __m512i s  = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)0x80), vv);
            _mm512_storeu_si512(out, vv);
            _mm512_storeu_si512(out + 64, _mm512_sub_epi32(_mm512_setzero_si512(), s));
        }
    }
}

// Rows r (0-3 of each half h) of a Q4_1 group: quarter r of lo[h] holds row 4h + r's lanes 0-3,
// of hi[h] its lanes 4-7 (the low and the high nibbles: codes 0-15 and 16-31).
OTT_X8 void q4_1_group_vnni(const uint8_t * g, int64_t nb, const block_q8_1 * y, const uint8_t * yq, float * out) {
    __m512 lo[2] = { _mm512_setzero_ps(), _mm512_setzero_ps() }, hi[2] = { _mm512_setzero_ps(), _mm512_setzero_ps() };
    __m256 summs        = _mm256_setzero_ps();
    const __m512i nib   = _mm512_set1_epi8(0x0F);
    const __m512i to[2] = { _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                            _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7) };
    for (int64_t ib = 0; ib < nb; ++ib, g += ROWS * sizeof(block_q4_1), yq += COL_BYTES) {
        for (int l = 0; l < 3; ++l) _mm_prefetch((const char *)g + 8 * ROWS * sizeof(block_q4_1) + 64 * l, _MM_HINT_T0);
        const __m256 d     = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + D_AT)));
        const __m256 m     = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + M_AT)));
        const __m512 scale = _mm512_zextps256_ps512(_mm256_mul_ps(d, _mm256_set1_ps(f16(y[ib].d))));
        summs              = _mm256_fmadd_ps(m, _mm256_set1_ps(f16(y[ib].s)), summs);
        const __m512i ylo = _mm512_loadu_si512(yq), yhi = _mm512_loadu_si512(yq + 64);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
            const __m512i q  = _mm512_loadu_si512(g + codes_at(GGML_TYPE_Q4_1) + 64 * h);  // 4 rows
            const __m512i sl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(q, nib), ylo);
            const __m512i sh =
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(_mm512_srli_epi16(q, 4), nib), yhi);
            const __m512 s = _mm512_permutexvar_ps(to[h], scale);
            lo[h]          = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(sl), lo[h]);
            hi[h]          = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(sh), hi[h]);
        }
    }
    alignas(32) float sm[ROWS];
    _mm256_store_ps(sm, summs);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) out[r] = hsum8(quarter(lo[r / 4], r % 4), quarter(hi[r / 4], r % 4)) + sm[r];
}

// Rows 2p, 2p+1 of a Q8_0 group: the low and high halves of acc[p], ggml's lanes 0-7 each.
OTT_X8 void q8_0_group_vnni(const uint8_t * g, int64_t nb, const block_q8_0 * y, const uint8_t * yq, float * out) {
    __m512 acc[ROWS / 2];
    for (__m512 & a : acc) a = _mm512_setzero_ps();
    const __m512i x80 = _mm512_set1_epi8((char)0x80);
    __m512i to[ROWS / 2];
    for (int p = 0; p < ROWS / 2; ++p) {
        const int a = 2 * p, b = 2 * p + 1;
        to[p] = _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b);
    }
    for (int64_t ib = 0; ib < nb; ++ib, g += ROWS * sizeof(block_q8_0), yq += COL_BYTES) {
        for (int l = 0; l < 5; ++l) _mm_prefetch((const char *)g + 8 * ROWS * sizeof(block_q8_0) + 64 * l, _MM_HINT_T0);
        const __m256 d     = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + D_AT)));
        const __m512 scale = _mm512_zextps256_ps512(_mm256_mul_ps(d, _mm256_set1_ps(f16(y[ib].d))));
        const __m512i yb = _mm512_loadu_si512(yq), start = _mm512_loadu_si512(yq + 64);
#pragma GCC unroll 4
        for (int p = 0; p < ROWS / 2; ++p) {
            const __m512i q    = _mm512_xor_si512(_mm512_loadu_si512(g + codes_at(GGML_TYPE_Q8_0) + 64 * p), x80);
            const __m512i sums = _mm512_dpbusd_epi32(start, q, yb);
            acc[p]             = _mm512_fmadd_ps(_mm512_permutexvar_ps(to[p], scale), _mm512_cvtepi32_ps(sums), acc[p]);
        }
    }
#pragma GCC unroll 4
    for (int p = 0; p < ROWS / 2; ++p) {
        out[2 * p]     = hsum8(quarter(acc[p], 0), quarter(acc[p], 1));
        out[2 * p + 1] = hsum8(quarter(acc[p], 2), quarter(acc[p], 3));
    }
}

// ---- AVX2: vpmaddubsw and vpmaddwd take a row's lane sums (ggml's own instructions there; the
// products of a pair fit 16 bits: |Q4_1 code · Q8_1 code| ≤ 15·127, |Q8_0 · Q8_0| ≤ 128·127).
// The column: Q4_1's partner Q8_1 as [codes 0-15 twice | codes 16-31 twice]; Q8_0's codes.

OTT_X8_AVX2 void arrange_avx2(ggml_type wtype, const void * y, int64_t nb, uint8_t * out) {
    for (int64_t ib = 0; ib < nb; ++ib, out += COL_BYTES) {
        if (wtype == GGML_TYPE_Q4_1) {
            const int8_t * qs = ((const block_q8_1 *)y)[ib].qs;
            _mm256_storeu_si256((__m256i *)out, _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs)));
            _mm256_storeu_si256((__m256i *)(out + 32),
                                _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(qs + 16))));
        } else {
            std::memcpy(out, ((const block_q8_0 *)y)[ib].qs, 32);
        }
    }
}

// 8 int32 lanes, each the sum of 4 products of unsigned a and signed b bytes (ggml's
// mul_sum_us8_pairs_float before the conversion)
OTT_X8_AVX2_INLINE __m256i lane_sums(__m256i a, __m256i b) {
    return _mm256_madd_epi16(_mm256_set1_epi16(1), _mm256_maddubs_epi16(a, b));
}

// Rows 2p, 2p+1 of a Q4_1 group: the low and high 128 bits of lo[p] hold their lanes 0-3, of
// hi[p] their lanes 4-7 (the low and the high nibbles: codes 0-15 and 16-31).
OTT_X8_AVX2 void q4_1_group_avx2(const uint8_t * g, int64_t nb, const block_q8_1 * y, const uint8_t * yq, float * out) {
    __m256 lo[ROWS / 2], hi[ROWS / 2];
    for (int p = 0; p < ROWS / 2; ++p) lo[p] = hi[p] = _mm256_setzero_ps();
    __m256 summs      = _mm256_setzero_ps();
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i odd = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // even rows' scales low, odd rows' high
    for (int64_t ib = 0; ib < nb; ++ib, g += ROWS * sizeof(block_q4_1), yq += COL_BYTES) {
        for (int l = 0; l < 3; ++l) _mm_prefetch((const char *)g + 8 * ROWS * sizeof(block_q4_1) + 64 * l, _MM_HINT_T0);
        const __m256 d     = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + D_AT)));
        const __m256 m     = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + M_AT)));
        const __m256 scale = _mm256_permutevar8x32_ps(_mm256_mul_ps(d, _mm256_set1_ps(f16(y[ib].d))), odd);
        summs              = _mm256_fmadd_ps(m, _mm256_set1_ps(f16(y[ib].s)), summs);
        const __m256i ylo  = _mm256_loadu_si256((const __m256i *)yq);
        const __m256i yhi  = _mm256_loadu_si256((const __m256i *)(yq + 32));
#pragma GCC unroll 4
        for (int p = 0; p < ROWS / 2; ++p) {
            const __m256i q  = _mm256_loadu_si256((const __m256i *)(g + codes_at(GGML_TYPE_Q4_1) + 32 * p));  // 2 rows
            const __m256i sl = lane_sums(_mm256_and_si256(q, nib), ylo);
            const __m256i sh = lane_sums(_mm256_and_si256(_mm256_srli_epi16(q, 4), nib), yhi);
            __m256 s;  // row 2p's scale in the low 128 bits, row 2p + 1's in the high
            switch (p) {
                case 0:  s = _mm256_permute_ps(scale, 0x00); break;
                case 1:  s = _mm256_permute_ps(scale, 0x55); break;
                case 2:  s = _mm256_permute_ps(scale, 0xAA); break;
                default: s = _mm256_permute_ps(scale, 0xFF); break;
            }
            lo[p] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(sl), lo[p]);
            hi[p] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(sh), hi[p]);
        }
    }
    alignas(32) float sm[ROWS];
    _mm256_store_ps(sm, summs);
#pragma GCC unroll 4
    for (int p = 0; p < ROWS / 2; ++p) {
        out[2 * p]     = hsum8(_mm256_castps256_ps128(lo[p]), _mm256_castps256_ps128(hi[p])) + sm[2 * p];
        out[2 * p + 1] = hsum8(_mm256_extractf128_ps(lo[p], 1), _mm256_extractf128_ps(hi[p], 1)) + sm[2 * p + 1];
    }
}

// Row r of a Q8_0 group in acc[r], ggml's lanes 0-7; its codes' signs moved onto the column's
// (ggml's mul_sum_i8_pairs_float).
OTT_X8_AVX2 void q8_0_group_avx2(const uint8_t * g, int64_t nb, const block_q8_0 * y, const uint8_t * yq, float * out) {
    __m256 acc[ROWS];
    for (__m256 & a : acc) a = _mm256_setzero_ps();
    for (int64_t ib = 0; ib < nb; ++ib, g += ROWS * sizeof(block_q8_0), yq += COL_BYTES) {
        for (int l = 0; l < 5; ++l) _mm_prefetch((const char *)g + 8 * ROWS * sizeof(block_q8_0) + 64 * l, _MM_HINT_T0);
        alignas(32) float scale[ROWS];
        _mm256_store_ps(scale, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + D_AT))),
                                             _mm256_set1_ps(f16(y[ib].d))));
        const __m256i yb = _mm256_loadu_si256((const __m256i *)yq);
#pragma GCC unroll 8
        for (int r = 0; r < ROWS; ++r) {
            const __m256i q    = _mm256_loadu_si256((const __m256i *)(g + codes_at(GGML_TYPE_Q8_0) + 32 * r));
            const __m256i sums = lane_sums(_mm256_sign_epi8(q, q), _mm256_sign_epi8(yb, q));
            acc[r]             = _mm256_fmadd_ps(_mm256_broadcast_ss(scale + r), _mm256_cvtepi32_ps(sums), acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) out[r] = hsum8(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
}

// The kernels of one instruction set.
struct x8_kernels {
    void (*arrange)(ggml_type, const void *, int64_t, uint8_t *);
    void (*q4_1)(const uint8_t *, int64_t, const block_q8_1 *, const uint8_t *, float *);
    void (*q8_0)(const uint8_t *, int64_t, const block_q8_0 *, const uint8_t *, float *);
};

// dst = w·x. Each thread quantizes COLS columns at a time as ggml does (the same from_float,
// so the same blocks), then multiplies its share of the row groups by each of them.
void mul_mat_op(ggml_tensor * dst, int ith, int nth, void *) {
    const ggml_tensor * w = dst->src[0];
    const ggml_tensor * x = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1], nb = K / 32, n_cols = ggml_nrows(x);
    const ggml_type ytype            = ggml_get_type_traits_cpu(w->type)->vec_dot_type;
    const ggml_from_float_t quantize = ggml_get_type_traits_cpu(ytype)->from_float;
    const size_t yrow = ggml_row_size(ytype, K), gs = ggml_row_size(w->type, K) * ROWS;

    static const x8_kernels vnni { arrange_vnni, q4_1_group_vnni, q8_0_group_vnni };
    static const x8_kernels avx2 { arrange_avx2, q4_1_group_avx2, q8_0_group_avx2 };
    const x8_kernels & k = x8_vnni() ? vnni : avx2;  // ott_x8_packable: one of them runs here

    thread_local std::vector<uint8_t> ys, yq;
    ys.resize(yrow * COLS);
    yq.resize((size_t)COL_BYTES * nb * COLS);
    const int64_t ng = N / ROWS, g0 = ng * ith / nth, g1 = ng * (ith + 1) / nth;
    for (int64_t c0 = 0; c0 < n_cols; c0 += COLS) {
        const int64_t nc = std::min<int64_t>(COLS, n_cols - c0);
        for (int64_t c = 0; c < nc; ++c) {  // column c0 + c of x: (i1, i2, i3) in its rows
            const int64_t i = c0 + c, i1 = i % x->ne[1], i2 = i / x->ne[1] % x->ne[2], i3 = i / (x->ne[1] * x->ne[2]);
            const auto * col = (const float *)((const char *)x->data + i1 * x->nb[1] + i2 * x->nb[2] + i3 * x->nb[3]);
            quantize(col, ys.data() + c * yrow, K);
            k.arrange(w->type, ys.data() + c * yrow, nb, yq.data() + c * COL_BYTES * nb);
        }
        for (int64_t g = g0; g < g1; ++g) {
            const uint8_t * rows = (const uint8_t *)w->data + g * gs;
            for (int64_t c = 0; c < nc; ++c) {
                float * out          = (float *)dst->data + (c0 + c) * N + g * ROWS;
                const uint8_t * y    = ys.data() + c * yrow;
                const uint8_t * ycol = yq.data() + c * COL_BYTES * nb;
                if (w->type == GGML_TYPE_Q4_1) {
                    k.q4_1(rows, nb, (const block_q8_1 *)y, ycol, out);
                } else {
                    k.q8_0(rows, nb, (const block_q8_0 *)y, ycol, out);
                }
            }
        }
    }
}

}  // namespace

ggml_tensor * ott_x8_mul_mat(ggml_context * ctx, ggml_tensor * w, ggml_tensor * x) {
    ggml_tensor * args[2] = { w, x };
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], x->ne[2], x->ne[3], args, 2, mul_mat_op,
                          GGML_N_TASKS_MAX, nullptr);
}

#else

ggml_tensor * ott_x8_mul_mat(ggml_context *, ggml_tensor *, ggml_tensor *) { return nullptr; }

#endif
