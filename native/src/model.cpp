// model.cpp — read a GGUF file: validate metadata and tensors, place weights on the chosen
// device in their stored types (on the CPU repacked where ggml has a faster layout, or as 8
// interleaved rows for our kernel: cpu/matmul_x8.h).
#include "model.h"
#include "cpu/matmul_x8.h"
#include "gguf_scan.h"

#include "ggml-alloc.h"
#include "ggml-cpu.h"
#ifdef OTT_USE_CUDA
#include "ggml-cuda.h"
#endif

#include <cerrno>
#include <cfloat>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>

namespace {

struct arch_desc {
    const char * name;
    ott_arch arch;
    int rope_type;
};

const arch_desc k_archs[] = {
    { "llama", OTT_ARCH_LLAMA, GGML_ROPE_TYPE_NORMAL }, { "mistral", OTT_ARCH_MISTRAL, GGML_ROPE_TYPE_NORMAL },
    { "qwen2", OTT_ARCH_QWEN2, GGML_ROPE_TYPE_NEOX },   { "qwen3", OTT_ARCH_QWEN3, GGML_ROPE_TYPE_NEOX },
    { "gemma3", OTT_ARCH_GEMMA3, GGML_ROPE_TYPE_NEOX }, { "phi3", OTT_ARCH_PHI3, GGML_ROPE_TYPE_NEOX },
};

struct file_closer {
    void operator()(FILE * f) const {
        if (f) fclose(f);
    }
};
using file_ptr = std::unique_ptr<FILE, file_closer>;

// Integer metadata of any GGUF integer type; returns false when absent or not an integer.
bool get_int(const gguf_context * g, const std::string & key, int64_t & out) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8:  out = gguf_get_val_u8(g, id); return true;
        case GGUF_TYPE_INT8:   out = gguf_get_val_i8(g, id); return true;
        case GGUF_TYPE_UINT16: out = gguf_get_val_u16(g, id); return true;
        case GGUF_TYPE_INT16:  out = gguf_get_val_i16(g, id); return true;
        case GGUF_TYPE_UINT32: out = gguf_get_val_u32(g, id); return true;
        case GGUF_TYPE_INT32:  out = gguf_get_val_i32(g, id); return true;
        case GGUF_TYPE_UINT64: out = (int64_t)gguf_get_val_u64(g, id); return true;
        case GGUF_TYPE_INT64:  out = gguf_get_val_i64(g, id); return true;
        default:               return false;
    }
}

bool get_float(const gguf_context * g, const std::string & key, float & out) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0) return false;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_FLOAT32: out = gguf_get_val_f32(g, id); return true;
        case GGUF_TYPE_FLOAT64: out = (float)gguf_get_val_f64(g, id); return true;
        default:                {
            int64_t v;
            if (!get_int(g, key, v)) return false;
            out = (float)v;
            return true;
        }
    }
}

std::string get_str(const gguf_context * g, const std::string & key) {
    const int64_t id = gguf_find_key(g, key.c_str());
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_STRING) return "";
    return gguf_get_val_str(g, id);
}

ott_status require_int(const ott_model * m, const std::string & key, int64_t lo, int64_t hi, int32_t & out) {
    int64_t v;
    if (!get_int(m->gguf, key, v)) {
        return ott_fail(OTT_ERR_FORMAT, "%s: missing integer metadata key '%s'", m->path.c_str(), key.c_str());
    }
    if (v < lo || v > hi) {
        return ott_fail(OTT_ERR_FORMAT, "%s: metadata '%s' = %" PRId64 " is out of range [%" PRId64 ", %" PRId64 "]",
                        m->path.c_str(), key.c_str(), v, lo, hi);
    }
    out = (int32_t)v;
    return OTT_OK;
}

// Float metadata that must be finite and in (lo, hi]; `out` keeps its default when the key is
// absent. A value of another type is an error, not a silent default.
ott_status require_float(const ott_model * m, const std::string & key, float lo, float hi, float & out) {
    if (gguf_find_key(m->gguf, key.c_str()) < 0) return OTT_OK;
    if (!get_float(m->gguf, key, out)) {
        return ott_fail(OTT_ERR_FORMAT, "%s: metadata '%s' is not a number", m->path.c_str(), key.c_str());
    }
    if (!std::isfinite(out) || !(out > lo && out <= hi)) {
        return ott_fail(OTT_ERR_FORMAT, "%s: metadata '%s' = %g is not in (%g, %g]", m->path.c_str(), key.c_str(), out,
                        lo, hi);
    }
    return OTT_OK;
}

ott_status read_swa(ott_model * m);

