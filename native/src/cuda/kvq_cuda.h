// kvq_cuda.h — CUDA kernels of the KVQuant cache, as seen by host code (kv_quant_cuda.cpp,
// tests/cuda_ops.cpp). One op per .cu file; each launcher takes the stream and returns the
// launch status:
//
//   kvq_event.cu  quantization of blocks into KVQuant head-blocks, bit for bit
//                 ott_kvq_quantize_block_ref (kv/kv_kvq.h): ott_cuda_kvq_event on packed
//                 blocks, ott_cuda_kvq_layer_event on the window rows of a cache layer
//   kvq_attn.cu   attention of one KV head's query rows over its stores: codebook lookup and
//                 RoPE at each key's position, as cpu/kvq_attn_cpu.h: ott_cuda_kvq_attn on
//                 packed groups (same arguments, device pointers), ott_cuda_kvq_layer_attn on
//                 a cache layer's tiles; each group's keys split over n_splits thread blocks
//                 (ott_cuda_kvq_attn_splits), their partials in `partials`, then merged
#pragma once

#include "cuda/ott_cuda.h"
#include "kv/kvq_types.h"

#include <cuda_runtime.h>
#include <stdint.h>

// n blocks, each of one KV head: k, v fp16 [n][block][head_dim]; tables [n] (device pointers
// inside); out [n] head-blocks of ott_kvq_block_layout_of(g).size bytes; scratch [n] of
// ott_cuda_kvq_event_scratch(g) bytes each (0 where a block's scratch fits in shared memory).
size_t ott_cuda_kvq_event_scratch(const ott_kvq_geom & g);
cudaError_t ott_cuda_kvq_event(const ott_kvq_geom & g, const ott_kvq_tables * tabs, const ott_fp16 * k,
                               const ott_fp16 * v, int32_t n, uint8_t * out, uint8_t * scratch, cudaStream_t stream);

constexpr int OTT_CUDA_KVQ_ROWS = 16;  // query rows of a group, at most

// Splits of each group's keys for n_groups groups of up to max_rows rows over at most
// max_keys keys (head-block slots and fp16 rows) on n_sm multiprocessors; 1 where the
// geometry's kernel does not split. The attention then needs ott_cuda_kvq_partial_floats
// floats of device memory for its partials (0: none).
int32_t ott_cuda_kvq_attn_splits(const ott_kvq_geom & g, int32_t n_groups, int32_t max_rows, int64_t max_keys,
                                 int32_t n_sm);
size_t ott_cuda_kvq_partial_floats(const ott_kvq_geom & g, int32_t n_groups, int32_t n_splits);
// Whether groups of max_rows rows are attended on tensor cores (fp16 operands: a looser error
// budget than the float32 kernels').
bool ott_cuda_kvq_attn_tensor_cores(const ott_kvq_geom & g, int32_t max_rows);

// n_groups query groups, group i: tables tabs[i], stores st[i], rows q + i·n_q·head_dim,
// output out + i·n_q·head_dim (all device memory); n_q <= OTT_CUDA_KVQ_ROWS.
cudaError_t ott_cuda_kvq_attn(const ott_kvq_geom & g, const ott_kvq_tables * tabs, const ott_kvq_head_stores * st,
                              int32_t n_groups, const ott_rope_table & rope, const float * q, int32_t n_q,
                              float kq_scale, int32_t n_splits, float * partials, float * out, cudaStream_t stream);

// The runtime cache (cuda/ott_cuda.h's stores, head-blocks of ott_kvq_block_layout_of(g).size
// bytes): events of one layer in every KV head, tables tabs [n_head_kv] (device), scratch of
// n_events·n_head_kv·ott_cuda_kvq_event_scratch(g) bytes; at most one event per sequence.
cudaError_t ott_cuda_kvq_layer_event(const ott_kvq_geom & g, const ott_cuda_kv_layer & L, const ott_kvq_tables * tabs,
                                     const ott_cuda_event * events, int32_t n_events, uint8_t * scratch,
                                     cudaStream_t stream);
// Attention of n_tiles tiles (each at most max_rows <= OTT_CUDA_KVQ_ROWS rows) over layer L's
// stores and the chunk's k, v (keys before RoPE when rope.cs is non-null, else none rotated):
// writes the tiles' rows of out F32 [head_dim*n_head, n_tokens] (row stride out_nb1 floats).
cudaError_t ott_cuda_kvq_layer_attn(const ott_kvq_geom & g, const ott_cuda_kv_layer & L, const ott_kvq_tables * tabs,
                                    const ott_rope_table & rope, ott_cuda_f32_3d q, ott_cuda_f32_3d k,
                                    ott_cuda_f32_3d v, int32_t n_rep, const ott_cuda_attn_tile * tiles, int32_t n_tiles,
                                    int32_t max_rows, float kq_scale, int32_t n_splits, float * partials, float * out,
                                    int64_t out_nb1, cudaStream_t stream);
