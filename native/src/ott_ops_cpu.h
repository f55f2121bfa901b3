// ott_ops_cpu.h — CPU workers of the quantized KV cache, run as ggml custom ops inside a
// step's graph (threads split the work by ith/nth):
//
//   ott_cpu_attn_partial  fused attention of a ubatch's queries over sink, quantized blocks
//                         (minus masked slots), outlier pool, extra pool, fp16 window and the
//                         chunk itself (causal, its K/V rounded to fp16); one partial softmax
//                         (max, sum, weighted values) per work item
//   ott_cpu_attn_merge    merges the partials of each query row into the attention output
//   ott_cpu_kv_append     appends the chunk's K/V (fp16) and runs the quantization events
//                         on the way (kv_quant.h: OTT selection, pools, block quantization)
//
// The cache (kv_ott.cpp) owns the state below and plans a step (ott_kv_step); the ops read
// the state as it stood before the step, and append runs after attention in each layer.
#pragma once

#include "kv_cache.h"
#include "kv_layout.h"

#include "ggml.h"

#include <vector>

// Every knob of the quantized cache, resolved for the model.
struct ott_kv_config {
    ott_kv_geom         geom;       // head_dim, block, bits, groups
    ott_kv_block_layout layout;     // offsets inside a head-block
    int32_t window;                 // R
    int32_t pool;                   // outlier-pool capacity per KV head
    int32_t extra_pool;             // extra-pool capacity per KV head
    int32_t skip_layers;
    int32_t sink;
    int32_t prefill_fp16;
    int32_t n_layer;
    int32_t n_head_kv;

    bool traces(int il) const { return pool > 0 && il >= skip_layers; }
    int32_t pool_cap(int il) const { return traces(il) ? pool : 0; }
    int32_t extra_cap(int il) const { return traces(il) ? extra_pool : 0; }
    size_t  event_bytes() const { return (size_t) layout.size * (size_t) n_head_kv; }  // one event, all heads
};

// Validate every knob (one line naming the bad one) and resolve them for the model.
ott_status ott_kv_config_resolve(const ott_kv_params & params, const ott_kv_shape & shape, ott_kv_config & out);

// The schedule of one sequence: identical in every layer and KV head.
struct ott_kv_sched {
    int32_t n_tokens = 0;   // tokens appended = position of the next one
    int32_t n_sink   = 0;   // tokens in the sink
    int32_t n_blocks = 0;   // quantized blocks
    int32_t n_win    = 0;   // tokens in the fp16 window

    // Keep the first n_keep (0 < n_keep < n_tokens) tokens of sequence `seq`; quantized
    // tokens cannot be dropped (the stores of the CPU and CUDA caches follow the schedule).
    ott_status truncate(int32_t seq, int32_t n_keep, int32_t sink, int32_t block) {
        const int32_t frozen = n_blocks > 0 ? n_sink + n_blocks * block : 0;
        if (n_keep < frozen) {
            return ott_fail(OTT_ERR_UNSUPPORTED, "sequence %d: cannot keep %d of its %d tokens, the first %d are quantized "
                            "(a quantized cache keeps at least those, or clears with n_keep = 0)",
                            seq, n_keep, n_tokens, frozen);
        }
        n_tokens = n_keep;
        n_sink   = n_keep < sink ? n_keep : sink;
        n_win    = n_keep - n_sink - n_blocks * block;
        return OTT_OK;
    }
};

// The stores of one layer of one sequence, all KV heads (head-major).
struct ott_kv_layer_seq {
    std::vector<ott_fp16> sink_k, sink_v;     // [n_head_kv][sink][head_dim]
    std::vector<ott_fp16> win_k, win_v;       // [n_head_kv][win_cap][head_dim]
    std::vector<ott_fp16> pool_k, pool_v;     // [n_head_kv][pool_cap][head_dim]
    std::vector<int32_t>  pool_pos;           // [n_head_kv][pool_cap]
    std::vector<ott_fp16> extra_k, extra_v;   // [n_head_kv][extra_cap][head_dim]
    std::vector<int32_t>  extra_pos;          // [n_head_kv][extra_cap]
    std::vector<int32_t>  n_pool, n_extra;    // [n_head_kv]
    std::vector<int32_t>  tracing;            // [n_head_kv] 1 while the head traces
    std::vector<uint8_t *> blocks;            // [>= n_blocks] event j: n_head_kv head-blocks side by side
};

