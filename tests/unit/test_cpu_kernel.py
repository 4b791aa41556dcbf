"""The C decode-attention kernel against a plain torch reference, its work split, and the fallback without a compiler."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.attention import cpu_kernel, select_backend
from engine.attention.cpu_kernel import PagedDecodeKernel, load_paged_decode_kernel
from engine.kv_cache import QuantizedKV, dequantize_int8, quantize_int8


def _reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: list[list[int]],
               lens: list[int]) -> torch.Tensor:
    """Attention of each sequence's query over its own context, gathered position by position."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // num_kv_heads
    outputs = []
    for i, (table, length) in enumerate(zip(tables, lens)):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        k = key_cache.reshape(-1, num_kv_heads, head_dim)[slots].repeat_interleave(group, dim=1)  # (ctx, heads, d)
        v = value_cache.reshape(-1, num_kv_heads, head_dim)[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,chd->hc", query[i].double(), k.double()) * head_dim**-0.5
        outputs.append(torch.einsum("hc,chd->hd", scores.softmax(-1), v.double()))
    return torch.stack(outputs).float()


@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size"),
    [(3, 3, 64, 16), (2, 1, 128, 8), (1, 4, 24, 5)],
)
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_kernel_matches_reference_attention(num_kv_heads: int, group: int, head_dim: int, block_size: int,
                                            num_threads: int) -> None:
    kernel = load_paged_decode_kernel(num_threads)
    assert kernel is not None, "this machine has a C compiler: the kernel must build"
    rng = random.Random(0)
    torch.manual_seed(0)
    num_blocks = 200
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim)
    # Context lengths around block boundaries, blocks scattered over the pool.
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2, 97]
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    max_blocks = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
    query = torch.randn(len(lens), num_kv_heads * group, head_dim)

    out = kernel(query, key_cache, value_cache, padded, torch.tensor(lens), kernel.split_points(lens), head_dim**-0.5)

    assert out.shape == query.shape
    torch.testing.assert_close(out, _reference(query, key_cache, value_cache, tables, lens), atol=2e-6, rtol=2e-5)


def _scattered_batch(block_size: int, seed: int) -> tuple[list[int], list[list[int]], torch.Tensor]:
    """Context lengths around block boundaries, their blocks scattered over a pool of 200, and queries."""
    rng = random.Random(seed)
    lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2, 97]
    free = list(range(1, 200))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
    max_blocks = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
    return lens, tables, padded


@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim", "block_size"),
    [(3, 3, 64, 16), (2, 1, 128, 8), (1, 4, 24, 5)],
)
@pytest.mark.parametrize("num_threads", [1, 3])
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_compact_kv_kernels_match_reference_attention_over_the_dequantized_cache(
    num_kv_heads: int, group: int, head_dim: int, block_size: int, num_threads: int, kv_dtype: torch.dtype,
    query_dtype: torch.dtype,
) -> None:
    kernel = load_paged_decode_kernel(num_threads)
    assert kernel is not None
    torch.manual_seed(0)
    lens, tables, padded = _scattered_batch(block_size, seed=0)
    keys = torch.randn(200, block_size, num_kv_heads, head_dim) * 2
    values = torch.randn(200, block_size, num_kv_heads, head_dim)
    query = torch.randn(len(lens), num_kv_heads * group, head_dim).to(query_dtype)
    if kv_dtype == torch.int8:
        key_cache, value_cache = QuantizedKV(*quantize_int8(keys)), QuantizedKV(*quantize_int8(values))
        # What the kernel must attend over: exactly the dequantized values.
        seen_keys = dequantize_int8(*key_cache, torch.float32)
        seen_values = dequantize_int8(*value_cache, torch.float32)
    else:
        key_cache, value_cache = keys.to(kv_dtype), values.to(kv_dtype)
        seen_keys, seen_values = key_cache.float(), value_cache.float()

    out = kernel(query, key_cache, value_cache, padded, torch.tensor(lens), kernel.split_points(lens), head_dim**-0.5)

    assert out.shape == query.shape and out.dtype == query_dtype
    expected = _reference(query.float(), seen_keys, seen_values, tables, lens)
    if query_dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=4e-6, rtol=2e-5)
    else:  # float32 result rounded once to bfloat16
        torch.testing.assert_close(out, expected.to(query_dtype), atol=0, rtol=2**-8)


def test_kernel_rejects_int8_kv_without_scales() -> None:
    kernel = load_paged_decode_kernel(1)
    assert kernel is not None
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="QuantizedKV"):
        kernel(torch.zeros(1, 1, 8), cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), [0, 1], 1.0)
    with pytest.raises(ValueError, match="float16"):
        half = cache.half()
        kernel(torch.zeros(1, 1, 8), half, half, torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), [0, 1], 1.0)


def test_split_points_balance_context_across_threads() -> None:
    library = cpu_kernel._load_library()
    assert library is not None
    assert PagedDecodeKernel(library, 1).split_points([100, 200, 50, 300, 10]) == [0, 5]
    assert PagedDecodeKernel(library, 2).split_points([100, 200, 50, 300, 10]) == [0, 3, 5]
    assert PagedDecodeKernel(library, 3).split_points([100, 100, 100, 100, 100, 100]) == [0, 2, 4, 6]
    # Never an empty range, even with more threads than sequences.
    assert PagedDecodeKernel(library, 4).split_points([7]) == [0, 1]
    assert PagedDecodeKernel(library, 4).split_points([1, 1]) == [0, 1, 2]


def test_without_a_compiler_auto_falls_back_to_sdpa(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cpu_kernel._load_library.cache_clear()
    try:
        assert load_paged_decode_kernel() is None
        assert select_backend("auto", torch.device("cpu"), torch.float32).name == "sdpa"
        with pytest.raises(ValueError, match="cpu_paged"):
            select_backend("cpu_paged", torch.device("cpu"), torch.float32)
    finally:
        monkeypatch.undo()
        cpu_kernel._load_library.cache_clear()
    assert select_backend("auto", torch.device("cpu"), torch.float32).name == "cpu_paged"
    # The kernel reads float32, bfloat16 and int8 KV for float32 or bfloat16 models; float16 keeps SDPA.
    assert select_backend("auto", torch.device("cpu"), torch.bfloat16).name == "cpu_paged"
    assert select_backend("auto", torch.device("cpu"), torch.float32, torch.int8).name == "cpu_paged"
    assert select_backend("auto", torch.device("cpu"), torch.float16).name == "sdpa"
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        select_backend("cpu_paged", torch.device("cpu"), torch.float16)
