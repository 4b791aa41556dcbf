/*
 * INT4 and INT8 weight GEMV / small GEMM for CPUs (decode batches): out = x @ W.T, x of `rows` rows.
 *
 * The activation is quantized on the fly to int8 in blocks of 32 (llama.cpp's Q8 approach):
 * d = max|x| / 127 and xq = round(x / d) per block, so that the products are int8 dot products
 * (AVX512-VNNI `vpdpbusd`: 64 multiply-adds an instruction), with one float step per block.
 *
 * Weight layout (both kinds): output rows in tiles of 16, one 32-bit lane per row. For each tile and
 * each block of 32 input columns the 16 rows' bytes are stored so that one 64-byte load feeds one
 * `vpdpbusd` with a broadcast 4 bytes of the activation:
 *   INT8: 8 chunks of (16 rows x 4 columns) bytes, value w + 128 (unsigned, in [1, 255]).
 *   INT4: 4 chunks of (16 rows x 4 bytes); byte i of row r in chunk c holds column c*8 + i in its
 *         low nibble and column c*8 + 4 + i in its high nibble, q in [0, 15].
 * Scales: INT8 one float32 per output row ([tile][16]); INT4 a float16 scale and a float16 minimum
 * per group of input columns ([tile][group][16] each), W = scale * q + minimum.
 *
 * Per block b of an activation row (scale d_b, integer sum s_b of its xq):
 *   INT8: acc += d_b * (sum(wu * xq) - 128 * s_b); out = acc * row_scale
 *   INT4: acc += (scale_g * d_b) * sum(q * xq) + minimum_g * (d_b * s_b)
 * Without VNNI (or AVX-512 BW) the same integer sums come from AVX2 where the CPU has it (llama.cpp's
 * `vpmaddubsw` + `vpmaddwd` pairs: 16-bit pair sums that cannot saturate for these value ranges), else
 * from portable C. All three paths produce the same bits.
 *
 * Work is split over tiles of output rows with OpenMP (when built with it) on `threads` threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "experts.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define QBLOCK 32
#define TILE 16

/* The integer-product path this build uses: 2 AVX512-VNNI, 1 AVX2 (with FMA and F16C), 0 portable C. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PDSERVE_QUANT_PATH 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDSERVE_QUANT_PATH 1
#else
#define PDSERVE_QUANT_PATH 0
#endif

/* Activation rows sharing one pass over a weight tile (their accumulators stay in registers): eight
 * independent chains of vpdpbusd keep AVX-512's 32 registers busy; AVX2's 16 hold four. Each row's
 * sums are the same in any grouping. */
#if PDSERVE_QUANT_PATH == 2
#define ROW_GROUP 8
#else
#define ROW_GROUP 4
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef struct {
    int8_t *xq;       /* (rows, k) */
    float *d;         /* (rows, k / 32) */
    int32_t *sums;    /* (rows, k / 32) */
} QuantizedRows;

static float bf16_to_f32(uint16_t bits)
{
    union { uint32_t u; float f; } v = { .u = (uint32_t)bits << 16 };
    return v.f;
}

static uint16_t f32_to_bf16(float f)
{
    union { float f; uint32_t u; } v = { .f = f };
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

#if PDSERVE_QUANT_PATH == 0
static float f16_to_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    union { uint32_t u; float f; } v;
    if (exponent == 0) {
        /* Zero or subnormal: mantissa * 2^-24. */
        v.f = (float)mantissa * 5.9604644775390625e-8f;
        v.u |= sign;
        return v.f;
    }
    if (exponent == 31) {
        v.u = sign | 0x7F800000u | (mantissa << 13);
        return v.f;
    }
    v.u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    return v.f;
}
#endif

#if PDSERVE_QUANT_PATH == 2
/* Sixteen values of an activation row from `at`, as float32. */
ALWAYS_INLINE __m512 load16(const void *x, int is_bf16, int64_t at)
{
    if (is_bf16) {
        const __m256i bits = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + at));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
    return _mm512_loadu_ps((const float *)x + at);
}
#endif

/* One activation row (float32 or bf16, k elements, k % 32 == 0) quantized per block of 32. The AVX-512
 * build does in vectors what the loop below does per element, with the same bits: max |x| is exact in
 * any order, the product is one float32 multiply, and vcvtps2dq rounds half to even as nearbyintf does
 * in the default rounding mode. */
