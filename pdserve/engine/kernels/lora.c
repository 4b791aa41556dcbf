/*
 * LoRA's per-row update for CPUs (Punica's BGMV: S-LoRA's shrink and expand), for the adapters
 * pdserve/engine/lora.py serves unmerged. After a packed projection's base product, each row adds only its
 * own adapter's update to the columns of each module m of the pack:
 *
 *   out[row, columns of m] += B_{s,m} (scale[row] * (A_{s,m} x[row]))      s: the row's slot
 *
 * and a row of the base model (no slot) is left untouched. The dense form over every resident adapter
 * multiplies each row by all of them (8 adapters: 8 times its own work); here the rows come grouped by slot,
 * so a slot's A and B are read from memory once per call and stay in cache across its rows.
 *
 * Layouts (lora_layers.py's LoRALinear buffers, float32 or bfloat16: weights_bf16):
 *   lora_a (slots * modules * max_rank, in)  row (s * modules + m) * max_rank + r: row r of A_{s,m};
 *   lora_b (slots * max_rank, out)           row s * max_rank + r: column r of each B_{s,m} under m's output
 *                                            columns (the modules' columns do not overlap);
 *   ranks (slots, modules)                   the rank of A_{s,m} (0: the adapter does not target m);
 *   columns (modules, 2)                     each module's [start, end) output columns.
 * x (rows, in) and out (rows, out) are float32 or bfloat16 (is_bf16), contiguous. `order` lists the rows that
 * have a slot, grouped by slot (row_slots: each row's slot, -1 none; row_scales: its adapter's scale), and
 * group_offsets (groups + 1 entries) where each group starts in `order`.
 *
 * Shrink: each (group, module, LORA_A_ROWS rows of A) unit multiplies those rows of A by the group's rows of x,
 * LORA_ROWS of them at once (each load of A feeds several rows), into t = scale * (A x), float32. bfloat16 x and
 * A on a CPU with AVX512-BF16: vdpbf16ps, 32 columns an instruction, each product of two bfloat16 values exact
 * in float32 and added to a float32 sum (the odd column's first, as dense_gemm.c's header says); elsewhere
 * bfloat16 values are widened to float32 (exact) and multiplied as float32 ones are. Expand: each
 * (group, LORA_COLUMNS output columns) unit adds the float32 sums over r of t[r] * B[r] to the group's rows,
 * LORA_ROWS rows by LORA_COLUMNS columns at once (independent sums: the multiply-adds do not wait on each other),
 * bfloat16 B widened to float32 (t stays float32: vdpbf16ps would round it to bfloat16);
 * bfloat16 out gets the update rounded to bfloat16 first, then the sum rounded, as torch's
 * `out.add_(update.to(torch.bfloat16))` rounds. Every sum is float32 in one order per row whatever the rows
 * beside it or the thread count, so a row's result does not depend on the batch; the variants differ in the
 * last bits (AVX2 and AVX-512 fuse the multiply-adds; AVX512-BF16 sums pairs), within float32 rounding of
 * torch's dense form over the same weights (tests/lora/test_lora_kernel.py).
 *
 * bfloat16 weights (a bfloat16 model's adapters) halve what a step reads, and reading each resident adapter's A
 * and B once per call is what bounds the kernel: 8 rank-16 adapters on the seven projections of the default model
 * (SmolLM2-135M, 30 layers) are 78 MB a decode step in bfloat16, 156 MB in float32, counted from the shapes.
 */
#include <stdint.h>
#include <stdlib.h>

#include "vector.h"

/* Rows of A per shrink unit, all multiplied by each load of x. */
#define LORA_A_ROWS 4
/* Output columns per expand unit, summed side by side: with 16-row ranks, 4 KiB of B, kept in L1 across the
 * group's rows. */
#define LORA_COLUMNS 64
#define LORA_VECTORS (LORA_COLUMNS / LANES)
/* Rows of x sharing each load of A (shrink) or B (expand): with AVX-512's 32 registers, 4 x 4 accumulators. */
#if defined(__AVX512F__)
#define LORA_ROWS 4
#else
#define LORA_ROWS 1
#endif

