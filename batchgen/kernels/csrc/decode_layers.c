/*
 * A decode step's decoder layers in one call: the same kernels, with the same arguments and in
 * the same order, as `fused_decoder.FusedDecoder.forward` calls them one by one from Python for
 * a Llama-shaped layer (bf16 or W8A8 int8 products, over a bf16 or an int8 K/V pool), so the
 * results are the same bits.
 * It adds no arithmetic of its own: it saves the Python, ctypes and allocation work of some nine
 * calls a layer, which beside the kernels costs several times its own time (docs/performance.md).
 *
 *   bg_decode_layers   runs `num_layers` layers of a step over `step`'s buffers; returns the first
 *                      status other than STATUS_OK that a kernel returns (nothing after it runs),
 *                      else STATUS_OK
 *
 * The kernels come as function pointers (`Kernels`; the pool's store and decode kernels in
 * `Step`), taken from their own libraries (decoder_ops.c, int8_gemm.c, bf16_gemm.c,
 * kv_int8_attention.c, amx_attention.c or paged_attention.c), each built with its own flags.
 *
 * Per layer, with x the residual rows and n the normed rows (n holds the first layer's attention
 * norm of x on entry, and leaves with the final norm of x), each product bf16 or int8 as its
 * weight is:
 *   qkv = (n, qkv); rotate q into heads and k into keys, storing k and v at the step's slots of
 *   a bf16 pool (of a scratch pool for an int8 one, then quantized into it from keys and qkv);
 *   attended = decode attention of heads over the pool; out = (attended, o);
 *   x += out, n = mlp_norm(x); hidden = act(gate) * up of (n, mlp_in) (the int8 product applies
 *   it, else the layer's activation pass); out = (hidden, mlp_out);
 *   x += out, n = next_norm(x) (the next layer's attention norm, or the final norm).
 */
#include <stdint.h>

#include "attention_kernel.h"

typedef void (*AddRmsNorm)(void *out, void *residual, const void *x, const void *weight, int num_rows, int hidden,
                           float eps, int dtype, int num_threads);
typedef void (*Int8Linear)(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const float *smoothing,
                           int8_t *q, float *x_scales, int64_t k_padded, const int8_t *weight, const float *w_scales,
                           const int32_t *compensation, const uint16_t *bias, int64_t n, int gated, int split,
                           uint16_t *out, int num_threads);
typedef void (*Bf16Linear)(const uint16_t *x, int64_t m, int64_t k, const uint16_t *weight, const uint16_t *bias,
                           int64_t n, uint16_t *out, int num_threads);
typedef void (*GatedActivation)(void *out, const void *gate_up, int num_rows, int width, int dtype, int num_threads);
typedef void (*RopeWriteKv)(void *q_out, void *k_out, void *k_cache, void *v_cache, const void *qkv, const void *cos,
                            const void *sin, const int64_t *slots, int num_tokens, int num_heads, int num_kv_heads,
                            int head_dim, int rotary_dim, const float *q_norm, const float *k_norm, int norm_width,
                            int norm_kind, float eps, int dtype, int num_threads);
typedef int (*KvStore)(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride, int8_t *k_cache,
                       int8_t *v_cache, const int64_t *slots, int num_tokens, int num_kv_heads, int head_dim,
                       int64_t num_slots, int num_threads);
typedef int (*DecodeAttention)(uint16_t *out, const uint16_t *q, const int8_t *k_cache, const int8_t *v_cache,
                               const int32_t *block_tables, const int32_t *context_lens, const int32_t *groups,
                               int num_groups, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                               int num_blocks, int block_size, int max_blocks, float scale, int num_threads);

typedef struct {
    AddRmsNorm add_rms_norm;
    Int8Linear int8_linear; /* each 0 where the layers have no product of its kind */
    Bf16Linear bf16_linear;
    RopeWriteKv rope_write_kv;
} Kernels;

enum { PRODUCT_BF16 = 0, PRODUCT_INT8 = 1 };

/* One product's weight, as bf16_gemm.linear or int8_gemm.linear passes it. */
typedef struct {
    int kind;               /* PRODUCT_* */
    const float *smoothing; /* int8; none: 0 */
    const void *panels;
    const float *scales; /* int8 */
    const int32_t *compensation;
    const uint16_t *bias; /* none: 0 */
    int64_t in_features, padded_inputs, out_features;
    int gated; /* int8: int8_gemm.c's GATED_* */
} Product;

typedef struct {
    const void *weight; /* bf16 */
    float eps;
} Norm;

/* A layer's constants. */
typedef struct {
    Product qkv, o, mlp_in, mlp_out;
    Norm mlp_norm, next_norm;
    GatedActivation activation;   /* of mlp_in's rows; 0 where its product applies it */
    const float *q_norm, *k_norm; /* none: 0 */
    int qk_norm_width, qk_norm_kind;
    float qk_norm_eps, scale;
} Layer;

/* A layer's part of the step: its pool and its rotation's tables. */
typedef struct {
    void *k_cache, *v_cache;
    const void *cos, *sin;
    int64_t rotary_dim;
} LayerStep;