ott_status read_hparams(ott_model * m) {
    const gguf_context * g = m->gguf;
    ott_hparams & hp       = m->hparams;

    hp.arch_name           = get_str(g, "general.architecture");
    const arch_desc * desc = nullptr;
    for (const auto & a : k_archs) {
        if (hp.arch_name == a.name) desc = &a;
    }
    if (!desc) {
        std::string names;
        for (const auto & a : k_archs) names += std::string(names.empty() ? "" : ", ") + a.name;
        return ott_fail(OTT_ERR_UNSUPPORTED, "%s: architecture '%s' is not supported (supported: %s)", m->path.c_str(),
                        hp.arch_name.empty() ? "<missing general.architecture>" : hp.arch_name.c_str(), names.c_str());
    }
    hp.arch      = desc->arch;
    hp.rope_type = desc->rope_type;

    const std::string a = hp.arch_name + ".";
    OTT_TRY(require_int(m, a + "block_count", 1, 1024, hp.n_layer));
    OTT_TRY(require_int(m, a + "embedding_length", 1, 1 << 17, hp.n_embd));
    OTT_TRY(require_int(m, a + "feed_forward_length", 1, 1 << 20, hp.n_ff));
    OTT_TRY(require_int(m, a + "attention.head_count", 1, 1024, hp.n_head));
    hp.n_head_kv = hp.n_head;
    if (gguf_find_key(g, (a + "attention.head_count_kv").c_str()) >= 0) {
        OTT_TRY(require_int(m, a + "attention.head_count_kv", 1, hp.n_head, hp.n_head_kv));
    }
    if (hp.n_head % hp.n_head_kv != 0) {
        return ott_fail(OTT_ERR_FORMAT, "%s: head_count %d is not a multiple of head_count_kv %d", m->path.c_str(),
                        hp.n_head, hp.n_head_kv);
    }
    hp.n_ctx_train = 4096;
    if (gguf_find_key(g, (a + "context_length").c_str()) >= 0) {
        OTT_TRY(require_int(m, a + "context_length", 1, 1 << 24, hp.n_ctx_train));
    }
    hp.n_embd_head = hp.n_embd / hp.n_head;
    if (gguf_find_key(g, (a + "attention.key_length").c_str()) >= 0) {
        OTT_TRY(require_int(m, a + "attention.key_length", 1, 1024, hp.n_embd_head));
    } else if (hp.n_embd % hp.n_head != 0) {
        return ott_fail(OTT_ERR_FORMAT, "%s: embedding_length %d is not a multiple of head_count %d", m->path.c_str(),
                        hp.n_embd, hp.n_head);
    }
    if (hp.n_embd_head % 2 != 0) {
        return ott_fail(OTT_ERR_FORMAT, "%s: head dimension %d is odd", m->path.c_str(), hp.n_embd_head);
    }
    hp.n_rot = hp.n_embd_head;
    if (gguf_find_key(g, (a + "rope.dimension_count").c_str()) >= 0) {
        OTT_TRY(require_int(m, a + "rope.dimension_count", 2, hp.n_embd_head, hp.n_rot));
    }
    if (hp.n_rot % 2 != 0) {  // rope turns pairs of dimensions
        return ott_fail(OTT_ERR_FORMAT, "%s: rope.dimension_count %d is odd", m->path.c_str(), hp.n_rot);
    }

    hp.norm_rms_eps = 1e-5f;
    OTT_TRY(require_float(m, a + "attention.layer_norm_rms_epsilon", 0.0f, 1.0f, hp.norm_rms_eps));
    hp.rope_freq_base = 10000.0f;
    OTT_TRY(require_float(m, a + "rope.freq_base", 0.0f, FLT_MAX, hp.rope_freq_base));

    // rope scaling: none, linear, yarn (llama3-style and LongRoPE factors come as tensors)
    hp.rope_freq_scale  = 1.0f;
    hp.rope_ext_factor  = 0.0f;
    hp.rope_attn_factor = 1.0f;
    OTT_TRY(require_float(m, a + "rope.scaling.attn_factor", 0.0f, 100.0f, hp.rope_attn_factor));
    hp.rope_n_ctx_orig = hp.n_ctx_train;
    if (gguf_find_key(g, (a + "rope.scaling.original_context_length").c_str()) >= 0) {
        OTT_TRY(require_int(m, a + "rope.scaling.original_context_length", 1, 1 << 24, hp.rope_n_ctx_orig));
    }
    const std::string scaling = get_str(g, a + "rope.scaling.type");
    float factor              = 1.0f;
    OTT_TRY(require_float(m, a + "rope.scaling.factor", 0.0f, 1e6f, factor));
    if (scaling == "linear" || scaling == "yarn") {
        hp.rope_freq_scale = 1.0f / factor;
        if (scaling == "yarn") hp.rope_ext_factor = 1.0f;
    } else if (!scaling.empty() && scaling != "none") {
        return ott_fail(OTT_ERR_UNSUPPORTED, "%s: rope scaling type '%s' is not supported (none, linear, yarn)",
                        m->path.c_str(), scaling.c_str());
    }

    hp.kq_scale      = 1.0f / sqrtf((float)hp.n_embd_head);
    hp.logit_softcap = 0.0f;
    if (hp.arch == OTT_ARCH_GEMMA3) {
        // Gemma 3 27B scales queries by n_embd/n_head, not head_dim; its files do not say so,
        // and llama.cpp recognises it by its 62 layers — so do we
        if (hp.n_layer == 62) hp.kq_scale = 1.0f / sqrtf((float)(hp.n_embd / hp.n_head));
        OTT_TRY(require_float(m, a + "final_logit_softcapping", -FLT_MAX, FLT_MAX, hp.logit_softcap));
        if (hp.logit_softcap < 0.0f) {
            return ott_fail(OTT_ERR_FORMAT, "%s: final_logit_softcapping = %g is negative", m->path.c_str(),
                            hp.logit_softcap);
        }
    }
    return read_swa(m);
}

