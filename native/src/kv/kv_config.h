// kv_config.h — the knobs of the quantized KV cache, validated and resolved for a model
// (docs/design.md §2; ott_gguf/reference/config.py is the Python twin of the rules).
#pragma once

#include "common.h"
#include "kv/kv_layout.h"

#include <cstddef>

struct ott_kv_shape;

struct ott_kv_config {
    ott_kv_geom geom;            // head_dim, block, bits, groups
    ott_kv_block_layout layout;  // offsets inside a head-block
    int32_t window;              // R: the fp16 window keeps R .. R+block-1 recent tokens
    int32_t pool;                // outlier-pool capacity per KV head
    int32_t extra_pool;          // extra-pool capacity per KV head
    int32_t skip_layers;         // layers 0 .. skip_layers-1 do not trace outliers
    int32_t sink;                // first tokens of a sequence kept in fp16
    int32_t prefill_fp16;        // 1: a multi-token chunk defers its quantization events
    int32_t rot_k, rot_v;        // ott_kv_rot_kind of keys and of values (kv_rotation.h)
    int32_t n_layer;
    int32_t n_head_kv;

    bool traces(int il) const { return pool > 0 && il >= skip_layers; }
    int32_t pool_cap(int il) const { return traces(il) ? pool : 0; }
    int32_t extra_cap(int il) const { return traces(il) ? extra_pool : 0; }
    // Bytes of one event's head-blocks: the n_head_kv head-blocks of a layer side by side.
    size_t event_bytes() const { return (size_t)layout.size * (size_t)n_head_kv; }
};

// Validate every knob (one line naming the bad one) and resolve them for the model.
ott_status ott_kv_config_resolve(const ott_kv_params & params, const ott_kv_shape & shape, ott_kv_config & out);
