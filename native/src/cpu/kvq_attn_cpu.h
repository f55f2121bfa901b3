// kvq_attn_cpu.h — attention of one KV head's queries over its KVQuant stores, on the CPU
// (docs/kvquant.md; ott_gguf/reference/attention.py with cfg.kvq is the float64 specification).
// Implemented in ott_ops_cpu.cpp with the tiles of the other caches' attention, which the
// runtime's step runs as well (ott_cpu_attn_partial), so this entry point is what the tests and
// the CUDA check (tests/cuda_ops.cpp) compare with.
//
// Keys are cached before RoPE. Per tile (up to 128 keys of a head-block, or of the fp16 rows)
// each key is dequantized from its codes — level L_k[code] of the layer's codebook times its
// channel's calibrated scale plus zero, the sparse entries put back exactly — then rotated by
// RoPE at its own position and scored against the queries (already rotated at theirs): exact
// up to float32 rounding, and the whole cache is never dequantized at once. Values likewise,
// per token. One online softmax per query row over every store.
//
// Why the key and not the query is rotated per position: both cost n_rot/2 rotations per
// key, but a rotated key serves every query row of the group (GQA heads, chunk tokens).
#pragma once

#include "kv/kv_kvq.h"

#ifdef __cplusplus
extern "C" {
#endif

// The RoPE table's first OTT_ROPE_TILE positions in the order the CPU's tiles read them (ott_rope_table.tile):
// OTT_ROPE_TILE·n_rot floats into tile.
void ott_rope_tile_fill(int32_t n_rot, double freq_base, double freq_scale, float * tile);

// Floats of scratch ott_cpu_kvq_attn needs.
size_t ott_cpu_kvq_attn_scratch(const ott_kvq_geom * g, int32_t n_q);

// out [n_q][head_dim] = softmax(kq_scale · q · RoPE(k̂)) · v̂ over the keys of st, for query
// rows q [n_q][head_dim] (after RoPE). Row r sees every quantized block and the first
// n_visible[r] fp16 rows of st (n_visible NULL: all of them; a chunk's causal mask when the
// chunk's own rows come last). rope NULL: the keys are cached after RoPE, none is rotated;
// else its tile is filled too.
void ott_cpu_kvq_attn(const ott_kvq_geom * g, const ott_kvq_tables * tab, const ott_kvq_head_stores * st,
                      const ott_rope_table * rope, const float * q, int32_t n_q, const int32_t * n_visible,
                      float kq_scale, float * out, float * scratch);

#ifdef __cplusplus
}
#endif