// Sliding-window layers: gemma3 interleaves local and global layers (every
// attention.sliding_window_pattern-th layer global, default 6, or a per-layer array), phi3
// makes every layer local when its file has a window. Other architectures: all global.
ott_status read_swa(ott_model * m) {
    const gguf_context * g = m->gguf;
    ott_hparams & hp       = m->hparams;
    const std::string a    = hp.arch_name + ".";
    hp.n_swa               = 0;
    hp.swa_layers.assign(hp.n_layer, 0);
    hp.rope_freq_base_swa  = 10000.0f;
    hp.rope_freq_scale_swa = 1.0f;
    if (hp.arch != OTT_ARCH_GEMMA3 && hp.arch != OTT_ARCH_PHI3) return OTT_OK;
    if (gguf_find_key(g, (a + "attention.sliding_window").c_str()) < 0) return OTT_OK;
    OTT_TRY(require_int(m, a + "attention.sliding_window", 0, 1 << 24, hp.n_swa));
    if (hp.n_swa == 0) return OTT_OK;  // phi3's converter writes 0 for "no window"

    const std::string key = a + "attention.sliding_window_pattern";
    const int64_t id      = gguf_find_key(g, key.c_str());
    if (hp.arch == OTT_ARCH_PHI3) {
        hp.swa_layers.assign(hp.n_layer, 1);
    } else if (id >= 0 && gguf_get_kv_type(g, id) == GGUF_TYPE_ARRAY) {
        const gguf_type t = gguf_get_arr_type(g, id);
        const bool wide   = t == GGUF_TYPE_INT32 || t == GGUF_TYPE_UINT32;
        if ((t != GGUF_TYPE_BOOL && !wide) || (int64_t)gguf_get_arr_n(g, id) != hp.n_layer) {
            return ott_fail(OTT_ERR_FORMAT, "%s: '%s' must be an array of %d booleans", m->path.c_str(), key.c_str(),
                            hp.n_layer);
        }
        const void * flags = gguf_get_arr_data(g, id);
        for (int il = 0; il < hp.n_layer; ++il) {
            hp.swa_layers[il] = wide ? ((const int32_t *)flags)[il] != 0 : ((const int8_t *)flags)[il] != 0;
        }
    } else {
        int32_t n_pattern = 6;
        if (id >= 0) OTT_TRY(require_int(m, key, 0, hp.n_layer, n_pattern));
        for (int il = 0; il < hp.n_layer; ++il) hp.swa_layers[il] = n_pattern == 0 || il % n_pattern < n_pattern - 1;
    }
    OTT_TRY(require_float(m, a + "rope.freq_base_swa", 0.0f, FLT_MAX, hp.rope_freq_base_swa));
    return OTT_OK;
}

// Tensor types that can be multiplied on the CPU backend (have a dot-product kernel).
bool cpu_matmul_type(ggml_type t) {
    if ((int)t < 0 || t >= GGML_TYPE_COUNT || ggml_blck_size(t) == 0) return false;
    const ggml_type_traits_cpu * tr = ggml_get_type_traits_cpu(t);
    return tr && tr->vec_dot != nullptr;
}

struct weight_loader {
    ott_model * m;
    ggml_context * meta;                                                             // headers from the GGUF file
    std::map<ggml_backend_buffer_type_t, ggml_context *> ctxs;                       // one context per buffer type
    std::vector<std::pair<ggml_tensor *, std::vector<const ggml_tensor *>>> placed;  // ours, the file's rows in it
    std::vector<ggml_backend_buffer_type_t> extra_bufts;  // repacked layouts, best first (CPU)
    ggml_backend_dev_t dev = nullptr;                     // the device that holds the weights
    bool x8                = false;                       // our 8-row layout where it applies (CPU)

