// cuda_ops.cpp — the CUDA kernels of the quantized KV cache against the CPU reference, from
// one case table (test-backend-ops style), and their timings.
//
//   ott-cuda-ops check         every case; one line each: "<id> OK|FAIL <numbers>"; exit 1 on
//                              any FAIL. Appends and events must equal kv_quant.c's _ref bit
//                              for bit (stores, pools, positions, tracing flags, head-blocks);
//                              attention must be within ATTN_BUDGET of a float64 reference
//                              (relative L2 error over the output).
//   ott-cuda-ops perf [ctx[:batch] ..]  copy bandwidth of the card, then the attention
//                              kernels (7B shape: 32 KV heads of 128; ott2, ottr2, ottr3, ottr2
//                              with key tiers, ottr2tg's and ottr2tr's blocks, kvquant2) at each context
//                              and batch (1..64, or the one given): one JSON object per line.
// Inputs are random, fresh for every case; outputs are poisoned (NaN) before each run.
#include "cpu/kvq_attn_cpu.h"
#include "cuda/kvq_cuda.h"
#include "cuda/ott_cuda.h"
#include "kv/kv_kvq.h"
#include "kv/kv_quant.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr double ATTN_BUDGET        = 3e-4;  // float32 arithmetic, exp2f; sharp softmaxes amplify score rounding
constexpr double ATTN_BUDGET_TC     = 2e-3;  // tensor-core path: 16-bit fixed-point q·scale and p·scale
constexpr double KVQ_ATTN_BUDGET    = 1e-5;  // KVQuant attention vs the CPU op: both float32, other sum orders
constexpr double KVQ_ATTN_BUDGET_TC = 2e-3;  // tensor-core path: fp16 keys, queries, probabilities, values
constexpr double GATHER_ROPE_BUDGET = 1e-3;  // gathered keys turned by RoPE: fp16 rows rounded again

#define CHECK_CUDA(expr)                                                                                               \
    do {                                                                                                               \
        const cudaError_t _e = (expr);                                                                                 \
        if (_e != cudaSuccess) {                                                                                       \
            fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(_e), __FILE__, __LINE__, #expr);        \
            exit(2);                                                                                                   \
        }                                                                                                              \
    } while (0)

using rng_t = std::mt19937_64;

// fp16 of a normal value with standard deviation sd.
ott_fp16 rand_f16(rng_t & rng, float sd) {
    std::normal_distribution<float> n(0.0f, sd);
    return ott_fp32_to_fp16_ref(n(rng));
}

// A device copy of v, its allocation recorded in dev (to be freed with the others).
template <typename T> T * upload_to(std::vector<void *> & dev, const std::vector<T> & v) {
    void * p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(1, v.size() * sizeof(T))));
    if (!v.empty()) CHECK_CUDA(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    dev.push_back(p);
    return (T *)p;
}

// Host copy of one layer's stores (ott_cuda.h layout) and its device twin; with recent
// blocks (set_recent), the ring of the newest ones and the layer's recent view R.
struct layer_store {
    ott_cuda_kv_layer L {};  // device pointers
    ott_cuda_kv_layer R {};  // the recent view (R.ring > 0)
    int32_t S = 0;           // sequences
    std::vector<ott_fp16> sink_k, sink_v, win_k, win_v, pool_k, pool_v, extra_k, extra_v;
    std::vector<int32_t> pool_pos, extra_pos, n_pool, n_extra, tracing;
    std::vector<uint8_t> blocks, ring;
    std::vector<float> tier_scale;  // [H][head_dim] with key tiers, or empty (1)
    std::vector<void *> dev;

    layer_store(const ott_kv_geom & g, int32_t S_, int32_t H, int32_t sink, int32_t win_cap, int32_t pool,
                int32_t extra, int32_t max_blocks)
        : S(S_) {
        L.geom          = g;
        L.layout        = ott_kv_block_layout_of(&g);
        L.n_head_kv     = H;
        L.sink          = sink;
        L.win_cap       = win_cap;
        L.pool_cap      = pool;
        L.extra_cap     = extra;
        L.max_blocks    = max_blocks;
        const size_t sh = (size_t)S * H, hd = g.head_dim;
        sink_k.assign(sh * sink * hd, 0);
        sink_v = sink_k;
        win_k.assign(sh * win_cap * hd, 0);
        win_v = win_k;
        pool_k.assign(sh * pool * hd, 0);
        pool_v = pool_k;
        pool_pos.assign(sh * pool, 0);
        extra_k.assign(sh * extra * hd, 0);
        extra_v = extra_k;
        extra_pos.assign(sh * extra, 0);
        n_pool.assign(sh, 0);
        n_extra.assign(sh, 0);
        tracing.assign(sh, 0);
        blocks.assign((size_t)S * max_blocks * H * L.layout.size, 0);
    }
    ~layer_store() {
        for (void * p : dev) cudaFree(p);
    }

    // the newest n blocks of a sequence in a ring of the recent geometry
    void set_recent(int32_t n) {
        view_recent(n);
        ring.assign((size_t)S * n * L.n_head_kv * R.layout.size, 0);
    }
    // R: L's stores with the recent geometry and a ring of n slots as its blocks
    void view_recent(int32_t n) {
        R            = L;
        R.geom       = ott_kv_recent_geom(&L.geom);
        R.layout     = ott_kv_block_layout_of(&R.geom);
        R.max_blocks = R.ring = n;
        R.tier_scale          = nullptr;
    }
    const ott_cuda_kv_layer * recent_view() const { return R.ring ? &R : nullptr; }

    template <typename T> T * upload(const std::vector<T> & v) { return upload_to(dev, v); }
    template <typename T> static void download(std::vector<T> & v, const T * p) {
        if (!v.empty()) CHECK_CUDA(cudaMemcpy(v.data(), p, v.size() * sizeof(T), cudaMemcpyDeviceToHost));
    }

    void to_device() {
        L.sink_k     = upload(sink_k);
        L.sink_v     = upload(sink_v);
        L.win_k      = upload(win_k);
        L.win_v      = upload(win_v);
        L.pool_k     = upload(pool_k);
        L.pool_v     = upload(pool_v);
        L.pool_pos   = upload(pool_pos);
        L.extra_k    = upload(extra_k);
        L.extra_v    = upload(extra_v);
        L.extra_pos  = upload(extra_pos);
        L.n_pool     = upload(n_pool);
        L.n_extra    = upload(n_extra);
        L.tracing    = upload(tracing);
        L.blocks     = upload(blocks);
        L.tier_scale = tier_scale.empty() ? nullptr : upload(tier_scale);
        if (R.ring) {  // the device's stores
            view_recent(R.ring);
            R.blocks = upload(ring);
        }
    }
    void from_device() {
        download(sink_k, L.sink_k);
        download(sink_v, L.sink_v);
        download(win_k, L.win_k);
        download(win_v, L.win_v);
        download(pool_k, L.pool_k);
        download(pool_v, L.pool_v);
        download(pool_pos, L.pool_pos);
        download(extra_k, L.extra_k);
        download(extra_v, L.extra_v);
        download(extra_pos, L.extra_pos);
        download(n_pool, L.n_pool);
        download(n_extra, L.n_extra);
        download(tracing, L.tracing);
        download(blocks, L.blocks);
        if (R.ring) download(ring, R.blocks);
    }
    uint8_t * head_block(int32_t s, int32_t j, int32_t h) {
        return blocks.data() + (ott_cuda_head_block(L, s, j, h) - L.blocks);
    }
    uint8_t * ring_block(int32_t s, int32_t j, int32_t h) {
        return ring.data() + (ott_cuda_head_block(R, s, j, h) - R.blocks);
    }
    // Block j of sequence s holding n_blocks: its geometry and head-block (recent: in the ring)
    std::pair<const ott_kv_geom *, uint8_t *> block_of(int32_t s, int32_t j, int32_t h, int32_t n_blocks) {
        if (R.ring && j >= n_blocks - R.ring) return { &R.geom, ring_block(s, j, h) };
        return { &L.geom, head_block(s, j, h) };
    }
    const float * tier_scale_of(int32_t h) const {
        return tier_scale.empty() ? nullptr : tier_scale.data() + (size_t)h * L.geom.head_dim;
    }
    // with key tiers, a query scale u in [0.01, 4) per channel (some tied), else none
    void draw_tier_scale(rng_t & rng) {
        if (!ott_kv_tiered(&L.geom)) return;
        tier_scale.resize((size_t)L.n_head_kv * L.geom.head_dim);
        for (size_t i = 0; i < tier_scale.size(); ++i)
            tier_scale[i] = i % 9 == 4 ? 1.0f : 0.01f + (rng() % 400) / 100.0f;
    }
};

