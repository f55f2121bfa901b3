// kv_calib.cpp — reading and checking the calibration sidecar (kv_calib.h).
#include "kv/kv_calib.h"

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

namespace {

constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull;

uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

struct gguf_owner {
    gguf_context * g    = nullptr;
    ggml_context * data = nullptr;
    ~gguf_owner() {
        if (g) gguf_free(g);
        if (data) ggml_free(data);
    }
};

// The value of integer key `key`, or -1.
int64_t int_of(const gguf_context * g, const char * key) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0) return -1;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, id);
        case GGUF_TYPE_INT32:  return gguf_get_val_i32(g, id);
        case GGUF_TYPE_UINT64: return (int64_t)gguf_get_val_u64(g, id);
        case GGUF_TYPE_INT64:  return gguf_get_val_i64(g, id);
        default:               return -1;
    }
}

std::string str_of(const gguf_context * g, const char * key) {
    const int64_t id = gguf_find_key(g, key);
    return id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_STRING ? gguf_get_val_str(g, id) : "";
}

// The F32 tensor `name` of shape [ne0, ne1, ne2] as floats, checked finite.
ott_status tensor_of(const char * path, ggml_context * data, const std::string & name, int64_t ne0, int64_t ne1,
                     int64_t ne2, std::vector<float> & out) {
    const ggml_tensor * t = ggml_get_tensor(data, name.c_str());
    if (!t) return ott_fail(OTT_ERR_FORMAT, "%s: calibration sidecar has no tensor '%s'", path, name.c_str());
    if (t->type != GGML_TYPE_F32 || t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2 || t->ne[3] != 1) {
        return ott_fail(OTT_ERR_FORMAT,
                        "%s: calibration tensor '%s' is %s [%lld, %lld, %lld], expected f32 [%lld, %lld, %lld]", path,
                        name.c_str(), ggml_type_name(t->type), (long long)t->ne[0], (long long)t->ne[1],
                        (long long)t->ne[2], (long long)ne0, (long long)ne1, (long long)ne2);
    }
    const float * x = (const float *)t->data;
    out.assign(x, x + ggml_nelements(t));
    for (float v : out) {
        if (!std::isfinite(v))
            return ott_fail(OTT_ERR_FORMAT, "%s: calibration tensor '%s' holds a non-finite value", path, name.c_str());
    }
    return OTT_OK;
}

// Each of the heads matrices of r (d x d, row-major) keeps the length of 8 fixed random
// vectors, and so does its transpose, to 1e-4: what an orthogonal matrix does, and what a
// corrupted or unnormalised one does not (a full R Rᵀ check would cost d³ per head).
ott_status check_orthogonal(const char * path, const std::string & name, const std::vector<float> & r, int d,
                            int heads) {
    uint64_t state = GOLDEN;
    std::vector<double> x(d);
    for (int probe = 0; probe < 8; ++probe) {
        double nx = 0;
        for (double & e : x) {
            state += GOLDEN;
            e = (double)(mix(state) >> 11) * 0x1p-53 - 0.5;
            nx += e * e;
        }
        for (int h = 0; h < heads; ++h) {
            const float * m = r.data() + (size_t)h * d * d;
            double ny = 0, nt = 0;
            for (int i = 0; i < d; ++i) {
                double y = 0, t = 0;
                for (int j = 0; j < d; ++j) {
                    y += (double)m[(size_t)i * d + j] * x[j];
                    t += (double)m[(size_t)j * d + i] * x[j];
                }
                ny += y * y;
                nt += t * t;
            }
            if (std::fabs(ny / nx - 1.0) > 1e-4 || std::fabs(nt / nx - 1.0) > 1e-4) {
                return ott_fail(OTT_ERR_FORMAT,
                                "%s: calibration rotation '%s' of KV head %d is not orthogonal "
                                "(it scales a vector's length by %.6f)",
                                path, name.c_str(), h, std::sqrt(ny / nx));
            }
        }
    }
    return OTT_OK;
}

}  // namespace

