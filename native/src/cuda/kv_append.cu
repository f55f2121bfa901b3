// kv_append.cu — new tokens' K and V into the fp16 stores: each F32 value rounded to fp16
// as ott_cpu_kv_append does (ott_fp32_to_fp16_ref), into a sink row or a window-ring row.
#include "cuda/ott_cuda.h"
#include "cuda/kv_quant.cuh"

namespace {

// grid: (n_items, n_head_kv); threads over channels
__global__ void kv_append_kernel(const ott_cuda_kv_layer L, const ott_cuda_f32_3d k, const ott_cuda_f32_3d v,
                                 const ott_cuda_append * items) {
    const ott_cuda_append it = items[blockIdx.x];
    const int32_t h = blockIdx.y, hd = L.geom.head_dim;
    const int64_t sh = (int64_t)it.seq * L.n_head_kv + h;
    ott_fp16 *kd, *vd;
    if (it.row >= 0) {
        kd = L.sink_k + ((size_t)sh * L.sink + it.row) * hd;
        vd = L.sink_v + ((size_t)sh * L.sink + it.row) * hd;
    } else {
        kd = L.win_k + ((size_t)sh * L.win_cap + (-it.row - 1)) * hd;
        vd = L.win_v + ((size_t)sh * L.win_cap + (-it.row - 1)) * hd;
    }
    const float * kr = k.data + it.tok * k.nb2 + h * k.nb1;
    const float * vr = v.data + it.tok * v.nb2 + h * v.nb1;
    for (int32_t c = threadIdx.x; c < hd; c += blockDim.x) {
        kd[c] = ott_fp32_to_fp16_ref(kr[c]);
        vd[c] = ott_fp32_to_fp16_ref(vr[c]);
    }
}

}  // namespace

cudaError_t ott_cuda_kv_append(const ott_cuda_kv_layer & L, ott_cuda_f32_3d k, ott_cuda_f32_3d v,
                               const ott_cuda_append * items, int32_t n_items, cudaStream_t stream) {
    if (n_items == 0) return cudaSuccess;
    const int threads = L.geom.head_dim < 256 ? L.geom.head_dim : 256;
    kv_append_kernel<<<dim3(n_items, L.n_head_kv), threads, 0, stream>>>(L, k, v, items);
    return cudaGetLastError();
}
