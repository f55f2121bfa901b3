// kv_event.cu — quantization events on the GPU: ott_kv_event_ref (kv_quant.c), the same steps
// in the same order, so the head-block, pools and tracing flag equal the CPU's bit for bit. The
// block being quantized is rows row0 .. row0+block-1 of the head's window ring (contiguous:
// win_cap is a multiple of block).
//
// Two kernels per round of events:
//   kv_event_pool_kernel   one thread block per (event, KV head): the outlier pool (scores,
//                          selection, moves, mean substitution in the ring rows), then the
//                          head-block zeroed, its mask bits and, with key tiers, its key rows'
//                          channel order (begin_head_block)
//   kv_event_quant_kernel  `splits` thread blocks per (event, KV head), each a share of the
//                          head-block's groups: key rows [r0, r1) and value slots [t0, t1)
//                          staged as floats in shared memory, then a team of 16 lanes per group
//                          (lane c tries clipped candidate c, the reference's sums in its order;
//                          then the lanes code the group's bytes side by side)
// One thread block per event and head left most of the GPU idle for a prompt's events (one
// sequence: 32 blocks on the 7B shape), each busy for hundreds of microseconds.
// With recent blocks (ott_kv_recode_ref) a round starts with two more: kv_recode_kernel
// decodes the ring slot the event re-codes into the sequence's scratch rows, substitutes its
// masked slots and begins the head-block it becomes; kv_event_quant_kernel quantizes them.
#include "cuda/ott_cuda.h"
#include "cuda/kv_quant.cuh"

#include <algorithm>

