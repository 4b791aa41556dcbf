/*
 * The decoder layer's elementwise steps, fused, for CPUs: each replaces several torch ops (and their
 * dispatch, temporaries and passes over memory) with one call. Single-threaded: at decode batch
 * sizes these tensors are a few tens of kilobytes.
 *
 * Tensors are row-major (rows, width), float32 or bfloat16 (is_bf16); bfloat16 results are rounded
 * where the torch ops they replace round, so bfloat16 models see the values they would see in torch
 * up to the order of one float32 sum and a few ulp of exp (now and then one bfloat16 step).
 *
 * rms_norm:  (residual += delta, rounded to the dtype, when delta is not NULL), then
 *            out = weight * (residual * rsqrt(mean(residual^2) + eps)), the normalisation in float32
 *            and the product rounded as `weight * x.to(dtype)` rounds it: Llama's RMSNorm after the
 *            residual add of the sublayer before.
 * silu_mul:  out = silu(gate) * up for gate_up = [gate | up] (each `width` wide), silu rounded to
 *            the dtype before the product, as `silu(gate).mul_(up)` does.
 */
#include "vector.h"

/* Sums of squares and products must round like the torch ops they replace: no fused multiply-add. */
#pragma GCC optimize("fp-contract=off")

ALWAYS_INLINE v16f load_any(const void *p, int64_t at, int is_bf16)
{
    return is_bf16 ? load_bf16((const uint16_t *)p + at) : load_f32((const float *)p + at);
}

ALWAYS_INLINE void store_any(void *p, int64_t at, v16f v, int is_bf16)
{
    if (is_bf16) {
        store_bf16((uint16_t *)p + at, v);
    } else {
        store_f32((float *)p + at, v);
    }
}

/* Elements [at, at + count) of p as a vector, zeros past count (count < 16: a row's tail). */
ALWAYS_INLINE v16f load_part(const void *p, int64_t at, int64_t count, int is_bf16)
{
    v16f v = {0};
    for (int64_t i = 0; i < count; ++i) {
        v[i] = is_bf16 ? bf16_to_float(((const uint16_t *)p)[at + i]) : ((const float *)p)[at + i];
    }
    return v;
}

ALWAYS_INLINE void store_part(void *p, int64_t at, int64_t count, v16f v, int is_bf16)
{
    for (int64_t i = 0; i < count; ++i) {
        if (is_bf16) {
            ((uint16_t *)p)[at + i] = float_to_bf16(v[i]);
        } else {
            ((float *)p)[at + i] = v[i];
        }
    }
}

ALWAYS_INLINE v16f in_dtype(v16f v, int is_bf16)
{
    return is_bf16 ? round_bf16(v) : v;
}

ALWAYS_INLINE void rms_norm(void *out, void *residual, const void *delta, const void *weight, int64_t rows,
                            int64_t width, float eps, int is_bf16)
{
    const int64_t full = width / LANES * LANES;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = r * width;
        v16f squares = {0};
        for (int64_t i = 0; i < width; i += LANES) {
            const int64_t count = width - i < LANES ? width - i : LANES;
            v16f x = count == LANES ? load_any(residual, row + i, is_bf16) : load_part(residual, row + i, count, is_bf16);
            if (delta != NULL) {
                const v16f d = count == LANES ? load_any(delta, row + i, is_bf16) : load_part(delta, row + i, count, is_bf16);
                x = in_dtype(x + d, is_bf16);
                if (count == LANES) {
                    store_any(residual, row + i, x, is_bf16);
                } else {
                    store_part(residual, row + i, count, x, is_bf16);
                }
            }
            squares += x * x;
        }
        const float inv_rms = 1.0f / sqrtf(sum16(squares) / (float)width + eps);
        for (int64_t i = 0; i < width; i += LANES) {
            const int64_t count = width - i < LANES ? width - i : LANES;
            const v16f x = i < full ? load_any(residual, row + i, is_bf16) : load_part(residual, row + i, count, is_bf16);
            const v16f w = i < full ? load_any(weight, i, is_bf16) : load_part(weight, i, count, is_bf16);
            const v16f y = w * in_dtype(x * inv_rms, is_bf16);
            if (i < full) {
                store_any(out, row + i, y, is_bf16);
            } else {
                store_part(out, row + i, count, y, is_bf16);
            }
        }
    }
}

/* silu(x) = x * sigmoid(x), with exp only of -|x| (exp16's domain): sigmoid = 1 / (1 + e) or e / (1 + e). */
ALWAYS_INLINE v16f silu16(v16f x)
{
    const v16i negative = x < 0.0f;
    const v16f e = exp16((v16f)((v16i)x | (v16i)(v16f){-0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f,
                                                         -0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f, -0.0f}));
    const v16f one = (v16f){0} + 1.0f;
    const v16f numerator = (v16f)(((v16i)e & negative) | ((v16i)one & ~negative));
    return x * (numerator / (one + e));
}

ALWAYS_INLINE void silu_mul(void *out, const void *gate_up, int64_t rows, int64_t width, int is_bf16)
{
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t gate = r * 2 * width, up = gate + width, dst = r * width;
        for (int64_t i = 0; i < width; i += LANES) {
            const int64_t count = width - i < LANES ? width - i : LANES;
            if (count == LANES) {
                const v16f g = load_any(gate_up, gate + i, is_bf16), u = load_any(gate_up, up + i, is_bf16);
                store_any(out, dst + i, in_dtype(silu16(g), is_bf16) * u, is_bf16);
            } else {
                const v16f g = load_part(gate_up, gate + i, count, is_bf16), u = load_part(gate_up, up + i, count, is_bf16);
                store_part(out, dst + i, count, in_dtype(silu16(g), is_bf16) * u, is_bf16);
            }
        }
    }
}

void pdserve_rms_norm(void *out, void *residual, const void *delta, const void *weight, int64_t rows, int64_t width,
                      float eps, int64_t is_bf16)
{
    if (is_bf16) {
        rms_norm(out, residual, delta, weight, rows, width, eps, 1);
    } else {
        rms_norm(out, residual, delta, weight, rows, width, eps, 0);
    }
}

void pdserve_silu_mul(void *out, const void *gate_up, int64_t rows, int64_t width, int64_t is_bf16)
{
    if (is_bf16) {
        silu_mul(out, gate_up, rows, width, 1);
    } else {
        silu_mul(out, gate_up, rows, width, 0);
    }
}
