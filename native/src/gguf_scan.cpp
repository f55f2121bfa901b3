// gguf_scan.cpp — the bounded header walk of gguf_scan.h (GGUF v2/v3, little-endian).
#include "gguf_scan.h"

#include "gguf.h"

#include <cinttypes>
#include <cstdio>
#include <string>
#include <vector>

namespace {

// Size of one scalar of a GGUF value type; 0 for STRING, ARRAY and unknown types.
size_t scalar_size(uint32_t type) {
    switch (type) {
        case GGUF_TYPE_UINT8:
        case GGUF_TYPE_INT8:
        case GGUF_TYPE_BOOL:    return 1;
        case GGUF_TYPE_UINT16:
        case GGUF_TYPE_INT16:   return 2;
        case GGUF_TYPE_UINT32:
        case GGUF_TYPE_INT32:
        case GGUF_TYPE_FLOAT32: return 4;
        case GGUF_TYPE_UINT64:
        case GGUF_TYPE_INT64:
        case GGUF_TYPE_FLOAT64: return 8;
        default:                return 0;
    }
}

struct reader {
    const char * path;
    FILE * f;
    int64_t file_size;
    int64_t pos     = 0;
    std::string key = "<header>";  // the key being read, for messages

    ott_status fail(const char * what) const {
        const bool long_key = key.size() > 64;  // a corrupted one, likely: its start says enough
        return ott_fail(OTT_ERR_FORMAT, "%s: metadata '%s%s': %s (at byte %" PRId64 ")", path,
                        key.substr(0, 64).c_str(), long_key ? "..." : "", what, pos);
    }

    ott_status bytes(void * dst, int64_t n) {
        if (n < 0 || n > file_size - pos) return fail("truncated");
        if (n > 0 && fread(dst, 1, (size_t)n, f) != (size_t)n) return fail("read error");
        pos += n;
        return OTT_OK;
    }

    ott_status skip(int64_t n) {
        if (n < 0 || n > file_size - pos) return fail("truncated");
        if (fseeko(f, pos + n, SEEK_SET) != 0) return fail("seek error");
        pos += n;
        return OTT_OK;
    }

    template <typename T> ott_status value(T & out) { return bytes(&out, sizeof(T)); }

    // a length-prefixed string; keys and scalar strings must not hold NUL bytes
    ott_status string(std::string * out, bool no_nul) {
        uint64_t n = 0;
        OTT_TRY(value(n));
        if (n > (uint64_t)(file_size - pos)) return fail("string length runs past the end of the file");
        if (!out && !no_nul) return skip((int64_t)n);
        std::string s((size_t)n, '\0');
        OTT_TRY(bytes(s.data(), (int64_t)n));
        if (no_nul && s.find('\0') != std::string::npos) return fail("string holds a NUL byte");
        if (out) *out = std::move(s);
        return OTT_OK;
    }
};

}  // namespace

ott_status ott_gguf_scan(const char * path, FILE * f, int64_t file_size) {
    reader r { path, f, file_size };
    if (fseeko(f, 0, SEEK_SET) != 0) return r.fail("seek error");
    char magic[4];
    uint32_t version  = 0;
    int64_t n_tensors = 0, n_kv = 0;
    OTT_TRY(r.bytes(magic, 4));
    OTT_TRY(r.value(version));
    if (version != 2 && version != 3) {
        return ott_fail(OTT_ERR_FORMAT, "%s: GGUF version %u is not supported (2 or 3)", path, version);
    }
    OTT_TRY(r.value(n_tensors));
    OTT_TRY(r.value(n_kv));
    if (n_tensors < 0 || n_tensors > OTT_GGUF_MAX_TENSORS) {
        return ott_fail(OTT_ERR_FORMAT, "%s: %" PRId64 " tensors declared, at most %d are accepted", path, n_tensors,
                        OTT_GGUF_MAX_TENSORS);
    }
    if (n_kv < 0 || n_kv > OTT_GGUF_MAX_KV) {
        return ott_fail(OTT_ERR_FORMAT, "%s: %" PRId64 " metadata keys declared, at most %d are accepted", path, n_kv,
                        OTT_GGUF_MAX_KV);
    }
    for (int64_t i = 0; i < n_kv; ++i) {
        r.key = "#" + std::to_string(i);
        std::string key;
        OTT_TRY(r.string(&key, true));
        r.key         = key;
        uint32_t type = 0;
        OTT_TRY(r.value(type));
        if (type == GGUF_TYPE_STRING) {
            OTT_TRY(r.string(nullptr, true));
        } else if (type == GGUF_TYPE_ARRAY) {
            uint32_t elem = 0;
            uint64_t n    = 0;
            OTT_TRY(r.value(elem));
            OTT_TRY(r.value(n));
            if (elem == GGUF_TYPE_STRING) {
                // each element takes 8 bytes at least: a count past that cannot fit in the file
                if (n > (uint64_t)(file_size - r.pos) / 8) return r.fail("array length runs past the end of the file");
                for (uint64_t j = 0; j < n; ++j) OTT_TRY(r.string(nullptr, false));
            } else if (scalar_size(elem) == 0) {
                return r.fail(elem == GGUF_TYPE_ARRAY ? "nested arrays are not supported"
                                                      : "unknown array element type");
            } else {
                if (n > (uint64_t)(file_size - r.pos) / scalar_size(elem)) {
                    return r.fail("array length runs past the end of the file");
                }
                OTT_TRY(r.skip((int64_t)(n * scalar_size(elem))));
            }
        } else if (scalar_size(type) == 0) {
            return r.fail("unknown value type");
        } else {
            OTT_TRY(r.skip((int64_t)scalar_size(type)));
        }
    }
    return OTT_OK;
}
