/*
 * The whole decoder of a Llama-family model (every layer, then the final norm) for one decode step, in one
 * C call: bfloat16 activations, INT8/INT4 or bf16 projections, short queries over the paged KV cache.
 *
 * At batch 1 the model's arithmetic is a few milliseconds; the Python and torch dispatch around the ~10
 * kernel calls of each layer (rotary alone is eight small torch ops) costs about as much again. This file
 * runs the same kernels in the same order with the same rounding points, so its result is bit for bit
 * the unfused bfloat16 path's (tests/unit/test_fused_decode.py):
 *
 *   h        = rms_norm(residual += delta)                   fused_ops.c (delta: the previous layer's MLP out)
 *   qkv      = h @ Wqkv.T (+ bias, rounded to bf16)         quant_gemv.c, the bias add torch's bf16 add_; or
 *                                                            dense_gemm.c for unquantized bf16 weights, the
 *                                                            bias added to the float32 sum before rounding
 *   q, k     = qkv[q | k] * cos + rotate_half(qkv[q | k]) * sin, each product and the sum rounded to
 *              bfloat16, cos and sin rounded to bfloat16 first: pdserve/engine/models/rope.py's apply_rotary in torch
 *   cache    <- k, v at the step's slots                     paged_attention.c's pdserve_store_kv
 *   attn     = paged attention of q over the block tables    paged_attention.c
 *   h        = rms_norm(residual += attn @ Wo.T (+ bias))
 *   delta    = (silu(gate) * up)(h @ Wgate_up.T (+ bias)) @ Wdown.T (+ bias)
 *   hidden   = rms_norm(residual += delta) with the final norm's weight
 *
 * With LoRA adapters (pdserve/engine/layers/lora.py), a step whose rows have adapters adds each row's update
 * after each projection's product (and bias), with lora.c's kernel, as the layer-by-layer path's LoRALinear does
 * after its base projection: still bit for bit that path's.
 *
 * The kernels are included, not copied: one implementation of each, the same compiler flags. They come
 * before this file's own code in the order below because fused_ops.c turns floating-point contraction
 * off for everything after it (which the rotary needs too: torch rounds each product).
 */
#include "quant_gemv.c"
#include "dense_gemm.c"
#include "lora.c"
#include "paged_attention.c"
#include "fused_ops.c"

enum projection_kind { PROJECTION_INT8 = 1, PROJECTION_INT4 = 2, PROJECTION_BF16 = 3 };

/* One packed projection, as pdserve/engine/layers/quant_kernels.py (INT8, INT4) or pdserve/engine/layers/dense_kernels.py
 * (bf16) keeps it: see quant_gemv.c's and dense_gemm.c's headers. */
typedef struct {
    int64_t kind;            /* projection_kind */
    const uint8_t *qweight;  /* the kernel's tiles (bf16: its panels) */
    const void *scales;      /* INT8: float32 per padded output row; INT4: float16 (tiles, groups, 16) */
    const uint16_t *minimums; /* INT4 only */
    int64_t group_size;      /* INT4 only */
    const uint16_t *bias;    /* (out_features,) bfloat16, or NULL */
    int64_t out_features;
    int64_t in_features;     /* INT8/INT4: a multiple of 32, the tiles' width; bf16: even */
    int64_t parallel;        /* 1: split over the step's threads (as BoundGemm does above 64 KiB of weight) */
    /* The projection's LoRA slots (LoRALinear's buffers, in lora.c's layouts), or lora_a NULL: none. */
    const void *lora_a;
    const void *lora_b;
    const int64_t *lora_ranks;
    const int64_t *lora_columns;
    int64_t lora_modules;
    int64_t lora_max_rank;
    int64_t lora_weights_bf16;
} pdserve_projection;

/* A step's rows under LoRA adapters (lora_layers.py's LoRARows; lora.c's header). */
typedef struct {
    const int64_t *row_slots;     /* (rows,): each row's slot, -1 none */
    const float *row_scales;      /* (rows,) */
    const int64_t *order;         /* the rows with a slot, grouped by slot */
    const int64_t *group_offsets; /* (groups + 1,) */
    int64_t groups;
} pdserve_lora_rows;

