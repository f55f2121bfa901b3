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
    OTT_ERR_IO           = 1,  /* file missing or unreadable                      */
    OTT_ERR_FORMAT       = 2,  /* not a GGUF file, truncated, inconsistent         */
    OTT_ERR_UNSUPPORTED  = 3,  /* architecture, tensor type or option we lack      */
    OTT_ERR_INVALID_ARG  = 4,  /* bad parameter or batch                          */
    OTT_ERR_CONTEXT_FULL = 5,  /* a sequence would exceed n_ctx                   */
    OTT_ERR_ALLOC        = 6,  /* out of memory                                   */
    OTT_ERR_BACKEND      = 7,  /* ggml backend failure                            */
} ott_status;

const char * ott_last_error(void);

/* ---- model ------------------------------------------------------------------------ */

typedef struct ott_model   ott_model;
typedef struct ott_context ott_context;

typedef struct {
    int32_t repack;      /* 1: store matmul weights in ggml's repacked CPU layout where the
                            type has one (faster kernels); 0: keep the file's layout    */
} ott_model_params;

typedef struct {
    char     arch[32];          /* general.architecture: llama, mistral, qwen2     */
    int32_t  n_vocab;
    int32_t  n_ctx_train;
    int32_t  n_embd;
    int32_t  n_layer;
    int32_t  n_head;
    int32_t  n_head_kv;
    int32_t  n_embd_head;       /* head_dim                                         */
    int32_t  n_ff;
    int32_t  rope_type;         /* 0 = normal (llama), 2 = neox (qwen2)              */
    float    rope_freq_base;
    float    rope_freq_scale;
    float    norm_rms_eps;
    int32_t  tied_output;       /* 1 when the output projection is token_embd        */
    int64_t  n_params;
    int64_t  weight_bytes;
} ott_model_info;

ott_model_params ott_model_default_params(void);
ott_status ott_model_load(const char * path, const ott_model_params * params, ott_model ** out);
void       ott_model_free(ott_model * model);
ott_status ott_model_get_info(const ott_model * model, ott_model_info * out);

/* GGUF metadata and tensor list of a loaded model, as the loader parsed them (reading
 * them again in Python is slow for 100k-entry vocabularies). Pointers stay valid until
 * ott_model_free. Types are gguf's: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32,
 * 7 bool, 8 string, 9 array, 10 u64, 11 i64, 12 f64. */
typedef struct {
    const char * key;
    int32_t      type;        /* value type; 9 for arrays                                 */
    int32_t      elem_type;   /* arrays: element type                                     */
    int64_t      n;           /* arrays: element count; scalars: 1                         */
    const void * data;        /* scalars and numeric arrays: raw little-endian values     */
    const char * str;         /* string scalars                                           */
} ott_meta_kv;

ott_status ott_model_meta_count(const ott_model * model, int64_t * out);
ott_status ott_model_meta_get(const ott_model * model, int64_t i, ott_meta_kv * out);
ott_status ott_model_meta_arr_str(const ott_model * model, int64_t i, int64_t j, const char ** out);

typedef struct {
    const char * name;
    const char * type_name;   /* ggml type name, e.g. "q4_1"                              */
    int64_t      ne[4];       /* ggml shape                                               */
    int64_t      n_bytes;
} ott_tensor_desc;

ott_status ott_model_tensor_count(const ott_model * model, int64_t * out);
ott_status ott_model_tensor_get(const ott_model * model, int64_t i, ott_tensor_desc * out);

/* ---- KV cache modes ------------------------------------------------------------------ */

typedef enum {
    OTT_KV_F16 = 0,   /* fp16 cache, ggml flash attention                                */
} ott_kv_type;

typedef struct {
    int32_t type;             /* ott_kv_type                                             */
} ott_kv_params;

/* ---- context ------------------------------------------------------------------------- */

typedef struct {
    int32_t       n_ctx;      /* tokens per sequence; <= 0: the model's n_ctx_train      */
    int32_t       n_seq_max;  /* sequences that may be live at once                      */
    int32_t       n_ubatch;   /* tokens per graph evaluation                             */
    int32_t       n_threads;  /* <= 0: physical cores                                    */
    ott_kv_params kv;
} ott_context_params;

ott_context_params ott_context_default_params(void);
ott_status ott_context_init(ott_model * model, const ott_context_params * params, ott_context ** out);
void       ott_context_free(ott_context * ctx);
ott_status ott_context_set_threads(ott_context * ctx, int32_t n_threads);

/* A batch of tokens, each with its position and sequence. Positions of one sequence must
 * continue that sequence exactly (its current length, then +1 ...). Tokens with
 * logits[i] != 0 produce a row of logits, in batch order. */
typedef struct {
    int32_t         n_tokens;
    const int32_t * token;    /* [n_tokens] */
    const int32_t * pos;      /* [n_tokens] */
    const int32_t * seq_id;   /* [n_tokens] */
    const int8_t  * logits;   /* [n_tokens]; NULL: only the last token                   */
} ott_batch;

ott_status ott_decode(ott_context * ctx, const ott_batch * batch);

/* Logits of the last ott_decode: F32 [n_outputs, n_vocab], row-major. */
ott_status ott_get_logits(ott_context * ctx, const float ** out, int32_t * n_outputs);

/* Sequence state. */
ott_status ott_seq_len(const ott_context * ctx, int32_t seq_id, int32_t * out);
ott_status ott_seq_truncate(ott_context * ctx, int32_t seq_id, int32_t n_keep);  /* n_keep = 0 clears */

typedef struct {
    int64_t bytes_allocated;      /* KV bytes allocated now, all layers and sequences   */
    int64_t bytes_used;           /* KV bytes holding live tokens                       */
    int64_t n_tokens;             /* live tokens summed over sequences                  */
    double  bytes_per_token_layer;/* bytes per token per layer, everything counted      */
    double  bits_per_element;     /* average bits per K or V element                    */
} ott_kv_stats;

ott_status ott_get_kv_stats(const ott_context * ctx, ott_kv_stats * out);

/* Physical cores of this machine (the default thread count). */
int32_t ott_physical_cores(void);

#ifdef __cplusplus
}
#endif

#endif /* OTT_H */
