/* kv_kvq.h — the scalar specification (`_ref`) of a KVQuant quantization event, transliterated
 * from ott_gguf/reference/kvquant.py and nuq.py. Bit-exact contract (float32 operations, round
 * to nearest even, no FMA: this file's .c is compiled with -ffp-contract=off):
 *
 *  - keys:   t = (f32(k) - zero_c) * inv_c,  inv_c = scale_c != 0 ? 1.0f / scale_c : 0,
 *            zero_c = (hi_c + lo_c) * 0.5f, scale_c = (hi_c - lo_c) * 0.5f from the calibrated
 *            thresholds (ott_kvq_channel_params_ref);
 *  - sparse keys: the n_out largest |t| of the block, equal ones by lower index t·head_dim + c;
 *  - sparse values: the n_out/2 largest values of the block, then the n_out/2 smallest of the
 *            rest, equal ones by lower index;
 *  - per-token value range over the entries that are not sparse (none: zero = scale = 0):
 *            zero = fp16((mx + mn) * 0.5f), scale = fp16((mx - mn) * 0.5f),
 *            t = (f32(v) - f32(zero)) * (scale != 0 ? 1.0f / f32(scale) : 0);
 *  - code = #{ j : mid_j < t },  mid_j = (L_j + L_{j+1}) * 0.5f  (the nearest level, ties down).
 *
 * The CUDA twin, under the same names: cuda/kv_kvq.cuh.
 */
#ifndef OTT_KV_KVQ_H
#define OTT_KV_KVQ_H

#include "kv/kvq_types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* zero and scale of n channels from their thresholds lo, hi (float [n] each). */
void ott_kvq_channel_params_ref(const float * lo, const float * hi, int32_t n, float * zero, float * scale);

/* The code of normalized value t in a codebook of n_levels ascending levels. */
uint8_t ott_kvq_code_ref(float t, const float * levels, int32_t n_levels);

/* Scratch bytes ott_kvq_quantize_block_ref needs. */
size_t ott_kvq_scratch_bytes(const ott_kvq_geom * g);

/* Quantize one block of one KV head into a KVQuant head-block (kv_layout.h).
 * k, v: fp16 [block][head_dim] (keys before RoPE when the cache is pre-RoPE);
 * out: ott_kvq_block_layout_of(g).size bytes; scratch: ott_kvq_scratch_bytes(g), 4-byte aligned. */
void ott_kvq_quantize_block_ref(const ott_kvq_geom * g, const ott_kvq_tables * tab, const ott_fp16 * k,
                                const ott_fp16 * v, uint8_t * out, void * scratch);

#ifdef __cplusplus
}
#endif

#endif /* OTT_KV_KVQ_H */