static void quantize_row(const void *x, int is_bf16, int64_t k, int8_t *xq, float *d, int32_t *sums)
{
#if PDSERVE_QUANT_PATH == 2
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t b = 0; b < k / QBLOCK; ++b) {
        const __m512 v0 = load16(x, is_bf16, b * QBLOCK), v1 = load16(x, is_bf16, b * QBLOCK + 16);
        /* max(|v|, acc) keeps acc where |v| is NaN, as fmaxf does; acc starts at 0 as amax does. */
        __m512 largest = _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_setzero_ps());
        largest = _mm512_max_ps(_mm512_andnot_ps(sign, v1), largest);
        const float amax = _mm512_reduce_max_ps(largest);
        const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
        _mm_storeu_si128((__m128i *)(xq + b * QBLOCK), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(xq + b * QBLOCK + 16), _mm512_cvtepi32_epi8(q1));
        d[b] = amax / 127.0f;
        sums[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
#else
    for (int64_t b = 0; b < k / QBLOCK; ++b) {
        float values[QBLOCK];
        for (int i = 0; i < QBLOCK; ++i) {
            const int64_t at = b * QBLOCK + i;
            values[i] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[at]) : ((const float *)x)[at];
        }
        float amax = 0.0f;
        for (int i = 0; i < QBLOCK; ++i) {
            amax = fmaxf(amax, fabsf(values[i]));
        }
        const float scale = amax / 127.0f;
        const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < QBLOCK; ++i) {
            /* Round half to even, as torch.round does. */
            const int32_t q = (int32_t)nearbyintf(values[i] * inverse);
            xq[b * QBLOCK + i] = (int8_t)q;
            sum += q;
        }
        d[b] = scale;
        sums[b] = sum;
    }
#endif
}

/* Activation elements from which quantizing splits its rows over the threads (below, a parallel region
 * costs more than it saves). */
#define PARALLEL_QUANTIZE_MIN_ELEMENTS 16384

/* Every row quantized on its own, so splitting the rows over `threads` changes no bit. */
static int quantize_rows(const void *x, int is_bf16, int64_t rows, int64_t k, int64_t threads, QuantizedRows *out)
{
    const int64_t blocks = k / QBLOCK;
    if (rows <= 0) {
        out->xq = NULL;
        out->d = NULL;
        out->sums = NULL;
        return 0;
    }
    out->xq = malloc((size_t)(rows * k));
    out->d = malloc((size_t)(rows * blocks) * sizeof(float));
    out->sums = malloc((size_t)(rows * blocks) * sizeof(int32_t));
    if (out->xq == NULL || out->d == NULL || out->sums == NULL) {
        return -1;
    }
    const size_t element = is_bf16 ? 2 : 4;
    (void)threads; /* unused without OpenMP */
#pragma omp parallel for schedule(static) num_threads(threads) \
    if (threads > 1 && rows > 1 && rows * k >= PARALLEL_QUANTIZE_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        quantize_row((const char *)x + (size_t)(r * k) * element, is_bf16, k, out->xq + r * k, out->d + r * blocks,
                     out->sums + r * blocks);
    }
    return 0;
}

static void free_rows(QuantizedRows *rows)
{
    free(rows->xq);
    free(rows->d);
    free(rows->sums);
}

/* Outputs whose rows are at least this wide (an LM head's), with at least STREAM_MIN_ROWS rows, are written
 * with non-temporal stores (AVX-512, float32): each tile writes a cache line in every row, and lines of an
 * output that large are not in cache, so an ordinary store first reads each one from memory. Measured on a
 * Zen 4 (SmolLM2's head, 49,152 x 576 INT8, one core): 32 rows 7.7 -> 6.4 ms, 8 rows 2.0 -> 1.5 ms; one row
 * 0.67 -> 0.79 ms (its 196 KB stay in cache), hence the row minimum. */
#define STREAM_MIN_N 16384
#define STREAM_MIN_ROWS 4

static int stream_output(int64_t rows, int64_t n, int64_t is_bf16)
{
#if PDSERVE_QUANT_PATH == 2
    return !is_bf16 && n >= STREAM_MIN_N && rows >= STREAM_MIN_ROWS && n % TILE == 0;
#else
    (void)rows, (void)n, (void)is_bf16;
    return 0;
#endif
}

/* Sixteen results of a tile for one activation row into out (row-major, `n` outputs a row); `stream`
 * (stream_output): a non-temporal store where the row is a whole aligned cache line, which the caller's
 * thread fences (_mm_sfence) before the results are read. */
