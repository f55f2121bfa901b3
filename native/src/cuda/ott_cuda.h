// ott_cuda.h — CUDA kernels of the quantized KV cache, as seen by host code (kv_quant_cuda.cpp,
// tests/cuda_ops.cpp). One op per .cu file; each launcher takes the stream and returns the
// launch status (cudaGetLastError after the launch):
//
//   ott_cuda_kv_append    kv_append.cu  new tokens' K/V, rounded to fp16, into sink or window
//   ott_cuda_kv_event     kv_event.cu   quantization events (kv_quant.h, bit for bit): OTT
//                                       scores and selection, pool moves, mean substitution,
//                                       block quantization
//   ott_cuda_attn_partial attn.cu       fused attention of query tiles over one split of a
//                                       KV head's stores (a share of its quantized blocks
//                                       and of its fp16 stores and the chunk itself):
//                                       partial softmax per row (kernels: attn_kernels.cuh,
//                                       built per head size and widths by attn_rows.cu; the
//                                       quantized-block phase on integer tensor cores
//                                       for head size 128, block 128, 2-bit values with
//                                       2- or 4-bit keys or ottr2t's tiers, or 4-bit keys
//                                       and values: attn_imma.cuh)
//   ott_cuda_attn_merge   attn.cu       merges a tile's partials into the attention output
//   ott_cuda_kv_gather    kv_gather.cu  one sequence's stores and chunk as fp16 rows in position
//                                       order (head-blocks dequantised, pooled slots from
//                                       their pools), for ggml's flash attention of a prompt
//
// The stores of one layer live in device memory, indexed by (sequence, KV head) = sh:
//   sink_k/v   fp16  [n_seq_max][n_head_kv][sink][head_dim]
//   win_k/v    fp16  [n_seq_max][n_head_kv][win_cap][head_dim]  ring: position p at row
//                    (p - sink) % win_cap; win_cap is a multiple of block, so a block's rows
//                    are contiguous
//   pool_k/v   fp16  [n_seq_max][n_head_kv][pool_cap][head_dim], pool_pos int32 [..][pool_cap]
//   extra_k/v  fp16  [n_seq_max][n_head_kv][extra_cap][head_dim], extra_pos int32 [..][extra_cap]
//   n_pool, n_extra, tracing  int32 [n_seq_max][n_head_kv]
//   tier_scale float [n_head_kv][head_dim], with key tiers (or null)
//   rope       float2 [n_ctx][head_dim/2], keys cached before RoPE (or null): (cos, sin) of
//              pair i's angle at position p at rope[p·head_dim/2 + i]; every key store then
//              holds keys before RoPE, which attention and the gather rotate at their positions
//   blocks     head-blocks (kv_layout.h) [n_seq_max][max_blocks][n_head_kv], block j of a
//              sequence = positions sink + j*block ..
// With recent blocks (ott_kv_config::recent = N), the newest N blocks of a sequence are
// head-blocks of the recent geometry in a ring of their own, [n_seq_max][N][n_head_kv], block
// j at slot j % N: the layer's recent view (ott_cuda_kv_layer::ring = N) is the same stores
// with that geometry, layout and ring as `blocks`.
#pragma once

#include "kv/kv_layout.h"

#include <cuda_runtime.h>
#include <stdint.h>

// One layer's stores (device pointers) and the knobs the kernels need.
struct ott_cuda_kv_layer {
    ott_kv_geom geom;
    ott_kv_block_layout layout;
    int32_t n_head_kv;
    int32_t sink;      // sink capacity
    int32_t win_cap;   // window rows per (sequence, KV head)
    int32_t pool_cap;  // 0 in layers that do not trace
    int32_t extra_cap;
    int32_t max_blocks;  // head-block slots per (sequence, KV head)
    ott_fp16 * sink_k;
    ott_fp16 * sink_v;
    ott_fp16 * win_k;
    ott_fp16 * win_v;
    ott_fp16 * pool_k;
    ott_fp16 * pool_v;
    int32_t * pool_pos;
    ott_fp16 * extra_k;
    ott_fp16 * extra_v;
    int32_t * extra_pos;
    int32_t * n_pool;
    int32_t * n_extra;
    int32_t * tracing;
    uint8_t * blocks;
    const float * tier_scale;  // key tiers' query scale [n_head_kv][head_dim] (kv_quant.h), or null: 1
    int32_t ring;              // 0; a recent view: its N, blocks being a ring of max_blocks = N slots
    const float2 * rope;       // keys cached before RoPE: the angles above, or null (keys after RoPE)
    int32_t rope_neox;         // with rope: pair i is channels (i, i + head_dim/2), else (2i, 2i+1)
};

