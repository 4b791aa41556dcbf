"""The draft model's prompt KV across a handoff, both ways: built on the prefill engine and handed over as the
handoff's draft section, or recomputed by the decode engine. Greedy output equals transformers' either way,
a decode engine that cannot use a draft section ignores it, and no block is left held on either side."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLMEngine, SamplingParams
from pdserve.engine.types.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.types.handoff import DRAFT_SECTION_SUFFIX, KVHandoff, KVLayout
from pdserve.engine.types.speculative import SpeculativeConfig
from pdserve.kv_transfer.descriptor import handoff_from_proto, handoff_to_proto
from tests.conftest import Oracle, random_prompts
from tests.integration.test_spec_decode_draft import shallow_draft  # noqa: F401 - fixture
from tests.support.handoff import finished_outputs, prefill_and_hold

MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
BLOCK_SIZE = 16


def _draft(path: Path, **kwargs: object) -> SpeculativeConfig:
    return SpeculativeConfig(
        method="draft_model", model=str(path), num_speculative_tokens=3, disable_by_batch_size=8, **kwargs
    )


def _engine(checkpoint: Path, spec: SpeculativeConfig | None = None, handoff_draft_kv: bool = False) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=ModelConfig(model=str(checkpoint), dtype="float32"),
            cache=CacheConfig(num_kv_blocks=96, block_size=BLOCK_SIZE),
            speculative_config=spec,
            handoff_draft_kv=handoff_draft_kv,
        )
    )


class _ChunkLog:
    """Records where the chunks of every forward the decode engine's draft runs start."""

    def __init__(self, engine: LLMEngine) -> None:
        self.starts: list[int] = []
        draft = engine.draft
        assert draft is not None
        forward = draft._forward

        def logged(chunks, starts, tables):  # type: ignore[no-untyped-def]
            self.starts.extend(starts)
            return forward(chunks, starts, tables)

        draft._forward = logged  # type: ignore[method-assign]


def _hand_over_with_draft(prefill: LLMEngine, decode: LLMEngine, prompt: list[int]) -> tuple[str, bool]:
    """What the decode service does: the target's blocks it lacks, and the draft section from block 0
    when its draft can use it; the lease ends once both landed. (request id, whether draft KV landed)."""
    held = prefill_and_hold(prefill, prompt, GREEDY)
    handoff = held.kv_handoff
    assert handoff is not None
    request_id = decode.kv_connector.add_remote_request(held.request_id, prompt, GREEDY, handoff)
    (slot,) = decode.kv_connector.drain_kv_slots()
    used_draft = decode.kv_connector.accepts_draft_kv(handoff)
    if used_draft:
        section = handoff.draft_section()
        assert section is not None and section.request_id == request_id + DRAFT_SECTION_SUFFIX
        assert prefill.leases.num_layers_of(section.request_id) == section.layout.num_layers
        draft_blocks = prefill.leases.export(section.request_id, 0)
        assert tuple(draft_blocks.shape) == section.layout.tensor_shape(handoff.num_blocks)
        assert decode.kv_connector.fill_draft(request_id, draft_blocks)
    blocks = prefill.leases.export(request_id, slot.first_block)
    assert prefill.leases.release(request_id)
    assert decode.kv_connector.fill(request_id, slot.first_block, blocks) is not None
    return request_id, used_draft