typedef struct {
    const uint16_t *input_norm;  /* (hidden,) bfloat16 */
    const uint16_t *post_norm;   /* (hidden,) bfloat16 */
    float input_eps;
    float post_eps;
    pdserve_projection qkv;      /* (heads + 2 * kv_heads) * head_dim outputs: q, then k, then v */
    pdserve_projection o;
    pdserve_projection gate_up;  /* 2 * intermediate outputs: gate, then up */
    pdserve_projection down;
    void *key_cache;             /* (num_blocks, block_size, kv_heads, head_dim) in kv_kind */
    void *value_cache;
    float *key_scales;           /* int8 KV only: (num_blocks, block_size, kv_heads) */
    float *value_scales;
} pdserve_layer;

typedef struct {
    int64_t num_layers;
    int64_t hidden;
    int64_t heads;
    int64_t kv_heads;
    int64_t head_dim;
    int64_t intermediate;
    int64_t kv_kind;             /* paged_attention.c's kv_kind */
    int64_t block_size;
    int64_t num_slots;           /* num_blocks * block_size */
    int64_t max_positions;       /* rows of the rotary tables */
    float attn_scale;            /* head_dim ** -0.5, as the attention backend passes it */
    float final_eps;
    const float *cos;            /* (max_positions, head_dim) float32: RotaryEmbedding's tables */
    const float *sin;
    const uint16_t *final_norm;  /* (hidden,) bfloat16 */
    const pdserve_layer *layers; /* num_layers of them */
} pdserve_model;

/* out (rows, out_features) bf16 = x (rows, in_features) bf16 @ W.T, then + bias as torch's bf16 add_ rounds it
 * (bf16 weights: the bias inside the kernel, as the layer-by-layer path's call adds it). */
static int64_t project_base(const pdserve_projection *p, void *out, const void *x, int64_t rows, int64_t threads)
{
    const int64_t used_threads = p->parallel ? threads : 1;
    int64_t status;
    if (p->kind == PROJECTION_BF16) {
        return pdserve_bf16_gemm(out, x, (const uint16_t *)p->qweight, p->bias, rows, p->out_features,
                                 p->in_features, used_threads);
    }
    if (p->kind == PROJECTION_INT8) {
        status = pdserve_int8_gemm(out, x, p->qweight, (const float *)p->scales, rows, p->out_features,
                                   p->in_features, 1, used_threads);
    } else {
        status = pdserve_int4_gemm(out, x, p->qweight, (const uint16_t *)p->scales, p->minimums, p->group_size, rows,
                                   p->out_features, p->in_features, 1, used_threads);
    }
    if (status != 0 || p->bias == NULL) {
        return status;
    }
    uint16_t *values = out;
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < p->out_features; ++i) {
            const int64_t at = r * p->out_features + i;
            values[at] = float_to_bf16(bf16_to_float(values[at]) + bf16_to_float(p->bias[i]));
        }
    }
    return 0;
}

/* project_base, then each row's LoRA update where the step has adapter rows (lora: NULL none). */
static int64_t project(const pdserve_projection *p, const pdserve_lora_rows *lora, void *out, const void *x,
                      int64_t rows, int64_t threads)
{
    const int64_t status = project_base(p, out, x, rows, threads);
    if (status != 0 || lora == NULL || p->lora_a == NULL) {
        return status;
    }
    return pdserve_lora_shrink_expand(out, x, p->lora_a, p->lora_b, p->lora_ranks, p->lora_columns, lora->row_slots,
                                      lora->row_scales, lora->order, lora->group_offsets, lora->groups,
                                      p->lora_modules, p->lora_max_rank, p->in_features, p->out_features, 1,
                                      p->lora_weights_bf16, threads);
}

/*
 * rope.py's apply_rotary in bfloat16: out = x * cos + rotate_half(x) * sin, with cos and sin the float32
 * tables rounded to bfloat16 (RotaryEmbedding.tables), each product rounded to bfloat16 and then the sum.
 * x: the first `num_heads` heads of each row of qkv (rows `qkv_width` elements apart); out: (rows, num_heads,
 * head_dim) contiguous.
 */
