// kv_report.h — what a quantized KV cache reports about itself, the same for every backend:
// its memory (ott_kv_stats, the accounting of ott_gguf/reference/footprint.py) and the counts
// and layout of an exported KV head (ott_kv_head_state).
#pragma once

#include "kv/kv_schedule.h"

// Bytes of live data of one layer of one sequence, all KV heads: the head-blocks' codes,
// scales and mins (masks in tracing layers), the sink and window rows, and n_pooled tokens
// held in outlier and extra pools (fp16 K and V and an int32 position each).
double ott_kv_used_bytes(const ott_kv_config & cfg, int il, const ott_kv_sched & sc, int64_t n_pooled);

// Stats of a cache holding n_tokens tokens (all sequences) in `used` bytes of live data
// (summed ott_kv_used_bytes) and `allocated` bytes in all.
ott_kv_stats ott_kv_stats_of(const ott_kv_config & cfg, double used, int64_t n_tokens, int64_t allocated);

// The counts and head-block layout of an export of one KV head at schedule sc; the backend
// adds its pool counts, tracing flag and the stores.
void ott_kv_export_header(const ott_kv_config & cfg, const ott_kv_sched & sc, ott_kv_head_state & out);
