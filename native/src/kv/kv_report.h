// kv_report.h — what a quantized KV cache reports about itself, the same for every backend:
// its memory (ott_kv_stats, the accounting of ott_gguf/reference/footprint.py) and the counts
// and layout of an exported KV head (ott_kv_head_state).
#pragma once

#include "kv/kv_schedule.h"

// Bytes of live data of one layer of one sequence, all KV heads: the head-blocks' codes,
// scales and mins (masks in tracing layers), the sink and window rows, and n_pooled tokens
// held in outlier and extra pools (fp16 K and V and an int32 position each).
double ott_kv_used_bytes(const ott_kv_config & cfg, int il, const ott_kv_sched & sc, int64_t n_pooled);

// Bytes the quantized cache of cfg holds at most for one sequence of n_ctx tokens, all
// layers and KV heads: sink rows, the window ring (room for a deferred prefill_fp16 chunk;
// whole_blocks: rounded up to whole blocks, as the CUDA cache allocates it), outlier and
// extra pools with their positions, three int32 counts per KV head, and the head-blocks as
// laid out (kv_layout.h: arrays on OTT_KV_ALIGN boundaries). The CUDA cache allocates this
// per sequence up front, the CPU cache up to it as a sequence grows; per context both add
// what is shared (tables, scratch). The footprint (ott_kv_used_bytes,
// reference/footprint.py) counts the data alone.
int64_t ott_kv_quant_seq_bytes(const ott_kv_config & cfg, int32_t n_ctx, bool whole_blocks);

// Stats of a cache holding n_tokens tokens (all sequences) in `used` bytes of live data
// (summed ott_kv_used_bytes) and `allocated` bytes in all.
ott_kv_stats ott_kv_stats_of(const ott_kv_config & cfg, double used, int64_t n_tokens, int64_t allocated);

// The counts and head-block layout of an export of one KV head at schedule sc; the backend
// adds its pool counts, tracing flag and the stores.
void ott_kv_export_header(const ott_kv_config & cfg, const ott_kv_sched & sc, ott_kv_head_state & out);
