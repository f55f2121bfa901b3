/* kv_layout.h — byte layouts of the quantized KV cache, shared by C, C++ and CUDA.
 *
 * The unit of quantized storage is a head-block: one block of `block` consecutive tokens
 * of one KV head of one layer of one sequence, quantized at one event (docs/design.md §2). Its
 * arrays are those of ott_gguf/reference/block.py, byte for byte; they lie in one
 * contiguous piece of memory at the offsets of ott_kv_block_layout:
 *
 *   k_scale  fp16  [block/group_k][head_dim]   [g][c] = key group g (slots g·group_k ..) of channel c
 *   k_min    fp16  [block/group_k][head_dim]
 *   v_scale  fp16  [block][head_dim/group_v]   [t][g] = channels g·group_v .. of slot t
 *   v_min    fp16  [block][head_dim/group_v]   (sym_v: 0 bytes, the minimum is ott_kv_sym_min)
 *   (with param_bits 8, scales are uint8 ufp8 and mins int8, same shapes: ott_kv_scale8 /
 *   ott_kv_min8 decode them, ott_gguf/reference/quant.py states the encoding)
 *   k_codes  uint8 [head_dim][block·bits_k/8]  row c = channel c, codes packed LSB-first along
 *                                              slots (2 bits: byte j holds slots 4j..4j+3)
 *   (with key_axis 1, keys are grouped per token as values are: k_scale, k_min
 *   [block][head_dim/group_k], k_codes [block][head_dim·bits_k/8]; the byte counts are equal)
 *   v_codes  uint8 [block][head_dim·bits_v/8]  row t = slot t, codes packed LSB-first along channels
 *   mask     uint8 [block/8]                   bit t%8 of byte t/8 = 1: slot t lives in a pool
 *   k_order  uint8 [head_dim]                  key tiers only (n_hi or n_lo > 0; else 0 bytes):
 *                                              k_order[r] = the channel of key row r
 *
 * With key tiers (block.py: channels ranked by range, group_k = block) key row r is the
 * channel of rank r: k_scale[0][r], k_min[0][r] are its parameters, and its codes, at
 * ott_kv_k_row_bits bits, start ott_kv_k_row_offset bytes into k_codes (rows back to back).
 *
 * Every array starts on an OTT_KV_ALIGN boundary and the head-block size is a multiple of
 * it, so head-blocks can be laid side by side (the n_head_kv head-blocks of one event are).
 *
 * fp16 token stores (sink, outlier pool, extra pool, window) of one KV head are rows:
 *   k   fp16  [n][head_dim]    v   fp16  [n][head_dim]    pos  int32 [n] (pools only)
 *
 * fp16 values are kept as their IEEE binary16 bit patterns (ott_fp16) so that C, C++ and
 * CUDA code agree on the type without a half-precision compiler type.
 */
#ifndef OTT_KV_LAYOUT_H
#define OTT_KV_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define OTT_HD __host__ __device__
#else
#define OTT_HD
#endif

#if defined(__cplusplus)
#define OTT_STATIC_ASSERT(c, m) static_assert(c, m)
#else
#define OTT_STATIC_ASSERT(c, m) _Static_assert(c, m)
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef uint16_t ott_fp16; /* IEEE binary16 bit pattern */

#define OTT_KV_ALIGN 64 /* bytes: start of every array of a head-block */

/* The knobs that fix a head-block: its layout and how its groups are quantized (KVConfig
 * resolved for head_dim). */
typedef struct {
    int32_t head_dim;   /* n_embd_head                                    */
    int32_t block;      /* tokens per block, multiple of 8                */
    int32_t bits_k;     /* 2, 4 or 8                                      */
    int32_t bits_v;     /* 2, 4 or 8                                      */
    int32_t group_k;    /* key group: tokens of one channel (divides block), or with key_axis 1
                            channels of one token (divides head_dim)         */
    int32_t group_v;    /* channels per value group, divides head_dim     */
    int32_t clip;       /* 1: each group takes the best clipped range (kv_clip.h), 0: min-max */
    int32_t param_bits; /* 16: fp16 scale and min per group; 8: ufp8 scale, int8 min (below) */
    int32_t key_axis;   /* 0: key groups per channel along tokens; 1: per token along channels */
    int32_t n_hi;       /* key tiers: the first n_hi key rows are coded with OTT_KV_HI_BITS bits */
    int32_t n_lo;       /* ... the last n_lo with OTT_KV_LO_BITS; the others with bits_k     */
    int32_t sym_v;      /* 1: value groups symmetric around zero, no v_min (ott_kv_sym_min)   */
} ott_kv_geom;
OTT_STATIC_ASSERT(sizeof(ott_kv_geom) == 48, "ott_kv_geom is twelve int32");