// The angles of L.rope for n_pos positions (host memory): RoPE over the whole head of head_dim
// channels, theta = p · freq_scale · freq_base^(-2i/head_dim), as the CPU's table
// (ott_rope_table_fill).
void ott_cuda_rope_pairs_fill(int32_t head_dim, double freq_base, double freq_scale, int32_t n_pos, float2 * out);

// Head-block j of KV head h of sequence s (a recent view: at slot j % ring).
static inline OTT_HD uint8_t * ott_cuda_head_block(const ott_cuda_kv_layer & L, int32_t s, int32_t j, int32_t h) {
    if (L.ring) j %= L.ring;
    return L.blocks + (((size_t)s * L.max_blocks + j) * L.n_head_kv + h) * L.layout.size;
}

// A step's F32 activations: element (c, h, t) of x at x[t*nb2 + h*nb1 + c] (floats).
struct ott_cuda_f32_3d {
    const float * data;
    int64_t nb1;
    int64_t nb2;
};

// ---- append --------------------------------------------------------------------------------

// One new token of one sequence: ubatch token `tok` goes to sink row `row` (row < 0: to the
// window row -row-1), in every KV head.
struct ott_cuda_append {
    int32_t tok;
    int32_t seq;
    int32_t row;
};

// k, v: F32 [head_dim, n_head_kv, n_tokens]; items: device array [n_items].
cudaError_t ott_cuda_kv_append(const ott_cuda_kv_layer & L, ott_cuda_f32_3d k, ott_cuda_f32_3d v,
                               const ott_cuda_append * items, int32_t n_items, cudaStream_t stream);

// Let a launch of `kernel` take `dyn` bytes of dynamic shared memory beside its `stat` bytes
// of static shared memory: past 48 KiB of the two together it needs the opt-in.
inline cudaError_t ott_cuda_allow_smem(const void * kernel, size_t dyn, size_t stat = 0) {
    if (dyn + stat <= 48 * 1024) return cudaSuccess;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dyn);
}

// ---- quantization events --------------------------------------------------------------------

// One event of one sequence, in every KV head: the block of positions pos0 .. pos0+block-1
// (window rows starting at row0) becomes head-block `block_idx`.
struct ott_cuda_event {
    int32_t seq;
    int32_t block_idx;
    int32_t pos0;
    int32_t row0;
};

// events: device array [n_events], at most one per sequence (a sequence's events are ordered).
// With recent blocks, R is the layer's recent view and scratch fp16 [n_seq_max][n_head_kv][2]
// [block][head_dim] (else both null): an event first re-codes the block N events older from
// its ring slot into `blocks` (ott_kv_recode_ref), then codes its own block into that slot.
cudaError_t ott_cuda_kv_event(const ott_cuda_kv_layer & L, const ott_cuda_kv_layer * R, const ott_cuda_event * events,
                              int32_t n_events, ott_fp16 * scratch, cudaStream_t stream);

// ---- attention ------------------------------------------------------------------------------

constexpr int OTT_CUDA_ATTN_ROWS = 4;  // query rows of a tile, at most

// A tile: up to OTT_CUDA_ATTN_ROWS consecutive query rows of one (sequence, KV head). Row
// rho = i*n_rep + r is the query of chunk token i (ubatch token t0 + i) and query head
// head*n_rep + r. The sequence's stores as they stood before the step: n_sink sink rows,
// n_blocks head-blocks, its pools (counts on the device), n_win window rows from position
// win_pos0; then the chunk itself, n_q tokens, causally.
struct ott_cuda_attn_tile {
    int32_t seq;
    int32_t head;
    int32_t t0;
    int32_t n_q;
    int32_t row0;
    int32_t n_rows;
    int32_t n_sink;
    int32_t n_blocks;
    int32_t n_win;
    int32_t win_pos0;
};

// Floats of one row's partial: max, sum, then head_dim weighted values (log2 domain).
inline int64_t ott_cuda_partial_row(int32_t head_dim) { return head_dim + 2; }

