/*
 * Attention of short queries straight from the paged KV cache, for CPUs.
 *
 * A "short query" is a decode token, or the few tokens a speculative step
 * verifies: q_len query rows at the end of a context that is already in the
 * cache. The torch path gathers every sequence's KV blocks into a padded batch
 * and runs SDPA over it; this kernel reads each key and value row where it lies
 * in the block pool, so nothing is copied or padded.
 *
 * Work items: item = seq * num_kv_heads + kv_head. An item computes the group of
 * query heads that share that KV head, for every query row of the sequence.
 * pdserve_paged_attention covers items [item_begin, item_end) on the calling
 * thread. pdserve_paged_attention_ranges covers num_ranges contiguous ranges
 * (range r: items [points[r], points[r + 1])), one per OpenMP thread, when built
 * with -fopenmp on torch's own runtime (pdserve/engine/native.py: the threads are the
 * ones torch's GEMMs use, so the two never fight over the cores); without
 * OpenMP it runs the ranges in turn and the Python side splits them over
 * threads itself (pdserve_paged_attention_openmp says which).
 *
 * Layouts (row-major):
 *   query, out    (num_rows, num_kv_heads, group, head_dim) float32 or bfloat16
 *                 (io_bf16): query head h * group + g uses KV head h, as repeat_kv
 *                 does. out is contiguous; query's rows are query_stride elements
 *                 apart (a column slice of the fused q/k/v output, read in place). Sequence s owns rows query_rows[s] .. + query_lens[s] - 1;
 *                 rows no item covers are left untouched.
 *   key_cache,    (num_blocks, block_size, num_kv_heads, head_dim): float32,
 *   value_cache   bfloat16 bits or int8 (kv_kind)
 *   key_scales,   (num_blocks, block_size, num_kv_heads) float32, int8 only:
 *   value_scales  value = int8 * scale (per token and KV head)
 *   block_tables  (num_seqs, max_blocks) int64, padded past each table's end
 *   context_lens  (num_seqs,) int64: the context after this step; query row r
 *                 sits at position context_len - q_len + r and attends to
 *                 positions 0 .. itself (causal), or with window > 0 to the
 *                 last `window` of them, itself included (sliding-window
 *                 attention, as transformers masks it).
 *   softcap       > 0: every score s becomes softcap * tanh(s / softcap)
 *                 before the softmax (Gemma 2's attention soft-capping).
 *
 * Arithmetic is float32 throughout: each cached row is widened once per block of
 * up to VECTORS_PER_PASS query vectors, scores are max-subtracted, exponentiated
 * (a vectorised exp within 2 ulp of expf, vector.h) and normalised, and the output is
 * accumulated in float32, rounded once to bfloat16 when io_bf16.
 * Returns 0, -1 when out of memory, -2 for an argument it cannot serve (a query
 * longer than its context, head_dim above MAX_HEAD_DIM, int8 without scales).
 */
#include "vector.h"
#if defined(_OPENMP)
#include <omp.h>
#endif

enum kv_kind { KV_FLOAT32 = 0, KV_BF16 = 1, KV_INT8 = 2 };

/* Query vectors (query row x head of the group) scored together against each widened row. */
#define VECTORS_PER_PASS 4
/* The largest row served: Llama and Qwen2 heads have 64 and 128 features, DeepSeek's latent-attention rows
   512 + 64 (the latent and its rope part, read as one KV head). */
#define MAX_HEAD_DIM 576

/* The row (lanes [16 * chunk, 16 * chunk + 16)) of cache row `index`, widened to float32. */
ALWAYS_INLINE v16f load_row_chunk(enum kv_kind kind, const void *cache, const float *scales, int64_t index,
                                  int64_t head_dim, int64_t chunk)
{
    const int64_t at = index * head_dim + chunk * LANES;
    if (kind == KV_FLOAT32) {
        return load_f32((const float *)cache + at);
    }
    if (kind == KV_BF16) {
        return load_bf16((const uint16_t *)cache + at);
    }
    return load_int8((const int8_t *)cache + at, scales[index]);
}

/* Element `i` of cache row `index` (the head_dim % 16 tail), as float32. */
ALWAYS_INLINE float load_row_element(enum kv_kind kind, const void *cache, const float *scales, int64_t index,
                                     int64_t head_dim, int64_t i)
{
    const int64_t at = index * head_dim + i;
    if (kind == KV_FLOAT32) {
        return ((const float *)cache)[at];
    }
    if (kind == KV_BF16) {
        return bf16_to_float(((const uint16_t *)cache)[at]);
    }
    return (float)((const int8_t *)cache)[at] * scales[index];
}

