// attn.cu — fused attention of the quantized KV cache (docs/design.md §3): which kernel of
// attn_kernels.cuh serves a geometry, how many splits, the merge of the splits' partials.
// The partial kernels are compiled per head size and code widths in attn_rows.cu.
#include "cuda/attn_kernels.cuh"
#include "kv/kvq_types.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// grid: n_tiles; threads over channels
template <int HD> __global__ void attn_merge_kernel(const ott_cuda_attn_args a, float * out, int64_t out_nb1) {
    wait_for_partials();
    const ott_cuda_attn_tile T = a.tiles[blockIdx.x];
    const int n_parts          = ott_cuda_attn_parts(a);
    const float * part         = a.partials + (size_t)blockIdx.x * n_parts * OTT_CUDA_ATTN_ROWS * (HD + 2);
    for (int r = 0; r < T.n_rows; ++r) {
        float mx = -INFINITY;
        for (int s = 0; s < n_parts; ++s) mx = fmaxf(mx, part[((size_t)s * OTT_CUDA_ATTN_ROWS + r) * (HD + 2)]);
        float l = 0.0f;
        for (int s = 0; s < n_parts; ++s) {
            const float * p = part + ((size_t)s * OTT_CUDA_ATTN_ROWS + r) * (HD + 2);
            if (p[1] != 0.0f) l += p[1] * exp2f(p[0] - mx);
        }
        const int rho = T.row0 + r;
        const int tok = T.t0 + rho / a.n_rep, hq = T.head * a.n_rep + rho % a.n_rep;
        float * o = out + (int64_t)tok * out_nb1 + (int64_t)hq * HD;
        for (int c = threadIdx.x; c < HD; c += blockDim.x) {
            float acc = 0.0f;
            for (int s = 0; s < n_parts; ++s) {
                const float * p = part + ((size_t)s * OTT_CUDA_ATTN_ROWS + r) * (HD + 2);
                if (p[1] != 0.0f) acc += p[2 + c] * exp2f(p[0] - mx);
            }
            o[c] = acc / l;
        }
    }
}

// Key and value widths: equal, or 4-bit keys with 2-bit values (ott_cuda_attn_unsupported).
template <int HD> cudaError_t launch_bits(const ott_cuda_attn_args & a, int nr, cudaStream_t stream, int * occ) {
    const ott_kv_geom & g = a.L.geom;
    if (g.bits_k == 4 && g.bits_v == 2) return ott_attn::launch_rows<HD, 4, 2>(a, nr, stream, occ);
    switch (g.bits_k) {
        case 2:  return ott_attn::launch_rows<HD, 2, 2>(a, nr, stream, occ);
        case 4:  return ott_attn::launch_rows<HD, 4, 4>(a, nr, stream, occ);
        default: return ott_attn::launch_rows<HD, 8, 8>(a, nr, stream, occ);
    }
}

// The partial kernel for a's geometry and rows: launched, or with occ, its blocks per multiprocessor.
cudaError_t dispatch_partial(const ott_cuda_attn_args & a, cudaStream_t stream, int * occ) {
    const int rows = kernel_rows(a.rows_per_tile);
    switch (a.L.geom.head_dim) {
        case 64:  return launch_bits<64>(a, rows, stream, occ);
        case 128: return launch_bits<128>(a, rows, stream, occ);
        default:  return launch_bits<256>(a, rows, stream, occ);
    }
}

}  // namespace

const char * ott_cuda_attn_unsupported(const ott_kv_geom & g, bool rope) {
    if (g.head_dim != 64 && g.head_dim != 128 && g.head_dim != 256) return "head_dim must be 64, 128 or 256";
    if (g.bits_k != g.bits_v && !(g.bits_k == 4 && g.bits_v == 2)) return "bits_k and bits_v must be equal, or 4 and 2";
    if (g.bits_k != 2 && g.bits_k != 4 && g.bits_k != 8) return "bits must be 2, 4 or 8";
    if (g.block * g.bits_k % 32 || !pow2_upto_32(g.block * g.bits_k / 32))
        return "block*bits/32 must be a power of two up to 32";
    if (!pow2_upto_32(g.head_dim * g.bits_v / 32)) return "head_dim*bits/32 must be a power of two up to 32";
    if (g.group_k * g.bits_k % 8 || g.group_v * g.bits_v % 8) return "groups must fill whole bytes";
    if (ott_kv_tiered(&g) && (g.bits_k != 2 || g.key_axis || g.group_k != g.block))
        return "key tiers need bits_k 2 and one key group per block";
    if (dyn_smem(g, OTT_CUDA_ATTN_ROWS, false, rope) > 96 * 1024) return "block is too large";
    return nullptr;
}