    ggml_context * ctx_for(ggml_backend_buffer_type_t buft) {
        auto it = ctxs.find(buft);
        if (it != ctxs.end()) return it->second;
        ggml_init_params ip = { ggml_tensor_overhead() * (size_t)(gguf_get_n_tensors(m->gguf) + 1), nullptr, true };
        ggml_context * c    = ggml_init(ip);
        m->ctxs_w.push_back(c);  // the model owns every header context
        ctxs[buft] = c;
        return c;
    }

    // Would the device's backend multiply a weight of this type and shape when it lives in `buft`?
    bool matmul_supported(ggml_backend_buffer_type_t buft, ggml_type type, const int64_t * ne) {
        ggml_init_params ip         = { ggml_tensor_overhead() * 4, nullptr, true };
        ggml_context * c            = ggml_init(ip);
        ggml_tensor * wt            = ggml_new_tensor(c, type, GGML_MAX_DIMS, ne);
        ggml_tensor * x             = ggml_new_tensor_2d(c, GGML_TYPE_F32, ne[0], 512);
        ggml_tensor * op            = ggml_mul_mat(c, wt, x);
        ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(buft, 0);
        wt->buffer                  = dummy;
        const bool ok               = ggml_backend_dev_supports_op(dev, op);
        wt->buffer                  = nullptr;
        ggml_backend_buffer_free(dummy);
        ggml_free(c);
        return ok;
    }

    // Can the device multiply a weight of this tensor's type in its plain layout?
    bool multipliable(const ggml_tensor * w) {
        if (!cpu_matmul_type(w->type)) return false;  // every type ggml can compute has a CPU kernel
        return m->cuda_device < 0 || matmul_supported(ggml_backend_dev_buffer_type(dev), w->type, w->ne);
    }

    // The first repacked layout (faster kernels) that multiplies a weight of this type and
    // shape, or null.
    ggml_backend_buffer_type_t repacked_buft(ggml_type type, const int64_t * ne) {
        for (auto b : extra_bufts) {
            if (matmul_supported(b, type, ne)) return b;
        }
        return nullptr;
    }

    // Find `name` and check its type and shape; *src stays null when it is missing and not required.
    ott_status find(const std::string & name, const std::vector<int64_t> & ne, bool matmul, bool required,
                    const ggml_tensor ** src_out) {
        *src_out                = nullptr;
        const ggml_tensor * src = ggml_get_tensor(meta, name.c_str());
        if (!src) {
            if (!required) return OTT_OK;
            return ott_fail(OTT_ERR_FORMAT, "%s: tensor '%s' is missing", m->path.c_str(), name.c_str());
        }
        const bool type_ok = matmul ? multipliable(src) : (src->type == GGML_TYPE_F32 || multipliable(src));
        if (!type_ok || (!matmul && src->type != GGML_TYPE_F32 && ne.size() == 1)) {
            return ott_fail(OTT_ERR_UNSUPPORTED, "%s: tensor '%s' has type %s, which the %s backend cannot use here",
                            m->path.c_str(), name.c_str(), ggml_type_name(src->type), ggml_backend_dev_name(dev));
        }
        for (int d = 0; d < GGML_MAX_DIMS; ++d) {
            const int64_t want = d < (int)ne.size() ? ne[d] : 1;
            if (src->ne[d] != want) {
                return ott_fail(OTT_ERR_FORMAT,
                                "%s: tensor '%s' has shape [%" PRId64 ", %" PRId64 ", %" PRId64 "], expected [%" PRId64
                                ", %" PRId64 ", %" PRId64 "]",
                                m->path.c_str(), name.c_str(), src->ne[0], src->ne[1], src->ne[2], ne[0],
                                ne.size() > 1 ? ne[1] : 1, ne.size() > 2 ? ne[2] : 1);
            }
        }
        *src_out = src;
        return OTT_OK;
    }

    // Would a matrix of this type and shape go to our 8-row layout (when no repacked one takes it)?
    bool x8_layout(ggml_type type, const int64_t * ne) {
        return x8 && ne[2] == 1 && ne[3] == 1 && ott_x8_packable(type, ne[0], ne[1]);
    }

    // Our header `name` of the parts' type and shape ne, filled at load by the parts' data one
    // after the other; a matrix goes to the first repacked layout that multiplies it, or else
    // to our 8-row layout where that applies.
    ggml_tensor * place(const char * name, const int64_t * ne, bool matmul, std::vector<const ggml_tensor *> parts) {
        ggml_backend_buffer_type_t buft = matmul ? repacked_buft(parts[0]->type, ne) : nullptr;
        const bool to_x8                = matmul && !buft && x8_layout(parts[0]->type, ne);
        if (!buft) buft = ggml_backend_dev_buffer_type(dev);
        ggml_tensor * t = ggml_new_tensor(ctx_for(buft), parts[0]->type, GGML_MAX_DIMS, ne);
        ggml_set_name(t, name);
        if (to_x8) m->x8.insert(t);
        placed.push_back({ t, std::move(parts) });
        return t;
    }