/*
 * One pass: `count` (<= VECTORS_PER_PASS, a constant after inlining, so the accumulators below live in
 * registers) query vectors `q` (float32, head_dim each) of one sequence and KV head, vector j attending to
 * positions [starts[j], limits[j]) (both non-decreasing), into `o`. `scores` holds count * limits[count - 1]
 * floats, indexed by position (those before starts[0] are never touched).
 */
ALWAYS_INLINE void attend_pass(enum kv_kind kind, const void *key_cache, const void *value_cache,
                               const float *key_scales, const float *value_scales, const int64_t *table,
                               int64_t kv_head, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                               float scale, float softcap, const float *q, int64_t count, const int64_t *starts,
                               const int64_t *limits, float *scores, float *o)
{
    const int64_t chunks = head_dim / LANES;
    const int64_t tail = chunks * LANES;
    const int64_t span = limits[count - 1], lo = starts[0];

    /* Scores: every key row from the first start up to the longest limit, widened once for all `count` vectors. */
    for (int64_t block_start = lo / block_size * block_size; block_start < span; block_start += block_size) {
        const int64_t from = block_start > lo ? block_start : lo;
        int64_t index = (table[block_start / block_size] * block_size + from - block_start) * num_kv_heads + kv_head;
        const int64_t block_end = block_start + block_size < span ? block_start + block_size : span;
        for (int64_t position = from; position < block_end; ++position, index += num_kv_heads) {
            v16f acc[VECTORS_PER_PASS] = {{0}};
            for (int64_t c = 0; c < chunks; ++c) {
                const v16f k = load_row_chunk(kind, key_cache, key_scales, index, head_dim, c);
                for (int64_t j = 0; j < count; ++j) {
                    acc[j] += load_f32(q + j * head_dim + c * LANES) * k;
                }
            }
            for (int64_t j = 0; j < count; ++j) {
                float dot = sum16(acc[j]);
                for (int64_t i = tail; i < head_dim; ++i) {
                    dot += q[j * head_dim + i] * load_row_element(kind, key_cache, key_scales, index, head_dim, i);
                }
                dot *= scale;
                if (softcap > 0.0f) {
                    dot = softcap * tanhf(dot / softcap);
                }
                scores[j * span + position] = dot;
            }
        }
    }

    /* Softmax of each vector over its own [start, limit); positions outside it (from lo) weigh 0. */
    for (int64_t j = 0; j < count; ++j) {
        float *row = scores + j * span;
        const int64_t limit = limits[j], start = starts[j];
        float max_score = -INFINITY;
        for (int64_t position = start; position < limit; ++position) {
            max_score = row[position] > max_score ? row[position] : max_score;
        }
        v16f sums = {0};
        int64_t position = start;
        for (; position + LANES <= limit; position += LANES) {
            const v16f e = exp16(load_f32(row + position) - max_score);
            store_f32(row + position, e);
            sums += e;
        }
        float sum = sum16(sums);
        if (position < limit) {
            float rest[LANES];
            v16f x;
            for (int64_t i = 0; i < LANES; ++i) {
                x[i] = position + i < limit ? row[position + i] - max_score : -INFINITY;
            }
            store_f32(rest, exp16(x));
            for (int64_t i = 0; position + i < limit; ++i) {
                row[position + i] = rest[i];
                sum += rest[i];
            }
        }
        const float inv_sum = 1.0f / sum;
        for (position = start; position < limit; ++position) {
            row[position] *= inv_sum;
        }
        for (position = lo; position < start; ++position) {
            row[position] = 0.0f;
        }
        for (position = limit; position < span; ++position) {
            row[position] = 0.0f;
        }
    }

    /* Weighted sum of the value rows into float32 accumulators, kept in registers for the common head sizes. */
    v16f acc[VECTORS_PER_PASS][MAX_HEAD_DIM / LANES];
    for (int64_t j = 0; j < count; ++j) {
        for (int64_t c = 0; c < chunks; ++c) {
            acc[j][c] = (v16f){0};
        }
    }
    float tails[VECTORS_PER_PASS][LANES] = {{0}};
    for (int64_t block_start = lo / block_size * block_size; block_start < span; block_start += block_size) {
        const int64_t from = block_start > lo ? block_start : lo;
        int64_t index = (table[block_start / block_size] * block_size + from - block_start) * num_kv_heads + kv_head;
        const int64_t block_end = block_start + block_size < span ? block_start + block_size : span;
        for (int64_t position = from; position < block_end; ++position, index += num_kv_heads) {
            for (int64_t c = 0; c < chunks; ++c) {
                const v16f v = load_row_chunk(kind, value_cache, value_scales, index, head_dim, c);
                for (int64_t j = 0; j < count; ++j) {
                    acc[j][c] += scores[j * span + position] * v;
                }
            }
            for (int64_t i = tail; i < head_dim; ++i) {
                const float v = load_row_element(kind, value_cache, value_scales, index, head_dim, i);
                for (int64_t j = 0; j < count; ++j) {
                    tails[j][i - tail] += scores[j * span + position] * v;
                }
            }
        }
    }
    for (int64_t j = 0; j < count; ++j) {
        for (int64_t c = 0; c < chunks; ++c) {
            store_f32(o + j * head_dim + c * LANES, acc[j][c]);
        }
        for (int64_t i = tail; i < head_dim; ++i) {
            o[j * head_dim + i] = tails[j][i - tail];
        }
    }
}

