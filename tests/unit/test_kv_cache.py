"""The KV pool in each kv_cache_dtype: exact block accounting, int8 quantization, export/import across dtypes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM
from pdserve.engine.attention.backend import read_cache, write_to_cache
from pdserve.engine.kv import cache as kv_cache_module
from pdserve.engine.kv.cache import (
    KVCache,
    QuantizedKV,
    bytes_per_block,
    dequantize_int8,
    pack_int8,
    quantize_int8,
    resolve_kv_cache_dtype,
    size_kv_pool,
    unpack_int8,
)
from pdserve.engine.types.config import CacheConfig

# SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64, blocks of 16 tokens.
SMOLLM2 = (30, 16, 3, 64)


def test_bytes_per_block_counts_values_and_int8_scales_exactly() -> None:
    assert bytes_per_block(*SMOLLM2, torch.float32) == 30 * 2 * 16 * 3 * 64 * 4 == 737_280
    assert bytes_per_block(*SMOLLM2, torch.bfloat16) == 368_640
    # int8: 64 one-byte values and one float32 scale per token and KV head.
    assert bytes_per_block(*SMOLLM2, torch.int8) == 30 * 2 * 16 * 3 * (64 + 4) == 195_840


def test_an_int8_pool_holds_3_76x_the_blocks_of_float32_in_the_same_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache_module, "available_memory_bytes", lambda device: 1 << 30)
    cpu = torch.device("cpu")
    blocks = {
        dtype: size_kv_pool(bytes_per_block(*SMOLLM2, dtype), 0.5, cpu, 10**9)
        for dtype in (torch.float32, torch.bfloat16, torch.int8)
    }
    assert blocks == {torch.float32: 728, torch.bfloat16: 1456, torch.int8: 2741}


def test_engine_sizes_its_pool_from_the_kv_dtype(monkeypatch: pytest.MonkeyPatch, llama_checkpoint: Path) -> None:
    monkeypatch.setattr(kv_cache_module, "available_memory_bytes", lambda device: 1 << 24)
    # The tiny checkpoint: 3 layers, 2 KV heads of 16, 16-token blocks: 12,288 bytes a
    # block in float32, 6,144 in bfloat16, 3,840 in int8; half of 16 MiB to fill.
    expected = {"auto": (1 << 23) // 12_288, "bfloat16": (1 << 23) // 6_144, "int8": (1 << 23) // 3_840}
    assert expected == {"auto": 682, "bfloat16": 1365, "int8": 2184}
    for kv_cache_dtype, num_blocks in expected.items():
        llm = LLM(model=str(llama_checkpoint), dtype="float32", kv_memory_fraction=0.5, max_num_seqs=10**6,
                  kv_cache_dtype=kv_cache_dtype)
        engine = llm.engine
        assert engine.block_manager.num_blocks == num_blocks
        assert engine.kv_cache.data.dtype == resolve_kv_cache_dtype(kv_cache_dtype, torch.float32)
        assert (engine.kv_cache.scales is None) == (kv_cache_dtype != "int8")


def test_invalid_kv_cache_dtype_raises_value_error_naming_it(llama_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model=str(llama_checkpoint), kv_cache_dtype="float8")


def test_int8_quantization_is_symmetric_per_row_and_within_half_a_step() -> None:
    x = torch.tensor([[0.5, -1.27, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.5, -0.75, 0.01]])
    data, scales = quantize_int8(x)
    assert data.dtype == torch.int8 and scales.dtype == torch.float32
    assert data.tolist() == [[50, -127, 0, 100], [0, 0, 0, 0], [127, 64, -32, 0]]
    torch.testing.assert_close(scales, torch.tensor([0.01, 0.0, 3.0 / 127]))
    restored = dequantize_int8(data, scales, torch.float32)
    assert (restored - x).abs().le(scales[:, None] / 2 + 1e-7).all()
    assert restored[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_packed_int8_rows_carry_their_scale_bytes_after_the_values() -> None:
    torch.manual_seed(0)
    data, scales = quantize_int8(torch.randn(3, 5, 16))
    packed = pack_int8(data, scales)
    assert packed.shape == (3, 5, 20) and packed.dtype == torch.int8
    assert torch.equal(packed[..., :16], data)
    assert packed[0, 0, 16:].view(torch.float32).item() == scales[0, 0].item()
    unpacked_data, unpacked_scales = unpack_int8(packed)
    assert torch.equal(unpacked_data, data) and torch.equal(unpacked_scales, scales)


def _filled_cache(dtype: torch.dtype) -> KVCache:
    cache = KVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype,
                    device=torch.device("cpu"))
    torch.manual_seed(1)
    values = torch.randn(2, 2, 6, 4, 2, 8)
    cache.import_blocks(range(6), values)
    return cache


def test_int8_blocks_export_and_import_bit_for_bit() -> None:
    source = _filled_cache(torch.int8)
    exported = source.export_blocks([4, 1])
    assert exported.shape == (2, 2, 2, 4, 2, 8 + 4) and exported.dtype == torch.int8
    assert source.block_shape == (2, 2, 4, 2, 12)
    target = KVCache(2, 6, 4, 2, 8, torch.int8, torch.device("cpu"))
    target.import_blocks([0, 5], exported)
    assert source.scales is not None and target.scales is not None
    assert torch.equal(target.data[:, :, [0, 5]], source.data[:, :, [4, 1]])
    assert torch.equal(target.scales[:, :, [0, 5]], source.scales[:, :, [4, 1]])
    assert target.data[:, :, 1:5].eq(0).all()


def test_import_converts_blocks_of_another_kv_dtype() -> None:
    float_source = _filled_cache(torch.float32)
    int8_source = _filled_cache(torch.int8)
    assert int8_source.scales is not None
    # float32 into int8: quantized exactly as writes are.
    int8_target = KVCache(2, 6, 4, 2, 8, torch.int8, torch.device("cpu"))
    int8_target.import_blocks([2], float_source.export_blocks([3]))
    expected_data, expected_scales = quantize_int8(float_source.data[:, :, [3]])
    assert int8_target.scales is not None
    assert torch.equal(int8_target.data[:, :, [2]], expected_data)
    assert torch.equal(int8_target.scales[:, :, [2]], expected_scales)
    # int8 into float32 and bfloat16: dequantized.
    for dtype in (torch.float32, torch.bfloat16):
        target = KVCache(2, 6, 4, 2, 8, dtype, torch.device("cpu"))
        target.import_blocks([0], int8_source.export_blocks([3]))
        dequantized = dequantize_int8(int8_source.data[:, :, [3]], int8_source.scales[:, :, [3]], torch.float32)
        assert torch.equal(target.data[:, :, [0]], dequantized.to(dtype))


def test_import_rejects_blocks_of_another_shape() -> None:
    cache = KVCache(2, 6, 4, 2, 8, torch.int8, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"expected \(2, 2, 1, 4, 2, 12\)"):
        cache.import_blocks([0], torch.zeros(2, 2, 1, 4, 2, 8, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_write_then_read_returns_the_new_kv_in_the_cache_precision(dtype: torch.dtype) -> None:
    cache = KVCache(1, 4, 4, 2, 8, dtype, torch.device("cpu"))
    ((key_cache, value_cache),) = cache.layers()
    assert isinstance(key_cache, QuantizedKV) == (dtype == torch.int8)
    torch.manual_seed(2)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([13, 2, 7])
    flat_k, flat_v = write_to_cache(key, value, key_cache, value_cache, slots)
    read_k = read_cache(flat_k, slots, torch.float32)
    read_v = read_cache(flat_v, slots, torch.float32)
    if dtype == torch.bfloat16:
        expected_k, expected_v = key.bfloat16().float(), value.bfloat16().float()
    else:
        expected_k = dequantize_int8(*quantize_int8(key), torch.float32)
        expected_v = dequantize_int8(*quantize_int8(value), torch.float32)
    assert torch.equal(read_k, expected_k) and torch.equal(read_v, expected_v)
    # Block view: slot 13 is block 3, offset 1.
    assert torch.equal(read_cache(key_cache, torch.tensor([3]), torch.float32)[0, 1], expected_k[0])


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated", "offline"])
def test_every_engine_role_takes_kv_cache_dtype(role: str) -> None:
    from pdserve.cli import build_parser
    from pdserve.serve import engine_config

    parser = build_parser()
    assert engine_config(parser.parse_args([role, "--kv-cache-dtype", "int8"])).cache.kv_cache_dtype == "int8"
    assert engine_config(parser.parse_args([role])).cache.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args([role, "--kv-cache-dtype", "float8"])
    assert parser.parse_args(["up", "--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
