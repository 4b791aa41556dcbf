/*
 * Decode attention straight from the paged KV cache, float32, for CPUs.
 *
 * The torch path gathers every decode sequence's KV blocks into a padded
 * batch and runs SDPA over it; this kernel reads each key and value where it
 * lies in the block pool instead, so nothing is copied or padded. One call
 * covers sequences [seq_begin, seq_end); the Python side splits a batch across
 * threads (ctypes releases the GIL), so the kernel itself is single-threaded
 * and needs no OpenMP runtime (only `#pragma omp simd`, from -fopenmp-simd).
 *
 * Layouts (all contiguous, row-major):
 *   query, out    (num_seqs, num_kv_heads, group, head_dim): query head
 *                 h * group + g uses KV head h, as repeat_kv does
 *   key_cache,    (num_blocks, block_size, num_kv_heads, head_dim)
 *   value_cache
 *   block_tables  (num_seqs, max_blocks) int64, padded past each table's end
 *   context_lens  (num_seqs,) int64: positions 0 .. context_len - 1 attend
 *
 * Softmax is computed exactly as written (max-subtracted exponentials over
 * all scores, then normalised), in float32. Returns 0, or -1 when out of memory.
 *
 * Two variants read a compact cache (kv_cache_dtype), with the same layouts
 * and float32 queries, scores, softmax and accumulation:
 *   pdserve_paged_decode_attention_bf16  key/value_cache hold bfloat16 bits
 *   pdserve_paged_decode_attention_int8  key/value_cache hold int8, and
 *     key_scales, value_scales (num_blocks, block_size, num_kv_heads) float32
 *     hold each token's per-KV-head scale: value = int8 * scale.
 * Each cached row is widened to float32 once and used by its whole query group.
 * The float32 kernel above them is left exactly as it was.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline __attribute__((always_inline)) float dot_n(const float *restrict a, const float *restrict b, int64_t n)
{
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
        sum += a[i] * b[i];
    }
    return sum;
}

static inline __attribute__((always_inline)) void axpy_n(float alpha, const float *restrict x, float *restrict y, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        y[i] += alpha * x[i];
    }
}

/* The common head sizes get loops of constant length, which the compiler unrolls into a few vector instructions. */
static inline float dot(const float *restrict a, const float *restrict b, int64_t n)
{
    return n == 64 ? dot_n(a, b, 64) : n == 128 ? dot_n(a, b, 128) : dot_n(a, b, n);
}

/* y += alpha * x */
static inline void axpy(float alpha, const float *restrict x, float *restrict y, int64_t n)
{
    if (n == 64) {
        axpy_n(alpha, x, y, 64);
    } else if (n == 128) {
        axpy_n(alpha, x, y, 128);
    } else {
        axpy_n(alpha, x, y, n);
    }
}

int pdserve_paged_decode_attention(
    float *out, const float *query, const float *key_cache, const float *value_cache,
    const int64_t *block_tables, const int64_t *context_lens, int64_t seq_begin, int64_t seq_end,
    int64_t max_blocks, int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size, float scale)
{
    const int64_t num_heads = num_kv_heads * group;
    int64_t max_context = 0;
    for (int64_t s = seq_begin; s < seq_end; ++s) {
        if (context_lens[s] > max_context) {
            max_context = context_lens[s];
        }
    }
    /* scores[query_head * context_len + position], then one normaliser per query head. */
    float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_context + num_heads));
    if (scores == NULL) {
        return -1;
    }
    float *inv_sums = scores + num_heads * max_context;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * token_stride;

    for (int64_t s = seq_begin; s < seq_end; ++s) {
        const int64_t context_len = context_lens[s];
        const int64_t *table = block_tables + s * max_blocks;
        const float *q = query + s * num_heads * head_dim;
        float *o = out + s * num_heads * head_dim;

        /* Blocks are walked in order and each token's row (every KV head) read once,
         * front to back: the reads stay sequential within a block, and no position
         * needs a division (which costs more than the dot product). */
        for (int64_t block_start = 0; block_start < context_len; block_start += block_size) {
            const float *rows = key_cache + table[block_start / block_size] * block_stride;
            const int64_t block_end = block_start + block_size < context_len ? block_start + block_size : context_len;
            for (int64_t position = block_start; position < block_end; ++position, rows += token_stride) {
                for (int64_t kv_head = 0, head = 0; kv_head < num_kv_heads; ++kv_head) {
                    const float *k = rows + kv_head * head_dim;
                    for (int64_t g = 0; g < group; ++g, ++head) {
                        scores[head * context_len + position] = dot(q + head * head_dim, k, head_dim) * scale;
                    }
                }
            }
        }

        for (int64_t head = 0; head < num_heads; ++head) {
            float *row = scores + head * context_len;
            float max_score = -INFINITY;
            for (int64_t position = 0; position < context_len; ++position) {
                max_score = row[position] > max_score ? row[position] : max_score;
            }
            float sum = 0.0f;
            for (int64_t position = 0; position < context_len; ++position) {
                row[position] = expf(row[position] - max_score);
                sum += row[position];
            }
            inv_sums[head] = 1.0f / sum;
        }

        memset(o, 0, sizeof(float) * (size_t)(num_heads * head_dim));
        for (int64_t block_start = 0; block_start < context_len; block_start += block_size) {
            const float *rows = value_cache + table[block_start / block_size] * block_stride;
            const int64_t block_end = block_start + block_size < context_len ? block_start + block_size : context_len;
            for (int64_t position = block_start; position < block_end; ++position, rows += token_stride) {
                for (int64_t kv_head = 0, head = 0; kv_head < num_kv_heads; ++kv_head) {
                    const float *v = rows + kv_head * head_dim;
                    for (int64_t g = 0; g < group; ++g, ++head) {
                        axpy(scores[head * context_len + position] * inv_sums[head], v, o + head * head_dim, head_dim);
                    }
                }
            }
        }
    }
    free(scores);
    return 0;
}