/* One call's arguments (see the header and pdserve_lora_shrink_expand). */
typedef struct {
    void *out;
    const void *x;
    const void *lora_a; /* float32 or bfloat16 (the call's weights_bf16) */
    const void *lora_b;
    const int64_t *ranks;
    const int64_t *columns;
    const int64_t *row_slots;
    const float *row_scales;
    const int64_t *order;
    const int64_t *group_offsets;
    int64_t modules;
    int64_t max_rank;
    int64_t in_features;
    int64_t out_features;
    float *t; /* (positions in order, modules, max_rank): scale * (A x) */
} lora_call;

ALWAYS_INLINE int64_t lora_min(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

ALWAYS_INLINE int64_t lora_max(int64_t a, int64_t b)
{
    return a > b ? a : b;
}

/* Elements [at, at + count) of a float32 or bfloat16 array as a vector, zeros past count (count <= 16). */
ALWAYS_INLINE v16f lora_load(const void *p, int64_t at, int64_t count, int is_bf16)
{
    if (count == LANES) {
        if (!is_bf16) {
            return load_f32((const float *)p + at);
        }
#if defined(__AVX512F__)
        /* One widening load (load_bf16's generic conversion takes GCC four instructions here). */
        const __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at));
        return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
#else
        return load_bf16((const uint16_t *)p + at);
#endif
    }
    v16f v = {0};
    for (int64_t i = 0; i < count; ++i) {
        v[i] = is_bf16 ? bf16_to_float(((const uint16_t *)p)[at + i]) : ((const float *)p)[at + i];
    }
    return v;
}

ALWAYS_INLINE void lora_store(void *p, int64_t at, int64_t count, v16f v, int is_bf16)
{
    if (count == LANES) {
        if (is_bf16) {
            store_bf16((uint16_t *)p + at, v);
        } else {
            store_f32((float *)p + at, v);
        }
        return;
    }
    for (int64_t i = 0; i < count; ++i) {
        if (is_bf16) {
            ((uint16_t *)p)[at + i] = float_to_bf16(v[i]);
        } else {
            ((float *)p)[at + i] = v[i];
        }
    }
}

/* Elements [i, i + count) of the dot products of LORA_A_ROWS rows of A with `rows` rows of x, into acc. */
ALWAYS_INLINE void lora_dot_step(v16f acc[LORA_ROWS][LORA_A_ROWS], const void *const *a, const void *const *x,
                                 int rows, int64_t i, int64_t count, int is_bf16, int weights_bf16)
{
    v16f av[LORA_A_ROWS];
    for (int k = 0; k < LORA_A_ROWS; ++k) {
        av[k] = lora_load(a[k], i, count, weights_bf16);
    }
    for (int r = 0; r < rows; ++r) {
        const v16f xv = lora_load(x[r], i, count, is_bf16);
        for (int k = 0; k < LORA_A_ROWS; ++k) {
            acc[r][k] += av[k] * xv;
        }
    }
}

#if PDSERVE_BF16_PATH == 1
/* lora_dot_step for bfloat16 x and A with vdpbf16ps: elements [i, i + count), count <= 32 (a tail zero-filled). */
ALWAYS_INLINE void lora_dot_pairs(v16f acc[LORA_ROWS][LORA_A_ROWS], const void *const *a, const void *const *x,
                                  int rows, int64_t i, int64_t count)
{
    const __mmask32 mask = count >= 32 ? 0xFFFFFFFFu : (1u << count) - 1u;
    __m512i av[LORA_A_ROWS];
    for (int k = 0; k < LORA_A_ROWS; ++k) {
        av[k] = count >= 32 ? _mm512_loadu_si512((const uint16_t *)a[k] + i)
                            : _mm512_maskz_loadu_epi16(mask, (const uint16_t *)a[k] + i);
    }
    for (int r = 0; r < rows; ++r) {
        const __m512i xv = count >= 32 ? _mm512_loadu_si512((const uint16_t *)x[r] + i)
                                       : _mm512_maskz_loadu_epi16(mask, (const uint16_t *)x[r] + i);
        for (int k = 0; k < LORA_A_ROWS; ++k) {
            acc[r][k] = (v16f)_mm512_dpbf16_ps((__m512)acc[r][k], (__m512bh)xv, (__m512bh)av[k]);
        }
    }
}
#endif

