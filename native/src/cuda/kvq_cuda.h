// kvq_cuda.h — CUDA kernels of the KVQuant cache, as seen by host code (tests/cuda_ops.cpp;
// the runtime's KVQuant cache is still to come). One op per .cu file; each launcher takes
// the stream and returns the launch status:
//
//   ott_cuda_kvq_event  kvq_event.cu  quantization of blocks into KVQuant head-blocks, bit for
//                                     bit ott_kvq_quantize_block_ref (kv/kv_kvq.h)
//   ott_cuda_kvq_attn   kvq_attn.cu   attention of one KV head's query rows over its stores:
//                                     codebook lookup and RoPE at each key's position, as
//                                     cpu/kvq_attn_cpu.h (same arguments, device pointers)
#pragma once

#include "kv/kvq_types.h"

#include <cuda_runtime.h>
#include <stdint.h>

// n blocks, each of one KV head: k, v fp16 [n][block][head_dim]; tables [n] (device pointers
// inside); out [n] head-blocks of ott_kvq_block_layout_of(g).size bytes; scratch [n] of
// ott_cuda_kvq_event_scratch(g) bytes each.
size_t ott_cuda_kvq_event_scratch(const ott_kvq_geom & g);
cudaError_t ott_cuda_kvq_event(const ott_kvq_geom & g, const ott_kvq_tables * tabs, const ott_fp16 * k,
                               const ott_fp16 * v, int32_t n, uint8_t * out, uint8_t * scratch, cudaStream_t stream);

// n_groups query groups, group i: tables tabs[i], stores st[i], rows q + i·n_q·head_dim,
// output out + i·n_q·head_dim (all device memory); n_q <= OTT_CUDA_KVQ_ROWS.
constexpr int OTT_CUDA_KVQ_ROWS = 16;
cudaError_t ott_cuda_kvq_attn(const ott_kvq_geom & g, const ott_kvq_tables * tabs, const ott_kvq_head_stores * st,
                              int32_t n_groups, const ott_rope_table & rope, const float * q, int32_t n_q,
                              float kq_scale, float * out, cudaStream_t stream);
