/*
 * Dense (unquantized) GEMMs for CPUs, from one row to prefill chunks: out (rows, n) = x (rows, k) @ W.T + bias.
 *
 * Both keep the weight in panels of 32 output rows, each input column's (float32) or pair of input
 * columns' (bfloat16) values for the panel's 32 rows together, so that a panel is read front to back
 * once per group of 8 activation rows, every 64-byte load feeding one vector multiply-add per row
 * with a broadcast activation value, the row group's accumulators in registers: the outputs lie in
 * the vector lanes, so no horizontal sums are needed. Each output is one float32 sum over the input
 * columns in order, so a row's result does not depend on the rows computed with it, nor on the thread
 * count: a sequence's tokens are the same at batch 1 and batch 32.
 *
 * bfloat16 (`pdserve_bf16_gemm`), for CPUs with AVX512-BF16 and no AMX: oneDNN's bf16 GEMM is built
 * for large tiles and runs decode batches well under its 2,048-row rate (benchmarks/linear_methods.py,
 * Zen 4; BENCHMARKS.md). Layout [panel][k / 2][32][2] bf16, 128 bytes a pair of columns; `vdpbf16ps` adds the two
 * products of a pair (each exact in float32) to the accumulator; each output is rounded once to bf16
 * after the bias is added in float32. The portable path (CPUs without AVX512-BF16) adds them the way
 * Intel's pseudo-code orders them, the odd column's product first: a reference for the tests, not a
 * fast path.
 *
 * float32 (`pdserve_f32_gemm`): layout [panel][k][32] float32, 128 bytes a column; GCC vector code,
 * so AVX-512, AVX2 and portable builds come from one source (8 rows a group with AVX-512's 32
 * registers, 2 with AVX2's 16). MKL's packed sgemm runs far under the machine's float32 rate on AMD
 * CPUs (70-77 GFLOP/s at 32 rows against this kernel's 148-185, 2 threads, Zen 4:
 * benchmarks/linear_methods.py; BENCHMARKS.md).
 *
 * Work is split over (block of 64 rows, panel) units with OpenMP (when built with it) on `threads` threads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "experts.h"
#include "vector.h"

#define PANEL 32
/* Activation rows sharing one pass over a panel: 8 rows x 2 vectors = 16 accumulators in registers. */
#define BF16_ROW_GROUP 8
/* Rows of one work unit: 8 row groups (at k = 1,536, 192 KiB of bf16 activations). */
#define ROW_BLOCK 64
#if defined(__AVX512F__)
#define F32_ROW_GROUP 8
#else
#define F32_ROW_GROUP 2
#endif

/* (row block, panel) unit `unit` of a GEMM over `panels` panels: its first row, past-the-end row and panel. */
ALWAYS_INLINE void unit_bounds(int64_t unit, int64_t panels, int64_t rows, int64_t *first, int64_t *end, int64_t *panel)
{
    const int64_t block = unit / panels;
    *panel = unit % panels;
    *first = block * ROW_BLOCK;
    *end = *first + ROW_BLOCK < rows ? *first + ROW_BLOCK : rows;
}

/* Thirty-two bf16 results of a panel for one activation row into out (+ bias, rounded to bfloat16). */
static void store_bf16_panel(uint16_t *out, const uint16_t *bias, int64_t row, int64_t n, int64_t first,
                        const float *values)
{
    const int64_t count = n - first < PANEL ? n - first : PANEL;
    uint16_t *to = out + row * n + first;
    if (bias == NULL) {
        for (int64_t i = 0; i < count; ++i) {
            to[i] = float_to_bf16(values[i]);
        }
    } else {
        for (int64_t i = 0; i < count; ++i) {
            to[i] = float_to_bf16(values[i] + bf16_to_float(bias[first + i]));
        }
    }
}

#if PDSERVE_BF16_PATH == 1

/*
 * `count` (a constant after inlining, <= BF16_ROW_GROUP) activation rows from `row0` against one panel. Each
 * row's sums run over the pairs in order whatever the count, so a row's result does not depend on the rows
 * computed with it (nor on the thread count): a sequence's tokens are the same at batch 1 and batch 32.
 * (Two accumulators a row at small counts gained nothing at one row, where the weight's bandwidth bounds.)
 */