namespace {

// RECODE_THREADS: kv_recode_kernel has one block per event and head (a prompt chunk's 4 events
// on the 7B shape: 128 blocks, about one per SM), each decoding 2·block·head_dim entries whose
// loads wait on memory; 1024 threads keep four times as many in flight as 256.
constexpr int POOL_THREADS = 256, RECODE_THREADS = 1024, QUANT_THREADS = 256, TEAM = 16;

// ---- the pool --------------------------------------------------------------------------------

// Shared memory: scores int64 [n_cand] | best int32 [pool_cap] | keep uint8 [n_cand]
size_t pool_smem(const ott_cuda_kv_layer & L) {
    const size_t n_cand = (size_t)L.pool_cap + (size_t)L.geom.block;
    return n_cand * sizeof(int64_t) + (size_t)L.pool_cap * sizeof(int32_t) + n_cand;
}

__device__ void copy_row(ott_fp16 * dst, const ott_fp16 * src, int32_t hd) {
    for (int32_t c = threadIdx.x; c < hd; c += blockDim.x) dst[c] = src[c];
}

// Key tiers: the channel of every key row (rank_channels in kv_quant.c: channels by descending
// weight w_c, ties by index). Counted per channel in parallel; weights with a NaN take the
// reference's insertion on one thread, which places them where the CPU does. Every thread
// must call it.
__device__ void rank_channels(const ott_kv_geom & g, const ott_fp16 * k, const float * tier_scale, uint8_t * order) {
    __shared__ float width[256]; /* w_c */
    __shared__ int32_t s_nan;
    if (threadIdx.x == 0) s_nan = 0;
    __syncthreads();
    for (int32_t c = threadIdx.x; c < g.head_dim; c += blockDim.x) {
        float mn, mx;
        ott_range_ref(k + c, g.head_dim, g.block, &mn, &mx);
        width[c] = __fsub_rn(mx, mn);
        if (tier_scale) width[c] = __fmul_rn(width[c], tier_scale[c]);
        if (isnan(width[c])) s_nan = 1;
    }
    __syncthreads();
    if (!s_nan) {
        for (int32_t c = threadIdx.x; c < g.head_dim; c += blockDim.x) {
            const float w = width[c];
            int32_t rank  = 0;
            for (int32_t j = 0; j < g.head_dim; ++j) rank += width[j] > w || (width[j] == w && j < c);
            order[rank] = (uint8_t)c;
        }
    } else if (threadIdx.x == 0) {
        for (int32_t c = 0; c < g.head_dim; ++c) {
            int32_t j = c; /* insertion: after every channel of a weight >= this one */
            while (j > 0 && width[order[j - 1]] < width[c]) {
                order[j] = order[j - 1];
                --j;
            }
            order[j] = (uint8_t)c;
        }
    }
    __syncthreads();
}

// Head-block `out` of KV head h, for the block blk_k [block][head_dim] whose slots `masked`
// marks: zeroed, then its mask bits and, with key tiers, its key rows' channel order. Every
// thread must call it.
__device__ void begin_head_block(const ott_cuda_kv_layer & L, int32_t h, const ott_fp16 * blk_k, const uint8_t * masked,
                                 uint8_t * out) {
    const int32_t hd = L.geom.head_dim, block = L.geom.block;
    for (uint32_t i = threadIdx.x; i < L.layout.size / 4; i += blockDim.x) ((uint32_t *)out)[i] = 0;
    __syncthreads();
    for (int32_t b = threadIdx.x; b < block / 8; b += blockDim.x) {
        uint32_t bits = 0;
        for (int32_t i = 0; i < 8; ++i) bits |= (uint32_t)(masked[b * 8 + i] != 0) << i;
        out[L.layout.mask + b] = (uint8_t)bits;
    }
    if (ott_kv_tiered(&L.geom)) {
        rank_channels(L.geom, blk_k, L.tier_scale ? L.tier_scale + (size_t)h * hd : nullptr, out + L.layout.k_order);
    }
}

// grid: (n_events, n_head_kv)
__global__ void __launch_bounds__(POOL_THREADS)
    kv_event_pool_kernel(const ott_cuda_kv_layer L, const ott_cuda_event * events) {
    extern __shared__ __align__(16) uint8_t smem_raw[];
    const ott_cuda_event ev = events[blockIdx.x];
    const int32_t h         = blockIdx.y;
    const int64_t sh        = (int64_t)ev.seq * L.n_head_kv + h;
    const int32_t hd = L.geom.head_dim, block = L.geom.block;
    const int32_t n_cand_max = L.pool_cap + block;
    int64_t * score          = (int64_t *)smem_raw;
    int32_t * best           = (int32_t *)(score + n_cand_max);
    uint8_t * keep           = (uint8_t *)(best + L.pool_cap);
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
    const uint8_t * masked = keep + n_old;
    for (int32_t i = threadIdx.x; i < n_cand; i += blockDim.x) keep[i] = 0;
    __syncthreads();

    if (s_tracing && L.pool_cap > 0) {
        /* a warp per candidate row: its score is an exact integer sum, in any order */
        const int32_t warp = (int32_t)threadIdx.x / 32, lane = (int32_t)threadIdx.x % 32;
        for (int32_t i = warp; i < n_cand; i += (int32_t)blockDim.x / 32) {
            const ott_fp16 * row = i < n_old ? pool_k + (size_t)i * hd : blk_k + (size_t)(i - n_old) * hd;
            int64_t sum          = 0;
            for (int32_t c = lane; c < hd; c += 32) sum += ott_l1_score_ref(row + c, 1);
            for (int32_t o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == 0) score[i] = sum;
        }
        __syncthreads();
        if (threadIdx.x == 0) ott_select_pool_ref(score, n_cand, L.pool_cap, keep, best);
        __syncthreads();

        /* evicted pool tokens go to the extra pool, kept ones move to the front, in order */
        int32_t n_pool = 0, n_extra = L.n_extra[sh];
        for (int32_t i = 0; i < n_old; ++i) {
            const int32_t pos = pool_pos[i];
            __syncthreads(); /* every thread has read pool_pos[i] */
            if (keep[i]) {
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
    }

    begin_head_block(L, h, blk_k, masked, out);
}

// ---- re-coding a recent block -----------------------------------------------------------------

// The scratch rows of sequence s, KV head h: K [block][head_dim], then V.
__host__ __device__ ott_fp16 * recode_rows(ott_fp16 * scratch, const ott_kv_geom & g, int32_t n_head_kv, int32_t s,
                                           int32_t h) {
    return scratch + ((size_t)s * n_head_kv + h) * 2 * g.block * g.head_dim;
}

// decode_code (kv_quant.c): fp16 of the float of code·s + m, in double
__device__ ott_fp16 decode_code(uint32_t code, float2 p) {
    return ott_fp32_to_fp16_ref(__double2float_rn(__dadd_rn(__dmul_rn((double)code, (double)p.x), (double)p.y)));
}

// grid: (n_events, n_head_kv). An event of block_idx >= N (R.ring) re-codes ring slot
// block_idx % N, block block_idx - N of the sequence: its keys and values dequantized into the
// sequence's scratch rows, its masked slots substituted by the mean again, and its head-block
// in `blocks` begun (kv_event_quant_kernel, shifted by N, codes the groups).
__global__ void __launch_bounds__(RECODE_THREADS) kv_recode_kernel(const ott_cuda_kv_layer L, const ott_cuda_kv_layer R,
                                                                   const ott_cuda_event * events, ott_fp16 * scratch) {
    __shared__ uint8_t masked[1024];
    const ott_cuda_event ev = events[blockIdx.x];
    if (ev.block_idx < R.ring) return;  // no block to re-code yet
    const int32_t h        = blockIdx.y;
    const ott_kv_geom & rg = R.geom;
    const int32_t hd = rg.head_dim, block = rg.block;
    const uint8_t * src = ott_cuda_head_block(R, ev.seq, ev.block_idx, h);
    ott_fp16 * k        = recode_rows(scratch, rg, L.n_head_kv, ev.seq, h);
    ott_fp16 * v        = k + (size_t)block * hd;
    const size_t k_row = (size_t)block * rg.bits_k / 8, v_row = ott_kv_v_row_bytes(&rg);
    const int32_t n_gv = (int32_t)ott_kv_n_gv(&rg);
    for (int32_t t = threadIdx.x; t < block; t += blockDim.x) masked[t] = (src[R.layout.mask + t / 8] >> (t % 8)) & 1;
    for (int32_t i = threadIdx.x; i < block * hd; i += blockDim.x) {
        const int32_t t = i / hd, c = i % hd;
        const uint8_t * kr = src + R.layout.k_codes + c * k_row; /* row c = channel c */
        const uint8_t * vr = src + R.layout.v_codes + t * v_row;
        k[i]               = decode_code(ott_kvq_code_at(kr, t, rg.bits_k, k_row),
                                         ott_param_ref(rg, src + R.layout.k_scale, src + R.layout.k_min, rg.bits_k,
                                                       (size_t)(t / rg.group_k) * hd + c));
        v[i] = decode_code(ott_kvq_code_at(vr, c, rg.bits_v, v_row),
                           ott_param_ref(rg, src + R.layout.v_scale, rg.sym_v ? nullptr : src + R.layout.v_min,
                                         rg.bits_v, (size_t)t * n_gv + c / rg.group_v));
    }
    __syncthreads();
    ott_substitute_mean_ref(k, block, hd, masked); /* nothing masked: unchanged */
    ott_substitute_mean_ref(v, block, hd, masked);
    __syncthreads();
    begin_head_block(L, h, k, masked, ott_cuda_head_block(L, ev.seq, ev.block_idx - R.ring, h));
}

// ---- the groups --------------------------------------------------------------------------------

// A split's share: key rows [r0, r1) with all their groups, value slots [t0, t1).
struct split_share {
    int32_t r0, r1, t0, t1;
};

__host__ __device__ split_share share_of(const ott_kv_geom & g, int32_t s, int32_t splits) {
    return { g.head_dim * s / splits, g.head_dim * (s + 1) / splits, g.block * s / splits, g.block * (s + 1) / splits };
}

// Floats of a split's staging: keys [block][rows], values [slots][head_dim + 1] (the odd row
// stride keeps two teams' value groups in different banks).
__host__ __device__ size_t stage_floats(const ott_kv_geom & g, int32_t splits) {
    const size_t rows = (g.head_dim + splits - 1) / splits, slots = (g.block + splits - 1) / splits;
    return (size_t)g.block * rows + slots * (size_t)(g.head_dim + 1);
}

// Candidate c's squared error in the reference's order (ott_quantize_group_ref's search). The
// code is clamped in float: a NaN code stands for 0 as code_of's conversion makes it, and the
// sign of a zero code does not reach e².
__device__ double clip_err(const float * x, int32_t stride, int32_t n, float mn, float mx, int32_t c, float levels,
                           int32_t param_bits, int32_t sym) {
    const float d      = __fmul_rn(ott_clip_shrink(c), __fsub_rn(mx, mn));
    const range_enc rc = encode_range(__fadd_rn(mn, d), __fsub_rn(mx, d), levels, param_bits, sym);
    double err         = 0.0;
    for (int32_t i = 0; i < n; ++i) {
        const float xi = x[i * stride];
        const float t  = fminf(fmaxf(rintf(__fmul_rn(__fsub_rn(xi, rc.m), rc.inv)), 0.0f), levels);
        const float e  = __fsub_rn(__fadd_rn(__fmul_rn(t, rc.s), rc.m), xi);
        err            = __dadd_rn(err, __dmul_rn((double)e, (double)e));
    }
    return err;
}

// One group by a team of 16 lanes (called by all 32 lanes of a warp alike; `live` false for a
// team without a group): ott_quantize_group_ref's parameters and packed code bytes (sym: a
// symmetric group, its scale alone).
__device__ void quantize_group_team(const float * x, int32_t stride, int32_t n, int32_t bits, int32_t clip,
                                    int32_t param_bits, int32_t sym, bool live, uint8_t * scale_out, uint8_t * min_out,
                                    uint8_t * codes) {
    const int32_t lane = threadIdx.x % TEAM;
    const float levels = (float)((1 << bits) - 1);
    float mn = 0.0f, mx = 0.0f;
    if (live) ott_range_ref(x, stride, n, &mn, &mx);
    if (sym) { /* [-a, a], a = max(-mn, mx) + 0 (no -0) */
        mx = __fadd_rn(-mn > mx ? -mn : mx, 0.0f);
        mn = -mx;
    }
    int32_t pick = 0;
    if (clip) {
        const double err =
            live && lane < OTT_CLIP_N ? clip_err(x, stride, n, mn, mx, lane, levels, param_bits, sym) : 0.0;
        double best_err = 0.0;
        for (int32_t j = 0; j < OTT_CLIP_N; ++j) { /* the first of the least */
            const double e = __shfl_sync(0xffffffffu, err, j, TEAM);
            if (j == 0 || e < best_err) {
                pick     = j;
                best_err = e;
            }
        }
    }
    if (!live) return;
    float lo = mn, hi = mx; /* min-max: exactly mn (also -0) */
    if (clip) {
        const float d = __fmul_rn(ott_clip_shrink(pick), __fsub_rn(mx, mn));
        lo            = __fadd_rn(mn, d);
        hi            = __fsub_rn(mx, d);
    }
    const range_enc r = encode_range(lo, hi, levels, param_bits, sym);
    if (lane == 0) {
        for (int32_t i = 0; i < (param_bits == 8 ? 1 : 2); ++i) {
            scale_out[i] = r.scale[i];
            if (!sym) min_out[i] = r.min[i];
        }
    }
    const int32_t per_byte = 8 / bits; /* codes LSB-first, n·bits a multiple of 8 */
    for (int32_t b = lane; b < n * bits / 8; b += TEAM) {
        uint32_t byte = 0;
        for (int32_t e = 0; e < per_byte; ++e) {
            byte |= (uint32_t)code_of(x[(b * per_byte + e) * stride], r.m, r.inv, levels) << (e * bits);
        }
        codes[b] = (uint8_t)byte;
    }
}

// grid: (n_events, n_head_kv, splits). The pool kernel has run: the ring rows hold the
// substituted block, the head-block its zeros, mask and key order. With scratch (after
// kv_recode_kernel): the rows are the sequence's scratch rows, and an event of block_idx >=
// shift codes block block_idx - shift (the others none).
__global__ void __launch_bounds__(QUANT_THREADS)
    kv_event_quant_kernel(const ott_cuda_kv_layer L, const ott_cuda_event * events, int32_t splits, ott_fp16 * scratch,
                          int32_t shift) {
    extern __shared__ float stage[];
    const ott_cuda_event ev = events[blockIdx.x];
    if (ev.block_idx < shift) return;
    const int32_t h       = blockIdx.y;
    const int64_t sh      = (int64_t)ev.seq * L.n_head_kv + h;
    const ott_kv_geom & g = L.geom;
    const int32_t hd = g.head_dim, block = g.block, vs = hd + 1;
    const split_share S = share_of(g, blockIdx.z, splits);
    const int32_t rows = S.r1 - S.r0, slots = S.t1 - S.t0;
    const ott_fp16 * blk_k = scratch ? recode_rows(scratch, g, L.n_head_kv, ev.seq, h)
                                     : L.win_k + ((size_t)sh * L.win_cap + ev.row0) * hd;  // [block][hd]
    const ott_fp16 * blk_v = scratch ? blk_k + (size_t)block * hd : L.win_v + ((size_t)sh * L.win_cap + ev.row0) * hd;
    uint8_t * out          = ott_cuda_head_block(L, ev.seq, ev.block_idx - shift, h);
    const uint8_t * order  = out + L.layout.k_order;
    const bool tiered      = ott_kv_tiered(&g);
    float * xk             = stage;                         // [block][rows]
    float * xv             = stage + (size_t)block * rows;  // [slots][vs]

    for (int32_t i = threadIdx.x; i < block * rows; i += blockDim.x) {
        const int32_t t = i / rows, r = S.r0 + i % rows;
        xk[i] = ott_fp16_to_fp32_ref(blk_k[(size_t)t * hd + (tiered ? order[r] : r)]);
    }
    for (int32_t i = threadIdx.x; i < slots * hd; i += blockDim.x) {
        const int32_t t = i / hd, c = i % hd;
        xv[t * vs + c] = ott_fp16_to_fp32_ref(blk_v[(size_t)(S.t0 + t) * hd + c]);
    }
    __syncthreads();

    /* the share's groups: each key row's (one with tiers, else [gk]), then each slot's [gv] */
    const uint32_t pb  = ott_kv_param_bytes(&g);
    const int32_t n_gk = tiered ? 1 : (int32_t)ott_kv_n_gk(&g), n_gv = (int32_t)ott_kv_n_gv(&g);
    const int32_t n_kg = rows * n_gk, n_local = n_kg + slots * n_gv;
    const int32_t teams  = (int32_t)blockDim.x / TEAM;
    const int32_t rounds = (n_local + teams - 1) / teams;
    for (int32_t q = (int32_t)threadIdx.x / TEAM; q < rounds * teams; q += teams) {
        const bool live = q < n_local;
        const float * x = xk;
        int32_t stride = rows, n = 1, bits = g.bits_k;
        uint8_t *scale = out, *mins = out, *codes = out;
        int32_t sym = 0;
        if (live && q < n_kg) {
            const int32_t r = S.r0 + q / n_gk, gk = q % n_gk;
            const int32_t p = tiered ? r : gk * hd + r; /* the key parameter's index */
            x               = xk + (size_t)gk * g.group_k * rows + (r - S.r0);
            n               = tiered ? block : g.group_k;
            bits            = tiered ? ott_kv_k_row_bits(&g, r) : g.bits_k;
            scale           = out + L.layout.k_scale + (size_t)p * pb;
            mins            = out + L.layout.k_min + (size_t)p * pb;
            codes           = out + L.layout.k_codes +
                              (tiered ? ott_kv_k_row_offset(&g, r)
                                      : (size_t)r * ott_kv_k_row_bytes(&g) + (size_t)gk * g.group_k * g.bits_k / 8);
        } else if (live) {
            const int32_t j = q - n_kg, t = S.t0 + j / n_gv, gv = j % n_gv;
            const int32_t p = t * n_gv + gv; /* the value parameter's index */
            x               = xv + (size_t)(t - S.t0) * vs + gv * g.group_v;
            stride          = 1;
            n               = g.group_v;
            bits            = g.bits_v;
            sym             = g.sym_v;
            scale           = out + L.layout.v_scale + (size_t)p * pb;
            mins            = out + L.layout.v_min + (size_t)p * pb;
            codes = out + L.layout.v_codes + (size_t)t * ott_kv_v_row_bytes(&g) + (size_t)gv * g.group_v * g.bits_v / 8;
        }
        quantize_group_team(x, stride, n, bits, g.clip, g.param_bits, sym, live, scale, mins, codes);
    }
}

// Splits of an event's groups: about two groups per team, at most one key row and one slot
// each, more while the staging would exceed 64 KiB.
int32_t quant_splits(const ott_kv_geom & g) {
    const int32_t most = std::min(g.head_dim, g.block);
    int32_t s          = std::max(1, std::min(most, ott_kv_n_groups(&g) / (2 * QUANT_THREADS / TEAM)));
    while (s < most && stage_floats(g, s) * sizeof(float) > 64 * 1024) s = std::min(most, s * 2);
    return s;
}

// kv_event_quant_kernel over the events' blocks of L (see there for scratch and shift).
cudaError_t quantize_groups(const ott_cuda_kv_layer & L, const ott_cuda_event * events, int32_t n_events,
                            ott_fp16 * scratch, int32_t shift, cudaStream_t stream) {
    const int32_t splits    = quant_splits(L.geom);
    const size_t smem_quant = stage_floats(L.geom, splits) * sizeof(float);
    const cudaError_t e     = ott_cuda_allow_smem((const void *)kv_event_quant_kernel, smem_quant);
    if (e != cudaSuccess) return e;
    kv_event_quant_kernel<<<dim3(n_events, L.n_head_kv, splits), QUANT_THREADS, smem_quant, stream>>>(L, events, splits,
                                                                                                      scratch, shift);
    return cudaGetLastError();
}

}  // namespace

cudaError_t ott_cuda_kv_event(const ott_cuda_kv_layer & L, const ott_cuda_kv_layer * R, const ott_cuda_event * events,
                              int32_t n_events, ott_fp16 * scratch, cudaStream_t stream) {
    if (n_events == 0) return cudaSuccess;
    cudaError_t e = cudaSuccess;
    if (R) {  // the blocks N events older leave the ring first
        kv_recode_kernel<<<dim3(n_events, L.n_head_kv), RECODE_THREADS, 0, stream>>>(L, *R, events, scratch);
        if ((e = quantize_groups(L, events, n_events, scratch, R->ring, stream)) != cudaSuccess) return e;
    }
    const ott_cuda_kv_layer & D = R ? *R : L;  // where the events' blocks go
    const size_t smem_pool      = pool_smem(D);
    if ((e = ott_cuda_allow_smem((const void *)kv_event_pool_kernel, smem_pool)) != cudaSuccess) return e;
    kv_event_pool_kernel<<<dim3(n_events, D.n_head_kv), POOL_THREADS, smem_pool, stream>>>(D, events);
    return quantize_groups(D, events, n_events, nullptr, 0, stream);
}
