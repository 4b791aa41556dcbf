"""Synthetic workloads: lengths within bounds, exactly shared prefixes, reproducible from the seed."""

from __future__ import annotations

from collections import Counter

import pytest

from pdserve.bench.request import BenchRequest
from pdserve.bench.workload import (
    LOWEST_ORDINARY_TOKEN_ID,
    WorkloadConfig,
    build_workload,
    length_bounds,
    mixed_workload,
    prefix_workload,
    random_workload,
    warmup_requests,
)

VOCAB = 512


def test_length_bounds_are_the_integers_inside_the_range() -> None:
    assert length_bounds(100, 0.0) == (100, 100)
    assert length_bounds(100, 0.5) == (50, 150)
    assert length_bounds(10, 0.15) == (9, 11)  # [8.5, 11.5]
    assert length_bounds(1, 0.9) == (1, 1)  # [0.1, 1.9], and never below one token


def test_random_lengths_stay_within_the_range_and_ids_avoid_special_tokens() -> None:
    config = WorkloadConfig(kind="random", num_prompts=200, input_len=40, output_len=20, range_ratio=0.5, seed=1)
    requests = random_workload(config, VOCAB)
    assert len(requests) == 200
    input_lens = [r.prompt_len for r in requests]
    output_lens = [r.output_len for r in requests]
    assert (min(input_lens), max(input_lens)) == (20, 60)  # 200 draws from 41 values reach both ends
    assert (min(output_lens), max(output_lens)) == (10, 30)
    ids = [t for r in requests for t in r.prompt_token_ids or ()]
    assert (min(ids), max(ids)) == (LOWEST_ORDINARY_TOKEN_ID, VOCAB - 1)


def test_a_zero_range_ratio_gives_exact_lengths() -> None:
    requests = random_workload(WorkloadConfig(num_prompts=5, input_len=7, output_len=3), VOCAB)
    assert [(r.prompt_len, r.output_len) for r in requests] == [(7, 3)] * 5


@pytest.mark.parametrize("kind", ["random", "prefix", "mixed"])
def test_the_seed_reproduces_the_workload(kind: str) -> None:
    config = WorkloadConfig(kind=kind, num_prompts=10, input_len=12, output_len=4, range_ratio=0.3,
                            num_prefixes=3, prefix_len=16, seed=5)
    assert build_workload(config, VOCAB) == build_workload(config, VOCAB)
    other = WorkloadConfig(**{**config.__dict__, "seed": 6})
    assert build_workload(other, VOCAB) != build_workload(config, VOCAB)


def test_prefix_requests_share_exactly_their_prefix_round_robin() -> None:
    config = WorkloadConfig(kind="prefix", num_prompts=9, input_len=10, output_len=4, num_prefixes=3, prefix_len=32,
                            seed=2)
    requests = prefix_workload(config, VOCAB)
    prompts = [r.prompt_token_ids or () for r in requests]
    assert all(len(p) == 42 for p in prompts)
    prefixes = [p[:32] for p in prompts]
    # Round robin: request i carries prefix i % 3, and the three prefixes differ.
    assert prefixes[0:3] == prefixes[3:6] == prefixes[6:9]
    assert len(set(prefixes[:3])) == 3
    suffixes = [p[32:] for p in prompts]
    assert len(set(suffixes)) == 9
    # Requests with the same prefix have exactly its 32 tokens in common; others none.
    common = {(i, j): _common_prefix_len(prompts[i], prompts[j]) for i in range(9) for j in range(i + 1, 9)}
    assert {pair: n for pair, n in common.items() if n} == {
        pair: 32 for pair in common if pair[0] % 3 == pair[1] % 3
    }


def _common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_prefix_choice_can_be_random_and_seeded() -> None:
    config = WorkloadConfig(kind="prefix", num_prompts=60, input_len=4, output_len=2, num_prefixes=3, prefix_len=8,
                            prefix_order="random", seed=11)
    requests = prefix_workload(config, VOCAB)
    prefixes = Counter(tuple((r.prompt_token_ids or ())[:8]) for r in requests)
    assert len(prefixes) == 3
    assert sum(prefixes.values()) == 60
    assert prefix_workload(config, VOCAB) == requests


