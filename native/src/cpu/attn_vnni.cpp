// attn_vnni.cpp — see attn_vnni.h. Compiled for every x86-64 target with function-level
// target attributes; ott_vnni_available() decides at run time whether it may be called.
#include "cpu/attn_vnni.h"

#include "common.h"
#include "cpu/ott_ops_cpu.h"  // OTT_VERSIONS: the fused attention has an AVX-512 version to call this from

namespace {
std::atomic<bool> g_off { false };  // ott_set_cpu_int_dots(0)
}

bool ott_vnni_enabled() { return ott_vnni_available() && !g_off.load(std::memory_order_relaxed); }

ott_status ott_vnni_switch(std::atomic<bool> & off, int32_t on, int32_t * out, const char * what) {
    if (on > 0 && !ott_vnni_available()) {
        return ott_fail(OTT_ERR_UNSUPPORTED, "this CPU lacks AVX-512 VNNI for %s", what);
    }
    if (on >= 0) off.store(on == 0, std::memory_order_relaxed);
    if (out) *out = ott_vnni_available() && !off.load(std::memory_order_relaxed) ? 1 : 0;
    return OTT_OK;
}

extern "C" ott_status ott_set_cpu_int_dots(int32_t on, int32_t * out) {
    return ott_vnni_switch(g_off, on, out, "integer dot products");
}

#if OTT_VERSIONS
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#define OTT_VNNI_ISA "avx512f,avx512bw,avx512vl,avx512vnni"
#define OTT_VNNI __attribute__((target(OTT_VNNI_ISA)))
#define OTT_VNNI_INLINE inline __attribute__((always_inline, target(OTT_VNNI_ISA)))

bool ott_vnni_available() {
    static const bool ok =
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    return ok;
}

namespace {

// permutex2var_ps indices that interleave two sequences of elements of W floats: lane i takes
// element i/(2W) (+ 8/W for the high half) of a (i/W even) or b (odd).
struct zip_table {
    alignas(64) int32_t lo[16];
    alignas(64) int32_t hi[16];
    constexpr explicit zip_table(int W) : lo {}, hi {} {
        for (int i = 0; i < 16; ++i) {
            lo[i] = (i / (2 * W)) * W + i % W + ((i / W) % 2 ? 16 : 0);
            hi[i] = lo[i] + 8;
        }
    }
};
constexpr zip_table ZIP1 { 1 }, ZIP2 { 2 }, ZIP4 { 4 };

// out[2j], out[2j+1] := the elements (W floats) of a[j] and b[j] alternating, j < n.
template <int W> OTT_VNNI_INLINE void zip(const __m512 * a, const __m512 * b, int n, __m512 * out) {
    const zip_table & z = W == 1 ? ZIP1 : W == 2 ? ZIP2 : ZIP4;
    const __m512i lo = _mm512_load_si512(z.lo), hi = _mm512_load_si512(z.hi);
    for (int j = 0; j < n; ++j) {
        out[2 * j]     = _mm512_permutex2var_ps(a[j], lo, b[j]);
        out[2 * j + 1] = _mm512_permutex2var_ps(a[j], hi, b[j]);
    }
}

// f[s][l] is code CPB·l + s of a segment; out: the segment's 16·CPB codes in order.
template <int CPB> OTT_VNNI_INLINE void to_code_order(const __m512 (&f)[CPB], __m512 (&out)[CPB]) {
    if constexpr (CPB == 2) {
        zip<1>(&f[0], &f[1], 1, out);
    } else if constexpr (CPB == 4) {
        __m512 g0[2], g1[2];
        zip<1>(&f[0], &f[1], 1, g0);
        zip<1>(&f[2], &f[3], 1, g1);
        zip<2>(g0, g1, 2, out);
    } else {
        __m512 g[4][2], h0[4], h1[4];
        for (int k = 0; k < 4; ++k) zip<1>(&f[2 * k], &f[2 * k + 1], 1, g[k]);
        zip<2>(g[0], g[1], 2, h0);
        zip<2>(g[2], g[3], 2, h1);
        zip<4>(h0, h1, 4, out);
    }
}

template <int BITS, int RB>
OTT_VNNI void pair_dots(const uint8_t * rows, size_t row_bytes, int32_t n_pairs, int32_t n, const int16_t * w,
                        int32_t w_stride, const float * scale, float * out, int32_t ld) {
    constexpr int CPB       = 8 / BITS;           // codes per byte
    constexpr int SPP       = CPB < 4 ? CPB : 4;  // shifts per pass over the pairs (RB·SPP accumulators)
    constexpr uint32_t CODE = (1u << BITS) - 1;
    constexpr __mmask16 ALL = 0xFFFF;  // the maskz forms: GCC 12 warns on the plain ones' undefined inputs
    // dword l = byte l of row a, twice, then byte l of row b, twice (bytes 1 and 3 are masked off):
    // 128-bit lane k takes dword k of each row (vpermt2d), then its bytes are spread (vpshufb)
    alignas(64) static constexpr struct idx_t {
        int32_t d[16];
        uint8_t b[64];
        constexpr idx_t() : d {}, b {} {
            for (int k = 0; k < 4; ++k) {
                d[4 * k]     = k;
                d[4 * k + 1] = 16 + k;
                for (int i = 0; i < 4; ++i) {
                    b[16 * k + 4 * i] = b[16 * k + 4 * i + 1] = (uint8_t)i;
                    b[16 * k + 4 * i + 2] = b[16 * k + 4 * i + 3] = (uint8_t)(4 + i);
                }
            }
        }
    } IDX {};
    const __m512i idx_d = _mm512_load_si512(IDX.d), idx_b = _mm512_load_si512(IDX.b);
    for (int32_t i0 = 0, seg = 0; i0 < n; i0 += 16 * CPB, ++seg) {
        __m512 f[RB][CPB];
        for (int s0 = 0; s0 < CPB; s0 += SPP) {
            __m512i acc[RB][SPP];
            for (int r = 0; r < RB; ++r)
                for (int s = 0; s < SPP; ++s) acc[r][s] = _mm512_setzero_si512();
            const uint8_t * p0 = rows + (size_t)seg * 16;
            for (int32_t p = 0; p < n_pairs; ++p, p0 += 2 * row_bytes) {
                const __m512i a = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)p0));
                const __m512i b = _mm512_zextsi128_si512(_mm_loadu_si128((const __m128i *)(p0 + row_bytes)));
                const __m512i x = _mm512_shuffle_epi8(_mm512_permutex2var_epi32(a, idx_d, b), idx_b);
                for (int s = 0; s < SPP; ++s) {
                    const uint32_t m = CODE << (BITS * (s0 + s));
                    const __m512i xm = _mm512_and_si512(x, _mm512_set1_epi32((int)(m | m << 16)));
                    for (int r = 0; r < RB; ++r) {
                        int32_t wp;  // the pair's two weights
                        std::memcpy(&wp, w + (size_t)r * w_stride + 2 * p, sizeof wp);
                        acc[r][s] = _mm512_dpwssd_epi32(acc[r][s], xm, _mm512_set1_epi32(wp));
                    }
                }
            }
            for (int r = 0; r < RB; ++r)
                for (int s = 0; s < SPP; ++s) {
                    const float k = scale[r] / (float)(1u << (BITS * (s0 + s)));
                    f[r][s0 + s]  = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(ALL, acc[r][s]), _mm512_set1_ps(k));
                }
        }
        const int32_t nv = std::min(16 * CPB, n - i0);  // codes of this segment in range
        for (int r = 0; r < RB; ++r) {
            __m512 o[CPB];
            to_code_order<CPB>(f[r], o);
            float * dst = out + (size_t)r * ld + i0;
            for (int v = 0; v < CPB && 16 * v < nv; ++v) {
                const int k           = std::min(16, nv - 16 * v);
                const __mmask16 lanes = (__mmask16)((1u << k) - 1);
                const __m512 prev     = _mm512_maskz_loadu_ps(lanes, dst + 16 * v);
                _mm512_mask_storeu_ps(dst + 16 * v, lanes, _mm512_add_ps(prev, o[v]));
            }
        }
    }
}

