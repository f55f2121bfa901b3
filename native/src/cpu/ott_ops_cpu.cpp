// ott_ops_cpu.cpp — CPU workers of the quantized KV cache (see ott_ops_cpu.h).
//
// Attention of one work item keeps, per query row, the running max m, the sum l of
// exp(score - m) and the weighted value sum acc (online softmax), over tiles of up to
// KEY_TILE keys. A KV head's data are read once per item and shared by all its query rows
// (GQA: every query head of the KV head, every chunk token of the item), which are kept
// in registers RB_MAX at a time.
//
// Quantized blocks take one of two paths:
//   fused         (few rows, groups a multiple of VL) scores and values straight from the
//                 codes: Σ_c (q_c·scale_c)·code + Σ_c q_c·min_c per key group, and
//                 Σ_t (p_t·scale_t)·code + Σ_t p_t·min_t per value group (docs/design.md §3)
//   materialised  the tile is dequantised once into float keys (channel-major) and values,
//                 then the same kernels as the fp16 stores run on it
// Vectors are GCC/Clang vector extensions (SSE2 … AVX-512 from one source), VL floats as two
// halves of 8 (v16f below); on x86-64 Linux the kernels are cloned for x86-64-v4 (AVX-512),
// v3 (AVX2/FMA) and the baseline, picked at load time, and the fused path has an AVX-512
// version in 64-byte vectors (v16z). This file may reassociate float sums: attention is
// checked against the float64 reference within a budget; the quantizer (kv_quant.c) is
// bit-exact and compiled apart.
#include "cpu/ott_ops_cpu.h"
#include "cpu/attn_vnni.h"
#include "cpu/kvq_attn_cpu.h"

#include "kv/kv_kvq.h"
#include "kv/kv_quant.h"

#include "ggml-cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

#define OTT_INLINE inline __attribute__((always_inline))