struct ott_cuda_attn_args {
    ott_cuda_kv_layer L;
    ott_cuda_f32_3d q;  // F32 [head_dim, n_head, n_tokens]
    ott_cuda_f32_3d k;  // F32 [head_dim, n_head_kv, n_tokens] the chunk's own
    ott_cuda_f32_3d v;
    int32_t n_rep;  // query heads per KV head
    float kq_scale;
    int32_t traces;                    // 1: the layer's head-blocks carry masks
    const ott_cuda_attn_tile * tiles;  // device [n_tiles]
    int32_t n_tiles;
    int32_t rows_per_tile;  // most n_rows of a tile (1 .. OTT_CUDA_ATTN_ROWS)
    int32_t prefetch;       // code words a lane loads ahead in one-row tiles: 8 (0: 8), 16 or 32
    int32_t tensor_cores;   // 1: head-blocks attn_imma.cuh serves (head_dim 128, block 128, 2-bit
                            // values) run on integer tensor cores (needs sm_80+), 0: FFMA everywhere
    int32_t n_splits;       // blocks per tile, each a share of its quantized blocks and fp16 rows
    float * partials;       // device [n_tiles][n_parts][OTT_CUDA_ATTN_ROWS][head_dim+2]
    // Recent blocks (ott_kv_config::recent): the newest min(recent, n_blocks) head-blocks of a
    // tile are read by a launch over the recent view (L.ring > 0: its blocks alone, no fp16
    // rows), the others by the launch over the layer. A launch's splits write partials
    // part0 .. part0 + n_splits - 1 of the tile's n_parts (0: n_splits), which the merge reads.
    int32_t recent;
    int32_t part0;
    int32_t n_parts;
};

// Partials per tile that the merge of a reads.
static inline OTT_HD int32_t ott_cuda_attn_parts(const ott_cuda_attn_args & a) {
    return a.n_parts ? a.n_parts : a.n_splits;
}

// Which kernel configurations exist: bits 2/4/8 with every code word (32 bits) inside one
// group and one row; head_dim a multiple of 64 up to 256; rope: keys cached before RoPE (their
// kernels need more shared memory with key tiers). Returns nullptr when supported, else a
// reason.
const char * ott_cuda_attn_unsupported(const ott_kv_geom & g, bool rope);

// Whether ott_cuda_attn_partial runs the quantized-block phase of tiles of up to
// rows_per_tile rows on integer tensor cores (tensor_cores = 1 and a geometry it serves).
bool ott_cuda_attn_uses_tensor_cores(const ott_kv_geom & g, int32_t rows_per_tile, int32_t tensor_cores);

// Splits (blocks per tile, each a share of its quantized blocks and fp16 rows) for n_tiles
// tiles of sequences of up to max_blocks head-blocks on n_sm multiprocessors (at least 4
// head-blocks a split, one per warp), for the kernel the arguments select.
int32_t ott_cuda_attn_splits(const ott_kv_geom & g, int32_t rows_per_tile, int32_t tensor_cores, int32_t n_tiles,
                             int32_t n_sm, int32_t max_blocks);

cudaError_t ott_cuda_attn_partial(const ott_cuda_attn_args & a, cudaStream_t stream);

// Recent blocks: partials per tile (n_parts) for n_splits splits over the layer's blocks and
// a ring of `recent` blocks. While n_tiles leave multiprocessors of the n_sm idle, the recent
// launch gives each warp one head-block (one block of a tile would leave a warp several rounds
// of its ring, each waiting on its loads); from n_sm tiles on, one block a tile, as more
// partials to merge cost more than the idle warps.
int32_t ott_cuda_attn_n_parts(int32_t n_splits, int32_t recent, int32_t n_tiles, int32_t n_sm);
// The launch over R, the recent view of a.L: partials a.n_splits .. n_parts - 1 of every tile.
cudaError_t ott_cuda_attn_recent(const ott_cuda_attn_args & a, const ott_cuda_kv_layer & R, cudaStream_t stream);
// out: F32 [head_dim*n_head, n_tokens] (row stride out_nb1 floats)
cudaError_t ott_cuda_attn_merge(const ott_cuda_attn_args & a, float * out, int64_t out_nb1, cudaStream_t stream);

// ---- gather (a prompt chunk's attention by ggml's flash attention) ----------------------------

// One sequence's stores as attention sees them before the step (n_sink sink rows, n_blocks
// head-blocks, n_win window rows), then its chunk: n_new tokens from ubatch token t0.
struct ott_cuda_gather {
    int32_t seq;
    int32_t n_sink;
    int32_t n_blocks;
    int32_t n_win;
    int32_t n_new;
    int32_t t0;
    int32_t n_rows;  // rows written per KV head: the positions, then zero rows up to n_rows
};

// ko, vo: fp16 [n_head_kv][n_rows][head_dim]; row p of head h holds position p. R: the
// layer's recent view (its newest blocks), or null.
cudaError_t ott_cuda_kv_gather(const ott_cuda_kv_layer & L, const ott_cuda_kv_layer * R, ott_cuda_f32_3d k,
                               ott_cuda_f32_3d v, const ott_cuda_gather & G, ott_fp16 * ko, ott_fp16 * vo,
                               cudaStream_t stream);