def test_prefix_suffixes_are_distinct_even_when_collisions_are_likely() -> None:
    # 40 one-token suffixes out of 495 ordinary ids: a collision is likely (birthday bound), and is redrawn.
    config = WorkloadConfig(kind="prefix", num_prompts=40, input_len=1, output_len=1, num_prefixes=1, prefix_len=4,
                            seed=0)
    suffixes = [(r.prompt_token_ids or ())[4:] for r in prefix_workload(config, VOCAB)]
    assert len(set(suffixes)) == 40


def test_warmup_requests_mirror_the_workload_shapes_with_fresh_ids() -> None:
    requests = (
        BenchRequest(prompt_token_ids=(20, 21, 22), prompt=None, output_len=5),
        BenchRequest(prompt_token_ids=None, prompt="hello", output_len=2),
    )
    warmups = warmup_requests(requests, 3, VOCAB, seed=0)
    assert [(w.prompt_len, w.output_len) for w in warmups] == [(3, 5), (16, 2), (3, 5)]
    assert all(w.prompt_token_ids != (20, 21, 22) for w in warmups)
    assert warmup_requests(requests, 3, VOCAB, seed=0) == warmups


@pytest.mark.parametrize(("overrides", "message"), [
    ({"kind": "chat"}, "unknown workload 'chat'"),
    ({"num_prompts": 0}, "--num-prompts must be >= 1"),
    ({"range_ratio": 1.0}, r"--range-ratio must be in \[0, 1\)"),
    ({"kind": "prefix", "num_prefixes": 0}, "--num-prefixes and --prefix-len must be >= 1"),
    ({"kind": "file"}, "the file workload needs --dataset"),
    ({"kind": "mixed", "long_len": 0}, "--long-len, --num-prefixes and --prefix-len must be >= 1"),
    ({"kind": "mixed", "mix": (0.0, 0.0, 0.0)}, "--mix must be three non-negative weights"),
    ({"kind": "mixed", "mix": (1.0, -1.0, 1.0)}, "--mix must be three non-negative weights"),
])
def test_bad_workload_options_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkloadConfig(**overrides)


def test_mixed_requests_are_chat_turns_long_documents_and_shared_prefixes_in_their_shares() -> None:
    config = WorkloadConfig(kind="mixed", num_prompts=400, input_len=20, output_len=8, num_prefixes=2, prefix_len=64,
                            long_len=300, mix=(0.5, 0.25, 0.25), seed=3)
    requests = mixed_workload(config, VOCAB)
    prompts = [r.prompt_token_ids or () for r in requests]
    prefixes = Counter(p[:64] for p in prompts if len(p) == 84)
    kinds = Counter("long" if len(p) == 300 else "prefix" if p[:64] in prefixes and prefixes[p[:64]] > 1 else "chat"
                    for p in prompts)
    assert set(len(p) for p in prompts) == {20, 84, 300}
    assert len(prefixes.most_common(2)) == 2 and sum(prefixes.values()) == kinds["prefix"]
    # 400 draws: each share within 5 points of its weight.
    assert abs(kinds["chat"] / 400 - 0.5) < 0.05 and abs(kinds["long"] / 400 - 0.25) < 0.05
    assert abs(kinds["prefix"] / 400 - 0.25) < 0.05
    assert len(set(prompts)) == 400 and {r.output_len for r in requests} == {8}


def test_a_mix_flag_is_parsed_or_refused_naming_it() -> None:
    from pdserve.bench.config import parse_mix

    assert parse_mix("0.6, 0.2,0.2") == (0.6, 0.2, 0.2)
    for bad in ("1,2", "a,b,c", "0,0,0", "1,inf,1"):
        with pytest.raises(ValueError, match="--mix takes three non-negative weights CHAT,LONG,PREFIX"):
            parse_mix(bad)