static void store_tile(void *out, int is_bf16, int64_t row, int64_t n, int64_t first, const float *values,
                       int stream)
{
    const int64_t count = n - first < TILE ? n - first : TILE;
    if (count == TILE && is_bf16) {
        /* One vector store a row: 16 scalar stores to a line that is not cached fill the store buffer while
         * the line is fetched. */
        uint16_t bits[TILE];
        for (int i = 0; i < TILE; ++i) {
            bits[i] = f32_to_bf16(values[i]);
        }
        memcpy((uint16_t *)out + row * n + first, bits, sizeof(bits));
        return;
    }
    if (count == TILE) {
        float *dst = (float *)out + row * n + first;
#if PDSERVE_QUANT_PATH == 2
        if (stream && ((uintptr_t)dst & 63) == 0) {
            _mm512_stream_ps(dst, _mm512_loadu_ps(values));
            return;
        }
#endif
        memcpy(dst, values, TILE * sizeof(float));
        return;
    }
    (void)stream;
    for (int64_t i = 0; i < count; ++i) {
        if (is_bf16) {
            ((uint16_t *)out)[row * n + first + i] = f32_to_bf16(values[i]);
        } else {
            ((float *)out)[row * n + first + i] = values[i];
        }
    }
}

#if PDSERVE_QUANT_PATH == 2

ALWAYS_INLINE __m512i broadcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* INT8: `count` (<= ROW_GROUP) activation rows from `row0` against tile t. */
ALWAYS_INLINE void int8_tile(const uint8_t *tile, const float *row_scales, const QuantizedRows *x, int64_t row0,
                             int count, int64_t k, float *results)
{
    const int64_t blocks = k / QBLOCK;
    __m512 acc[ROW_GROUP];
    for (int r = 0; r < ROW_GROUP; ++r) {
        acc[r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *w = tile + b * QBLOCK * TILE;
        __m512i chunks[8];
        for (int c = 0; c < 8; ++c) {
            chunks[c] = _mm512_loadu_si512((const void *)(w + c * 64));
        }
        for (int r = 0; r < ROW_GROUP; ++r) {
            if (r >= count) {
                break;
            }
            const int8_t *xq = x->xq + (row0 + r) * k + b * QBLOCK;
            __m512i isum = _mm512_setzero_si512();
            for (int c = 0; c < 8; ++c) {
                isum = _mm512_dpbusd_epi32(isum, chunks[c], broadcast4(xq + c * 4));
            }
            const int64_t at = (row0 + r) * blocks + b;
            isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(128 * x->sums[at]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(x->d[at]), acc[r]);
        }
    }
    const __m512 scales = _mm512_loadu_ps(row_scales);
    for (int r = 0; r < count; ++r) {
        _mm512_storeu_ps(results + r * TILE, _mm512_mul_ps(acc[r], scales));
    }
}

#define PAIR_ROW_GROUP 4
/* Activation rows from which int8 GEMMs take tiles in pairs: measured on a Zen 4 against a build with
 * -DPDSERVE_NO_TILE_PAIRS, pairs ran 1.1-1.2x faster from 32 rows, and slower at 1-8 rows of a weight
 * streamed from memory (the LM head: 0.64x at 1 row, 0.78x at 8). */
#define PAIR_MIN_ROWS 16

/* INT8: `count` (<= PAIR_ROW_GROUP) activation rows from `row0` against two tiles at once, so that each
 * broadcast of 4 activation bytes feeds two vpdpbusd (one per tile). Each tile's sums are int8_tile's. */
ALWAYS_INLINE void int8_tile_pair(const uint8_t *tile_a, const uint8_t *tile_b, const float *scales_a,
                                  const float *scales_b, const QuantizedRows *x, int64_t row0, int count, int64_t k,
                                  float *results_a, float *results_b)
{
    const int64_t blocks = k / QBLOCK;
    __m512 acc_a[PAIR_ROW_GROUP], acc_b[PAIR_ROW_GROUP];
    for (int r = 0; r < PAIR_ROW_GROUP; ++r) {
        acc_a[r] = _mm512_setzero_ps();
        acc_b[r] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *wa = tile_a + b * QBLOCK * TILE, *wb = tile_b + b * QBLOCK * TILE;
        __m512i sum_a[PAIR_ROW_GROUP], sum_b[PAIR_ROW_GROUP];
        for (int r = 0; r < PAIR_ROW_GROUP; ++r) {
            sum_a[r] = _mm512_setzero_si512();
            sum_b[r] = _mm512_setzero_si512();
        }
        for (int c = 0; c < 8; ++c) {
            const __m512i chunk_a = _mm512_loadu_si512((const void *)(wa + c * 64));
            const __m512i chunk_b = _mm512_loadu_si512((const void *)(wb + c * 64));
            for (int r = 0; r < PAIR_ROW_GROUP; ++r) {
                if (r >= count) {
                    break;
                }
                const __m512i x4 = broadcast4(x->xq + (row0 + r) * k + b * QBLOCK + c * 4);
                sum_a[r] = _mm512_dpbusd_epi32(sum_a[r], chunk_a, x4);
                sum_b[r] = _mm512_dpbusd_epi32(sum_b[r], chunk_b, x4);
            }
        }
        for (int r = 0; r < PAIR_ROW_GROUP; ++r) {
            if (r >= count) {
                break;
            }
            const int64_t at = (row0 + r) * blocks + b;
            const __m512i correction = _mm512_set1_epi32(128 * x->sums[at]);
            const __m512 d = _mm512_set1_ps(x->d[at]);
            acc_a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum_a[r], correction)), d, acc_a[r]);
            acc_b[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum_b[r], correction)), d, acc_b[r]);
        }
    }
    const __m512 row_scales_a = _mm512_loadu_ps(scales_a), row_scales_b = _mm512_loadu_ps(scales_b);
    for (int r = 0; r < count; ++r) {
        _mm512_storeu_ps(results_a + r * TILE, _mm512_mul_ps(acc_a[r], row_scales_a));
        _mm512_storeu_ps(results_b + r * TILE, _mm512_mul_ps(acc_b[r], row_scales_b));
    }
}