    // Find `name`, check its type and shape, and create our header for it.
    ott_status get(const std::string & name, const std::vector<int64_t> & ne, bool matmul, bool required,
                   ggml_tensor ** out) {
        const ggml_tensor * src = nullptr;
        OTT_TRY(find(name, ne, matmul, required, &src));
        *out = src ? place(name.c_str(), src->ne, matmul, { src }) : nullptr;
        return OTT_OK;
    }

    // Matrices (or vectors) of one type and width, as one tensor `name` of their rows (elements)
    // in the order of `names`, each checked as `get` does, part i of shape ne[i]. The products of
    // such a matrix are those of the parts, row for row: one product (one node, one launch)
    // instead of several. Null when the parts differ in type (then each is loaded alone).
    ott_status get_stacked(const std::vector<std::string> & names, const std::vector<std::vector<int64_t>> & ne,
                           bool matmul, const std::string & name, ggml_tensor ** out) {
        *out = nullptr;
        std::vector<const ggml_tensor *> parts(names.size());
        for (size_t i = 0; i < names.size(); ++i) {
            OTT_TRY(find(names[i], ne[i], matmul, true, &parts[i]));
            if (parts[i]->type != parts[0]->type) return OTT_OK;
        }
        const int axis               = ne[0].size() - 1;  // rows of a matrix, elements of a vector
        int64_t shape[GGML_MAX_DIMS] = { parts[0]->ne[0], 1, 1, 1 };
        shape[axis]                  = 0;
        for (const ggml_tensor * t : parts) shape[axis] += t->ne[axis];
        *out = place(name.c_str(), shape, matmul, std::move(parts));
        return OTT_OK;
    }
};

}  // namespace

ott_status ott_device_resolve(const char * device, ggml_backend_dev_t & dev, int32_t & cuda_device) {
    const std::string name(device, strnlen(device, sizeof(ott_model_params::device)));
    const int32_t n_cuda = ott_cuda_device_count();
    cuda_device          = -1;
    if (name.empty()) {
        cuda_device = n_cuda > 0 ? 0 : -1;
    } else if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
        const std::string idx = name.size() > 5 ? name.substr(5) : (name == "cuda" ? "0" : "");
        if (idx.empty() || idx.size() > 3 || idx.find_first_not_of("0123456789") != std::string::npos) {
            return ott_fail(OTT_ERR_INVALID_ARG, "device '%s' is not one of cpu, cuda, cuda:N", name.c_str());
        }
        if (n_cuda == 0) {
#ifdef OTT_USE_CUDA
            return ott_fail(OTT_ERR_UNSUPPORTED, "device %s: no CUDA device is present", name.c_str());
#else
            return ott_fail(OTT_ERR_UNSUPPORTED,
                            "device %s: this build has no CUDA support (build with OTT_CUDA=ON: bench/build_cuda.sh)",
                            name.c_str());
#endif
        }
        cuda_device = std::stoi(idx);
        if (cuda_device >= n_cuda) {
            return ott_fail(OTT_ERR_INVALID_ARG, "device %s: this machine has %d CUDA device(s)", name.c_str(), n_cuda);
        }
    } else if (name != "cpu") {
        return ott_fail(OTT_ERR_INVALID_ARG, "device '%s' is not one of cpu, cuda, cuda:N", name.c_str());
    }
#ifdef OTT_USE_CUDA
    if (cuda_device >= 0) {
        dev = ggml_backend_reg_dev_get(ggml_backend_cuda_reg(), (size_t)cuda_device);
        return dev ? OTT_OK : ott_fail(OTT_ERR_BACKEND, "ggml has no device for cuda:%d", cuda_device);
    }
#endif
    dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    return dev ? OTT_OK : ott_fail(OTT_ERR_BACKEND, "ggml has no CPU device");
}

ggml_tensor * ott_model::rope_factors(int32_t n_ctx) const {
    if (rope_long) return n_ctx > hparams.rope_n_ctx_orig ? rope_long : rope_short;
    return rope_freqs;
}

ott_model::~ott_model() {
    for (auto b : buffers) ggml_backend_buffer_free(b);
    for (auto c : ctxs_w) ggml_free(c);
    if (ctx_meta) ggml_free(ctx_meta);
    if (gguf) gguf_free(gguf);
}

