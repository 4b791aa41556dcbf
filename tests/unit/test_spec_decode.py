"""Speculative decoding without a model: config validation, n-gram lookup, and the scheduler's and block
manager's accounting of proposed tokens (exact block ids on a tiny pool)."""

from __future__ import annotations

import pytest

from pdserve.engine.kv.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.proposer import NgramProposer, ngram_lookup
from pdserve.engine.types.config import SchedulerConfig
from pdserve.engine.types.sampling_params import SamplingParams
from pdserve.engine.types.speculative import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig

BS = 4


# ---- config ---------------------------------------------------------------------------


def test_config_from_vllm_dict_and_json() -> None:
    config = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    )
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (
        "ngram", 5, 2, 4,
    )
    assert config.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE["ngram"] == 4
    draft = SpeculativeConfig.from_dict(
        '{"method": "draft_model", "model": "/m", "num_speculative_tokens": 3, "quantization": "int4", "dtype": "bfloat16"}'
    )
    assert (draft.model, draft.quantization, draft.dtype) == ("/m", "int4", "bfloat16")
    assert draft.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE["draft_model"] == 2
    # What --speculative-config passes on to up's workers reads back the same.
    assert SpeculativeConfig.from_dict(draft.to_json()) == draft
    assert draft.to_json() == (
        '{"method": "draft_model", "num_speculative_tokens": 3, "model": "/m", "quantization": "int4", "dtype": "bfloat16"}'
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, r"speculative_config\.method must be one of"),
        ({"method": "ngram"}, r"speculative_config\.num_speculative_tokens is required"),
        ({"num_speculative_tokens": 2}, r"speculative_config\.method is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer >= 1, got 0"),
        ({"method": "ngram", "num_speculative_tokens": True}, r"num_speculative_tokens must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         r"prompt_lookup_min \(4\) must not exceed prompt_lookup_max \(2\)"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}, r"speculative_config\.model is for method"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"speculative_config\.model .* is required"),
        ({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2, "quantization": "fp8"},
         r"speculative_config\.quantization must be one of"),
        ({"method": "draft_model", "model": "/m", "num_speculative_tokens": 2, "dtype": "int8"},
         r"speculative_config\.dtype must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
         r"disable_by_batch_size must be an integer >= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, r"unknown keys \['lookahead'\]"),
        ("{not json", r"speculative_config is not valid JSON"),
        ("[1, 2]", r"speculative_config must be a mapping, got list"),
    ],
)
def test_bad_config_is_refused_naming_the_field(config: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(config)  # type: ignore[arg-type]


def test_use_speculation_must_be_a_bool() -> None:
    assert SamplingParams().use_speculation is True
    with pytest.raises(ValueError, match="use_speculation must be a bool"):
        SamplingParams(use_speculation=1)  # type: ignore[arg-type]


# ---- n-gram lookup ---------------------------------------------------------------------


def test_ngram_lookup_prefers_the_longest_suffix_at_its_latest_occurrence() -> None:
    # Suffix [1, 2] occurs at 0 and 4; the latest (4) is followed by 9, 1, 2.
    assert ngram_lookup([1, 2, 3, 4, 1, 2, 9, 1, 2], 1, 3, 3) == [9, 1, 2]
    # The 3-gram [5, 1, 2] occurs once earlier, followed by 3: it beats the later 2-gram match.
    assert ngram_lookup([5, 1, 2, 3, 1, 2, 7, 5, 1, 2], 1, 3, 2) == [3, 1]
    # Fewer tokens than asked when the match is near the end; none when nothing matches.
    assert ngram_lookup([1, 2, 3, 1, 2], 1, 2, 5) == [3, 1, 2]
    assert ngram_lookup([1, 2, 3, 4], 1, 3, 3) == []
    # prompt_lookup_min bounds the shortest suffix tried.
    assert ngram_lookup([1, 2, 3, 4, 3], 2, 3, 2) == []
    assert ngram_lookup([1, 2, 3, 4, 3], 1, 3, 2) == [4, 3]


def test_ngram_lookup_matches_whole_token_ids_only() -> None:
    # As int32 bytes, 256 then 1 contains the bytes of 1 at a misaligned offset: not a match.
    assert ngram_lookup([256, 1, 0, 0, 1, 7, 1], 1, 2, 2) == [7, 1]
    assert ngram_lookup([65536 * 3, 5, 3], 1, 1, 2) == []


def test_ngram_proposer_reads_each_sequence_with_its_own_limit() -> None:
    proposer = NgramProposer(1, 2)
    seqs = [_seq("a", [1, 2, 3, 1, 2]), _seq("b", [4, 4, 4])]
    assert proposer.propose(seqs, [1, 3]) == [[3], [4]]


# ---- scheduling and rollback ------------------------------------------------------------


def _seq(request_id: str, tokens: list[int], max_tokens: int = 100) -> Sequence:
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0), BS, "tiny")


