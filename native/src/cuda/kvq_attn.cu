// kvq_attn.cu — attention over KVQuant stores on the GPU: which kernel serves a geometry, how
// many splits, the launches. The split kernel (kvq_attn_split.cuh) serves head sizes 64, 128
// and 256 with blocks of a multiple of 32 tokens and equal key and value widths, the
// tensor-core kernel (kvq_attn_mma.cuh) those of head size 64 and 128 in groups of more than
// 4 rows; the tile kernel below serves every other geometry, the steps of the CPU's (cpu/kvq_attn_cpu.h):
// one thread block per query group (up to OTT_CUDA_KVQ_ROWS query rows of one KV head of one
// sequence); per tile of KT keys the threads dequantize keys and values from their codes into
// shared memory (codebook level times scale plus zero, sparse entries put back), rotate the
// keys by RoPE at their positions, score every row, and fold the tile into each row's online
// softmax. All read the two kinds of group of kvq_attn_groups.cuh.
#include "cuda/kvq_attn_mma.cuh"

#include <algorithm>
#include <cmath>

namespace {

constexpr int ATTN_THREADS = 128;
constexpr int KT           = 32;  // keys per tile

struct tile_smem {
    float * kt;     // [KT][hd]
    float * vt;     // [KT][hd]
    float * s;      // [n_q][KT] scores, then probabilities
    float * acc;    // [n_q][hd]
    float * m;      // [n_q]
    float * l;      // [n_q]
    float * corr;   // [n_q]
    float * q;      // [n_q][hd] the rows' queries
    int32_t * pos;  // [KT]
    int32_t * lim;  // [n_q] keys of the tile each row sees
};

__host__ __device__ size_t smem_bytes(int32_t hd, int32_t n_q) {
    return ((size_t)2 * KT * hd + (size_t)n_q * KT + 2 * (size_t)n_q * hd + 3 * (size_t)n_q) * 4 + KT * 4 + n_q * 4;
}

// Rotate the n keys of the tile at their positions, then fold them into every row (row r
// takes the first S.lim[r] keys).
__device__ void fold_tile(const tile_smem & S, int32_t n, int32_t hd, int32_t n_q, const ott_rope_table & R,
                          float kq_scale) {
    const int32_t half = R.n_rot / 2;
    for (int32_t e = threadIdx.x; R.cs && e < n * half; e += blockDim.x) {
        const int32_t t = e / half, i = e % half;
        const int32_t ia = R.neox ? i : 2 * i, ib = R.neox ? i + half : 2 * i + 1;
        const float c = R.cs[(size_t)i * R.n_pos + S.pos[t]], s = R.cs[(size_t)(half + i) * R.n_pos + S.pos[t]];
        float * y     = S.kt + (size_t)t * hd;
        const float a = y[ia], b = y[ib];
        y[ia] = a * c - b * s;
        y[ib] = a * s + b * c;
    }
    __syncthreads();
    for (int32_t e = threadIdx.x; e < n_q * n; e += blockDim.x) {
        const int32_t r = e / n, t = e % n;
        const float *qr = S.q + (size_t)r * hd, *kr = S.kt + (size_t)t * hd;
        float d = 0.0f;
        for (int32_t c = 0; c < hd; ++c) d += qr[c] * kr[c];
        S.s[r * KT + t] = t < S.lim[r] ? d * kq_scale : -INFINITY;
    }
    __syncthreads();
    for (int32_t r = threadIdx.x; r < n_q; r += blockDim.x) {
        float mt = -INFINITY;
        for (int32_t t = 0; t < n; ++t) mt = fmaxf(mt, S.s[r * KT + t]);
        if (mt == -INFINITY) {  // nothing of this tile is visible to row r
            S.corr[r] = 1.0f;
            for (int32_t t = 0; t < n; ++t) S.s[r * KT + t] = 0.0f;
            continue;
        }
        const float m_new = fmaxf(S.m[r], mt);
        S.corr[r]         = expf(S.m[r] - m_new);
        float l           = S.l[r] * S.corr[r];
        for (int32_t t = 0; t < n; ++t) {
            const float p   = expf(S.s[r * KT + t] - m_new);
            S.s[r * KT + t] = p;
            l += p;
        }
        S.l[r] = l;
        S.m[r] = m_new;
    }
    __syncthreads();
    for (int32_t e = threadIdx.x; e < n_q * hd; e += blockDim.x) {
        const int32_t r = e / hd, c = e % hd;
        float a = S.acc[e] * S.corr[r];
        for (int32_t t = 0; t < n; ++t) a += S.s[r * KT + t] * S.vt[(size_t)t * hd + c];
        S.acc[e] = a;
    }
    __syncthreads();
}

// grid: the groups of `groups` (packed_groups or cache_tiles)
template <typename Groups>
__global__ void __launch_bounds__(ATTN_THREADS)
    kvq_attn_kernel(const ott_kvq_geom g, const Groups groups, const ott_rope_table R, float kq_scale) {
    extern __shared__ __align__(16) float smem[];
    const int32_t hd = g.head_dim;
    const auto G     = groups.at(blockIdx.x, hd);
    const int32_t nq = G.rows();
    tile_smem S;
    S.kt   = smem;
    S.vt   = S.kt + KT * hd;
    S.s    = S.vt + KT * hd;
    S.acc  = S.s + nq * KT;
    S.q    = S.acc + nq * hd;
    S.m    = S.q + nq * hd;
    S.l    = S.m + nq;
    S.corr = S.l + nq;
    S.pos  = (int32_t *)(S.corr + nq);
    S.lim  = S.pos + KT;
    for (int32_t e = threadIdx.x; e < nq * hd; e += blockDim.x) {
        S.acc[e] = 0.0f;
        S.q[e]   = G.query(e / hd)[e % hd];
    }
    for (int32_t r = threadIdx.x; r < nq; r += blockDim.x) {
        S.m[r]   = -INFINITY;
        S.l[r]   = 0.0f;
        S.lim[r] = KT;
    }
    __syncthreads();

    const ott_kvq_block_layout L = ott_kvq_block_layout_of(&g);
    const int32_t k_row = g.block * g.bits_k / 8, v_row = hd * g.bits_v / 8;
    for (int32_t j = 0; j < G.n_blocks(); ++j) {
        const uint8_t * b = G.block(j);
        for (int32_t t0 = 0; t0 < g.block; t0 += KT) {
            const int32_t n = min(KT, g.block - t0);
            for (int32_t e = threadIdx.x; e < n * hd; e += blockDim.x) {
                const int32_t t = e / hd, c = e % hd, slot = t0 + t;
                S.kt[e] = G.tab.levels_k[ott_kvq_code_at(b + L.k_codes + (size_t)c * k_row, slot, g.bits_k, k_row)] *
                              G.tab.k_scale[c] +
                          G.tab.k_zero[c];
                S.vt[e] = G.tab.levels_v[ott_kvq_code_at(b + L.v_codes + (size_t)slot * v_row, c, g.bits_v, v_row)] *
                              f16(load16(b + L.v_scale + 2 * slot)) +
                          f16(load16(b + L.v_zero + 2 * slot));
            }
            for (int32_t t = threadIdx.x; t < n; t += blockDim.x) S.pos[t] = G.pos0() + j * g.block + t0 + t;
            __syncthreads();
            for (int32_t e = threadIdx.x; e < g.n_out; e += blockDim.x) {
                const int32_t ik = load16(b + L.k_out_idx + 2 * e) - t0 * hd,
                              iv = load16(b + L.v_out_idx + 2 * e) - t0 * hd;
                if (ik >= 0 && ik < n * hd) S.kt[ik] = f16(load16(b + L.k_out_val + 2 * e));
                if (iv >= 0 && iv < n * hd) S.vt[iv] = f16(load16(b + L.v_out_val + 2 * e));
            }
            __syncthreads();
            fold_tile(S, n, hd, nq, R, kq_scale);
        }
    }
    for (int32_t t0 = 0; t0 < G.n_fp(); t0 += KT) {
        const int32_t n = min(KT, G.n_fp() - t0);
        for (int32_t e = threadIdx.x; e < n * hd; e += blockDim.x) {
            S.kt[e] = G.fp_k(t0 + e / hd, e % hd);
            S.vt[e] = G.fp_v(t0 + e / hd, e % hd);
        }
        for (int32_t t = threadIdx.x; t < n; t += blockDim.x) S.pos[t] = G.fp_pos(t0 + t);
        for (int32_t r = threadIdx.x; r < nq; r += blockDim.x) S.lim[r] = G.visible(r) - t0;
        __syncthreads();
        fold_tile(S, n, hd, nq, R, kq_scale);
    }
    for (int32_t e = threadIdx.x; e < nq * hd; e += blockDim.x) G.output(e / hd)[e % hd] = S.acc[e] / S.l[e / hd];
}

bool split_serves(const ott_kvq_geom & g) {
    return (g.head_dim == 64 || g.head_dim == 128 || g.head_dim == 256) && g.block % split::UNIT == 0 &&
           g.bits_k == g.bits_v;
}

// Groups of more than 4 rows of head size 64 or 128 go to tensor cores (kvq_attn_mma.cuh).
bool mma_serves(const ott_kvq_geom & g, int32_t max_rows) {
    return split_serves(g) && max_rows > 4 && g.head_dim <= 128;
}

// The tensor-core kernel for (HD, BITS): launched, or with occ, its blocks per multiprocessor.
template <int HD, int BITS, typename Groups>
cudaError_t launch_mma(const ott_kvq_geom & g, const Groups & groups, int32_t n_groups, const ott_rope_table & rope,
                       float kq_scale, int32_t n_splits, float * partials, cudaStream_t stream, int * occ) {
    const auto kernel   = mma::kvq_mma_kernel<HD, BITS, Groups>;
    const size_t dyn    = mma::tile_bytes<HD>();
    const cudaError_t e = ott_cuda_allow_smem((const void *)kernel, dyn, sizeof(mma::smem_t<HD>));
    if (e != cudaSuccess) return e;
    if (occ) return cudaOccupancyMaxActiveBlocksPerMultiprocessor(occ, kernel, split::WARPS * 32, dyn);
    kernel<<<dim3(n_groups, n_splits, 1), split::WARPS * 32, dyn, stream>>>(g, groups, rope, kq_scale, n_splits,
                                                                            partials);
    split::kvq_merge_kernel<<<n_groups, 128, 0, stream>>>(groups, HD, n_splits, partials);
    return cudaGetLastError();
}

// The split kernel for (HD, BITS, NR): launched, or with occ, its blocks per multiprocessor.
template <int HD, int BITS, int NR, typename Groups>
cudaError_t launch_split(const ott_kvq_geom & g, const Groups & groups, int32_t n_groups, int32_t max_rows,
                         const ott_rope_table & rope, float kq_scale, int32_t n_splits, float * partials,
                         cudaStream_t stream, int * occ) {
    const auto kernel   = split::kvq_split_kernel<HD, BITS, NR, Groups>;
    const size_t dyn    = (size_t)split::WARPS * 2 * split::stage_words(HD, BITS, g.n_out) * 4;
    const cudaError_t e = ott_cuda_allow_smem((const void *)kernel, dyn, sizeof(split::smem_t<HD, NR>));
    if (e != cudaSuccess) return e;
    if (occ) return cudaOccupancyMaxActiveBlocksPerMultiprocessor(occ, kernel, split::WARPS * 32, dyn);
    const dim3 grid(n_groups, n_splits, (max_rows + NR - 1) / NR);
    kernel<<<grid, split::WARPS * 32, dyn, stream>>>(g, groups, rope, kq_scale, n_splits, partials);
    split::kvq_merge_kernel<<<n_groups, 128, 0, stream>>>(groups, HD, n_splits, partials);
    return cudaGetLastError();
}

template <typename Groups>
cudaError_t dispatch_split(const ott_kvq_geom & g, const Groups & groups, int32_t n_groups, int32_t max_rows,
                           const ott_rope_table & rope, float kq_scale, int32_t n_splits, float * partials,
                           cudaStream_t stream, int * occ) {
#define OTT_KVQ_SPLIT(HD, B, NR)                                                                                       \
    launch_split<HD, B, NR>(g, groups, n_groups, max_rows, rope, kq_scale, n_splits, partials, stream, occ)
#define OTT_KVQ_ROWS(HD, B) (max_rows == 1 ? OTT_KVQ_SPLIT(HD, B, 1) : OTT_KVQ_SPLIT(HD, B, 4))
#define OTT_KVQ_BITS(HD)                                                                                               \
    (g.bits_k == 2 ? OTT_KVQ_ROWS(HD, 2) : g.bits_k == 3 ? OTT_KVQ_ROWS(HD, 3) : OTT_KVQ_ROWS(HD, 4))
#define OTT_KVQ_MMA(HD)                                                                                                \
    (g.bits_k == 2   ? launch_mma<HD, 2>(g, groups, n_groups, rope, kq_scale, n_splits, partials, stream, occ)         \
     : g.bits_k == 3 ? launch_mma<HD, 3>(g, groups, n_groups, rope, kq_scale, n_splits, partials, stream, occ)         \
                     : launch_mma<HD, 4>(g, groups, n_groups, rope, kq_scale, n_splits, partials, stream, occ))
    if (mma_serves(g, max_rows)) return g.head_dim == 64 ? OTT_KVQ_MMA(64) : OTT_KVQ_MMA(128);
    switch (g.head_dim) {
        case 64:  return OTT_KVQ_BITS(64);
        case 128: return OTT_KVQ_BITS(128);
        default:  return OTT_KVQ_BITS(256);
    }
#undef OTT_KVQ_MMA
#undef OTT_KVQ_BITS
#undef OTT_KVQ_ROWS
#undef OTT_KVQ_SPLIT
}

template <typename Groups>
cudaError_t launch(const ott_kvq_geom & g, const Groups & groups, int32_t n_groups, int32_t max_rows,
                   const ott_rope_table & rope, float kq_scale, int32_t n_splits, float * partials,
                   cudaStream_t stream) {
    if (n_groups <= 0) return cudaSuccess;
    if (max_rows <= 0 || max_rows > OTT_CUDA_KVQ_ROWS || n_splits <= 0) return cudaErrorInvalidValue;
    if (split_serves(g)) {
        if (!partials) return cudaErrorInvalidValue;
        return dispatch_split(g, groups, n_groups, max_rows, rope, kq_scale, n_splits, partials, stream, nullptr);
    }
    const size_t smem   = smem_bytes(g.head_dim, max_rows);
    const cudaError_t e = ott_cuda_allow_smem((const void *)kvq_attn_kernel<Groups>, smem);
    if (e != cudaSuccess) return e;
    kvq_attn_kernel<<<n_groups, ATTN_THREADS, smem, stream>>>(g, groups, rope, kq_scale);
    return cudaGetLastError();
}

}  // namespace

