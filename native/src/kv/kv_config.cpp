// kv_config.cpp — validation of the quantized cache's knobs (kv_config.h).
#include "kv/kv_config.h"

#include "kv/kv_cache.h"
#include "kv/kv_kvq.h"

#include <algorithm>
#include <cmath>
#include <utility>

size_t ott_kvq_layer_floats(const ott_kv_params & p, int32_t n_head_kv, int32_t head_dim) {
    return 2 * (size_t)n_head_kv * head_dim + ((size_t)1 << p.bits_k) + ((size_t)1 << p.bits_v);
}

namespace {

ott_status bad(const char * what, int32_t value, const char * rule) {
    return ott_fail(OTT_ERR_INVALID_ARG, "kv config: %s=%d %s", what, value, rule);
}

// Keys cached before RoPE (either scheme): the model's RoPE must be plain, its rotation is
// then applied to every key at its position in attention.
ott_status resolve_pre_rope(const ott_kv_params & p, const ott_kv_shape & shape, ott_kv_config & cfg) {
    if (p.pre_rope != 0 && p.pre_rope != 1) return bad("pre_rope", p.pre_rope, "must be 0 or 1");
    if (p.pre_rope && !shape.rope_plain) {
        return ott_fail(OTT_ERR_UNSUPPORTED, "kv config: pre-RoPE keys need a plain RoPE (this model scales it: YaRN, "
                                             "frequency factors or an attention factor); use pre_rope=0");
    }
    if (p.pre_rope && (shape.rope_n_rot <= 0 || shape.rope_n_rot % 2 || shape.rope_n_rot > shape.n_embd_head))
        return bad("pre_rope", p.pre_rope, "needs an even RoPE dimension count up to head_dim");
    cfg.pre_rope        = p.pre_rope;
    cfg.rope_n_rot      = shape.rope_n_rot;
    cfg.rope_neox       = shape.rope_neox;
    cfg.rope_freq_base  = shape.rope_freq_base;
    cfg.rope_freq_scale = shape.rope_freq_scale;
    return OTT_OK;
}

// KVQuant (OTT_KV_KVQUANT): its own rules (ott_gguf/reference/config.py: _check_kvq), then
// the calibrated tables copied in, key thresholds turned into zero and scale.
ott_status resolve_kvq(const ott_kv_params & p, const ott_kv_shape & shape, ott_kv_config & cfg, bool tables) {
    const int32_t hd = shape.n_embd_head;
    for (const auto & [name, bits] : { std::pair { "bits_k", p.bits_k }, std::pair { "bits_v", p.bits_v } }) {
        if (bits < 2 || bits > 4) return bad(name, bits, "is not one of 2, 3, 4 (KVQuant codebooks)");
    }
    if (p.block < 8 || p.block % 8 || (int64_t)p.block * hd > 65536)
        return bad("block", p.block, "must be a multiple of 8 with block*head_dim <= 65536 (KVQuant)");
    if (p.group_k != p.block) return bad("group_k", p.group_k, "must equal block (KVQuant: calibrated key ranges)");
    if (std::min(p.group_v, hd) != hd) return bad("group_v", p.group_v, "must be >= head_dim (KVQuant: per token)");
    if (hd * p.bits_v % 8) return bad("bits_v", p.bits_v, "does not fill whole bytes per token (KVQuant)");
    const std::pair<const char *, int32_t> unused[] = {
        { "pool", p.pool },     { "extra_pool", p.extra_pool },     { "clip", p.clip },  { "rot_k", p.rot_k },
        { "rot_v", p.rot_v },   { "key_axis", p.key_axis },         { "hi_k", p.hi_k },  { "lo_k", p.lo_k },
        { "recent", p.recent }, { "prefill_fp16", p.prefill_fp16 }, { "sym_v", p.sym_v }
    };
    for (const auto & [name, value] : unused) {
        if (value != 0) return bad(name, value, "does not apply to KVQuant (must be 0)");
    }
    if (p.param_bits != 0 && p.param_bits != 16) return bad("param_bits", p.param_bits, "must be 16 with KVQuant");
    if (p.outliers < 0 || p.outliers > 1000) return bad("outliers", p.outliers, "must be 0 .. 1000 per 10000");
    OTT_TRY(resolve_pre_rope(p, shape, cfg));
    if (tables && !p.kvq_tables) return ott_fail(OTT_ERR_INVALID_ARG, "kv config: KVQuant needs its calibrated tables");

    cfg.kvq         = 1;
    cfg.kvq_geom    = { hd, p.block, p.bits_k, p.bits_v, ott_kvq_n_out(p.outliers, p.block, hd) };
    cfg.kvq_layout  = ott_kvq_block_layout_of(&cfg.kvq_geom);
    cfg.geom        = { hd, p.block, p.bits_k, p.bits_v, p.block, hd, 0, 16, 0, 0, 0, 0 };
    cfg.layout      = ott_kv_block_layout {};
    cfg.layout.size = cfg.kvq_layout.size;
    if (!tables) return OTT_OK;

    const size_t per_layer = ott_kvq_layer_floats(p, shape.n_head_kv, hd), n_k = (size_t)shape.n_head_kv * hd;
    const int32_t n_lk = 1 << p.bits_k, n_lv = 1 << p.bits_v;
    cfg.kvq_keys.resize((size_t)shape.n_layer * 2 * n_k);
    cfg.kvq_levels.resize((size_t)shape.n_layer * (n_lk + n_lv));
    for (int il = 0; il < shape.n_layer; ++il) {
        const float * t = p.kvq_tables + il * per_layer;  // k_lo, k_hi, levels_k, levels_v
        for (size_t i = 0; i < per_layer; ++i) {
            if (!std::isfinite(t[i]))
                return ott_fail(OTT_ERR_INVALID_ARG, "kv config: KVQuant table of layer %d holds a non-finite value",
                                il);
        }
        for (size_t i = 0; i < n_k; ++i) {
            if (t[n_k + i] < t[i])
                return ott_fail(OTT_ERR_INVALID_ARG, "kv config: KVQuant key thresholds of layer %d: hi < lo", il);
        }
        const float * lv = t + 2 * n_k;
        for (int32_t j = 1; j < n_lk + n_lv; ++j) {
            if (j != n_lk && !(lv[j - 1] < lv[j]))
                return ott_fail(OTT_ERR_INVALID_ARG, "kv config: KVQuant codebook of layer %d is not ascending", il);
        }
        std::copy(lv, lv + n_lk + n_lv, cfg.kvq_levels.begin() + (size_t)il * (n_lk + n_lv));
        for (int32_t h = 0; h < shape.n_head_kv; ++h) {
            float * zs = cfg.kvq_keys.data() + ((size_t)il * shape.n_head_kv + h) * 2 * hd;
            ott_kvq_channel_params_ref(t + (size_t)h * hd, t + n_k + (size_t)h * hd, hd, zs, zs + hd);
        }
    }
    return OTT_OK;
}

}  // namespace

