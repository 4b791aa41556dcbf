/*
 * Register-only loops of each kernel's inner multiply-add, for benchmarks/instruction_peaks.py: what one
 * core can issue at most, with no memory traffic. Each function runs `iters` rounds of CHAINS independent
 * chains (enough to hide every latency) and returns a value the compiler cannot drop. Every operand is
 * re-made opaque each round (an empty asm), so no chain's product can be hoisted out of the loop.
 */
#include <immintrin.h>
#include <stdint.h>

#define CHAINS 12
#define UNROLL _Pragma("GCC unroll 16")

/* float32 FMA, 256 bits (AVX2): 8 multiply-adds an instruction. */
__attribute__((target("avx2,fma"))) float peak_f32_avx2(int64_t iters)
{
    __m256 acc[CHAINS];
    __m256 x = _mm256_set1_ps(1.0f), y = _mm256_set1_ps(0.0f);
    for (int i = 0; i < CHAINS; ++i) {
        acc[i] = _mm256_set1_ps((float)i);
    }
    for (int64_t n = 0; n < iters; ++n) {
        UNROLL for (int i = 0; i < CHAINS; ++i)
        {
            acc[i] = _mm256_fmadd_ps(acc[i], x, y);
        }
        __asm__ volatile("" : "+x"(x), "+x"(y));
    }
    __m256 sum = acc[0];
    for (int i = 1; i < CHAINS; ++i) {
        sum = _mm256_add_ps(sum, acc[i]);
    }
    return _mm256_cvtss_f32(sum);
}

/* int8 x int8 as the AVX2 INT8 kernel multiplies (quant_gemv.c, dot4_signed): vpsignb, vpmaddubsw,
 * vpmaddwd, vpaddd: 32 multiply-adds. */
__attribute__((target("avx2"))) int32_t peak_int8_avx2(int64_t iters)
{
    __m256i acc[CHAINS], w[CHAINS];
    const __m256i ones = _mm256_set1_epi16(1), x = _mm256_set1_epi8(5), x_abs = _mm256_abs_epi8(x);
    for (int i = 0; i < CHAINS; ++i) {
        acc[i] = _mm256_set1_epi32(i);
        w[i] = _mm256_set1_epi8((char)(i - 3));
    }
    for (int64_t n = 0; n < iters; ++n) {
        UNROLL for (int i = 0; i < CHAINS; ++i)
        {
            const __m256i pairs = _mm256_maddubs_epi16(x_abs, _mm256_sign_epi8(w[i], x));
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(pairs, ones));
            __asm__ volatile("" : "+x"(w[i]));
        }
    }
    __m256i sum = acc[0];
    for (int i = 1; i < CHAINS; ++i) {
        sum = _mm256_add_epi32(sum, acc[i]);
    }
    return _mm256_extract_epi32(sum, 0);
}

/* uint4 x int8 as the AVX2 INT4 kernel multiplies (quant_gemv.c, dot8_nibbles): two nibbles unpacked, two
 * vpmaddubsw summed in 16 bits, vpmaddwd, vpaddd: 64 multiply-adds. */
__attribute__((target("avx2"))) int32_t peak_int4_avx2(int64_t iters)
{
    __m256i acc[CHAINS], bytes[CHAINS];
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i x_low = _mm256_set1_epi8(5), x_high = _mm256_set1_epi8(-7);
    for (int i = 0; i < CHAINS; ++i) {
        acc[i] = _mm256_set1_epi32(i);
        bytes[i] = _mm256_set1_epi8((char)(0x35 + i));
    }
    for (int64_t n = 0; n < iters; ++n) {
        UNROLL for (int i = 0; i < CHAINS; ++i)
        {
            const __m256i low = _mm256_and_si256(bytes[i], mask);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes[i], 4), mask);
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, x_low), _mm256_maddubs_epi16(high, x_high));
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(pairs, ones));
            __asm__ volatile("" : "+x"(bytes[i]));
        }
    }
    __m256i sum = acc[0];
    for (int i = 1; i < CHAINS; ++i) {
        sum = _mm256_add_epi32(sum, acc[i]);
    }
    return _mm256_extract_epi32(sum, 0);
}

/* float32 FMA, 512 bits (AVX-512): 16 multiply-adds an instruction. */
__attribute__((target("avx512f"))) float peak_f32_avx512(int64_t iters)
{
    __m512 acc[CHAINS];
    __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(0.0f);
    for (int i = 0; i < CHAINS; ++i) {
        acc[i] = _mm512_set1_ps((float)i);
    }
    for (int64_t n = 0; n < iters; ++n) {
        UNROLL for (int i = 0; i < CHAINS; ++i)
        {
            acc[i] = _mm512_fmadd_ps(acc[i], x, y);
        }
        __asm__ volatile("" : "+v"(x), "+v"(y));
    }
    __m512 sum = acc[0];
    for (int i = 1; i < CHAINS; ++i) {
        sum = _mm512_add_ps(sum, acc[i]);
    }
    return _mm512_reduce_add_ps(sum);
}

/* int8 as the VNNI kernels multiply: vpdpbusd, 512 bits: 64 multiply-adds an instruction. */
__attribute__((target("avx512f,avx512vnni"))) int32_t peak_int8_vnni(int64_t iters)
{
    __m512i acc[CHAINS];
    __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(-5);
    for (int i = 0; i < CHAINS; ++i) {
        acc[i] = _mm512_set1_epi32(i);
    }
    for (int64_t n = 0; n < iters; ++n) {
        UNROLL for (int i = 0; i < CHAINS; ++i)
        {
            acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
        }
        __asm__ volatile("" : "+v"(w), "+v"(x));
    }
    __m512i sum = acc[0];
    for (int i = 1; i < CHAINS; ++i) {
        sum = _mm512_add_epi32(sum, acc[i]);
    }
    return _mm512_reduce_add_epi32(sum);
}
