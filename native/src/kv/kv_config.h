// kv_config.h — the knobs of the quantized KV cache, validated and resolved for a model
// (docs/design.md §2; ott_gguf/reference/config.py is the Python twin of the rules).
#pragma once

#include "common.h"
#include "kv/kv_layout.h"
#include "kv/kvq_types.h"

#include <cstddef>
#include <vector>

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
    std::vector<float> tier_scale;  // [n_layer][n_head_kv][head_dim] query scale of the key tiers, or empty: 1
    // Recent blocks: the newest `recent` blocks are head-blocks of rgeom / rlayout (4-bit keys
    // and values); an event re-codes the block `recent` events older into geom.
    int32_t recent;
    ott_kv_geom rgeom;
    ott_kv_block_layout rlayout;

    // The KVQuant scheme (kvq = 1; kv/kv_kvq.h): the schedule of geom.block and sink as above,
    // no pools, head-blocks of kvq_layout (layout.size is theirs; its other offsets unused).
    int32_t kvq;
    ott_kvq_geom kvq_geom;
    ott_kvq_block_layout kvq_layout;
    std::vector<float> kvq_keys;    // [n_layer][n_head_kv][2][head_dim]: k_zero, k_scale
    std::vector<float> kvq_levels;  // [n_layer][2^bits_k + 2^bits_v]: levels_k, levels_v
    int32_t pre_rope;               // 1: keys cached before RoPE (either scheme), rotated in attention
    int32_t rope_n_rot, rope_neox;  // the model's RoPE (with pre_rope)
    float rope_freq_base, rope_freq_scale;

    bool traces(int il) const { return pool > 0 && il >= skip_layers; }
    int32_t pool_cap(int il) const { return traces(il) ? pool : 0; }
    int32_t extra_cap(int il) const { return traces(il) ? extra_pool : 0; }
    // Bytes of one event's head-blocks: the n_head_kv head-blocks of a layer side by side.
    size_t event_bytes() const { return (size_t)layout.size * (size_t)n_head_kv; }
    // Whether block b of a sequence holding n_blocks is a recent one.
    bool is_recent(int32_t b, int32_t n_blocks) const { return b >= n_blocks - recent; }
    // How many of n_blocks blocks are recent ones (held in the recent ring).
    int32_t n_recent(int32_t n_blocks) const { return n_blocks < recent ? n_blocks : recent; }
    // Bytes of one event's recent head-blocks.
    size_t recent_event_bytes() const { return (size_t)rlayout.size * (size_t)n_head_kv; }
    // This config as it reads a recent block (geom, layout of the recent blocks, no tiers).
    ott_kv_config recent_view() const {
        ott_kv_config r = *this;
        r.geom = rgeom, r.layout = rlayout, r.recent = 0;
        r.tier_scale.clear();
        return r;
    }
    // The key tiers' query scale of KV head h of layer il, float [head_dim], or null (1).
    const float * tier_scale_of(int il, int32_t h) const {
        return tier_scale.empty() ? nullptr : tier_scale.data() + ((size_t)il * n_head_kv + h) * geom.head_dim;
    }
    // The calibrated tables of KV head h of layer il (kvq).
    ott_kvq_tables kvq_tables(int il, int32_t h) const {
        const size_t hd = (size_t)geom.head_dim, n_lv = ((size_t)1 << geom.bits_k) + ((size_t)1 << geom.bits_v);
        const float * k  = kvq_keys.data() + ((size_t)il * n_head_kv + h) * 2 * hd;
        const float * lv = kvq_levels.data() + (size_t)il * n_lv;
        return { k, k + hd, lv, lv + ((size_t)1 << geom.bits_k) };
    }
};

// Floats of one layer's part of ott_kv_params::kvq_tables.
size_t ott_kvq_layer_floats(const ott_kv_params & p, int32_t n_head_kv, int32_t head_dim);

// Validate every knob (one line naming the bad one) and resolve them for the model. With
// tables = false only the geometry is resolved (sizes, ott_kv_quant_seq_bytes): KVQuant's
// tables and a calibrated rotation's sidecar are neither needed nor read.
ott_status ott_kv_config_resolve(const ott_kv_params & params, const ott_kv_shape & shape, ott_kv_config & out,
                                 bool tables = true);