/* attend_pass with the pass's vector count and the head size as constants (one specialised copy each). */
ALWAYS_INLINE void attend_pass_sized(enum kv_kind kind, const void *key_cache, const void *value_cache,
                                     const float *key_scales, const float *value_scales, const int64_t *table,
                                     int64_t kv_head, int64_t num_kv_heads, int64_t block_size, int64_t head_dim,
                                     float scale, float softcap, const float *q, int64_t count,
                                     const int64_t *starts, const int64_t *limits, float *scores, float *o)
{
#define PDSERVE_PASS(n, d)                                                                                       \
    attend_pass(kind, key_cache, value_cache, key_scales, value_scales, table, kv_head, num_kv_heads, block_size, \
                d, scale, softcap, q, n, starts, limits, scores, o)
#define PDSERVE_PASS_COUNTS(d)     \
    switch (count) {               \
    case 1: PDSERVE_PASS(1, d); break; \
    case 2: PDSERVE_PASS(2, d); break; \
    case 3: PDSERVE_PASS(3, d); break; \
    default: PDSERVE_PASS(4, d); break; \
    }
    if (head_dim == 64) {
        PDSERVE_PASS_COUNTS(64)
    } else if (head_dim == 128) {
        PDSERVE_PASS_COUNTS(128)
    } else {
        PDSERVE_PASS_COUNTS(head_dim)
    }
#undef PDSERVE_PASS_COUNTS
#undef PDSERVE_PASS
}

/* One specialised copy of the passes per KV dtype, shared by both query dtypes. */
static __attribute__((noinline)) void attend_pass_kind(enum kv_kind kind, const void *key_cache, const void *value_cache,
                                                       const float *key_scales, const float *value_scales,
                                                       const int64_t *table, int64_t kv_head, int64_t num_kv_heads,
                                                       int64_t block_size, int64_t head_dim, float scale, float softcap,
                                                       const float *q, int64_t count, const int64_t *starts,
                                                       const int64_t *limits, float *scores, float *o)
{
#define PDSERVE_KIND(k)                                                                                           \
    attend_pass_sized(k, key_cache, value_cache, key_scales, value_scales, table, kv_head, num_kv_heads,         \
                      block_size, head_dim, scale, softcap, q, count, starts, limits, scores, o)
    if (kind == KV_FLOAT32) {
        PDSERVE_KIND(KV_FLOAT32);
    } else if (kind == KV_BF16) {
        PDSERVE_KIND(KV_BF16);
    } else {
        PDSERVE_KIND(KV_INT8);
    }
#undef PDSERVE_KIND
}