/* INT4: `count` (<= ROW_GROUP) activation rows from `row0` against tile t. */
ALWAYS_INLINE void int4_tile(const uint8_t *tile, const uint16_t *scales, const uint16_t *minimums,
                             int64_t group_size, const QuantizedRows *x, int64_t row0, int count, int64_t k,
                             float *results)
{
    const int64_t blocks = k / QBLOCK, blocks_per_group = group_size / QBLOCK;
    __m512 acc[ROW_GROUP];
    for (int r = 0; r < ROW_GROUP; ++r) {
        acc[r] = _mm512_setzero_ps();
    }
    const __m512i low_mask = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *w = tile + b * (QBLOCK / 2) * TILE;
        __m512i low[4], high[4];
        for (int c = 0; c < 4; ++c) {
            const __m512i bytes = _mm512_loadu_si512((const void *)(w + c * 64));
            low[c] = _mm512_and_si512(bytes, low_mask);
            high[c] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_mask);
        }
        const int64_t g = b / blocks_per_group;
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + g * TILE)));
        const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(minimums + g * TILE)));
        for (int r = 0; r < ROW_GROUP; ++r) {
            if (r >= count) {
                break;
            }
            const int8_t *xq = x->xq + (row0 + r) * k + b * QBLOCK;
            __m512i isum = _mm512_setzero_si512();
            for (int c = 0; c < 4; ++c) {
                isum = _mm512_dpbusd_epi32(isum, low[c], broadcast4(xq + c * 8));
                isum = _mm512_dpbusd_epi32(isum, high[c], broadcast4(xq + c * 8 + 4));
            }
            const int64_t at = (row0 + r) * blocks + b;
            const float d = x->d[at];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scale, _mm512_set1_ps(d)), acc[r]);
            acc[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(d * (float)x->sums[at]), acc[r]);
        }
    }
    for (int r = 0; r < count; ++r) {
        _mm512_storeu_ps(results + r * TILE, acc[r]);
    }
}

#elif PDSERVE_QUANT_PATH == 1 /* AVX2: each 64-byte chunk of a tile is two 32-byte halves, rows 0-7 and 8-15 */

ALWAYS_INLINE __m256i broadcast4(const int8_t *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Per 32-bit lane, the sum of its 4 products w * x (w, x signed in [-127, 127]): |x| times w carrying
 * x's sign, so `vpmaddubsw` sees an unsigned operand; a pair of products is at most 2 * 127 * 127. */
ALWAYS_INLINE __m256i dot4_signed(__m256i w, __m256i x4, __m256i x4_abs, __m256i ones)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(x4_abs, _mm256_sign_epi8(w, x4)), ones);
}