#define OTT_KV_HI_BITS 4     /* code width of the high key tier */
#define OTT_KV_RECENT_BITS 4 /* code width of keys and values in recent blocks (ott_kv_params.recent) */
#define OTT_KV_LO_BITS 1     /* code width of the low key tier */
#define OTT_KV_TIER_UNIT 16  /* hi_k and lo_k count channels per 16 of head_dim */

/* Byte offsets of the arrays of one head-block from its start, and its size. */
typedef struct {
    uint32_t k_scale;
    uint32_t k_min;
    uint32_t v_scale;
    uint32_t v_min;
    uint32_t k_codes;
    uint32_t v_codes;
    uint32_t mask;
    uint32_t k_order;
    uint32_t size; /* total bytes, a multiple of OTT_KV_ALIGN */
} ott_kv_block_layout;
OTT_STATIC_ASSERT(sizeof(ott_kv_block_layout) == 36, "ott_kv_block_layout is nine uint32");

static inline OTT_HD uint32_t ott_kv_align(uint32_t n) { return (n + OTT_KV_ALIGN - 1) / OTT_KV_ALIGN * OTT_KV_ALIGN; }

/* Bytes of one scale or minimum. */
static inline OTT_HD uint32_t ott_kv_param_bytes(const ott_kv_geom * g) { return g->param_bits == 8 ? 1u : 2u; }

/* An 8-bit scale: the fp16 with bit pattern s8 << 7 (5 exponent, 3 mantissa bits), as float. */
static inline OTT_HD float ott_kv_scale8(uint8_t s8) {
#if defined(__CUDA_ARCH__)
    /* the hardware's fp16 -> fp32 conversion: exact, subnormals included (two instructions
     * where the branches below take about ten in an attention kernel's parameter loads) */
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)((uint32_t)s8 << 7)));
    return f;
#else
    const uint32_t e = (uint32_t)s8 >> 3, m = ((uint32_t)s8 & 7u) << 7; /* fp16 exponent, mantissa */
    union {
        uint32_t u;
        float f;
    } v;
    if (e == 0) return (float)m * 0x1p-24f; /* subnormal, exact */
    v.u = ((e + 112u) << 23) | (m << 13);
    return v.f;
#endif
}

/* An 8-bit minimum: z quarters of its group's scale, two float multiplications. */
static inline OTT_HD float ott_kv_min8(int8_t z, float scale) { return ((float)z * 0.25f) * scale; }

/* The implied minimum of a symmetric group of `bits`-bit codes: -(2^bits - 1)/2 steps, one
 * float multiplication (ott_gguf/reference/quant.py: sym_min). */
static inline OTT_HD float ott_kv_sym_min(int32_t bits, float scale) {
    return (-0.5f * (float)((1 << bits) - 1)) * scale;
}

/* Bytes of one packed code row (keys: without tiers). */
static inline OTT_HD uint32_t ott_kv_k_row_bytes(const ott_kv_geom * g) {
    return (uint32_t)((g->key_axis ? g->head_dim : g->block) * g->bits_k / 8);
}
static inline OTT_HD int ott_kv_tiered(const ott_kv_geom * g) { return g->n_hi > 0 || g->n_lo > 0; }
/* Bits per code of key row r (key_axis 0). */
static inline OTT_HD int32_t ott_kv_k_row_bits(const ott_kv_geom * g, int32_t r) {
    return r < g->n_hi ? OTT_KV_HI_BITS : r >= g->head_dim - g->n_lo ? OTT_KV_LO_BITS : g->bits_k;
}
/* Byte offset of key row r in k_codes (key_axis 0): the rows before it, back to back. */
static inline OTT_HD uint32_t ott_kv_k_row_offset(const ott_kv_geom * g, int32_t r) {
    const int32_t lo_start = g->head_dim - g->n_lo;
    const int32_t hi = r < g->n_hi ? r : g->n_hi, lo = r > lo_start ? r - lo_start : 0, mid = r - hi - lo;
    return (uint32_t)((hi * OTT_KV_HI_BITS + mid * g->bits_k + lo * OTT_KV_LO_BITS) * g->block / 8);
}
static inline OTT_HD uint32_t ott_kv_v_row_bytes(const ott_kv_geom * g) {
    return (uint32_t)(g->head_dim * g->bits_v / 8);
}
/* Key groups per channel (key_axis 0) or per token (1), value groups per token. */
static inline OTT_HD uint32_t ott_kv_n_gk(const ott_kv_geom * g) {
    return (uint32_t)((g->key_axis ? g->head_dim : g->block) / g->group_k);
}
static inline OTT_HD uint32_t ott_kv_n_gv(const ott_kv_geom * g) { return (uint32_t)(g->head_dim / g->group_v); }