static int paged_attention(
    enum kv_kind kind, int io_bf16, void *out, const void *query, int64_t query_stride, const void *key_cache,
    const void *value_cache,
    const float *key_scales, const float *value_scales, const int64_t *block_tables, const int64_t *context_lens,
    const int64_t *query_rows, const int64_t *query_lens, int64_t item_begin, int64_t item_end, int64_t max_blocks,
    int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size, float scale, int64_t window,
    float softcap)
{
    const int64_t num_heads = num_kv_heads * group;
    int64_t longest = 0;
    for (int64_t item = item_begin; item < item_end; ++item) {
        const int64_t s = item / num_kv_heads;
        if (query_lens[s] < 1 || query_lens[s] > context_lens[s]) {
            return -2;
        }
        longest = context_lens[s] > longest ? context_lens[s] : longest;
    }
    /* Scores of one pass, then its query vectors and outputs in float32. */
    const size_t floats = (size_t)(VECTORS_PER_PASS * longest + 2 * VECTORS_PER_PASS * head_dim);
    float *scores = malloc(sizeof(float) * floats);
    if (scores == NULL) {
        return -1;
    }
    float *q = scores + VECTORS_PER_PASS * longest;
    float *o = q + VECTORS_PER_PASS * head_dim;

    for (int64_t item = item_begin; item < item_end; ++item) {
        const int64_t s = item / num_kv_heads, kv_head = item % num_kv_heads;
        const int64_t q_len = query_lens[s], first_position = context_lens[s] - q_len;
        const int64_t num_vectors = q_len * group;
        for (int64_t first = 0; first < num_vectors; first += VECTORS_PER_PASS) {
            const int64_t count = num_vectors - first < VECTORS_PER_PASS ? num_vectors - first : VECTORS_PER_PASS;
            int64_t limits[VECTORS_PER_PASS], starts[VECTORS_PER_PASS];
            int64_t offsets[VECTORS_PER_PASS]; /* element offset of vector j in out */
            int64_t query_offsets[VECTORS_PER_PASS]; /* and in query */
            for (int64_t j = 0; j < count; ++j) {
                const int64_t vector = first + j, row = vector / group, g = vector % group;
                limits[j] = first_position + row + 1;
                starts[j] = window > 0 && limits[j] > window ? limits[j] - window : 0;
                offsets[j] = ((query_rows[s] + row) * num_heads + kv_head * group + g) * head_dim;
                query_offsets[j] = (query_rows[s] + row) * query_stride + (kv_head * group + g) * head_dim;
                for (int64_t i = 0; i < head_dim; ++i) {
                    q[j * head_dim + i] = io_bf16 ? bf16_to_float(((const uint16_t *)query)[query_offsets[j] + i])
                                                  : ((const float *)query)[query_offsets[j] + i];
                }
            }
            attend_pass_kind(kind, key_cache, value_cache, key_scales, value_scales, block_tables + s * max_blocks,
                             kv_head, num_kv_heads, block_size, head_dim, scale, softcap, q, count, starts, limits,
                             scores, o);
            for (int64_t j = 0; j < count; ++j) {
                for (int64_t i = 0; i < head_dim; ++i) {
                    if (io_bf16) {
                        ((uint16_t *)out)[offsets[j] + i] = float_to_bf16(o[j * head_dim + i]);
                    } else {
                        ((float *)out)[offsets[j] + i] = o[j * head_dim + i];
                    }
                }
            }
        }
    }
    free(scores);
    return 0;
}

int pdserve_paged_attention(
    void *out, const void *query, int64_t query_stride, int64_t io_bf16, const void *key_cache,
    const void *value_cache, int64_t kv_kind,
    const float *key_scales, const float *value_scales, const int64_t *block_tables, const int64_t *context_lens,
    const int64_t *query_rows, const int64_t *query_lens, int64_t item_begin, int64_t item_end, int64_t max_blocks,
    int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size, float scale, int64_t window,
    float softcap)
{
    const int known_kind = kv_kind == KV_FLOAT32 || kv_kind == KV_BF16 || (kv_kind == KV_INT8 && key_scales && value_scales);
    if (!known_kind || head_dim < 1 || head_dim > MAX_HEAD_DIM) {
        return -2;
    }
    return paged_attention((enum kv_kind)kv_kind, io_bf16 != 0, out, query, query_stride, key_cache, value_cache,
                           key_scales,
                           value_scales, block_tables, context_lens, query_rows, query_lens, item_begin, item_end,
                           max_blocks, num_kv_heads, group, head_dim, block_size, scale, window, softcap);
}

int pdserve_paged_attention_ranges(
    void *out, const void *query, int64_t query_stride, int64_t io_bf16, const void *key_cache,
    const void *value_cache, int64_t kv_kind,
    const float *key_scales, const float *value_scales, const int64_t *block_tables, const int64_t *context_lens,
    const int64_t *query_rows, const int64_t *query_lens, const int64_t *points, int64_t num_ranges,
    int64_t max_blocks, int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size, float scale,
    int64_t window, float softcap)
{
    /* Any failure wins over success; out of memory (-1) over a bad argument (-2) is as good as any order. */
    int status = 0;
#if defined(_OPENMP)
#pragma omp parallel for num_threads(num_ranges) schedule(static, 1) reduction(min : status) if (num_ranges > 1)
#endif
    for (int64_t r = 0; r < num_ranges; ++r) {
        const int result = pdserve_paged_attention(
            out, query, query_stride, io_bf16, key_cache, value_cache, kv_kind, key_scales, value_scales, block_tables,
            context_lens, query_rows, query_lens, points[r], points[r + 1], max_blocks, num_kv_heads, group,
            head_dim, block_size, scale, window, softcap);
        status = result < status ? result : status;
    }
    return status;
}

