"""benchmarks.window_kv: real models' KV geometry; the bytes counted are the pages a sequence's blocks hold."""

from __future__ import annotations

from pathlib import Path

from benchmarks.window_kv import _configs, _write, held_bytes


def test_the_models_have_their_checkpoints_kv_geometry() -> None:
    configs = _configs(4112)
    gemma3 = configs["gemma3_1b"]
    assert (gemma3.num_hidden_layers, gemma3.num_key_value_heads, gemma3.head_dim, gemma3.sliding_window) == (
        26, 1, 256, 512)
    assert [i for i, kind in enumerate(gemma3.layer_types) if kind == "full_attention"] == [5, 11, 17, 23]
    assert configs["gemma3_4b"].layer_types.count("full_attention") == 5
    gemma2, mistral = configs["gemma2_2b"], configs["mistral_7b"]
    assert (gemma2.num_hidden_layers, gemma2.num_key_value_heads, gemma2.sliding_window) == (26, 4, 4096)
    assert (mistral.num_hidden_layers, mistral.num_key_value_heads, mistral.head_dim) == (32, 8, 128)


def test_a_sequence_holds_the_full_layers_whole_and_the_sliding_ones_from_its_window(tmp_path: Path) -> None:
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=1,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=128, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    path = _write(tmp_path, config)
    paged, full = held_bytes(path, 64, paged=True), held_bytes(path, 64, paged=False)
    # A block: 2 layers x keys and values x 16 slots x 16 float32 features = 4,096 bytes; a page is one layer's.
    assert full == {"blocks": 4, "pages": 4, "groups": 1, "bytes": 4 * 4096, "block_bytes": 4096}
    # The next query at 64 reads positions 49.. in the sliding layer: its block 3 only.
    assert paged == {"blocks": 4, "pages": 5, "groups": 2, "bytes": 5 * 2048, "block_bytes": 4096}