/* t rows of the positions [p, p + rows) (rows a constant after inlining): scale * (A rows a . x). */
ALWAYS_INLINE void lora_shrink_rows(const lora_call *c, const void *const *a, int64_t p, int rows, int64_t m,
                                    int64_t first, int64_t used, int is_bf16, int weights_bf16)
{
    const int64_t row_bytes = c->in_features * (is_bf16 ? 2 : 4);
    const void *x[LORA_ROWS];
    for (int r = 0; r < rows; ++r) {
        x[r] = (const char *)c->x + c->order[p + r] * row_bytes;
    }
    v16f acc[LORA_ROWS][LORA_A_ROWS];
    for (int r = 0; r < LORA_ROWS; ++r) {
        for (int k = 0; k < LORA_A_ROWS; ++k) {
            acc[r][k] = (v16f){0};
        }
    }
#if PDSERVE_BF16_PATH == 1
    if (is_bf16 && weights_bf16) {
        const int64_t pairs_full = c->in_features / 32 * 32;
        for (int64_t i = 0; i < pairs_full; i += 32) {
            lora_dot_pairs(acc, a, x, rows, i, 32);
        }
        if (pairs_full < c->in_features) {
            lora_dot_pairs(acc, a, x, rows, pairs_full, c->in_features - pairs_full);
        }
    } else
#endif
    {
        const int64_t full = c->in_features / LANES * LANES;
        for (int64_t i = 0; i < full; i += LANES) {
            lora_dot_step(acc, a, x, rows, i, LANES, is_bf16, weights_bf16);
        }
        if (full < c->in_features) {
            lora_dot_step(acc, a, x, rows, full, c->in_features - full, is_bf16, weights_bf16);
        }
    }
    for (int r = 0; r < rows; ++r) {
        const float scale = c->row_scales[c->order[p + r]];
        float *to = c->t + ((p + r) * c->modules + m) * c->max_rank + first;
        for (int64_t k = 0; k < used; ++k) {
            to[k] = scale * sum16(acc[r][k]);
        }
    }
}

/* Shrink unit `unit`: (group, module, LORA_A_ROWS rows of A), group-major. */
ALWAYS_INLINE void lora_shrink_unit(const lora_call *c, int64_t unit, int is_bf16, int weights_bf16)
{
    const int64_t chunks = (c->max_rank + LORA_A_ROWS - 1) / LORA_A_ROWS;
    const int64_t g = unit / (c->modules * chunks), m = unit / chunks % c->modules;
    const int64_t first = unit % chunks * LORA_A_ROWS;
    const int64_t begin = c->group_offsets[g], end = c->group_offsets[g + 1];
    const int64_t slot = c->row_slots[c->order[begin]], rank = c->ranks[slot * c->modules + m];
    if (first >= rank) {
        return;
    }
    /* Rows of A past the rank repeat the last one: computed, never stored. */
    const int64_t row_bytes = c->in_features * (weights_bf16 ? 2 : 4);
    const void *a[LORA_A_ROWS];
    for (int k = 0; k < LORA_A_ROWS; ++k) {
        const int64_t row = (slot * c->modules + m) * c->max_rank + lora_min(first + k, rank - 1);
        a[k] = (const char *)c->lora_a + row * row_bytes;
    }
    const int64_t used = lora_min(LORA_A_ROWS, rank - first);
    int64_t p = begin;
    for (; p + LORA_ROWS <= end; p += LORA_ROWS) {
        lora_shrink_rows(c, a, p, LORA_ROWS, m, first, used, is_bf16, weights_bf16);
    }
    switch (end - p) {
#if LORA_ROWS == 4
    case 3: lora_shrink_rows(c, a, p, 3, m, first, used, is_bf16, weights_bf16); break;
    case 2: lora_shrink_rows(c, a, p, 2, m, first, used, is_bf16, weights_bf16); break;
#endif
    case 1: lora_shrink_rows(c, a, p, 1, m, first, used, is_bf16, weights_bf16); break;
    default: break;
    }
}

