"""benchmarks.mla_handoff: the models compared have one width; a held prompt's export is what is counted."""

from __future__ import annotations

from pathlib import Path

from benchmarks.mla_handoff import _configs, _write, measure


def test_the_compared_models_share_width_and_heads() -> None:
    configs = _configs(2)
    mla, mha, gqa = configs["mla"], configs["mha"], configs["gqa"]
    for config in configs.values():
        assert (config.hidden_size, config.num_attention_heads, config.num_hidden_layers) == (2048, 16, 2)
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.first_k_dense_replace) == (512, 64, 2)
    assert (mha.num_key_value_heads, mha.head_dim, gqa.num_key_value_heads) == (16, 128, 4)


def test_the_bytes_counted_are_the_latent_rows_of_every_held_block(tmp_path: Path) -> None:
    config = _configs(1)["mla"]
    config.hidden_size, config.num_attention_heads, config.kv_lora_rank = 64, 2, 32
    config.qk_nope_head_dim = config.v_head_dim = 16
    config.qk_rope_head_dim, config.intermediate_size = 8, 64
    result = measure(_write(tmp_path, config), 20, "auto")
    # 20 tokens fill 2 blocks of 16: 1 layer x 1 part x 2 blocks x 16 slots x (32 + 8) float32 features.
    assert (result["blocks"], result["bytes"]) == (2, 2 * 16 * 40 * 4)
    assert result["layout"]["kv_parts"] == 1 and result["bytes_per_token"] == 256.0
