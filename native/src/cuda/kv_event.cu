// kv_event.cu — quantization events on the GPU: ott_kv_event_ref (kv_quant.c) for one
// (sequence, KV head) per thread block, the same steps in the same order, so the head-block,
// pools and tracing flag equal the CPU's bit for bit. The block being quantized is rows
// row0 .. row0+block-1 of the head's window ring (contiguous: win_cap is a multiple of block).
#include "cuda/ott_cuda.h"
#include "cuda/kv_quant.cuh"

namespace {

// Threads of an event; clipped ranges take more, their search having 12 candidates per group
// to try in parallel (ott_clip_pick).
constexpr int EVENT_THREADS = 128, EVENT_THREADS_CLIP = 512;

// Shared memory: unpacked codes [block*head_dim] | scores int64 [n_cand] | best int32 [pool_cap]
// | keep uint8 [n_cand] | picks uint8 [n_groups] (clipped ranges only)
struct event_smem {
    uint8_t * codes;
    int64_t * score;
    int32_t * best;
    uint8_t * keep;
    uint8_t * picks;
};

__host__ __device__ size_t codes_bytes(const ott_kv_geom & g) { return ((size_t)g.block * g.head_dim + 7) / 8 * 8; }

__device__ event_smem carve(uint8_t * smem, const ott_cuda_kv_layer & L) {
    const int32_t n_cand = L.pool_cap + L.geom.block;
    event_smem s;
    s.codes = smem;
    s.score = (int64_t *)(smem + codes_bytes(L.geom));
    s.best  = (int32_t *)(s.score + n_cand);
    s.keep  = (uint8_t *)(s.best + L.pool_cap);
    s.picks = s.keep + n_cand;
    return s;
}

__device__ void copy_row(ott_fp16 * dst, const ott_fp16 * src, int32_t hd) {
    for (int32_t c = threadIdx.x; c < hd; c += blockDim.x) dst[c] = src[c];
}

// grid: (n_events, n_head_kv)
__global__ void __launch_bounds__(EVENT_THREADS_CLIP)
    kv_event_kernel(const ott_cuda_kv_layer L, const ott_cuda_event * events) {
    extern __shared__ __align__(16) uint8_t smem_raw[];
    const ott_cuda_event ev = events[blockIdx.x];
    const int32_t h         = blockIdx.y;
    const int64_t sh        = (int64_t)ev.seq * L.n_head_kv + h;
    const int32_t hd = L.geom.head_dim, block = L.geom.block;
    const event_smem S = carve(smem_raw, L);
    __shared__ int32_t s_tracing, s_n_old;

    ott_fp16 * blk_k    = L.win_k + ((size_t)sh * L.win_cap + ev.row0) * hd;  // [block][hd]
    ott_fp16 * blk_v    = L.win_v + ((size_t)sh * L.win_cap + ev.row0) * hd;
    ott_fp16 * pool_k   = L.pool_k + (size_t)sh * L.pool_cap * hd;
    ott_fp16 * pool_v   = L.pool_v + (size_t)sh * L.pool_cap * hd;
    int32_t * pool_pos  = L.pool_pos + (size_t)sh * L.pool_cap;
    ott_fp16 * extra_k  = L.extra_k + (size_t)sh * L.extra_cap * hd;
    ott_fp16 * extra_v  = L.extra_v + (size_t)sh * L.extra_cap * hd;
    int32_t * extra_pos = L.extra_pos + (size_t)sh * L.extra_cap;
    uint8_t * out       = ott_cuda_head_block(L, ev.seq, ev.block_idx, h);

    if (threadIdx.x == 0) {
        int32_t tracing     = L.tracing[sh];
        const int32_t n_old = L.pool_cap > 0 ? L.n_pool[sh] : 0;
        if (tracing && L.extra_cap - L.n_extra[sh] < n_old) tracing = 0; /* the stop rule */
        L.tracing[sh] = tracing;
        s_tracing     = tracing;
        s_n_old       = n_old;
    }
    __syncthreads();
    const int32_t n_old = s_n_old, n_cand = n_old + block;
    uint8_t * masked = S.keep + n_old;
    for (int32_t i = threadIdx.x; i < n_cand; i += blockDim.x) S.keep[i] = 0;
    __syncthreads();

    if (s_tracing && L.pool_cap > 0) {
        for (int32_t i = threadIdx.x; i < n_cand; i += blockDim.x) {
            S.score[i] = ott_l1_score_ref(i < n_old ? pool_k + (size_t)i * hd : blk_k + (size_t)(i - n_old) * hd, hd);
        }
        __syncthreads();
        if (threadIdx.x == 0) ott_select_pool_ref(S.score, n_cand, L.pool_cap, S.keep, S.best);
        __syncthreads();

        /* evicted pool tokens go to the extra pool, kept ones move to the front, in order */
        int32_t n_pool = 0, n_extra = L.n_extra[sh];
        for (int32_t i = 0; i < n_old; ++i) {
            const int32_t pos = pool_pos[i];
            __syncthreads(); /* every thread has read pool_pos[i] */
            if (S.keep[i]) {
                copy_row(pool_k + (size_t)n_pool * hd, pool_k + (size_t)i * hd, hd);
                copy_row(pool_v + (size_t)n_pool * hd, pool_v + (size_t)i * hd, hd);
                if (threadIdx.x == 0) pool_pos[n_pool] = pos;
                n_pool++;
            } else {
                copy_row(extra_k + (size_t)n_extra * hd, pool_k + (size_t)i * hd, hd);
                copy_row(extra_v + (size_t)n_extra * hd, pool_v + (size_t)i * hd, hd);
                if (threadIdx.x == 0) extra_pos[n_extra] = pos;
                n_extra++;
            }
            __syncthreads();
        }
        for (int32_t t = 0; t < block; ++t) {
            if (masked[t]) {
                copy_row(pool_k + (size_t)n_pool * hd, blk_k + (size_t)t * hd, hd);
                copy_row(pool_v + (size_t)n_pool * hd, blk_v + (size_t)t * hd, hd);
                if (threadIdx.x == 0) pool_pos[n_pool] = ev.pos0 + t;
                n_pool++;
            }
        }
        __syncthreads(); /* every thread has read n_extra */
        if (threadIdx.x == 0) {
            L.n_pool[sh]  = n_pool;
            L.n_extra[sh] = n_extra;
        }
        ott_substitute_mean_ref(blk_k, block, hd, masked);
        ott_substitute_mean_ref(blk_v, block, hd, masked);
        __syncthreads();
    }
    const float * u = L.tier_scale ? L.tier_scale + (size_t)h * hd : nullptr;
    ott_quantize_block_ref(&L.geom, blk_k, blk_v, masked, u, out, S.codes, S.picks);
}

}  // namespace

size_t ott_cuda_kv_event_smem(const ott_cuda_kv_layer & L) {
    const size_t n_cand = (size_t)L.pool_cap + (size_t)L.geom.block;
    const size_t picks  = L.geom.clip ? (size_t)ott_kv_n_groups(&L.geom) : 0;
    return codes_bytes(L.geom) + n_cand * sizeof(int64_t) + (size_t)L.pool_cap * sizeof(int32_t) + n_cand + picks;
}

cudaError_t ott_cuda_kv_event(const ott_cuda_kv_layer & L, const ott_cuda_event * events, int32_t n_events,
                              cudaStream_t stream) {
    if (n_events == 0) return cudaSuccess;
    const size_t smem = ott_cuda_kv_event_smem(L);
    if (smem > 48 * 1024) {
        const cudaError_t e =
            cudaFuncSetAttribute(kv_event_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return e;
    }
    const int threads = L.geom.clip ? EVENT_THREADS_CLIP : EVENT_THREADS;
    kv_event_kernel<<<dim3(n_events, L.n_head_kv), threads, smem, stream>>>(L, events);
    return cudaGetLastError();
}
