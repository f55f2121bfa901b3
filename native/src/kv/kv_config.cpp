// kv_config.cpp — validation of the quantized cache's knobs (kv_config.h).
#include "kv/kv_config.h"

#include "kv/kv_cache.h"

#include <algorithm>
#include <utility>

ott_status ott_kv_config_resolve(const ott_kv_params & p, const ott_kv_shape & shape, ott_kv_config & cfg) {
    const int32_t hd = shape.n_embd_head;
    auto bad         = [](const char * what, int32_t value, const char * rule) {
        return ott_fail(OTT_ERR_INVALID_ARG, "kv config: %s=%d %s", what, value, rule);
    };
    for (const auto & [name, bits] : { std::pair { "bits_k", p.bits_k }, std::pair { "bits_v", p.bits_v } }) {
        if (bits != 2 && bits != 4 && bits != 8) return bad(name, bits, "is not one of 2, 4, 8");
    }
    if (p.block < 8 || p.block % 8 || p.block > 8192)
        return bad("block", p.block, "must be a multiple of 8 in 8..8192");
    if (p.key_axis != 0 && p.key_axis != 1)
        return bad("key_axis", p.key_axis, "is not 0 (per channel) or 1 (per token)");
    const int32_t group_k = p.key_axis ? std::min(p.group_k, hd) : p.group_k;
    if (group_k <= 0 || (p.key_axis ? hd % group_k : p.block % group_k)) {
        return bad("group_k", group_k, p.key_axis ? "does not divide head_dim (per-token keys)" : "must divide block");
    }
    if (group_k * p.bits_k % 8) return bad("group_k", group_k, "does not fill whole bytes at bits_k");
    if (p.group_v <= 0 || p.group_v * p.bits_v % 8)
        return bad("group_v", p.group_v, "must be > 0 and fill whole bytes at bits_v");
    const int32_t group_v = std::min(p.group_v, hd);
    if (hd > 8192 || hd % group_v) return bad("group_v", group_v, "does not divide head_dim");
    if (p.window < 0) return bad("window", p.window, "must be >= 0");
    if (p.sink < 0) return bad("sink", p.sink, "must be >= 0");
    if (p.skip_layers < 0) return bad("skip_layers", p.skip_layers, "must be >= 0");
    if (p.pool < 0 || p.pool >= p.block) return bad("pool", p.pool, "must be in 0..block-1");
    if (p.extra_pool < 0 || (p.extra_pool && !p.pool))
        return bad("extra_pool", p.extra_pool, "needs pool > 0 and must be >= 0");
    if (p.type == OTT_KV_KIVI && p.pool) return bad("pool", p.pool, "must be 0 in KIVI mode");
    if (p.type == OTT_KV_OTT && !p.pool) return bad("pool", p.pool, "must be > 0 in OTT mode");
    if (p.prefill_fp16 != 0 && p.prefill_fp16 != 1) return bad("prefill_fp16", p.prefill_fp16, "must be 0 or 1");
    if (p.clip != 0 && p.clip != 1) return bad("clip", p.clip, "must be 0 or 1");
    const int32_t param_bits = p.param_bits == 0 ? 16 : p.param_bits;
    if (param_bits != 16 && param_bits != 8) return bad("param_bits", p.param_bits, "is not 16 or 8");
    if (param_bits == 8 && p.clip)
        return bad("clip", p.clip, "needs param_bits=16 (8-bit parameters take the min-max range)");
    for (const auto & [name, kind] : { std::pair { "rot_k", p.rot_k }, std::pair { "rot_v", p.rot_v } }) {
        if (kind < 0 || kind > 2) return bad(name, kind, "is not 0 (none), 1 (hadamard) or 2 (calibrated)");
        if (kind == 1 && (hd & (hd - 1))) {
            return ott_fail(OTT_ERR_INVALID_ARG,
                            "kv config: %s=hadamard needs a head size that is a power of two, not %d", name, hd);
        }
        if (kind == 2 && !p.calib_path) {
            return ott_fail(OTT_ERR_INVALID_ARG, "kv config: %s=calibrated needs a calibration sidecar", name);
        }
    }

    cfg              = ott_kv_config {};
    cfg.geom         = { hd, p.block, p.bits_k, p.bits_v, group_k, group_v, p.clip, param_bits, p.key_axis };
    cfg.layout       = ott_kv_block_layout_of(&cfg.geom);
    cfg.window       = p.window;
    cfg.pool         = p.pool;
    cfg.extra_pool   = p.extra_pool;
    cfg.skip_layers  = p.skip_layers;
    cfg.sink         = p.sink;
    cfg.prefill_fp16 = p.prefill_fp16;
    cfg.rot_k        = p.rot_k;
    cfg.rot_v        = p.rot_v;
    cfg.n_layer      = shape.n_layer;
    cfg.n_head_kv    = shape.n_head_kv;
    return OTT_OK;
}