static inline OTT_HD ott_kv_block_layout ott_kv_block_layout_of(const ott_kv_geom * g) {
    const uint32_t k_sc =
        (uint32_t)(g->block * g->head_dim / g->group_k) * ott_kv_param_bytes(g);       /* bytes of k_scale, of k_min */
    const uint32_t v_sc = (uint32_t)g->block * ott_kv_n_gv(g) * ott_kv_param_bytes(g); /* bytes of v_scale, of v_min */
    const uint32_t v_mn = g->sym_v ? 0u : v_sc;
    ott_kv_block_layout L;
    uint32_t off = 0;
    L.k_scale    = off;
    off += ott_kv_align(k_sc);
    L.k_min = off;
    off += ott_kv_align(k_sc);
    L.v_scale = off;
    off += ott_kv_align(v_sc);
    L.v_min = off;
    off += ott_kv_align(v_mn);
    L.k_codes = off;
    off += ott_kv_align(ott_kv_k_row_offset(g, g->head_dim));
    L.v_codes = off;
    off += ott_kv_align((uint32_t)g->block * ott_kv_v_row_bytes(g));
    L.mask = off;
    off += ott_kv_align((uint32_t)g->block / 8);
    L.k_order = off;
    off += ott_kv_align(ott_kv_tiered(g) ? (uint32_t)g->head_dim : 0u);
    L.size = off;
    return L;
}

/* The geometry of the recent blocks of a cache of geometry g (ott_kv_params.recent): 4-bit keys
 * and values in its groups and parameter format, min-max ranges, no key tiers. */
static inline OTT_HD ott_kv_geom ott_kv_recent_geom(const ott_kv_geom * g) {
    ott_kv_geom r = *g;
    r.bits_k = r.bits_v = OTT_KV_RECENT_BITS;
    r.clip              = 0;
    r.n_hi = r.n_lo = 0;
    return r;
}

/* Head-block of KV head h among the n_head_kv head-blocks of one event, laid side by side. */
static inline OTT_HD uint8_t * ott_kv_head_block(uint8_t * event, const ott_kv_block_layout * L, int32_t h) {
    return event + (size_t)h * L->size;
}

/* Bytes of a head-block that hold data (what the footprint counts; the rest is padding). */
static inline OTT_HD uint64_t ott_kv_block_data_bytes(const ott_kv_geom * g, int with_mask) {
    const uint64_t codes  = ott_kv_k_row_offset(g, g->head_dim) + (uint64_t)g->head_dim * g->block * g->bits_v / 8;
    const uint64_t params = (uint64_t)g->block * g->head_dim / g->group_k * 2 +
                            (uint64_t)g->block * ott_kv_n_gv(g) * (uint64_t)(2 - g->sym_v); /* scales and mins */
    const uint64_t order  = ott_kv_tiered(g) ? (uint64_t)g->head_dim : 0;
    return codes + params * ott_kv_param_bytes(g) + order + (with_mask ? (uint64_t)g->block / 8 : 0);
}

