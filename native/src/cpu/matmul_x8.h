// matmul_x8.h — Q4_1 and Q8_0 weights in a layout of 8 interleaved rows, and their products
// on AVX-512 VNNI or AVX2, bit for bit what ggml's CPU backend computes from the file's layout.
//
// ggml computes each output element on its own (its AVX2 vec_dot, the path of the
// libggml-python wheel and of llama.cpp on x86): the column quantized to 32-element blocks
// (Q8_1 for Q4_1 weights, Q8_0 for Q8_0), then per block 8 exact int32 sums of 4 products,
// converted to float and fused-multiply-added with d_w·d_y into 8 float lanes (Q4_1 also
// fma(m_w, s_y) into a scalar), and at the end one fixed horizontal sum. Each row waits on its
// own chain of FMAs, and a one-token step spends 45 % of its time there (docs/results.md).
//
// Here every float operation of an element and its order stay, and 8 rows go at once. Their
// blocks are stored together, so that one load brings 8 scales:
//   Q4_1, per 8 rows and block (160 bytes): d[8] fp16 | m[8] fp16 | qs[8][16]
//   Q8_0, per 8 rows and block (272 bytes): d[8] fp16 | qs[8][32]
// (the same bytes as the file's 8 rows, in another order; tied embeddings are stored so once,
// and their lookup reads that layout too). On AVX-512 VNNI one vpdpbusd takes the lane sums
// of 4 rows (Q4_1, one nibble half) or 2 rows (Q8_0) at a time; on AVX2 a vpmaddubsw and a
// vpmaddwd take those of 2 rows (Q4_1) or 1 (Q8_0), as ggml's own AVX2 kernel does, with the
// 8 rows' chains of FMAs independent.
//
// Error: none; tests/test_matmul_x8.py compares the logits with ggml's products bit for bit.
#pragma once

#include "ggml.h"

// Whether a weight of this type and shape [ne0, ne1] can be stored in the 8-row layout and
// multiplied by ott_x8_mul_mat on this CPU: Q4_1 or Q8_0, rows a multiple of 32 long, a
// multiple of 8 of them, and AVX-512 VNNI (attn_vnni.h: ott_vnni_available) or AVX2 with FMA
// and F16C (x86-64-v3), in a build with the x86-64 versions (ott_ops_cpu.h: OTT_VERSIONS).
bool ott_x8_packable(ggml_type type, int64_t ne0, int64_t ne1);

// The file's layout of such a weight (ne1 rows of ggml's blocks) to the 8-row layout, in place.
void ott_x8_pack(ggml_type type, int64_t ne0, int64_t ne1, uint8_t * data);

// Rows ids (I32 [n]) of w in the 8-row layout as F32 [w->ne[0], n], ggml's get_rows bit for bit
// (its dequantization: q·d for Q8_0, q·d + m for Q4_1, each operation rounded): the lookup of
// tied embeddings stored once for both uses. Ids must be valid rows (the context checks tokens).
ggml_tensor * ott_x8_get_rows(ggml_context * ctx, ggml_tensor * w, ggml_tensor * ids);

// w·x for w in the 8-row layout and x F32 [w->ne[0], n...] (rows contiguous along dim 0): a
// custom op of the CPU backend, F32 [w->ne[1], n...], the row groups split over its threads.
ggml_tensor * ott_x8_mul_mat(ggml_context * ctx, ggml_tensor * w, ggml_tensor * x);