ALWAYS_INLINE void panel_rows(const uint16_t *panel, const uint16_t *x, int64_t k, int64_t row0, int count,
                              float *results)
{
    const int64_t pairs = k / 2;
    __m512 acc[BF16_ROW_GROUP][2];
    for (int r = 0; r < BF16_ROW_GROUP; ++r) {
        acc[r][0] = _mm512_setzero_ps();
        acc[r][1] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < pairs; ++i) {
        const uint16_t *w = panel + i * 2 * PANEL;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)w);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(w + PANEL));
        for (int r = 0; r < count; ++r) {
            int32_t pair;
            memcpy(&pair, x + (row0 + r) * k + 2 * i, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
        }
    }
    for (int r = 0; r < count; ++r) {
        _mm512_storeu_ps(results + r * PANEL, acc[r][0]);
        _mm512_storeu_ps(results + r * PANEL + 16, acc[r][1]);
    }
}

/* panel_rows with its row count as a constant: one specialised copy each. */
static void panel_rows_sized(const uint16_t *panel, const uint16_t *x, int64_t k, int64_t row0, int count,
                             float *results)
{
    switch (count) {
    case 1: panel_rows(panel, x, k, row0, 1, results); break;
    case 2: panel_rows(panel, x, k, row0, 2, results); break;
    case 3: panel_rows(panel, x, k, row0, 3, results); break;
    case 4: panel_rows(panel, x, k, row0, 4, results); break;
    case 5: panel_rows(panel, x, k, row0, 5, results); break;
    case 6: panel_rows(panel, x, k, row0, 6, results); break;
    case 7: panel_rows(panel, x, k, row0, 7, results); break;
    default: panel_rows(panel, x, k, row0, 8, results); break;
    }
}

#else /* portable C */

static void panel_rows_sized(const uint16_t *panel, const uint16_t *x, int64_t k, int64_t row0, int count,
                             float *results)
{
    const int64_t pairs = k / 2;
    for (int r = 0; r < count; ++r) {
        const uint16_t *row = x + (row0 + r) * k;
        float acc[PANEL] = {0};
        for (int64_t i = 0; i < pairs; ++i) {
            const uint16_t *w = panel + i * 2 * PANEL;
            const float odd = bf16_to_float(row[2 * i + 1]), even = bf16_to_float(row[2 * i]);
            for (int lane = 0; lane < PANEL; ++lane) {
                acc[lane] += odd * bf16_to_float(w[2 * lane + 1]);
                acc[lane] += even * bf16_to_float(w[2 * lane]);
            }
        }
        memcpy(results + r * PANEL, acc, sizeof(acc));
    }
}

#endif

/* The bf16 path of this build: 1 AVX512-BF16, 0 portable C. */
int64_t pdserve_bf16_path(void)
{
    return PDSERVE_BF16_PATH;
}

/*
 * out (rows, n) bf16 = x (rows, k) bf16 @ W.T (+ bias (n,) bf16, or NULL). Returns 0, or -2 for an odd k.
 * weight: ceil(n / 32) panels x (k / 2) pairs x 32 rows x 2 values, bfloat16 (see the header).
 */
int64_t pdserve_bf16_gemm(uint16_t *out, const uint16_t *x, const uint16_t *weight, const uint16_t *bias,
                          int64_t rows, int64_t n, int64_t k, int64_t threads)
{
    if (k % 2) {
        return -2;
    }
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
    /* Units of (block of rows, panel), block-major: a thread's contiguous share of them mostly reads one
     * block's activations against a run of panels, and a prefill chunk splits over many cores, not only
     * over the panels of a narrow projection. */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t unit = 0; unit < blocks * panels; ++unit) {
        int64_t first, end, p;
        unit_bounds(unit, panels, rows, &first, &end, &p);
        float results[BF16_ROW_GROUP * PANEL];
        const uint16_t *panel = weight + p * k * PANEL;
        for (int64_t row0 = first; row0 < end; row0 += BF16_ROW_GROUP) {
            const int count = end - row0 < BF16_ROW_GROUP ? (int)(end - row0) : BF16_ROW_GROUP;
            panel_rows_sized(panel, x, k, row0, count, results);
            for (int r = 0; r < count; ++r) {
                store_bf16_panel(out, bias, row0 + r, n, p * PANEL, results + r * PANEL);
            }
        }
    }
    return 0;
}

/*
 * float32: `count` (a constant after inlining, <= F32_ROW_GROUP) activation rows from `row0` against one
 * panel, (+ bias) into out.
 */