template <int BITS>
void pair_dots_rb(int32_t rb, const uint8_t * rows, size_t row_bytes, int32_t n_pairs, int32_t n, const int16_t * w,
                  int32_t w_stride, const float * scale, float * out, int32_t ld) {
    switch (rb) {
        case 1:  pair_dots<BITS, 1>(rows, row_bytes, n_pairs, n, w, w_stride, scale, out, ld); break;
        case 2:  pair_dots<BITS, 2>(rows, row_bytes, n_pairs, n, w, w_stride, scale, out, ld); break;
        case 3:  pair_dots<BITS, 3>(rows, row_bytes, n_pairs, n, w, w_stride, scale, out, ld); break;
        default: pair_dots<BITS, 4>(rows, row_bytes, n_pairs, n, w, w_stride, scale, out, ld); break;
    }
}

}  // namespace

void ott_vnni_pair_dots(int32_t bits, const uint8_t * rows, size_t row_bytes, int32_t n_pairs, int32_t n,
                        const int16_t * w, int32_t w_stride, const float * scale, int32_t rb, float * out, int32_t ld) {
    switch (bits) {
        case 1:  pair_dots_rb<1>(rb, rows, row_bytes, n_pairs, n, w, w_stride, scale, out, ld); break;
        case 2:  pair_dots_rb<2>(rb, rows, row_bytes, n_pairs, n, w, w_stride, scale, out, ld); break;
        default: pair_dots_rb<4>(rb, rows, row_bytes, n_pairs, n, w, w_stride, scale, out, ld); break;
    }
}

#else

bool ott_vnni_available() { return false; }

void ott_vnni_pair_dots(int32_t, const uint8_t *, size_t, int32_t, int32_t, const int16_t *, int32_t, const float *,
                        int32_t, float *, int32_t) {}

#endif
