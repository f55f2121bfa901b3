// fast_exp2.cuh — the exponential of the attention kernels' online softmax (both cache
// families: attn_kernels.cuh, kvq_attn_split.cuh).
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