/* INT8: `count` (<= ROW_GROUP) activation rows from `row0` against tile t. The stored w + 128 flipped
 * back to w by its top bit; the sums are then sum(w * xq), which is the VNNI path's sum(wu * xq) - 128 * s. */
ALWAYS_INLINE void int8_tile(const uint8_t *tile, const float *row_scales, const QuantizedRows *x, int64_t row0,
                             int count, int64_t k, float *results)
{
    const int64_t blocks = k / QBLOCK;
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_GROUP][2];
    for (int r = 0; r < ROW_GROUP; ++r) {
        acc[r][0] = _mm256_setzero_ps();
        acc[r][1] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *w = tile + b * QBLOCK * TILE;
        for (int r = 0; r < ROW_GROUP; ++r) {
            if (r >= count) {
                break;
            }
            const int8_t *xq = x->xq + (row0 + r) * k + b * QBLOCK;
            __m256i low = _mm256_setzero_si256(), high = _mm256_setzero_si256();
            for (int c = 0; c < 8; ++c) {
                const __m256i x4 = broadcast4(xq + c * 4), x4_abs = _mm256_abs_epi8(x4);
                const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + c * 64)), flip);
                const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + c * 64 + 32)), flip);
                low = _mm256_add_epi32(low, dot4_signed(w0, x4, x4_abs, ones));
                high = _mm256_add_epi32(high, dot4_signed(w1, x4, x4_abs, ones));
            }
            const __m256 d = _mm256_set1_ps(x->d[(row0 + r) * blocks + b]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), d, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), d, acc[r][1]);
        }
    }
    const __m256 scales0 = _mm256_loadu_ps(row_scales), scales1 = _mm256_loadu_ps(row_scales + 8);
    for (int r = 0; r < count; ++r) {
        _mm256_storeu_ps(results + r * TILE, _mm256_mul_ps(acc[r][0], scales0));
        _mm256_storeu_ps(results + r * TILE + 8, _mm256_mul_ps(acc[r][1], scales1));
    }
}

/* Per 32-bit lane, sum(q_low * x_low) + sum(q_high * x_high) of 4 bytes (q in [0, 15]): every 16-bit
 * partial sum is at most 4 * 15 * 127. */
ALWAYS_INLINE __m256i dot8_nibbles(__m256i bytes, __m256i low_mask, __m256i x_low, __m256i x_high, __m256i ones)
{
    const __m256i low = _mm256_and_si256(bytes, low_mask);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask);
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, x_low), _mm256_maddubs_epi16(high, x_high));
    return _mm256_madd_epi16(pairs, ones);
}

/* INT4: `count` (<= ROW_GROUP) activation rows from `row0` against tile t. */
ALWAYS_INLINE void int4_tile(const uint8_t *tile, const uint16_t *scales, const uint16_t *minimums,
                             int64_t group_size, const QuantizedRows *x, int64_t row0, int count, int64_t k,
                             float *results)
{
    const int64_t blocks = k / QBLOCK, blocks_per_group = group_size / QBLOCK;
    const __m256i low_mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[ROW_GROUP][2];
    for (int r = 0; r < ROW_GROUP; ++r) {
        acc[r][0] = _mm256_setzero_ps();
        acc[r][1] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *w = tile + b * (QBLOCK / 2) * TILE;
        const int64_t g = b / blocks_per_group;
        const __m256 scale0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + g * TILE)));
        const __m256 scale1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + g * TILE + 8)));
        const __m256 minimum0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(minimums + g * TILE)));
        const __m256 minimum1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(minimums + g * TILE + 8)));
        for (int r = 0; r < ROW_GROUP; ++r) {
            if (r >= count) {
                break;
            }
            const int8_t *xq = x->xq + (row0 + r) * k + b * QBLOCK;
            __m256i low = _mm256_setzero_si256(), high = _mm256_setzero_si256();
            for (int c = 0; c < 4; ++c) {
                const __m256i x_low = broadcast4(xq + c * 8), x_high = broadcast4(xq + c * 8 + 4);
                const __m256i bytes0 = _mm256_loadu_si256((const __m256i *)(w + c * 64));
                const __m256i bytes1 = _mm256_loadu_si256((const __m256i *)(w + c * 64 + 32));
                low = _mm256_add_epi32(low, dot8_nibbles(bytes0, low_mask, x_low, x_high, ones));
                high = _mm256_add_epi32(high, dot8_nibbles(bytes1, low_mask, x_low, x_high, ones));
            }
            const int64_t at = (row0 + r) * blocks + b;
            const float d = x->d[at];
            const __m256 vd = _mm256_set1_ps(d), vds = _mm256_set1_ps(d * (float)x->sums[at]);
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), _mm256_mul_ps(scale0, vd), acc[r][0]);
            acc[r][0] = _mm256_fmadd_ps(minimum0, vds, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high), _mm256_mul_ps(scale1, vd), acc[r][1]);
            acc[r][1] = _mm256_fmadd_ps(minimum1, vds, acc[r][1]);
        }
    }
    for (int r = 0; r < count; ++r) {
        _mm256_storeu_ps(results + r * TILE, acc[r][0]);
        _mm256_storeu_ps(results + r * TILE + 8, acc[r][1]);
    }
}