/* Columns [j, j + vectors * 16) (or [j, j + count) for one vector, count <= 16) of out, for the positions
 * [p, p + rows): += sum over k < rank of t[k] * B[k] (b: B's row 0, out_features apart). */
ALWAYS_INLINE void lora_expand_rows(const lora_call *c, const void *b, int64_t rank, int64_t p, int rows,
                                    int64_t m, int64_t j, int vectors, int64_t count, int is_bf16, int weights_bf16)
{
    const int64_t size = weights_bf16 ? 2 : 4;
    const float *t[LORA_ROWS];
    for (int r = 0; r < rows; ++r) {
        t[r] = c->t + ((p + r) * c->modules + m) * c->max_rank;
    }
    v16f acc[LORA_ROWS][LORA_VECTORS];
    for (int r = 0; r < LORA_ROWS; ++r) {
        for (int v = 0; v < LORA_VECTORS; ++v) {
            acc[r][v] = (v16f){0};
        }
    }
    for (int64_t k = 0; k < rank; ++k) {
        const void *row = (const char *)b + k * c->out_features * size;
        v16f bv[LORA_VECTORS];
        if (vectors == LORA_VECTORS) {
            /* B's rows are read LORA_COLUMNS at a time, rank rows apart: too many streams for the hardware's
             * prefetcher at decode sizes, so each asks for its cache lines two units on. */
            const char *ahead = (const char *)row + (j + 2 * LORA_COLUMNS) * size;
            for (int64_t line = 0; line < LORA_COLUMNS * size; line += 64) {
                __builtin_prefetch(ahead + line);
            }
        }
        for (int v = 0; v < vectors; ++v) {
            bv[v] = lora_load(row, j + v * LANES, vectors == 1 ? count : LANES, weights_bf16);
        }
        for (int r = 0; r < rows; ++r) {
            for (int v = 0; v < vectors; ++v) {
                acc[r][v] += t[r][k] * bv[v];
            }
        }
    }
    for (int r = 0; r < rows; ++r) {
        for (int v = 0; v < vectors; ++v) {
            const int64_t at = c->order[p + r] * c->out_features + j + v * LANES, n = vectors == 1 ? count : LANES;
            const v16f update = is_bf16 ? round_bf16(acc[r][v]) : acc[r][v];
            lora_store(c->out, at, n, lora_load(c->out, at, n, is_bf16) + update, is_bf16);
        }
    }
}

/* lora_expand_rows over the positions [p, p + rows), rows a constant in each call. */
ALWAYS_INLINE void lora_expand_block(const lora_call *c, const void *b, int64_t rank, int64_t begin, int64_t end,
                                     int64_t m, int64_t j, int vectors, int64_t count, int is_bf16, int weights_bf16)
{
    int64_t p = begin;
    for (; p + LORA_ROWS <= end; p += LORA_ROWS) {
        lora_expand_rows(c, b, rank, p, LORA_ROWS, m, j, vectors, count, is_bf16, weights_bf16);
    }
    switch (end - p) {
#if LORA_ROWS == 4
    case 3: lora_expand_rows(c, b, rank, p, 3, m, j, vectors, count, is_bf16, weights_bf16); break;
    case 2: lora_expand_rows(c, b, rank, p, 2, m, j, vectors, count, is_bf16, weights_bf16); break;
#endif
    case 1: lora_expand_rows(c, b, rank, p, 1, m, j, vectors, count, is_bf16, weights_bf16); break;
    default: break;
    }
}

