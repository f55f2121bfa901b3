// warp_ops.cuh — the warp-level arithmetic both cache families' attention kernels share
// (attn_kernels.cuh, attn_imma.cuh, kvq_attn_split.cuh): the online softmax's exponential and
// butterfly reductions over a warp's lanes.
#pragma once

// 2^x as the hardware's ex2.approx gives it, results below 2^-126 flushed to zero. exp2f
// computes the same approximation and, for those results alone, rescales the argument and
// squares the result (four more instructions an exponential). A probability or correction
// factor below 2^-126 stands next to the row's largest term, 1, so the sums it enters do not
// change with it. 2^-inf = 0.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The largest x over the warp, in every lane.
__device__ __forceinline__ float warp_max(float x) {
    for (int o = 1; o < 32; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// x summed over the lanes that differ from this one in lane bits >= first (a power of two);
// first = 1: the whole warp.
__device__ __forceinline__ void warp_sum_from(float & x, int first) {
    for (int o = first; o < 32; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
}