int32_t ott_cuda_kvq_attn_splits(const ott_kvq_geom & g, int32_t n_groups, int32_t max_rows, int64_t max_keys,
                                 int32_t n_sm) {
    if (!split_serves(g) || n_groups <= 0) return 1;
    // the fewest splits (at least 2 units a warp) whose blocks fill the resident slots' waves
    // best; ties to fewer splits: each adds a partial to merge
    int per_sm = 1;
    if (dispatch_split(g, cache_tiles {}, 1, max_rows, ott_rope_table {}, 1.0f, 1, nullptr, nullptr, &per_sm) !=
            cudaSuccess ||
        per_sm < 1)
        per_sm = 1;
    const int64_t chunks = max_rows == 1 || mma_serves(g, max_rows) ? 1 : (max_rows + 3) / 4;
    const int64_t units  = (max_keys + split::UNIT - 1) / split::UNIT;
    const int64_t most   = std::max<int64_t>(1, std::min<int64_t>(64, units / (2 * split::WARPS)));
    const double slots   = (double)per_sm * n_sm;
    int32_t best         = 1;
    double best_fill     = 0.0;
    for (int64_t s = 1; s <= most; ++s) {
        const double blocks = (double)n_groups * chunks * s;
        const double fill   = blocks / (std::ceil(blocks / slots) * slots);
        if (fill > best_fill + 0.05) {
            best      = (int32_t)s;
            best_fill = fill;
        }
    }
    return best;
}