template <typename T> bool same(const std::vector<T> & a, const std::vector<T> & b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

void report(const std::string & id, bool ok, const std::string & detail, int & n_fail) {
    printf("%-48s %s %s\n", id.c_str(), ok ? "OK" : "FAIL", detail.c_str());
    fflush(stdout);
    n_fail += ok ? 0 : 1;
}

// ---- events: ott_kv_event_ref vs ott_cuda_kv_event ---------------------------------------------

struct event_case {
    const char * name;
    ott_kv_geom g;
    int32_t pool, extra;        // capacities (0: a layer that does not trace)
    int32_t n_pool0, n_extra0;  // counts before the event
    bool ties;                  // duplicated key rows: equal scores
    int32_t recent;             // N > 0: recent blocks (sequence 0's event re-codes one)
};

// Sequence 0 fills a block at window rows [block, 2 block) (block index 1; with N recent
// blocks N + 1, re-coding ring slot 1, an older block coded with masks, into block 1),
// sequence 1 at rows [0, block) (block index 0); two KV heads each.
void check_event(const event_case & c, uint64_t seed, int & n_fail) {
    rng_t rng(seed);
    const ott_kv_geom & g = c.g;
    const int32_t S = 2, H = 2, hd = g.head_dim, block = g.block, win_cap = 2 * block, N = c.recent;
    layer_store st(g, S, H, 0, win_cap, c.pool, c.extra, 2);
    st.draw_tier_scale(rng);
    const int32_t row0[S] = { block, 0 }, bidx[S] = { N + 1, 0 }, pos0[S] = { 1000, 3 * block };
    if (N) st.set_recent(N);
    const ott_kv_geom & eg = N ? st.R.geom : g;  // the geometry of the blocks the events code
    std::vector<uint8_t> scratch(
        std::max(ott_kv_event_scratch_bytes(&eg, std::max(c.pool, 3)), N ? ott_kv_recode_scratch_bytes(&eg) : 0) + 8);
    if (N) {
        std::vector<ott_fp16> ok((size_t)block * hd), ov(ok.size()), pk(3 * hd), pv(pk.size()), ek(32 * hd),
            ev(ek.size());
        std::vector<int32_t> ppos(3), epos(32);
        for (int32_t h = 0; h < H; ++h) {
            for (size_t i = 0; i < ok.size(); ++i) {
                ok[i] = rand_f16(rng, (i / hd) % 5 == 2 ? 0.05f : 1.0f);
                ov[i] = rand_f16(rng, 1.0f);
            }
            ott_kv_rows pool  = { pk.data(), pv.data(), ppos.data(), 0, 3 },
                        extra = { ek.data(), ev.data(), epos.data(), 0, 32 };
            int32_t tracing   = 1;
            ott_kv_event_ref(&st.R.geom, ok.data(), ov.data(), pos0[0] - N * block, &pool, &extra, &tracing, nullptr,
                             st.ring_block(0, bidx[0], h), scratch.data());
        }
    }

    for (int32_t s = 0; s < S; ++s) {
        for (int32_t h = 0; h < H; ++h) {
            const size_t sh = (size_t)s * H + h;
            for (int32_t t = 0; t < block; ++t) {
                // some rows small (candidates), one channel constant in a group, a few large values
                const float sd = (t % 7 == 3) ? 0.05f : 1.0f;
                for (int32_t ch = 0; ch < hd; ++ch) {
                    const size_t i = ((sh * win_cap) + row0[s] + t) * hd + ch;
                    st.win_k[i]    = ch == 5 ? ott_fp32_to_fp16_ref(0.5f) : rand_f16(rng, ch == 7 ? 40.0f : sd);
                    st.win_v[i]    = rand_f16(rng, sd);
                }
                if (c.ties && t % 11 == 4 && t > 0) {  // same key as the slot before: equal L1
                    std::memcpy(&st.win_k[((sh * win_cap) + row0[s] + t) * hd],
                                &st.win_k[((sh * win_cap) + row0[s] + t - 1) * hd], hd * 2);
                }
            }
            st.n_pool[sh]  = c.pool ? c.n_pool0 : 0;
            st.n_extra[sh] = c.extra ? c.n_extra0 : 0;
            st.tracing[sh] = c.pool > 0;
            for (int32_t i = 0; i < st.n_pool[sh]; ++i) {
                st.pool_pos[sh * c.pool + i] = pos0[s] - 100 + 7 * i;
                for (int32_t ch = 0; ch < hd; ++ch) {
                    st.pool_k[(sh * c.pool + i) * hd + ch] = rand_f16(rng, i == 0 ? 0.01f : 0.08f);
                    st.pool_v[(sh * c.pool + i) * hd + ch] = rand_f16(rng, 1.0f);
                }
            }
            for (int32_t i = 0; i < st.n_extra[sh]; ++i) {
                st.extra_pos[sh * c.extra + i] = i;
                for (int32_t ch = 0; ch < hd; ++ch) {
                    st.extra_k[(sh * c.extra + i) * hd + ch] = rand_f16(rng, 1.0f);
                    st.extra_v[(sh * c.extra + i) * hd + ch] = rand_f16(rng, 1.0f);
                }
            }
        }
    }

    // device
    layer_store gpu = st;
    gpu.dev.clear();
    gpu.to_device();
    std::vector<ott_cuda_event> evs;
    for (int32_t s = 0; s < S; ++s) evs.push_back({ s, bidx[s], pos0[s], row0[s] });
    ott_cuda_event * d_evs = gpu.upload(evs);
    ott_fp16 * d_scratch   = gpu.upload(std::vector<ott_fp16>(N ? (size_t)S * H * 2 * block * hd : 0));
    CHECK_CUDA(
        ott_cuda_kv_event(gpu.L, gpu.recent_view(), d_evs, (int32_t)evs.size(), N ? d_scratch : nullptr, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    gpu.from_device();

    // reference, in place on st (as ott_cpu_kv_event)
    for (int32_t s = 0; s < S; ++s) {
        for (int32_t h = 0; h < H; ++h) {
            const size_t sh   = (size_t)s * H + h;
            ott_kv_rows pool  = { st.pool_k.data() + sh * c.pool * hd, st.pool_v.data() + sh * c.pool * hd,
                                  st.pool_pos.data() + sh * c.pool, st.n_pool[sh], c.pool };
            ott_kv_rows extra = { st.extra_k.data() + sh * c.extra * hd, st.extra_v.data() + sh * c.extra * hd,
                                  st.extra_pos.data() + sh * c.extra, st.n_extra[sh], c.extra };
            int32_t tracing   = st.tracing[sh];
            uint8_t * out     = N ? st.ring_block(s, bidx[s], h) : st.head_block(s, bidx[s], h);
            if (N && bidx[s] >= N) {
                ott_kv_recode_ref(&st.R.geom, out, &g, st.tier_scale_of(h), st.head_block(s, bidx[s] - N, h),
                                  scratch.data());
            }
            ott_kv_event_ref(&eg, st.win_k.data() + (sh * win_cap + row0[s]) * hd,
                             st.win_v.data() + (sh * win_cap + row0[s]) * hd, pos0[s], &pool, &extra, &tracing,
                             N ? nullptr : st.tier_scale_of(h), out, scratch.data());
            st.n_pool[sh]  = c.pool ? pool.n : 0;
            st.n_extra[sh] = c.extra ? extra.n : 0;
            st.tracing[sh] = tracing;
        }
    }

    std::string bad;
    auto cmp = [&](const char * what, bool ok) {
        if (!ok) bad += std::string(bad.empty() ? "" : ",") + what;
    };
    cmp("head-blocks", same(st.blocks, gpu.blocks));
    cmp("recent ring", same(st.ring, gpu.ring));
    cmp("window(substituted)", same(st.win_k, gpu.win_k) && same(st.win_v, gpu.win_v));
    cmp("pool", same(st.pool_k, gpu.pool_k) && same(st.pool_v, gpu.pool_v) && same(st.pool_pos, gpu.pool_pos));
    cmp("extra", same(st.extra_k, gpu.extra_k) && same(st.extra_v, gpu.extra_v) && same(st.extra_pos, gpu.extra_pos));
    cmp("counts", same(st.n_pool, gpu.n_pool) && same(st.n_extra, gpu.n_extra) && same(st.tracing, gpu.tracing));
    char detail[160];
    snprintf(detail, sizeof(detail), "n_pool %d n_extra %d tracing %d%s%s", st.n_pool[0], st.n_extra[0], st.tracing[0],
             bad.empty() ? "" : " differ: ", bad.c_str());
    report(std::string("event/") + c.name, bad.empty(), detail, n_fail);
}

// ---- KVQuant: ott_kvq_quantize_block_ref vs ott_cuda_kvq_event, ott_cpu_kvq_attn vs ott_cuda_kvq_attn ----

struct kvq_case {
    const char * name;
    ott_kvq_geom g;    // n_out from the outlier share below
    int32_t outliers;  // per 10000
    int32_t groups;    // query groups (KV heads of sequences), each with its own tables
    int32_t n_blocks;  // head-blocks per group
    int32_t n_fp;      // fp16 rows per group (sink, window, the chunk)
    int32_t n_q;       // query rows per group
    int32_t neox;
};

void check_kvq(kvq_case c, uint64_t seed, int & n_fail) {
    rng_t rng(seed);
    ott_kvq_geom & g = c.g;
    g.n_out          = ott_kvq_n_out(c.outliers, g.block, g.head_dim);
    const int32_t hd = g.head_dim, G = c.groups, NB = c.n_blocks, n = g.block * hd;
    const ott_kvq_block_layout L = ott_kvq_block_layout_of(&g);
    std::vector<void *> mem;

    // tables per group: thresholds on a grid of quarters, codebooks a warped grid (exact midpoints)
    std::vector<float> zero((size_t)G * hd), scale((size_t)G * hd), lk((size_t)G << g.bits_k),
        lv((size_t)G << g.bits_v);
    for (int32_t i = 0; i < G; ++i) {
        std::vector<float> lo(hd), hi(hd);
        for (int32_t ch = 0; ch < hd; ++ch) {
            lo[ch] = -(float)(1 + rng() % 4) * 0.5f;
            hi[ch] = (float)(1 + rng() % 4) * 0.5f;
        }
        ott_kvq_channel_params_ref(lo.data(), hi.data(), hd, &zero[(size_t)i * hd], &scale[(size_t)i * hd]);
        for (int32_t j = 0, nl = 1 << g.bits_k; j < nl; ++j)
            lk[((size_t)i << g.bits_k) + j] = -1.0f + 2.0f * j / (nl - 1) + (j % 2 ? 0.125f : 0.0f) * (j < nl - 1);
        for (int32_t j = 0, nl = 1 << g.bits_v; j < nl; ++j)
            lv[((size_t)i << g.bits_v) + j] = -1.0f + 2.0f * j / (nl - 1);
    }
    const float *d_zero = upload_to(mem, zero), *d_scale = upload_to(mem, scale), *d_lk = upload_to(mem, lk),
                *d_lv = upload_to(mem, lv);
    std::vector<ott_kvq_tables> htab(G), dtab(G);
    for (int32_t i = 0; i < G; ++i) {
        htab[i] = { &zero[(size_t)i * hd], &scale[(size_t)i * hd], &lk[(size_t)i << g.bits_k],
                    &lv[(size_t)i << g.bits_v] };
        dtab[i] = { d_zero + (size_t)i * hd, d_scale + (size_t)i * hd, d_lk + ((size_t)i << g.bits_k),
                    d_lv + ((size_t)i << g.bits_v) };
    }

    // blocks: half of them ties everywhere (multiples of 1/8), the others spread with large values
    std::vector<ott_fp16> k((size_t)G * NB * n), v(k.size());
    for (size_t b = 0; b < (size_t)G * NB; ++b) {
        for (int32_t i = 0; i < n; ++i) {
            const size_t at = b * n + i;
            if (b % 2) {
                k[at] = ott_fp32_to_fp16_ref((float)((int)(rng() % 48) - 24) / 8.0f);
                v[at] = ott_fp32_to_fp16_ref((float)((int)(rng() % 48) - 24) / 8.0f);
            } else {
                k[at] = rand_f16(rng, i % 97 == 5 ? 20.0f : 1.5f);
                v[at] = rand_f16(rng, i % 89 == 7 ? 30.0f : 1.0f);
            }
        }
    }
    std::vector<uint8_t> want((size_t)G * NB * L.size), got(want.size());
    std::vector<uint8_t> scratch(ott_kvq_scratch_bytes(&g));
    std::vector<ott_kvq_tables> btab((size_t)G * NB);
    for (size_t b = 0; b < (size_t)G * NB; ++b) {
        ott_kvq_quantize_block_ref(&g, &htab[b / NB], &k[b * n], &v[b * n], &want[b * L.size], scratch.data());
        btab[b] = dtab[b / NB];
    }
    uint8_t * d_blocks  = (uint8_t *)upload_to(mem, std::vector<uint8_t>(want.size(), 0xff));
    uint8_t * d_scratch = upload_to(mem, std::vector<uint8_t>(ott_cuda_kvq_event_scratch(g) * G * NB, 0));
    CHECK_CUDA(ott_cuda_kvq_event(g, upload_to(mem, btab), upload_to(mem, k), upload_to(mem, v), G * NB, d_blocks,
                                  d_scratch, nullptr));
    CHECK_CUDA(cudaMemcpy(got.data(), d_blocks, got.size(), cudaMemcpyDeviceToHost));
    report(std::string("kvq-event/") + c.name, got == want, "n_out " + std::to_string(g.n_out), n_fail);

    // attention: group i holds its NB blocks from position 1, its fp16 rows at 0 (the sink) and after
    const int32_t n_pos = 1 + NB * g.block + c.n_fp;
    std::vector<float> cs((size_t)n_pos * hd), tile((size_t)OTT_ROPE_TILE * hd);
    ott_rope_table rope = { hd, c.neox, n_pos, cs.data(), tile.data() };
    ott_rope_table_fill(hd, 10000.0, 1.0, n_pos, cs.data());
    ott_rope_tile_fill(hd, 10000.0, 1.0, tile.data());
    std::vector<ott_fp16> fk((size_t)G * c.n_fp * hd), fv(fk.size());
    for (size_t i = 0; i < fk.size(); ++i) {
        fk[i] = rand_f16(rng, 1.0f);
        fv[i] = rand_f16(rng, 1.0f);
    }
    std::vector<int32_t> fpos((size_t)G * c.n_fp);
    for (int32_t i = 0; i < G; ++i) {
        for (int32_t r = 0; r < c.n_fp; ++r) fpos[(size_t)i * c.n_fp + r] = r == 0 ? 0 : NB * g.block + r;
    }
    std::vector<float> q((size_t)G * c.n_q * hd), want_o(q.size()), got_o(q.size());
    for (float & x : q) x = std::normal_distribution<float>(0.0f, 1.0f)(rng);
    const ott_fp16 *d_fk = upload_to(mem, fk), *d_fv = upload_to(mem, fv);
    const int32_t * d_fpos = upload_to(mem, fpos);
    std::vector<ott_kvq_head_stores> hst(G), dst(G);
    std::vector<float> ascratch(ott_cpu_kvq_attn_scratch(&g, c.n_q));
    const float kq_scale = 1.0f / std::sqrt((float)hd);
    for (int32_t i = 0; i < G; ++i) {
        const size_t fo = (size_t)i * c.n_fp;
        hst[i]          = {
            &want[(size_t)i * NB * L.size], NB, (int64_t)L.size, 1, &fk[fo * hd], &fv[fo * hd], &fpos[fo], c.n_fp
        };
        dst[i] = { d_blocks + (size_t)i * NB * L.size,
                   NB,
                   (int64_t)L.size,
                   1,
                   d_fk + fo * hd,
                   d_fv + fo * hd,
                   d_fpos + fo,
                   c.n_fp };
        ott_cpu_kvq_attn(&g, &htab[i], &hst[i], &rope, &q[(size_t)i * c.n_q * hd], c.n_q, nullptr, kq_scale,
                         &want_o[(size_t)i * c.n_q * hd], ascratch.data());
    }
    ott_rope_table drope = rope;
    drope.cs             = upload_to(mem, cs);
    float * d_out        = upload_to(mem, std::vector<float>(q.size(), NAN));
    int n_sm             = 1;
    CHECK_CUDA(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
    const int32_t n_splits = ott_cuda_kvq_attn_splits(g, G, c.n_q, (int64_t)NB * g.block + c.n_fp, n_sm);
    float * d_parts =
        upload_to(mem, std::vector<float>(std::max<size_t>(1, ott_cuda_kvq_partial_floats(g, G, n_splits))));
    CHECK_CUDA(ott_cuda_kvq_attn(g, upload_to(mem, dtab), upload_to(mem, dst), G, drope, upload_to(mem, q), c.n_q,
                                 kq_scale, n_splits, d_parts, d_out, nullptr));
    CHECK_CUDA(cudaMemcpy(got_o.data(), d_out, got_o.size() * 4, cudaMemcpyDeviceToHost));
    double e2 = 0, w2 = 0;
    for (size_t i = 0; i < q.size(); ++i) {
        e2 += std::pow((double)got_o[i] - want_o[i], 2);
        w2 += std::pow((double)want_o[i], 2);
    }
    const double err    = std::sqrt(e2 / std::max(w2, 1e-300));
    const bool tc       = ott_cuda_kvq_attn_tensor_cores(g, c.n_q);
    const double budget = tc ? KVQ_ATTN_BUDGET_TC : KVQ_ATTN_BUDGET;
    char detail[96];
    snprintf(detail, sizeof(detail), "rel err %.2e (budget %.0e), %d split(s)%s", err, budget, n_splits,
             tc ? ", tensor cores" : "");
    report(std::string("kvq-attn/") + c.name, err < budget, detail, n_fail);
    for (void * p : mem) CHECK_CUDA(cudaFree(p));
}

// ---- appends: ott_fp32_to_fp16_ref vs ott_cuda_kv_append -------------------------------------

void check_append(uint64_t seed, int & n_fail) {
    rng_t rng(seed);
    const ott_kv_geom g = { 64, 16, 2, 2, 16, 32 };
    const int32_t S = 2, H = 3, hd = 64, n_tok = 5, win_cap = 32, sink = 2;
    layer_store gpu(g, S, H, sink, win_cap, 0, 0, 1);
    gpu.to_device();
    // values of every kind: normal, ties at the fp16 rounding boundary, subnormals, overflow
    std::vector<float> k((size_t)n_tok * H * hd), v(k.size());
    std::normal_distribution<float> n(0.0f, 3.0f);
    for (size_t i = 0; i < k.size(); ++i) {
        switch (i % 5) {
            case 0:  k[i] = 1.0f + 0x1p-11f * (float)(i % 4); break;  // halfway cases
            case 1:  k[i] = 0x1p-20f * n(rng); break;                 // fp16 subnormals
            case 2:  k[i] = 70000.0f * (i % 2 ? 1 : -1); break;       // overflow to inf
            default: k[i] = n(rng); break;
        }
        v[i] = n(rng);
    }
    float *dk = gpu.upload(k), *dv = gpu.upload(v);
    const ott_cuda_f32_3d K = { dk, hd, (int64_t)H * hd }, V = { dv, hd, (int64_t)H * hd };
    // tokens 0,1 of seq 1 into its sink rows 0,1; tokens 2..4 of seq 0 into window rows 30, 31, 0
    const std::vector<ott_cuda_append> items = { { 0, 1, 0 }, { 1, 1, 1 }, { 2, 0, -31 }, { 3, 0, -32 }, { 4, 0, -1 } };
    ott_cuda_append * d_items                = gpu.upload(items);
    CHECK_CUDA(ott_cuda_kv_append(gpu.L, K, V, d_items, (int32_t)items.size(), nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    gpu.from_device();

    bool ok = true;
    for (const ott_cuda_append & it : items) {
        for (int32_t h = 0; h < H; ++h) {
            const size_t sh = (size_t)it.seq * H + h;
            const ott_fp16 * kd =
                it.row >= 0 ? &gpu.sink_k[(sh * sink + it.row) * hd] : &gpu.win_k[(sh * win_cap - it.row - 1) * hd];
            const ott_fp16 * vd =
                it.row >= 0 ? &gpu.sink_v[(sh * sink + it.row) * hd] : &gpu.win_v[(sh * win_cap - it.row - 1) * hd];
            for (int32_t c = 0; c < hd; ++c) {
                const size_t i = ((size_t)it.tok * H + h) * hd + c;
                ok &= kd[c] == ott_fp32_to_fp16_ref(k[i]) && vd[c] == ott_fp32_to_fp16_ref(v[i]);
            }
        }
    }
    report("append/fp16-rounding-sink-and-ring", ok, "", n_fail);
}

// ---- attention: ott_cuda_attn_* vs float64 --------------------------------------------------------

struct attn_case {
    const char * name;
    ott_kv_geom g;
    int32_t n_rep;
    int32_t n_q;          // chunk tokens per sequence (1 = decode)
    int32_t n_blocks[2];  // quantized blocks of sequences 0 and 1
    int32_t sink, pool, extra, n_win;
    int32_t n_splits;
    int32_t recent;  // the newest blocks of a sequence in the recent geometry (ott_cuda.h)
    int32_t rope;    // keys cached before RoPE: 1 pairs (2i, 2i+1), 2 NeoX pairs (i, i + hd/2); 0 after
};

// Keys before RoPE: the angles of positions 0 .. n_pos-1 on the device as L.rope (and R's).
std::vector<float2> set_rope(const attn_case & c, int32_t n_pos, layer_store & st) {
    std::vector<float2> pairs;
    if (!c.rope) return pairs;
    pairs.resize((size_t)n_pos * c.g.head_dim / 2);
    ott_cuda_rope_pairs_fill(c.g.head_dim, 10000.0, 1.0, n_pos, pairs.data());
    st.L.rope      = st.upload(pairs);
    st.L.rope_neox = c.rope == 2;
    return pairs;
}

// k turned by RoPE at position p with the angles of set_rope (float64 arithmetic).
void rope_ref(std::vector<double> & k, const std::vector<float2> & pairs, int32_t p, bool neox) {
    const int32_t half = (int32_t)k.size() / 2;
    for (int32_t i = 0; i < half; ++i) {
        const int32_t a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
        const float2 cs = pairs[(size_t)p * half + i];
        const double x = k[a], y = k[b];
        k[a] = x * cs.x - y * cs.y;
        k[b] = x * cs.y + y * cs.x;
    }
}

// The positions of an attn_case's stores run up to sink + blocks·block + window + chunk.
int32_t attn_positions(const attn_case & c) {
    return c.sink + (std::max(c.n_blocks[0], c.n_blocks[1]) + 1) * c.g.block + c.n_win + c.n_q;
}

// A quantized entry: its code, and its group's scale and minimum as floats.
struct coded {
    int code;
    float scale, min;
};

// Parameter i of arrays sc, mn (fp16, or 8-bit: kv_layout.h; mn null: a symmetric group of
// `bits`-bit codes) with its code.
coded with_params(const ott_kv_geom & g, int code, const uint8_t * sc, const uint8_t * mn, int32_t i, int32_t bits) {
    const float s = g.param_bits == 8 ? ott_kv_scale8(sc[i]) : ott_fp16_to_fp32_ref(((const ott_fp16 *)sc)[i]);
    if (!mn) return { code, s, ott_kv_sym_min(bits, s) };
    return { code, s,
             g.param_bits == 8 ? ott_kv_min8((int8_t)mn[i], s) : ott_fp16_to_fp32_ref(((const ott_fp16 *)mn)[i]) };
}

// Entry (t, c) of a head-block's keys or values.
coded entry(const ott_kv_geom & g, const uint8_t * hb, bool key, int32_t t, int32_t c) {
    const ott_kv_block_layout L = ott_kv_block_layout_of(&g);
    if (key && ott_kv_tiered(&g)) {  // key row r: the channel of rank r, one group per block
        const int32_t r    = (int32_t)(std::find(hb + L.k_order, hb + L.k_order + g.head_dim, c) - (hb + L.k_order));
        const int32_t bits = ott_kv_k_row_bits(&g, r);
        const uint8_t byte = hb[L.k_codes + ott_kv_k_row_offset(&g, r) + t * bits / 8];
        return with_params(g, (byte >> ((t * bits) % 8)) & ((1 << bits) - 1), hb + L.k_scale, hb + L.k_min, r, bits);
    }
    if (key) {
        const uint8_t byte = hb[L.k_codes + (size_t)c * ott_kv_k_row_bytes(&g) + t * g.bits_k / 8];
        const int code     = (byte >> ((t * g.bits_k) % 8)) & ((1 << g.bits_k) - 1);
        return with_params(g, code, hb + L.k_scale, hb + L.k_min, t / g.group_k * g.head_dim + c, g.bits_k);
    }
    const uint8_t byte = hb[L.v_codes + (size_t)t * ott_kv_v_row_bytes(&g) + c * g.bits_v / 8];
    const int code     = (byte >> ((c * g.bits_v) % 8)) & ((1 << g.bits_v) - 1);
    return with_params(g, code, hb + L.v_scale, g.sym_v ? nullptr : hb + L.v_min,
                       t * (g.head_dim / g.group_v) + c / g.group_v, g.bits_v);
}

// code·scale + min in float64 (the attention's reference)
double dequant(const ott_kv_geom & g, const uint8_t * hb, bool key, int32_t t, int32_t c) {
    const coded e = entry(g, hb, key, t, c);
    return e.code * (double)e.scale + e.min;
}

constexpr int32_t ATTN_SEQS = 2, ATTN_HEADS = 2;  // the stores of an attn_case

// Window ring rows of an attn_case's stores.
int32_t attn_win_cap(const attn_case & c) { return ((c.n_win + c.g.block) / c.g.block + 1) * c.g.block; }

// Random stores of an attn_case (ATTN_SEQS sequences, ATTN_HEADS KV heads): blocks from the
// reference quantizer (random masks where tracing), fp16 rows; the pools' positions are the
// masked slots (the pool's first, then the extra pool's; cycling when they hold more).
void fill_stores(const attn_case & c, rng_t & rng, layer_store & st) {
    const ott_kv_geom & g = c.g;
    const int32_t S = ATTN_SEQS, H = ATTN_HEADS, hd = g.head_dim, block = g.block, win_cap = attn_win_cap(c);
    const bool traces = c.pool > 0;
    st.draw_tier_scale(rng);
    if (c.recent) st.set_recent(c.recent);
    std::vector<ott_fp16> bk((size_t)block * hd), bv(bk.size());
    std::vector<uint8_t> masked(block);
    for (int32_t s = 0; s < S; ++s) {
        for (int32_t h = 0; h < H; ++h) {
            const size_t sh = (size_t)s * H + h;
            for (int32_t j = 0; j < c.n_blocks[s]; ++j) {
                for (size_t i = 0; i < bk.size(); ++i) {
                    bk[i] = rand_f16(rng, 1.0f + (i % hd == 3 ? 4.0f : 0.0f));
                    bv[i] = rand_f16(rng, 1.0f);
                }
                for (int32_t t = 0; t < block; ++t) masked[t] = traces && (rng() % 13 == 0);
                const auto [bg, hb] = st.block_of(s, j, h, c.n_blocks[s]);
                ott_quantize_block_ref(bg, bk.data(), bv.data(), masked.data(),
                                       bg == &g ? st.tier_scale_of(h) : nullptr, hb);
            }
            for (auto * vec : { &st.sink_k, &st.sink_v }) {
                for (int32_t i = 0; i < c.sink * hd; ++i) (*vec)[sh * c.sink * hd + i] = rand_f16(rng, 1.0f);
            }
            st.n_pool[sh]  = c.pool ? (int32_t)(rng() % (c.pool + 1)) : 0;
            st.n_extra[sh] = c.extra ? (int32_t)(rng() % (c.extra + 1)) : 0;
            for (int32_t i = 0; i < c.pool * hd; ++i) {
                st.pool_k[sh * c.pool * hd + i] = rand_f16(rng, 0.3f);
                st.pool_v[sh * c.pool * hd + i] = rand_f16(rng, 1.0f);
            }
            for (int32_t i = 0; i < c.extra * hd; ++i) {
                st.extra_k[sh * c.extra * hd + i] = rand_f16(rng, 1.0f);
                st.extra_v[sh * c.extra * hd + i] = rand_f16(rng, 1.0f);
            }
            for (int32_t i = 0; i < win_cap * hd; ++i) {
                st.win_k[sh * win_cap * hd + i] = rand_f16(rng, 1.0f);
                st.win_v[sh * win_cap * hd + i] = rand_f16(rng, 1.0f);
            }
            std::vector<int32_t> pooled;
            for (int32_t j = 0; j < c.n_blocks[s]; ++j) {
                const auto [bg, hb]         = st.block_of(s, j, h, c.n_blocks[s]);
                const ott_kv_block_layout L = ott_kv_block_layout_of(bg);
                for (int32_t t = 0; t < block; ++t) {
                    if ((hb[L.mask + t / 8] >> (t % 8)) & 1) pooled.push_back(c.sink + j * block + t);
                }
            }
            for (int32_t i = 0; i < st.n_pool[sh] + st.n_extra[sh] && !pooled.empty(); ++i) {
                const int32_t pos = pooled[i % pooled.size()];
                if (i < st.n_pool[sh]) {
                    st.pool_pos[sh * c.pool + i] = pos;
                } else {
                    st.extra_pos[sh * c.extra + i - st.n_pool[sh]] = pos;
                }
            }
        }
    }
}

// tensor_cores: run the integer tensor-core block phase where it applies (ott_cuda.h); n_sm:
// the multiprocessors ott_cuda_attn_n_parts sizes the recent launch for
void check_attn(const attn_case & c, uint64_t seed, int tensor_cores, int32_t n_sm, int & n_fail) {
    rng_t rng(seed);
    const ott_kv_geom & g = c.g;
    const int32_t S = ATTN_SEQS, H = ATTN_HEADS, hd = g.head_dim, block = g.block, n_head = H * c.n_rep;
    const int32_t max_blocks = std::max(c.n_blocks[0], c.n_blocks[1]) + 1;
    const int32_t win_cap    = attn_win_cap(c);
    const bool traces        = c.pool > 0;
    layer_store st(g, S, H, c.sink, win_cap, c.pool, c.extra, max_blocks);
    fill_stores(c, rng, st);

    // the step: sequence s has tokens t0 = s*n_q .. of the ubatch
    const int32_t n_tok = S * c.n_q;
    std::vector<float> q((size_t)n_tok * n_head * hd), k((size_t)n_tok * H * hd), v(k.size());
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float & x : q) x = nd(rng);
    for (float & x : k) x = nd(rng);
    for (float & x : v) x = nd(rng);
    const float kq_scale = 1.0f / std::sqrt((float)hd);

    std::vector<ott_cuda_attn_tile> tiles;
    int32_t win_pos0[S];
    const int32_t rows = c.n_q * c.n_rep;
    for (int32_t s = 0; s < S; ++s) {
        win_pos0[s] = c.sink + c.n_blocks[s] * block;
        for (int32_t h = 0; h < H; ++h) {
            for (int32_t row0 = 0; row0 < rows; row0 += OTT_CUDA_ATTN_ROWS) {
                tiles.push_back({ s, h, s * c.n_q, c.n_q, row0, std::min(OTT_CUDA_ATTN_ROWS, rows - row0), c.sink,
                                  c.n_blocks[s], c.n_win, win_pos0[s] });
            }
        }
    }

    const std::vector<float2> pairs = set_rope(c, attn_positions(c), st);
    layer_store & gpu               = st;
    gpu.to_device();
    ott_cuda_attn_args a {};
    a.L             = gpu.L;
    a.q             = { gpu.upload(q), hd, (int64_t)n_head * hd };
    a.k             = { gpu.upload(k), hd, (int64_t)H * hd };
    a.v             = { gpu.upload(v), hd, (int64_t)H * hd };
    a.n_rep         = c.n_rep;
    a.kq_scale      = kq_scale;
    a.traces        = traces;
    a.tiles         = gpu.upload(tiles);
    a.n_tiles       = (int32_t)tiles.size();
    a.rows_per_tile = std::min(rows, OTT_CUDA_ATTN_ROWS);
    a.n_splits      = c.n_splits;
    a.tensor_cores  = tensor_cores;
    a.recent        = c.recent;
    a.n_parts       = ott_cuda_attn_n_parts(c.n_splits, c.recent, a.n_tiles, n_sm);
    std::vector<float> parts(tiles.size() * a.n_parts * OTT_CUDA_ATTN_ROWS * ott_cuda_partial_row(hd), NAN);
    a.partials = gpu.upload(parts);
    std::vector<float> out((size_t)n_tok * n_head * hd, NAN);
    float * d_out = gpu.upload(out);
    CHECK_CUDA(ott_cuda_attn_partial(a, nullptr));
    if (c.recent) CHECK_CUDA(ott_cuda_attn_recent(a, gpu.R, nullptr));
    CHECK_CUDA(ott_cuda_attn_merge(a, d_out, (int64_t)n_head * hd, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    layer_store::download(out, d_out);

    // float64 reference: one softmax over sink, unmasked slots, pool, extra, window, the chunk
    double err2 = 0, ref2 = 0;
    bool finite = true;
    for (int32_t s = 0; s < S; ++s) {
        for (int32_t h = 0; h < H; ++h) {
            const size_t sh = (size_t)s * H + h;
            std::vector<std::vector<double>> ks, vs;  // the keys and values every row sees
            auto see = [&](std::vector<double> & kr, std::vector<double> & vr, int32_t p) {
                if (c.rope) rope_ref(kr, pairs, p, c.rope == 2);
                ks.push_back(kr);
                vs.push_back(vr);
            };
            // n rows at positions pos[i], or p0 + i
            auto f16_rows = [&](const ott_fp16 * kp, const ott_fp16 * vp, int32_t n, int32_t p0,
                                const int32_t * pos = nullptr) {
                for (int32_t i = 0; i < n; ++i) {
                    std::vector<double> kr(hd), vr(hd);
                    for (int32_t ch = 0; ch < hd; ++ch) {
                        kr[ch] = ott_fp16_to_fp32_ref(kp[(size_t)i * hd + ch]);
                        vr[ch] = ott_fp16_to_fp32_ref(vp[(size_t)i * hd + ch]);
                    }
                    see(kr, vr, pos ? pos[i] : p0 + i);
                }
            };
            f16_rows(&st.sink_k[sh * c.sink * hd], &st.sink_v[sh * c.sink * hd], c.sink, 0);
            for (int32_t j = 0; j < c.n_blocks[s]; ++j) {
                const auto [bg, hb]         = st.block_of(s, j, h, c.n_blocks[s]);
                const ott_kv_block_layout L = ott_kv_block_layout_of(bg);
                for (int32_t t = 0; t < block; ++t) {
                    if (traces && ((hb[L.mask + t / 8] >> (t % 8)) & 1)) continue;
                    std::vector<double> kr(hd), vr(hd);
                    for (int32_t ch = 0; ch < hd; ++ch) {
                        kr[ch] = dequant(*bg, hb, true, t, ch);
                        vr[ch] = dequant(*bg, hb, false, t, ch);
                    }
                    see(kr, vr, c.sink + j * block + t);
                }
            }
            f16_rows(&st.pool_k[sh * c.pool * hd], &st.pool_v[sh * c.pool * hd], st.n_pool[sh], 0,
                     &st.pool_pos[sh * c.pool]);
            f16_rows(&st.extra_k[sh * c.extra * hd], &st.extra_v[sh * c.extra * hd], st.n_extra[sh], 0,
                     &st.extra_pos[sh * c.extra]);
            for (int32_t i = 0; i < c.n_win; ++i) {
                const int32_t row = (win_pos0[s] + i - c.sink) % win_cap;
                f16_rows(&st.win_k[(sh * win_cap + row) * hd], &st.win_v[(sh * win_cap + row) * hd], 1,
                         win_pos0[s] + i);
            }
            const size_t n_past = ks.size();
            for (int32_t j = 0; j < c.n_q; ++j) {
                std::vector<double> kr(hd), vr(hd);
                for (int32_t ch = 0; ch < hd; ++ch) {
                    const size_t i = ((size_t)(s * c.n_q + j) * H + h) * hd + ch;
                    kr[ch]         = ott_fp16_to_fp32_ref(ott_fp32_to_fp16_ref(k[i]));
                    vr[ch]         = ott_fp16_to_fp32_ref(ott_fp32_to_fp16_ref(v[i]));
                }
                see(kr, vr, win_pos0[s] + c.n_win + j);
            }
            for (int32_t i = 0; i < c.n_q; ++i) {
                for (int32_t r = 0; r < c.n_rep; ++r) {
                    const int32_t tok = s * c.n_q + i, hq = h * c.n_rep + r;
                    const float * qr   = &q[((size_t)tok * n_head + hq) * hd];
                    const size_t n_vis = n_past + i + 1;
                    std::vector<double> sc(n_vis);
                    double mx = -INFINITY;
                    for (size_t t = 0; t < n_vis; ++t) {
                        double d = 0;
                        for (int32_t ch = 0; ch < hd; ++ch) d += (double)qr[ch] * ks[t][ch];
                        sc[t] = d * kq_scale;
                        mx    = std::max(mx, sc[t]);
                    }
                    double l = 0;
                    std::vector<double> o(hd, 0.0);
                    for (size_t t = 0; t < n_vis; ++t) {
                        const double p = std::exp(sc[t] - mx);
                        l += p;
                        for (int32_t ch = 0; ch < hd; ++ch) o[ch] += p * vs[t][ch];
                    }
                    for (int32_t ch = 0; ch < hd; ++ch) {
                        const double ref = o[ch] / l, got = out[((size_t)tok * n_head + hq) * hd + ch];
                        finite &= std::isfinite(got);
                        err2 += (got - ref) * (got - ref);
                        ref2 += ref * ref;
                    }
                }
            }
        }
    }
    const double rel = std::sqrt(err2 / ref2), budget = tensor_cores ? ATTN_BUDGET_TC : ATTN_BUDGET;
    char detail[96];
    snprintf(detail, sizeof(detail), "rel_l2 %.2e (budget %.0e)", rel, budget);
    const char * launch = c.recent && n_sm == 1 ? "/recent-unsplit" : "";
    report(std::string(tensor_cores ? "attn-tc/" : "attn/") + c.name + launch, finite && rel < budget, detail, n_fail);
}

// ---- gather: ott_cuda_kv_gather vs the stores read in position order ---------------------------

// fp16(code·scale + min), the product and the sum each rounded in float (cuda/kv_gather.cu)
ott_fp16 entry_f16(const ott_kv_geom & g, const uint8_t * hb, bool key, int32_t t, int32_t c) {
    const coded e    = entry(g, hb, key, t, c);
    const float prod = (float)e.code * e.scale;
    return ott_fp32_to_fp16_ref(prod + e.min);
}

// Each sequence's stores and a chunk as fp16 rows in position order, bit for bit: sink,
// head-block entries (entry_f16), window, the chunk rounded to fp16, pooled slots from their
// pools, then zero rows.
void check_gather(const attn_case & c, uint64_t seed, int & n_fail) {
    rng_t rng(seed);
    const ott_kv_geom & g = c.g;
    const int32_t S = ATTN_SEQS, H = ATTN_HEADS, hd = g.head_dim, block = g.block, win_cap = attn_win_cap(c);
    layer_store st(g, S, H, c.sink, win_cap, c.pool, c.extra, std::max(c.n_blocks[0], c.n_blocks[1]) + 1);
    fill_stores(c, rng, st);
    std::vector<float> k((size_t)S * c.n_q * H * hd), v(k.size());
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float & x : k) x = nd(rng);
    for (float & x : v) x = nd(rng);
    const std::vector<float2> pairs = set_rope(c, attn_positions(c), st);
    st.to_device();
    double err2 = 0, ref2 = 0;  // keys before RoPE: the turned keys against float64
    const ott_cuda_f32_3d dk = { st.upload(k), hd, (int64_t)H * hd }, dv = { st.upload(v), hd, (int64_t)H * hd };
    bool ok = true;
    for (int32_t s = 0; s < S; ++s) {
        const int32_t n_past    = c.sink + c.n_blocks[s] * block + c.n_win;
        const ott_cuda_gather G = { s, c.sink, c.n_blocks[s], c.n_win, c.n_q, s * c.n_q, n_past + c.n_q + 70 };
        std::vector<ott_fp16> ko((size_t)H * G.n_rows * hd, 0x7E00), vo(ko.size(), 0x7E00);  // NaN
        ott_fp16 *dko = st.upload(ko), *dvo = st.upload(vo);
        CHECK_CUDA(ott_cuda_kv_gather(st.L, st.recent_view(), dk, dv, G, dko, dvo, nullptr));
        CHECK_CUDA(cudaDeviceSynchronize());
        layer_store::download(ko, dko);
        layer_store::download(vo, dvo);

        std::vector<ott_fp16> rk(ko.size(), 0), rv(vo.size(), 0);
        for (int32_t h = 0; h < H; ++h) {
            const size_t sh = (size_t)s * H + h;
            auto row        = [&](int32_t p) { return ((size_t)h * G.n_rows + p) * hd; };
            auto put        = [&](int32_t p, const ott_fp16 * kr, const ott_fp16 * vr) {
                std::copy(kr, kr + hd, rk.begin() + row(p));
                std::copy(vr, vr + hd, rv.begin() + row(p));
            };
            for (int32_t p = 0; p < c.sink; ++p)
                put(p, &st.sink_k[(sh * c.sink + p) * hd], &st.sink_v[(sh * c.sink + p) * hd]);
            for (int32_t j = 0; j < c.n_blocks[s]; ++j) {
                const auto [bg, hb] = st.block_of(s, j, h, c.n_blocks[s]);
                for (int32_t t = 0; t < block; ++t) {
                    for (int32_t ch = 0; ch < hd; ++ch) {
                        rk[row(c.sink + j * block + t) + ch] = entry_f16(*bg, hb, true, t, ch);
                        rv[row(c.sink + j * block + t) + ch] = entry_f16(*bg, hb, false, t, ch);
                    }
                }
            }
            for (int32_t i = 0; i < c.n_win; ++i) {
                const int32_t p = c.sink + c.n_blocks[s] * block + i, r = (p - c.sink) % win_cap;
                put(p, &st.win_k[(sh * win_cap + r) * hd], &st.win_v[(sh * win_cap + r) * hd]);
            }
            for (int32_t i = 0; i < c.n_q; ++i) {
                for (int32_t ch = 0; ch < hd; ++ch) {
                    const size_t x           = ((size_t)(s * c.n_q + i) * H + h) * hd + ch;
                    rk[row(n_past + i) + ch] = ott_fp32_to_fp16_ref(k[x]);
                    rv[row(n_past + i) + ch] = ott_fp32_to_fp16_ref(v[x]);
                }
            }
            for (int32_t i = 0; i < st.n_pool[sh]; ++i) {
                put(st.pool_pos[sh * c.pool + i], &st.pool_k[(sh * c.pool + i) * hd],
                    &st.pool_v[(sh * c.pool + i) * hd]);
            }
            for (int32_t i = 0; i < st.n_extra[sh]; ++i) {
                put(st.extra_pos[sh * c.extra + i], &st.extra_k[(sh * c.extra + i) * hd],
                    &st.extra_v[(sh * c.extra + i) * hd]);
            }
            for (int32_t p = 0; c.rope && p < n_past + c.n_q; ++p) {  // turned in float, rounded to fp16 twice
                std::vector<double> kr(hd);
                for (int32_t ch = 0; ch < hd; ++ch) kr[ch] = ott_fp16_to_fp32_ref(rk[row(p) + ch]);
                rope_ref(kr, pairs, p, c.rope == 2);
                for (int32_t ch = 0; ch < hd; ++ch) {
                    const double got = ott_fp16_to_fp32_ref(ko[row(p) + ch]);
                    err2 += (got - kr[ch]) * (got - kr[ch]);
                    ref2 += kr[ch] * kr[ch];
                    rk[row(p) + ch] = ko[row(p) + ch];
                }
            }
        }
        ok = ok && same(ko, rk) && same(vo, rv);
    }
    const double rel = ref2 > 0 ? std::sqrt(err2 / ref2) : 0.0;
    ok               = ok && rel < GATHER_ROPE_BUDGET;
    char detail[96];
    snprintf(detail, sizeof(detail), "keys turned by RoPE: rel_l2 %.2e (budget %.0e)", rel, GATHER_ROPE_BUDGET);
    report(std::string("gather/") + c.name, ok, c.rope ? detail : ok ? "bit-exact" : "differs from the stores", n_fail);
}

int run_checks() {
    int n_fail                 = 0;
    const ott_kv_geom ott2_128 = { 128, 128, 2, 2, 128, 64 }, ott2_64 = { 64, 128, 2, 2, 128, 64 };
    const ott_kv_geom kivi2_64 = { 64, 128, 2, 2, 32, 32 }, ott4_128 = { 128, 128, 4, 4, 128, 64 };
    const ott_kv_geom kivi2_128 = { 128, 128, 2, 2, 32, 32 }, g16_128 = { 128, 128, 2, 2, 16, 16 };
    const ott_kv_geom kivi4_128 = { 128, 128, 4, 4, 32, 32 };
    const ott_kv_geom v32_128   = { 128, 128, 2, 2, 128, 32 };
    const ott_kv_geom small2 = { 64, 16, 2, 2, 8, 16 }, small8 = { 64, 16, 8, 8, 4, 16 },
                      small4    = { 128, 16, 4, 4, 16, 32 };
    const ott_kv_geom clip2_128 = { 128, 128, 2, 2, 128, 64, 1, 16 }, clip4_64 = { 64, 16, 4, 4, 8, 16, 1, 16 };
    const ott_kv_geom p8_128 = { 128, 128, 2, 2, 128, 128, 0, 8 }, p8_64 = { 64, 16, 4, 4, 8, 16, 0, 8 };
    const ott_kv_geom k4v2_64 = { 64, 128, 4, 2, 128, 64, 0, 8 }, k4v2_128 = { 128, 128, 4, 2, 128, 128, 0, 16 };
    const ott_kv_geom ottr3_128   = { 128, 128, 4, 2, 128, 128, 0, 8 };
    const ott_kv_geom clip_p8_128 = { 128, 128, 2, 2, 128, 128, 1, 8 }, clip_p8_64 = { 64, 16, 4, 4, 8, 16, 1, 8 };
    // key tiers (ottr2:hi_k=4:lo_k=8 and others): n_hi rows of 4-bit codes, n_lo of 1-bit
    const ott_kv_geom tier_64      = { 64, 128, 2, 2, 128, 64, 1, 8, 0, 16, 32 };
    const ott_kv_geom tier_128     = { 128, 128, 2, 2, 128, 128, 1, 8, 0, 32, 64 };
    const ott_kv_geom hi_only_128  = { 128, 128, 2, 2, 128, 64, 0, 16, 0, 32, 0 };
    const ott_kv_geom lo_only_64   = { 64, 32, 2, 2, 32, 16, 1, 8, 0, 0, 16 };
    const ott_kv_geom tier_b16_256 = { 256, 16, 2, 2, 16, 256, 1, 8, 0, 64, 64 };
    // symmetric value groups (sym_v): ottr2t's geometry with them, fp16 parameters without
    // tiers, and ottr2tr's (tiers 5 + 10 of 16 channels)
    const ott_kv_geom sym_tiers_128 = { 128, 128, 2, 2, 128, 128, 1, 8, 0, 32, 64, 1 };
    const ott_kv_geom sym_64        = { 64, 128, 2, 2, 128, 64, 1, 16, 0, 0, 0, 1 };
    const ott_kv_geom ottr2tr_64    = { 64, 128, 2, 2, 128, 64, 1, 8, 0, 20, 40, 1 };
    const ott_kv_geom ottr2tr_128   = { 128, 128, 2, 2, 128, 128, 1, 8, 0, 40, 80, 1 };
    const event_case events[]       = {
        { "ott2-hd128-first", ott2_128, 3, 32, 0, 0, false },
        { "ott2-hd128-pool-full", ott2_128, 3, 32, 3, 10, true },
        { "ott2-hd64-stop-rule", ott2_64, 3, 32, 3, 30, false },
        { "ott2-hd64-extra-edge", ott2_64, 3, 32, 3, 29, false },
        { "kivi2-hd64-no-tracing", kivi2_64, 0, 0, 0, 0, false },
        { "ott4-hd128-pool-full", ott4_128, 3, 32, 3, 5, true },
        { "small2-hd64-g8", small2, 2, 5, 2, 1, true },
        { "small8-hd64-g4", small8, 2, 5, 1, 0, false },
        { "small4-hd128", small4, 2, 5, 2, 2, false },
        { "clip2-hd128-pool-full", clip2_128, 3, 32, 3, 10, true },
        { "clip4-hd64-kivi", clip4_64, 0, 0, 0, 0, false },
        { "p8-hd128-pool-full", p8_128, 3, 32, 3, 10, true },
        { "p8-hd64-4bit-kivi", p8_64, 0, 0, 0, 0, false },
        { "k4v2-hd64-pool-full", k4v2_64, 3, 32, 3, 10, true },
        { "clip-p8-hd128-pool-full", clip_p8_128, 3, 32, 3, 10, true },
        { "clip-p8-hd64-4bit-kivi", clip_p8_64, 0, 0, 0, 0, false },
        { "tiers-hd64-pool-full", tier_64, 3, 32, 3, 10, true },
        { "tiers-hd128-first", tier_128, 3, 32, 0, 0, false },
        { "tiers-hi-only-hd128-fp16-params", hi_only_128, 3, 32, 3, 10, true },
        { "tiers-lo-only-hd64-b32", lo_only_64, 0, 0, 0, 0, false },
        { "tiers-hd256-b16", tier_b16_256, 2, 5, 2, 1, false },
        { "sym-tiers-p8-hd128-pool-full", sym_tiers_128, 3, 32, 3, 10, true },
        { "sym-p16-hd64-first", sym_64, 3, 32, 0, 0, false },
        { "recent1-kivi2-hd64-no-tracing", kivi2_64, 0, 0, 0, 0, false, 1 },
        { "recent2-sym-tiers-hd128", sym_tiers_128, 3, 32, 3, 10, false, 2 },
        { "recent5-ottr2tr-hd64-pool-full", ottr2tr_64, 3, 32, 3, 10, true, 5 },
        { "recent5-ottr2tr-hd128", ottr2tr_128, 3, 32, 1, 4, false, 5 },
    };
    uint64_t seed = 1;
    for (const event_case & c : events) check_event(c, seed++, n_fail);
    check_append(seed++, n_fail);

    const attn_case attns[] = {
        { "ott2-hd128-rep1-decode", ott2_128, 1, 1, { 9, 4 }, 0, 3, 32, 40, 1 },
        { "ott2-hd128-rep1-split3", ott2_128, 1, 1, { 9, 4 }, 0, 3, 32, 40, 3 },
        { "ott2-hd64-rep3-decode", ott2_64, 3, 1, { 5, 0 }, 0, 3, 32, 100, 2 },
        { "ott2-hd64-rep3-chunk5", ott2_64, 3, 5, { 3, 2 }, 0, 3, 32, 33, 2 },
        { "kivi2-hd64-rep2-chunk3", kivi2_64, 2, 3, { 4, 1 }, 0, 0, 0, 128, 2 },
        { "ott4-hd128-rep1-decode", ott4_128, 1, 1, { 6, 6 }, 0, 3, 32, 50, 2 },
        { "small2-hd64-rep7-chunk2", small2, 7, 2, { 11, 5 }, 2, 2, 5, 7, 3 },
        { "small8-hd64-rep3-chunk3", small8, 3, 3, { 7, 0 }, 2, 2, 5, 4, 2 },
        { "small4-hd128-rep1-decode", small4, 1, 1, { 10, 3 }, 0, 2, 5, 5, 4 },
        { "ott2-hd128-empty-cache", ott2_128, 1, 4, { 0, 0 }, 0, 3, 32, 0, 1 },
        { "ott2-hd128-rep2-decode", ott2_128, 2, 1, { 7, 3 }, 0, 3, 32, 20, 2 },
        { "ott2-hd128-rep1-chunk4", ott2_128, 1, 4, { 5, 2 }, 0, 3, 32, 10, 2 },
        { "kivi2-hd128-rep1-decode", kivi2_128, 1, 1, { 6, 2 }, 0, 0, 0, 100, 2 },
        { "kivi2-hd128-rep2-decode", kivi2_128, 2, 1, { 4, 5 }, 0, 0, 0, 60, 3 },
        { "g16-hd128-rep1-decode", g16_128, 1, 1, { 5, 1 }, 0, 3, 8, 30, 2 },
        { "v32-hd128-rep1-decode", v32_128, 1, 1, { 6, 3 }, 0, 3, 32, 40, 2 },
        { "p8-hd128-rep1-decode", p8_128, 1, 1, { 6, 3 }, 0, 3, 32, 40, 2 },
        { "p8-hd128-rep2-chunk3", p8_128, 2, 3, { 5, 2 }, 4, 3, 32, 30, 3 },
        { "p8-hd64-rep3-chunk2", p8_64, 3, 2, { 9, 4 }, 2, 2, 5, 7, 2 },
        { "k4v2-hd64-rep3-decode", k4v2_64, 3, 1, { 7, 2 }, 0, 3, 32, 60, 2 },
        { "k4v2-hd128-rep1-chunk4", k4v2_128, 1, 4, { 5, 3 }, 0, 3, 32, 20, 3 },
        { "ottr3-hd128-rep1-decode", ottr3_128, 1, 1, { 9, 4 }, 0, 3, 32, 40, 2 },
        { "ottr3-hd128-rep2-decode", ottr3_128, 2, 1, { 6, 5 }, 0, 3, 32, 90, 3 },
        { "ottr3-hd128-rep1-decode-long", ottr3_128, 1, 1, { 20, 11 }, 0, 3, 32, 7, 3 },
        { "ottr3-hd128-rep1-decode-sink", ottr3_128, 1, 1, { 4, 12 }, 2, 3, 32, 100, 1 },
        { "p8-hd128-rep1-decode-long", p8_128, 1, 1, { 20, 11 }, 0, 3, 32, 7, 3 },
        { "tiers-hd64-rep3-decode", tier_64, 3, 1, { 9, 4 }, 0, 3, 32, 60, 2 },
        { "tiers-hd64-rep3-chunk3", tier_64, 3, 3, { 5, 2 }, 0, 3, 32, 20, 3 },
        { "tiers-hd128-rep1-decode", tier_128, 1, 1, { 9, 4 }, 0, 3, 32, 40, 3 },
        { "tiers-hd128-rep2-chunk2", tier_128, 2, 2, { 6, 3 }, 2, 3, 32, 30, 2 },
        { "tiers-hi-only-hd128-decode", hi_only_128, 1, 1, { 5, 2 }, 0, 3, 32, 10, 1 },
        { "tiers-lo-only-hd64-b32-rep7", lo_only_64, 7, 2, { 11, 5 }, 2, 0, 0, 7, 3 },
        { "tiers-hd256-b16-decode", tier_b16_256, 1, 1, { 20, 3 }, 0, 2, 5, 5, 4 },
        { "sym-tiers-hd128-rep1-decode", sym_tiers_128, 1, 1, { 9, 4 }, 0, 3, 32, 40, 3 },
        { "sym-p16-hd64-rep3-chunk2", sym_64, 3, 2, { 6, 3 }, 2, 3, 32, 20, 2 },
        { "recent1-kivi2-hd64-rep2-chunk3", kivi2_64, 2, 3, { 4, 1 }, 0, 0, 0, 100, 2, 1 },
        { "recent2-sym-tiers-hd128-rep1-decode", sym_tiers_128, 1, 1, { 9, 4 }, 0, 3, 32, 40, 3, 2 },
        { "recent5-ottr2tr-hd64-rep3-decode", ottr2tr_64, 3, 1, { 9, 3 }, 0, 3, 32, 60, 2, 5 },
        { "recent5-ottr2tr-hd128-rep2-chunk2", ottr2tr_128, 2, 2, { 7, 0 }, 2, 3, 32, 30, 2, 5 },
        { "recent5-ottr2tg-hd128-rep1-decode", sym_tiers_128, 1, 1, { 9, 6 }, 0, 3, 0, 40, 3, 5 },
        { "ott4-hd128-rep1-chunk3", ott4_128, 1, 3, { 5, 2 }, 0, 3, 32, 20, 2 },
        { "kivi4-hd128-rep2-decode", kivi4_128, 2, 1, { 6, 3 }, 0, 0, 0, 50, 2 },
        // keys before RoPE: ottr2tr (SmolLM2's shape, Qwen2.5's with NeoX pairs, the 7B shape),
        // other head sizes and groups, 8-bit codes
        { "rope-ottr2tr-hd64-rep3-decode", ottr2tr_64, 3, 1, { 9, 3 }, 0, 3, 0, 60, 2, 5, 1 },
        { "rope-ottr2tr-hd64-rep7-chunk2-neox", ottr2tr_64, 7, 2, { 8, 5 }, 0, 3, 0, 30, 3, 5, 2 },
        { "rope-ottr2tr-hd128-rep1-decode", ottr2tr_128, 1, 1, { 9, 6 }, 0, 3, 0, 40, 3, 5, 1 },
        { "rope-ottr2tr-hd128-rep2-chunk3-neox", ottr2tr_128, 2, 3, { 7, 2 }, 2, 3, 32, 30, 2, 5, 2 },
        { "rope-tiers-hd256-b16-decode-neox", tier_b16_256, 1, 1, { 20, 3 }, 0, 2, 5, 5, 4, 0, 2 },
        { "rope-small2-hd64-rep7-chunk2", small2, 7, 2, { 11, 5 }, 2, 2, 5, 7, 3, 0, 1 },
        { "rope-small8-hd64-rep3-chunk3-neox", small8, 3, 3, { 7, 0 }, 2, 2, 5, 4, 2, 0, 2 },
        { "rope-kivi4-hd128-rep2-decode-neox", kivi4_128, 2, 1, { 6, 3 }, 0, 0, 0, 50, 2, 0, 2 },
    };
    for (const attn_case & c : attns) {
        // the recent blocks' launch both ways: a warp per head-block (many multiprocessors), a
        // block per tile (one)
        for (const int32_t n_sm : { INT32_MAX, 1 }) {
            if (n_sm == 1 && !c.recent) continue;
            check_attn(c, seed, 0, n_sm, n_fail);
            if (!c.rope && ott_cuda_attn_uses_tensor_cores(c.g, std::min(c.n_q * c.n_rep, OTT_CUDA_ATTN_ROWS), 1)) {
                check_attn(c, seed, 1, n_sm, n_fail);
            }
        }
        check_gather(c, seed, n_fail);
        ++seed;
    }
    const kvq_case kvqs[] = {
        { "kvquant2-hd64-b32-1pct", { 64, 32, 2, 2, 0 }, 100, 3, 5, 9, 3, 0 },
        { "kvquant3-hd64-b32-1pct-neox", { 64, 32, 3, 3, 0 }, 100, 2, 4, 33, 7, 1 },
        { "kvquant4-hd128-b32-2.5pct", { 128, 32, 4, 4, 0 }, 250, 2, 3, 5, 1, 0 },
        { "kvquant2-hd128-b64-0pct", { 128, 64, 2, 2, 0 }, 0, 4, 2, 2, 16, 1 },
        { "kvquant3-hd64-b16-k3v2", { 64, 16, 3, 2, 0 }, 100, 2, 6, 40, 2, 0 },
        { "kvquant2-hd128-b32-splits", { 128, 32, 2, 2, 0 }, 100, 3, 48, 21, 1, 1 },
        { "kvquant3-hd256-b32-splits-5rows", { 256, 32, 3, 3, 0 }, 100, 2, 40, 37, 5, 0 },
        { "kvquant4-hd64-b96-splits-gqa", { 64, 96, 4, 4, 0 }, 200, 2, 12, 70, 16, 1 },
    };
    for (const kvq_case & c : kvqs) check_kvq(c, seed++, n_fail);
    printf("%d case(s) failed\n", n_fail);
    return n_fail == 0 ? 0 : 1;
}

// ---- perf ---------------------------------------------------------------------------------------

// Median of reps timings of fn (ms), after warm-up. Each timing is preceded by before(),
// queued and not timed: fn's launches are queued while it runs (the host's launch latency is
// not timed), and fn starts right after it, as in a stream of decode work.
template <typename F, typename B> float time_ms(F fn, int reps, B before) {
    cudaEvent_t a, b;
    CHECK_CUDA(cudaEventCreate(&a));
    CHECK_CUDA(cudaEventCreate(&b));
    for (int i = 0; i < 3; ++i) fn();
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) {
        before();
        CHECK_CUDA(cudaEventRecord(a));
        fn();
        CHECK_CUDA(cudaEventRecord(b));
        CHECK_CUDA(cudaEventSynchronize(b));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    CHECK_CUDA(cudaEventDestroy(a));
    CHECK_CUDA(cudaEventDestroy(b));
    return t[t.size() / 2];
}

// KVQuant's attention (kvquant2, keys before RoPE, 1 % outliers) over one layer of the same
// 7B shape: ctx tokens per sequence in blocks of 32 (the last partial block's rows in fp16),
// B sequences; head-blocks quantized from random keys and values, then repeated.
void perf_kvq(int ctx, int B, double copy_gbs) {
    const int32_t H = 32, hd = 128, block = 32, n_blocks = ctx / block, n_fp = ctx - n_blocks * block + 1;
    const ott_kvq_geom g         = { hd, block, 2, 2, ott_kvq_n_out(100, block, hd) };
    const ott_kvq_block_layout L = ott_kvq_block_layout_of(&g);
    const int32_t n_src          = 64;  // distinct head-blocks
    std::vector<void *> mem;
    rng_t rng(13);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    auto normal_f16 = [&](size_t n) {
        std::vector<ott_fp16> x(n);
        for (ott_fp16 & h : x) h = ott_fp32_to_fp16_ref(nd(rng));
        return x;
    };
    std::vector<float> zero(hd, 0.0f), scale(hd, 2.0f), lev = { -1.0f, -0.3f, 0.3f, 1.0f };
    const ott_kvq_tables tab = { upload_to(mem, zero), upload_to(mem, scale), upload_to(mem, lev),
                                 upload_to(mem, lev) };
    const std::vector<ott_kvq_tables> tabs((size_t)B * H, tab);
    uint8_t * src                     = upload_to(mem, std::vector<uint8_t>((size_t)n_src * L.size, 0));
    const ott_kvq_tables * d_src_tabs = upload_to(mem, std::vector<ott_kvq_tables>(n_src, tab));
    const ott_fp16 *src_k             = upload_to(mem, normal_f16((size_t)n_src * block * hd)),
                   *src_v             = upload_to(mem, normal_f16((size_t)n_src * block * hd));
    uint8_t * ev_scratch              = upload_to(mem, std::vector<uint8_t>(ott_cuda_kvq_event_scratch(g) * n_src, 0));
    auto event                        = [&](int32_t n) {
        CHECK_CUDA(ott_cuda_kvq_event(g, d_src_tabs, src_k, src_v, n, src, ev_scratch, nullptr));
    };
    event(n_src);
    if (B == 1)  // an event round of one sequence (a block in each KV head) and of 64 KV heads' blocks
        for (const int32_t n : { H, n_src })
            printf("{\"op\": \"kvq_event\", \"blocks\": %d, \"ms\": %.4f}\n", n, time_ms([&] { event(n); }, 20, [] {}));
    const size_t n_hb = (size_t)B * H * n_blocks;
    auto layer        = [&]() {  // head-blocks, fp16 rows and stores of one layer
        uint8_t * blocks = upload_to(mem, std::vector<uint8_t>(std::max<size_t>(n_hb * L.size, 1), 0));
        for (size_t i = 0; i < n_hb; ++i)
            CHECK_CUDA(cudaMemcpy(blocks + i * L.size, src + (i % n_src) * L.size, L.size, cudaMemcpyDeviceToDevice));
        const ott_fp16 * fk = upload_to(mem, normal_f16((size_t)B * H * n_fp * hd));
        std::vector<int32_t> pos((size_t)n_fp);
        for (int32_t i = 0; i < n_fp; ++i) pos[i] = i == 0 ? 0 : 1 + n_blocks * block + i - 1;
        const int32_t * d_pos = upload_to(mem, pos);
        std::vector<ott_kvq_head_stores> st((size_t)B * H);
        for (size_t i = 0; i < st.size(); ++i)
            st[i] = { blocks + i * n_blocks * L.size,
                      n_blocks,
                      (int64_t)L.size,
                      1,
                      fk + i * n_fp * hd,
                      fk + i * n_fp * hd,
                      d_pos,
                      n_fp };
        return upload_to(mem, st);
    };
    const ott_kvq_head_stores *a = layer(), *prev = layer();
    std::vector<float> cs((size_t)(ctx + block) * hd);
    ott_rope_table_fill(hd, 10000.0, 1.0, ctx + block, cs.data());
    const ott_rope_table rope     = { hd, 1, ctx + block, upload_to(mem, cs) };
    const ott_kvq_tables * d_tabs = upload_to(mem, tabs);
    std::vector<float> q((size_t)B * H * hd * OTT_CUDA_KVQ_ROWS);  // room for the rows of a prompt's tile
    for (float & x : q) x = nd(rng);
    const float * d_q = upload_to(mem, q);
    float * d_out     = upload_to(mem, q);
    int n_sm          = 1;
    CHECK_CUDA(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0));
    const int32_t chosen = ott_cuda_kvq_attn_splits(g, B * H, 1, ctx, n_sm);
    float * d_parts =
        upload_to(mem, std::vector<float>(std::max<size_t>(1, ott_cuda_kvq_partial_floats(g, B * H, 2 * chosen))));
    const double bytes = (double)n_hb * ott_kvq_block_data_bytes(&g) + (double)B * H * n_fp * hd * 4 + B * H * hd * 4.0;
    for (const int32_t n_splits : { chosen, std::max(1, chosen / 2), 2 * chosen }) {  // the choice, and beside it
        auto attend = [&](const ott_kvq_head_stores * st) {
            CHECK_CUDA(ott_cuda_kvq_attn(g, d_tabs, st, B * H, rope, d_q, 1, 1.0f / std::sqrt((float)hd), n_splits,
                                         d_parts, d_out, nullptr));
        };
        const float ms   = time_ms([&] { attend(a); }, 20, [&] { attend(prev); });
        const double gbs = bytes / (ms * 1e-3) / 1e9;
        printf("{\"op\": \"attn\", \"mode\": \"kvquant2\", \"ctx\": %d, \"batch\": %d, \"n_head_kv\": %d, "
               "\"head_dim\": %d, \"splits\": %d, \"chosen\": %s, \"bytes\": %.0f, \"ms\": %.4f, \"GBps\": %.1f, "
               "\"of_copy\": %.3f}\n",
               ctx, B, H, hd, n_splits, n_splits == chosen ? "true" : "false", bytes, ms, gbs, gbs / copy_gbs);
        fflush(stdout);
    }
    if (B == 1)  // groups of a prompt's rows: 4 (the split kernel) and 16 (tensor cores, where they serve)
        for (const int32_t n_q : { 4, OTT_CUDA_KVQ_ROWS }) {
            const int32_t n_splits = ott_cuda_kvq_attn_splits(g, H, n_q, ctx, n_sm);
            auto attend            = [&](const ott_kvq_head_stores * st) {
                CHECK_CUDA(ott_cuda_kvq_attn(g, d_tabs, st, H, rope, d_q, n_q, 1.0f / std::sqrt((float)hd), n_splits,
                                             d_parts, d_out, nullptr));
            };
            printf("{\"op\": \"attn_rows\", \"mode\": \"kvquant2\", \"ctx\": %d, \"rows\": %d, \"splits\": %d, "
                   "\"tensor_cores\": %s, \"ms\": %.4f}\n",
                   ctx, n_q, n_splits, ott_cuda_kvq_attn_tensor_cores(g, n_q) ? "true" : "false",
                   time_ms([&] { attend(a); }, 20, [&] { attend(prev); }));
            fflush(stdout);
        }
    for (void * p : mem) CHECK_CUDA(cudaFree(p));
}

// contexts: (context, batch); batch 0 = every batch of the table
int run_perf(const std::vector<std::pair<int, int>> & contexts) {
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    // copy bandwidth: bytes read + written
    const size_t n_copy = (size_t)4 << 30;
    void *src, *dst;
    CHECK_CUDA(cudaMalloc(&src, n_copy));
    CHECK_CUDA(cudaMalloc(&dst, n_copy));
    CHECK_CUDA(cudaMemset(src, 1, n_copy));
    const float ms_copy =
        time_ms([&] { CHECK_CUDA(cudaMemcpyAsync(dst, src, n_copy, cudaMemcpyDeviceToDevice)); }, 10, [] {});
    const double copy_gbs = 2.0 * n_copy / (ms_copy * 1e-3) / 1e9;
    printf("{\"op\": \"copy\", \"device\": \"%s\", \"bytes\": %zu, \"ms\": %.4f, \"GBps\": %.1f}\n", prop.name,
           2 * n_copy, ms_copy, copy_gbs);
    CHECK_CUDA(cudaFree(src));
    CHECK_CUDA(cudaFree(dst));

    // attention of one layer of a Llama-2-7B-shaped model (32 KV heads of 128, n_rep 1): ott2,
    // then ottr2 (one value group per head, 8-bit parameters, no fp16 window beyond the block),
    // then ottr3 (ottr2's layout with 4-bit keys), then ottr2 with key tiers (a quarter of the
    // key rows at 4 bits, a half at 1 bit), then ottr2tg's old blocks (those tiers, clipped
    // ranges, symmetric values; its recent blocks not read), then a cache of ottr2tg's recent
    // geometry alone (4-bit keys and values, min-max ranges, symmetric values); then the same
    // two with keys before RoPE, ottr2tr's (its tiers 5 + 10 of 16)
    struct perf_mode {
        const char * name;
        ott_kv_geom g;
        int32_t window;
        bool variants;
        bool rope = false;
    };
    const perf_mode modes[] = { { "ott2", { 128, 128, 2, 2, 128, 64, 0, 16 }, 32, true },
                                { "ottr2", { 128, 128, 2, 2, 128, 128, 0, 8 }, 0, false },
                                { "ottr3", { 128, 128, 4, 2, 128, 128, 0, 8 }, 0, false },
                                { "ottr2-tiers", { 128, 128, 2, 2, 128, 128, 0, 8, 0, 32, 64 }, 0, false },
                                { "ottr2tg-blocks", { 128, 128, 2, 2, 128, 128, 1, 8, 0, 32, 64, 1 }, 0, false },
                                { "ottr2tg-recent", { 128, 128, 4, 4, 128, 128, 0, 8, 0, 0, 0, 1 }, 0, false },
                                { "ottr2tr-blocks", { 128, 128, 2, 2, 128, 128, 1, 8, 0, 40, 80, 1 }, 0, false, true },
                                { "ottr2tr-recent", { 128, 128, 4, 4, 128, 128, 0, 8, 0, 0, 0, 1 }, 0, false, true } };
    const int32_t H = 32, hd = 128, pool = 3, extra = 32;
    for (const perf_mode & mode : modes)
        for (const auto & [ctx, only] : contexts) {
            const ott_kv_geom & g        = mode.g;
            const int32_t window         = mode.window;
            const ott_kv_block_layout BL = ott_kv_block_layout_of(&g);
            for (int B : { 1, 4, 8, 16, 32, 64 }) {
                if (only && B != only) continue;
                const int32_t n_blocks = (ctx - window) / g.block, n_win = ctx - n_blocks * g.block;
                const int32_t win_cap = (n_win + g.block - 1) / g.block * g.block;
                const size_t sh       = (size_t)B * H;
                std::vector<void *> mem;
                auto dalloc = [&](size_t bytes, int fill) {
                    void * p;
                    CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
                    CHECK_CUDA(cudaMemset(p, fill, bytes));
                    mem.push_back(p);
                    return p;
                };
                std::vector<int32_t> full(sh, pool), half(sh, extra / 2);
                std::vector<uint8_t> noise((size_t)64 << 20);
                {
                    rng_t rng(7);
                    for (size_t i = 0; i < noise.size(); i += 8) {
                        const uint64_t x = rng();
                        std::memcpy(&noise[i], &x, 8);
                    }
                }
                std::vector<float> q((size_t)B * H * hd);
                {
                    rng_t rng(11);
                    std::normal_distribution<float> nd(0.0f, 1.0f);
                    for (float & x : q) x = nd(rng);
                }
                std::vector<ott_cuda_attn_tile> tiles;
                for (int32_t s = 0; s < B; ++s) {
                    for (int32_t h = 0; h < H; ++h)
                        tiles.push_back({ s, h, s, 1, 0, 1, 0, n_blocks, n_win, n_blocks * g.block });
                }
                // one layer's stores, queries and tiles; its arguments but the launch choices
                auto make_layer = [&]() {
                    ott_cuda_kv_layer L {};
                    L.geom       = g;
                    L.layout     = BL;
                    L.n_head_kv  = H;
                    L.sink       = 0;
                    L.win_cap    = win_cap;
                    L.pool_cap   = pool;
                    L.extra_cap  = extra;
                    L.max_blocks = n_blocks;
                    if (mode.rope) {
                        std::vector<float2> pairs((size_t)(ctx + g.block) * hd / 2);
                        ott_cuda_rope_pairs_fill(hd, 10000.0, 1.0, ctx + g.block, pairs.data());
                        L.rope = upload_to(mem, pairs);
                    }
                    L.sink_k = L.sink_v = (ott_fp16 *)dalloc(0, 0);
                    // fp16 0x3c3c = 1.06: finite everywhere
                    L.win_k     = (ott_fp16 *)dalloc(sh * win_cap * hd * 2, 0x3c);
                    L.win_v     = (ott_fp16 *)dalloc(sh * win_cap * hd * 2, 0x3c);
                    L.pool_k    = (ott_fp16 *)dalloc(sh * pool * hd * 2, 0x3c);
                    L.pool_v    = (ott_fp16 *)dalloc(sh * pool * hd * 2, 0x3c);
                    L.pool_pos  = (int32_t *)dalloc(sh * pool * 4, 0);
                    L.extra_k   = (ott_fp16 *)dalloc(sh * extra * hd * 2, 0x3c);
                    L.extra_v   = (ott_fp16 *)dalloc(sh * extra * hd * 2, 0x3c);
                    L.extra_pos = (int32_t *)dalloc(sh * extra * 4, 0);
                    L.n_pool    = upload_to(mem, full);
                    L.n_extra   = upload_to(mem, half);
                    L.tracing   = (int32_t *)dalloc(sh * 4, 0);
                    // random codes; then scales and mins 0x2c2c (0.065), so every score is finite, no
                    // mask, and with key tiers each head-block's k_order the identity (a permutation, as
                    // the quantizer writes: the kernels index channels by it)
                    const size_t n_hb = sh * n_blocks, blk_bytes = n_hb * BL.size;
                    L.blocks = (uint8_t *)dalloc(blk_bytes, 0);
                    for (size_t off = 0; off < blk_bytes; off += noise.size()) {
                        CHECK_CUDA(cudaMemcpy(L.blocks + off, noise.data(), std::min(noise.size(), blk_bytes - off),
                                              cudaMemcpyHostToDevice));
                    }
                    if (n_hb) {
                        CHECK_CUDA(cudaMemset2D(L.blocks + BL.k_scale, BL.size, 0x2c, BL.k_codes - BL.k_scale, n_hb));
                        CHECK_CUDA(cudaMemset2D(L.blocks + BL.mask, BL.size, 0, BL.size - BL.mask, n_hb));
                        if (ott_kv_tiered(&g)) {
                            std::vector<uint8_t> order(n_hb * hd);
                            for (size_t i = 0; i < order.size(); ++i) order[i] = (uint8_t)(i % hd);
                            CHECK_CUDA(cudaMemcpy2D(L.blocks + BL.k_order, BL.size, order.data(), hd, hd, n_hb,
                                                    cudaMemcpyHostToDevice));
                        }
                    }
                    ott_cuda_attn_args a {};
                    a.L = L;
                    a.q = { upload_to(mem, q), hd, (int64_t)H * hd };
                    a.k = a.v       = a.q;
                    a.n_rep         = 1;
                    a.kq_scale      = 1.0f / std::sqrt((float)hd);
                    a.traces        = 1;
                    a.tiles         = upload_to(mem, tiles);
                    a.n_tiles       = (int32_t)tiles.size();
                    a.rows_per_tile = 1;
                    return a;
                };
                // the timed layer, and another one whose attention runs just before it: the L2
                // cache then holds none of the timed layer's bytes, as in a decode step
                ott_cuda_attn_args a = make_layer(), prev = make_layer();
                // the cache's choice (kv_quant_cuda.cpp: its split count, tensor cores but for keys
                // before RoPE), then FFMA decoding at two prefetch depths and other split counts
                const int n_sm   = prop.multiProcessorCount;
                const int tc     = mode.rope ? 0 : 1;
                const int chosen = ott_cuda_attn_splits(g, 1, tc, a.n_tiles, n_sm, n_blocks);
                const int ffma   = ott_cuda_attn_splits(g, 1, 0, a.n_tiles, n_sm, n_blocks);
                struct variant {
                    int splits, prefetch, tc;
                };
                std::vector<variant> variants = { { chosen, 0, tc } };
                if (tc) variants.push_back({ ffma, 0, 0 });
                if (mode.variants) variants.push_back({ ffma, 16, 0 });
                for (int sp : { 1, 2, 4, 8, 16, 32 }) {
                    if (mode.variants && sp != chosen && sp <= std::max(1, n_blocks / 4))
                        variants.push_back({ sp, 0, 1 });
                }
                int most = 0;
                for (const auto & v : variants) most = std::max(most, v.splits);
                float * dout             = (float *)dalloc(q.size() * 4, 0);
                const size_t part_floats = tiles.size() * (size_t)most * OTT_CUDA_ATTN_ROWS * ott_cuda_partial_row(hd);
                a.partials               = (float *)dalloc(part_floats * 4, 0);
                prev.partials            = (float *)dalloc(part_floats * 4, 0);
                const auto attend        = [&](const ott_cuda_attn_args & x) {
                    CHECK_CUDA(ott_cuda_attn_partial(x, nullptr));
                    CHECK_CUDA(ott_cuda_attn_merge(x, dout, (int64_t)H * hd, nullptr));
                };
                for (const auto & [sp, pf, vtc] : variants) {
                    a.n_splits = prev.n_splits = sp;
                    a.prefetch = prev.prefetch = pf;
                    a.tensor_cores = prev.tensor_cores = vtc;
                    const float ms                     = time_ms([&] { attend(a); }, 20, [&] { attend(prev); });
                    // bytes it must read: head-block data, fp16 rows, queries
                    const double bytes = (double)sh * (n_blocks * (double)ott_kv_block_data_bytes(&g, 1) +
                                                       (double)(n_win + pool + extra / 2) * hd * 2 * 2) +
                                         q.size() * 4.0;
                    const double gbs   = bytes / (ms * 1e-3) / 1e9;
                    printf("{\"op\": \"attn\", \"mode\": \"%s\", \"ctx\": %d, \"batch\": %d, \"n_head_kv\": %d, "
                           "\"head_dim\": %d, "
                           "\"splits\": %d, \"prefetch\": %d, \"tensor_cores\": %d, \"chosen\": %s, \"bytes\": %.0f, "
                           "\"ms\": %.4f, "
                           "\"GBps\": %.1f, \"of_copy\": %.3f}\n",
                           mode.name, ctx, B, H, hd, sp, pf ? pf : 8, vtc,
                           sp == chosen && pf == 0 && vtc == tc ? "true" : "false", bytes, ms, gbs, gbs / copy_gbs);
                    fflush(stdout);
                }
                for (void * p : mem) CHECK_CUDA(cudaFree(p));
            }
        }
    for (const auto & [ctx, only] : contexts)
        for (int B : { 1, 4, 8, 16, 32, 64 })
            if (!only || B == only) perf_kvq(ctx, B, copy_gbs);
    return 0;
}

}  // namespace

int main(int argc, char ** argv) {
    const std::string mode = argc > 1 ? argv[1] : "check";
    int n_dev              = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        fprintf(stderr, "ott-cuda-ops: no CUDA device\n");
        return 3;
    }
    if (mode == "check") return run_checks();
    if (mode == "perf") {
        std::vector<std::pair<int, int>> contexts;  // "CTX" or "CTX:BATCH"
        for (int i = 2; i < argc; ++i) {
            const char * colon = strchr(argv[i], ':');
            contexts.push_back({ atoi(argv[i]), colon ? atoi(colon + 1) : 0 });
        }
        if (contexts.empty()) contexts = { { 4096, 0 }, { 8192, 0 }, { 16384, 0 } };
        return run_perf(contexts);
    }
    fprintf(stderr, "usage: ott-cuda-ops check | perf [context[:batch] ...]\n");
    return 2;
}
