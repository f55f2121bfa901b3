// hadamard_cpu.h — the Hadamard rotation of kv/kv_rotation.h as one ggml custom op on the CPU:
// the sign flip and ggml's fast Walsh–Hadamard transform of a row in one pass, so that a
// rotation costs one node of the step's graph (one barrier of its threads) instead of two.
// Bit for bit what ggml's ops compute: the flip is exact, then each row is scaled by 1/√d
// (float) and run through the radix-2 butterflies u + v, u − v in ggml's order (pairs 1, 2,
// 4, ... apart).
#pragma once

#include "ggml.h"

// How the signs s apply: before the transform (R = H_d·diag(s)/√d: keys, queries, values on
// their way in) or after it (Rᵀ = diag(s)·H_d/√d: the attention output on its way back).
enum ott_hadamard_side { OTT_HADAMARD_SIGNS_FIRST = 0, OTT_HADAMARD_SIGNS_LAST = 1 };

// dst: F32 [d, heads, n]; src[0]: x F32 [d, heads, n] (rows contiguous); src[1]: s F32
// [d, heads], the signs of each head; userdata: the side, (void *)(intptr_t) of the enum.
// d a power of two. Threads split the rows (head, token).
void ott_cpu_hadamard(ggml_tensor * dst, int ith, int nth, void * userdata);