def test_draft_kv_built_on_the_prefill_engine_is_used_not_recomputed(
    checkpoint: Path, oracle: Oracle, shallow_draft: Path  # noqa: F811
) -> None:
    # A draft of another depth than the target (one layer): its section has its own layout.
    spec = _draft(shallow_draft)
    prefill = _engine(checkpoint, spec, handoff_draft_kv=True)
    decode = _engine(checkpoint, spec)
    chunks = _ChunkLog(decode)
    # 16 and 32 tokens end exactly on a block boundary; 40 shares its first two blocks with the third
    # prompt, which the decode engine then caches (the draft section still comes from block 0).
    shared = random_prompts([32], seed=81)[0]
    prompts = [*random_prompts([5, 16], seed=82), shared, shared + random_prompts([8], seed=83)[0]]
    ids = []
    for prompt in prompts:
        request_id, used_draft = _hand_over_with_draft(prefill, decode, prompt)
        assert used_draft
        assert decode._requests[request_id].num_draft_computed_tokens == len(prompt)
        ids.append(request_id)
    assert decode.kv_connector.drain_kv_slots() == []
    tokens = finished_outputs(decode)
    assert [tokens[i] for i in ids] == [oracle.generate(p, MAX_TOKENS) for p in prompts]
    # The decode engine's draft never ran over a prompt: no forward of it starts before the first token.
    assert chunks.starts and min(chunks.starts) >= min(len(p) for p in prompts)
    stats = decode.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0
    assert prefill.block_manager.num_used_blocks == 0 and len(prefill.leases) == 0
    assert decode.block_manager.num_used_blocks == 0


def test_recomputed_draft_kv_gives_the_same_tokens_as_handed_over(
    checkpoint: Path, oracle: Oracle, shallow_draft: Path  # noqa: F811
) -> None:
    spec = _draft(shallow_draft)
    prompts = random_prompts([7, 33, 48], seed=84)
    results = {}
    for handoff_draft_kv in (False, True):
        prefill = _engine(checkpoint, spec, handoff_draft_kv=handoff_draft_kv)
        decode = _engine(checkpoint, spec)
        chunks = _ChunkLog(decode)
        ids = []
        for prompt in prompts:
            request_id, used_draft = _hand_over_with_draft(prefill, decode, prompt)
            assert used_draft == handoff_draft_kv
            ids.append(request_id)
        tokens = finished_outputs(decode)
        results[handoff_draft_kv] = [tokens[i] for i in ids]
        # Recomputing: the draft's first forward for a request runs its prompt from position 0.
        assert chunks.starts.count(0) == (0 if handoff_draft_kv else len(prompts))
        assert prefill.block_manager.num_used_blocks == decode.block_manager.num_used_blocks == 0
    assert results[False] == results[True] == [oracle.generate(p, MAX_TOKENS) for p in prompts]


