// kv_layered.cpp — the KV cache of a model with local (sliding-window) and global layers
// (kv_layered.h): each layer is delegated to the cache of its kind under its index among the
// layers of that kind. Both parts see every step (begin, inputs, commit) and every sequence
// operation, so the sequences' lengths agree; a truncation is checked against the ring before
// either part changes.
//
// On a GPU whose quantized cache attends outside the graph (kv_cache.h: external_attention),
// the executor ends a graph segment at each layer: a local layer's segment is empty (its
// fp16 attention is in the graph, so its nodes run in the next global layer's segment) and
// its run_layer does nothing.
#include "kv/kv_layered.h"

#include "kv/kv_config.h"

namespace {

// The fp16 ring of the n_local local layers: n_swa - 1 + n_ubatch rows, at most n_ctx.
ott_kv_shape ring_shape_of(const ott_kv_shape & sh, int32_t n_local, int32_t n_swa, int32_t n_ubatch) {
    ott_kv_shape ring = sh;
    ring.n_layer      = n_local;
    ring.n_ctx        = (int32_t)std::min<int64_t>(sh.n_ctx, (int64_t)n_swa - 1 + n_ubatch);
    return ring;
}

// The params and shape of the n_global global layers: skip_layers counts the model's layers,
// so the global ones below it skip (the per-layer tables are the caller's to pick).
void global_part(const ott_kv_params & params, const ott_kv_shape & sh, const std::vector<uint8_t> & local,
                 int32_t n_global, ott_kv_params & gp, ott_kv_shape & gs) {
    gp             = params;
    gp.skip_layers = 0;
    for (int il = 0; il < params.skip_layers && il < (int)local.size(); ++il) gp.skip_layers += !local[il];
    gs         = sh;
    gs.n_layer = n_global;
}

class kv_layered final : public ott_kv_cache {
public:
    kv_layered(const ott_kv_shape & shape, const std::vector<uint8_t> & local, int32_t n_swa)
        : sh(shape), local(local), index(local.size()), n_swa(n_swa) {
        int32_t n[2] = { 0, 0 };
        for (size_t il = 0; il < local.size(); ++il) index[il] = n[local[il] ? 1 : 0]++;
        n_global = n[0];
        n_local  = n[1];
    }

    ott_status init(const ott_kv_params & params, int32_t n_ubatch) {
        const ott_kv_shape ring_shape = ring_shape_of(sh, n_local, n_swa, n_ubatch);
        ring_rows                     = ott_kv_f16_seq_rows(ring_shape);
        OTT_TRY(ott_kv_f16_window_create(ring_shape, n_swa, ring));
        if (n_global == 0)
            return ott_kv_params_validate(params, sh);  // nothing to quantize; the knobs are still checked
        ott_kv_params global_params;
        ott_kv_shape global_shape;
        global_part(params, sh, local, n_global, global_params, global_shape);
        // per-layer tables of the model's layers, read for the global ones in their order
        std::vector<float> tables, tier_scale;
        if (params.type == OTT_KV_KVQUANT && params.kvq_tables) {
            global_params.kvq_tables =
                global_rows(params.kvq_tables, ott_kvq_layer_floats(params, sh.n_head_kv, sh.n_embd_head), tables);
        }
        if (params.tier_scale) {
            global_params.tier_scale =
                global_rows(params.tier_scale, (size_t)sh.n_head_kv * sh.n_embd_head, tier_scale);
        }
        return ott_kv_cache_create(global_params, global_shape, global);
    }

    ott_status begin(const ott_ubatch & ub) override {
        OTT_TRY(ring->begin(ub));  // checks the chunks fit the ring; changes no sequence
        return global ? global->begin(ub) : OTT_OK;
    }

    void build_inputs(ggml_context * ctx) override {
        ring->build_inputs(ctx);
        if (global) global->build_inputs(ctx);
    }

    ggml_tensor * build_attn(ggml_context * ctx, ggml_cgraph * gf, int il, ggml_tensor * q, ggml_tensor * k,
                             ggml_tensor * v, float kq_scale) override {
        return part(il).build_attn(ctx, gf, index[il], q, k, v, kq_scale);
    }

    void set_inputs() override {
        ring->set_inputs();
        if (global) global->set_inputs();
    }

    void commit() override {
        ring->commit();
        if (global) global->commit();
    }

    bool external_attention() const override { return global && global->external_attention(); }

    int segment_end(int il) const override {
        for (int j = il; j >= 0; --j) {  // a local layer ends where the last global one did
            if (!local[j]) return global->segment_end(index[j]);
        }
        return 0;
    }

    ott_status prepare_step(CUstream_st * stream) override { return global ? global->prepare_step(stream) : OTT_OK; }

    ott_status run_layer(int il, CUstream_st * stream) override {
        return local[il] ? OTT_OK : global->run_layer(index[il], stream);
    }

    int32_t seq_len(int32_t seq) const override { return ring->seq_len(seq); }