/* ---- KVQuant head-blocks (ott_gguf/reference/kvquant.py, byte for byte) ------------------
 *
 *   v_zero     fp16   [block]                      per-token zero of the values, slot t
 *   v_scale    fp16   [block]
 *   k_codes    uint8  [head_dim][block·bits_k/8]   row c = channel c, codes along slots as one
 *                                                  LSB-first bit stream (kv_quant.h: ott_pack_codes_ref)
 *   v_codes    uint8  [block][head_dim·bits_v/8]   row t = slot t, along channels
 *   k_out_idx  uint16 [n_out]                      sparse keys: ascending t·head_dim + c
 *   k_out_val  fp16   [n_out]                      their exact values
 *   v_out_idx  uint16 [n_out]                      sparse values, likewise
 *   v_out_val  fp16   [n_out]
 *
 * Codes index a codebook of 2^bits float levels (kv_kvq.h); keys are normalized by calibrated
 * per-channel ranges, so a head-block holds no key parameters. */
typedef struct {
    int32_t head_dim; /* n_embd_head; block·head_dim <= 65536 (16-bit sparse indices)  */
    int32_t block;    /* tokens per block, multiple of 8                              */
    int32_t bits_k;   /* 2, 3 or 4                                                    */
    int32_t bits_v;   /* 2, 3 or 4; head_dim·bits_v a multiple of 8                    */
    int32_t n_out;    /* sparse entries of keys, and of values, per block (even)      */
} ott_kvq_geom;
OTT_STATIC_ASSERT(sizeof(ott_kvq_geom) == 20, "ott_kvq_geom is five int32");

typedef struct {
    uint32_t v_zero;
    uint32_t v_scale;
    uint32_t k_codes;
    uint32_t v_codes;
    uint32_t k_out_idx;
    uint32_t k_out_val;
    uint32_t v_out_idx;
    uint32_t v_out_val;
    uint32_t size; /* total bytes, a multiple of OTT_KV_ALIGN */
} ott_kvq_block_layout;
OTT_STATIC_ASSERT(sizeof(ott_kvq_block_layout) == 36, "ott_kvq_block_layout is nine uint32");

/* Sparse entries per block of keys (and of values) at `outliers` per 10000 of its entries:
 * twice round(outliers/2 per 10000), half up (kvquant.py: n_outliers). */
static inline OTT_HD int32_t ott_kvq_n_out(int32_t outliers, int32_t block, int32_t head_dim) {
    return 2 * (int32_t)(((int64_t)outliers * block * head_dim + 10000) / 20000);
}

/* Bytes of a KVQuant head-block that hold data: codes, value zero and scale per token, and
 * the sparse entries of keys and values (an fp16 value and a uint16 index each). */
static inline OTT_HD uint64_t ott_kvq_block_data_bytes(const ott_kvq_geom * g) {
    const uint64_t codes = (uint64_t)g->head_dim * g->block * (uint64_t)(g->bits_k + g->bits_v) / 8;
    return codes + (uint64_t)g->block * 4 + (uint64_t)g->n_out * 2 * 4;
}

static inline OTT_HD ott_kvq_block_layout ott_kvq_block_layout_of(const ott_kvq_geom * g) {
    const uint32_t sp = (uint32_t)g->n_out * 2u; /* bytes of one sparse array */
    ott_kvq_block_layout L;
    uint32_t off = 0;
    L.v_zero     = off;
    off += ott_kv_align((uint32_t)g->block * 2u);
    L.v_scale = off;
    off += ott_kv_align((uint32_t)g->block * 2u);
    L.k_codes = off;
    off += ott_kv_align((uint32_t)(g->head_dim * g->block * g->bits_k / 8));
    L.v_codes = off;
    off += ott_kv_align((uint32_t)(g->block * g->head_dim * g->bits_v / 8));
    L.k_out_idx = off;
    off += ott_kv_align(sp);
    L.k_out_val = off;
    off += ott_kv_align(sp);
    L.v_out_idx = off;
    off += ott_kv_align(sp);
    L.v_out_val = off;
    off += ott_kv_align(sp);
    L.size = off;
    return L;
}

/* Code i of a packed row of row_bytes bytes (one LSB-first bit stream of `bits`-bit codes). */
static inline OTT_HD uint32_t ott_kvq_code_at(const uint8_t * row, int32_t i, int32_t bits, size_t row_bytes) {
    const int32_t at = i * bits;
    uint32_t x       = row[at / 8];
    if ((size_t)(at / 8 + 1) < row_bytes) x |= (uint32_t)row[at / 8 + 1] << 8;
    return (x >> (at % 8)) & ((1u << bits) - 1);
}

#ifdef __cplusplus
}
#endif

#endif /* OTT_KV_LAYOUT_H */
