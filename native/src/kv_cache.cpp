// kv_cache.cpp — choose the cache implementation for a mode.
#include "kv_cache.h"

ott_status ott_kv_cache_create(const ott_kv_params & params, const ott_kv_shape & shape,
                               std::unique_ptr<ott_kv_cache> & out) {
    switch (params.type) {
        case OTT_KV_F16: return ott_kv_f16_create(shape, out);
        default: return ott_fail(OTT_ERR_INVALID_ARG, "unknown KV cache type %d", params.type);
    }
}