ott_status ott_gguf_data_hash(const char * path, uint64_t data_offset, uint64_t & out) {
    std::unique_ptr<FILE, decltype(&fclose)> f(fopen(path, "rb"), fclose);
    if (!f || fseeko(f.get(), (off_t)data_offset, SEEK_SET) != 0) {
        return ott_fail(OTT_ERR_IO, "%s: cannot read the tensor data to identify the model", path);
    }
    std::vector<uint64_t> buf(1 << 16);
    uint64_t h = 0, i = 0, n_bytes = 0;
    for (;;) {
        const size_t got = fread(buf.data(), 1, buf.size() * 8, f.get());
        if (got == 0) break;
        std::memset((char *)buf.data() + got, 0, (8 - got % 8) % 8);  // zero-pad the last word
        for (size_t w = 0; w < (got + 7) / 8; ++w, ++i) h += mix(buf[w] ^ (i * GOLDEN));
        n_bytes += got;
    }
    out = mix(h ^ n_bytes);
    return OTT_OK;
}

extern "C" ott_status ott_model_fingerprint(const ott_model * m, uint64_t * out) {
    if (!m || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_model_fingerprint: null argument");
    return ott_gguf_data_hash(m->path.c_str(), gguf_get_data_offset(m->gguf), *out);
}

ott_status ott_kv_calib_load(const char * path, const ott_model & m, bool want_k, bool want_v,
                             std::vector<ott_kv_rot_layer> & out) {
    gguf_owner o;
    gguf_init_params gp = { /*no_alloc =*/false, /*ctx =*/&o.data };
    o.g                 = gguf_init_from_file(path, gp);
    if (!o.g)
        return ott_fail(OTT_ERR_FORMAT, "%s: cannot read the calibration sidecar (missing, truncated or not GGUF)",
                        path);

    const ott_hparams & hp = m.hparams;
    const std::string arch = str_of(o.g, "ott.calib.architecture");
    const int64_t n_layer = int_of(o.g, "ott.calib.block_count"), n_kv = int_of(o.g, "ott.calib.head_count_kv");
    const int64_t d = int_of(o.g, "ott.calib.key_length");
    if (arch.empty() || n_layer < 0 || n_kv < 0 || d < 0 || gguf_find_key(o.g, "ott.calib.model_hash") < 0) {
        return ott_fail(OTT_ERR_FORMAT, "%s: not a calibration sidecar (its ott.calib.* keys are missing)", path);
    }
    if (arch != hp.arch_name || n_layer != hp.n_layer || n_kv != hp.n_head_kv || d != hp.n_embd_head) {
        return ott_fail(OTT_ERR_INVALID_ARG,
                        "%s: calibration sidecar is for another model (%s, %lld layers, %lld KV heads of %lld; "
                        "this model: %s, %d, %d of %d)",
                        path, arch.c_str(), (long long)n_layer, (long long)n_kv, (long long)d, hp.arch_name.c_str(),
                        hp.n_layer, hp.n_head_kv, hp.n_embd_head);
    }
    uint64_t hash = 0;
    OTT_TRY(ott_gguf_data_hash(m.path.c_str(), gguf_get_data_offset(m.gguf), hash));
    char hex[17];
    snprintf(hex, sizeof(hex), "%016" PRIx64, hash);
    if (str_of(o.g, "ott.calib.model_hash") != hex) {
        return ott_fail(OTT_ERR_INVALID_ARG,
                        "%s: calibration sidecar is for another model file (model hash %s, this file %s)", path,
                        str_of(o.g, "ott.calib.model_hash").c_str(), hex);
    }

    out.assign(hp.n_layer, ott_kv_rot_layer {});
    for (int il = 0; il < hp.n_layer; ++il) {
        ott_kv_rot_layer & L = out[il];
        const std::string i  = std::to_string(il);
        if (want_k) {
            OTT_TRY(tensor_of(path, o.data, "ott.rot_k." + i, d, d, n_kv, L.r_k));
            OTT_TRY(check_orthogonal(path, "ott.rot_k." + i, L.r_k, (int)d, (int)n_kv));
            OTT_TRY(tensor_of(path, o.data, "ott.center_k." + i, d, n_kv, 1, L.c_k));
        }
        if (want_v) {
            OTT_TRY(tensor_of(path, o.data, "ott.rot_v." + i, d, d, n_kv, L.r_v));
            OTT_TRY(check_orthogonal(path, "ott.rot_v." + i, L.r_v, (int)d, (int)n_kv));
            OTT_TRY(tensor_of(path, o.data, "ott.center_v." + i, d, n_kv, 1, L.c_v));
        }
    }
    return OTT_OK;
}