ALWAYS_INLINE void f32_panel_rows(float *out, const float *panel, const float *x, const float *bias, int64_t n,
                                  int64_t k, int64_t row0, int count, int64_t first_output)
{
    v16f acc[F32_ROW_GROUP][2];
    for (int r = 0; r < F32_ROW_GROUP; ++r) {
        acc[r][0] = (v16f){0};
        acc[r][1] = (v16f){0};
    }
    for (int64_t i = 0; i < k; ++i) {
        const v16f w0 = load_f32(panel + i * PANEL), w1 = load_f32(panel + i * PANEL + LANES);
        for (int r = 0; r < count; ++r) {
            const float value = x[(row0 + r) * k + i];
            acc[r][0] += value * w0;
            acc[r][1] += value * w1;
        }
    }
    const int64_t outputs = n - first_output < PANEL ? n - first_output : PANEL;
    for (int r = 0; r < count; ++r) {
        float values[PANEL];
        store_f32(values, acc[r][0]);
        store_f32(values + LANES, acc[r][1]);
        float *to = out + (row0 + r) * n + first_output;
        for (int64_t i = 0; i < outputs; ++i) {
            to[i] = bias == NULL ? values[i] : values[i] + bias[first_output + i];
        }
    }
}

static void f32_panel_rows_sized(float *out, const float *panel, const float *x, const float *bias, int64_t n,
                                 int64_t k, int64_t row0, int count, int64_t first_output)
{
#define PDSERVE_F32_ROWS(c) f32_panel_rows(out, panel, x, bias, n, k, row0, c, first_output)
#if F32_ROW_GROUP == 8
    switch (count) {
    case 1: PDSERVE_F32_ROWS(1); break;
    case 2: PDSERVE_F32_ROWS(2); break;
    case 3: PDSERVE_F32_ROWS(3); break;
    case 4: PDSERVE_F32_ROWS(4); break;
    case 5: PDSERVE_F32_ROWS(5); break;
    case 6: PDSERVE_F32_ROWS(6); break;
    case 7: PDSERVE_F32_ROWS(7); break;
    default: PDSERVE_F32_ROWS(8); break;
    }
#else
    if (count == 1) {
        PDSERVE_F32_ROWS(1);
    } else {
        PDSERVE_F32_ROWS(2);
    }
#endif
#undef PDSERVE_F32_ROWS
}

/*
 * out (rows, n) float32 = x (rows, k) float32 @ W.T (+ bias (n,) float32, or NULL). Returns 0.
 * weight: ceil(n / 32) panels x k columns x 32 rows, float32 (see the header).
 */
int64_t pdserve_f32_gemm(float *out, const float *x, const float *weight, const float *bias, int64_t rows,
                         int64_t n, int64_t k, int64_t threads)
{
    const int64_t panels = (n + PANEL - 1) / PANEL, blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t unit = 0; unit < blocks * panels; ++unit) {
        int64_t first, end, p;
        unit_bounds(unit, panels, rows, &first, &end, &p);
        const float *panel = weight + p * k * PANEL;
        for (int64_t row0 = first; row0 < end; row0 += F32_ROW_GROUP) {
            const int count = end - row0 < F32_ROW_GROUP ? (int)(end - row0) : F32_ROW_GROUP;
            f32_panel_rows_sized(out, panel, x, bias, n, k, row0, count, p * PANEL);
        }
    }
    return 0;
}

/*
 * Experts side by side (a mixture-of-experts layer), float32: expert e multiplies rows [offsets[e], offsets[e + 1])
 * of x by its own panels (weights[e], an address, in pdserve_f32_gemm's layout) into the same rows of out, n
 * outputs a row, no bias. The (expert, panel) units of every expert split over the threads in one parallel
 * region, so a layer's experts cost one call instead of one each. Each row's results are the bits
 * pdserve_f32_gemm gives it (a row's sums do not depend on the rows computed with it). Returns 0, or -1 when
 * out of memory.
 */
int64_t pdserve_f32_grouped_gemm(float *out, const float *x, const int64_t *weights, const int64_t *offsets,
                                 int64_t num_experts, int64_t n, int64_t k, int64_t threads)
{
    int64_t num_active;
    int64_t *active = active_experts(offsets, num_experts, &num_active);
    if (active == NULL) {
        return -1;
    }
    const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t unit = 0; unit < num_active * panels; ++unit) {
        const int64_t e = active[unit / panels], p = unit % panels, first = offsets[e], end = offsets[e + 1];
        const float *panel = (const float *)weights[e] + p * k * PANEL;
        for (int64_t row0 = first; row0 < end; row0 += F32_ROW_GROUP) {
            const int count = end - row0 < F32_ROW_GROUP ? (int)(end - row0) : F32_ROW_GROUP;
            f32_panel_rows_sized(out, panel, x, NULL, n, k, row0, count, p * PANEL);
        }
    }
    free(active);
    return 0;
}

/* The float32 path of this build: 2 AVX-512, 1 AVX2, 0 portable C (GCC's vectors of whatever the CPU has). */
int64_t pdserve_f32_path(void)
{
#if defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__)
    return 1;
#else
    return 0;
#endif
}