#else /* portable C: the same integer sums and float steps, lane by lane */

static void int8_tile(const uint8_t *tile, const float *row_scales, const QuantizedRows *x, int64_t row0, int count,
                      int64_t k, float *results)
{
    const int64_t blocks = k / QBLOCK;
    for (int r = 0; r < count; ++r) {
        float acc[TILE] = {0};
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t *w = tile + b * QBLOCK * TILE;
            const int8_t *xq = x->xq + (row0 + r) * k + b * QBLOCK;
            const int64_t at = (row0 + r) * blocks + b;
            for (int lane = 0; lane < TILE; ++lane) {
                int32_t isum = 0;
                for (int c = 0; c < 8; ++c) {
                    for (int i = 0; i < 4; ++i) {
                        isum += (int32_t)w[c * 64 + lane * 4 + i] * (int32_t)xq[c * 4 + i];
                    }
                }
                isum -= 128 * x->sums[at];
                acc[lane] = fmaf((float)isum, x->d[at], acc[lane]);
            }
        }
        for (int lane = 0; lane < TILE; ++lane) {
            results[r * TILE + lane] = acc[lane] * row_scales[lane];
        }
    }
}

static void int4_tile(const uint8_t *tile, const uint16_t *scales, const uint16_t *minimums, int64_t group_size,
                      const QuantizedRows *x, int64_t row0, int count, int64_t k, float *results)
{
    const int64_t blocks = k / QBLOCK, blocks_per_group = group_size / QBLOCK;
    for (int r = 0; r < count; ++r) {
        float acc[TILE] = {0};
        for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t *w = tile + b * (QBLOCK / 2) * TILE;
            const int8_t *xq = x->xq + (row0 + r) * k + b * QBLOCK;
            const int64_t at = (row0 + r) * blocks + b, g = b / blocks_per_group;
            const float d = x->d[at];
            for (int lane = 0; lane < TILE; ++lane) {
                int32_t isum = 0;
                for (int c = 0; c < 4; ++c) {
                    for (int i = 0; i < 4; ++i) {
                        const uint8_t byte = w[c * 64 + lane * 4 + i];
                        isum += (int32_t)(byte & 15) * (int32_t)xq[c * 8 + i];
                        isum += (int32_t)(byte >> 4) * (int32_t)xq[c * 8 + 4 + i];
                    }
                }
                const float scale = f16_to_f32(scales[g * TILE + lane]), minimum = f16_to_f32(minimums[g * TILE + lane]);
                acc[lane] = fmaf((float)isum, scale * d, acc[lane]);
                acc[lane] = fmaf(minimum, d * (float)x->sums[at], acc[lane]);
            }
        }
        for (int lane = 0; lane < TILE; ++lane) {
            results[r * TILE + lane] = acc[lane];
        }
    }
}

#endif

/* The integer-product path of this build: 2 AVX512-VNNI, 1 AVX2, 0 portable C. */
int64_t pdserve_quant_path(void)
{
    return PDSERVE_QUANT_PATH;
}

/* Every activation row against tile t alone, in row groups, into out. */
static void int8_one_tile(void *out, int is_bf16, const uint8_t *qweight, const float *row_scales,
                          const QuantizedRows *quantized, int64_t rows, int64_t n, int64_t k, int64_t t, int stream)
{
    float results[ROW_GROUP * TILE];
    for (int64_t row0 = 0; row0 < rows; row0 += ROW_GROUP) {
        const int count = rows - row0 < ROW_GROUP ? (int)(rows - row0) : ROW_GROUP;
        int8_tile(qweight + t * k * TILE, row_scales + t * TILE, quantized, row0, count, k, results);
        for (int r = 0; r < count; ++r) {
            store_tile(out, is_bf16, row0 + r, n, t * TILE, results + r * TILE, stream);
        }
    }
}

