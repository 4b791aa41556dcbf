"""Compact KV caches (kv_cache_dtype bfloat16, int8): exact through a handoff, close to float32 KV greedy.

float32 stays the oracle elsewhere (test_exactness.py); here a reduced KV
dtype is held to two things: a handoff between engines gives exactly the
tokens (and the int8 rows) the same engine gives in-process, and teacher-forced
top-1 agreement with float32 KV, where the float32 reference is decisive
(tests/support/near_ties.py), stays near 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine import LLM, LLMEngine, SamplingParams
from tests.conftest import MLA_FAMILIES, random_prompts
from tests.support.cpu_paths import CPU_KINDS, emulate
from tests.support.handoff import hand_over, handoff_tokens, hold_together
from tests.support.near_ties import TopTwo, decisive_agreement, prompt_top_two

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# Teacher-forced top-1 agreement with float32 KV over 4 x 283 positions, where the float32 reference leads by
# MARGIN or more (672-857 positions count; Gemma 2's soft-capped logits fewest), the mixture-of-experts
# families with decisive routers (``agreement_checkpoint``). Measured (bfloat16 / int8), the same on every CPU
# kind's paths: 1.000 / 0.995-1.000 (Phi-3 lowest); over every position 0.971-1.000 / 0.937-0.996.
MARGIN = 0.2
MIN_COUNTED = 600
MIN_AGREEMENT = 0.99


def _engine(path: Path, kv_cache_dtype: str, **kwargs: object) -> LLMEngine:
    return LLM(model=str(path), dtype="float32", num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype, **kwargs).engine


@pytest.mark.parametrize(("prefill_dtype", "decode_dtype"), [
    ("bfloat16", "bfloat16"),
    ("int8", "int8"),
    ("auto", "int8"),  # float32 blocks quantized on import, as a local write would be
])
@pytest.mark.parametrize("attention_backend", ["sdpa", "cpu_paged"])
def test_kv_handoff_gives_exactly_the_tokens_of_the_decode_kv_dtype_in_process(
    checkpoint: Path, prefill_dtype: str, decode_dtype: str, attention_backend: str
) -> None:
    prompts = random_prompts([1, 16, 37, 150], seed=10)
    in_process = LLM(model=str(checkpoint), dtype="float32", num_kv_blocks=64, kv_cache_dtype=decode_dtype,
                     attention_backend=attention_backend).generate(prompts, GREEDY)
    prefill = _engine(checkpoint, prefill_dtype, attention_backend=attention_backend)
    decode = _engine(checkpoint, decode_dtype, attention_backend=attention_backend)
    # Prefilled in one batch, as in process: what is compared is the handoff, not the GEMMs' row counts.
    outputs = handoff_tokens(prefill, decode, prompts, GREEDY, together=True)
    assert [outputs[f"req-{i}"] for i in range(len(prompts))] == [out.token_ids for out in in_process]


def _record_rows(engine: LLMEngine, index_of: dict[str, int], rows: dict[tuple[int, int], tuple[bytes, bytes]]) -> None:
    """Each running sequence's cached rows, by (prompt index, position): int8 data and scales, as bytes."""
    cache = engine.kv_cache
    assert cache.scales is not None and cache.layout is None
    for seq in engine.scheduler.running:
        for position in range(seq.num_computed_tokens):
            block, slot = seq.block_table[position // cache.block_size], position % cache.block_size
            data, scales = cache.data[:, :, block, slot], cache.scales[:, :, block, slot]  # every layer's
            rows.setdefault((index_of[seq.request_id], position), (data.numpy().tobytes(), scales.numpy().tobytes()))


def _decode_recording_rows(engine: LLMEngine, index_of: dict[str, int]) -> dict[tuple[int, int], tuple[bytes, bytes]]:
    rows: dict[tuple[int, int], tuple[bytes, bytes]] = {}
    for _ in range(GREEDY_ROWS.max_tokens + 1):
        _record_rows(engine, index_of, rows)
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests()
    return rows


GREEDY_ROWS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("prefill_dtype", ["int8", "auto"])
@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_a_handed_off_int8_latent_cache_is_bit_for_bit_the_locally_written_one(
    family: str, prefill_dtype: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each latent row (normalised latent and rope part under one scale) of the prompt as the decode engine
    # imports it (int8 as sent, or float32 quantized on arrival) and of the tokens it decodes after, against
    # the rows an int8 engine writes in process; with each CPU kind's GEMMs (MKL's on a Xeon or a Zen 3,
    # pdserve's panels on a Zen 4 or 5) and both attention backends.
    checkpoint = request.getfixturevalue(f"{family}_checkpoint")
    prompts = random_prompts([1, 16, 37, 150], seed=10)
    for kind in CPU_KINDS:
        emulate(monkeypatch, kind)
        for backend in ("sdpa", "cpu_paged"):
            local = _engine(checkpoint, "int8", attention_backend=backend)
            index_of = {local.add_request(prompt, GREEDY_ROWS): i for i, prompt in enumerate(prompts)}
            expected = _decode_recording_rows(local, index_of)
            prefill = _engine(checkpoint, prefill_dtype, attention_backend=backend)
            decode = _engine(checkpoint, "int8", attention_backend=backend)
            held = hold_together(prefill, prompts, GREEDY_ROWS)
            index_of = {hand_over(prefill, decode, prompt, GREEDY_ROWS, out).request_id: i
                        for i, (prompt, out) in enumerate(zip(prompts, held))}
            landed = _decode_recording_rows(decode, index_of)
            # Every prompt token's row and the first two decoded tokens' (a row read after a step is a running
            # sequence's: the fourth token's step writes the third's and ends the request).
            assert sorted(landed) == sorted(expected) == [
                (i, position) for i, prompt in enumerate(prompts) for position in range(len(prompt) + 2)
            ]
            differing = [key for key in expected if landed[key] != expected[key]]
            assert not differing, f"{kind.name}, {backend}: rows (prompt, position) {differing[:8]} differ"


def test_int8_blocks_imported_into_a_float32_cache_decode_to_the_end(llama_checkpoint: Path) -> None:
    prompts = random_prompts([37, 150], seed=13)
    prefill, decode = _engine(llama_checkpoint, "int8"), _engine(llama_checkpoint, "auto")
    outputs = handoff_tokens(prefill, decode, prompts, GREEDY)
    # float32 decoding over a dequantized int8 prompt: the first steps equal the int8
    # engine's own first steps (same prompt KV, same first token).
    own = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=64, kv_cache_dtype="int8").generate(
        prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    )
    assert [outputs[f"req-{i}"][:2] for i in range(2)] == [out.token_ids for out in own]
    assert [len(outputs[f"req-{i}"]) for i in range(2)] == [24, 24]


def _teacher_forced_top2(path: Path, kv_cache_dtype: str, prompts: list[list[int]]) -> TopTwo:
    """The top two at every position after the first chunk; 16-token chunks make each read its context from the
    cache."""
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=16,
              kv_cache_dtype=kv_cache_dtype)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
    return prompt_top_two(outputs, skip=16)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_compact_kv_agrees_with_float32_kv_where_float32_is_decisive(
    agreement_checkpoint: Path, kv_cache_dtype: str
) -> None:
    prompts = random_prompts([300] * 4, seed=21)
    reference = _teacher_forced_top2(agreement_checkpoint, "auto", prompts)
    compact = _teacher_forced_top2(agreement_checkpoint, kv_cache_dtype, prompts)
    assert len(reference.tokens) == len(compact.tokens) == 4 * 283
    agreement = decisive_agreement(reference, compact, MARGIN)
    assert agreement.counted >= MIN_COUNTED and agreement.share >= MIN_AGREEMENT, str(agreement)
    # The compact cache really is read: the leads move (an argmax need not, Gemma 3's never did in bf16).
    assert max(abs(a - b) for a, b in zip(reference.margins, compact.margins)) > 1e-4
