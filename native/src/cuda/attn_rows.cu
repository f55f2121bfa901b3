// attn_rows.cu — the partial attention kernels (attn_kernels.cuh) of one head size and one pair
// of code widths, chosen by the build: OTT_ATTN_HD (64, 128, 256), OTT_ATTN_BK and OTT_ATTN_BV
// (2/2, 4/4, 8/8 or 4/2; native/CMakeLists.txt compiles this file once per combination).
#include "cuda/attn_kernels.cuh"

#if !defined(OTT_ATTN_HD) || !defined(OTT_ATTN_BK) || !defined(OTT_ATTN_BV)
#error "attn_rows.cu is compiled with -DOTT_ATTN_HD=.. -DOTT_ATTN_BK=.. -DOTT_ATTN_BV=.."
#endif

template <int HD, int BK, int BV>
cudaError_t ott_attn::launch_rows(const ott_cuda_attn_args & a, int nr, cudaStream_t stream, int * occ) {
    switch (nr) {
        case 1:  return launch_groups<HD, BK, BV, 1>(a, stream, occ);
        case 2:  return launch_groups<HD, BK, BV, 2>(a, stream, occ);
        default: return launch_groups<HD, BK, BV, 4>(a, stream, occ);
    }
}

template cudaError_t ott_attn::launch_rows<OTT_ATTN_HD, OTT_ATTN_BK, OTT_ATTN_BV>(const ott_cuda_attn_args &, int,
                                                                                  cudaStream_t, int *);