@pytest.mark.parametrize("decode_spec", ["none", "ngram", "other_draft"])
def test_a_decode_engine_that_cannot_use_the_draft_section_ignores_it(
    checkpoint: Path, oracle: Oracle, shallow_draft: Path, decode_spec: str  # noqa: F811
) -> None:
    prefill = _engine(checkpoint, _draft(shallow_draft), handoff_draft_kv=True)
    if decode_spec == "none":
        decode = _engine(checkpoint)
    elif decode_spec == "ngram":
        decode = _engine(checkpoint, SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    else:
        # The target as draft: another depth and identity than the section's.
        decode = _engine(checkpoint, _draft(checkpoint))
    prompts = random_prompts([9, 21], seed=85)
    ids = []
    for prompt in prompts:
        request_id, used_draft = _hand_over_with_draft(prefill, decode, prompt)
        assert not used_draft
        ids.append(request_id)
    tokens = finished_outputs(decode)
    assert [tokens[i] for i in ids] == [oracle.generate(p, MAX_TOKENS) for p in prompts]
    assert prefill.block_manager.num_used_blocks == decode.block_manager.num_used_blocks == 0


def test_the_same_draft_in_another_dtype_is_another_draft(checkpoint: Path) -> None:
    float_draft = _engine(checkpoint, _draft(checkpoint)).draft
    bf16_draft = _engine(checkpoint, _draft(checkpoint, dtype="bfloat16")).draft
    assert float_draft is not None and bf16_draft is not None
    assert float_draft.accepts(float_draft.kv_layout, float_draft.identity)
    assert not bf16_draft.accepts(float_draft.kv_layout, float_draft.identity)
    assert bf16_draft.kv_layout.dtype == "bfloat16"


def test_the_lease_table_exports_the_draft_section_and_ends_it_with_the_request(
    checkpoint: Path, shallow_draft: Path  # noqa: F811
) -> None:
    prefill = _engine(checkpoint, _draft(shallow_draft), handoff_draft_kv=True)
    ended: list[str] = []
    prefill.leases.on_end = ended.append
    prompt = random_prompts([20], seed=86)[0]
    held = prefill_and_hold(prefill, prompt, GREEDY)
    handoff = held.kv_handoff
    assert handoff is not None and handoff.draft_layout == prefill.draft.kv_layout
    num_layers = prefill.kv_layout.num_layers
    assert handoff.draft_layout.num_layers == 1 < num_layers
    section_id = held.request_id + DRAFT_SECTION_SUFFIX
    assert prefill.leases.num_layers_of(section_id) == 1
    assert prefill.leases.num_layers_of(held.request_id) == num_layers
    draft_blocks = prefill.leases.export(section_id, 1)
    target_blocks = prefill.leases.export(held.request_id, 1)
    assert draft_blocks.shape[:3] == (1, prefill.draft.kv_layout.kv_parts, 1)
    assert target_blocks.shape[:3] == (num_layers, prefill.kv_layout.kv_parts, 1)
    # The section's KV is the draft's own over the prompt: what its pool holds in the request's blocks.
    table = prefill.leases._leases[held.request_id].seq.block_table
    assert torch.equal(draft_blocks, prefill.draft.kv_cache.export_blocks(table[1:]))
    with pytest.raises(ValueError, match="first_block"):
        prefill.leases.export(section_id, 3)
    assert prefill.leases.release(held.request_id)
    assert ended == [held.request_id, section_id]
    with pytest.raises(KeyError):
        prefill.leases.export(section_id, 0)
    assert prefill.block_manager.num_used_blocks == 0


def test_an_engine_without_a_handed_over_draft_exports_no_section(llama_checkpoint: Path) -> None:
    # A draft for its own decoding, but not building the handoff's draft KV.
    prefill = _engine(llama_checkpoint, _draft(llama_checkpoint))
    held = prefill_and_hold(prefill, random_prompts([10], seed=87)[0], GREEDY)
    assert held.kv_handoff is not None and held.kv_handoff.draft_layout is None
    with pytest.raises(KeyError):
        prefill.leases.export(held.request_id + DRAFT_SECTION_SUFFIX, 0)
    prefill.leases.release_all()


@pytest.mark.parametrize("spec", [None, SpeculativeConfig(method="ngram", num_speculative_tokens=2)])
def test_handoff_draft_kv_needs_a_draft_model(spec: SpeculativeConfig | None) -> None:
    with pytest.raises(ValueError, match="handoff_draft_kv needs a speculative_config with method 'draft_model'"):
        EngineConfig(speculative_config=spec, handoff_draft_kv=True)


def _handoff(**kwargs: object) -> KVHandoff:
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")
    fields = dict(
        request_id="r", model_id="m", layout=layout, block_hashes=(), num_tokens=20, first_token_id=3,
        transport="grpc", address="127.0.0.1:5", lease_deadline_ms=1, worker_id="p", epoch=1,
    )
    fields.update(kwargs)
    return KVHandoff(**fields)  # type: ignore[arg-type]


def test_the_draft_section_survives_the_wire_and_a_malformed_one_is_refused() -> None:
    draft_layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, block_size=16, dtype="bfloat16")
    handoff = _handoff(draft_layout=draft_layout, draft_model_id="draft")
    assert handoff_from_proto(handoff_to_proto(handoff)) == handoff
    plain = _handoff()
    assert handoff_from_proto(handoff_to_proto(plain)) == plain and plain.draft_section() is None
    section = handoff.draft_section()
    assert section == dataclasses.replace(
        handoff, request_id="r" + DRAFT_SECTION_SUFFIX, layout=draft_layout, draft_layout=None, draft_model_id=""
    )
    assert section.num_blocks == handoff.num_blocks == 2
    with pytest.raises(ValueError, match="draft_model_id must name the draft"):
        _handoff(draft_layout=draft_layout)
    with pytest.raises(ValueError, match="draft_model_id is given without draft_layout"):
        _handoff(draft_model_id="draft")
    with pytest.raises(ValueError, match=r"draft_layout\.block_size 8 != layout\.block_size 16"):
        _handoff(draft_layout=dataclasses.replace(draft_layout, block_size=8), draft_model_id="draft")
