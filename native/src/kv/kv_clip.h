/* kv_clip.h — the clipped ranges a group may be quantized to (ott_kv_geom::clip), shared by
 * C, C++ and CUDA: candidate i narrows a group's range [mn, mx] by ott_clip_shrink(i) of its
 * width at each end (ott_gguf/reference/quant.py: CLIP_SHRINK, the same float32 values).
 * Candidate 0 is the whole range. */
#ifndef OTT_KV_CLIP_H
#define OTT_KV_CLIP_H

#include "kv/kv_layout.h"

#define OTT_CLIP_N 12

static inline OTT_HD float ott_clip_shrink(int32_t i) {
    const float c[OTT_CLIP_N] = { 0.0f, 0.05f, 0.075f, 0.1f, 0.125f, 0.15f, 0.175f, 0.2f, 0.225f, 0.25f, 0.275f, 0.3f };
    return c[i];
}

#endif /* OTT_KV_CLIP_H */
