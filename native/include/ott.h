/* ott.h — the only C API of ott-gguf.
 *
 * Every function returns an ott_status; on failure ott_last_error() holds one line that
 * says what failed and where (thread-local, valid until the next call on the thread).
 * Objects come in lifetime pairs: ott_model_load / ott_model_free,
 * ott_context_init / ott_context_free. The library never aborts on bad input.
 */
#ifndef OTT_H
#define OTT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    OTT_OK               = 0,
    OTT_ERR_IO           = 1, /* file missing or unreadable                      */
    OTT_ERR_FORMAT       = 2, /* not a GGUF file, truncated, inconsistent         */
    OTT_ERR_UNSUPPORTED  = 3, /* architecture, tensor type or option we lack      */
    OTT_ERR_INVALID_ARG  = 4, /* bad parameter or batch                          */
    OTT_ERR_CONTEXT_FULL = 5, /* a sequence would exceed n_ctx                   */
    OTT_ERR_ALLOC        = 6, /* out of memory                                   */
    OTT_ERR_BACKEND      = 7, /* ggml backend failure                            */
} ott_status;

const char * ott_last_error(void);

/* ---- model ------------------------------------------------------------------------ */

typedef struct ott_model ott_model;
typedef struct ott_context ott_context;

typedef struct {
    int32_t repack;  /* 1: store matmul weights in a faster CPU layout where the type has
                            one: ggml's repacked layouts, or (x8) this library's; 0: keep
                            the file's layout                                          */
    int32_t x8;      /* with repack, 1: Q4_1 and Q8_0 matrices (tied embeddings too) as 8
                            interleaved rows where the CPU has AVX-512 VNNI, multiplied by
                            this library's kernel with ggml's results bit for bit; 0: not */
    char device[16]; /* "cpu", "cuda", "cuda:N"; "" (default): cuda:0 when this build
                            has CUDA and a GPU is present, else cpu. Weights, graph and KV
                            cache live there; logits come back to the host            */
} ott_model_params;

typedef struct {
    char arch[32]; /* general.architecture: llama, mistral, qwen2, qwen3,
                                   gemma3, phi3                                      */
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t n_embd_head; /* head_dim                                         */
    int32_t n_ff;
    int32_t rope_type; /* 0 = normal (llama), 2 = neox (qwen2 and later)    */
    float rope_freq_base;
    float rope_freq_scale;
    float norm_rms_eps;
    int32_t tied_output; /* 1 when the output projection is token_embd        */
    int64_t n_params;
    int64_t weight_bytes;
    int64_t x8_bytes; /* bytes of them stored as 8 interleaved rows (ott_model_params.x8) */
    char device[16];  /* where the model runs: "cpu" or "cuda:N"           */
    int32_t n_swa;    /* sliding window of the local layers (tokens); 0: every
                                   layer is global (ott_model_layer_window)           */
} ott_model_info;

ott_model_params ott_model_default_params(void);
/* The fingerprint of the model file's tensor data (what a calibration sidecar names as its
 * ott.calib.model_hash; native/src/kv/kv_calib.h defines it). Reads the whole file. */
ott_status ott_model_fingerprint(const ott_model * model, uint64_t * out);
ott_status ott_model_load(const char * path, const ott_model_params * params, ott_model ** out);
void ott_model_free(ott_model * model);
ott_status ott_model_get_info(const ott_model * model, ott_model_info * out);
/* The attention window of layer il: n_swa for a sliding-window (local) layer, 0 for a global
 * one. A context keeps a local layer in an fp16 ring of its window whatever the KV mode, when
 * the window is shorter than the context (else the window masks nothing: the layer is global);
 * the cache's mode applies to the global layers. */
ott_status ott_model_layer_window(const ott_model * model, int32_t il, int32_t * out);

/* GGUF metadata and tensor list of a loaded model, as the loader parsed them (reading
 * them again in Python is slow for 100k-entry vocabularies). Pointers stay valid until
 * ott_model_free. Types are gguf's: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32,
 * 7 bool, 8 string, 9 array, 10 u64, 11 i64, 12 f64. */
typedef struct {
    const char * key;
    int32_t type;      /* value type; 9 for arrays                                 */
    int32_t elem_type; /* arrays: element type                                     */
    int64_t n;         /* arrays: element count; scalars: 1                         */
    const void * data; /* scalars and numeric arrays: raw little-endian values     */
    const char * str;  /* string scalars                                           */
} ott_meta_kv;

ott_status ott_model_meta_count(const ott_model * model, int64_t * out);
ott_status ott_model_meta_get(const ott_model * model, int64_t i, ott_meta_kv * out);
ott_status ott_model_meta_arr_str(const ott_model * model, int64_t i, int64_t j, const char ** out);

