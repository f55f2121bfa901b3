/* rope_table.c — the RoPE table of kvq_types.h (ott_rope_table.cs), filled on the host for both
 * backends: θ = (p · freq_scale) · freq_base^(-2i/n_rot) in double, its cosine and sine rounded
 * to float, as ott_gguf/reference/rope.py computes the angles. */
#include "kv/kvq_types.h"

#include <math.h>
#include <stddef.h>

void ott_rope_table_fill(int32_t n_rot, double freq_base, double freq_scale, int32_t n_pos, float * cs) {
    const int32_t half = n_rot / 2;
    for (int32_t i = 0; i < half; ++i) {
        const double inv_freq = pow(freq_base, -(double)(2 * i) / n_rot);
        for (int32_t p = 0; p < n_pos; ++p) {
            const double theta                 = (double)p * freq_scale * inv_freq;
            cs[(size_t)i * n_pos + p]          = (float)cos(theta);
            cs[(size_t)(half + i) * n_pos + p] = (float)sin(theta);
        }
    }
}
