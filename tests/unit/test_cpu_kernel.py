"""The C paged-attention kernel against a plain torch reference, in every variant this CPU runs, its work split
over OpenMP threads on torch's runtime, and the fallback of a package built without its kernels."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve.engine.attention import cpu_kernel, select_backend
from pdserve.engine.attention.backend import write_to_cache
from pdserve.engine.attention.cpu_kernel import PagedAttentionKernel, load_paged_attention_kernel
from pdserve.engine.kv.cache import KVCache, QuantizedKV, dequantize_int8, quantize_int8
from pdserve.engine.native import load_kernel_ops, supported_variants
from tests.support.cpu_paths import variant_params

VARIANTS = supported_variants()


def _reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: list[list[int]],
               lens: list[int], query_lens: list[int]) -> torch.Tensor:
    """Causal attention of each sequence's last query_len positions over its own context, position by position."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // num_kv_heads
    outputs = []
    row = 0
    for table, length, q_len in zip(tables, lens, query_lens):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        k = key_cache.reshape(-1, num_kv_heads, head_dim)[slots].repeat_interleave(group, dim=1)  # (ctx, heads, d)
        v = value_cache.reshape(-1, num_kv_heads, head_dim)[slots].repeat_interleave(group, dim=1)
        for r in range(q_len):
            visible = length - q_len + r + 1
            scores = torch.einsum("hd,chd->hc", query[row].double(), k[:visible].double()) * head_dim**-0.5
            outputs.append(torch.einsum("hc,chd->hd", scores.softmax(-1), v[:visible].double()))
            row += 1
    return torch.stack(outputs).float()


def _scattered_batch(block_size: int, seed: int) -> tuple[list[int], list[list[int]], list[int]]:
    """Context lengths around block boundaries, their blocks scattered over a pool of 200, and query lengths
    (decodes, and chunks of up to 9 tokens as a speculative step verifies)."""
    rng = random.Random(seed)
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2, 97, 40]
    query_lens = [1, 1, 3, 1, 5, 9, 1]
    free = list(range(1, 200))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    return lens, tables, [min(q, n) for q, n in zip(query_lens, lens)]


def _run(kernel: PagedAttentionKernel, query: torch.Tensor, key_cache: object, value_cache: object,
         tables: list[list[int]], lens: list[int], query_lens: list[int]) -> torch.Tensor:
    num_kv_heads = (key_cache.data if isinstance(key_cache, QuantizedKV) else key_cache).shape[2]
    rows = [sum(query_lens[:i]) for i in range(len(query_lens))]
    plan = kernel.plan(rows, query_lens, lens, tables, num_kv_heads, query.shape[1] // num_kv_heads)
    out = torch.full_like(query, float("nan"))
    kernel(query, key_cache, value_cache, plan, query.shape[2] ** -0.5, out)
    return out


SHAPES = [(3, 3, 64, 16), (2, 1, 128, 8), (1, 4, 24, 5), (2, 2, 16, 4)]


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("variant", variant_params())
def test_kernel_matches_reference_attention(num_kv_heads: int, group: int, head_dim: int, block_size: int,
                                            num_threads: int, variant: str) -> None:
    kernel = load_paged_attention_kernel(num_threads, variant)
    assert kernel is not None, "pdserve was installed without its kernels (PDSERVE_BUILD_KERNELS=0?)"
    torch.manual_seed(0)
    key_cache = torch.randn(200, block_size, num_kv_heads, head_dim)
    value_cache = torch.randn(200, block_size, num_kv_heads, head_dim)
    lens, tables, query_lens = _scattered_batch(block_size, seed=0)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim)

    out = _run(kernel, query, key_cache, value_cache, tables, lens, query_lens)

    expected = _reference(query, key_cache, value_cache, tables, lens, query_lens)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)


def test_kernel_leaves_rows_outside_its_plan_untouched() -> None:
    kernel = load_paged_attention_kernel(2)
    assert kernel is not None
    torch.manual_seed(0)
    cache = torch.randn(8, 4, 1, 16)
    query = torch.randn(5, 2, 16)
    # One sequence of 2 query rows at rows 1-2; rows 0, 3 and 4 belong to someone else.
    plan = kernel.plan([1], [2], [6], [[3, 5]], 1, 2)
    out = torch.full_like(query, 7.0)
    kernel(query, cache, cache, plan, 0.25, out)
    assert torch.equal(out[[0, 3, 4]], torch.full((3, 2, 16), 7.0))
    assert not torch.isnan(out[1:3]).any() and not torch.equal(out[1:3], torch.full((2, 2, 16), 7.0))


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_a_strided_query_in_place(query_dtype: torch.dtype) -> None:
    kernel = load_paged_attention_kernel(2)
    assert kernel is not None
    torch.manual_seed(0)
    cache = torch.randn(200, 16, 3, 64)
    lens, tables, query_lens = _scattered_batch(16, seed=1)
    # The queries as the model hands them over: the first 9 heads of the fused q/k/v output's 15.
    fused = torch.randn(sum(query_lens), 15, 64).to(query_dtype)
    strided = fused[:, :9]
    assert not strided.is_contiguous()
    out = _run(kernel, strided, cache, cache, tables, lens, query_lens)
    assert torch.equal(out, _run(kernel, strided.contiguous(), cache, cache, tables, lens, query_lens))
    with pytest.raises(ValueError, match="query"):
        # head_dim strided: (rows, head_dim, heads) seen as (rows, heads, head_dim)
        _run(kernel, strided.transpose(1, 2).contiguous().transpose(1, 2), cache, cache, tables, lens, query_lens)


