// kv_schedule.cpp — the schedule of the quantized KV cache and a step's plan (kv_schedule.h).
#include "kv/kv_schedule.h"

#include "kv/kv_cache.h"

#include <algorithm>

int32_t ott_kv_sched::events_due(const ott_kv_config & cfg) const {
    const int32_t over = n_win - cfg.window;
    return over >= cfg.geom.block ? over / cfg.geom.block : 0;
}

int32_t ott_kv_sched::tokens_until_event(const ott_kv_config & cfg) const {
    // a deferred prefill_fp16 window holds R+block or more: its events fire at the next
    // single-token step, before it
    return std::max(1, (cfg.sink - n_sink) + (cfg.window + cfg.geom.block - n_win));
}

ott_kv_sched ott_kv_sched::advance(const ott_kv_config & cfg, int32_t n, bool defer) const {
    ott_kv_sched sc       = *this;
    const int32_t to_sink = std::min(n, cfg.sink - sc.n_sink);
    sc.n_sink += to_sink;
    sc.n_win += n - to_sink;
    sc.n_tokens += n;
    return defer ? sc : sc.fire_due(cfg);
}

ott_kv_sched ott_kv_sched::fire_due(const ott_kv_config & cfg) const {
    ott_kv_sched sc      = *this;
    const int32_t events = sc.events_due(cfg);
    sc.n_blocks += events;
    sc.n_win -= events * cfg.geom.block;
    return sc;
}

ott_status ott_kv_sched::truncate(const ott_kv_config & cfg, int32_t seq, int32_t n_keep) {
    const int32_t frozen = n_blocks > 0 ? win_pos0(cfg) : 0;
    if (n_keep < frozen) {
        return ott_fail(OTT_ERR_UNSUPPORTED,
                        "sequence %d: cannot keep %d of its %d tokens, the first %d are quantized "
                        "(a quantized cache keeps at least those, or clears with n_keep = 0)",
                        seq, n_keep, n_tokens, frozen);
    }
    n_tokens = n_keep;
    n_sink   = std::min(n_keep, cfg.sink);
    n_win    = n_keep - n_sink - n_blocks * cfg.geom.block;
    return OTT_OK;
}

int32_t ott_kv_max_blocks(const ott_kv_config & cfg, int32_t n_ctx) {
    return std::max(0, n_ctx - cfg.sink - cfg.window) / cfg.geom.block;
}

int32_t ott_kv_win_cap(const ott_kv_config & cfg, int32_t n_win) {
    return std::max(n_win, cfg.window + cfg.geom.block);
}

int32_t ott_kv_ring_rows(const ott_kv_config & cfg, int32_t n_ctx) {
    const int32_t block = cfg.geom.block;
    return (ott_kv_win_cap(cfg, cfg.prefill_fp16 ? n_ctx - cfg.sink : 0) + block - 1) / block * block;
}

ott_kv_plan ott_kv_plan_step(const ott_kv_config & cfg, const std::vector<ott_kv_sched> & sched,
                             const ott_ubatch & ub) {
    ott_kv_plan plan;
    const int32_t block = cfg.geom.block;
    for (const ott_run & r : ub.runs) {
        for (int32_t j = 0; j < r.n_seqs; ++j) {
            ott_kv_step_seq S {};
            S.seq   = r.seq0 + j;
            S.t0    = r.t0 + j * r.n_tokens;
            S.n_new = r.n_tokens;
            S.defer = cfg.prefill_fp16 && r.n_tokens > 1;
            S.ev0   = (int32_t)plan.events.size();
            S.app0  = (int32_t)plan.appends.size();

            // events a deferred chunk left, before attention
            ott_kv_sched sc = sched[S.seq];
            if (!S.defer) {
                for (int32_t e = sc.events_due(cfg); e > 0; --e) {
                    plan.events.push_back({ S.seq, sc.n_blocks, sc.win_pos0(cfg), -1 });
                    sc.n_blocks++;
                    sc.n_win -= block;
                }
            }
            S.before    = sc;
            S.n_win_max = sc.n_win;

            // the chunk's appends, each event after the token that fills the window
            for (int32_t i = 0; i < S.n_new; ++i) {
                const bool to_sink = sc.n_sink < cfg.sink;
                plan.appends.push_back({ S.t0 + i, S.seq, sc.n_tokens, to_sink ? sc.n_sink : -1 });
                sc.n_sink += to_sink;
                sc.n_win += !to_sink;
                sc.n_tokens++;
                S.n_win_max = std::max(S.n_win_max, sc.n_win);
                if (!S.defer && sc.n_win == cfg.window + block) {
                    plan.events.push_back({ S.seq, sc.n_blocks, sc.win_pos0(cfg), i + 1 });
                    sc.n_blocks++;
                    sc.n_win -= block;
                }
            }
            S.after         = sc;
            S.n_app         = (int32_t)plan.appends.size() - S.app0;
            S.n_ev          = (int32_t)plan.events.size() - S.ev0;
            plan.max_blocks = std::max(plan.max_blocks, S.before.n_blocks);
            plan.max_new    = std::max(plan.max_new, S.n_new);
            plan.max_events = std::max(plan.max_events, S.n_ev);
            plan.seqs.push_back(S);
        }
    }
    return plan;
}

ott_status ott_kv_check_fits(int32_t seq, int32_t n_tokens, int32_t n_new, int32_t n_ctx) {
    if (n_tokens + n_new > n_ctx) {
        return ott_fail(OTT_ERR_CONTEXT_FULL, "sequence %d would hold %d tokens, more than the context size %d", seq,
                        n_tokens + n_new, n_ctx);
    }
    return OTT_OK;
}