/* Expand unit `unit`: (group, LORA_COLUMNS output columns), group-major; each module's part of the columns. */
ALWAYS_INLINE void lora_expand_unit(const lora_call *c, int64_t unit, int is_bf16, int weights_bf16)
{
    const int64_t column_chunks = (c->out_features + LORA_COLUMNS - 1) / LORA_COLUMNS;
    const int64_t g = unit / column_chunks, start = unit % column_chunks * LORA_COLUMNS;
    const int64_t stop = lora_min(start + LORA_COLUMNS, c->out_features);
    const int64_t begin = c->group_offsets[g], end = c->group_offsets[g + 1];
    const int64_t slot = c->row_slots[c->order[begin]];
    const void *b = (const char *)c->lora_b + slot * c->max_rank * c->out_features * (weights_bf16 ? 2 : 4);
    for (int64_t m = 0; m < c->modules; ++m) {
        const int64_t low = lora_max(start, c->columns[2 * m]), high = lora_min(stop, c->columns[2 * m + 1]);
        const int64_t rank = c->ranks[slot * c->modules + m];
        if (low >= high || rank == 0) {
            continue;
        }
        if (high - low == LORA_COLUMNS) {
            lora_expand_block(c, b, rank, begin, end, m, low, LORA_VECTORS, LANES, is_bf16, weights_bf16);
            continue;
        }
        /* A module's first or last columns off the unit's boundaries: a vector at a time. */
        for (int64_t j = low; j < high; j += LANES) {
            if (j + LANES <= high) {
                lora_expand_block(c, b, rank, begin, end, m, j, 1, LANES, is_bf16, weights_bf16);
            } else {
                lora_expand_block(c, b, rank, begin, end, m, j, 1, high - j, is_bf16, weights_bf16);
            }
        }
    }
}

/* Each dtype pair's loops compiled for it: x and out bfloat16 (is_bf16), the weights bfloat16 (weights_bf16). */
#define LORA_DISPATCH(call, is_bf16, weights_bf16)                                                              \
    do {                                                                                                        \
        if (is_bf16) {                                                                                          \
            if (weights_bf16) { call(1, 1); } else { call(1, 0); }                                              \
        } else {                                                                                                \
            if (weights_bf16) { call(0, 1); } else { call(0, 0); }                                              \
        }                                                                                                       \
    } while (0)

/*
 * out[row] += each row's own adapter's update (see the header), `groups` groups of rows. x and out are bfloat16
 * when is_bf16 (else float32), lora_a and lora_b when weights_bf16. Returns 0, or -1 when out of memory.
 */
int64_t pdserve_lora_shrink_expand(void *out, const void *x, const void *lora_a, const void *lora_b,
                                   const int64_t *ranks, const int64_t *columns, const int64_t *row_slots,
                                   const float *row_scales, const int64_t *order, const int64_t *group_offsets,
                                   int64_t groups, int64_t modules, int64_t max_rank, int64_t in_features,
                                   int64_t out_features, int64_t is_bf16, int64_t weights_bf16, int64_t threads)
{
    const int64_t positions = group_offsets[groups];
    if (positions == 0) {
        return 0;
    }
    const lora_call c = {out, x, lora_a, lora_b, ranks, columns, row_slots, row_scales, order, group_offsets,
                         modules, max_rank, in_features, out_features,
                         malloc(sizeof(float) * (size_t)(positions * modules * max_rank))};
    if (c.t == NULL) {
        return -1;
    }
    const int64_t shrink_units = groups * modules * ((max_rank + LORA_A_ROWS - 1) / LORA_A_ROWS);
    const int64_t expand_units = groups * ((out_features + LORA_COLUMNS - 1) / LORA_COLUMNS);
    /* Units group-major: a thread's contiguous share of them reads few slots' weights. The dtype is chosen
     * per unit, inside the parallel region, so that each dtype pair's loops are compiled for it. */
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < shrink_units; ++unit) {
#define LORA_SHRINK(x_bf16, w_bf16) lora_shrink_unit(&c, unit, x_bf16, w_bf16)
            LORA_DISPATCH(LORA_SHRINK, is_bf16, weights_bf16);
#undef LORA_SHRINK
        }
#pragma omp for schedule(static)
        for (int64_t unit = 0; unit < expand_units; ++unit) {
#define LORA_EXPAND(x_bf16, w_bf16) lora_expand_unit(&c, unit, x_bf16, w_bf16)
            LORA_DISPATCH(LORA_EXPAND, is_bf16, weights_bf16);
#undef LORA_EXPAND
        }
    }
    free(c.t);
    return 0;
}
