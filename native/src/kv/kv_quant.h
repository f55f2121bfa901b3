/* kv_quant.h — the scalar specification (`_ref`) of everything the quantized KV cache
 * computes at a quantization event, transliterated from ott_gguf/reference (quant.py,
 * outliers.py, block.py, cache.py). Bit-exact contract:
 *
 *  - fp16 <-> fp32: IEEE binary16, float -> fp16 rounds to nearest even (as numpy, F16C).
 *  - Quantizing one group (KIVI, asymmetric), each step one float32 operation, no FMA
 *    (this file is compiled with -ffp-contract=off; CUDA: no --use_fast_math):
 *        mn = min x, mx = max x                     (exact)
 *        scale = fp16((f32(mx) - f32(mn)) / f32(2^b - 1))
 *        inv   = scale != 0 ? 1.0f / f32(scale) : 0
 *        code  = clamp(rint((f32(x) - f32(mn)) * inv), 0, 2^b - 1)   rint: half to even
 *    min is stored as fp16(mn) (exact).
 *  - Clipped ranges (geom clip = 1): candidate i of kv_clip.h narrows [mn, mx] to
 *        d = c_i * (mx - mn),  lo = mn + d,  hi = mx - d
 *        scale = fp16((hi - lo) / f32(2^b - 1)),  min = fp16(lo),  inv as above
 *        code  = clamp(rint((f32(x) - f32(min)) * inv), 0, 2^b - 1)
 *        err   = sum over the group, in element order, of double(e)*double(e) in double,
 *                e = (code * f32(scale) + f32(min)) - f32(x)   (three float operations)
 *    and the first candidate of least err is kept; candidate 0 is the min-max recipe.
 *  - 8-bit parameters (geom param_bits = 8), from a range [lo, hi] (min-max, or with clip = 1
 *    each candidate's, its err then taken with the decoded m and s):
 *        t = (hi - lo) / f32(2^b - 1);  h = fp16(t), +1 while f32(h) < t
 *        s8 = max(1, ceil(h / 128));  s = ott_kv_scale8(s8)
 *        z = floor((lo / s) * 4.0f), and while z is outside -128..127: s8 += 1, again
 *        m = ott_kv_min8(z, s);  code = clamp(rint((f32(x) - m) * (1.0f / s)), 0, 2^b - 1)
 *  - L1 score of a key: the exact sum of |k_c|, as an integer count of 2^-24 (every fp16
 *    value is one), so any summation order gives the same number.
 *  - Pool selection: the `capacity` candidates with the smallest score; equal scores go to
 *    the lower candidate index (candidates are in ascending position).
 *  - Mean substitution: per channel, the exact sum over unmasked rows, divided by their
 *    count in double, rounded to float, then to fp16.
 *
 * These functions are also what the CPU cache runs at events (they are not on the hot
 * path: one event per `block` tokens). Attention has its own workers (cpu/ott_ops_cpu.h).
 * Their CUDA twin, line by line under the same names: cuda/kv_quant.cuh.
 */
#ifndef OTT_KV_QUANT_H
#define OTT_KV_QUANT_H

#include "kv/fp16_ref.h"
#include "kv/kv_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Quantize one group of n <= 8192 fp16 values read at x[i*stride] over its whole range (clip = 0)
 * or the best clipped one (clip = 1): codes uint8 [n] (unpacked); the scale and min written
 * at scale and min: fp16 (param_bits 16) or one byte each, a ufp8 scale and an int8 z
 * (param_bits 8, kv_layout.h). sym = 1: the range is [-a, a] with a = max(-mn, mx) + 0,
 * only the scale is written and the minimum is ott_kv_sym_min (reference/quant.py). */
void ott_quantize_group_ref(const ott_fp16 * x, int64_t stride, int32_t n, int32_t bits, int32_t clip,
                            int32_t param_bits, int32_t sym, uint8_t * codes, uint8_t * scale, uint8_t * min);

/* Pack n codes LSB-first as one bit stream: bit k of code i is bit i*bits + k of out, bit m
 * of out is bit m % 8 of byte m / 8 (bits 2, 4, 8: code i in byte i*bits/8 at bit
 * (i % (8/bits))*bits; bits 3: eight codes in three bytes).
 * out: uint8 [n*bits/8]; n*bits must be a multiple of 8. */