static void rotate(uint16_t *out, const uint16_t *qkv, int64_t qkv_width, int64_t rows, int64_t num_heads,
                   int64_t head_dim, const float *cos_table, const float *sin_table, const int64_t *positions)
{
    const int64_t half = head_dim / 2;
    float cos_row[MAX_HEAD_DIM], sin_row[MAX_HEAD_DIM];
    for (int64_t r = 0; r < rows; ++r) {
        const float *cos_at = cos_table + positions[r] * head_dim, *sin_at = sin_table + positions[r] * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) {
            cos_row[i] = bf16_to_float(float_to_bf16(cos_at[i]));
            sin_row[i] = bf16_to_float(float_to_bf16(sin_at[i]));
        }
        for (int64_t h = 0; h < num_heads; ++h) {
            const uint16_t *x = qkv + r * qkv_width + h * head_dim;
            uint16_t *y = out + (r * num_heads + h) * head_dim;
            /* rotate_half: (-x[half:], x[:half]); negating a bfloat16 is exact. Two loops, no branch: vectorised. */
            for (int64_t i = 0; i < half; ++i) {
                const float a = bf16_to_float(float_to_bf16(bf16_to_float(x[i]) * cos_row[i]));
                const float b = bf16_to_float(float_to_bf16(-bf16_to_float(x[i + half]) * sin_row[i]));
                y[i] = float_to_bf16(a + b);
            }
            for (int64_t i = half; i < head_dim; ++i) {
                const float a = bf16_to_float(float_to_bf16(bf16_to_float(x[i]) * cos_row[i]));
                const float b = bf16_to_float(float_to_bf16(bf16_to_float(x[i - half]) * sin_row[i]));
                y[i] = float_to_bf16(a + b);
            }
        }
    }
}

/* Scratch of one step: every intermediate of a layer, bfloat16, reused by every layer. */
typedef struct {
    uint16_t *normed;   /* (rows, hidden) */
    uint16_t *qkv;      /* (rows, (heads + 2 * kv_heads) * head_dim) */
    uint16_t *qk;       /* (rows, (heads + kv_heads) * head_dim), rotated */
    uint16_t *attn;     /* (rows, heads * head_dim) */
    uint16_t *attn_out; /* (rows, hidden) */
    uint16_t *gate_up;  /* (rows, 2 * intermediate) */
    uint16_t *act;      /* (rows, intermediate) */
    uint16_t *delta;    /* (rows, hidden) */
} scratch;

static uint16_t *scratch_take(uint16_t **cursor, int64_t elements)
{
    uint16_t *at = *cursor;
    /* 64-byte steps: each buffer starts on its own cache line. */
    *cursor += (elements + 31) / 32 * 32;
    return at;
}

/*
 * One decode step through every layer and the final norm.
 *   lora           the step's rows under LoRA adapters, or NULL (no row has one, or the model has no LoRA)
 *   residual       (rows, hidden) bfloat16: the token embeddings; updated in place (the residual stream)
 *   hidden_out     (rows, hidden) bfloat16: the final norm's output
 *   positions      (rows,) int64, each < max_positions
 *   slots          (rows,) int64: each token's cache slot
 *   block_tables .. range points, num_ranges, max_blocks: the attention kernel's plan (KernelPlan)
 *   threads        the threads of the projections that split (torch's current count)
 * Returns 0; -1 out of memory; -2 an argument the attention kernels cannot serve; -3 a slot outside the
 * pool; -4 a position outside the rotary tables (the last two checked before anything is written).
 */
