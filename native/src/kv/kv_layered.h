// kv_layered.h — a KV cache for a model whose layers are of two kinds (kv_layered.cpp):
// local layers attend over a sliding window of n_swa positions and keep it in an fp16 ring
// (kv_f16.cpp), global layers attend over everything and use the cache of the chosen mode
// (ott_kv_cache_create for a shape of those layers only). Quantizing a ring of a few hundred
// tokens would save little and the quantized cache has no sliding window, so local layers
// stay fp16 in every mode.
#pragma once

#include "kv/kv_cache.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

// A ring of `rows` rows per sequence, holding the last `rows` positions of a sequence of
// n_held tokens, still holds every earlier position that a query at `pos` attends to with a
// window of n_swa positions: pos - n_swa + 1 .. pos - 1 (none at pos 0; n_swa = 0: no window,
// and nothing is ever overwritten).
inline bool ott_kv_ring_holds(int32_t n_swa, int32_t rows, int32_t n_held, int32_t pos) {
    return pos == 0 || n_swa == 0 || std::max(0, pos - n_swa + 1) >= n_held - rows;
}

// Rows per sequence of the fp16 cache for a shape: shape.n_ctx, padded on a GPU.
int32_t ott_kv_f16_seq_rows(const ott_kv_shape & shape);

// The fp16 cache with a sliding window of n_swa positions (0: none) in a ring of
// ott_kv_f16_seq_rows(shape) rows per sequence; a chunk of a sequence may take at most
// rows - n_swa + 1 tokens once the ring wraps.
ott_status ott_kv_f16_window_create(const ott_kv_shape & shape, int32_t n_swa, std::unique_ptr<ott_kv_cache> & out);

// Check params for a cache of this shape as ott_kv_cache_create would, creating nothing.
ott_status ott_kv_params_validate(const ott_kv_params & params, const ott_kv_shape & shape);

// The cache of a model whose layers il with local[il] != 0 attend over a window of n_swa
// positions. shape: the whole model (n_layer = local.size()); n_ubatch: the most tokens of
// one sequence in a step (the ring holds n_swa - 1 + n_ubatch positions, at most n_ctx).
// The quantized modes' skip_layers counts the model's layers (global layers below it skip).
ott_status ott_kv_layered_create(const ott_kv_params & params, const ott_kv_shape & shape,
                                 const std::vector<uint8_t> & local, int32_t n_swa, int32_t n_ubatch,
                                 std::unique_ptr<ott_kv_cache> & out);

// Bytes the cache ott_kv_layered_create would make holds at most for one sequence of
// shape.n_ctx tokens (ott.h: ott_kv_seq_bytes); needs neither KVQuant's tables nor a sidecar.
ott_status ott_kv_layered_seq_bytes(const ott_kv_params & params, const ott_kv_shape & shape,
                                    const std::vector<uint8_t> & local, int32_t n_swa, int32_t n_ubatch, int64_t & out);