ott_status ott_kv_config_resolve(const ott_kv_params & p, const ott_kv_shape & shape, ott_kv_config & cfg,
                                 bool tables) {
    const int32_t hd = shape.n_embd_head;
    cfg              = ott_kv_config {};
    cfg.window       = p.window;
    cfg.sink         = p.sink;
    cfg.skip_layers  = p.skip_layers;
    cfg.n_layer      = shape.n_layer;
    cfg.n_head_kv    = shape.n_head_kv;
    if (p.window < 0) return bad("window", p.window, "must be >= 0");
    if (p.sink < 0) return bad("sink", p.sink, "must be >= 0");
    if (p.type == OTT_KV_KVQUANT) return resolve_kvq(p, shape, cfg, tables);
    if (p.outliers || p.kvq_tables)
        return bad("outliers", p.outliers, "and kvq_tables apply to KVQuant only (must be 0)");
    OTT_TRY(resolve_pre_rope(p, shape, cfg));
    if (p.pre_rope && p.rot_k) {
        return bad("rot_k", p.rot_k,
                   "does not compose with pre_rope=1 (a rotation of keys before RoPE mixes the pairs it turns)");
    }
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
    if (p.skip_layers < 0) return bad("skip_layers", p.skip_layers, "must be >= 0");
    if (p.pool < 0 || p.pool >= p.block) return bad("pool", p.pool, "must be in 0..block-1");
    if (p.extra_pool < 0 || (p.extra_pool && !p.pool))
        return bad("extra_pool", p.extra_pool, "needs pool > 0 and must be >= 0");
    if (p.type == OTT_KV_KIVI && p.pool) return bad("pool", p.pool, "must be 0 in KIVI mode");
    if (p.type == OTT_KV_OTT && !p.pool) return bad("pool", p.pool, "must be > 0 in OTT mode");
    if (p.prefill_fp16 != 0 && p.prefill_fp16 != 1) return bad("prefill_fp16", p.prefill_fp16, "must be 0 or 1");
    if (p.clip != 0 && p.clip != 1) return bad("clip", p.clip, "must be 0 or 1");
    if (p.sym_v != 0 && p.sym_v != 1) return bad("sym_v", p.sym_v, "must be 0 or 1");
    const int32_t param_bits = p.param_bits == 0 ? 16 : p.param_bits;
    if (param_bits != 16 && param_bits != 8) return bad("param_bits", p.param_bits, "is not 16 or 8");
    for (const auto & [name, kind] : { std::pair { "rot_k", p.rot_k }, std::pair { "rot_v", p.rot_v } }) {
        if (kind < 0 || kind > 2) return bad(name, kind, "is not 0 (none), 1 (hadamard) or 2 (calibrated)");
        if (kind == 1 && (hd & (hd - 1))) {
            return ott_fail(OTT_ERR_INVALID_ARG,
                            "kv config: %s=hadamard needs a head size that is a power of two, not %d", name, hd);
        }
        if (kind == 2 && tables && !p.calib_path) {
            return ott_fail(OTT_ERR_INVALID_ARG, "kv config: %s=calibrated needs a calibration sidecar", name);
        }
    }

    if (p.hi_k < 0 || p.lo_k < 0 || p.hi_k + p.lo_k > OTT_KV_TIER_UNIT)
        return bad("hi_k", p.hi_k, "and lo_k must be >= 0 with hi_k + lo_k <= 16");
    if ((p.hi_k || p.lo_k) &&
        (p.bits_k != 2 || p.key_axis || group_k != p.block || hd % OTT_KV_TIER_UNIT || hd > 256)) {
        return ott_fail(OTT_ERR_INVALID_ARG,
                        "kv config: key tiers (hi_k=%d, lo_k=%d) need bits_k=2, key_axis=0, group_k=block and a "
                        "head size that is a multiple of 16 up to 256",
                        p.hi_k, p.lo_k);
    }
    const int32_t n_hi = p.hi_k * hd / OTT_KV_TIER_UNIT, n_lo = p.lo_k * hd / OTT_KV_TIER_UNIT;
    cfg.geom = {
        hd, p.block, p.bits_k, p.bits_v, group_k, group_v, p.clip, param_bits, p.key_axis, n_hi, n_lo, p.sym_v
    };
    cfg.layout     = ott_kv_block_layout_of(&cfg.geom);
    cfg.pool       = p.pool;
    cfg.extra_pool = p.extra_pool;
    if (p.tier_scale && (n_hi || n_lo)) {
        cfg.tier_scale.assign(p.tier_scale, p.tier_scale + (size_t)shape.n_layer * shape.n_head_kv * hd);
        for (const float u : cfg.tier_scale) {
            if (!(u >= 0.0f && u <= 1e30f))
                return ott_fail(OTT_ERR_INVALID_ARG, "kv config: a key-tier query scale is outside 0 .. 1e30 (or NaN)");
        }
    }
    if (p.recent < 0 || p.recent > 64) return bad("recent", p.recent, "must be 0 .. 64 blocks");
    if (p.recent && (p.bits_k > OTT_KV_RECENT_BITS || p.bits_v > OTT_KV_RECENT_BITS)) {
        return ott_fail(OTT_ERR_INVALID_ARG,
                        "kv config: recent=%d needs codes of at most %d bits (bits_k=%d, bits_v=%d)", p.recent,
                        OTT_KV_RECENT_BITS, p.bits_k, p.bits_v);
    }
    cfg.recent       = p.recent;
    cfg.rgeom        = ott_kv_recent_geom(&cfg.geom);
    cfg.rlayout      = ott_kv_block_layout_of(&cfg.rgeom);
    cfg.prefill_fp16 = p.prefill_fp16;
    cfg.rot_k        = p.rot_k;
    cfg.rot_v        = p.rot_v;
    return OTT_OK;
}