// One sequence of a step.
struct ott_kv_step_seq {
    int32_t seq;            // sequence id
    int32_t t0;             // its first token in the ubatch
    int32_t n_new;          // its tokens in the ubatch (the chunk)
    int32_t defer;          // 1: prefill_fp16 chunk, no events during the append
    int32_t win_cap;        // window rows per head
    ott_kv_sched before;    // schedule when the step starts
};

// One unit of attention work: query rows of one KV head of one sequence over a key range.
struct ott_kv_attn_item {
    int32_t sq;             // index into ott_kv_step::seqs
    int32_t head;           // KV head
    int32_t i0, n_q;        // chunk tokens [i0, i0+n_q) whose queries it computes
    int32_t b0, b1;         // quantized blocks [b0, b1) it reads
    int32_t fp16;           // 1: it also reads sink, pools, window and the chunk itself
};

struct ott_kv_step;

// What one layer's ops get as userdata.
struct ott_kv_layer_op {
    ott_kv_step * step;
    int32_t       il;
};

// A step as planned by the cache's begin(): valid while the graph computes.
struct ott_kv_step {
    const ott_kv_config * cfg;
    ott_kv_layer_seq    * layers;             // [n_layer][n_seq_max], row-major
    int32_t               n_seq_max;
    int32_t               n_head;             // query heads
    float                 kq_scale;
    int32_t               rows_max;           // query rows per item: n_rep * max n_q
    std::vector<ott_kv_step_seq>  seqs;
    std::vector<ott_kv_attn_item> items;      // grouped: items of one query group are consecutive
    std::vector<int32_t>          groups;     // [n_groups+1] first item of each group
    std::vector<ott_kv_layer_op>  layer_ops;  // [n_layer]
    std::vector<std::vector<uint8_t>> * scratch;  // [OTT_MAX_THREADS] per-thread work memory

    ott_kv_layer_seq & ls(int il, int32_t seq) const { return layers[(size_t) il * n_seq_max + seq]; }
};

// Threads a ggml CPU backend may run (ott_context_set_threads allows up to 512).
constexpr int OTT_MAX_THREADS = 512;

// Floats of one item's partial result per query row: max, sum, then head_dim weighted values.
inline int64_t ott_attn_partial_row(int32_t head_dim) { return head_dim + 2; }

// dst: F32 [head_dim+2, rows_max, n_items]; src: q F32 [head_dim, n_head, n_tokens],
// k, v F32 [head_dim, n_head_kv, n_tokens]
void ott_cpu_attn_partial(ggml_tensor * dst, int ith, int nth, void * userdata);
// dst: F32 [head_dim*n_head, n_tokens]; src: the partials
void ott_cpu_attn_merge(ggml_tensor * dst, int ith, int nth, void * userdata);
// dst: F32 [1] (ordering only); src: k, v F32 [head_dim, n_head_kv, n_tokens], attention output
void ott_cpu_kv_append(ggml_tensor * dst, int ith, int nth, void * userdata);

// The quantization events of one KV head of one layer, from sched's state until the window
// holds fewer than R + block tokens (used to flush deferred prefill_fp16 chunks). Returns
// the schedule after them; the head-blocks must be allocated already.
ott_kv_sched ott_kv_run_events(const ott_kv_config & cfg, ott_kv_layer_seq & ls, int il, int h,
                               int32_t win_cap, ott_kv_sched sched, std::vector<uint8_t> & scratch);
