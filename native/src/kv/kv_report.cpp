// kv_report.cpp — memory accounting and export header of the quantized KV cache (kv_report.h).
#include "kv/kv_report.h"

double ott_kv_used_bytes(const ott_kv_config & cfg, int il, const ott_kv_sched & sc, int64_t n_pooled) {
    const int64_t token    = 2 * (int64_t)cfg.geom.head_dim * sizeof(ott_fp16);
    const int64_t n_recent = cfg.n_recent(sc.n_blocks);
    const int64_t blocks =
        (int64_t)(sc.n_blocks - n_recent) * (int64_t)(cfg.kvq ? ott_kvq_block_data_bytes(&cfg.kvq_geom)
                                                              : ott_kv_block_data_bytes(&cfg.geom, cfg.traces(il))) +
        (n_recent ? n_recent * (int64_t)ott_kv_block_data_bytes(&cfg.rgeom, cfg.traces(il)) : 0);
    return (double)cfg.n_head_kv * (double)(blocks + (int64_t)(sc.n_sink + sc.n_win) * token) +
           (double)n_pooled * (double)(token + (int64_t)sizeof(int32_t));
}

int64_t ott_kv_quant_seq_bytes(const ott_kv_config & cfg, int32_t n_ctx, bool whole_blocks) {
    const int64_t hd = cfg.geom.head_dim, token = 2 * hd * (int64_t)sizeof(ott_fp16);
    const int64_t rows     = cfg.sink + (whole_blocks ? ott_kv_ring_rows(cfg, n_ctx)
                                                      : ott_kv_win_cap(cfg, cfg.prefill_fp16 ? n_ctx - cfg.sink : 0));
    const int64_t n_blocks = ott_kv_max_blocks(cfg, n_ctx), n_recent = cfg.n_recent((int32_t)n_blocks);
    const int64_t blocks = (n_blocks - n_recent) * cfg.layout.size + n_recent * cfg.rlayout.size;
    int64_t total        = 0;
    for (int il = 0; il < cfg.n_layer; ++il) {
        const int64_t pooled = cfg.pool_cap(il) + cfg.extra_cap(il);
        total += cfg.n_head_kv * (rows * token + pooled * (token + (int64_t)sizeof(int32_t)) + 3 * 4 + blocks);
    }
    return total;
}

ott_kv_stats ott_kv_stats_of(const ott_kv_config & cfg, double used, int64_t n_tokens, int64_t allocated) {
    ott_kv_stats st {};
    st.n_tokens        = n_tokens;
    st.bytes_allocated = allocated;
    st.bytes_used      = (int64_t)used;
    if (n_tokens > 0) {
        const double token_layers = (double)n_tokens * cfg.n_layer;
        st.bytes_per_token_layer  = used / token_layers;
        st.bits_per_element       = 8.0 * used / (token_layers * cfg.n_head_kv * 2 * cfg.geom.head_dim);
    }
    return st;
}

void ott_kv_export_header(const ott_kv_config & cfg, const ott_kv_sched & sc, ott_kv_head_state & out) {
    out.n_tokens                  = sc.n_tokens;
    out.n_sink                    = sc.n_sink;
    out.n_blocks                  = sc.n_blocks;
    out.n_window                  = sc.n_win;
    out.block_bytes               = (int32_t)cfg.layout.size;
    const ott_kv_block_layout & L = cfg.layout;
    const uint32_t offs[8]        = { L.k_scale, L.k_min, L.v_scale, L.v_min, L.k_codes, L.v_codes, L.mask, L.k_order };
    for (int i = 0; i < 8; ++i) out.block_offsets[i] = (int32_t)offs[i];
    const ott_kv_block_layout & R = cfg.rlayout;
    const uint32_t roffs[8]       = { R.k_scale, R.k_min, R.v_scale, R.v_min, R.k_codes, R.v_codes, R.mask, R.k_order };
    out.n_recent                  = cfg.n_recent(sc.n_blocks);
    out.recent_bytes              = (int32_t)R.size;
    for (int i = 0; i < 8; ++i) out.recent_offsets[i] = (int32_t)roffs[i];
}
