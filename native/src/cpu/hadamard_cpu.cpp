// hadamard_cpu.cpp — the Hadamard rotation as one custom op (hadamard_cpu.h).
#include "cpu/hadamard_cpu.h"

#include <cmath>
#include <cstdint>

void ott_cpu_hadamard(ggml_tensor * dst, int ith, int nth, void * userdata) {
    const ggml_tensor * x = dst->src[0];
    const ggml_tensor * s = dst->src[1];
    const bool first      = (intptr_t)userdata == OTT_HADAMARD_SIGNS_FIRST;
    const int64_t d = dst->ne[0], heads = dst->ne[1], rows = heads * dst->ne[2];
    const float scale = 1.0f / sqrtf((float)d);  // as ggml_compute_forward_fwht
    const int64_t per = (rows + nth - 1) / nth, r0 = ith * per, r1 = r0 + per < rows ? r0 + per : rows;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t h = r % heads, t = r / heads;
        const float * xr = (const float *)((const char *)x->data + h * x->nb[1] + t * x->nb[2]);
        const float * sr = (const float *)((const char *)s->data + h * s->nb[1]);
        float * y        = (float *)((char *)dst->data + h * dst->nb[1] + t * dst->nb[2]);
        for (int64_t j = 0; j < d; ++j) y[j] = (first ? xr[j] * sr[j] : xr[j]) * scale;
        for (int64_t len = 1; len < d; len <<= 1) {
            for (int64_t i = 0; i < d; i += 2 * len) {
                for (int64_t j = i; j < i + len; ++j) {
                    const float u = y[j], v = y[j + len];
                    y[j]       = u + v;
                    y[j + len] = u - v;
                }
            }
        }
        if (!first) {
            for (int64_t j = 0; j < d; ++j) y[j] *= sr[j];
        }
    }
}
