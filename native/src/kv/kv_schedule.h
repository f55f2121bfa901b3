// kv_schedule.h — the schedule of the quantized KV cache (docs/design.md §2), the one place its rules
// are written in native code (ott_gguf/reference/cache.py is the Python twin):
//
//   - a new token goes to the sink while it holds fewer than `sink` tokens, else to the window;
//   - when the window holds R + block tokens its oldest `block` tokens are quantized (an event),
//     so it keeps R .. R+block-1 tokens; a prefill_fp16 chunk of several tokens defers its
//     events to the start of the sequence's next single-token step;
//   - the window is a ring of win_cap >= R + block rows per (sequence, KV head): position p
//     at row (p - sink) % win_cap;
//   - a sequence holds at most n_ctx tokens.
//
// The schedule is the same in every layer and KV head of a sequence. A step's plan lists, per
// sequence, what the backends then execute in order: the deferred events to fire before
// attention, the appends of the chunk's tokens, and the events they trigger.
#pragma once

#include "common.h"
#include "kv/kv_config.h"

#include <vector>

struct ott_ubatch;

// The schedule of one sequence.
struct ott_kv_sched {
    int32_t n_tokens = 0;  // tokens appended = position of the next one
    int32_t n_sink   = 0;  // tokens in the sink
    int32_t n_blocks = 0;  // quantized blocks
    int32_t n_win    = 0;  // tokens in the fp16 window

    // Position of the oldest window token.
    int32_t win_pos0(const ott_kv_config & cfg) const { return n_sink + n_blocks * cfg.geom.block; }
    // Events due now (a deferred chunk may leave several).
    int32_t events_due(const ott_kv_config & cfg) const;
    // Appends until the next event fires (after the last of them), counting from here.
    int32_t tokens_until_event(const ott_kv_config & cfg) const;
    // The schedule after appending n tokens, firing events on the way unless deferred.
    ott_kv_sched advance(const ott_kv_config & cfg, int32_t n, bool defer) const;
    // The schedule after the events due now.
    ott_kv_sched fire_due(const ott_kv_config & cfg) const;
    // Keep the first n_keep tokens of sequence `seq` (0 < n_keep < n_tokens); quantized
    // tokens cannot be dropped.
    ott_status truncate(const ott_kv_config & cfg, int32_t seq, int32_t n_keep);
};

// The most quantized blocks a sequence of n_ctx tokens holds.
int32_t ott_kv_max_blocks(const ott_kv_config & cfg, int32_t n_ctx);
// Window ring rows per (sequence, KV head) that hold n_win tokens: at least R + block.
int32_t ott_kv_win_cap(const ott_kv_config & cfg, int32_t n_win);
// The ring rows a cache allocates up front for a context of n_ctx tokens: room for a
// deferred prefill_fp16 chunk of the whole context, rounded up to whole blocks (the CUDA
// cache; kv_report.h: ott_kv_quant_seq_bytes).
int32_t ott_kv_ring_rows(const ott_kv_config & cfg, int32_t n_ctx);
// The ring row of window position pos (pos >= sink) in a ring of win_cap rows.
inline int32_t ott_kv_win_row(const ott_kv_config & cfg, int32_t win_cap, int32_t pos) {
    return (pos - cfg.sink) % win_cap;
}

// A new token of a step: ubatch token `tok` of sequence `seq` at position `pos`, stored in
// sink row `sink_row`, or in the window (sink_row < 0).
struct ott_kv_append {
    int32_t tok;
    int32_t seq;
    int32_t pos;
    int32_t sink_row;
};

// A quantization event: block `block_idx` of sequence `seq` (positions pos0 .. pos0+block-1,
// the oldest window rows) becomes a head-block in every KV head. `after`: it fires once the
// sequence's first `after` appends of the step are stored (-1: before attention, deferred).
struct ott_kv_event {
    int32_t seq;
    int32_t block_idx;
    int32_t pos0;
    int32_t after;
};

// One sequence of a step.
struct ott_kv_step_seq {
    int32_t seq;          // sequence id
    int32_t t0;           // its first token in the ubatch
    int32_t n_new;        // its tokens in the ubatch (the chunk)
    int32_t defer;        // 1: prefill_fp16 chunk, no events during its appends
    int32_t n_win_max;    // most window tokens from `before` on (ring rows the step needs)
    ott_kv_sched before;  // what attention sees: the schedule after the deferred events
    ott_kv_sched after;   // the schedule once the step is committed
    int32_t app0, n_app;  // its appends: plan.appends[app0 .. app0+n_app), in token order
    int32_t ev0, n_ev;    // its events: plan.events[ev0 .. ev0+n_ev), in order (deferred first)
};

struct ott_kv_plan {
    std::vector<ott_kv_step_seq> seqs;
    std::vector<ott_kv_append> appends;
    std::vector<ott_kv_event> events;
    int32_t max_blocks = 0;  // most head-blocks one sequence attends over
    int32_t max_new    = 0;  // most chunk tokens of one sequence
    int32_t max_events = 0;  // most events of one sequence (deferred ones included)
};

// The plan of a ubatch over the sequences' schedules sched[n_seq_max].
ott_kv_plan ott_kv_plan_step(const ott_kv_config & cfg, const std::vector<ott_kv_sched> & sched, const ott_ubatch & ub);

// The context-full check: sequence seq holds n_tokens and would take n_new more.
ott_status ott_kv_check_fits(int32_t seq, int32_t n_tokens, int32_t n_new, int32_t n_ctx);
