/*
 * Every kernel is built once per ISA variant (setup.py: portable, avx2, avx512, avx512_vnni,
 * avx512_bf16), and all the variants are linked into one library (pdserve/engine/kernels/ops.cpp).
 * Built with -DPDSERVE_VARIANT=<variant> and `-include variant.h`, each function the kernels export
 * takes that variant's name (pdserve_int8_gemm -> pdserve_avx2_int8_gemm), in its definition and in
 * every call, so the variants' copies never collide. ops.cpp declares the same list per variant.
 */
#ifndef PDSERVE_VARIANT_H
#define PDSERVE_VARIANT_H

#ifdef PDSERVE_VARIANT
#define PDSERVE_JOIN2(variant, name) pdserve_##variant##_##name
#define PDSERVE_JOIN(variant, name) PDSERVE_JOIN2(variant, name)
#define pdserve_bf16_gemm PDSERVE_JOIN(PDSERVE_VARIANT, bf16_gemm)
#define pdserve_bf16_path PDSERVE_JOIN(PDSERVE_VARIANT, bf16_path)
#define pdserve_f32_gemm PDSERVE_JOIN(PDSERVE_VARIANT, f32_gemm)
#define pdserve_f32_grouped_gemm PDSERVE_JOIN(PDSERVE_VARIANT, f32_grouped_gemm)
#define pdserve_f32_path PDSERVE_JOIN(PDSERVE_VARIANT, f32_path)
#define pdserve_fused_decode PDSERVE_JOIN(PDSERVE_VARIANT, fused_decode)
#define pdserve_fused_decode_struct_sizes PDSERVE_JOIN(PDSERVE_VARIANT, fused_decode_struct_sizes)
#define pdserve_int4_gemm PDSERVE_JOIN(PDSERVE_VARIANT, int4_gemm)
#define pdserve_int8_gemm PDSERVE_JOIN(PDSERVE_VARIANT, int8_gemm)
#define pdserve_int4_grouped_gemm PDSERVE_JOIN(PDSERVE_VARIANT, int4_grouped_gemm)
#define pdserve_int8_grouped_gemm PDSERVE_JOIN(PDSERVE_VARIANT, int8_grouped_gemm)
#define pdserve_lora_shrink_expand PDSERVE_JOIN(PDSERVE_VARIANT, lora_shrink_expand)
#define pdserve_paged_attention PDSERVE_JOIN(PDSERVE_VARIANT, paged_attention)
#define pdserve_paged_attention_openmp PDSERVE_JOIN(PDSERVE_VARIANT, paged_attention_openmp)
#define pdserve_paged_attention_ranges PDSERVE_JOIN(PDSERVE_VARIANT, paged_attention_ranges)
#define pdserve_quant_path PDSERVE_JOIN(PDSERVE_VARIANT, quant_path)
#define pdserve_rms_norm PDSERVE_JOIN(PDSERVE_VARIANT, rms_norm)
#define pdserve_silu_mul PDSERVE_JOIN(PDSERVE_VARIANT, silu_mul)
#define pdserve_store_kv PDSERVE_JOIN(PDSERVE_VARIANT, store_kv)
#endif

#endif
