// metadata.cpp — the model's GGUF metadata and tensor list through the C API.
#include "model.h"

#include <cstring>

static ott_status check_kv(const ott_model * m, int64_t i) {
    if (!m) return ott_fail(OTT_ERR_INVALID_ARG, "null model");
    if (i < 0 || i >= gguf_get_n_kv(m->gguf)) {
        return ott_fail(OTT_ERR_INVALID_ARG, "metadata index %lld is out of range", (long long)i);
    }
    return OTT_OK;
}

extern "C" ott_status ott_model_meta_count(const ott_model * m, int64_t * out) {
    if (!m || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_model_meta_count: null argument");
    *out = gguf_get_n_kv(m->gguf);
    return OTT_OK;
}

extern "C" ott_status ott_model_meta_get(const ott_model * m, int64_t i, ott_meta_kv * out) {
    OTT_TRY(check_kv(m, i));
    if (!out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_model_meta_get: null argument");
    memset(out, 0, sizeof(*out));
    const gguf_type t = gguf_get_kv_type(m->gguf, i);
    out->key          = gguf_get_key(m->gguf, i);
    out->type         = t;
    out->n            = 1;
    if (t == GGUF_TYPE_ARRAY) {
        out->elem_type = gguf_get_arr_type(m->gguf, i);
        out->n         = (int64_t)gguf_get_arr_n(m->gguf, i);
        if (out->elem_type != GGUF_TYPE_STRING && out->elem_type != GGUF_TYPE_ARRAY) {
            out->data = gguf_get_arr_data(m->gguf, i);
        }
    } else if (t == GGUF_TYPE_STRING) {
        out->str = gguf_get_val_str(m->gguf, i);
    } else {
        out->data = gguf_get_val_data(m->gguf, i);
    }
    return OTT_OK;
}

extern "C" ott_status ott_model_meta_arr_str(const ott_model * m, int64_t i, int64_t j, const char ** out) {
    OTT_TRY(check_kv(m, i));
    if (!out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_model_meta_arr_str: null argument");
    if (gguf_get_kv_type(m->gguf, i) != GGUF_TYPE_ARRAY || gguf_get_arr_type(m->gguf, i) != GGUF_TYPE_STRING) {
        return ott_fail(OTT_ERR_INVALID_ARG, "metadata '%s' is not a string array", gguf_get_key(m->gguf, i));
    }
    if (j < 0 || j >= (int64_t)gguf_get_arr_n(m->gguf, i)) {
        return ott_fail(OTT_ERR_INVALID_ARG, "element %lld of '%s' is out of range", (long long)j,
                        gguf_get_key(m->gguf, i));
    }
    *out = gguf_get_arr_str(m->gguf, i, (size_t)j);
    return OTT_OK;
}

extern "C" ott_status ott_model_tensor_count(const ott_model * m, int64_t * out) {
    if (!m || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_model_tensor_count: null argument");
    *out = gguf_get_n_tensors(m->gguf);
    return OTT_OK;
}

extern "C" ott_status ott_model_tensor_get(const ott_model * m, int64_t i, ott_tensor_desc * out) {
    if (!m || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_model_tensor_get: null argument");
    if (i < 0 || i >= gguf_get_n_tensors(m->gguf)) {
        return ott_fail(OTT_ERR_INVALID_ARG, "tensor index %lld is out of range", (long long)i);
    }
    const char * name     = gguf_get_tensor_name(m->gguf, i);
    const ggml_tensor * t = ggml_get_tensor(m->ctx_meta, name);
    out->name             = name;
    out->type_name        = ggml_type_name(gguf_get_tensor_type(m->gguf, i));
    for (int d = 0; d < 4; ++d) out->ne[d] = t ? t->ne[d] : 0;
    out->n_bytes     = (int64_t)gguf_get_tensor_size(m->gguf, i);
    out->file_offset = (int64_t)(gguf_get_data_offset(m->gguf) + gguf_get_tensor_offset(m->gguf, i));
    return OTT_OK;
}