def test_plan_rejects_a_query_longer_than_its_context() -> None:
    kernel = load_paged_attention_kernel(1)
    assert kernel is not None
    with pytest.raises(ValueError, match="query length"):
        kernel.plan([0], [5], [4], [[1]], 1, 1)


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size"), SHAPES[:3])
@pytest.mark.parametrize("num_threads", [1, 3])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", [VARIANTS[0], VARIANTS[-1]])
def test_compact_kv_kernels_match_reference_attention_over_the_dequantized_cache(
    num_kv_heads: int, group: int, head_dim: int, block_size: int, num_threads: int,
    kv_dtype: torch.dtype, query_dtype: torch.dtype, variant: str,
) -> None:
    kernel = load_paged_attention_kernel(num_threads, variant)
    assert kernel is not None
    torch.manual_seed(0)
    lens, tables, query_lens = _scattered_batch(block_size, seed=0)
    keys = torch.randn(200, block_size, num_kv_heads, head_dim) * 2
    values = torch.randn(200, block_size, num_kv_heads, head_dim)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim).to(query_dtype)
    if kv_dtype == torch.int8:
        key_cache, value_cache = QuantizedKV(*quantize_int8(keys)), QuantizedKV(*quantize_int8(values))
        # What the kernel must attend over: exactly the dequantized values.
        seen_keys = dequantize_int8(*key_cache, torch.float32)
        seen_values = dequantize_int8(*value_cache, torch.float32)
    else:
        key_cache, value_cache = keys.to(kv_dtype), values.to(kv_dtype)
        seen_keys, seen_values = key_cache.float(), value_cache.float()

    out = _run(kernel, query, key_cache, value_cache, tables, lens, query_lens)

    assert out.shape == query.shape and out.dtype == query_dtype
    expected = _reference(query.float(), seen_keys, seen_values, tables, lens, query_lens)
    if query_dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=4e-6, rtol=2e-5)
    else:  # a float32 result rounded once to bfloat16: at most one bfloat16 step (2^-7 relative) off
        torch.testing.assert_close(out, expected.to(query_dtype), atol=0, rtol=2**-7)


def test_kernel_rejects_int8_kv_without_scales() -> None:
    kernel = load_paged_attention_kernel(1)
    assert kernel is not None
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.int8)
    plan = kernel.plan([0], [1], [1], [[0]], 1, 1)
    query = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="QuantizedKV"):
        kernel(query, cache, cache, plan, 1.0, torch.empty_like(query))
    with pytest.raises(ValueError, match="float16"):
        half = cache.half()
        kernel(query, half, half, plan, 1.0, torch.empty_like(query))


def test_split_balances_work_across_threads_and_keeps_small_work_on_one() -> None:
    library = load_kernel_ops()
    assert library is not None
    work = [1000, 2000, 500, 3000, 100]
    assert PagedAttentionKernel(library, 1).split(work) == ((0, 5),)
    assert PagedAttentionKernel(library, 2).split(work) == ((0, 3), (3, 5))
    assert PagedAttentionKernel(library, 3).split([1000] * 6) == ((0, 2), (2, 4), (4, 6))
    # Never an empty range, even with more threads than items.
    assert PagedAttentionKernel(library, 4).split([7000]) == ((0, 1),)
    assert PagedAttentionKernel(library, 4).split([5000, 5000]) == ((0, 1), (1, 2))
    # Under 4,096 units of work (a batch-1 decode) one thread does it all.
    assert PagedAttentionKernel(library, 2).split([1000, 1000, 1000]) == ((0, 3),)


def test_plan_items_are_sequences_times_kv_heads_weighted_by_passes() -> None:
    library = load_kernel_ops()
    assert library is not None
    kernel = PagedAttentionKernel(library, 2)
    # Costs per item: 3000 x ceil(1 * 3 / 4) = 3000 (three items), then 1000 x ceil(5 * 3 / 4) = 4000 (three items).
    plan = kernel.plan([0, 1], [1, 5], [3000, 1000], [[1], [2]], 3, 3)
    assert plan.item_ranges == ((0, 4), (4, 6))
    assert plan.query_rows.tolist() == [0, 1] and plan.query_lens.tolist() == [1, 5]