ott_status ott_model_load_file(const char * path, const ott_model_params & params, ott_model * m) {
    m->path = path;

    file_ptr f(fopen(path, "rb"));
    if (!f) return ott_fail(OTT_ERR_IO, "%s: cannot open file: %s", path, strerror(errno));
    char magic[4] = { 0 };
    if (fread(magic, 1, 4, f.get()) != 4 || memcmp(magic, "GGUF", 4) != 0) {
        return ott_fail(OTT_ERR_FORMAT, "%s: not a GGUF file (bad magic)", path);
    }
    fseeko(f.get(), 0, SEEK_END);
    const int64_t file_size = ftello(f.get());
    OTT_TRY(ott_gguf_scan(path, f.get(), file_size));

    ggml_context * meta = nullptr;
    gguf_init_params gp = { /*no_alloc =*/true, /*ctx =*/&meta };
    m->gguf             = gguf_init_from_file(path, gp);
    if (!m->gguf) {
        return ott_fail(OTT_ERR_FORMAT, "%s: cannot parse the GGUF header (truncated or corrupt file)", path);
    }
    m->ctx_meta = meta;

    // every tensor's data must lie inside the file
    const int64_t data_off = (int64_t)gguf_get_data_offset(m->gguf);
    for (int64_t i = 0; i < gguf_get_n_tensors(m->gguf); ++i) {
        const int64_t end =
            data_off + (int64_t)gguf_get_tensor_offset(m->gguf, i) + (int64_t)gguf_get_tensor_size(m->gguf, i);
        if (end > file_size) {
            return ott_fail(OTT_ERR_FORMAT,
                            "%s: truncated: tensor '%s' ends at byte %" PRId64 " but the file has %" PRId64 " bytes",
                            path, gguf_get_tensor_name(m->gguf, i), end, file_size);
        }
    }

    OTT_TRY(read_hparams(m));
    ott_hparams & hp = m->hparams;

    OTT_TRY(ott_device_resolve(params.device, m->dev, m->cuda_device));
    weight_loader wl { m, meta, {}, {}, {}, m->dev };
    if (params.repack && m->cuda_device < 0) {
        wl.x8          = params.x8 != 0;
        auto get_extra = (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(
            ggml_backend_dev_backend_reg(wl.dev), "ggml_backend_dev_get_extra_bufts");
        if (get_extra) {
            for (ggml_backend_buffer_type_t * b = get_extra(wl.dev); b && *b; ++b) wl.extra_bufts.push_back(*b);
        }
    }

    // vocabulary size comes from the embedding matrix
    const ggml_tensor * emb = ggml_get_tensor(meta, "token_embd.weight");
    if (!emb) return ott_fail(OTT_ERR_FORMAT, "%s: tensor 'token_embd.weight' is missing", path);
    hp.n_vocab = (int32_t)emb->ne[1];

    const int64_t n_embd = hp.n_embd, n_q = (int64_t)hp.n_embd_head * hp.n_head, n_kv = hp.n_embd_gqa();
    const bool bias      = hp.arch == OTT_ARCH_QWEN2;
    const bool qk_norm   = hp.arch == OTT_ARCH_QWEN3 || hp.arch == OTT_ARCH_GEMMA3;
    const bool post_norm = hp.arch == OTT_ARCH_GEMMA3;
    const bool fused_ffn = hp.arch == OTT_ARCH_PHI3;
    // phi3's converters write the fused QKV matrix; separate Q, K, V are accepted as well
    const bool fused_qkv = hp.arch == OTT_ARCH_PHI3 && ggml_get_tensor(meta, "blk.0.attn_qkv.weight");
    OTT_TRY(wl.get("token_embd.weight", { n_embd, hp.n_vocab }, false, true, &m->tok_embd));
    OTT_TRY(wl.get("output_norm.weight", { n_embd }, false, true, &m->output_norm));
    OTT_TRY(wl.get("output.weight", { n_embd, hp.n_vocab }, true, false, &m->output));
    OTT_TRY(wl.get("rope_freqs.weight", { hp.n_rot / 2 }, false, false, &m->rope_freqs));
    if (hp.arch == OTT_ARCH_PHI3) {
        OTT_TRY(wl.get("rope_factors_long.weight", { hp.n_rot / 2 }, false, false, &m->rope_long));
        OTT_TRY(wl.get("rope_factors_short.weight", { hp.n_rot / 2 }, false, false, &m->rope_short));
        if (!m->rope_long != !m->rope_short) {
            return ott_fail(OTT_ERR_FORMAT, "%s: tensor '%s' is missing (LongRoPE needs both factor tensors)", path,
                            m->rope_long ? "rope_factors_short.weight" : "rope_factors_long.weight");
        }
    }
    if (!m->output) {
        if (!wl.multipliable(m->tok_embd)) {
            return ott_fail(OTT_ERR_UNSUPPORTED, "%s: tied output needs token_embd type %s to be multipliable on %s",
                            path, ggml_type_name(m->tok_embd->type), ggml_backend_dev_name(m->dev));
        }
        // as llama.cpp does, the output matrix gets its own copy when a repacked layout
        // multiplies it faster (ggml's embedding lookup needs the plain layout)
        const ggml_tensor * emb_src = ggml_get_tensor(meta, "token_embd.weight");
        if (wl.repacked_buft(emb_src->type, emb_src->ne)) {
            OTT_TRY(wl.get("token_embd.weight", { n_embd, hp.n_vocab }, true, true, &m->output));
        } else {
            // our 8-row layout is stored once, for the product and the lookup alike (filled below)
            if (wl.x8_layout(emb_src->type, emb_src->ne)) m->x8.insert(m->tok_embd);
            m->output = m->tok_embd;
        }
        m->tied_output = true;
    }

    m->layers.resize(hp.n_layer);
    for (int il = 0; il < hp.n_layer; ++il) {
        ott_layer & L       = m->layers[il];
        const std::string p = "blk." + std::to_string(il) + ".";
        OTT_TRY(wl.get(p + "attn_norm.weight", { n_embd }, false, true, &L.attn_norm));
        if (fused_qkv) {
            OTT_TRY(wl.get(p + "attn_qkv.weight", { n_embd, n_q + 2 * n_kv }, true, true, &L.wqkv));
        } else {
            const std::vector<std::string> qkv = { p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight" };
            OTT_TRY(wl.get_stacked(qkv, { { n_embd, n_q }, { n_embd, n_kv }, { n_embd, n_kv } }, true,
                                   p + "attn_qkv.weight", &L.wqkv));
            if (!L.wqkv) {  // of different types: three products
                OTT_TRY(wl.get(qkv[0], { n_embd, n_q }, true, true, &L.wq));
                OTT_TRY(wl.get(qkv[1], { n_embd, n_kv }, true, true, &L.wk));
                OTT_TRY(wl.get(qkv[2], { n_embd, n_kv }, true, true, &L.wv));
            }
        }
        OTT_TRY(wl.get(p + "attn_output.weight", { n_q, n_embd }, true, true, &L.wo));
        if (bias && L.wqkv) {
            OTT_TRY(wl.get_stacked({ p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias" },
                                   { { n_q }, { n_kv }, { n_kv } }, false, p + "attn_qkv.bias", &L.bqkv));
        } else if (bias) {
            OTT_TRY(wl.get(p + "attn_q.bias", { n_q }, false, true, &L.bq));
            OTT_TRY(wl.get(p + "attn_k.bias", { n_kv }, false, true, &L.bk));
            OTT_TRY(wl.get(p + "attn_v.bias", { n_kv }, false, true, &L.bv));
        }
        if (qk_norm) {
            OTT_TRY(wl.get(p + "attn_q_norm.weight", { hp.n_embd_head }, false, true, &L.attn_q_norm));
            OTT_TRY(wl.get(p + "attn_k_norm.weight", { hp.n_embd_head }, false, true, &L.attn_k_norm));
        }
        OTT_TRY(wl.get(p + "ffn_norm.weight", { n_embd }, false, true, &L.ffn_norm));
        if (fused_ffn) {
            OTT_TRY(wl.get(p + "ffn_up.weight", { n_embd, 2 * (int64_t)hp.n_ff }, true, true, &L.ffn_up));
        } else {
            const std::vector<std::string> gu = { p + "ffn_gate.weight", p + "ffn_up.weight" };
            OTT_TRY(wl.get_stacked(gu, { { n_embd, hp.n_ff }, { n_embd, hp.n_ff } }, true, p + "ffn_gate_up.weight",
                                   &L.ffn_up));
            if (!L.ffn_up) {
                OTT_TRY(wl.get(gu[0], { n_embd, hp.n_ff }, true, true, &L.ffn_gate));
                OTT_TRY(wl.get(gu[1], { n_embd, hp.n_ff }, true, true, &L.ffn_up));
            }
        }
        OTT_TRY(wl.get(p + "ffn_down.weight", { hp.n_ff, n_embd }, true, true, &L.ffn_down));
        if (post_norm) {
            OTT_TRY(wl.get(p + "post_attention_norm.weight", { n_embd }, false, true, &L.attn_post_norm));
            OTT_TRY(wl.get(p + "post_ffw_norm.weight", { n_embd }, false, true, &L.ffn_post_norm));
        }
    }

    // allocate one buffer per buffer type, then stream each tensor from the file
    for (auto & kv : wl.ctxs) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(kv.second, kv.first);
        if (!buf)
            return ott_fail(OTT_ERR_ALLOC, "%s: cannot allocate %s weight buffer", path,
                            ggml_backend_buft_name(kv.first));
        ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        m->buffers.push_back(buf);
    }
    std::vector<uint8_t> staging;
    for (auto & pr : wl.placed) {
        ggml_tensor * t     = pr.first;
        const size_t nbytes = ggml_nbytes(t);
        staging.resize(nbytes);
        size_t at = 0;  // the parts' bytes one after the other: their rows stacked
        for (const ggml_tensor * src : pr.second) {
            const int64_t idx = gguf_find_tensor(m->gguf, ggml_get_name(src));
            const size_t n    = ggml_nbytes(src);
            if (fseeko(f.get(), data_off + (int64_t)gguf_get_tensor_offset(m->gguf, idx), SEEK_SET) != 0 ||
                fread(staging.data() + at, 1, n, f.get()) != n) {
                return ott_fail(OTT_ERR_IO, "%s: read error in tensor '%s'", path, ggml_get_name(src));
            }
            at += n;
        }
        if (m->x8.count(t)) {
            ott_x8_pack(t->type, t->ne[0], t->ne[1], staging.data());
            m->x8_bytes += (int64_t)nbytes;
        }
        ggml_backend_tensor_set(t, staging.data(), 0, nbytes);
        if (!(m->tied_output && t == m->output && t != m->tok_embd)) {  // a repacked copy adds no parameters
            m->n_params += ggml_nelements(t);
            m->weight_bytes += (int64_t)nbytes;
        }
    }

    return OTT_OK;
}

namespace {

// ggml's own messages stay quiet; the last error line is kept to explain a failed parse.
thread_local std::string g_ggml_last_error;

void ggml_log_quiet(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR && text) {
        g_ggml_last_error = text;
        while (!g_ggml_last_error.empty() && (g_ggml_last_error.back() == '\n')) g_ggml_last_error.pop_back();
    }
}

}  // namespace

extern "C" ott_status ott_model_load(const char * path, const ott_model_params * params, ott_model ** out) {
    if (!path || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_model_load: null argument");
    *out = nullptr;
    ggml_log_set(ggml_log_quiet, nullptr);
    g_ggml_last_error.clear();
    const ott_model_params p = params ? *params : ott_model_default_params();
    auto m                   = std::unique_ptr<ott_model>(new (std::nothrow) ott_model());
    if (!m) return ott_fail(OTT_ERR_ALLOC, "out of memory loading %s", path);
    const ott_status st = ott_model_load_file(path, p, m.get());
    if (st != OTT_OK) {
        if (st == OTT_ERR_FORMAT && !g_ggml_last_error.empty()) {
            std::string msg = ott_last_error();
            ott_fail(st, "%s (%s)", msg.c_str(), g_ggml_last_error.c_str());
        }
        return st;
    }
    *out = m.release();
    return OTT_OK;
}

extern "C" void ott_model_free(ott_model * model) { delete model; }

extern "C" ott_status ott_model_get_info(const ott_model * m, ott_model_info * out) {
    if (!m || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_model_get_info: null argument");
    const ott_hparams & hp = m->hparams;
    memset(out, 0, sizeof(*out));
    snprintf(out->arch, sizeof(out->arch), "%s", hp.arch_name.c_str());
    out->n_vocab         = hp.n_vocab;
    out->n_ctx_train     = hp.n_ctx_train;
    out->n_embd          = hp.n_embd;
    out->n_layer         = hp.n_layer;
    out->n_head          = hp.n_head;
    out->n_head_kv       = hp.n_head_kv;
    out->n_embd_head     = hp.n_embd_head;
    out->n_ff            = hp.n_ff;
    out->rope_type       = hp.rope_type;
    out->rope_freq_base  = hp.rope_freq_base;
    out->rope_freq_scale = hp.rope_freq_scale;
    out->norm_rms_eps    = hp.norm_rms_eps;
    out->tied_output     = m->tied_output;
    out->n_params        = m->n_params;
    out->weight_bytes    = m->weight_bytes;
    out->x8_bytes        = m->x8_bytes;
    if (m->cuda_device >= 0)
        snprintf(out->device, sizeof(out->device), "cuda:%d", m->cuda_device);
    else
        snprintf(out->device, sizeof(out->device), "cpu");
    out->n_swa = hp.n_swa;
    return OTT_OK;
}

extern "C" ott_status ott_model_layer_window(const ott_model * m, int32_t il, int32_t * out) {
    if (!m || !out) return ott_fail(OTT_ERR_INVALID_ARG, "ott_model_layer_window: null argument");
    if (il < 0 || il >= m->hparams.n_layer) {
        return ott_fail(OTT_ERR_INVALID_ARG, "layer %d is outside [0, %d)", il, m->hparams.n_layer);
    }
    *out = m->hparams.is_swa(il) ? m->hparams.n_swa : 0;
    return OTT_OK;
}