    ott_status seq_truncate(int32_t seq, int32_t n_keep) override {
        const int32_t len = ring->seq_len(seq);
        if (n_keep < len && !ott_kv_ring_holds(n_swa, ring_rows, len, n_keep)) {
            return ring->seq_truncate(seq, n_keep);  // fails, saying which positions are gone
        }
        if (global) OTT_TRY(global->seq_truncate(seq, n_keep));  // fails leaving the sequence as it was
        return ring->seq_truncate(seq, n_keep);
    }

    ott_status seq_copy(int32_t src, int32_t dst) override {
        if (global) OTT_TRY(global->seq_copy(src, dst));
        return ring->seq_copy(src, dst);
    }

    // Bytes add up; per token and layer, each part's figure weighs by its layers.
    ott_kv_stats stats() const override {
        ott_kv_stats st      = ring->stats();
        const double n_layer = n_local + n_global;
        st.bytes_per_token_layer *= n_local / n_layer;
        st.bits_per_element *= n_local / n_layer;
        if (global) {
            const ott_kv_stats g = global->stats();
            st.bytes_allocated += g.bytes_allocated;
            st.bytes_used += g.bytes_used;
            st.bytes_per_token_layer += g.bytes_per_token_layer * n_global / n_layer;
            st.bits_per_element += g.bits_per_element * n_global / n_layer;
        }
        return st;
    }

    int32_t tokens_until_event(int32_t seq) const override { return global ? global->tokens_until_event(seq) : 0; }

    bool keys_before_rope(int il) const override { return !local[il] && global->keys_before_rope(index[il]); }

    ott_status export_head(int il, int32_t seq, int32_t head, ott_kv_head_state & out) const override {
        return part(il).export_head(index[il], seq, head, out);
    }

private:
    ott_kv_cache & part(int il) const { return local[il] ? *ring : *global; }

    // The rows of the global layers of a per-layer table ([n_layer][per_layer] floats), copied
    // into out in their order; returns out's data.
    const float * global_rows(const float * table, size_t per_layer, std::vector<float> & out) const {
        for (size_t il = 0; il < local.size(); ++il) {
            if (!local[il]) out.insert(out.end(), table + il * per_layer, table + (il + 1) * per_layer);
        }
        return out.data();
    }

    ott_kv_shape sh;             // the whole model
    std::vector<uint8_t> local;  // [n_layer] 1: local layer
    std::vector<int32_t> index;  // [n_layer] the layer's index among those of its kind
    int32_t n_swa;
    int32_t n_local = 0, n_global = 0;
    int32_t ring_rows = 0;                 // the ring's rows per sequence
    std::unique_ptr<ott_kv_cache> ring;    // local layers: fp16 ring of the window
    std::unique_ptr<ott_kv_cache> global;  // global layers: the chosen mode; null when there are none
};

}  // namespace

ott_status ott_kv_layered_create(const ott_kv_params & params, const ott_kv_shape & shape,
                                 const std::vector<uint8_t> & local, int32_t n_swa, int32_t n_ubatch,
                                 std::unique_ptr<ott_kv_cache> & out) {
    if (std::none_of(local.begin(), local.end(), [](uint8_t l) { return l != 0; }))
        return ott_kv_cache_create(params, shape, out);
    if ((int32_t)local.size() != shape.n_layer || n_swa <= 0 || n_ubatch <= 0) {
        return ott_fail(OTT_ERR_INVALID_ARG, "layered KV cache: %zu layer kinds for %d layers, window %d, ubatch %d",
                        local.size(), shape.n_layer, n_swa, n_ubatch);
    }
    auto c = std::make_unique<kv_layered>(shape, local, n_swa);
    OTT_TRY(c->init(params, n_ubatch));
    out = std::move(c);
    return OTT_OK;
}

ott_status ott_kv_layered_seq_bytes(const ott_kv_params & params, const ott_kv_shape & shape,
                                    const std::vector<uint8_t> & local, int32_t n_swa, int32_t n_ubatch,
                                    int64_t & out) {
    const int32_t n_local = (int32_t)std::count_if(local.begin(), local.end(), [](uint8_t l) { return l != 0; });
    if (n_local == 0) return ott_kv_cache_seq_bytes(params, shape, out);
    if ((int32_t)local.size() != shape.n_layer || n_swa <= 0 || n_ubatch <= 0) {
        return ott_fail(OTT_ERR_INVALID_ARG, "layered KV cache: %zu layer kinds for %d layers, window %d, ubatch %d",
                        local.size(), shape.n_layer, n_swa, n_ubatch);
    }
    const ott_kv_shape ring  = ring_shape_of(shape, n_local, n_swa, n_ubatch);
    const int64_t ring_bytes = (int64_t)ott_kv_f16_seq_rows(ring) * 2 * shape.n_embd_head * (int64_t)sizeof(ott_fp16) *
                               shape.n_head_kv * n_local;
    if (n_local == shape.n_layer) {
        OTT_TRY(ott_kv_params_validate(params, shape));
        out = ring_bytes;
        return OTT_OK;
    }
    ott_kv_params gp;
    ott_kv_shape gs;
    global_part(params, shape, local, shape.n_layer - n_local, gp, gs);
    OTT_TRY(ott_kv_cache_seq_bytes(gp, gs, out));
    out += ring_bytes;
    return OTT_OK;
}