typedef struct {
    const char * name;
    const char * type_name; /* ggml type name, e.g. "q4_1"                              */
    int64_t ne[4];          /* ggml shape                                               */
    int64_t n_bytes;
    int64_t file_offset; /* where its data starts in the model file                  */
} ott_tensor_desc;

ott_status ott_model_tensor_count(const ott_model * model, int64_t * out);
ott_status ott_model_tensor_get(const ott_model * model, int64_t i, ott_tensor_desc * out);

/* ---- KV cache modes ------------------------------------------------------------------ */

typedef enum {
    OTT_KV_F16     = 0, /* fp16 cache, ggml flash attention                                */
    OTT_KV_KIVI    = 1, /* quantized blocks + fp16 window (pool = extra_pool = 0)           */
    OTT_KV_OTT     = 2, /* KIVI + Outlier Token Tracing (pool > 0)                          */
    OTT_KV_KVQUANT = 3, /* KVQuant: calibrated per-channel keys (before RoPE), per-token
                           values, codebooks, sparse fp16 outliers (both backends)         */
} ott_kv_type;

/* Knobs of the quantized cache (docs/design.md §2, ott_gguf/reference/config.py); all 0 for
 * OTT_KV_F16. group_v larger than head_dim is capped at head_dim. Invalid combinations
 * make ott_context_init fail with OTT_ERR_INVALID_ARG and one line naming the knob. */
typedef struct {
    int32_t type;             /* ott_kv_type                                             */
    int32_t bits_k;           /* bits per key code: 2, 4 or 8 (KVQuant: 2, 3 or 4)       */
    int32_t bits_v;           /* bits per value code: 2, 4 or 8 (KVQuant: 2, 3 or 4)     */
    int32_t group_k;          /* tokens per key group (one channel), divides block; with
                                 key_axis 1 channels per key group (one token), divides
                                 head_dim (capped at head_dim as group_v)                */
    int32_t group_v;          /* channels per value group (one token), divides head_dim */
    int32_t block;            /* tokens quantized at one event, multiple of 8            */
    int32_t window;           /* R: the fp16 window keeps R .. R+block-1 recent tokens  */
    int32_t pool;             /* outlier-pool tokens per KV head, < block               */
    int32_t extra_pool;       /* extra-pool tokens per KV head                           */
    int32_t skip_layers;      /* layers 0 .. skip_layers-1 do not trace outliers        */
    int32_t sink;             /* first tokens of a sequence kept in fp16                */
    int32_t prefill_fp16;     /* 1: a multi-token chunk's quantization events wait until
                                 the sequence's next single-token step, so a prompt given
                                 in several chunks attends in full precision throughout */
    int32_t clip;             /* 1: each group is quantized over the best of a fixed set of
                                 clipped ranges (least squared error), 0: over min .. max */
    int32_t param_bits;       /* a group's scale and min: 16 (fp16; 0 means 16) or 8 (a ufp8
                                 scale and an int8 min, native/src/kv/kv_layout.h)         */
    int32_t rot_k;            /* rotation of keys (and queries) before the cache: 0 none,
                                 1 Hadamard with fixed signs (head_dim a power of two),
                                 2 calibrated (from calib_path)                           */
    int32_t rot_v;            /* rotation of values, rotated back after attention: same kinds */
    int32_t key_axis;         /* 0: key groups per channel (KIVI); 1: per token, as values
                                 (CPU only: the CUDA cache refuses it)                    */
    const char * calib_path;  /* calibration sidecar GGUF (calibrated rotations); NULL: none.
                                 Read during ott_context_init only                       */
    int32_t pre_rope;         /* 1: keys cached before RoPE, rotated at their position in
                                 attention; 0 after RoPE. Needs a plain RoPE; not with
                                 rot_k. The CUDA cache takes it outside KVQuant where RoPE
                                 turns every channel (n_rot = head_dim)                    */
    int32_t outliers;         /* OTT_KV_KVQUANT: entries per 10000 of a block's keys, and of
                                 its values, kept exactly in fp16 (0 .. 1000)             */
    const float * kvq_tables; /* OTT_KV_KVQUANT: the calibrated tables, per layer il in
                                 order: k_lo, k_hi [n_head_kv][head_dim] (the key
                                 thresholds), levels_k [2^bits_k], levels_v [2^bits_v]
                                 (ascending codebooks). Read during ott_context_init only */
    int32_t hi_k;             /* key tiers (ott_gguf/reference/block.py): of every 16 channels
                                 of a head-block, ranked by range, hi_k are coded with 4 bits */
    int32_t lo_k;             /* ... and the last lo_k with 1 bit; needs bits_k 2, key_axis 0,
                                 group_k = block, head_dim a multiple of 16 up to 256
                                 (both backends; the preset ottr2t uses 4 and 8)          */
    const float * tier_scale; /* key tiers: the query scale u that weighs each channel's
                                 range in the ranking, [n_layer][n_head_kv][head_dim],
                                 each in 0 .. 1e30 (ott_gguf/tier_scale.py); NULL: all 1.
                                 Read during ott_context_init only                       */
    int32_t recent;           /* the newest `recent` blocks (0 .. 64) hold 4-bit keys and
                                 values in the cache's groups (min-max ranges, no tiers);
                                 a block is re-coded to the cache's codes when it ages out
                                 (ott_gguf/reference/cache.py). bits_k, bits_v <= 4, not
                                 KVQuant; both backends                                    */
    int32_t sym_v;            /* 1: value groups symmetric around zero, their scale alone
                                 stored (ott_gguf/reference/quant.py); not KVQuant; both
                                 backends                                                  */
} ott_kv_params;