namespace {

constexpr int32_t KEY_TILE   = 128;            // keys per tile
constexpr int32_t VL         = 16;             // floats per vector
constexpr int32_t LD         = KEY_TILE + VL;  // row stride of per-key buffers (a partial vector may overrun)
constexpr int32_t RB_MAX     = 4;              // query rows whose accumulators stay in registers together
constexpr int32_t FUSED_ROWS = 8;              // items with at most this many rows read codes directly

// A vector of VL floats is two halves of 8 floats (v16f). With one 64-byte vector type GCC kept
// the register-blocked accumulators (arrays of vectors) on the stack in the AVX2 clone and moved
// them through general registers on every update; halves of 32 bytes stay in registers there.
// The fused kernels have a version of their own for AVX-512 (attend_codes), where one 64-byte
// register holds the VL floats (v16z) and an iteration takes two of them.
typedef float v8f __attribute__((vector_size(8 * sizeof(float))));
typedef uint32_t v8u __attribute__((vector_size(8 * sizeof(uint32_t))));
typedef int32_t v8i __attribute__((vector_size(8 * sizeof(int32_t))));
typedef uint8_t v8b __attribute__((vector_size(8)));
struct v16f {
    v8f lo, hi;
};
typedef float v16z __attribute__((vector_size(VL * sizeof(float))));
typedef uint32_t v16zu __attribute__((vector_size(VL * sizeof(uint32_t))));
typedef uint64_t v8zq __attribute__((vector_size(VL * sizeof(uint32_t))));
typedef uint8_t v16b __attribute__((vector_size(VL)));
static_assert(VL == 16 && sizeof(v16f) == sizeof(v16z), "v16f and v16z are VL floats");

OTT_INLINE v16f operator+(v16f a, v16f b) { return { a.lo + b.lo, a.hi + b.hi }; }
OTT_INLINE v16f operator+(v16f a, float b) { return { a.lo + b, a.hi + b }; }
OTT_INLINE v16f operator*(float a, v16f b) { return { a * b.lo, a * b.hi }; }
OTT_INLINE v16f operator*(v16f a, v16f b) { return { a.lo * b.lo, a.hi * b.hi }; }
OTT_INLINE v16f operator-(v16f a, v16f b) { return { a.lo - b.lo, a.hi - b.hi }; }
OTT_INLINE v16f & operator+=(v16f & a, v16f b) {
    a.lo += b.lo;
    a.hi += b.hi;
    return a;
}
// V: v16f or v16z. A v16f moves half by half: copied whole, GCC's AVX2 clone built the pair on
// the stack and moved it on in four 16-byte pieces.
template <class V = v16f> OTT_INLINE V load16(const float * p) {
    V v;
    if constexpr (std::is_same_v<V, v16f>) {
        std::memcpy(&v.lo, p, sizeof v.lo);
        std::memcpy(&v.hi, p + VL / 2, sizeof v.hi);
    } else {
        std::memcpy(&v, p, sizeof v);
    }
    return v;
}
template <class V> OTT_INLINE void store16(float * p, V v) {
    if constexpr (std::is_same_v<V, v16f>) {
        std::memcpy(p, &v.lo, sizeof v.lo);
        std::memcpy(p + VL / 2, &v.hi, sizeof v.hi);
    } else {
        std::memcpy(p, &v, sizeof v);
    }
}

// RoPE angles composed: the cosines and sines (co, si) of a + b from those of a (c0, s0; one
// pair) and of b (c, s; one per lane). V: v8f, v16f or v16z.
template <class V> OTT_INLINE void compose_angles(float c0, float s0, V c, V s, V & co, V & si) {
    co = c0 * c - s0 * s;
    si = s0 * c + c0 * s;
}
OTT_INLINE v16f splat(float x) { return { (v8f) {} + x, (v8f) {} + x }; }
OTT_INLINE v8f to_float(v8u x) { return __builtin_convertvector((v8i)x, v8f); }

// 8 consecutive codes of a packed row (LSB-first bit stream), from the first bit of byte p
template <int BITS> OTT_INLINE v8u codes8(const uint8_t * p) {
    uint32_t x;  // the BITS bytes, read whole (a narrower copy into a wider word stalls the load)
    if constexpr (BITS == 4) {
        std::memcpy(&x, p, 4);
    } else {
        uint16_t lo;
        std::memcpy(&lo, p, 2);
        x = BITS == 3 ? (uint32_t)lo | (uint32_t)p[2] << 16 : lo;
    }
    const v8u sh = { 0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS };
    return ((v8u) {} + x) >> sh & (uint32_t)((1 << BITS) - 1);
}

// 16 consecutive codes of a packed row, from the first bit of byte p, as one 64-byte vector
// whose lane i holds code_i·2^(BITS·i) (4 bits: 2^(4·(i mod 8))): a word broadcast to every
// lane and masked to the lane's code, left where it is (4 bits: the two words of 8 codes
// permuted into the lanes' halves). One uop less than shifting each lane down; the kernels
// scale their accumulators by lane_scale, a power of two per lane, which changes no rounding.
template <int BITS> OTT_INLINE v16z codes16z(const uint8_t * p) {
    if constexpr (BITS == 1) {
        const v16zu m = { 1u << 0, 1u << 1, 1u << 2,  1u << 3,  1u << 4,  1u << 5,  1u << 6,  1u << 7,
                          1u << 8, 1u << 9, 1u << 10, 1u << 11, 1u << 12, 1u << 13, 1u << 14, 1u << 15 };
        uint16_t h;
        std::memcpy(&h, p, 2);
        return __builtin_convertvector(((v16zu) {} + (uint32_t)h) & m, v16z);
    } else if constexpr (BITS == 2) {
        const v16zu m = { 3u << 0,  3u << 2,  3u << 4,  3u << 6,  3u << 8,  3u << 10, 3u << 12, 3u << 14,
                          3u << 16, 3u << 18, 3u << 20, 3u << 22, 3u << 24, 3u << 26, 3u << 28, 3u << 30 };
        uint32_t x;
        std::memcpy(&x, p, 4);
        return __builtin_convertvector(((v16zu) {} + x) & m, v16z);  // unsigned: lane 15 reaches bit 31
    } else if constexpr (BITS == 4) {
        const v16zu m = { 15u << 0, 15u << 4, 15u << 8, 15u << 12, 15u << 16, 15u << 20, 15u << 24, 15u << 28,
                          15u << 0, 15u << 4, 15u << 8, 15u << 12, 15u << 16, 15u << 20, 15u << 24, 15u << 28 };
        uint64_t x;
        std::memcpy(&x, p, 8);
        const v16zu w = (v16zu)((v8zq) {} + x);
        return __builtin_convertvector(
            __builtin_shufflevector(w, w, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1) & m, v16z);
    } else {
        v16b a;
        std::memcpy(&a, p, sizeof a);
        return __builtin_convertvector(a, v16z);
    }
}

// Lane i's factor between codes16z's lanes and the codes: 2^(BITS·i) (up) and its inverse
// (down); 1 for 8 bits and for the halves of 8 floats (v16f), whose codes16 shifts.
template <class V, int BITS> struct lane_scale {
    static OTT_INLINE V up(V x) { return x; }
    static OTT_INLINE V down(V x) { return x; }
};
template <int BITS> struct lane_factors {
    float f[VL];
    constexpr explicit lane_factors(bool up) : f {} {
        for (int i = 0; i < VL; ++i) {
            const int e = BITS == 8 ? 0 : BITS * (BITS == 4 ? i % 8 : i);
            f[i]        = up ? (float)(1u << e) : 1.0f / (float)(1u << e);
        }
    }
};
template <int BITS> struct lane_scale<v16z, BITS> {
    static constexpr lane_factors<BITS> UP { true }, DOWN { false };
    static OTT_INLINE v16z up(v16z x) { return BITS == 8 ? x : x * load16<v16z>(UP.f); }
    static OTT_INLINE v16z down(v16z x) { return BITS == 8 ? x : x * load16<v16z>(DOWN.f); }
};

// 16 consecutive codes of a packed row, from the first bit of byte p
template <int BITS, class V = v16f> OTT_INLINE V codes16(const uint8_t * p) {
    static_assert(BITS == 1 || BITS == 2 || BITS == 4 || BITS == 8, "1, 2, 4 or 8 bits");
    if constexpr (std::is_same_v<V, v16z>) {
        return codes16z<BITS>(p);
    } else if constexpr (BITS == 1) {
        const v8u sh = { 0, 1, 2, 3, 4, 5, 6, 7 };
        uint16_t h;
        std::memcpy(&h, p, 2);
        const v8u w = (v8u) {} + (uint32_t)h;
        return { to_float(w >> sh & 1u), to_float(w >> (sh + 8u) & 1u) };
    } else if constexpr (BITS == 2) {
        const v8u sh = { 0, 2, 4, 6, 8, 10, 12, 14 };
        uint32_t x;
        std::memcpy(&x, p, 4);
        const v8u w = (v8u) {} + x;
        return { to_float(w >> sh & 3u), to_float(w >> (sh + 16u) & 3u) };
    } else if constexpr (BITS == 4) {
        const v8u sh = { 0, 4, 8, 12, 16, 20, 24, 28 };
        uint32_t a, b;
        std::memcpy(&a, p, 4);
        std::memcpy(&b, p + 4, 4);
        return { to_float(((v8u) {} + a) >> sh & 15u), to_float(((v8u) {} + b) >> sh & 15u) };
    } else {
        v8b a, b;
        std::memcpy(&a, p, sizeof a);
        std::memcpy(&b, p + 8, sizeof b);
        return { __builtin_convertvector(a, v8f), __builtin_convertvector(b, v8f) };
    }
}

// ---- code unpacking for any length: byte -> its codes as floats, LSB-first ------------

struct code_lut {
    float one[256][8];
    float two[256][4];
    float four[256][2];
};

constexpr code_lut make_code_lut() {
    code_lut t {};
    for (int b = 0; b < 256; ++b) {
        for (int i = 0; i < 8; ++i) t.one[b][i] = (float)((b >> i) & 1);
        for (int i = 0; i < 4; ++i) t.two[b][i] = (float)((b >> (2 * i)) & 3);
        for (int i = 0; i < 2; ++i) t.four[b][i] = (float)((b >> (4 * i)) & 15);
    }
    return t;
}

constexpr code_lut LUT = make_code_lut();

// n codes of a packed row -> float [n]; n*bits is a multiple of 8
void unpack_codes(const uint8_t * row, int32_t n, int32_t bits, float * out) {
    switch (bits) {
        case 1:
            for (int32_t j = 0; j < n / 8; ++j) std::memcpy(out + 8 * j, LUT.one[row[j]], 8 * sizeof(float));
            break;
        case 2:
            for (int32_t j = 0; j < n / 4; ++j) std::memcpy(out + 4 * j, LUT.two[row[j]], 4 * sizeof(float));
            break;
        case 4:
            for (int32_t j = 0; j < n / 2; ++j) std::memcpy(out + 2 * j, LUT.four[row[j]], 2 * sizeof(float));
            break;
        default:
            for (int32_t j = 0; j < n; ++j) out[j] = (float)row[j];
            break;
    }
}

// 2^e as a float, e in -126 .. 127 (libm's ldexp is a call per use; built from its bits, loops over
// it vectorise).
OTT_INLINE float pow2f(int e) {
    const uint32_t bits = (uint32_t)(e + 127) << 23;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// e^x for x <= 0 (x = -inf gives 0); relative error below 4e-7; branch-free so loops over
// it vectorise. x = n·ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial.
OTT_INLINE float exp_nonpos(float x) {
    const float xc = x < -87.0f ? -87.0f : x;
    const float n  = std::floor(xc * 1.44269504088896341f + 0.5f);
    const float r  = (xc - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    float p        = 1.0f / 720.0f;
    p              = p * r + 1.0f / 120.0f;
    p              = p * r + 1.0f / 24.0f;
    p              = p * r + 1.0f / 6.0f;
    p              = p * r + 0.5f;
    p              = p * r + 1.0f;
    p              = p * r + 1.0f;
    return x < -87.0f ? 0.0f : p * pow2f((int)n);  // n >= -126
}

// n scales and minimums of a head-block's parameter arrays sc and mn from group i0, as floats
// into s and m: fp16, or ufp8 and int8 (param_bits 8, kv_layout.h); mn null: symmetric groups
// of `bits`-bit codes (sym_v), the minimum implied.
OTT_CLONES void params_f32(const ott_kv_geom & g, const uint8_t * sc, const uint8_t * mn, int32_t bits, size_t i0,
                           int64_t n, float * s, float * m) {
    if (g.param_bits == 8) {
        for (int64_t j = 0; j < n; ++j) s[j] = ott_kv_scale8(sc[i0 + j]);
        for (int64_t j = 0; mn && j < n; ++j) m[j] = ott_kv_min8((int8_t)mn[i0 + j], s[j]);
    } else {
        ggml_cpu_fp16_to_fp32((const ggml_fp16_t *)sc + i0, s, n);
        if (mn) ggml_cpu_fp16_to_fp32((const ggml_fp16_t *)mn + i0, m, n);
    }
    for (int64_t j = 0; !mn && j < n; ++j) m[j] = ott_kv_sym_min(bits, s[j]);
}

// A head-block's value minimums, or null for symmetric value groups (params_f32).
const uint8_t * v_min_of(const ott_kv_geom & g, const ott_kv_block_layout & L, const uint8_t * hb) {
    return g.sym_v ? nullptr : hb + L.v_min;
}

// ---- per-thread work memory -------------------------------------------------------------

struct attn_ws {
    int32_t hd, hdp;  // head_dim, and head_dim rounded up to VL (row stride of q, acc, v)
    float * kc;       // [head_dim][LD] keys of a tile, channel-major
    float * vc;       // [KEY_TILE][hdp] values of a tile
    float * tmp;      // [KEY_TILE][hdp] conversions
    float * s;        // [rows][LD] scores, then probabilities
    float * pw;       // [rows][LD] probabilities times a value group's scales
    float * q;        // [rows][hdp] queries times kq_scale
    float * qs;       // [rows][hdp] queries times a key group's scales
    float * acc;      // [rows][hdp] weighted values
    float * m;        // [rows] running max
    float * l;        // [rows] running sum
    float * qm;       // [rows] queries · a key group's mins
    float * mt;       // [rows] probabilities · a value group's mins
    float * ksc;      // [KEY_TILE][head_dim] key scales of a tile's groups (worst case group_k = 1)
    float * kmn;      // [KEY_TILE][head_dim] key mins
    float * vsc;      // [KEY_TILE][n_gv] value scales of a tile's slots
    float * vmn;      // [KEY_TILE][n_gv]
    float * rc;       // [KEY_TILE] RoPE: cos of one pair at each key of a tile (gathered)
    float * rs;       // sin
    int32_t * lim;    // [rows] causal limit of each row inside a tile of the chunk
    uint8_t * dead;   // [KEY_TILE] 1: masked slot
};

// The arrays of an attn_ws laid out in mem (NULL: sizes only, no array); returns their bytes.
size_t workspace_layout(void * mem, int32_t hd, int32_t n_gv, int32_t rows, attn_ws & w) {
    w.hd           = hd;
    w.hdp          = (hd + VL - 1) / VL * VL;
    const size_t T = KEY_TILE, R = rows, H = w.hdp;
    size_t off = 0;
    auto take  = [mem, &off](size_t n, size_t size) {
        void * p = mem ? (uint8_t *)mem + off : nullptr;
        off += n * size;
        return p;
    };
    auto floats = [&take](size_t n) { return (float *)take(n, sizeof(float)); };
    w.kc        = floats(hd * (size_t)LD);
    w.vc        = floats(T * H);
    w.tmp       = floats(T * H);
    w.s         = floats(R * LD);
    w.pw        = floats(R * LD);
    w.q         = floats(R * H);
    w.qs        = floats(R * H);
    w.acc       = floats(R * H);
    w.m         = floats(R);
    w.l         = floats(R);
    w.qm        = floats(R);
    w.mt        = floats(R);
    w.ksc       = floats(T * hd);
    w.kmn       = floats(T * hd);
    w.vsc       = floats(T * n_gv);
    w.vmn       = floats(T * n_gv);
    w.rc        = floats(T);
    w.rs        = floats(T);
    w.lim       = (int32_t *)take(R, sizeof(int32_t));
    w.dead      = (uint8_t *)take(T, 1);
    return off;
}

size_t workspace_bytes(int32_t hd, int32_t n_gv, int32_t rows) {
    attn_ws w;
    return workspace_layout(nullptr, hd, n_gv, rows, w);
}

// A thread's attn_ws in mem, grown as needed (zeroed: padding lanes stay finite).
attn_ws workspace(std::vector<uint8_t> & mem, int32_t hd, int32_t n_gv, int32_t rows) {
    const size_t bytes = workspace_bytes(hd, n_gv, rows);
    if (mem.size() < bytes) mem.assign(bytes, 0);
    attn_ws w;
    workspace_layout(mem.data(), hd, n_gv, rows, w);
    return w;
}

// An empty softmax state for rows query rows.
void start_rows(const attn_ws & w, int32_t rows) {
    std::fill(w.m, w.m + rows, -INFINITY);
    std::fill(w.l, w.l + rows, 0.0f);
    std::fill(w.acc, w.acc + (size_t)rows * w.hdp, 0.0f);
}

// ---- register-blocked kernels over RB query rows -----------------------------------------

// s[r][t] = Σ_c q[r][c]·kc[c][t], t in [0, n_t) rounded up to VL
template <int RB>
OTT_INLINE void scores_rb(const float * q, int32_t hdp, int32_t hd, const float * kc, int32_t n_t, float * s) {
    for (int32_t t = 0; t < n_t; t += VL) {
        v16f a[RB];
        for (int r = 0; r < RB; ++r) a[r] = splat(0.0f);
        for (int32_t c = 0; c < hd; ++c) {
            const v16f k = load16(kc + (size_t)c * LD + t);
            for (int r = 0; r < RB; ++r) a[r] += q[(size_t)r * hdp + c] * k;
        }
        for (int r = 0; r < RB; ++r) store16(s + (size_t)r * LD + t, a[r]);
    }
}

// Where ott_rope_table.tile holds pair i's cosine at slot u (its sine VL further): runs of VL
// slots, in each run every pair's VL cosines then its VL sines.
OTT_INLINE size_t tile_at(int32_t half, int32_t i, int32_t u) {
    return ((size_t)(u / VL) * half + i) * 2 * VL + u % VL;
}

// s[r][u] = Σ_c q[r][c]·k[c][u] for the NT vectors V of slots u from t, k the keys kc rotated
// by RoPE at their slots (the angles of positions 0 .. 127, R.tile) as they are scored, kc
// left as it is. The rotated pairs of the queries come rotated back by the angle at the tile's
// first position p, pair-major (qp[i][r][2], rows rows a pair; the rest of the channels in q),
// so that the key at slot u meets R(p + u) = R(p)·R(u) exactly in real arithmetic. The tile's
// angles are one contiguous run per VL slots, which every tile reads: the table's rows at p + u
// are n_pos floats apart, so that with n_pos a multiple of 1024 a tile's 2·n_rot/2 rows fall
// in the same L1 set and evict each other.
template <class V, int RB, int NT>
OTT_INLINE void rope_scores_nt(const ott_rope_table & R, const float * qp, int32_t rows, const float * q, int32_t hdp,
                               int32_t hd, const float * kc, int32_t t, float * s) {
    constexpr int32_t W = sizeof(V) / sizeof(float);  // slots a vector
    const int32_t half  = R.n_rot / 2;
    const int32_t step = R.neox ? 1 : 2, other = R.neox ? half : 1;  // pair i: channels step·i, step·i + other
    const float * ang[NT];  // pair 0's cosines of vector j's slots; pair i's 2·VL·i further (tile_at)
    for (int j = 0; j < NT; ++j) ang[j] = R.tile + tile_at(half, 0, t + j * W);
    V a[NT][RB] {}, b[NT][RB] {};  // the pairs' first and second channels: two chains of FMAs a row
    const float *k = kc + t, *qi = qp;
    for (int32_t i = 0; i < half; ++i, k += step * LD, qi += 2 * rows) {
        for (int j = 0; j < NT; ++j) {
            const V x = load16<V>(k + j * W), y = load16<V>(k + other * LD + j * W);
            const V co = load16<V>(ang[j] + 2 * VL * i), si = load16<V>(ang[j] + 2 * VL * i + VL);
            const V xr = x * co - y * si, yr = x * si + y * co;
            for (int r = 0; r < RB; ++r) {
                a[j][r] += qi[2 * r] * xr;
                b[j][r] += qi[2 * r + 1] * yr;
            }
        }
    }
    for (int32_t c = 2 * half; c < hd; ++c) {  // channels RoPE leaves alone
        for (int j = 0; j < NT; ++j) {
            const V k = load16<V>(kc + (size_t)c * LD + t + j * W);
            for (int r = 0; r < RB; ++r) a[j][r] += q[(size_t)r * hdp + c] * k;
        }
    }
    for (int j = 0; j < NT; ++j) {
        for (int r = 0; r < RB; ++r) store16(s + (size_t)r * LD + t + j * W, a[j][r] + b[j][r]);
    }
}

// rope_scores_nt over t in [0, n_t) rounded up to a vector: on AVX-512 (V v16z) two 64-byte
// vectors of slots at a time, whose accumulators its 32 registers hold, so that a row's
// broadcast query pair serves both; elsewhere (V v16f) 8 slots at a time, whose accumulators
// and operands fit AVX2's 16 registers
template <class V, int RB>
OTT_INLINE void rope_scores_rb(const ott_rope_table & R, const float * qp, int32_t rows, const float * q, int32_t hdp,
                               int32_t hd, const float * kc, int32_t n_t, float * s) {
    int32_t t = 0;
    if constexpr (std::is_same_v<V, v16z>) {
        if constexpr (RB <= RB_MAX) {
            for (; t + 2 * VL <= n_t; t += 2 * VL) rope_scores_nt<V, RB, 2>(R, qp, rows, q, hdp, hd, kc, t, s);
        }
        for (; t < n_t; t += VL) rope_scores_nt<V, RB, 1>(R, qp, rows, q, hdp, hd, kc, t, s);
    } else {
        for (; t < n_t; t += VL / 2) rope_scores_nt<v8f, RB, 1>(R, qp, rows, q, hdp, hd, kc, t, s);
    }
}

// acc[r][c] += Σ_t p[r][t]·vc[t][c], c in [0, hdp)
template <int RB> OTT_INLINE void values_rb(const float * p, const float * vc, int32_t hdp, int32_t n_t, float * acc) {
    for (int32_t c = 0; c < hdp; c += VL) {
        v16f a[RB];
        for (int r = 0; r < RB; ++r) a[r] = load16(acc + (size_t)r * hdp + c);
        for (int32_t t = 0; t < n_t; ++t) {
            const v16f v = load16(vc + (size_t)t * hdp + c);
            for (int r = 0; r < RB; ++r) a[r] += p[(size_t)r * LD + t] * v;
        }
        for (int r = 0; r < RB; ++r) store16(acc + (size_t)r * hdp + c, a[r]);
    }
}

// Key rows [r0, r1) of one code width: row r's codes at codes + (r - r0)·row_bytes.
struct key_rows {
    int32_t r0, r1, bits;
    const uint8_t * codes;
    size_t row_bytes;
};

// The key rows of a head-block (key_axis 0) by code width: one run, or the tiers' three.
int32_t key_row_runs(const ott_kv_geom & g, const uint8_t * kcodes, key_rows * runs) {
    const int32_t edges[4] = { 0, g.n_hi, g.head_dim - g.n_lo, g.head_dim };
    int32_t n              = 0;
    for (int32_t i = 0; i < 3; ++i) {
        if (edges[i] == edges[i + 1]) continue;
        const int32_t bits = ott_kv_k_row_bits(&g, edges[i]);
        runs[n++]          = { edges[i], edges[i + 1], bits, kcodes + ott_kv_k_row_offset(&g, edges[i]),
                               (size_t)g.block * bits / 8 };
    }
    return n;
}

// f(std::integral_constant<int, B>) for the code width bits = B (1, 2, 4, else 8)
template <typename F> OTT_INLINE void with_code_width(int32_t bits, F f) {
    switch (bits) {
        case 1:  f(std::integral_constant<int, 1>()); break;
        case 2:  f(std::integral_constant<int, 2>()); break;
        case 4:  f(std::integral_constant<int, 4>()); break;
        default: f(std::integral_constant<int, 8>()); break;
    }
}

// s[r][t] += Σ_c qs[r][c]·code[c][t] for the NV·VL tokens from t of one key group, c over the
// rows of one run of BITS-bit codes (s: the group's first token ta)
template <class V, int NV, int RB, int BITS>
OTT_INLINE void scores_step(const float * qs, int32_t hdp, const key_rows & kr, int32_t ta, int32_t t, float * s) {
    V a[RB][NV];
    using L = lane_scale<V, BITS>;
    for (int r = 0; r < RB; ++r) {
        for (int v = 0; v < NV; ++v) a[r][v] = L::up(load16<V>(s + (size_t)r * LD + (t - ta) + v * VL));
    }
    const uint8_t * col = kr.codes + (size_t)t * BITS / 8;
    for (int32_t c = kr.r0; c < kr.r1; ++c) {
        V k[NV];
        for (int v = 0; v < NV; ++v) k[v] = codes16<BITS, V>(col + (c - kr.r0) * kr.row_bytes + v * VL * BITS / 8);
        for (int r = 0; r < RB; ++r) {
            for (int v = 0; v < NV; ++v) a[r][v] += qs[(size_t)r * hdp + c] * k[v];
        }
    }
    for (int r = 0; r < RB; ++r) {
        for (int v = 0; v < NV; ++v) store16(s + (size_t)r * LD + (t - ta) + v * VL, L::down(a[r][v]));
    }
}

// s[r][t] = qm[r] + Σ_c qs[r][c]·code[c][t] for the tokens [ta, tb) of one key group, c over
// the key rows of the n_runs runs, each run NV vectors of tokens at a time, then one
template <class V, int NV, int RB>
OTT_INLINE void scores_codes_rb(const float * qs, const float * qm, int32_t hdp, const key_rows * runs, int32_t n_runs,
                                int32_t ta, int32_t tb, float * s) {
    for (int r = 0; r < RB; ++r) std::fill(s + (size_t)r * LD, s + (size_t)r * LD + (tb - ta), qm[r]);
    for (int32_t i = 0; i < n_runs; ++i) {
        with_code_width(runs[i].bits, [&](auto B) __attribute__((always_inline)) {
            int32_t t = ta;
            for (; t + NV * VL <= tb; t += NV * VL) scores_step<V, NV, RB, B>(qs, hdp, runs[i], ta, t, s);
            for (; t < tb; t += VL) scores_step<V, 1, RB, B>(qs, hdp, runs[i], ta, t, s);
        });
    }
}

// acc[r][c] += mt[r] + Σ_t pw[r][t]·code[t][c] for the NV·VL channels from c of one value group
template <class V, int NV, int RB, int BITS>
OTT_INLINE void values_step(const float * pw, const float * mt, const uint8_t * vcodes, size_t vrow, int32_t n_t,
                            int32_t c, int32_t hdp, float * acc) {
    V a[RB][NV];
    using L = lane_scale<V, BITS>;
    for (int r = 0; r < RB; ++r) {
        for (int v = 0; v < NV; ++v) a[r][v] = L::up(load16<V>(acc + (size_t)r * hdp + c + v * VL) + mt[r]);
    }
    const uint8_t * col = vcodes + (size_t)c * BITS / 8;
    for (int32_t t = 0; t < n_t; ++t) {
        V x[NV];
        for (int v = 0; v < NV; ++v) x[v] = codes16<BITS, V>(col + t * vrow + v * VL * BITS / 8);
        for (int r = 0; r < RB; ++r) {
            for (int v = 0; v < NV; ++v) a[r][v] += pw[(size_t)r * LD + t] * x[v];
        }
    }
    for (int r = 0; r < RB; ++r) {
        for (int v = 0; v < NV; ++v) store16(acc + (size_t)r * hdp + c + v * VL, L::down(a[r][v]));
    }
}

// values_step over the channels [ca, cb) of one value group, NV vectors at a time, then one,
// for codes of `bits` bits
template <class V, int NV, int RB>
OTT_INLINE void values_codes_rb(const float * pw, const float * mt, const uint8_t * vcodes, size_t vrow, int32_t bits,
                                int32_t n_t, int32_t ca, int32_t cb, int32_t hdp, float * acc) {
    with_code_width(bits, [&](auto B) __attribute__((always_inline)) {
        int32_t c = ca;
        for (; c + NV * VL <= cb; c += NV * VL) values_step<V, NV, RB, B>(pw, mt, vcodes, vrow, n_t, c, hdp, acc);
        for (; c < cb; c += VL) values_step<V, 1, RB, B>(pw, mt, vcodes, vrow, n_t, c, hdp, acc);
    });
}

// Run kernel K<RB> over the rows in blocks of RB_MAX: f(rb_kernel, first row).
#define OTT_FOR_ROW_BLOCKS(rows, CALL)                                                                                 \
    for (int32_t r0 = 0; r0 < (rows); r0 += RB_MAX) {                                                                  \
        switch (std::min(RB_MAX, (rows) - r0)) {                                                                       \
            case 1:  CALL(1); break;                                                                                   \
            case 2:  CALL(2); break;                                                                                   \
            case 3:  CALL(3); break;                                                                                   \
            default: CALL(4); break;                                                                                   \
        }                                                                                                              \
    }

// max(-inf, x[0], .., x[n-1]); a NaN is skipped, as by std::max(m, x[t])
OTT_INLINE float max_row(const float * x, int32_t n) {
    v8f a = (v8f) {} - INFINITY, b = a;  // two chains of 8 lanes: the loop is not latency-bound
    int32_t t = 0;
    for (; t + VL <= n; t += VL) {
        const v16f v = load16(x + t);
        a            = v.lo > a ? v.lo : a;
        b            = v.hi > b ? v.hi : b;
    }
    a        = b > a ? b : a;
    float mx = -INFINITY;
    for (int i = 0; i < 8; ++i) mx = std::max(mx, a[i]);
    for (; t < n; ++t) mx = std::max(mx, x[t]);
    return mx;
}

// Σ a[i]·b[i] over i < n in two chains of 8 lanes (one chain of n dependent FMAs was a
// tenth of the attention's samples); the order of the sum is not the float64 reference's,
// whose attention budgets allow it.
OTT_INLINE float dot_row(const float * a, const float * b, int32_t n) {
    v8f s0 = {}, s1 = {};
    int32_t i = 0;
    for (; i + VL <= n; i += VL) {
        const v16f x = load16(a + i), y = load16(b + i);
        s0 += x.lo * y.lo;
        s1 += x.hi * y.hi;
    }
    s0 += s1;
    float s = 0.0f;
    for (int k = 0; k < 8; ++k) s += s0[k];
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

// Online softmax over a tile's scores w.s (n_t keys): masks, new max, rescaled sums and
// accumulators; w.s then holds the probabilities. dead: per key, 1 = invisible (or
// nullptr); causal: row r sees keys t < w.lim[r].
OTT_INLINE void softmax_tile(const attn_ws & w, int32_t rows, int32_t n_t, const uint8_t * dead, bool causal) {
    for (int32_t r = 0; r < rows; ++r) {
        float * s = w.s + (size_t)r * LD;
        if (dead) {
            for (int32_t t = 0; t < n_t; ++t) s[t] = dead[t] ? -INFINITY : s[t];
        }
        if (causal) {
            for (int32_t t = std::max(0, w.lim[r]); t < n_t; ++t) s[t] = -INFINITY;
        }
        const float mx = max_row(s, n_t);
        if (mx == -INFINITY) {  // nothing visible in this tile
            std::fill(s, s + n_t, 0.0f);
            continue;
        }
        const float m_new = std::max(w.m[r], mx);
        const float corr  = exp_nonpos(w.m[r] - m_new);
        float sum         = 0.0f;
        for (int32_t t = 0; t < n_t; ++t) {
            s[t] = exp_nonpos(s[t] - m_new);
            sum += s[t];
        }
        w.l[r] = w.l[r] * corr + sum;
        w.m[r] = m_new;
        if (corr != 1.0f) {
            float * acc = w.acc + (size_t)r * w.hdp;
            for (int32_t c = 0; c < w.hdp; ++c) acc[c] *= corr;
        }
    }
}

// One tile already in w.kc / w.vc (n_t keys): scores, softmax, values.
OTT_CLONES void attend_tile(const attn_ws & w, int32_t rows, int32_t n_t, const uint8_t * dead, bool causal) {
    for (int32_t c = 0; c < w.hd && n_t % VL; ++c) {  // finite lanes past n_t
        std::fill(w.kc + (size_t)c * LD + n_t, w.kc + (size_t)c * LD + (n_t + VL - 1) / VL * VL, 0.0f);
    }
#define OTT_SCORES(RB) scores_rb<RB>(w.q + (size_t)r0 * w.hdp, w.hdp, w.hd, w.kc, n_t, w.s + (size_t)r0 * LD)
    OTT_FOR_ROW_BLOCKS(rows, OTT_SCORES)
#undef OTT_SCORES
    softmax_tile(w, rows, n_t, dead, causal);
#define OTT_VALUES(RB) values_rb<RB>(w.s + (size_t)r0 * LD, w.vc, w.hdp, n_t, w.acc + (size_t)r0 * w.hdp)
    OTT_FOR_ROW_BLOCKS(rows, OTT_VALUES)
#undef OTT_VALUES
}

// x[0..n) in 16-bit fixed point for attn_vnni, q[i] = x[i]·2^e rounded (pairs (q[2i], q[2i+1])
// are its int32 words, little-endian), and the factor 2^-e back to x: the largest |x|·2^e in
// [2^14, 2^15], at most 32767. n even.
OTT_INLINE void fixed_pairs(const float * x, int32_t n, int16_t * q, float * scale) {
    v8f hi = {}, lo = {};  // lane-wise max and min (vector compares: the loop vectorises)
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v;
        std::memcpy(&v, x + i, sizeof v);
        hi = v > hi ? v : hi;
        lo = v < lo ? v : lo;
    }
    float mx = 0.0f;
    for (int k = 0; k < 8; ++k) mx = std::max(mx, std::max(hi[k], -lo[k]));
    for (; i < n; ++i) mx = std::max(mx, std::fabs(x[i]));
    int e = 0;
    if (mx > 0.0f) {
        uint32_t bits;
        std::memcpy(&bits, &mx, sizeof bits);
        const uint32_t biased = bits >> 23;  // mx >= 0
        if (biased != 0 && biased != 255)
            e = (int)biased - 126;  // mx < 2^e, as frexp gives it for a normal mx
        else
            std::frexp(mx, &e);
        e = std::max(-100, std::min(100, 15 - e));
    }
    const float f = pow2f(e);
    for (i = 0; i < n; ++i) q[i] = (int16_t)std::max(-32767.0f, std::min(32767.0f, std::nearbyint(x[i] * f)));
    *scale = pow2f(-e);
}

// Whether attn_vnni serves a head-block's codes: key rows and values of 1, 2 or 4 bits, each run
// of key rows (tiers) an even number of rows (asked by the AVX-512 version alone).
[[maybe_unused]] bool vnni_fits(const ott_kv_geom & g) {
    return ott_vnni_enabled() && g.bits_k != 8 && g.bits_v != 8 && g.head_dim <= 256 && g.n_hi % 2 == 0 &&
           g.n_lo % 2 == 0;
}

// s[r][t - ta] = qm[r] + Σ_c qs[r][c]·code[c][t] for the tokens [ta, tb) of one key group, c over
// the key rows of the n_runs runs, by attn_vnni (each run's qs in a fixed point of its own: the
// key tiers' scales differ by their code widths)
OTT_INLINE void scores_vnni(const attn_ws & w, int32_t rows, const key_rows * runs, int32_t n_runs, int32_t ta,
                            int32_t tb, float * s) {
    int16_t * q16 = (int16_t *)w.tmp;  // [rows][head_dim]
    for (int32_t r = 0; r < rows; ++r) std::fill(s + (size_t)r * LD, s + (size_t)r * LD + (tb - ta), w.qm[r]);
    for (int32_t i = 0; i < n_runs; ++i) {
        const key_rows & kr = runs[i];
        float scale[FUSED_ROWS];
        for (int32_t r = 0; r < rows; ++r) {
            fixed_pairs(w.qs + (size_t)r * w.hdp + kr.r0, kr.r1 - kr.r0, q16 + (size_t)r * w.hd + kr.r0, &scale[r]);
        }
        for (int32_t r0 = 0; r0 < rows; r0 += RB_MAX) {
            ott_vnni_pair_dots(kr.bits, kr.codes + (size_t)ta * kr.bits / 8, kr.row_bytes, (kr.r1 - kr.r0) / 2, tb - ta,
                               q16 + (size_t)r0 * w.hd + kr.r0, w.hd, scale + r0, std::min(RB_MAX, rows - r0),
                               s + (size_t)r0 * LD, LD);
        }
    }
}

// acc[r][c] += mt[r] + Σ_t pw[r][t]·code[t][c] for the channels [ca, cb) of one value group and
// the n_t tokens of the codes from vcodes (row stride vrow), by attn_vnni
OTT_INLINE void values_vnni(const attn_ws & w, int32_t rows, const uint8_t * vcodes, size_t vrow, int32_t bits,
                            int32_t n_t, int32_t ca, int32_t cb) {
    int16_t * p16 = (int16_t *)w.tmp;  // [rows][n_t]
    float scale[FUSED_ROWS];
    for (int32_t r = 0; r < rows; ++r) {
        fixed_pairs(w.pw + (size_t)r * LD, n_t, p16 + (size_t)r * n_t, &scale[r]);
        float * acc = w.acc + (size_t)r * w.hdp;
        for (int32_t c = ca; c < cb; ++c) acc[c] += w.mt[r];
    }
    for (int32_t r0 = 0; r0 < rows; r0 += RB_MAX) {
        ott_vnni_pair_dots(bits, vcodes + (size_t)ca * bits / 8, vrow, n_t / 2, cb - ca, p16 + (size_t)r0 * n_t, n_t,
                           scale + r0, std::min(RB_MAX, rows - r0), w.acc + (size_t)r0 * w.hdp + ca, w.hdp);
    }
}

// Key rows r0 .. r1-1 of one run (BITS-bit codes, parameters sc[r], mn[r]) dequantized into
// kc[channel][t] (rows of LD floats) for the n_t slots from t0, a multiple of VL each, VL at
// a time in vectors V (codes16's lane factors folded into the scale); channel = order[r], or
// r without tiers.
template <class V, int BITS>
OTT_INLINE void dequant_key_rows(const key_rows & kr, const uint8_t * order, const float * sc, const float * mn,
                                 int32_t t0, int32_t n_t, float * kc) {
    static constexpr float ONES[VL] = { 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1 };
    for (int32_t r = kr.r0; r < kr.r1; ++r) {
        const uint8_t * row = kr.codes + (size_t)(r - kr.r0) * kr.row_bytes + (size_t)t0 * BITS / 8;
        float * kt          = kc + (size_t)(order ? order[r] : r) * LD;
        const V scale       = lane_scale<V, BITS>::down(sc[r] * load16<V>(ONES));
        const float m       = mn[r];
        // a pointer each for the codes and the keys: (t·BITS)/8 of a signed t cost three
        // instructions an iteration
        for (const float * end = kt + n_t; kt < end; kt += VL, row += VL * BITS / 8)
            store16(kt, codes16<BITS, V>(row) * scale + m);
    }
}

// Slots t0 .. t0+n_t-1 of a head-block straight from the codes (fused path; group_k,
// group_v multiples of VL, n_t a multiple of VL); the kernels in vectors V, NV per iteration,
// or (VNNI) attn_vnni's integer dot products. Keys cached before RoPE (rope non-null; slot 0
// at position pos0) are dequantized and rotated first, their scores taken in float.
template <class V, int NV, bool VNNI = false>
OTT_INLINE void attend_codes_v(const ott_kv_config & cfg, const uint8_t * hb, int32_t t0, int32_t n_t,
                               const attn_ws & w, int32_t rows, const uint8_t * dead, const ott_rope_table * rope,
                               int32_t pos0) {
    const ott_kv_geom & g         = cfg.geom;
    const ott_kv_block_layout & L = cfg.layout;
    const int32_t hd = g.head_dim, hdp = w.hdp, gk = g.group_k, gv = g.group_v, n_gv = hd / gv;
    key_rows runs[3];
    const int32_t n_runs  = key_row_runs(g, hb + L.k_codes, runs);
    const uint8_t * order = ott_kv_tiered(&g) ? hb + L.k_order : nullptr;  // channel of each key row

    if (rope) {  // keys before RoPE: kc[channel][t] = code·scale + min, a run of key rows at a time
        // qs[i][r] = the pair i of R(p)ᵀ·q[r], the rows rotated back by the angle at the tile's
        // first position p, pair by pair so that a pair's rows are adjacent
        const int32_t half = rope->n_rot / 2, p = pos0 + t0;
        const int32_t step = rope->neox ? 1 : 2, other = rope->neox ? half : 1;
        for (int32_t i = 0; i < half; ++i) {
            const float co = rope->cs[(size_t)i * rope->n_pos + p], si = rope->cs[(size_t)(half + i) * rope->n_pos + p];
            for (int32_t r = 0; r < rows; ++r) {
                const float *x = w.q + (size_t)r * hdp + step * i, a = x[0], b = x[other];
                float * y = w.qs + ((size_t)i * rows + r) * 2;
                y[0]      = co * a + si * b;
                y[1]      = co * b - si * a;
            }
        }
        for (int32_t ta = t0; ta < t0 + n_t;) {
            const int32_t gi = ta / gk, tb = std::min(t0 + n_t, (gi + 1) * gk);
            params_f32(g, hb + L.k_scale, hb + L.k_min, g.bits_k, (size_t)gi * hd, hd, w.ksc, w.kmn);
            for (int32_t i = 0; i < n_runs; ++i) {
                with_code_width(runs[i].bits, [&](auto B) {
                    dequant_key_rows<V, B()>(runs[i], order, w.ksc, w.kmn, ta, tb - ta, w.kc + (ta - t0));
                });
            }
            ta = tb;
        }
        // rotated at their positions as they are scored, in float; AVX-512's 32 registers
        // hold the accumulators of up to FUSED_ROWS rows, so that each pair rotates once
#define OTT_SCORES(RB)                                                                                                 \
    rope_scores_rb<V, RB>(*rope, w.qs + 2 * r0, rows, w.q + (size_t)r0 * hdp, hdp, hd, w.kc, n_t, w.s + (size_t)r0 * LD)
        bool all_rows = false;
        if constexpr (std::is_same_v<V, v16z>) {
            static_assert(FUSED_ROWS == 8, "rows 5 .. 8 below");
            all_rows = rows > RB_MAX;
            if (all_rows) {
                const int32_t r0 = 0;
                switch (rows) {
                    case 5:  OTT_SCORES(5); break;
                    case 6:  OTT_SCORES(6); break;
                    case 7:  OTT_SCORES(7); break;
                    default: OTT_SCORES(8); break;
                }
            }
        }
        if (!all_rows) OTT_FOR_ROW_BLOCKS(rows, OTT_SCORES)
#undef OTT_SCORES
    } else {
        // scores, one key group segment at a time: qs = q·scale, qm = q·min (per key row)
        for (int32_t ta = t0; ta < t0 + n_t;) {
            const int32_t gi = ta / gk, tb = std::min(t0 + n_t, (gi + 1) * gk);
            params_f32(g, hb + L.k_scale, hb + L.k_min, g.bits_k, (size_t)gi * hd, hd, w.ksc, w.kmn);
            for (int32_t r = 0; r < rows; ++r) {
                const float * q = w.q + (size_t)r * hdp;
                float * qs      = w.qs + (size_t)r * hdp;
                if (order) {  // q in key-row order, then scaled in place
                    for (int32_t c = 0; c < hd; ++c) qs[c] = q[order[c]];
                    q = qs;
                }
                w.qm[r] = dot_row(q, w.kmn, hd);
                for (int32_t c = 0; c < hd; ++c) qs[c] = q[c] * w.ksc[c];
            }
#define OTT_SCORES(RB)                                                                                                 \
    scores_codes_rb<V, NV, RB>(w.qs + (size_t)r0 * hdp, w.qm + r0, hdp, runs, n_runs, ta, tb,                          \
                               w.s + (size_t)r0 * LD + (ta - t0))
            if constexpr (VNNI) {
                scores_vnni(w, rows, runs, n_runs, ta, tb, w.s + (ta - t0));
            } else {
                OTT_FOR_ROW_BLOCKS(rows, OTT_SCORES)
            }
#undef OTT_SCORES
            ta = tb;
        }
    }
    softmax_tile(w, rows, n_t, dead, false);

    // values, one value group at a time: pw = p·scale, mt = Σ p·min
    params_f32(g, hb + L.v_scale, v_min_of(g, L, hb), g.bits_v, (size_t)t0 * n_gv, (int64_t)n_t * n_gv, w.vsc, w.vmn);
    const uint8_t * vcodes = hb + L.v_codes + (size_t)t0 * ott_kv_v_row_bytes(&g);
    // pw[r][t] = p[r][t]·vs[t·stride], mt[r] = Σ_t p[r][t]·vm[t·stride]: contiguous (it
    // vectorises) when a token has one value group
    auto weigh = [&](const float * vs, const float * vm, auto stride) __attribute__((always_inline)) {
        for (int32_t r = 0; r < rows; ++r) {
            const float * p = w.s + (size_t)r * LD;
            float * pw      = w.pw + (size_t)r * LD;
            if constexpr (std::is_same_v<decltype(stride), std::integral_constant<int32_t, 1>>) {
                w.mt[r] = dot_row(p, vm, n_t);
                for (int32_t t = 0; t < n_t; ++t) pw[t] = p[t] * vs[t];
            } else {
                float mt = 0.0f;
                for (int32_t t = 0; t < n_t; ++t) {
                    pw[t] = p[t] * vs[t * stride];
                    mt += p[t] * vm[t * stride];
                }
                w.mt[r] = mt;
            }
        }
    };
    for (int32_t gi = 0; gi < n_gv; ++gi) {
        if (n_gv == 1) {
            weigh(w.vsc, w.vmn, std::integral_constant<int32_t, 1>());
        } else {
            weigh(w.vsc + gi, w.vmn + gi, n_gv);
        }
#define OTT_VALUES(RB)                                                                                                 \
    values_codes_rb<V, NV, RB>(w.pw + (size_t)r0 * LD, w.mt + r0, vcodes, ott_kv_v_row_bytes(&g), g.bits_v, n_t,       \
                               gi * gv, (gi + 1) * gv, hdp, w.acc + (size_t)r0 * hdp)
        if constexpr (VNNI) {
            values_vnni(w, rows, vcodes, ott_kv_v_row_bytes(&g), g.bits_v, n_t, gi * gv, (gi + 1) * gv);
        } else {
            OTT_FOR_ROW_BLOCKS(rows, OTT_VALUES)
        }
#undef OTT_VALUES
    }
}

// attend_codes_v in 64-byte vectors, two per iteration, where AVX-512 runs; in halves of 8
// floats, one per iteration, elsewhere
#if OTT_VERSIONS
OTT_V4 void attend_codes(const ott_kv_config & cfg, const uint8_t * hb, int32_t t0, int32_t n_t, const attn_ws & w,
                         int32_t rows, const uint8_t * dead, const ott_rope_table * rope, int32_t pos0) {
    if (vnni_fits(cfg.geom)) {
        attend_codes_v<v16z, 2, true>(cfg, hb, t0, n_t, w, rows, dead, rope, pos0);
    } else {
        attend_codes_v<v16z, 2>(cfg, hb, t0, n_t, w, rows, dead, rope, pos0);
    }
}

OTT_V3 void attend_codes(const ott_kv_config & cfg, const uint8_t * hb, int32_t t0, int32_t n_t, const attn_ws & w,
                         int32_t rows, const uint8_t * dead, const ott_rope_table * rope, int32_t pos0) {
    attend_codes_v<v16f, 1>(cfg, hb, t0, n_t, w, rows, dead, rope, pos0);
}

OTT_BASELINE
#endif
void attend_codes(const ott_kv_config & cfg, const uint8_t * hb, int32_t t0, int32_t n_t, const attn_ws & w,
                  int32_t rows, const uint8_t * dead, const ott_rope_table * rope, int32_t pos0) {
    attend_codes_v<v16f, 1>(cfg, hb, t0, n_t, w, rows, dead, rope, pos0);
}

// ---- tiles: fill w.kc / w.vc with n_t keys and values ------------------------------------

void dequant_channels(const ott_kv_config & cfg, const uint8_t * hb, int32_t t0, int32_t n_t, const attn_ws & w);
void dequant_rows(const ott_kv_geom & g, const uint8_t * scale, const uint8_t * mn, const uint8_t * codes, int32_t bits,
                  int32_t group, int32_t t0, int32_t n_t, float * out, float * psc, float * pmn, int64_t ld);
void keys_from_tmp(int32_t n_t, const attn_ws & w);

// Slots t0 .. t0+n_t-1 of a head-block, dequantised (materialised path).
void dequant_tile(const ott_kv_config & cfg, const uint8_t * hb, int32_t t0, int32_t n_t, const attn_ws & w) {
    const ott_kv_geom & g         = cfg.geom;
    const ott_kv_block_layout & L = cfg.layout;
    if (g.key_axis) {
        // per-token keys: rows [t][c] into w.tmp, then transposed into w.kc
        dequant_rows(g, hb + L.k_scale, hb + L.k_min, hb + L.k_codes, g.bits_k, g.group_k, t0, n_t, w.tmp, w.ksc, w.kmn,
                     w.hdp);
        keys_from_tmp(n_t, w);
    } else {
        dequant_channels(cfg, hb, t0, n_t, w);
    }
    // values: vc[t][c] = code·scale[t][g(c)] + min[t][g(c)]
    dequant_rows(g, hb + L.v_scale, v_min_of(g, L, hb), hb + L.v_codes, g.bits_v, g.group_v, t0, n_t, w.vc, w.vsc,
                 w.vmn, w.hdp);
}

// Keys grouped per channel: kc[c][t] = code·scale[g(t)][c] + min[g(t)][c] for slots t0 ..
// (with key tiers, key row r and its parameters belong to channel k_order[r])
void dequant_channels(const ott_kv_config & cfg, const uint8_t * hb, int32_t t0, int32_t n_t, const attn_ws & w) {
    const ott_kv_geom & g         = cfg.geom;
    const ott_kv_block_layout & L = cfg.layout;
    const int32_t hd = g.head_dim, gk = g.group_k;
    const int32_t g0 = t0 / gk, g1 = (t0 + n_t - 1) / gk + 1;
    params_f32(g, hb + L.k_scale, hb + L.k_min, 0, (size_t)g0 * hd, (int64_t)(g1 - g0) * hd, w.ksc, w.kmn);
    const uint8_t * order = ott_kv_tiered(&g) ? hb + L.k_order : nullptr;  // channel of each key row
    for (int32_t c = 0; c < hd; ++c) {                                     // c: key row
        const int32_t bits = ott_kv_k_row_bits(&g, c);
        float * kt         = w.kc + (size_t)(order ? order[c] : c) * LD;
        unpack_codes(hb + L.k_codes + ott_kv_k_row_offset(&g, c) + (size_t)t0 * bits / 8, n_t, bits, kt);
        for (int32_t gi = g0; gi < g1; ++gi) {
            const int32_t ts = std::max(t0, gi * gk) - t0, te = std::min(t0 + n_t, (gi + 1) * gk) - t0;
            const float sc = w.ksc[(size_t)(gi - g0) * hd + c], mn = w.kmn[(size_t)(gi - g0) * hd + c];
            for (int32_t t = ts; t < te; ++t) kt[t] = kt[t] * sc + mn;
        }
    }
}

// Rows grouped per token (values; keys with key_axis 1): out[t][c] = code·scale[t][g(c)] +
// min[t][g(c)] for slots t0 .. t0+n_t-1, rows of ld floats; psc, pmn: room for the
// [n_t][head_dim/group] parameters.
void dequant_rows(const ott_kv_geom & g, const uint8_t * scale, const uint8_t * mn, const uint8_t * codes, int32_t bits,
                  int32_t group, int32_t t0, int32_t n_t, float * out, float * psc, float * pmn, int64_t ld) {
    const int32_t hd = g.head_dim, n_g = hd / group;
    params_f32(g, scale, mn, bits, (size_t)t0 * n_g, (int64_t)n_t * n_g, psc, pmn);
    const size_t row = (size_t)hd * bits / 8;
    for (int32_t t = 0; t < n_t; ++t) {
        float * x = out + (size_t)t * ld;
        unpack_codes(codes + (size_t)(t0 + t) * row, hd, bits, x);
        for (int32_t gi = 0; gi < n_g; ++gi) {
            const float sc = psc[t * n_g + gi], m = pmn[t * n_g + gi];
            for (int32_t c = gi * group; c < (gi + 1) * group; ++c) x[c] = x[c] * sc + m;
        }
    }
}

// Transpose rows [n_t][hdp] in w.tmp into w.kc.
void keys_from_tmp(int32_t n_t, const attn_ws & w) {
    for (int32_t t = 0; t < n_t; ++t) {
        const float * row = w.tmp + (size_t)t * w.hdp;
        for (int32_t c = 0; c < w.hd; ++c) w.kc[(size_t)c * LD + t] = row[c];
    }
}

// n_t fp16 rows of a store.
void f16_tile(const ott_fp16 * k, const ott_fp16 * v, int32_t n_t, const attn_ws & w) {
    for (int32_t t = 0; t < n_t; ++t) {
        ggml_cpu_fp16_to_fp32((const ggml_fp16_t *)k + (size_t)t * w.hd, w.tmp + (size_t)t * w.hdp, w.hd);
        ggml_cpu_fp16_to_fp32((const ggml_fp16_t *)v + (size_t)t * w.hd, w.vc + (size_t)t * w.hdp, w.hd);
    }
    keys_from_tmp(n_t, w);
}

// n_t rows of the chunk's own F32 K/V (tokens tok0 .. of the ubatch, KV head h), rounded
// to fp16 as the window will store them.
void chunk_tile(const ggml_tensor * k, const ggml_tensor * v, int32_t tok0, int32_t h, int32_t n_t, const attn_ws & w) {
    ggml_fp16_t h16[1024];
    for (int32_t t = 0; t < n_t; ++t) {
        const float * kr =
            (const float *)((const char *)k->data + (size_t)(tok0 + t) * k->nb[2] + (size_t)h * k->nb[1]);
        const float * vr =
            (const float *)((const char *)v->data + (size_t)(tok0 + t) * v->nb[2] + (size_t)h * v->nb[1]);
        for (int32_t c0 = 0; c0 < w.hd; c0 += 1024) {
            const int32_t n = std::min(w.hd - c0, 1024);
            ggml_cpu_fp32_to_fp16(kr + c0, h16, n);
            ggml_cpu_fp16_to_fp32(h16, w.tmp + (size_t)t * w.hdp + c0, n);
            ggml_cpu_fp32_to_fp16(vr + c0, h16, n);
            ggml_cpu_fp16_to_fp32(h16, w.vc + (size_t)t * w.hdp + c0, n);
        }
    }
    keys_from_tmp(n_t, w);
}

// ---- KVQuant tiles (kv/kv_layout.h: KVQuant head-blocks; kvq_attn_cpu.h) ---------------

// Keys of a tile (w.kc, n_t keys) rotated by RoPE, key t at position pos[t] (pos0 + t when
// pos is NULL, the table's rows read in place); each pair rotated along t.
OTT_CLONES void rope_tile(const ott_rope_table & R, const int32_t * pos, int32_t pos0, int32_t n_t, const attn_ws & w) {
    const int32_t half = R.n_rot / 2;
    for (int32_t i = 0; i < half; ++i) {
        const float * cos_i = R.cs + (size_t)i * R.n_pos;
        const float * sin_i = R.cs + (size_t)(half + i) * R.n_pos;
        const float *co = cos_i + pos0, *si = sin_i + pos0;
        if (pos) {  // gathered
            for (int32_t t = 0; t < n_t; ++t) {
                w.rc[t] = cos_i[pos[t]];
                w.rs[t] = sin_i[pos[t]];
            }
            co = w.rc;
            si = w.rs;
        }
        float * a = w.kc + (size_t)(R.neox ? i : 2 * i) * LD;
        float * b = w.kc + (size_t)(R.neox ? i + half : 2 * i + 1) * LD;
        for (int32_t t = 0; t < n_t; ++t) {
            const float x = a[t], y = b[t];
            a[t] = x * co[t] - y * si[t];
            b[t] = x * si[t] + y * co[t];
        }
    }
}

// Entries code[j] of a table of 2^BITS floats held in lo (levels 0..7) and hi (8..15)
template <int BITS> OTT_INLINE v8f lookup(v8f lo, v8f hi, v8u code) {
    if constexpr (BITS <= 3) return __builtin_shuffle(lo, (v8i)code);
    return __builtin_shuffle(lo, hi, (v8i)code);
}

// A codebook of 2^BITS levels in two vectors of 8 (levels 0..7, 8..15; unused lanes 0)
template <int BITS> OTT_INLINE void load_levels(const float * levels, v8f & lo, v8f & hi) {
    lo = hi = (v8f) {};
    std::memcpy(&lo, levels, sizeof(float) * std::min(8, 1 << BITS));
    if constexpr (BITS == 4) std::memcpy(&hi, levels + 8, sizeof hi);
}

// Slots t0 .. t0+n_t-1 of a KVQuant head-block dequantised into keys kc [head_dim][LD]
// (channel-major) and values vc [n_t][hdp]: the codebook level of each code times its scale
// plus zero, the sparse entries put back. With rope (keys cached before RoPE) the keys come
// out rotated at their positions pos0 + t: each pair of channels is dequantised and rotated
// at once, and a sparse key corrects its pair by its rotated difference to the code's level.
// n_t a multiple of 8 and at most KEY_TILE (the tile's angles, rope->tile).
template <int BK, int BV>
OTT_INLINE void kvq_dequant(const ott_kvq_geom & g, const ott_kvq_tables & tab, const ott_rope_table * rope,
                            const uint8_t * hb, int32_t t0, int32_t pos0, int32_t n_t, float * kc, float * vc,
                            int32_t hdp) {
    const ott_kvq_block_layout L = ott_kvq_block_layout_of(&g);
    const int32_t hd = g.head_dim, hd8 = hd / 8 * 8, half = rope ? rope->n_rot / 2 : 0;
    const size_t k_row = (size_t)g.block * BK / 8, v_row = (size_t)hd * BV / 8;
    v8f lk_lo, lk_hi, lv_lo, lv_hi;
    load_levels<BK>(tab.levels_k, lk_lo, lk_hi);
    load_levels<BV>(tab.levels_v, lv_lo, lv_hi);
    auto k_codes = [&](int32_t c) { return hb + L.k_codes + (size_t)c * k_row + (size_t)t0 * BK / 8; };
    auto pair_of = [&](int32_t i, int32_t & ca, int32_t & cb) {
        ca = rope->neox ? i : 2 * i;
        cb = rope->neox ? i + half : 2 * i + 1;
    };
    for (int32_t i = 0; i < half; ++i) {  // rotated pairs
        int32_t ca, cb;
        pair_of(i, ca, cb);
        const v8f a_lo = lk_lo * tab.k_scale[ca] + tab.k_zero[ca], a_hi = lk_hi * tab.k_scale[ca] + tab.k_zero[ca];
        const v8f b_lo = lk_lo * tab.k_scale[cb] + tab.k_zero[cb], b_hi = lk_hi * tab.k_scale[cb] + tab.k_zero[cb];
        const uint8_t *ra = k_codes(ca), *rb = k_codes(cb);
        // the angle at pos0 + t as the angle at pos0 plus the one at t: the tile's own table
        // (rope_scores_nt says why), which every tile reads, and one entry at pos0 (float32
        // rounding; the table's rows at pos0 + t would be read from far apart)
        const float c0 = rope->cs[(size_t)i * rope->n_pos + pos0],
                    s0 = rope->cs[(size_t)(half + i) * rope->n_pos + pos0];
        float *ka = kc + (size_t)ca * LD, *kb = kc + (size_t)cb * LD;
        for (int32_t t = 0; t < n_t; t += 8) {
            const v8f a = lookup<BK>(a_lo, a_hi, codes8<BK>(ra + t * BK / 8));
            const v8f b = lookup<BK>(b_lo, b_hi, codes8<BK>(rb + t * BK / 8));
            v8f ct, st;
            const float * at = rope->tile + tile_at(half, i, t);
            std::memcpy(&ct, at, sizeof ct);
            std::memcpy(&st, at + VL, sizeof st);
            v8f c, sn;
            compose_angles(c0, s0, ct, st, c, sn);
            const v8f x = a * c - b * sn, y = a * sn + b * c;
            std::memcpy(ka + t, &x, sizeof x);
            std::memcpy(kb + t, &y, sizeof y);
        }
    }
    for (int32_t c = 2 * half; c < hd; ++c) {  // channels not rotated: the levels as keys of channel c
        const v8f lo = lk_lo * tab.k_scale[c] + tab.k_zero[c], hi = lk_hi * tab.k_scale[c] + tab.k_zero[c];
        const uint8_t * row = k_codes(c);
        float * kt          = kc + (size_t)c * LD;
        for (int32_t t = 0; t < n_t; t += 8) {
            const v8f x = lookup<BK>(lo, hi, codes8<BK>(row + t * BK / 8));
            std::memcpy(kt + t, &x, sizeof x);
        }
    }
    for (int32_t t = 0; t < n_t; ++t) {
        ott_fp16 z16, s16;
        std::memcpy(&z16, hb + L.v_zero + 2 * (size_t)(t0 + t), 2);
        std::memcpy(&s16, hb + L.v_scale + 2 * (size_t)(t0 + t), 2);
        const float sc = ott_fp16_to_fp32_ref(s16), z = ott_fp16_to_fp32_ref(z16);
        const v8f lo = lv_lo * sc + z, hi = lv_hi * sc + z;
        const uint8_t * row = hb + L.v_codes + (size_t)(t0 + t) * v_row;
        float * vt          = vc + (size_t)t * hdp;
        for (int32_t c = 0; c < hd8; c += 8) {
            const v8f x = lookup<BV>(lo, hi, codes8<BV>(row + c * BV / 8));
            std::memcpy(vt + c, &x, sizeof x);
        }
        if (hd8 < hd) {  // head_dim not a multiple of 8: the last codes one by one
            float table[16];
            std::memcpy(table, &lo, sizeof lo);
            std::memcpy(table + 8, &hi, sizeof hi);
            for (int32_t c = hd8; c < hd; ++c) vt[c] = table[ott_kvq_code_at(row, c, BV, v_row)];
        }
    }
    const int32_t first = t0 * hd, end = (t0 + n_t) * hd;  // sparse indices t·head_dim + c in the tile
    for (int32_t j = 0; j < g.n_out; ++j) {
        uint16_t ik, iv;
        ott_fp16 xk, xv;
        std::memcpy(&ik, hb + L.k_out_idx + 2 * (size_t)j, 2);
        std::memcpy(&xk, hb + L.k_out_val + 2 * (size_t)j, 2);
        std::memcpy(&iv, hb + L.v_out_idx + 2 * (size_t)j, 2);
        std::memcpy(&xv, hb + L.v_out_val + 2 * (size_t)j, 2);
        if (ik >= first && ik < end) {
            const int32_t c = ik % hd, t = ik / hd - t0;
            if (c >= 2 * half) {
                kc[(size_t)c * LD + t] = ott_fp16_to_fp32_ref(xk);
            } else {  // the pair of channel c, rotated: add the rotated difference to the code's level
                const int32_t i = rope->neox ? c % half : c / 2;
                int32_t ca, cb;
                pair_of(i, ca, cb);
                const float lev =
                    tab.levels_k[ott_kvq_code_at(k_codes(c), t, BK, k_row - (size_t)t0 * BK / 8)] * tab.k_scale[c] +
                    tab.k_zero[c];
                const float d  = ott_fp16_to_fp32_ref(xk) - lev;
                const float co = rope->cs[(size_t)i * rope->n_pos + pos0 + t];
                const float si = rope->cs[(size_t)(half + i) * rope->n_pos + pos0 + t];
                kc[(size_t)ca * LD + t] += c == ca ? d * co : -d * si;
                kc[(size_t)cb * LD + t] += c == ca ? d * si : d * co;
            }
        }
        if (iv >= first && iv < end) vc[(size_t)(iv / hd - t0) * hdp + iv % hd] = ott_fp16_to_fp32_ref(xv);
    }
}

// f(std::integral_constant<int, B>) for a KVQuant code width bits = B (2, 3 or 4)
template <typename F> OTT_INLINE void with_kvq_width(int32_t bits, F f) {
    switch (bits) {
        case 2:  f(std::integral_constant<int, 2>()); break;
        case 3:  f(std::integral_constant<int, 3>()); break;
        default: f(std::integral_constant<int, 4>()); break;
    }
}

// The `bytes` of a head-block fetched into cache ahead of its reads, a line at a time: blocks
// are allocations of their own, where the hardware prefetcher's runs end.
OTT_INLINE void prefetch_head_block(const uint8_t * hb, uint32_t bytes) {
    for (uint32_t o = 0; o < bytes; o += 64) __builtin_prefetch(hb + o);
}

// n KVQuant head-blocks hbs[0..n) of consecutive slots, slot 0 of the first at position pos0:
// dequantised (keys rotated when rope is non-NULL: keys cached before RoPE) as many blocks
// to a tile as it holds, or a block in several tiles, each tile then attended by every row.
OTT_CLONES void attend_kvq_blocks(const ott_kvq_geom & g, const ott_kvq_tables & tab, const ott_rope_table * rope,
                                  const uint8_t * const * hbs, int32_t n, int32_t pos0, const attn_ws & w,
                                  int32_t rows) {
    auto dequant = [&](const uint8_t * hb, int32_t t0, int32_t pos, int32_t n_t,
                       int32_t col) __attribute__((always_inline)) {
        with_kvq_width(g.bits_k, [&](auto BK) __attribute__((always_inline)) {
            with_kvq_width(g.bits_v, [&](auto BV) __attribute__((always_inline)) {
                kvq_dequant<BK, BV>(g, tab, rope, hb, t0, pos, n_t, w.kc + col, w.vc + (size_t)col * w.hdp, w.hdp);
            });
        });
    };
    const int32_t per_tile  = std::max(1, KEY_TILE / g.block);
    const uint32_t hb_bytes = ott_kvq_block_layout_of(&g).size;
    for (int32_t b = 0; b < n;) {
        if (g.block > KEY_TILE) {
            for (int32_t t0 = 0; t0 < g.block; t0 += KEY_TILE) {
                const int32_t n_t = std::min(KEY_TILE, g.block - t0);
                dequant(hbs[b], t0, pos0 + b * g.block + t0, n_t, 0);
                attend_tile(w, rows, n_t, nullptr, false);
            }
            ++b;
            continue;
        }
        const int32_t k = std::min(per_tile, n - b);
        for (int32_t j = b + k; j < std::min(n, b + 2 * k); ++j)
            prefetch_head_block(hbs[j], hb_bytes);  // the next tile's, while this one is read
        for (int32_t j = 0; j < k; ++j) dequant(hbs[b + j], 0, pos0 + (b + j) * g.block, g.block, j * g.block);
        attend_tile(w, rows, k * g.block, nullptr, false);
        b += k;
    }
}

// Head-blocks 0 .. n-1 of a KVQuant store (head_block(j): block j's bytes), slot 0 of block 0
// at position pos0, through attend_kvq_blocks in runs of consecutive blocks.
template <typename F>
void attend_kvq_store(const ott_kvq_geom & g, const ott_kvq_tables & tab, const ott_rope_table * rope, int32_t n,
                      int32_t pos0, const attn_ws & w, int32_t rows, F head_block) {
    const uint8_t * hbs[KEY_TILE / 8];
    for (int32_t b0 = 0; b0 < n; b0 += KEY_TILE / 8) {
        const int32_t k = std::min(KEY_TILE / 8, n - b0);
        for (int32_t j = 0; j < k; ++j) hbs[j] = head_block(b0 + j);
        attend_kvq_blocks(g, tab, rope, hbs, k, pos0 + b0 * g.block, w, rows);
    }
}

// Every tile of an fp16 store of n rows; with rope the keys are rotated by RoPE at their
// positions, row i at pos[i] (pos0 + i when pos is null).
void attend_f16_store(const attn_ws & w, int32_t rows, const ott_fp16 * k, const ott_fp16 * v, int32_t n,
                      const ott_rope_table * rope, int32_t pos0, const int32_t * pos = nullptr) {
    for (int32_t t0 = 0; t0 < n; t0 += KEY_TILE) {
        const int32_t n_t = std::min(KEY_TILE, n - t0);
        f16_tile(k + (size_t)t0 * w.hd, v + (size_t)t0 * w.hd, n_t, w);
        if (rope) rope_tile(*rope, pos ? pos + t0 : nullptr, pos0 + t0, n_t, w);
        attend_tile(w, rows, n_t, nullptr, false);
    }
}

// w.dead[t] = bit t0 + t of a head-block's mask (1: the token moved to the pool), t in
// [0, n_t), t0 a multiple of 8; false, and dead left as it is, when no bit of the tile is set
bool tile_dead(const uint8_t * mask, int32_t t0, int32_t n_t, uint8_t * dead) {
    const uint8_t * m = mask + t0 / 8;
    uint8_t any       = 0;
    for (int32_t i = 0; i < (n_t + 7) / 8; ++i) any |= m[i];
    if (!any) return false;
    for (int32_t t = 0; t < n_t; ++t) dead[t] = (m[t >> 3] >> (t & 7)) & 1;
    return true;
}

}  // namespace

void ott_cpu_attn_partial(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ott_kv_layer_op & op = *(const ott_kv_layer_op *)userdata;
    const ott_kv_step & st     = *op.step;
    const ott_kv_config & cfg  = *st.cfg;
    const ggml_tensor *q = dst->src[0], *k = dst->src[1], *v = dst->src[2];
    const int32_t hd = cfg.geom.head_dim, n_rep = st.n_head / cfg.n_head_kv, block = cfg.geom.block;
    const bool traces  = cfg.traces(op.il);
    const bool aligned = cfg.geom.group_k % VL == 0 && cfg.geom.group_v % VL == 0 && !cfg.geom.key_axis;
    const attn_ws w    = workspace((*st.scratch)[ith], hd, hd / cfg.geom.group_v, st.rows_max);

    // items in turn, whichever thread is free: they differ in cost (the last of a group also
    // reads the fp16 stores), so a fixed share per thread left one of them waiting
    std::atomic<int32_t> & taken = st.taken[op.il];
    const int32_t n_items        = (int32_t)st.items.size();
    for (int32_t it = taken.fetch_add(1, std::memory_order_relaxed); it < n_items;
         it         = taken.fetch_add(1, std::memory_order_relaxed)) {
        const ott_kv_attn_item & I  = st.items[it];
        const ott_kv_step_seq & S   = st.plan.seqs[I.sq];
        const ott_kv_layer_seq & ls = st.ls(op.il, S.seq);
        const int32_t rows          = I.n_q * n_rep;
        const bool fused            = aligned && rows <= FUSED_ROWS;

        // row qi*n_rep + r: query of chunk token I.i0 + qi, head I.head*n_rep + r
        for (int32_t qi = 0; qi < I.n_q; ++qi) {
            for (int32_t r = 0; r < n_rep; ++r) {
                const float * src = (const float *)((const char *)q->data + (size_t)(S.t0 + I.i0 + qi) * q->nb[2] +
                                                    (size_t)(I.head * n_rep + r) * q->nb[1]);
                float * qr        = w.q + (size_t)(qi * n_rep + r) * w.hdp;
                for (int32_t c = 0; c < hd; ++c) qr[c] = src[c] * st.kq_scale;
            }
        }
        start_rows(w, rows);

        // quantized blocks, masked slots excluded
        if (cfg.kvq) {  // KVQuant: slot 0 of block b at position n_sink + b·block
            attend_kvq_store(cfg.kvq_geom, cfg.kvq_tables(op.il, I.head), st.rope, I.b1 - I.b0,
                             S.before.n_sink + I.b0 * block, w, rows, [&](int32_t j) {
                                 return (const uint8_t *)ott_kv_head_block(ls.blocks[I.b0 + j], &cfg.layout, I.head);
                             });
        } else {
            // block b's head-block, and the config its codes follow
            auto head_block = [&](int32_t b) {
                const bool recent        = cfg.recent && cfg.is_recent(b, S.before.n_blocks);
                const ott_kv_config * bc = recent ? st.rcfg : &cfg;
                return std::make_pair(
                    bc, ott_kv_head_block(ott_kv_event_of(cfg, ls, b, S.before.n_blocks), &bc->layout, I.head));
            };
            decltype(head_block(0)) cur {};  // block b's, then the next one's
            if (I.b0 < I.b1) cur = head_block(I.b0);
            for (int32_t b = I.b0; b < I.b1; ++b) {
                const auto [cp, hb]     = cur;
                const ott_kv_config & c = *cp;
                if (b + 1 < I.b1) {  // the next head-block, fetched while this one is read
                    cur = head_block(b + 1);
                    prefetch_head_block(cur.second, cur.first->layout.size);
                }
                for (int32_t t0 = 0; t0 < block; t0 += KEY_TILE) {
                    const int32_t n_t   = std::min(KEY_TILE, block - t0);
                    const bool any_dead = traces && tile_dead(hb + c.layout.mask, t0, n_t, w.dead);
                    const int32_t pos0  = S.before.n_sink + b * block;  // of slot 0
                    if (fused) {
                        attend_codes(c, hb, t0, n_t, w, rows, any_dead ? w.dead : nullptr, st.rope, pos0);
                    } else {
                        dequant_tile(c, hb, t0, n_t, w);
                        if (st.rope) rope_tile(*st.rope, nullptr, pos0 + t0, n_t, w);
                        attend_tile(w, rows, n_t, any_dead ? w.dead : nullptr, false);
                    }
                }
            }
        }

        if (I.fp16) {
            const int32_t h = I.head;
            const size_t pc = cfg.pool_cap(op.il), ec = cfg.extra_cap(op.il);
            attend_f16_store(w, rows, ls.sink_k.data() + (size_t)h * cfg.sink * hd,
                             ls.sink_v.data() + (size_t)h * cfg.sink * hd, S.before.n_sink, st.rope, 0);
            if (pc) {
                attend_f16_store(w, rows, ls.pool_k.data() + h * pc * hd, ls.pool_v.data() + h * pc * hd, ls.n_pool[h],
                                 st.rope, 0, ls.pool_pos.data() + h * pc);
            }
            if (ec) {
                attend_f16_store(w, rows, ls.extra_k.data() + h * ec * hd, ls.extra_v.data() + h * ec * hd,
                                 ls.n_extra[h], st.rope, 0, ls.extra_pos.data() + h * ec);
            }
            // the window ring: its rows from the oldest window position, wrapping once
            const int32_t cap = st.win_cap[S.seq], n_win = S.before.n_win, p0 = S.before.win_pos0(cfg);
            const int32_t r0 = ott_kv_win_row(cfg, cap, p0), n_first = std::min(n_win, cap - r0);
            const ott_fp16 *wk = ls.win_k.data() + (size_t)h * cap * hd, *wv = ls.win_v.data() + (size_t)h * cap * hd;
            attend_f16_store(w, rows, wk + (size_t)r0 * hd, wv + (size_t)r0 * hd, n_first, st.rope, p0);
            attend_f16_store(w, rows, wk, wv, n_win - n_first, st.rope, p0 + n_first);
            // the chunk itself, causally: query token i sees chunk tokens j <= i
            const int32_t n_own = I.i0 + I.n_q;
            for (int32_t j0 = 0; j0 < n_own; j0 += KEY_TILE) {
                const int32_t n_t = std::min(KEY_TILE, n_own - j0);
                chunk_tile(k, v, S.t0 + j0, h, n_t, w);
                if (st.rope) rope_tile(*st.rope, nullptr, S.before.n_tokens + j0, n_t, w);
                for (int32_t qi = 0; qi < I.n_q; ++qi) {
                    for (int32_t r = 0; r < n_rep; ++r) w.lim[qi * n_rep + r] = I.i0 + qi + 1 - j0;
                }
                attend_tile(w, rows, n_t, nullptr, true);
            }
        }

        const int64_t prow = ott_attn_partial_row(hd);
        float * out        = (float *)dst->data + (size_t)it * st.rows_max * prow;
        for (int32_t r = 0; r < rows; ++r) {
            float * o = out + (size_t)r * prow;
            o[0]      = w.m[r];
            o[1]      = w.l[r];
            std::memcpy(o + 2, w.acc + (size_t)r * w.hdp, (size_t)hd * sizeof(float));
        }
    }
}

void ott_cpu_attn_merge(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ott_kv_layer_op & op = *(const ott_kv_layer_op *)userdata;
    const ott_kv_step & st     = *op.step;
    const int32_t hd = st.cfg->geom.head_dim, n_rep = st.n_head / st.cfg->n_head_kv;
    const int64_t prow = ott_attn_partial_row(hd);
    const float * part = (const float *)dst->src[0]->data;
    // the partial op is done with its items: ready for the graph to be computed again
    // (ott_first_nonfinite_layer recomputes a step node by node)
    if (ith == 0) st.taken[op.il].store(0, std::memory_order_relaxed);

    for (size_t gi = ith; gi + 1 < st.groups.size(); gi += nth) {
        const int32_t i_first = st.groups[gi], i_end = st.groups[gi + 1];
        const ott_kv_attn_item & I = st.items[i_first];
        const ott_kv_step_seq & S  = st.plan.seqs[I.sq];
        for (int32_t qi = 0; qi < I.n_q; ++qi) {
            for (int32_t r = 0; r < n_rep; ++r) {
                const int32_t row = qi * n_rep + r;
                float mx          = -INFINITY;
                for (int32_t it = i_first; it < i_end; ++it)
                    mx = std::max(mx, part[((size_t)it * st.rows_max + row) * prow]);
                float * o = (float *)((char *)dst->data + (size_t)(S.t0 + I.i0 + qi) * dst->nb[1]) +
                            (size_t)(I.head * n_rep + r) * hd;
                std::fill(o, o + hd, 0.0f);
                float l = 0.0f;
                for (int32_t it = i_first; it < i_end; ++it) {
                    const float * p = part + ((size_t)it * st.rows_max + row) * prow;
                    if (p[1] == 0.0f) continue;
                    const float f = std::exp(p[0] - mx);
                    l += p[1] * f;
                    for (int32_t c = 0; c < hd; ++c) o[c] += p[2 + c] * f;
                }
                const float inv = 1.0f / l;
                for (int32_t c = 0; c < hd; ++c) o[c] *= inv;
            }
        }
    }
}

void ott_rope_tile_fill(int32_t n_rot, double freq_base, double freq_scale, float * tile) {
    static_assert(OTT_ROPE_TILE == KEY_TILE && KEY_TILE % VL == 0, "a tile's angles in runs of VL");
    const int32_t half = n_rot / 2;
    std::vector<float> cs((size_t)n_rot * KEY_TILE);
    ott_rope_table_fill(n_rot, freq_base, freq_scale, KEY_TILE, cs.data());
    for (int32_t t = 0; t < KEY_TILE; ++t) {
        for (int32_t i = 0; i < half; ++i) {
            float * at = tile + tile_at(half, i, t);
            at[0]      = cs[(size_t)i * KEY_TILE + t];
            at[VL]     = cs[(size_t)(half + i) * KEY_TILE + t];
        }
    }
}

size_t ott_cpu_kvq_attn_scratch(const ott_kvq_geom * g, int32_t n_q) {
    return (workspace_bytes(g->head_dim, 1, n_q) + sizeof(float) - 1) / sizeof(float);
}

void ott_cpu_kvq_attn(const ott_kvq_geom * g, const ott_kvq_tables * tab, const ott_kvq_head_stores * st,
                      const ott_rope_table * rope, const float * q, int32_t n_q, const int32_t * n_visible,
                      float kq_scale, float * out, float * scratch) {
    const int32_t hd = g->head_dim;
    std::memset(scratch, 0, ott_cpu_kvq_attn_scratch(g, n_q) * sizeof(float));
    attn_ws w;
    workspace_layout(scratch, hd, 1, n_q, w);
    for (int32_t r = 0; r < n_q; ++r) {
        for (int32_t c = 0; c < hd; ++c) w.q[(size_t)r * w.hdp + c] = q[(size_t)r * hd + c] * kq_scale;
    }
    start_rows(w, n_q);
    attend_kvq_store(*g, *tab, rope, st->n_blocks, st->pos0, w, n_q, [st](int32_t j) {
        return st->block_list ? st->block_list[j] : st->blocks + (size_t)j * st->block_stride;
    });
    for (int32_t t0 = 0; t0 < st->n; t0 += KEY_TILE) {
        const int32_t n_t = std::min(KEY_TILE, st->n - t0);
        f16_tile(st->k + (size_t)t0 * hd, st->v + (size_t)t0 * hd, n_t, w);
        if (rope) rope_tile(*rope, st->pos + t0, 0, n_t, w);
        for (int32_t r = 0; n_visible && r < n_q; ++r) w.lim[r] = n_visible[r] - t0;
        attend_tile(w, n_q, n_t, nullptr, n_visible != nullptr);
    }
    for (int32_t r = 0; r < n_q; ++r) {
        for (int32_t c = 0; c < hd; ++c) out[(size_t)r * hd + c] = w.acc[(size_t)r * w.hdp + c] / w.l[r];
    }
}

void ott_cpu_kv_event(const ott_kv_config & cfg, ott_kv_layer_seq & ls, int il, int h, int32_t win_cap,
                      const ott_kv_event & e, std::vector<uint8_t> & scratch) {
    const int32_t hd = cfg.geom.head_dim, block = cfg.geom.block;
    const size_t pc = cfg.pool_cap(il), ec = cfg.extra_cap(il);
    const size_t rows_bytes = (size_t)block * hd * sizeof(ott_fp16);  // K or V of the block
    const size_t need       = std::max(2 * rows_bytes + (cfg.kvq ? ott_kvq_scratch_bytes(&cfg.kvq_geom)
                                                                 : ott_kv_event_scratch_bytes(&cfg.geom, (int32_t)pc)),
                                       cfg.recent ? ott_kv_recode_scratch_bytes(&cfg.rgeom) : 0);
    if (scratch.size() < need) scratch.resize(need);
    uint8_t * out = nullptr;
    if (cfg.recent) {  // the slot of the block `recent` events older: re-coded first
        uint8_t * slot = ott_kv_head_block(ls.recent[e.block_idx % cfg.recent], &cfg.rlayout, h);
        if (e.block_idx >= cfg.recent) {
            ott_kv_recode_ref(&cfg.rgeom, slot, &cfg.geom, cfg.tier_scale_of(il, h),
                              ott_kv_head_block(ls.blocks[e.block_idx - cfg.recent], &cfg.layout, h), scratch.data());
        }
        out = slot;
    } else {
        out = ott_kv_head_block(ls.blocks[e.block_idx], &cfg.layout, h);
    }
    // the block's rows, gathered from the ring (they may wrap around its end)
    ott_fp16 *blk_k = (ott_fp16 *)scratch.data(), *blk_v = blk_k + (size_t)block * hd;
    for (int32_t t = 0; t < block; ++t) {
        const size_t row = (size_t)h * win_cap + ott_kv_win_row(cfg, win_cap, e.pos0 + t);
        std::memcpy(blk_k + (size_t)t * hd, ls.win_k.data() + row * hd, hd * sizeof(ott_fp16));
        std::memcpy(blk_v + (size_t)t * hd, ls.win_v.data() + row * hd, hd * sizeof(ott_fp16));
    }
    if (cfg.kvq) {
        const ott_kvq_tables tab = cfg.kvq_tables(il, h);
        ott_kvq_quantize_block_ref(&cfg.kvq_geom, &tab, blk_k, blk_v, out, scratch.data() + 2 * rows_bytes);
        return;
    }
    ott_kv_rows pool  = { ls.pool_k.data() + h * pc * hd, ls.pool_v.data() + h * pc * hd, ls.pool_pos.data() + h * pc,
                          ls.n_pool[h], (int32_t)pc };
    ott_kv_rows extra = { ls.extra_k.data() + h * ec * hd, ls.extra_v.data() + h * ec * hd,
                          ls.extra_pos.data() + h * ec, ls.n_extra[h], (int32_t)ec };
    int32_t tracing   = ls.tracing[h];
    ott_kv_event_ref(cfg.recent ? &cfg.rgeom : &cfg.geom, blk_k, blk_v, e.pos0, &pool, &extra, &tracing,
                     cfg.recent ? nullptr : cfg.tier_scale_of(il, h), out, scratch.data() + 2 * rows_bytes);
    ls.n_pool[h]  = pool.n;
    ls.n_extra[h] = extra.n;
    ls.tracing[h] = tracing;
}

void ott_cpu_kv_append(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ott_kv_layer_op & op = *(const ott_kv_layer_op *)userdata;
    const ott_kv_step & st     = *op.step;
    const ott_kv_config & cfg  = *st.cfg;
    const ggml_tensor *k = dst->src[0], *v = dst->src[1];
    const int32_t hd = cfg.geom.head_dim, n_kv = cfg.n_head_kv;

    // one (sequence, KV head) per work item: its appends in order, each event after the
    // append that fills the window
    for (size_t idx = ith; idx < st.plan.seqs.size() * n_kv; idx += nth) {
        const ott_kv_step_seq & S = st.plan.seqs[idx / n_kv];
        const int32_t h = (int32_t)(idx % n_kv), cap = st.win_cap[S.seq];
        ott_kv_layer_seq & ls = st.ls(op.il, S.seq);
        int32_t ev            = S.ev0;
        while (ev < S.ev0 + S.n_ev && st.plan.events[ev].after < 0) ++ev;  // deferred: fired in begin()
        for (int32_t j = 0; j < S.n_app; ++j) {
            const ott_kv_append & a = st.plan.appends[S.app0 + j];
            const float * kr = (const float *)((const char *)k->data + (size_t)a.tok * k->nb[2] + (size_t)h * k->nb[1]);
            const float * vr = (const float *)((const char *)v->data + (size_t)a.tok * v->nb[2] + (size_t)h * v->nb[1]);
            const size_t row =
                a.sink_row >= 0 ? (size_t)h * cfg.sink + a.sink_row : (size_t)h * cap + ott_kv_win_row(cfg, cap, a.pos);
            ott_fp16 * kd = (a.sink_row >= 0 ? ls.sink_k : ls.win_k).data() + row * hd;
            ott_fp16 * vd = (a.sink_row >= 0 ? ls.sink_v : ls.win_v).data() + row * hd;
            for (int32_t c = 0; c < hd; ++c) {
                kd[c] = ott_fp32_to_fp16_ref(kr[c]);
                vd[c] = ott_fp32_to_fp16_ref(vr[c]);
            }
            for (; ev < S.ev0 + S.n_ev && st.plan.events[ev].after == j + 1; ++ev) {
                ott_cpu_kv_event(cfg, ls, op.il, h, cap, st.plan.events[ev], (*st.scratch)[ith]);
            }
        }
    }
}
