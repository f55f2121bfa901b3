// ott.cpp — error reporting, defaults and machine queries of the C API.
#include "common.h"

#ifdef OTT_USE_CUDA
#include "ggml-cuda.h"
#endif

#include <cstdio>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <utility>

static thread_local std::string g_last_error;

ott_status ott_fail(ott_status status, const char * fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    // one line whatever a file put into the message (a key or string may hold control bytes)
    g_last_error.clear();
    for (const char * c = buf; *c; ++c) {
        const unsigned char u = (unsigned char)*c;
        if (u >= 0x20 && u != 0x7f) {
            g_last_error += *c;
        } else if (u == '\n') {
            g_last_error += "\\n";
        } else {
            char esc[8];
            snprintf(esc, sizeof(esc), "\\x%02x", u);
            g_last_error += esc;
        }
    }
    return status;
}

extern "C" const char * ott_last_error(void) { return g_last_error.c_str(); }

// Physical cores: distinct (physical id, core id) pairs in /proc/cpuinfo, else the
// hardware thread count.
extern "C" int32_t ott_physical_cores(void) {
    std::set<std::pair<int, int>> cores;
    if (FILE * f = fopen("/proc/cpuinfo", "r")) {
        char line[256];
        int phys = 0;
        while (fgets(line, sizeof(line), f)) {
            int v;
            if (sscanf(line, "physical id : %d", &v) == 1) phys = v;
            if (sscanf(line, "core id : %d", &v) == 1) cores.insert({ phys, v });
        }
        fclose(f);
    }
    if (!cores.empty()) return (int32_t)cores.size();
    unsigned n = std::thread::hardware_concurrency();
    return n > 0 ? (int32_t)n : 1;
}

extern "C" int32_t ott_cuda_device_count(void) {
#ifdef OTT_USE_CUDA
    return ggml_backend_cuda_get_device_count();
#else
    return 0;
#endif
}

extern "C" ott_model_params ott_model_default_params(void) {
    ott_model_params p;
    memset(&p, 0, sizeof(p));
    p.repack = 1;  // device "": CUDA when present
    p.x8     = 1;
    return p;
}

extern "C" ott_context_params ott_context_default_params(void) {
    ott_context_params p {};  // kv knobs 0: the fp16 cache
    p.n_ctx     = 0;
    p.n_seq_max = 1;
    p.n_ubatch  = 512;
    p.n_threads = 0;
    p.kv.type   = OTT_KV_F16;
    return p;
}