/* ---- context ------------------------------------------------------------------------- */

typedef struct {
    int32_t n_ctx;     /* tokens per sequence; <= 0: the model's n_ctx_train      */
    int32_t n_seq_max; /* sequences that may be live at once                      */
    int32_t n_ubatch;  /* tokens per graph evaluation                             */
    int32_t n_threads; /* <= 0: physical cores                                    */
    ott_kv_params kv;
} ott_context_params;

ott_context_params ott_context_default_params(void);
ott_status ott_context_init(ott_model * model, const ott_context_params * params, ott_context ** out);
void ott_context_free(ott_context * ctx);
ott_status ott_context_set_threads(ott_context * ctx, int32_t n_threads);

/* A batch of tokens, each with its position and sequence. Positions of one sequence must
 * continue that sequence exactly (its current length, then +1 ...). Tokens with
 * logits[i] != 0 produce a row of logits, in batch order. */
typedef struct {
    int32_t n_tokens;
    const int32_t * token;  /* [n_tokens] */
    const int32_t * pos;    /* [n_tokens] */
    const int32_t * seq_id; /* [n_tokens] */
    const int8_t * logits;  /* [n_tokens]; NULL: only the last token                   */
} ott_batch;

ott_status ott_decode(ott_context * ctx, const ott_batch * batch);

/* Logits of the last ott_decode: F32 [n_outputs, n_vocab], row-major. */
ott_status ott_get_logits(ott_context * ctx, const float ** out, int32_t * n_outputs);

/* Sequence state. */
ott_status ott_seq_len(const ott_context * ctx, int32_t seq_id, int32_t * out);
/* n_keep = 0 clears. A quantized cache cannot undo quantization: it keeps n_keep tokens
 * only when every dropped token is still in the fp16 window (else OTT_ERR_UNSUPPORTED). */
ott_status ott_seq_truncate(ott_context * ctx, int32_t seq_id, int32_t n_keep);
/* Make sequence dst a copy of sequence src (dst's tokens are dropped): a prompt decoded once
 * and continued in several sequences. OTT_ERR_UNSUPPORTED for a cache mode that cannot. */
ott_status ott_seq_copy(ott_context * ctx, int32_t src, int32_t dst);

typedef struct {
    int64_t bytes_allocated;      /* KV bytes allocated now, all layers and sequences   */
    int64_t bytes_used;           /* KV bytes holding live tokens                       */
    int64_t n_tokens;             /* live tokens summed over sequences                  */
    double bytes_per_token_layer; /* bytes per token per layer, everything counted      */
    double bits_per_element;      /* average bits per K or V element                    */
} ott_kv_stats;

ott_status ott_get_kv_stats(const ott_context * ctx, ott_kv_stats * out);

/* Bytes a context of these params allocates at most for the KV cache of each of its
 * sequences, on the model's backend (n_ctx 0: the trained context; n_seq_max and n_threads
 * are not read): what to plan memory with. The footprint counts the data alone; a context
 * adds a few tables it shares between sequences. Needs neither KVQuant's tables nor a
 * calibration sidecar. */
ott_status ott_kv_seq_bytes(const ott_model * model, const ott_context_params * params, int64_t * out);

/* Where a context's compute time goes, by kind of graph node, summed over the ubatches
 * computed since ott_set_profile(ctx, 1) (which resets it). While on, each step runs as
 * several smaller graphs (one per run of nodes of one kind), so whole steps get slower:
 * time steps with profiling off. CPU backend only. */
typedef struct {
    double attn_ms;   /* attention over the cache: nodes named kq* (ggml's flash attention,
                             or its matrix products and softmax; our fused attention and merge) */
    double append_ms; /* new tokens into the cache, quantization events: kv_append*     */
    double rotate_ms; /* rotations of queries, keys, values and outputs: kv_rot*      */
    double other_ms;  /* everything else: projections, FFN, norms, output head          */
    int64_t n_ubatches;
} ott_profile;

