/*
 * 16-lane float32 vectors for the engine's C kernels (GCC/Clang vector extensions: AVX-512 registers
 * where the CPU has them, pairs of AVX2 registers elsewhere), and the conversions and reductions the
 * kernels share. Header-only; every function is inlined into its caller.
 */
#ifndef PDSERVE_VECTOR_H
#define PDSERVE_VECTOR_H

#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#define LANES 16

/* Whether this build multiplies bfloat16 pairs in hardware (AVX512-BF16's vdpbf16ps): 1, else 0. */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PDSERVE_BF16_PATH 1
#else
#define PDSERVE_BF16_PATH 0
#endif

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef int8_t v16b __attribute__((vector_size(16)));

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE v16f load_f32(const float *p)
{
    v16f v;
    memcpy(&v, p, sizeof(v));
    return v;
}

ALWAYS_INLINE void store_f32(float *p, v16f v)
{
    memcpy(p, &v, sizeof(v));
}

ALWAYS_INLINE float bf16_to_float(uint16_t bits)
{
    union { uint32_t u; float f; } value = { .u = (uint32_t)bits << 16 };
    return value.f;
}

ALWAYS_INLINE uint16_t float_to_bf16(float f)
{
    /* Round to nearest even, as torch's .to(torch.bfloat16) does (inputs here are finite). */
    union { float f; uint32_t u; } value = { .f = f };
    return (uint16_t)((value.u + 0x7FFFu + ((value.u >> 16) & 1u)) >> 16);
}

ALWAYS_INLINE v16f load_bf16(const uint16_t *p)
{
    v16h half;
    memcpy(&half, p, sizeof(half));
    v16u bits = __builtin_convertvector(half, v16u) << 16;
    v16f v;
    memcpy(&v, &bits, sizeof(v));
    return v;
}

/* Sixteen floats rounded to nearest even bfloat16, as float_to_bf16 does one. */
ALWAYS_INLINE void store_bf16(uint16_t *p, v16f v)
{
    v16u bits;
    memcpy(&bits, &v, sizeof(bits));
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const v16h half = __builtin_convertvector(bits, v16h);
    memcpy(p, &half, sizeof(half));
}

/* v rounded to bfloat16 and widened back: what a bfloat16 tensor would hold. */
ALWAYS_INLINE v16f round_bf16(v16f v)
{
    v16u bits;
    memcpy(&bits, &v, sizeof(bits));
    bits = ((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16) << 16;
    memcpy(&v, &bits, sizeof(v));
    return v;
}

ALWAYS_INLINE v16f load_int8(const int8_t *p, float scale)
{
#if defined(__AVX512F__)
    /* GCC 12 turns the generic conversion below into sixteen scalar ones. */
    return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))) * scale;
#else
    v16b bytes;
    memcpy(&bytes, p, sizeof(bytes));
    return __builtin_convertvector(bytes, v16f) * scale;
#endif
}

ALWAYS_INLINE float sum16(v16f v)
{
    typedef float v8f __attribute__((vector_size(32)));
    typedef float v4f __attribute__((vector_size(16)));
    v8f half = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f quarter = __builtin_shufflevector(half, half, 0, 1, 2, 3) + __builtin_shufflevector(half, half, 4, 5, 6, 7);
    return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

/* exp(x) for x <= 0, 0 below -87 (under 2^-125).
 * Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial for e^r, times 2^n. */
ALWAYS_INLINE v16f exp16(v16f x)
{
    const v16i underflow = x < -87.0f;
    x = (v16f)(((v16i)x & ~underflow) | ((v16i)(v16f){} & underflow));
    const v16f rounded = x * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: round to integer */
    const v16f n = rounded - 12582912.0f;
    const v16f r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    v16f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const v16f y = p * (r * r) + r + 1.0f;
    const v16i exponent = ((v16i)rounded - 0x4B400000 + 127) << 23; /* the integer n, as 2^n's bits */
    return (v16f)((v16i)(y * (v16f)exponent) & ~underflow);
}

#endif