typedef struct {
    AttentionKernel *float_decode; /* a bf16 pool's decode kernel; 0: an int8 pool */
    KvStore kv_store;              /* an int8 pool's store and decode kernels; 0: a bf16 pool */
    DecodeAttention int8_decode;
    uint16_t *residual, *normed, *qkv, *heads, *keys, *attended, *gate_up, *hidden, *out; /* bf16 rows */
    void *scratch_k, *scratch_v;                                              /* one slot per row */
    int8_t *quantized;                                                        /* int8_gemm's rows */
    const int64_t *scratch_slots, *slots;
    const int32_t *block_tables, *context_lens, *groups;
    const LayerStep *layers;
    int64_t rows, num_slots; /* rows: the padded row count every product runs */
    int num_tokens, num_groups, num_heads, num_kv_heads, head_dim, hidden_size;
    int num_blocks, block_size, max_blocks, num_threads;
} Step;

static void product(const Kernels *kernels, const Step *step, const Product *weight, const uint16_t *x,
                    uint16_t *out) {
    if (weight->kind == PRODUCT_BF16) {
        kernels->bf16_linear(x, step->rows, weight->in_features, weight->panels, weight->bias, weight->out_features,
                             out, step->num_threads);
        return;
    }
    int8_t *quantized = step->quantized;
    kernels->int8_linear(x, weight->in_features, step->rows, weight->in_features, weight->smoothing, quantized,
                         (float *)(quantized + step->rows * weight->padded_inputs), weight->padded_inputs,
                         weight->panels, weight->scales, weight->compensation, weight->bias, weight->out_features,
                         weight->gated, 0, out, step->num_threads);
}

static void add_norm(const Kernels *kernels, const Step *step, const uint16_t *x, Norm norm) {
    kernels->add_rms_norm(step->normed, step->residual, x, norm.weight, (int)step->rows, step->hidden_size, norm.eps,
                          DTYPE_BF16, step->num_threads);
}

/* Rotate the step's q|k|v and store its K/V, then attend: a bf16 pool's K/V rows go to their
 * slots at once; an int8 pool's through a scratch pool of one slot per row, then quantized into
 * their slots from `keys` and qkv's values. */
static int attention(const Kernels *kernels, const Step *step, const Layer *layer, const LayerStep *pool) {
    const int num_heads = step->num_heads, num_kv_heads = step->num_kv_heads, head_dim = step->head_dim;
    const int is_float_pool = step->float_decode != 0;
    kernels->rope_write_kv(step->heads, step->keys, is_float_pool ? pool->k_cache : step->scratch_k,
                           is_float_pool ? pool->v_cache : step->scratch_v, step->qkv, pool->cos, pool->sin,
                           is_float_pool ? step->slots : step->scratch_slots, step->num_tokens, num_heads,
                           num_kv_heads, head_dim, (int)pool->rotary_dim, layer->q_norm, layer->k_norm,
                           layer->qk_norm_width, layer->qk_norm_kind, layer->qk_norm_eps, DTYPE_BF16,
                           step->num_threads);
    if (is_float_pool)
        return step->float_decode(step->attended, step->heads, pool->k_cache, pool->v_cache, step->block_tables,
                                  step->context_lens, 0, 0, step->groups, step->num_tokens, step->num_groups,
                                  num_heads, num_kv_heads, head_dim, step->num_blocks, step->block_size,
                                  step->max_blocks, layer->scale, 0, 0.0f, 0, DTYPE_BF16, step->num_threads);
    const int64_t qkv_width = (int64_t)(num_heads + 2 * num_kv_heads) * head_dim;
    const int status = step->kv_store(step->keys, (int64_t)num_kv_heads * head_dim,
                                      step->qkv + (int64_t)(num_heads + num_kv_heads) * head_dim, qkv_width,
                                      pool->k_cache, pool->v_cache, step->slots, step->num_tokens, num_kv_heads,
                                      head_dim, step->num_slots, step->num_threads);
    if (status != STATUS_OK) return status;
    return step->int8_decode(step->attended, step->heads, pool->k_cache, pool->v_cache, step->block_tables,
                             step->context_lens, step->groups, step->num_groups, step->num_tokens, num_heads,
                             num_kv_heads, head_dim, step->num_blocks, step->block_size, step->max_blocks,
                             layer->scale, step->num_threads);
}

/* out = the MLP of the normed rows: the gated product's act(gate) * up (its own, or the layer's
 * activation pass over gate|up rows), then the down product. */
static void mlp(const Kernels *kernels, const Step *step, const Layer *layer) {
    if (layer->activation != 0) {
        product(kernels, step, &layer->mlp_in, step->normed, step->gate_up);
        layer->activation(step->hidden, step->gate_up, (int)step->rows, (int)layer->mlp_out.in_features, DTYPE_BF16,
                          step->num_threads);
    } else {
        product(kernels, step, &layer->mlp_in, step->normed, step->hidden);
    }
    product(kernels, step, &layer->mlp_out, step->hidden, step->out);
}

int bg_decode_layers(const Kernels *kernels, const Step *step, const Layer *layers, int num_layers) {
    for (int index = 0; index < num_layers; index++) {
        const Layer *layer = &layers[index];
        product(kernels, step, &layer->qkv, step->normed, step->qkv);
        int status = attention(kernels, step, layer, &step->layers[index]);
        if (status != STATUS_OK) return status;
        product(kernels, step, &layer->o, step->attended, step->out);
        add_norm(kernels, step, step->out, layer->mlp_norm);
        mlp(kernels, step, layer);
        add_norm(kernels, step, step->out, layer->next_norm);
    }
    return STATUS_OK;
}
