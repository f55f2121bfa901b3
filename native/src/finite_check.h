// finite_check.h — non-finite logits, and the first layer whose output went non-finite.
#pragma once

#include "common.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <cstddef>

// True when none of the n floats is NaN or infinite.
bool ott_all_finite(const float * x, size_t n);

// Recompute gf on backend node by node and return in *il the first layer whose output (the
// node named "l_out-<il>", F32) holds a NaN or an infinity; -1 when every layer output is
// finite (the output norm or matrix made the logits non-finite). The graph's inputs must
// still be set; the cache writes of the graph are redone with the same values.
ott_status ott_first_nonfinite_layer(ggml_backend_t backend, ggml_cgraph * gf, int32_t * il);
