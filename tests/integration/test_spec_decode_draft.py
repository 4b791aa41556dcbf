"""The draft_model method: greedy output equals transformers' whatever the draft (the target itself, a
shallower model, the target at lower precision), and a draft with another vocabulary is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.conftest import Oracle, _tiny_llama_config, build_checkpoint, random_prompts

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def _llm(path: Path, draft: Path, **kwargs: object) -> LLM:
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    spec.update(kwargs.pop("spec", {}))  # type: ignore[arg-type]
    return LLM(model=str(path), dtype="float32", speculative_config=spec, **kwargs)


def _assert_matches_oracle(outputs: list, prompts: list[list[int]], oracle: Oracle) -> None:
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == oracle.generate(prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"


@pytest.fixture(scope="module")
def shallow_draft(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's first layer only, with its embeddings, final norm and head: a cheaper, related model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:1]
    folder = tmp_path_factory.mktemp(f"draft-{checkpoint.name}")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def test_target_as_its_own_draft_accepts_every_proposal(checkpoint: Path, oracle: Oracle) -> None:
    prompts = random_prompts([1, 5, 16, 17, 40], seed=51)
    llm = _llm(checkpoint, checkpoint, num_kv_blocks=256)
    outputs = llm.generate(prompts, GREEDY)
    _assert_matches_oracle(outputs, prompts, oracle)
    for out in outputs:
        stats = out.spec_decode_stats
        assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
        # Prefill gives one token, each verifying step four (three accepted + the target's), the last
        # one fewer where max_tokens or EOS ends the request.
        assert stats.num_drafts == -(-(len(out.token_ids) - 1) // 4)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_shallower_draft_equals_transformers_with_chunked_prefill_prefix_hits_and_preemption(
    checkpoint: Path, oracle: Oracle, shallow_draft: Path
) -> None:
    shared = random_prompts([40], seed=52)[0]
    prompts = [shared + suffix for suffix in random_prompts([1, 9, 30], seed=53)] + random_prompts([95, 120], seed=54)
    roomy = _llm(checkpoint, shallow_draft, num_kv_blocks=256, block_size=16, max_num_batched_tokens=48)
    _assert_matches_oracle(roomy.generate(prompts, GREEDY), prompts, oracle)
    again = roomy.generate(prompts, GREEDY)
    _assert_matches_oracle(again, prompts, oracle)
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 16 * 16 for p in prompts]
    # 21 blocks: the newest running sequences are preempted and recomputed, draft KV included.
    tight = _llm(checkpoint, shallow_draft, num_kv_blocks=21, block_size=16, max_num_batched_tokens=48)
    _assert_matches_oracle(tight.generate(prompts, GREEDY), prompts, oracle)
    assert tight.engine.scheduler.num_preemptions > 0
    for llm in (roomy, tight):
        stats = llm.engine.stats()
        assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens > 0
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("draft_precision", [{"dtype": "bfloat16"}, {"quantization": "int8"}])
def test_target_at_lower_precision_as_draft_equals_transformers(
    checkpoint: Path, oracle: Oracle, draft_precision: dict
) -> None:
    prompts = random_prompts([3, 17, 33], seed=55)
    llm = _llm(checkpoint, checkpoint, num_kv_blocks=128, spec=draft_precision)
    assert llm.engine.spec_decoder.proposer.model.model.embed_tokens.weight.dtype == (
        torch.bfloat16 if draft_precision.get("dtype") else torch.float32
    )
    outputs = llm.generate(prompts, GREEDY)
    _assert_matches_oracle(outputs, prompts, oracle)
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0


def test_draft_with_another_vocabulary_is_refused_naming_both_sizes(
    llama_checkpoint: Path, tmp_path: Path
) -> None:
    config = _tiny_llama_config()
    config.vocab_size = 256
    draft = build_checkpoint(tmp_path / "small-vocab", config)
    with pytest.raises(ValueError, match=r"vocabulary of 256 tokens.*512"):
        _llm(llama_checkpoint, draft, num_kv_blocks=16)


def test_draft_model_config_needs_a_model() -> None:
    from pdserve.engine.types.speculative import SpeculativeConfig

    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2})


def test_kept_proposals_are_not_recomputed_by_the_draft(checkpoint: Path, oracle: Oracle) -> None:
    # The target as its own draft keeps every proposal. The draft fed all but the last proposed token
    # back (their KV is in the sequence's own blocks: one block of 64 holds the whole request), so
    # each proposing step's first forward needs only that last token and the target's token after the
    # run: 2 rows, not the k + 1 = 4 of recomputing the run. The first one is the prompt's catch-up.
    prompt = random_prompts([5], seed=52)[0]
    llm = _llm(checkpoint, checkpoint, num_kv_blocks=16, block_size=64)
    draft = llm.engine.draft
    assert draft is not None
    first_chunks: list[int] = []  # rows of each propose call's first forward
    forward = draft._forward

    propose = draft.propose

    def recording_propose(seqs, max_tokens):  # noqa: ANN001, ANN202
        calls: list[int] = []

        def first(chunks: list[list[int]], starts: list[int], tables: list[list[int]]) -> list[int]:
            calls.append(len(chunks[0]))
            return forward(chunks, starts, tables)

        draft._forward = first
        try:
            return propose(seqs, max_tokens)
        finally:
            draft._forward = forward
            first_chunks.append(calls[0])

    draft.propose = recording_propose
    (out,) = llm.generate([prompt], GREEDY)
    assert out.token_ids == oracle.generate(prompt, MAX_TOKENS)
    stats = out.spec_decode_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    # One propose call per verified run: the first catches up on the prompt and the first token.
    assert first_chunks == [len(prompt) + 1] + [2] * (stats.num_drafts - 1)