bool ott_cuda_kvq_attn_tensor_cores(const ott_kvq_geom & g, int32_t max_rows) { return mma_serves(g, max_rows); }

size_t ott_cuda_kvq_partial_floats(const ott_kvq_geom & g, int32_t n_groups, int32_t n_splits) {
    if (!split_serves(g)) return 0;
    return (size_t)n_groups * n_splits * OTT_CUDA_KVQ_ROWS * ott_cuda_partial_row(g.head_dim);
}

cudaError_t ott_cuda_kvq_attn(const ott_kvq_geom & g, const ott_kvq_tables * tabs, const ott_kvq_head_stores * st,
                              int32_t n_groups, const ott_rope_table & rope, const float * q, int32_t n_q,
                              float kq_scale, int32_t n_splits, float * partials, float * out, cudaStream_t stream) {
    return launch(g, packed_groups { tabs, st, q, out, n_q }, n_groups, n_q, rope, kq_scale, n_splits, partials,
                  stream);
}

cudaError_t ott_cuda_kvq_layer_attn(const ott_kvq_geom & g, const ott_cuda_kv_layer & L, const ott_kvq_tables * tabs,
                                    const ott_rope_table & rope, ott_cuda_f32_3d q, ott_cuda_f32_3d k,
                                    ott_cuda_f32_3d v, int32_t n_rep, const ott_cuda_attn_tile * tiles, int32_t n_tiles,
                                    int32_t max_rows, float kq_scale, int32_t n_splits, float * partials, float * out,
                                    int64_t out_nb1, cudaStream_t stream) {
    return launch(g, cache_tiles { L, tabs, tiles, q, k, v, out, out_nb1, n_rep }, n_tiles, max_rows, rope, kq_scale,
                  n_splits, partials, stream);
}