/* Called by every thread that wrote with stream set, after its last store (see store_tile). */
static void fence_streamed(int stream)
{
#if PDSERVE_QUANT_PATH == 2
    if (stream) {
        _mm_sfence();
    }
#else
    (void)stream;
#endif
}

/*
 * out (rows, n) = x (rows, k) @ W.T for INT8 tiles (see the header). Returns 0, or -1 when out of memory.
 * qweight: (ceil(n / 16) tiles) x (k / 32 blocks) x 512 bytes; row_scales: ceil(n / 16) * 16 floats.
 */
int64_t pdserve_int8_gemm(void *out, const void *x, const uint8_t *qweight, const float *row_scales, int64_t rows,
                          int64_t n, int64_t k, int64_t is_bf16, int64_t threads)
{
    QuantizedRows quantized;
    if (quantize_rows(x, (int)is_bf16, rows, k, threads, &quantized) != 0) {
        free_rows(&quantized);
        return -1;
    }
    const int64_t tiles = (n + TILE - 1) / TILE;
#if PDSERVE_QUANT_PATH == 2 && !defined(PDSERVE_NO_TILE_PAIRS)
    /* From PAIR_MIN_ROWS rows, tiles in pairs (the last one alone when their number is odd); fewer rows
     * stream the weight, which one tile at a time reads in order. */
    const int64_t step = rows >= PAIR_MIN_ROWS ? 2 : 1;
#else
    const int64_t step = 1;
#endif
    const int stream = stream_output(rows, n, is_bf16);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static) nowait
    for (int64_t unit = 0; unit < (tiles + step - 1) / step; ++unit) {
        const int64_t t = step * unit;
        if (step == 1 || t + 1 == tiles) {
            int8_one_tile(out, (int)is_bf16, qweight, row_scales, &quantized, rows, n, k, t, stream);
            continue;
        }
#if PDSERVE_QUANT_PATH == 2 && !defined(PDSERVE_NO_TILE_PAIRS)
        float results[2][PAIR_ROW_GROUP * TILE];
        const uint8_t *tile = qweight + t * k * TILE;
        for (int64_t row0 = 0; row0 < rows; row0 += PAIR_ROW_GROUP) {
            const int count = rows - row0 < PAIR_ROW_GROUP ? (int)(rows - row0) : PAIR_ROW_GROUP;
            int8_tile_pair(tile, tile + k * TILE, row_scales + t * TILE, row_scales + (t + 1) * TILE, &quantized,
                           row0, count, k, results[0], results[1]);
            for (int r = 0; r < count; ++r) {
                store_tile(out, (int)is_bf16, row0 + r, n, t * TILE, results[0] + r * TILE, stream);
                store_tile(out, (int)is_bf16, row0 + r, n, (t + 1) * TILE, results[1] + r * TILE, stream);
            }
        }
#endif
    }
    fence_streamed(stream);
    }
    free_rows(&quantized);
    return 0;
}

/*
 * out (rows, n) = x (rows, k) @ W.T for INT4 tiles (see the header). Returns 0, or -1 when out of memory.
 * qweight: tiles x (k / 32 blocks) x 256 bytes; scales, minimums: tiles x (k / group_size) x 16 float16.
 */
int64_t pdserve_int4_gemm(void *out, const void *x, const uint8_t *qweight, const uint16_t *scales,
                          const uint16_t *minimums, int64_t group_size, int64_t rows, int64_t n, int64_t k,
                          int64_t is_bf16, int64_t threads)
{
    QuantizedRows quantized;
    if (quantize_rows(x, (int)is_bf16, rows, k, threads, &quantized) != 0) {
        free_rows(&quantized);
        return -1;
    }
    const int64_t tiles = (n + TILE - 1) / TILE, groups = k / group_size;
    const int stream = stream_output(rows, n, is_bf16);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tiles; ++t) {
        float results[ROW_GROUP * TILE];
        const uint8_t *tile = qweight + t * (k / 2) * TILE;
        for (int64_t row0 = 0; row0 < rows; row0 += ROW_GROUP) {
            const int count = rows - row0 < ROW_GROUP ? (int)(rows - row0) : ROW_GROUP;
            int4_tile(tile, scales + t * groups * TILE, minimums + t * groups * TILE, group_size, &quantized, row0,
                      count, k, results);
            for (int r = 0; r < count; ++r) {
                store_tile(out, (int)is_bf16, row0 + r, n, t * TILE, results + r * TILE, stream);
            }
        }
    }
    fence_streamed(stream);
    }
    free_rows(&quantized);
    return 0;
}