void ott_pack_codes_ref(const uint8_t * codes, int32_t n, int32_t bits, uint8_t * out);

/* Exact L1 norm of one key, fp16 [head_dim], in units of 2^-24. */
int64_t ott_l1_score_ref(const ott_fp16 * k, int32_t head_dim);

/* Mark the `capacity` smallest scores: keep uint8 [n_cand] = 1 for them, 0 elsewhere.
 * Ties: the lower index wins. scratch: int32 [capacity]. */
void ott_select_pool_ref(const int64_t * score, int32_t n_cand, int32_t capacity, uint8_t * keep, int32_t * scratch);

/* Replace the rows of x (fp16 [n][head_dim]) with masked[t] != 0 by the channel means of
 * the other rows. At least one row must be unmasked. */
void ott_substitute_mean_ref(ott_fp16 * x, int32_t n, int32_t head_dim, const uint8_t * masked);

/* Quantize one block of one KV head into a head-block (kv_layout.h).
 * k, v: fp16 [block][head_dim], masked rows already substituted; masked: uint8 [block];
 * tier_scale: with key tiers the query scale u, float [head_dim] (block.py), or NULL (1). */
void ott_quantize_block_ref(const ott_kv_geom * g, const ott_fp16 * k, const ott_fp16 * v, const uint8_t * masked,
                            const float * tier_scale, uint8_t * out);

/* fp16 tokens with positions: an outlier pool or an extra pool of one KV head. */
typedef struct {
    ott_fp16 * k;  /* [cap][head_dim] */
    ott_fp16 * v;  /* [cap][head_dim] */
    int32_t * pos; /* [cap]           */
    int32_t n;     /* tokens held     */
    int32_t cap;
} ott_kv_rows;

/* Scratch bytes ott_kv_event_ref needs for a pool of capacity pool_cap. */
size_t ott_kv_event_scratch_bytes(const ott_kv_geom * g, int32_t pool_cap);

/* One quantization event of one KV head (reference/cache.py _quantize_oldest_block):
 *   blk_k, blk_v  fp16 [block][head_dim]: the oldest block of the window, slot t at
 *                 position pos0 + t; overwritten (masked rows get the mean)
 *   pool, extra   the head's outlier and extra pools, updated; pool->cap 0 = no tracing
 *   tracing       in: whether the head traces; out: cleared for good by the stop rule
 *   tier_scale    the key tiers' query scale, float [head_dim], or NULL (ott_quantize_block_ref)
 *   out           the head-block (ott_kv_block_layout_of(g).size bytes)
 *   scratch       ott_kv_event_scratch_bytes(g, pool->cap) bytes, 8-byte aligned
 * Tracing: if extra->cap - extra->n < pool->n, tracing stops (pool kept as is). Otherwise
 * the candidates pool ∪ block are scored, the `pool->cap` smallest form the new pool in
 * ascending position, pool tokens that lost their place are appended to the extra pool in
 * ascending position, and the selected block slots are masked and mean-substituted. */
void ott_kv_event_ref(const ott_kv_geom * g, ott_fp16 * blk_k, ott_fp16 * blk_v, int32_t pos0, ott_kv_rows * pool,
                      ott_kv_rows * extra, int32_t * tracing, const float * tier_scale, uint8_t * out, void * scratch);

/* Scratch bytes ott_kv_recode_ref needs for head-blocks of rg. */
size_t ott_kv_recode_scratch_bytes(const ott_kv_geom * rg);

/* A recent head-block re-coded to the cache's codes (reference/cache.py _recode):
 *   rg, src     the recent head-block and its geometry (no key tiers)
 *   g, out      the head-block it becomes and its geometry (same block, head_dim, groups)
 *   tier_scale  as ott_quantize_block_ref
 * Every key and value is dequantized exactly (double(code)·scale + min, the parameters
 * decoded as kv_layout.h), rounded to float and then to fp16; the masked slots (src's mask,
 * copied) are substituted by the mean again, and the block is quantized as any other.
 * scratch: ott_kv_recode_scratch_bytes(rg) bytes. */
void ott_kv_recode_ref(const ott_kv_geom * rg, const uint8_t * src, const ott_kv_geom * g, const float * tier_scale,
                       uint8_t * out, void * scratch);

#ifdef __cplusplus
}
#endif

#endif /* OTT_KV_QUANT_H */
