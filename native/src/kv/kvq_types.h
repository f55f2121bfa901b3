/* kvq_types.h — what the KVQuant ops read besides head-blocks (kv_layout.h), shared by C, C++
 * and CUDA: the calibrated tables of a KV head, the RoPE table, and a head's stores. Pointers
 * are host or device memory, as the op that takes them. */
#ifndef OTT_KVQ_TYPES_H
#define OTT_KVQ_TYPES_H

#include "kv/kv_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Calibrated tables of one KV head of one layer. */
typedef struct {
    const float * k_zero;   /* [head_dim] per-channel key zero  */
    const float * k_scale;  /* [head_dim] per-channel key scale */
    const float * levels_k; /* [2^bits_k] ascending             */
    const float * levels_v; /* [2^bits_v] ascending             */
} ott_kvq_tables;

/* cos and sin of every (pair, position), pair-major so that a pair's angles at consecutive
 * positions are consecutive: cos at cs[i·n_pos + p], sin at cs[(n_rot/2 + i)·n_pos + p] for
 * p < n_pos, from θ = p · freq_scale · freq_base^(-2i/n_rot) in double
 * (ott_gguf/reference/rope.py). */
typedef struct {
    int32_t n_rot;    /* rotated channels                                   */
    int32_t neox;     /* pairs (x[i], x[i + n_rot/2]); 0: (x[2i], x[2i+1])   */
    int32_t n_pos;    /* positions covered                                  */
    const float * cs; /* [2][n_rot/2][n_pos]                                */
    /* the CPU's tiles (NULL elsewhere): the angles at positions 0 .. OTT_ROPE_TILE-1 in runs
     * of 16, [OTT_ROPE_TILE/16][n_rot/2][cos 16, sin 16] (ott_rope_tile_fill,
     * cpu/kvq_attn_cpu.h) */
    const float * tile;
} ott_rope_table;

enum { OTT_ROPE_TILE = 128 }; /* positions in ott_rope_table.tile */

/* The table's cs for n_pos positions ([2][n_rot/2][n_pos] floats, rope_table.c). */
void ott_rope_table_fill(int32_t n_rot, double freq_base, double freq_scale, int32_t n_pos, float * cs);

/* The stores of one KV head of one sequence. */
typedef struct {
    const uint8_t * blocks; /* [n_blocks] head-blocks, block_stride bytes apart       */
    int32_t n_blocks;
    int64_t block_stride;
    int32_t pos0;       /* position of slot 0 of block 0; block j at pos0 + j·block */
    const ott_fp16 * k; /* fp16 rows [n][head_dim]: sink, window, the chunk (keys pre-RoPE) */
    const ott_fp16 * v;
    const int32_t * pos; /* [n] their positions */
    int32_t n;
    const uint8_t * const * block_list; /* CPU: head-block j at block_list[j] (blocks and
                                           block_stride unused); NULL: as above          */
} ott_kvq_head_stores;

#ifdef __cplusplus
}
#endif

#endif /* OTT_KVQ_TYPES_H */