int64_t pdserve_fused_decode(const pdserve_model *m, const pdserve_lora_rows *lora, void *residual, void *hidden_out,
                             const int64_t *positions, const int64_t *slots, const int64_t *block_tables,
                             const int64_t *context_lens, const int64_t *query_rows, const int64_t *query_lens,
                             const int64_t *range_points, int64_t num_ranges, int64_t max_blocks, int64_t rows,
                             int64_t threads)
{
    const int64_t d = m->head_dim, heads = m->heads, kv_heads = m->kv_heads;
    const int64_t qkv_width = (heads + 2 * kv_heads) * d, qk_width = (heads + kv_heads) * d;
    for (int64_t r = 0; r < rows; ++r) {
        if (positions[r] < 0 || positions[r] >= m->max_positions) {
            return -4;
        }
        if (slots[r] < 0 || slots[r] >= m->num_slots) {
            return -3;
        }
    }
    const int64_t per_row = m->hidden * 3 + qkv_width + qk_width + heads * d + 3 * m->intermediate;
    uint16_t *memory = aligned_alloc(64, (size_t)(rows * per_row + 8 * 32) * sizeof(uint16_t) / 64 * 64 + 64);
    if (memory == NULL) {
        return -1;
    }
    uint16_t *cursor = memory;
    scratch s;
    s.normed = scratch_take(&cursor, rows * m->hidden);
    s.qkv = scratch_take(&cursor, rows * qkv_width);
    s.qk = scratch_take(&cursor, rows * qk_width);
    s.attn = scratch_take(&cursor, rows * heads * d);
    s.attn_out = scratch_take(&cursor, rows * m->hidden);
    s.gate_up = scratch_take(&cursor, rows * 2 * m->intermediate);
    s.act = scratch_take(&cursor, rows * m->intermediate);
    s.delta = scratch_take(&cursor, rows * m->hidden);

    int64_t status = 0;
    for (int64_t l = 0; l < m->num_layers && status == 0; ++l) {
        const pdserve_layer *layer = &m->layers[l];
        pdserve_rms_norm(s.normed, residual, l == 0 ? NULL : s.delta, layer->input_norm, rows, m->hidden,
                         layer->input_eps, 1);
        if ((status = project(&layer->qkv, lora, s.qkv, s.normed, rows, threads)) != 0) {
            break;
        }
        /* Queries and keys are adjacent columns, so one rotation covers both. */
        rotate(s.qk, s.qkv, qkv_width, rows, heads + kv_heads, d, m->cos, m->sin, positions);
        /* Keys from the rotated rows, values straight from the projection's (strided views, as in torch). */
        status = pdserve_store_kv(s.qk + heads * d, s.qkv + qk_width, 1, qk_width, qkv_width, layer->key_cache,
                                  layer->value_cache, m->kv_kind, layer->key_scales, layer->value_scales, slots,
                                  rows, m->num_slots, kv_heads, d);
        if (status != 0) {
            break;
        }
        status = pdserve_paged_attention_ranges(s.attn, s.qk, qk_width, 1, layer->key_cache, layer->value_cache,
                                                m->kv_kind, layer->key_scales, layer->value_scales, block_tables,
                                                context_lens, query_rows, query_lens, range_points, num_ranges,
                                                max_blocks, kv_heads, heads / kv_heads, d, m->block_size,
                                                m->attn_scale, 0, 0.0f);
        if (status != 0 || (status = project(&layer->o, lora, s.attn_out, s.attn, rows, threads)) != 0) {
            break;
        }
        pdserve_rms_norm(s.normed, residual, s.attn_out, layer->post_norm, rows, m->hidden, layer->post_eps, 1);
        if ((status = project(&layer->gate_up, lora, s.gate_up, s.normed, rows, threads)) != 0) {
            break;
        }
        pdserve_silu_mul(s.act, s.gate_up, rows, m->intermediate, 1);
        status = project(&layer->down, lora, s.delta, s.act, rows, threads);
    }
    if (status == 0) {
        pdserve_rms_norm(hidden_out, residual, m->num_layers ? s.delta : NULL, m->final_norm, rows, m->hidden,
                         m->final_eps, 1);
    }
    free(memory);
    return status;
}

/* sizeof the structs above (0 projection, 1 layer, 2 model, 3 LoRA rows), so the Python side can check its
 * mirrors against this build. */
int64_t pdserve_fused_decode_struct_sizes(int64_t which)
{
    switch (which) {
    case 0: return (int64_t)sizeof(pdserve_projection);
    case 1: return (int64_t)sizeof(pdserve_layer);
    case 2: return (int64_t)sizeof(pdserve_model);
    default: return (int64_t)sizeof(pdserve_lora_rows);
    }
}