/* ---- compact KV: bfloat16 and int8 ------------------------------------------------------ */

enum kv_kind { KV_BF16, KV_INT8 };

static inline __attribute__((always_inline)) float bf16_to_float(uint16_t bits)
{
    union { uint32_t u; float f; } value = { .u = (uint32_t)bits << 16 };
    return value.f;
}

static inline __attribute__((always_inline)) void widen_bf16_n(const uint16_t *restrict src, float *restrict dst, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        dst[i] = bf16_to_float(src[i]);
    }
}

static inline __attribute__((always_inline)) void widen_int8_n(const int8_t *restrict src, float row_scale, float *restrict dst, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        dst[i] = row_scale * (float)src[i];
    }
}

/* Row `index` (head_dim elements) of a compact cache, as float32 (int8: times its scale) into dst.
 * Widened once per KV head and shared by the group's query heads, then the float32 dot/axpy run on it. */
static inline __attribute__((always_inline)) void widen_row(enum kv_kind kind, const void *cache, const float *scales, int64_t index, int64_t n, float *restrict dst)
{
    if (kind == KV_BF16) {
        const uint16_t *src = (const uint16_t *)cache + index * n;
        if (n == 64) {
            widen_bf16_n(src, dst, 64);
        } else if (n == 128) {
            widen_bf16_n(src, dst, 128);
        } else {
            widen_bf16_n(src, dst, n);
        }
        return;
    }
    const int8_t *src = (const int8_t *)cache + index * n;
    if (n == 64) {
        widen_int8_n(src, scales[index], dst, 64);
    } else if (n == 128) {
        widen_int8_n(src, scales[index], dst, 128);
    } else {
        widen_int8_n(src, scales[index], dst, n);
    }
}

/* Scores of up to four query heads against one widened key row, in independent vector accumulators
 * so that their multiply-add chains overlap (one dot product at a time waits on each add). GCC's
 * vector extension, not `omp simd reduction`: with four reductions the latter spills to memory. */