/* on = 1: reset the counters and profile from now on; 0: stop (the counters stay).
 * OTT_ERR_UNSUPPORTED on a GPU context. */
ott_status ott_set_profile(ott_context * ctx, int32_t on);
ott_status ott_get_profile(const ott_context * ctx, ott_profile * out);

/* Tokens sequence seq_id can take until the next quantization event fires (the event
 * fires after the last of them); 0 when the cache never quantizes. Feeding a sequence in
 * chunks of exactly this size (each chunk one ott_decode call, n_ubatch >= the chunk)
 * makes every token see the cache it would see in token-by-token decoding. */
ott_status ott_seq_tokens_until_event(const ott_context * ctx, int32_t seq_id, int32_t * out);

/* The raw stores of one KV head of one layer of one sequence. Counts are always filled;
 * each non-NULL buffer receives a copy of its store. The fp16 cache has every token in its
 * window (and no other store). fp16
 * values are IEEE binary16 bit patterns. Head-blocks are in native/src/kv/kv_layout.h's
 * layout (the arrays of ott_gguf/reference/block.py at the offsets block_offsets). */
typedef struct {
    int32_t n_tokens; /* tokens of the sequence                                   */
    int32_t n_sink;
    int32_t n_blocks; /* quantized blocks; block j holds positions
                                 n_sink + j*block ..                                      */
    int32_t n_pool;
    int32_t n_extra;
    int32_t n_window;         /* window positions: n_tokens - n_window ..                 */
    int32_t tracing;          /* 1 while this head still runs Outlier Token Tracing       */
    int32_t block_bytes;      /* bytes of one head-block                                  */
    int32_t block_offsets[8]; /* byte offsets of k_scale, k_min, v_scale, v_min, k_codes,
                                 v_codes, mask, k_order inside a head-block               */
    uint8_t * blocks;         /* [n_blocks - n_recent][block_bytes]                       */
    uint16_t * sink_k;        /* fp16 [n_sink][head_dim], likewise sink_v                 */
    uint16_t * sink_v;
    uint16_t * pool_k; /* fp16 [n_pool][head_dim], ascending position              */
    uint16_t * pool_v;
    int32_t * pool_pos; /* [n_pool]                                                 */
    uint16_t * extra_k; /* fp16 [n_extra][head_dim], in eviction order              */
    uint16_t * extra_v;
    int32_t * extra_pos; /* [n_extra]                                                */
    uint16_t * window_k; /* fp16 [n_window][head_dim], ascending position            */
    uint16_t * window_v;
    int32_t n_recent;          /* the last n_recent of the n_blocks blocks are recent ones
                                  (ott_kv_params.recent), in their own layout; `blocks`
                                  holds the n_blocks - n_recent others                    */
    int32_t recent_bytes;      /* bytes of one recent head-block                          */
    int32_t recent_offsets[8]; /* as block_offsets, in a recent head-block                */
    uint8_t * recent;          /* [n_recent][recent_bytes]                                */
} ott_kv_head_state;

ott_status ott_kv_export(const ott_context * ctx, int32_t il, int32_t seq_id, int32_t head, ott_kv_head_state * out);

/* Physical cores of this machine (the default thread count). */
int32_t ott_physical_cores(void);

/* CUDA devices this build can run on: 0 when it was built without CUDA or no GPU is present. */
int32_t ott_cuda_device_count(void);

/* How the CPU attention of a quantized cache multiplies 1-, 2- and 4-bit codes, for the whole
 * process: on = 1 (the default where the CPU has AVX-512 VNNI) by 16-bit integer
 * multiply-adds, q·scale and p·scale in fixed point (error: 2^-15 of each query row's
 * largest term per head-block); 0 in float; < 0 leaves it as it is. OTT_ERR_UNSUPPORTED for 1
 * where the CPU lacks them. *out (may be NULL) gets the setting now in effect. */
ott_status ott_set_cpu_int_dots(int32_t on, int32_t * out);

/* Which kernels multiply the weights stored as 8 interleaved rows (ott_model_params.x8), for
 * the whole process: vnni = 1 (the default where the CPU has AVX-512 VNNI) AVX-512 VNNI's, 0
 * AVX2's; both give ggml's products bit for bit. < 0 leaves it as it is. OTT_ERR_UNSUPPORTED
 * for 1 where the CPU lacks AVX-512 VNNI. *out (may be NULL) gets the setting now in effect. */
ott_status ott_set_cpu_x8_vnni(int32_t vnni, int32_t * out);

#ifdef __cplusplus
}
#endif

#endif /* OTT_H */