/*
 * Experts side by side (a mixture-of-experts layer): expert e multiplies rows [offsets[e], offsets[e + 1]) of
 * x by its own weight into the same rows of out, n outputs a row. The activation is quantized once for all
 * rows, and the (expert, tile) units of every expert with rows split over the threads in one parallel region,
 * so a layer's experts cost one call instead of one each. Each row's results are the bits pdserve_int8_gemm /
 * pdserve_int4_gemm give for it (every row is quantized alone; a tile's sums do not depend on its partners).
 * weights[e], row_scales[e] (INT8) or scales[e], minimums[e] (INT4): addresses of expert e's tensors in the
 * layouts above; offsets: num_experts + 1 non-decreasing row indices from 0. Returns 0, or -1 when out of memory.
 */
int64_t pdserve_int8_grouped_gemm(void *out, const void *x, const int64_t *weights, const int64_t *row_scales,
                                  const int64_t *offsets, int64_t num_experts, int64_t n, int64_t k, int64_t is_bf16,
                                  int64_t threads)
{
    QuantizedRows quantized;
    if (quantize_rows(x, (int)is_bf16, offsets[num_experts], k, threads, &quantized) != 0) {
        free_rows(&quantized);
        return -1;
    }
    int64_t num_active;
    int64_t *active = active_experts(offsets, num_experts, &num_active);
    if (active == NULL) {
        free_rows(&quantized);
        return -1;
    }
    const int64_t tiles = (n + TILE - 1) / TILE, blocks = k / QBLOCK;
    const size_t element = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t unit = 0; unit < num_active * tiles; ++unit) {
        const int64_t e = active[unit / tiles], t = unit % tiles, first = offsets[e], count = offsets[e + 1] - first;
        const QuantizedRows rows = {quantized.xq + first * k, quantized.d + first * blocks,
                                    quantized.sums + first * blocks};
        int8_one_tile((char *)out + (size_t)(first * n) * element, (int)is_bf16, (const uint8_t *)weights[e],
                      (const float *)row_scales[e], &rows, count, n, k, t, 0);
    }
    free(active);
    free_rows(&quantized);
    return 0;
}

int64_t pdserve_int4_grouped_gemm(void *out, const void *x, const int64_t *weights, const int64_t *scales,
                                  const int64_t *minimums, int64_t group_size, const int64_t *offsets,
                                  int64_t num_experts, int64_t n, int64_t k, int64_t is_bf16, int64_t threads)
{
    QuantizedRows quantized;
    if (quantize_rows(x, (int)is_bf16, offsets[num_experts], k, threads, &quantized) != 0) {
        free_rows(&quantized);
        return -1;
    }
    int64_t num_active;
    int64_t *active = active_experts(offsets, num_experts, &num_active);
    if (active == NULL) {
        free_rows(&quantized);
        return -1;
    }
    const int64_t tiles = (n + TILE - 1) / TILE, blocks = k / QBLOCK, groups = k / group_size;
    const size_t element = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t unit = 0; unit < num_active * tiles; ++unit) {
        const int64_t e = active[unit / tiles], t = unit % tiles, first = offsets[e], count = offsets[e + 1] - first;
        const QuantizedRows rows = {quantized.xq + first * k, quantized.d + first * blocks,
                                    quantized.sums + first * blocks};
        void *expert_out = (char *)out + (size_t)(first * n) * element;
        const uint8_t *tile = (const uint8_t *)weights[e] + t * (k / 2) * TILE;
        const uint16_t *tile_scales = (const uint16_t *)scales[e] + t * groups * TILE;
        const uint16_t *tile_minimums = (const uint16_t *)minimums[e] + t * groups * TILE;
        float results[ROW_GROUP * TILE];
        for (int64_t row0 = 0; row0 < count; row0 += ROW_GROUP) {
            const int c = count - row0 < ROW_GROUP ? (int)(count - row0) : ROW_GROUP;
            int4_tile(tile, tile_scales, tile_minimums, group_size, &rows, row0, c, k, results);
            for (int r = 0; r < c; ++r) {
                store_tile(expert_out, (int)is_bf16, row0 + r, n, t * TILE, results + r * TILE, 0);
            }
        }
    }
    free(active);
    free_rows(&quantized);
    return 0;
}