typedef float vec8 __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) vec8 load8(const float *p)
{
    vec8 v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline __attribute__((always_inline)) float sum8(vec8 v)
{
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

static inline __attribute__((always_inline)) void dot4_n(const float *restrict q0, const float *restrict q1, const float *restrict q2,
                                                        const float *restrict q3, const float *restrict k, int64_t n, float *restrict sums)
{
    vec8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const vec8 kv = load8(k + i);
        a0 += load8(q0 + i) * kv;
        a1 += load8(q1 + i) * kv;
        a2 += load8(q2 + i) * kv;
        a3 += load8(q3 + i) * kv;
    }
    float s0 = sum8(a0), s1 = sum8(a1), s2 = sum8(a2), s3 = sum8(a3);
    for (; i < n; ++i) {
        s0 += q0[i] * k[i];
        s1 += q1[i] * k[i];
        s2 += q2[i] * k[i];
        s3 += q3[i] * k[i];
    }
    sums[0] = s0;
    sums[1] = s1;
    sums[2] = s2;
    sums[3] = s3;
}

/* sums[g] = dot(q + g * n, k) for g < count <= 4; absent heads repeat the last one (their sums are ignored). */
static inline void dot_group(const float *restrict q, const float *restrict k, int64_t count, int64_t n, float *restrict sums)
{
    const float *q1 = q + (count > 1 ? n : 0), *q2 = q + (count > 2 ? 2 * n : 0), *q3 = q + (count > 3 ? 3 * n : 0);
    if (n == 64) {
        dot4_n(q, q1, q2, q3, k, 64, sums);
    } else if (n == 128) {
        dot4_n(q, q1, q2, q3, k, 128, sums);
    } else {
        dot4_n(q, q1, q2, q3, k, n, sums);
    }
}

/* The float32 kernel's walk, reading rows by index: row (block * block_size + offset) * num_kv_heads + kv_head
 * of head_dim elements, whose scale (int8) is element of the same index in key/value_scales. */
static inline __attribute__((always_inline)) int paged_decode_compact(
    enum kv_kind kind, float *out, const float *query, const void *key_cache, const void *value_cache,
    const float *key_scales, const float *value_scales,
    const int64_t *block_tables, const int64_t *context_lens, int64_t seq_begin, int64_t seq_end,
    int64_t max_blocks, int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size, float scale)
{
    const int64_t num_heads = num_kv_heads * group;
    int64_t max_context = 0;
    for (int64_t s = seq_begin; s < seq_end; ++s) {
        if (context_lens[s] > max_context) {
            max_context = context_lens[s];
        }
    }
    /* scores, one normaliser per query head, then one widened row. */
    float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_context + num_heads + head_dim));
    if (scores == NULL) {
        return -1;
    }
    float *inv_sums = scores + num_heads * max_context;
    float *widened = inv_sums + num_heads;

    for (int64_t s = seq_begin; s < seq_end; ++s) {
        const int64_t context_len = context_lens[s];
        const int64_t *table = block_tables + s * max_blocks;
        const float *q = query + s * num_heads * head_dim;
        float *o = out + s * num_heads * head_dim;

        for (int64_t block_start = 0; block_start < context_len; block_start += block_size) {
            int64_t row = table[block_start / block_size] * block_size * num_kv_heads;
            const int64_t block_end = block_start + block_size < context_len ? block_start + block_size : context_len;
            for (int64_t position = block_start; position < block_end; ++position) {
                for (int64_t kv_head = 0, head = 0; kv_head < num_kv_heads; ++kv_head, ++row) {
                    widen_row(kind, key_cache, key_scales, row, head_dim, widened);
                    if (group == 1) {
                        scores[head * context_len + position] = dot(q + head * head_dim, widened, head_dim) * scale;
                        ++head;
                        continue;
                    }
                    for (int64_t g = 0; g < group; g += 4) {
                        float sums[4];
                        const int64_t count = group - g < 4 ? group - g : 4;
                        dot_group(q + head * head_dim, widened, count, head_dim, sums);
                        for (int64_t j = 0; j < count; ++j, ++head) {
                            scores[head * context_len + position] = sums[j] * scale;
                        }
                    }
                }
            }
        }

        for (int64_t head = 0; head < num_heads; ++head) {
            float *scores_row = scores + head * context_len;
            float max_score = -INFINITY;
            for (int64_t position = 0; position < context_len; ++position) {
                max_score = scores_row[position] > max_score ? scores_row[position] : max_score;
            }
            float sum = 0.0f;
            for (int64_t position = 0; position < context_len; ++position) {
                scores_row[position] = expf(scores_row[position] - max_score);
                sum += scores_row[position];
            }
            inv_sums[head] = 1.0f / sum;
        }

        memset(o, 0, sizeof(float) * (size_t)(num_heads * head_dim));
        for (int64_t block_start = 0; block_start < context_len; block_start += block_size) {
            int64_t row = table[block_start / block_size] * block_size * num_kv_heads;
            const int64_t block_end = block_start + block_size < context_len ? block_start + block_size : context_len;
            for (int64_t position = block_start; position < block_end; ++position) {
                for (int64_t kv_head = 0, head = 0; kv_head < num_kv_heads; ++kv_head, ++row) {
                    widen_row(kind, value_cache, value_scales, row, head_dim, widened);
                    for (int64_t g = 0; g < group; ++g, ++head) {
                        axpy(scores[head * context_len + position] * inv_sums[head], widened, o + head * head_dim, head_dim);
                    }
                }
            }
        }
    }
    free(scores);
    return 0;
}

int pdserve_paged_decode_attention_bf16(
    float *out, const float *query, const uint16_t *key_cache, const uint16_t *value_cache,
    const int64_t *block_tables, const int64_t *context_lens, int64_t seq_begin, int64_t seq_end,
    int64_t max_blocks, int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size, float scale)
{
    return paged_decode_compact(KV_BF16, out, query, key_cache, value_cache, NULL, NULL, block_tables, context_lens,
                                seq_begin, seq_end, max_blocks, num_kv_heads, group, head_dim, block_size, scale);
}

int pdserve_paged_decode_attention_int8(
    float *out, const float *query, const int8_t *key_cache, const int8_t *value_cache,
    const float *key_scales, const float *value_scales,
    const int64_t *block_tables, const int64_t *context_lens, int64_t seq_begin, int64_t seq_end,
    int64_t max_blocks, int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size, float scale)
{
    return paged_decode_compact(KV_INT8, out, query, key_cache, value_cache, key_scales, value_scales, block_tables,
                                context_lens, seq_begin, seq_end, max_blocks, num_kv_heads, group, head_dim, block_size,
                                scale);
}