def _decoding(scheduler: Scheduler, tokens: list[int]) -> Sequence:
    """A running sequence whose prompt is computed and whose first output token is sampled."""
    seq = _seq("a", tokens)
    scheduler.add(seq)
    out = scheduler.schedule()
    scheduler.complete_step(out)
    seq.append_token(500)
    return seq


def test_a_proposal_is_scheduled_as_extra_tokens_and_rejected_blocks_go_back() -> None:
    manager = BlockManager(8, BS)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), manager)
    seq = _decoding(scheduler, [10, 11, 12, 13])  # 5 tokens, 4 computed: block 0 full
    assert seq.block_table == [0]
    seq.spec_token_ids = [20, 21, 22, 23]
    out = scheduler.schedule()
    (item,) = out.scheduled
    assert (item.start, item.num_new_tokens, item.spec_token_ids, item.samples) == (4, 5, (20, 21, 22, 23), True)
    assert item.num_sampled_rows == 5 and not item.is_decode
    assert seq.block_table == [0, 1, 2]  # positions 4..8
    assert out.num_batched_tokens == 5 and seq.spec_token_ids == []
    scheduler.complete_step(out)
    assert seq.num_computed_tokens == 5  # proposed tokens are not the sequence's until verified
    # One proposed token accepted: tokens 20 and the target's own 30 are appended; 6 KV positions count.
    seq.append_token(20)
    seq.append_token(30)
    scheduler.accept_proposed(seq, 1)
    assert seq.num_computed_tokens == 6 and seq.block_table == [0, 1]
    assert manager.free_block_ids()[:1] == [2]  # back at the front, as if never taken
    assert manager.num_free_blocks == 6


def test_rollback_exactly_at_a_block_boundary_keeps_the_full_block() -> None:
    manager = BlockManager(8, BS)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), manager)
    seq = _decoding(scheduler, [10, 11, 12])  # 4 tokens, 3 computed
    seq.spec_token_ids = [20, 21, 22, 23, 24]
    out = scheduler.schedule()
    assert seq.block_table == [0, 1, 2]  # positions 3..8
    scheduler.complete_step(out)
    for token in (20, 21, 22, 23):
        seq.append_token(token)
    scheduler.accept_proposed(seq, 4 - 1)  # 3 proposed kept, the 4th token is the target's own
    # 7 tokens computed fill block 0 and 3 slots of block 1; block 2 goes back.
    assert (seq.num_computed_tokens, seq.block_table) == (7, [0, 1])
    assert manager.num_free_blocks == 6
    # Only block 0 is full of accepted tokens: it alone is hashed into the prefix cache.
    assert manager.num_cached_blocks == 1 and manager.cached_block_id(seq.block_hashes()[0]) == 0


def test_a_proposal_is_cut_to_the_token_budget_and_dropped_rather_than_preempting() -> None:
    manager = BlockManager(3, BS)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=3), manager)
    seq = _decoding(scheduler, [10, 11, 12])
    seq.spec_token_ids = [20, 21, 22, 23]
    (item,) = scheduler.schedule().scheduled
    assert item.spec_token_ids == (20, 21) and item.num_new_tokens == 3

    manager = BlockManager(2, BS)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), manager)
    a, b = _seq("a", [10, 11, 12]), _seq("b", [1, 2, 3])
    scheduler.add(a)
    scheduler.add(b)
    scheduler.complete_step(scheduler.schedule())
    a.append_token(5)
    b.append_token(6)
    a.spec_token_ids = [20, 21, 22, 23, 24]  # would need a second block for a: none is free
    out = scheduler.schedule()
    assert [(i.seq.request_id, i.num_new_tokens, i.spec_token_ids) for i in out.scheduled] == [
        ("a", 1, ()), ("b", 1, ()),
    ]
    assert out.preempted == () and scheduler.num_preemptions == 0