bool ott_cuda_attn_uses_tensor_cores(const ott_kv_geom & g, int32_t rows_per_tile, int32_t tensor_cores) {
    return imma_applies(g, tensor_cores, kernel_rows(rows_per_tile));
}

int32_t ott_cuda_attn_splits(const ott_kv_geom & g, int32_t rows_per_tile, int32_t tensor_cores, int32_t n_tiles,
                             int32_t n_sm, int32_t max_blocks) {
    const int32_t most = std::max<int32_t>(1, max_blocks / 4);
    if (!ott_cuda_attn_uses_tensor_cores(g, rows_per_tile, tensor_cores)) {
        // FFMA: ~32 blocks per multiprocessor (a short last wave), as the H200's timings preferred
        const int32_t want = (32 * n_sm + n_tiles - 1) / std::max<int32_t>(1, n_tiles);
        return std::max<int32_t>(1, std::min(want, most));
    }
    // tensor cores: the fewest splits whose blocks fill the resident slots' waves best
    // (ties to fewer splits: each split adds a partial to merge)
    ott_cuda_attn_args a {};
    a.L.geom        = g;
    a.rows_per_tile = rows_per_tile;
    a.tensor_cores  = tensor_cores;
    int per_sm      = 1;
    if (dispatch_partial(a, nullptr, &per_sm) != cudaSuccess || per_sm < 1) per_sm = 1;
    const double slots = (double)per_sm * n_sm;
    int32_t best       = 1;
    double best_fill   = 0.0;
    for (int32_t s = 1; s <= std::min<int32_t>(most, 8); ++s) {
        const double blocks = (double)n_tiles * s;
        const double fill   = blocks / (std::ceil(blocks / slots) * slots);
        if (fill > best_fill + 0.05) {
            best      = s;
            best_fill = fill;
        }
    }
    return best;
}

cudaError_t ott_cuda_attn_partial(const ott_cuda_attn_args & a, cudaStream_t stream) {
    if (a.n_tiles == 0) return cudaSuccess;
    return dispatch_partial(a, stream, nullptr);
}

int32_t ott_cuda_attn_n_parts(int32_t n_splits, int32_t recent, int32_t n_tiles, int32_t n_sm) {
    if (!recent) return n_splits;
    return n_splits + (n_tiles < n_sm ? (recent + WARPS - 1) / WARPS : 1);
}

cudaError_t ott_cuda_attn_recent(const ott_cuda_attn_args & a, const ott_cuda_kv_layer & R, cudaStream_t stream) {
    ott_cuda_attn_args ar = a;
    ar.L                  = R;
    ar.part0              = a.n_splits;
    ar.n_splits           = ott_cuda_attn_parts(a) - a.n_splits;
    if (ar.n_splits > 1) ar.prefetch = 32;  // a warp's one head-block: its loads in flight at once
    return ott_cuda_attn_partial(ar, stream);
}

cudaError_t ott_cuda_attn_merge(const ott_cuda_attn_args & a, float * out, int64_t out_nb1, cudaStream_t stream) {
    if (a.n_tiles == 0) return cudaSuccess;
    int dev = 0, major = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (e != cudaSuccess) return e;
    cudaLaunchAttribute pdl {};  // a programmatic dependent launch where the GPU has them
    pdl.id                                         = cudaLaunchAttributeProgrammaticStreamSerialization;
    pdl.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg {};
    cfg.gridDim  = dim3(a.n_tiles);
    cfg.blockDim = dim3(a.L.geom.head_dim);  // threads over channels
    cfg.stream   = stream;
    cfg.attrs    = &pdl;
    cfg.numAttrs = major >= 9 ? 1 : 0;
    switch (a.L.geom.head_dim) {
        case 64:  return cudaLaunchKernelEx(&cfg, attn_merge_kernel<64>, a, out, out_nb1);
        case 128: return cudaLaunchKernelEx(&cfg, attn_merge_kernel<128>, a, out, out_nb1);
        default:  return cudaLaunchKernelEx(&cfg, attn_merge_kernel<256>, a, out, out_nb1);
    }
}

void ott_cuda_rope_pairs_fill(int32_t head_dim, double freq_base, double freq_scale, int32_t n_pos, float2 * out) {
    const int32_t half = head_dim / 2;
    std::vector<float> cs((size_t)head_dim * n_pos);  // [cos | sin][pair][position]
    ott_rope_table_fill(head_dim, freq_base, freq_scale, n_pos, cs.data());
    for (int32_t p = 0; p < n_pos; ++p) {
        for (int32_t i = 0; i < half; ++i)
            out[(size_t)p * half + i] = make_float2(cs[(size_t)i * n_pos + p], cs[(size_t)(half + i) * n_pos + p]);
    }
}
