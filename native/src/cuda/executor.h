// executor.h — computes a step's graph on ggml-cuda when the KV cache attends outside the
// graph (kv_cache.h: external_attention). Owned by the context, it runs segment il of the
// graph (the nodes up to layer il's q, k, v) on ggml's stream and then the cache's kernels
// of layer il on its own stream, the two streams ordered by CUDA events (no host
// synchronisation inside a step); one synchronisation ends the step. No CUDA header here:
// the context is compiled the same with and without CUDA.
#pragma once

#include "common.h"

#include "ggml-backend.h"

class ott_kv_cache;
struct ott_cuda_executor;

ott_status ott_cuda_executor_create(ggml_backend_t backend, int cuda_device, ott_cuda_executor ** out);
void ott_cuda_executor_free(ott_cuda_executor * ex);
// Compute gf, whose attention of layers 0 .. n_layer-1 kv runs between the segments.
ott_status ott_cuda_executor_compute(ott_cuda_executor * ex, ggml_backend_t backend, ggml_cgraph * gf,
                                     ott_kv_cache & kv, int n_layer);
