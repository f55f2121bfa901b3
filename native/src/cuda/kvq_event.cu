// kvq_event.cu — KVQuant quantization events on the GPU: ott_kvq_quantize_block_ref
// (kv/kv_kvq.c) for one block of one KV head per thread block (cuda/kv_kvq.cuh).
#include "cuda/kvq_cuda.h"
#include "cuda/kv_kvq.cuh"

namespace {

constexpr int EVENT_THREADS = 128;
constexpr size_t SMEM_MAX   = 160 * 1024;  // shared memory a block's scratch may take

// The scratch of one block (ott_kvq_quantize_block_ref's: t, the sparse flags, a row of codes
// for every thread): in shared memory up to SMEM_MAX (every pass reads it), else in device
// memory.
__host__ __device__ size_t block_scratch(const ott_kvq_geom & g) {
    const size_t n = (size_t)g.block * g.head_dim, row = (size_t)(g.block > g.head_dim ? g.block : g.head_dim);
    return (n * 6 + row * EVENT_THREADS + 15) / 16 * 16;
}
__host__ __device__ bool in_shared(const ott_kvq_geom & g) { return block_scratch(g) <= SMEM_MAX; }
__host__ __device__ size_t scratch_bytes(const ott_kvq_geom & g) { return in_shared(g) ? 0 : block_scratch(g); }

__device__ void quantize(const ott_kvq_geom & g, const ott_kvq_tables & tab, const ott_fp16 * k, const ott_fp16 * v,
                         uint8_t * out, uint8_t * scratch) {
    extern __shared__ __align__(16) uint8_t scratch_smem[];
    ott_kvq_quantize_block_ref(&g, tab.k_zero, tab.k_scale, tab.levels_k, tab.levels_v, k, v, out,
                               in_shared(g) ? scratch_smem : scratch);
}

// grid: n blocks
__global__ void __launch_bounds__(EVENT_THREADS)
    kvq_event_kernel(const ott_kvq_geom g, const ott_kvq_tables * tabs, const ott_fp16 * k, const ott_fp16 * v,
                     uint8_t * out, uint8_t * scratch) {
    const int32_t i = blockIdx.x;
    const size_t n  = (size_t)g.block * g.head_dim;
    quantize(g, tabs[i], k + i * n, v + i * n, out + (size_t)i * ott_kvq_block_layout_of(&g).size,
             scratch + i * scratch_bytes(g));
}

// grid: (n_events, n_head_kv); the block of event e in KV head h is rows row0 .. of its ring
__global__ void __launch_bounds__(EVENT_THREADS)
    kvq_layer_event_kernel(const ott_kvq_geom g, const ott_cuda_kv_layer L, const ott_kvq_tables * tabs,
                           const ott_cuda_event * events, uint8_t * scratch) {
    const ott_cuda_event e = events[blockIdx.x];
    const int32_t h        = blockIdx.y;
    const size_t rows      = ((size_t)e.seq * L.n_head_kv + h) * L.win_cap + e.row0;
    quantize(g, tabs[h], L.win_k + rows * g.head_dim, L.win_v + rows * g.head_dim,
             ott_cuda_head_block(L, e.seq, e.block_idx, h),
             scratch + ((size_t)blockIdx.x * gridDim.y + h) * scratch_bytes(g));
}

// Dynamic shared memory of a launch of `kernel` (the scratch, or none), allowed for it.
template <typename K> cudaError_t smem_for(K kernel, const ott_kvq_geom & g, size_t * smem) {
    *smem = in_shared(g) ? block_scratch(g) : 0;
    return ott_cuda_allow_smem((const void *)kernel, *smem);
}

}  // namespace

cudaError_t ott_cuda_kvq_layer_event(const ott_kvq_geom & g, const ott_cuda_kv_layer & L, const ott_kvq_tables * tabs,
                                     const ott_cuda_event * events, int32_t n_events, uint8_t * scratch,
                                     cudaStream_t stream) {
    if (n_events <= 0) return cudaSuccess;
    size_t smem         = 0;
    const cudaError_t e = smem_for(kvq_layer_event_kernel, g, &smem);
    if (e != cudaSuccess) return e;
    kvq_layer_event_kernel<<<dim3(n_events, L.n_head_kv), EVENT_THREADS, smem, stream>>>(g, L, tabs, events, scratch);
    return cudaGetLastError();
}

cudaError_t ott_cuda_kvq_event(const ott_kvq_geom & g, const ott_kvq_tables * tabs, const ott_fp16 * k,
                               const ott_fp16 * v, int32_t n, uint8_t * out, uint8_t * scratch, cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    size_t smem         = 0;
    const cudaError_t e = smem_for(kvq_event_kernel, g, &smem);
    if (e != cudaSuccess) return e;
    kvq_event_kernel<<<n, EVENT_THREADS, smem, stream>>>(g, tabs, k, v, out, scratch);
    return cudaGetLastError();
}

size_t ott_cuda_kvq_event_scratch(const ott_kvq_geom & g) { return scratch_bytes(g); }