def test_the_kernels_share_the_libgomp_torch_loaded() -> None:
    kernel = load_paged_attention_kernel(2)
    assert kernel is not None
    with open("/proc/self/maps", encoding="utf-8") as maps:
        libgomps = {line.split()[-1] for line in maps if Path(line.split()[-1]).name.startswith("libgomp")}
    # One runtime in the process: the kernel's parallel regions run on torch's OpenMP threads.
    assert len(libgomps) == 1
    assert Path(next(iter(libgomps))).parent == Path(torch.__file__).parent / "lib"


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_kv_write_matches_the_torch_write_bit_for_bit(model_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    kernel = load_paged_attention_kernel(1)
    assert kernel is not None
    torch.manual_seed(0)
    num_kv_heads, head_dim, block_size = 3, 64, 16
    # Keys and values as the model hands them over: column slices of the fused q/k/v output.
    qkv = (torch.randn(7, 9 + 2 * num_kv_heads, head_dim) * 3).to(model_dtype)
    qkv[2, 9] = 0  # an all-zero row: int8 keeps scale 0
    qkv[3, 9 + num_kv_heads, :8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.0, 63.5, -63.5])  # ties at 127
    key, value = qkv[:, 9 : 9 + num_kv_heads], qkv[:, 9 + num_kv_heads :]
    slots = torch.tensor([5, 17, 40, 41, 0, 63, 22])

    def empty_cache() -> tuple[object, object]:
        caches = KVCache(1, 4, block_size, num_kv_heads, head_dim, kv_dtype, torch.device("cpu")).layers()[0]
        return caches

    expected_k, expected_v = empty_cache()
    write_to_cache(key, value, expected_k, expected_v, slots)
    got_k, got_v = empty_cache()
    kernel.store(key, value, got_k, got_v, slots)

    for expected, got in ((expected_k, got_k), (expected_v, got_v)):
        if kv_dtype == torch.int8:
            assert torch.equal(got.data, expected.data) and torch.equal(got.scales, expected.scales)
            assert got.data.abs().sum() > 0
        else:
            assert torch.equal(got, expected) and got.abs().sum() > 0


def test_kv_write_rejects_a_slot_outside_the_pool_and_writes_nothing() -> None:
    kernel = load_paged_attention_kernel(1)
    assert kernel is not None
    cache = torch.zeros(2, 4, 1, 8)
    new = torch.ones(2, 1, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernel.store(new, new, cache, cache, torch.tensor([3, 8]))
    assert not cache.any()
    with pytest.raises(ValueError, match="slot_mapping"):
        kernel.store(new, new, cache, cache, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="key_cache"):
        kernel.store(new, new, cache.half(), cache.half(), torch.tensor([0, 1]))


def test_without_kernels_in_the_package_auto_falls_back_to_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patched:
        patched.setattr(cpu_kernel, "load_kernel_ops", lambda variant=None: None)  # PDSERVE_BUILD_KERNELS=0
        assert load_paged_attention_kernel() is None
        assert select_backend("auto", torch.device("cpu"), torch.float32).name == "sdpa"
        with pytest.raises(ValueError, match="cpu_paged"):
            select_backend("cpu_paged", torch.device("cpu"), torch.float32)
    assert select_backend("auto", torch.device("cpu"), torch.float32).name == "cpu_paged"
    # The kernel reads float32, bfloat16 and int8 KV for float32 or bfloat16 models; float16 keeps SDPA.
    assert select_backend("auto", torch.device("cpu"), torch.bfloat16).name == "cpu_paged"
    assert select_backend("auto", torch.device("cpu"), torch.float32, torch.int8).name == "cpu_paged"
    assert select_backend("auto", torch.device("cpu"), torch.float16).name == "sdpa"
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        select_backend("cpu_paged", torch.device("cpu"), torch.float16)


@pytest.mark.parametrize("variant", variant_params())
def test_kernel_reads_latent_attention_rows_as_keys_and_values(variant: str) -> None:
    # DeepSeek's absorbed decode: 16 query heads over one KV head of 576 features (512 latent + 64 rope), the
    # same rows passed as keys and values, as models/deepseek.py does.
    kernel = load_paged_attention_kernel(2, variant)
    assert kernel is not None
    torch.manual_seed(1)
    cache = torch.randn(200, 16, 1, 576)
    lens, tables, query_lens = _scattered_batch(16, seed=1)
    query = torch.randn(sum(query_lens), 16, 576)
    out = _run(kernel, query, cache, cache, tables, lens, query_lens)
    torch.testing.assert_close(out, _reference(query, cache, cache, tables, lens, query_lens), rtol=1e-4, atol=1e-4)
