// The engine's CPU kernels as torch operators: torch.ops.pdserve.<name>(variant, ...).
//
// The C kernels (fused_decode.c, which includes the others whole) are compiled once per ISA variant,
// each copy's functions renamed after its variant (variant.h), and linked into this one library with
// this file. Every operator takes the variant to run as its first argument, an index into kVariants:
// the caller (pdserve/engine/native.py) chooses the best one the CPU runs, or the one an override names,
// and passes it on; nothing here is global. Operators keep the C functions' arguments, with tensors
// where the C side takes a pointer: the Python wrappers check every layout before calling, as the C
// side trusts them.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

extern "C" int pdserve_openmp_team(int threads);

#define PDSERVE_DECLARE(v)                                                                                       \
    extern "C" {                                                                                                 \
    int64_t pdserve_##v##_bf16_path(void);                                                                       \
    int64_t pdserve_##v##_f32_path(void);                                                                        \
    int64_t pdserve_##v##_quant_path(void);                                                                      \
    int pdserve_##v##_paged_attention_openmp(void);                                                             \
    int64_t pdserve_##v##_bf16_gemm(uint16_t *, const uint16_t *, const uint16_t *, const uint16_t *, int64_t,  \
                                    int64_t, int64_t, int64_t);                                                  \
    int64_t pdserve_##v##_f32_gemm(float *, const float *, const float *, const float *, int64_t, int64_t,       \
                                   int64_t, int64_t);                                                            \
    int64_t pdserve_##v##_f32_grouped_gemm(float *, const float *, const int64_t *, const int64_t *, int64_t,    \
                                           int64_t, int64_t, int64_t);                                           \
    int64_t pdserve_##v##_int8_gemm(void *, const void *, const uint8_t *, const float *, int64_t, int64_t,      \
                                    int64_t, int64_t, int64_t);                                                  \
    int64_t pdserve_##v##_int8_grouped_gemm(void *, const void *, const int64_t *, const int64_t *,              \
                                            const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t);       \
    int64_t pdserve_##v##_int4_grouped_gemm(void *, const void *, const int64_t *, const int64_t *,              \
                                            const int64_t *, int64_t, const int64_t *, int64_t, int64_t,         \
                                            int64_t, int64_t, int64_t);                                          \
    int64_t pdserve_##v##_int4_gemm(void *, const void *, const uint8_t *, const uint16_t *, const uint16_t *,   \
                                    int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);                       \
    int pdserve_##v##_paged_attention_ranges(void *, const void *, int64_t, int64_t, const void *, const void *, \
                                             int64_t, const float *, const float *, const int64_t *,             \
                                             const int64_t *, const int64_t *, const int64_t *, const int64_t *, \
                                             int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float,        \
                                             int64_t, float);                                                    \
    int pdserve_##v##_store_kv(const void *, const void *, int64_t, int64_t, int64_t, void *, void *, int64_t,   \
                               float *, float *, const int64_t *, int64_t, int64_t, int64_t, int64_t);           \
    void pdserve_##v##_rms_norm(void *, void *, const void *, const void *, int64_t, int64_t, float, int64_t);   \
    void pdserve_##v##_silu_mul(void *, const void *, int64_t, int64_t, int64_t);                               \
    int64_t pdserve_##v##_lora_shrink_expand(void *, const void *, const void *, const void *, const int64_t *,  \
                                             const int64_t *, const int64_t *, const float *, const int64_t *,   \
                                             const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t,       \
                                             int64_t, int64_t, int64_t);                                         \
    int64_t pdserve_##v##_fused_decode(const void *, const void *, void *, void *, const int64_t *,              \
                                       const int64_t *, const int64_t *, const int64_t *, const int64_t *,       \
                                       const int64_t *, const int64_t *, int64_t, int64_t, int64_t, int64_t);    \
    int64_t pdserve_##v##_fused_decode_struct_sizes(int64_t);                                                    \
    }

