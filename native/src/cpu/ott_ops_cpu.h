// ott_ops_cpu.h — CPU workers of the quantized KV cache, run as ggml custom ops inside a
// step's graph (threads split the work by ith/nth; the attention items they take in turn):
//
//   ott_cpu_attn_partial  fused attention of a ubatch's queries over sink, quantized blocks
//                         (minus masked slots), outlier pool, extra pool, fp16 window and the
//                         chunk itself (causal, its K/V rounded to fp16); one partial softmax
//                         (max, sum, weighted values) per work item. KVQuant head-blocks are
//                         dequantised tile by tile and, with keys cached before RoPE, every
//                         key is rotated at its position (kvq_attn_cpu.h)
//   ott_cpu_attn_merge    merges the partials of each query row into the attention output
//   ott_cpu_kv_append     appends the chunk's K/V (fp16) and runs the quantization events
//                         on the way (kv_quant.h: OTT selection, pools, block quantization;
//                         kv_kvq.h for the KVQuant scheme)
//
// The cache (kv_quant_cpu.cpp) owns the state below and hands the ops a step (ott_kv_step:
// the core's plan, kv/kv_schedule.h, and the attention items); the ops read the state as it
// stood before the step, and append runs after attention in each layer.
#pragma once

#include "kv/kv_cache.h"
#include "kv/kv_schedule.h"
#include "kv/kvq_types.h"

#include "ggml.h"

#include <atomic>
#include <memory>
#include <vector>

// The stores of one layer of one sequence, all KV heads (head-major).
struct ott_kv_layer_seq {
    std::vector<ott_fp16> sink_k, sink_v;    // [n_head_kv][sink][head_dim]
    std::vector<ott_fp16> win_k, win_v;      // [n_head_kv][win_cap][head_dim] ring: position p at
                                             // row ott_kv_win_row(p), win_cap of the sequence
    std::vector<ott_fp16> pool_k, pool_v;    // [n_head_kv][pool_cap][head_dim]
    std::vector<int32_t> pool_pos;           // [n_head_kv][pool_cap]
    std::vector<ott_fp16> extra_k, extra_v;  // [n_head_kv][extra_cap][head_dim]
    std::vector<int32_t> extra_pos;          // [n_head_kv][extra_cap]
    std::vector<int32_t> n_pool, n_extra;    // [n_head_kv]
    std::vector<int32_t> tracing;            // [n_head_kv] 1 while the head traces
    std::vector<uint8_t *> blocks;           // [>= n_blocks - recent] event j: n_head_kv head-blocks side by side
    std::vector<uint8_t *> recent;           // [<= recent] ring of recent blocks (cfg.rlayout): block j
                                             // at slot j % recent while it is one of the newest
};

// One unit of attention work: query rows of one KV head of one sequence over a key range.
struct ott_kv_attn_item {
    int32_t sq;       // index into ott_kv_step::plan.seqs
    int32_t head;     // KV head
    int32_t i0, n_q;  // chunk tokens [i0, i0+n_q) whose queries it computes
    int32_t b0, b1;   // quantized blocks [b0, b1) it reads
    int32_t fp16;     // 1: it also reads sink, pools, window and the chunk itself
};

struct ott_kv_step;

// What one layer's ops get as userdata.
struct ott_kv_layer_op {
    ott_kv_step * step;
    int32_t il;
};

// A step as planned by the cache's begin(): valid while the graph computes.
struct ott_kv_step {
    const ott_kv_config * cfg;
    const ott_kv_config * rcfg;  // cfg as it reads a recent block (ott_kv_config::recent_view), or null
    ott_kv_layer_seq * layers;   // [n_layer][n_seq_max], row-major
    const int32_t * win_cap;     // [n_seq_max] window ring rows of each sequence
    int32_t n_seq_max;
    int32_t n_head;  // query heads
    float kq_scale;
    int32_t rows_max;                               // query rows per item: n_rep * max n_q
    ott_kv_plan plan;                               // appends and events (kv/kv_schedule.h)
    std::vector<ott_kv_attn_item> items;            // grouped: items of one query group are consecutive
    std::unique_ptr<std::atomic<int32_t>[]> taken;  // [n_layer] items the layer's threads have taken
    std::vector<int32_t> groups;                    // [n_groups+1] first item of each group
    std::vector<ott_kv_layer_op> layer_ops;         // [n_layer]
    std::vector<std::vector<uint8_t>> * scratch;    // [OTT_MAX_THREADS] per-thread work memory
    const ott_rope_table * rope;                    // keys before RoPE (pre_rope): their rotation; else null

    ott_kv_layer_seq & ls(int il, int32_t seq) const { return layers[(size_t)il * n_seq_max + seq]; }
};

// The n_head_kv head-blocks of block b of a sequence holding n_blocks, and the config that
// reads them (rcfg for a recent block).
inline uint8_t * ott_kv_event_of(const ott_kv_config & cfg, const ott_kv_layer_seq & ls, int32_t b, int32_t n_blocks) {
    return cfg.recent && cfg.is_recent(b, n_blocks) ? ls.recent[b % cfg.recent] : ls.blocks[b];
}

// A hot CPU function compiled for x86-64-v4 (AVX-512), v3 (AVX2/FMA) and the baseline,
// picked at load time (x86-64 Linux with GCC; elsewhere, or built with OTT_CPU_VERSIONS off,
// the baseline only). Where OTT_VERSIONS is 1, a function may instead have versions of its
// own source for these targets (GCC's function multiversioning: OTT_V4, OTT_V3, OTT_BASELINE).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) &&                           \
    !defined(OTT_NO_CPU_VERSIONS)
#define OTT_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define OTT_VERSIONS 1
#define OTT_V4 __attribute__((target("arch=x86-64-v4")))
#define OTT_V3 __attribute__((target("arch=x86-64-v3")))
#define OTT_BASELINE __attribute__((target("default")))
#else
#define OTT_CLONES
#define OTT_VERSIONS 0
#endif

// Threads a ggml CPU backend may run (ott_context_set_threads allows up to 512).
constexpr int OTT_MAX_THREADS = 512;

// Floats of one item's partial result per query row: max, sum, then head_dim weighted values.
inline int64_t ott_attn_partial_row(int32_t head_dim) { return head_dim + 2; }

// dst: F32 [head_dim+2, rows_max, n_items]; src: q F32 [head_dim, n_head, n_tokens] (after
// RoPE), k, v F32 [head_dim, n_head_kv, n_tokens] (k before RoPE when step.rope)
void ott_cpu_attn_partial(ggml_tensor * dst, int ith, int nth, void * userdata);
// dst: F32 [head_dim*n_head, n_tokens]; src: the partials
void ott_cpu_attn_merge(ggml_tensor * dst, int ith, int nth, void * userdata);
// dst: F32 [1] (ordering only); src: k, v F32 [head_dim, n_head_kv, n_tokens], attention output
void ott_cpu_kv_append(ggml_tensor * dst, int ith, int nth, void * userdata);
// Quantization event e in KV head h of one layer of its sequence (kv_quant.h's
// ott_kv_event_ref on the block's window rows, or kv_kvq.h's ott_kvq_quantize_block_ref);
// its head-blocks must be allocated already. With recent blocks it first re-codes the block
// `recent` events older (ott_kv_recode_ref) and then codes its block into the freed slot.
void ott_cpu_kv_event(const ott_kv_config & cfg, ott_kv_layer_seq & ls, int il, int h, int32_t win_cap,
                      const ott_kv_event & e, std::vector<uint8_t> & scratch);