/* 1 when the ranges above run on OpenMP threads, 0 when they run in turn on the caller's. */
int pdserve_paged_attention_openmp(void)
{
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

/*
 * The KV write of a step (vLLM's reshape_and_cache): token t's key and value rows go to cache slot
 * slots[t], cast to the cache's dtype or, for int8, quantized as pdserve/engine/kv/cache.py's quantize_int8 does
 * it (scale = max |x| / 127, x / scale rounded half to even, clamped to +-127; an all-zero row keeps
 * scale 0), bit for bit. One call replaces the dozen torch ops per layer that cost more in dispatch than
 * in arithmetic at decode sizes.
 *   key, value  (num_tokens, num_kv_heads, head_dim) float32 or bfloat16 (in_bf16), rows key_stride and
 *               value_stride elements apart (views of the fused q/k/v projection's output)
 *   caches      as pdserve_paged_attention's, scales (int8 only) (num_blocks * block_size, num_kv_heads)
 * Returns 0, -2 for a kind it does not know or int8 without scales, -3 for a slot outside [0, num_slots)
 * (checked before anything is written).
 */
static void store_rows(enum kv_kind kind, int in_bf16, const void *source, int64_t stride, void *cache,
                       float *scales, const int64_t *slots, int64_t num_tokens, int64_t num_kv_heads,
                       int64_t head_dim)
{
    float row[MAX_HEAD_DIM];
    for (int64_t t = 0; t < num_tokens; ++t) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t from = t * stride + h * head_dim;
            const int64_t to = (slots[t] * num_kv_heads + h) * head_dim;
            if (in_bf16 && kind == KV_BF16) {
                memcpy((uint16_t *)cache + to, (const uint16_t *)source + from, sizeof(uint16_t) * head_dim);
                continue;
            }
            if (!in_bf16 && kind == KV_FLOAT32) {
                memcpy((float *)cache + to, (const float *)source + from, sizeof(float) * head_dim);
                continue;
            }
            for (int64_t i = 0; i < head_dim; ++i) {
                row[i] = in_bf16 ? bf16_to_float(((const uint16_t *)source)[from + i])
                                 : ((const float *)source)[from + i];
            }
            if (kind == KV_FLOAT32) {
                memcpy((float *)cache + to, row, sizeof(float) * head_dim);
            } else if (kind == KV_BF16) {
                for (int64_t i = 0; i < head_dim; ++i) {
                    /* NaN stays NaN (float_to_bf16's rounding would carry it into the exponent). */
                    ((uint16_t *)cache)[to + i] = isnan(row[i]) ? 0x7FC0u : float_to_bf16(row[i]);
                }
            } else {
                float largest = 0.0f;
                for (int64_t i = 0; i < head_dim; ++i) {
                    largest = fabsf(row[i]) > largest ? fabsf(row[i]) : largest;
                }
                const float scale = largest / 127.0f;
                const float divisor = scale == 0.0f ? 1.0f : scale;
                for (int64_t i = 0; i < head_dim; ++i) {
                    float q = nearbyintf(row[i] / divisor);
                    q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
                    ((int8_t *)cache)[to + i] = (int8_t)q;
                }
                scales[slots[t] * num_kv_heads + h] = scale;
            }
        }
    }
}

int pdserve_store_kv(const void *key, const void *value, int64_t in_bf16, int64_t key_stride, int64_t value_stride,
                     void *key_cache, void *value_cache, int64_t kv_kind, float *key_scales, float *value_scales,
                     const int64_t *slots, int64_t num_tokens, int64_t num_slots, int64_t num_kv_heads,
                     int64_t head_dim)
{
    const int known_kind = kv_kind == KV_FLOAT32 || kv_kind == KV_BF16 || (kv_kind == KV_INT8 && key_scales && value_scales);
    if (!known_kind || head_dim < 1 || head_dim > MAX_HEAD_DIM) {
        return -2;
    }
    for (int64_t t = 0; t < num_tokens; ++t) {
        if (slots[t] < 0 || slots[t] >= num_slots) {
            return -3;
        }
    }
    store_rows((enum kv_kind)kv_kind, in_bf16 != 0, key, key_stride, key_cache, key_scales, slots, num_tokens,
               num_kv_heads, head_dim);
    store_rows((enum kv_kind)kv_kind, in_bf16 != 0, value, value_stride, value_cache, value_scales, slots,
               num_tokens, num_kv_heads, head_dim);
    return 0;
}
