"""DeepSeek's latent attention and routing: one cached row per token, both attention forms, the routers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM
from pdserve.engine.kv.cache import KVCache, bytes_per_block
from pdserve.engine.models.deepseek import LatentAttention
from pdserve.engine.types.handoff import KVLayout
from tests.conftest import _tiny_deepseek_v2_config, _tiny_deepseek_v3_config, build_checkpoint


def _engine(tmp_path: Path, config: object, **kwargs: object) -> LLM:
    return LLM(model=str(build_checkpoint(tmp_path, config)), dtype="float32", num_kv_blocks=16, **kwargs)


def test_the_cache_keeps_one_latent_row_per_token_and_layer(tmp_path: Path) -> None:
    engine = _engine(tmp_path, _tiny_deepseek_v2_config()).engine
    # kv_lora_rank 32 + qk_rope_head_dim 8, one "KV head" shared by the 4 query heads, no value rows.
    assert tuple(engine.kv_cache.data.shape) == (3, 1, 16, 16, 1, 40)
    assert engine.kv_layout == KVLayout(num_layers=3, num_kv_heads=1, head_dim=40, block_size=16, dtype="float32",
                                        kv_parts=1)
    # 3 layers x 16 tokens x 40 float32 features, where multi-head attention of the same 4 heads of 24 features
    # keeps keys and values: 3 x 2 x 16 x 4 x 24 x 4 bytes, 4.8 times as many.
    assert engine.kv_layout.bytes_per_block == 3 * 16 * 40 * 4 == 7680
    assert bytes_per_block(3, 16, 4, 24, torch.float32) == 36864
    key, value = engine.kv_cache.layers()[0]
    assert key is value or key.data_ptr() == value.data_ptr()  # one row, read as key and value


def test_an_int8_latent_pool_packs_its_scales_and_exports_one_part() -> None:
    cache = KVCache(2, 4, 16, 1, 40, torch.int8, torch.device("cpu"), parts=1)
    key, value = cache.layers()[1]
    assert key.data.data_ptr() == value.data.data_ptr() and key.scales.data_ptr() == value.scales.data_ptr()
    assert tuple(cache.export_blocks([2, 3]).shape) == (2, 1, 2, 16, 1, 44)
    with pytest.raises(ValueError, match=r"parts must be one of \(1, 2\), got 3"):
        KVCache(2, 4, 16, 1, 40, torch.float32, torch.device("cpu"), parts=3)


def test_absorbed_and_expanded_forms_give_the_same_attention(tmp_path: Path) -> None:
    model = _engine(tmp_path, _tiny_deepseek_v3_config()).engine.model
    layer = model.model.layers[0].self_attn
    assert isinstance(layer, LatentAttention) and (layer.num_heads, layer.v_head_dim) == (4, 32)
    torch.manual_seed(0)
    ctx = 9
    latent = torch.randn(ctx, layer.head_dim)
    q_nope, q_rope = torch.randn(1, 4, layer.nope_dim), torch.randn(1, 4, layer.rope_head_dim)
    keys, values = layer.expand(latent)  # (ctx, heads, 24), (ctx, heads, 32)
    scores = torch.einsum("hd,chd->hc", torch.cat((q_nope, q_rope), -1)[0], keys) * layer.scale
    expanded = torch.einsum("hc,chv->hv", scores.softmax(-1), values)
    absorbed_query = torch.cat((layer.absorb(q_nope), q_rope), -1)[0]  # (heads, 40)
    latent_scores = absorbed_query @ latent.T * layer.scale  # (heads, ctx)
    absorbed = layer.unabsorb((latent_scores.softmax(-1) @ latent)[None, :, : layer.latent_dim])[0]
    torch.testing.assert_close(latent_scores, scores, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("version", ["v2", "v3"])
def test_routing_chooses_and_weighs_the_experts_transformers_does(tmp_path: Path, version: str) -> None:
    from transformers import AutoModelForCausalLM

    config = _tiny_deepseek_v2_config() if version == "v2" else _tiny_deepseek_v3_config()
    path = build_checkpoint(tmp_path, config)
    ours = LLM(model=str(path), dtype="float32", num_kv_blocks=16).engine.model.model.layers[1].mlp
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.layers[1].mlp.gate
    torch.manual_seed(1)
    x = torch.randn(64, 64) * 3
    weights, chosen = ours.route(x)
    _, their_weights, their_chosen = theirs(x)
    order, their_order = chosen.argsort(1), their_chosen.argsort(1)
    assert torch.equal(chosen.gather(1, order), their_chosen.gather(1, their_order))
    assert torch.equal(weights.gather(1, order), their_weights.gather(1, their_order))
    # Group limits bite: some tokens' overall best experts lie outside their chosen groups.
    if version == "v2":
        unlimited = torch.softmax(x @ ours.gate.weight.T, -1).topk(3, -1).indices
    else:
        unlimited = (torch.sigmoid(x @ ours.gate.weight.T) + ours.gate.e_score_correction_bias).topk(3, -1).indices
    assert not torch.equal(unlimited.sort(1).values, chosen.sort(1).values)
    assert ours.shared_experts is not None and ours.shared_experts.intermediate_size == 64


def test_dense_first_layers_then_experts(tmp_path: Path) -> None:
    model = _engine(tmp_path, _tiny_deepseek_v2_config()).engine.model
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["MLP", "MoE", "MoE"]
    assert model.model.layers[0].mlp.intermediate_size == 160 and model.fused_decoder is None


def test_yarn_tables_and_score_scale_match_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

    from pdserve.engine.models.rope import RotaryEmbedding, yarn_softmax_scale

    config = _tiny_deepseek_v2_config()
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = RotaryEmbedding(config, config.qk_rope_head_dim, 64)
    freqs = torch.arange(64, dtype=torch.float32)[:, None] * inv_freq[None, :]
    assert torch.equal(ours.cos[:, :4], freqs.cos() * factor)
    assert yarn_softmax_scale(config.rope_parameters, 24**-0.5) == yarn_apply_mscale(config.rope_parameters, 24**-0.5)
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1  # YaRN's, for factor 4 and mscale_all_dim 0.707
    assert yarn_softmax_scale(config.rope_parameters, 1.0) == pytest.approx(mscale**2)


def test_tensor_parallel_ranks_keep_their_heads_and_the_whole_latent() -> None:
    from pdserve.engine.models.deepseek import DeepseekV2ForCausalLM
    from pdserve.engine.parallel.sharding import TensorParallelShard

    config = _tiny_deepseek_v2_config()
    whole = DeepseekV2ForCausalLM(config, 64).model.layers[0].self_attn
    for rank in (0, 1):
        model = DeepseekV2ForCausalLM(config, 64)
        attention = model.model.layers[0].self_attn
        for name in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            getattr(attention, name).weight.data.copy_(getattr(whole, name).weight)
        TensorParallelShard(rank, 2).shard(model)
        # 2 of the 4 heads: q rows of 24 (16 no-rope + 8 rope), kv_b rows of 32 (16 key + 16 value), o columns of 16.
        assert attention.num_heads == 2 and attention.num_kv_heads == 1
        assert torch.equal(attention.q_proj.weight, whole.q_proj.weight[rank * 48 : (rank + 1) * 48])
        assert torch.equal(attention.kv_b_proj.weight, whole.kv_b_proj.weight[rank * 64 : (rank + 1) * 64])
        assert torch.equal(attention.o_proj.weight, whole.o_proj.weight[:, rank * 32 : (rank + 1) * 32])
        assert torch.equal(attention.kv_a_proj_with_mqa.weight, whole.kv_a_proj_with_mqa.weight)  # the latent: whole
        # The shared expert splits like the routed ones: 64 columns, 32 per rank.
        assert model.model.layers[1].mlp.shared_experts.intermediate_size == 32
