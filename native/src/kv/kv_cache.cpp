// kv_cache.cpp — choose the cache implementation for a mode, and the bytes it holds per sequence.
#include "kv/kv_cache.h"

#include "kv/kv_config.h"
#include "kv/kv_layered.h"
#include "kv/kv_report.h"

ott_status ott_kv_params_validate(const ott_kv_params & params, const ott_kv_shape & shape) {
    switch (params.type) {
        case OTT_KV_F16: {
            const int32_t knobs[] = { params.bits_k,      params.bits_v,   params.group_k,      params.group_v,
                                      params.block,       params.window,   params.pool,         params.extra_pool,
                                      params.skip_layers, params.sink,     params.prefill_fp16, params.clip,
                                      params.param_bits,  params.rot_k,    params.rot_v,        params.key_axis,
                                      params.pre_rope,    params.outliers, params.hi_k,         params.lo_k,
                                      params.recent,      params.sym_v };
            for (int32_t k : knobs) {
                if (k != 0)
                    return ott_fail(OTT_ERR_INVALID_ARG,
                                    "kv config: the fp16 cache takes no quantization knobs (all must be 0)");
            }
            if (params.calib_path || params.kvq_tables)
                return ott_fail(OTT_ERR_INVALID_ARG, "kv config: the fp16 cache takes no calibration sidecar");
            return OTT_OK;
        }
        case OTT_KV_KIVI:
        case OTT_KV_OTT:
        case OTT_KV_KVQUANT: {
            ott_kv_config cfg;
            return ott_kv_config_resolve(params, shape, cfg);
        }
        default: return ott_fail(OTT_ERR_INVALID_ARG, "unknown KV cache type %d", params.type);
    }
}

ott_status ott_kv_cache_create(const ott_kv_params & params, const ott_kv_shape & shape,
                               std::unique_ptr<ott_kv_cache> & out) {
    OTT_TRY(ott_kv_params_validate(params, shape));
    if (params.type == OTT_KV_F16) return ott_kv_f16_create(shape, out);
    ott_kv_config cfg;
    OTT_TRY(ott_kv_config_resolve(params, shape, cfg));
#ifdef OTT_USE_CUDA
    if (shape.cuda_device >= 0) return ott_kv_quant_cuda_create(cfg, shape, out);
#endif
    return ott_kv_quant_cpu_create(cfg, shape, out);
}

ott_status ott_kv_cache_seq_bytes(const ott_kv_params & params, const ott_kv_shape & shape, int64_t & out) {
    if (params.type == OTT_KV_F16) {
        OTT_TRY(ott_kv_params_validate(params, shape));
        out = (int64_t)ott_kv_f16_seq_rows(shape) * 2 * shape.n_embd_head * (int64_t)sizeof(ott_fp16) *
              shape.n_head_kv * shape.n_layer;
        return OTT_OK;
    }
    ott_kv_config cfg;
    OTT_TRY(ott_kv_config_resolve(params, shape, cfg, false));
    out = ott_kv_quant_seq_bytes(cfg, shape.n_ctx, shape.cuda_device >= 0);
    return OTT_OK;
}