#define PDSERVE_TABLE(v)                                                                                         \
    Kernels{#v,                                                                                                  \
            pdserve_##v##_bf16_path,                                                                             \
            pdserve_##v##_f32_path,                                                                              \
            pdserve_##v##_quant_path,                                                                            \
            pdserve_##v##_paged_attention_openmp,                                                                \
            pdserve_##v##_bf16_gemm,                                                                             \
            pdserve_##v##_f32_gemm,                                                                              \
            pdserve_##v##_f32_grouped_gemm,                                                                      \
            pdserve_##v##_int8_gemm,                                                                             \
            pdserve_##v##_int4_gemm,                                                                             \
            pdserve_##v##_int8_grouped_gemm,                                                                     \
            pdserve_##v##_int4_grouped_gemm,                                                                     \
            pdserve_##v##_paged_attention_ranges,                                                                \
            pdserve_##v##_store_kv,                                                                              \
            pdserve_##v##_rms_norm,                                                                              \
            pdserve_##v##_silu_mul,                                                                              \
            pdserve_##v##_lora_shrink_expand,                                                                    \
            pdserve_##v##_fused_decode,                                                                          \
            pdserve_##v##_fused_decode_struct_sizes}

namespace {

struct Kernels {
    const char *name;
    int64_t (*bf16_path)(void);
    int64_t (*f32_path)(void);
    int64_t (*quant_path)(void);
    int (*paged_attention_openmp)(void);
    int64_t (*bf16_gemm)(uint16_t *, const uint16_t *, const uint16_t *, const uint16_t *, int64_t, int64_t,
                         int64_t, int64_t);
    int64_t (*f32_gemm)(float *, const float *, const float *, const float *, int64_t, int64_t, int64_t, int64_t);
    int64_t (*f32_grouped_gemm)(float *, const float *, const int64_t *, const int64_t *, int64_t, int64_t, int64_t,
                                int64_t);
    int64_t (*int8_gemm)(void *, const void *, const uint8_t *, const float *, int64_t, int64_t, int64_t, int64_t,
                         int64_t);
    int64_t (*int4_gemm)(void *, const void *, const uint8_t *, const uint16_t *, const uint16_t *, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t);
    int64_t (*int8_grouped_gemm)(void *, const void *, const int64_t *, const int64_t *, const int64_t *, int64_t,
                                 int64_t, int64_t, int64_t, int64_t);
    int64_t (*int4_grouped_gemm)(void *, const void *, const int64_t *, const int64_t *, const int64_t *, int64_t,
                                 const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t);
    int (*paged_attention_ranges)(void *, const void *, int64_t, int64_t, const void *, const void *, int64_t,
                                  const float *, const float *, const int64_t *, const int64_t *, const int64_t *,
                                  const int64_t *, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t,
                                  int64_t, float, int64_t, float);
    int (*store_kv)(const void *, const void *, int64_t, int64_t, int64_t, void *, void *, int64_t, float *,
                    float *, const int64_t *, int64_t, int64_t, int64_t, int64_t);
    void (*rms_norm)(void *, void *, const void *, const void *, int64_t, int64_t, float, int64_t);
    void (*silu_mul)(void *, const void *, int64_t, int64_t, int64_t);
    int64_t (*lora_shrink_expand)(void *, const void *, const void *, const void *, const int64_t *, const int64_t *,
                                  const int64_t *, const float *, const int64_t *, const int64_t *, int64_t, int64_t,
                                  int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
    int64_t (*fused_decode)(const void *, const void *, void *, void *, const int64_t *, const int64_t *,
                            const int64_t *, const int64_t *, const int64_t *, const int64_t *, const int64_t *,
                            int64_t, int64_t, int64_t, int64_t);
    int64_t (*fused_decode_struct_sizes)(int64_t);
};

}  // namespace

// The variants in this build, best last; setup.py builds the same list (VARIANTS there).
#if defined(__x86_64__)
PDSERVE_DECLARE(portable)
PDSERVE_DECLARE(avx2)
PDSERVE_DECLARE(avx512)
PDSERVE_DECLARE(avx512_vnni)
PDSERVE_DECLARE(avx512_bf16)
static const Kernels kVariants[] = {PDSERVE_TABLE(portable), PDSERVE_TABLE(avx2), PDSERVE_TABLE(avx512),
                                    PDSERVE_TABLE(avx512_vnni), PDSERVE_TABLE(avx512_bf16)};
#else
PDSERVE_DECLARE(portable)
static const Kernels kVariants[] = {PDSERVE_TABLE(portable)};
#endif
static constexpr int64_t kNumVariants = sizeof(kVariants) / sizeof(kVariants[0]);

namespace {

const Kernels &kernels(int64_t variant) {
    TORCH_CHECK(variant >= 0 && variant < kNumVariants, "variant must be in [0, ", kNumVariants, "), got ", variant);
    return kVariants[variant];
}

template <typename T = void>
T *ptr(const at::Tensor &tensor) {
    return static_cast<T *>(tensor.data_ptr());
}

template <typename T = void>
T *ptr(const std::optional<at::Tensor> &tensor) {
    return tensor.has_value() ? static_cast<T *>(tensor->data_ptr()) : nullptr;
}

std::string variant_names() {
    std::string names;
    for (const Kernels &k : kVariants) {
        names += names.empty() ? "" : ",";
        names += k.name;
    }
    return names;
}

int64_t bf16_path(int64_t v) { return kernels(v).bf16_path(); }
int64_t f32_path(int64_t v) { return kernels(v).f32_path(); }
int64_t quant_path(int64_t v) { return kernels(v).quant_path(); }
int64_t paged_attention_openmp(int64_t v) { return kernels(v).paged_attention_openmp(); }

int64_t bf16_gemm(int64_t v, const at::Tensor &out, const at::Tensor &x, const at::Tensor &weight,
                  const std::optional<at::Tensor> &bias, int64_t rows, int64_t n, int64_t k, int64_t threads) {
    return kernels(v).bf16_gemm(ptr<uint16_t>(out), ptr<const uint16_t>(x), ptr<const uint16_t>(weight),
                                ptr<const uint16_t>(bias), rows, n, k, threads);
}

int64_t f32_gemm(int64_t v, const at::Tensor &out, const at::Tensor &x, const at::Tensor &weight,
                 const std::optional<at::Tensor> &bias, int64_t rows, int64_t n, int64_t k, int64_t threads) {
    return kernels(v).f32_gemm(ptr<float>(out), ptr<const float>(x), ptr<const float>(weight),
                               ptr<const float>(bias), rows, n, k, threads);
}

int64_t f32_grouped_gemm(int64_t v, const at::Tensor &out, const at::Tensor &x, const at::Tensor &weights,
                         const at::Tensor &offsets, int64_t num_experts, int64_t n, int64_t k, int64_t threads) {
    return kernels(v).f32_grouped_gemm(ptr<float>(out), ptr<const float>(x), ptr<const int64_t>(weights),
                                       ptr<const int64_t>(offsets), num_experts, n, k, threads);
}

int64_t int8_gemm(int64_t v, const at::Tensor &out, const at::Tensor &x, const at::Tensor &qweight,
                  const at::Tensor &row_scales, int64_t rows, int64_t n, int64_t k, int64_t is_bf16, int64_t threads) {
    return kernels(v).int8_gemm(ptr(out), ptr<const void>(x), ptr<const uint8_t>(qweight),
                                ptr<const float>(row_scales), rows, n, k, is_bf16, threads);
}

int64_t int4_gemm(int64_t v, const at::Tensor &out, const at::Tensor &x, const at::Tensor &qweight,
                  const at::Tensor &scales, const at::Tensor &minimums, int64_t group_size, int64_t rows, int64_t n,
                  int64_t k, int64_t is_bf16, int64_t threads) {
    return kernels(v).int4_gemm(ptr(out), ptr<const void>(x), ptr<const uint8_t>(qweight),
                                ptr<const uint16_t>(scales), ptr<const uint16_t>(minimums), group_size, rows, n, k,
                                is_bf16, threads);
}

int64_t int8_grouped_gemm(int64_t v, const at::Tensor &out, const at::Tensor &x, const at::Tensor &weights,
                          const at::Tensor &row_scales, const at::Tensor &offsets, int64_t num_experts, int64_t n,
                          int64_t k, int64_t is_bf16, int64_t threads) {
    return kernels(v).int8_grouped_gemm(ptr(out), ptr<const void>(x), ptr<const int64_t>(weights),
                                        ptr<const int64_t>(row_scales), ptr<const int64_t>(offsets), num_experts, n,
                                        k, is_bf16, threads);
}

int64_t int4_grouped_gemm(int64_t v, const at::Tensor &out, const at::Tensor &x, const at::Tensor &weights,
                          const at::Tensor &scales, const at::Tensor &minimums, int64_t group_size,
                          const at::Tensor &offsets, int64_t num_experts, int64_t n, int64_t k, int64_t is_bf16,
                          int64_t threads) {
    return kernels(v).int4_grouped_gemm(ptr(out), ptr<const void>(x), ptr<const int64_t>(weights),
                                        ptr<const int64_t>(scales), ptr<const int64_t>(minimums), group_size,
                                        ptr<const int64_t>(offsets), num_experts, n, k, is_bf16, threads);
}

int64_t paged_attention(int64_t v, const at::Tensor &out, const at::Tensor &query, int64_t query_stride,
                        int64_t io_bf16, const at::Tensor &key_cache, const at::Tensor &value_cache, int64_t kv_kind,
                        const std::optional<at::Tensor> &key_scales, const std::optional<at::Tensor> &value_scales,
                        const at::Tensor &block_tables, const at::Tensor &context_lens, const at::Tensor &query_rows,
                        const at::Tensor &query_lens, const at::Tensor &points, int64_t num_ranges, int64_t max_blocks,
                        int64_t num_kv_heads, int64_t group, int64_t head_dim, int64_t block_size, double scale,
                        int64_t window, double softcap) {
    return kernels(v).paged_attention_ranges(
        ptr(out), ptr<const void>(query), query_stride, io_bf16, ptr<const void>(key_cache),
        ptr<const void>(value_cache), kv_kind, ptr<const float>(key_scales), ptr<const float>(value_scales),
        ptr<const int64_t>(block_tables), ptr<const int64_t>(context_lens), ptr<const int64_t>(query_rows),
        ptr<const int64_t>(query_lens), ptr<const int64_t>(points), num_ranges, max_blocks, num_kv_heads, group,
        head_dim, block_size, static_cast<float>(scale), window, static_cast<float>(softcap));
}

int64_t store_kv(int64_t v, const at::Tensor &key, const at::Tensor &value, int64_t in_bf16, int64_t key_stride,
                 int64_t value_stride, const at::Tensor &key_cache, const at::Tensor &value_cache, int64_t kv_kind,
                 const std::optional<at::Tensor> &key_scales, const std::optional<at::Tensor> &value_scales,
                 const at::Tensor &slots, int64_t num_tokens, int64_t num_slots, int64_t num_kv_heads,
                 int64_t head_dim) {
    return kernels(v).store_kv(ptr<const void>(key), ptr<const void>(value), in_bf16, key_stride, value_stride,
                               ptr(key_cache), ptr(value_cache), kv_kind, ptr<float>(key_scales),
                               ptr<float>(value_scales), ptr<const int64_t>(slots), num_tokens, num_slots,
                               num_kv_heads, head_dim);
}

void rms_norm(int64_t v, const at::Tensor &out, const at::Tensor &residual, const std::optional<at::Tensor> &delta,
              const at::Tensor &weight, int64_t rows, int64_t width, double eps, int64_t is_bf16) {
    kernels(v).rms_norm(ptr(out), ptr(residual), ptr<const void>(delta), ptr<const void>(weight), rows, width,
                        static_cast<float>(eps), is_bf16);
}

void silu_mul(int64_t v, const at::Tensor &out, const at::Tensor &gate_up, int64_t rows, int64_t width,
              int64_t is_bf16) {
    kernels(v).silu_mul(ptr(out), ptr<const void>(gate_up), rows, width, is_bf16);
}

int64_t lora_shrink_expand(int64_t v, const at::Tensor &out, const at::Tensor &x, const at::Tensor &lora_a,
                           const at::Tensor &lora_b, const at::Tensor &ranks, const at::Tensor &columns,
                           const at::Tensor &row_slots, const at::Tensor &row_scales, const at::Tensor &order,
                           const at::Tensor &group_offsets, int64_t groups, int64_t modules, int64_t max_rank,
                           int64_t in_features, int64_t out_features, int64_t is_bf16, int64_t weights_bf16,
                           int64_t threads) {
    return kernels(v).lora_shrink_expand(ptr(out), ptr<const void>(x), ptr<const void>(lora_a),
                                         ptr<const void>(lora_b), ptr<const int64_t>(ranks),
                                         ptr<const int64_t>(columns), ptr<const int64_t>(row_slots),
                                         ptr<const float>(row_scales), ptr<const int64_t>(order),
                                         ptr<const int64_t>(group_offsets), groups, modules, max_rank, in_features,
                                         out_features, is_bf16, weights_bf16, threads);
}

int64_t fused_decode(int64_t v, const at::Tensor &model, const std::optional<at::Tensor> &lora_rows,
                     const at::Tensor &residual, const at::Tensor &hidden_out, const at::Tensor &positions,
                     const at::Tensor &slots, const at::Tensor &block_tables, const at::Tensor &context_lens,
                     const at::Tensor &query_rows, const at::Tensor &query_lens, const at::Tensor &range_points,
                     int64_t num_ranges, int64_t max_blocks, int64_t rows, int64_t threads) {
    return kernels(v).fused_decode(ptr<const void>(model), ptr<const void>(lora_rows), ptr(residual),
                                   ptr(hidden_out), ptr<const int64_t>(positions), ptr<const int64_t>(slots),
                                   ptr<const int64_t>(block_tables), ptr<const int64_t>(context_lens),
                                   ptr<const int64_t>(query_rows), ptr<const int64_t>(query_lens),
                                   ptr<const int64_t>(range_points), num_ranges, max_blocks, rows, threads);
}

int64_t fused_decode_struct_sizes(int64_t v, int64_t which) { return kernels(v).fused_decode_struct_sizes(which); }

int64_t openmp_team(int64_t threads) { return pdserve_openmp_team(static_cast<int>(threads)); }

}  // namespace

TORCH_LIBRARY(pdserve, m) {
    m.def("variants() -> str", [] { return variant_names(); });
    m.def("bf16_path(int variant) -> int", &bf16_path);
    m.def("f32_path(int variant) -> int", &f32_path);
    m.def("quant_path(int variant) -> int", &quant_path);
    m.def("paged_attention_openmp(int variant) -> int", &paged_attention_openmp);
    m.def("bf16_gemm(int variant, Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, int rows, int n, int k, "
          "int threads) -> int",
          &bf16_gemm);
    m.def("f32_gemm(int variant, Tensor(a!) out, Tensor x, Tensor weight, Tensor? bias, int rows, int n, int k, "
          "int threads) -> int",
          &f32_gemm);
    m.def("f32_grouped_gemm(int variant, Tensor(a!) out, Tensor x, Tensor weights, Tensor offsets, int num_experts, "
          "int n, int k, int threads) -> int",
          &f32_grouped_gemm);
    m.def("int8_gemm(int variant, Tensor(a!) out, Tensor x, Tensor qweight, Tensor row_scales, int rows, int n, "
          "int k, int is_bf16, int threads) -> int",
          &int8_gemm);
    m.def("int8_grouped_gemm(int variant, Tensor(a!) out, Tensor x, Tensor weights, Tensor row_scales, "
          "Tensor offsets, int num_experts, int n, int k, int is_bf16, int threads) -> int",
          &int8_grouped_gemm);
    m.def("int4_grouped_gemm(int variant, Tensor(a!) out, Tensor x, Tensor weights, Tensor scales, "
          "Tensor minimums, int group_size, Tensor offsets, int num_experts, int n, int k, int is_bf16, "
          "int threads) -> int",
          &int4_grouped_gemm);
    m.def("int4_gemm(int variant, Tensor(a!) out, Tensor x, Tensor qweight, Tensor scales, Tensor minimums, "
          "int group_size, int rows, int n, int k, int is_bf16, int threads) -> int",
          &int4_gemm);
    m.def("paged_attention(int variant, Tensor(a!) out, Tensor query, int query_stride, int io_bf16, "
          "Tensor key_cache, Tensor value_cache, int kv_kind, Tensor? key_scales, Tensor? value_scales, "
          "Tensor block_tables, Tensor context_lens, Tensor query_rows, Tensor query_lens, Tensor points, "
          "int num_ranges, int max_blocks, int num_kv_heads, int group, int head_dim, int block_size, "
          "float scale, int window, float softcap) -> int",
          &paged_attention);
    m.def("store_kv(int variant, Tensor key, Tensor value, int in_bf16, int key_stride, int value_stride, "
          "Tensor(a!) key_cache, Tensor(b!) value_cache, int kv_kind, Tensor(c!)? key_scales, "
          "Tensor(d!)? value_scales, Tensor slots, int num_tokens, int num_slots, int num_kv_heads, "
          "int head_dim) -> int",
          &store_kv);
    m.def("rms_norm(int variant, Tensor(a!) out, Tensor(b!) residual, Tensor? delta, Tensor weight, int rows, "
          "int width, float eps, int is_bf16) -> ()",
          &rms_norm);
    m.def("silu_mul(int variant, Tensor(a!) out, Tensor gate_up, int rows, int width, int is_bf16) -> ()",
          &silu_mul);
    m.def("lora_shrink_expand(int variant, Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_b, Tensor ranks, "
          "Tensor columns, Tensor row_slots, Tensor row_scales, Tensor order, Tensor group_offsets, int groups, "
          "int modules, int max_rank, int in_features, int out_features, int is_bf16, int weights_bf16, int threads) "
          "-> int",
          &lora_shrink_expand);
    m.def("fused_decode(int variant, Tensor model, Tensor? lora_rows, Tensor(a!) residual, Tensor(b!) hidden_out, "
          "Tensor positions, Tensor slots, Tensor block_tables, Tensor context_lens, Tensor query_rows, "
          "Tensor query_lens, Tensor range_points, int num_ranges, int max_blocks, int rows, int threads) -> int",
          &fused_decode);
    m.def("fused_decode_struct_sizes(int variant, int which) -> int", &fused_decode_struct_sizes);
    m.def("openmp_team(int threads) -> int", &openmp_team);
}
