// executor.cpp — segment-by-segment computation of a step's graph on ggml-cuda (executor.h).
#include "cuda/executor.h"

#include "kv/kv_cache.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <vector>

namespace {

// ggml-backend-impl.h's struct ggml_backend_event: the device, then the backend's event
// (a cudaEvent_t for ggml-cuda). Read only after checking the device field (raw_event).
struct ggml_event_view {
    ggml_backend_dev_t device;
    void * context;
};

cudaEvent_t raw_event(ggml_backend_event_t e, ggml_backend_dev_t dev) {
    if (!e) return nullptr;
    const ggml_event_view * v = (const ggml_event_view *)e;
    return !dev || v->device == dev ? (cudaEvent_t)v->context : nullptr;
}

}  // namespace

#define OTT_CUDA_TRY(expr)                                                                                             \
    do {                                                                                                               \
        const cudaError_t _e = (expr);                                                                                 \
        if (_e != cudaSuccess) return ott_fail(OTT_ERR_BACKEND, "CUDA: %s: %s", #expr, cudaGetErrorString(_e));        \
    } while (0)

struct ott_cuda_executor {
    int device                   = 0;
    cudaStream_t stream          = nullptr;  // ours: the cache's kernels
    ggml_backend_event_t ev_ggml = nullptr;  // recorded on ggml's stream, waited on by ours
    ggml_backend_event_t ev_ours = nullptr;  // recorded on ours, waited on by ggml's
    bool events_ok               = false;    // else the streams are ordered by host syncs
    ggml_context * seg_ctx       = nullptr;
    std::vector<ggml_cgraph *> segs;  // [n_layer + 1]

    ~ott_cuda_executor() {
        cudaSetDevice(device);
        if (stream) cudaStreamSynchronize(stream);
        if (ev_ggml) ggml_backend_event_free(ev_ggml);
        if (ev_ours) ggml_backend_event_free(ev_ours);
        if (stream) cudaStreamDestroy(stream);
        if (seg_ctx) ggml_free(seg_ctx);
    }

    // Segment i: the nodes from layer i-1's end to layer i's (the last one: everything after
    // the last layer's attention).
    ott_status build_segments(ggml_cgraph * gf, const ott_kv_cache & kv, int n_layer) {
        std::vector<int> bounds(1, 0);
        for (int il = 0; il < n_layer; ++il) bounds.push_back(kv.segment_end(il));
        bounds.push_back(ggml_graph_n_nodes(gf));
        size_t mem = 0;
        for (int i = 0; i <= n_layer; ++i)
            mem += ggml_graph_overhead_custom(std::max(1, bounds[i + 1] - bounds[i]), false);
        if (seg_ctx) ggml_free(seg_ctx);
        ggml_init_params ip = { mem + 1024, nullptr, true };
        seg_ctx             = ggml_init(ip);
        if (!seg_ctx) return ott_fail(OTT_ERR_ALLOC, "cannot allocate the graph segments");
        segs.clear();
        for (int i = 0; i <= n_layer; ++i) {
            ggml_cgraph * g = ggml_new_graph_custom(seg_ctx, std::max(1, bounds[i + 1] - bounds[i]), false);
            for (int n = bounds[i]; n < bounds[i + 1]; ++n) ggml_graph_add_node(g, ggml_graph_node(gf, n));
            segs.push_back(g);
        }
        return OTT_OK;
    }
};

ott_status ott_cuda_executor_create(ggml_backend_t backend, int cuda_device, ott_cuda_executor ** out) {
    auto ex    = std::make_unique<ott_cuda_executor>();
    ex->device = cuda_device;
    OTT_CUDA_TRY(cudaSetDevice(cuda_device));
    OTT_CUDA_TRY(cudaStreamCreateWithFlags(&ex->stream, cudaStreamNonBlocking));
    // segments are ordered by ggml's events; raw_event checks we read them right
    ggml_backend_dev_t dev = ggml_backend_get_device(backend);
    ggml_backend_dev_props props;
    ggml_backend_dev_get_props(dev, &props);
    if (props.caps.events) {
        ex->ev_ggml = ggml_backend_event_new(dev);
        ex->ev_ours = ggml_backend_event_new(dev);
    }
    ex->events_ok = raw_event(ex->ev_ggml, dev) && raw_event(ex->ev_ours, dev);
    *out          = ex.release();
    return OTT_OK;
}

void ott_cuda_executor_free(ott_cuda_executor * ex) { delete ex; }

ott_status ott_cuda_executor_compute(ott_cuda_executor * ex, ggml_backend_t backend, ggml_cgraph * gf,
                                     ott_kv_cache & kv, int n_layer) {
    OTT_CUDA_TRY(cudaSetDevice(ex->device));
    OTT_TRY(ex->build_segments(gf, kv, n_layer));
    OTT_TRY(kv.prepare_step(ex->stream));
    for (int il = 0; il <= n_layer; ++il) {
        if (ggml_graph_n_nodes(ex->segs[il]) > 0 &&
            ggml_backend_graph_compute_async(backend, ex->segs[il]) != GGML_STATUS_SUCCESS) {
            return ott_fail(OTT_ERR_BACKEND, "graph segment %d failed", il);
        }
        if (il == n_layer) break;
        if (ex->events_ok) {  // our stream after ggml's
            ggml_backend_event_record(ex->ev_ggml, backend);
            OTT_CUDA_TRY(cudaStreamWaitEvent(ex->stream, raw_event(ex->ev_ggml, nullptr), 0));
        } else {
            ggml_backend_synchronize(backend);
        }
        OTT_TRY(kv.run_layer(il, ex->stream));
        if (ex->events_ok) {  // ggml's stream after ours
            OTT_CUDA_TRY(cudaEventRecord(raw_event(ex->ev_ours, nullptr), ex->stream));
            ggml_backend_event_wait(backend, ex->ev_ours);
        } else {
            OTT_CUDA_TRY(cudaStreamSynchronize(ex->stream));
        }
    }
    ggml_backend_synchronize(backend);
    OTT_CUDA_TRY(cudaStreamSynchronize(ex->stream));
    return OTT_OK;
}
