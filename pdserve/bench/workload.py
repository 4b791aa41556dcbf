"""What the benchmark sends: seeded synthetic workloads (random, shared prefixes) and the request type.

Prompts are token ids, so a server without a tokenizer can be benchmarked;
only a dataset file may hold text prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.bench.request import BenchRequest

# Ids 0..16 are special tokens in the models pdserve serves (SmolLM2: <|endoftext|>,
# <|im_start|>, ...); random prompts stay clear of them (benchmarks/ use this constant too).
LOWEST_ORDINARY_TOKEN_ID = 17
WORKLOAD_KINDS = ("random", "prefix", "mixed", "file")
PREFIX_ORDERS = ("round-robin", "random")
# Warm-up requests for text prompts, whose token count the client does not know.
WARMUP_TEXT_PROMPT_LEN = 16
WARMUP_STREAM = 1  # warm-up ids come from their own stream of the seed


@dataclass(frozen=True)
class WorkloadConfig:
    """Which workload to build and its sizes; every draw comes from ``seed``."""

    kind: str = "random"
    num_prompts: int = 100
    input_len: int = 128  # random: the prompt; prefix: the suffix after the shared prefix
    output_len: int = 64
    range_ratio: float = 0.0
    num_prefixes: int = 4
    prefix_len: int = 128
    prefix_order: str = "round-robin"
    dataset: Path | None = None
    seed: int = 0
    long_len: int = 1024  # mixed: tokens of a long document
    mix: tuple[float, float, float] = (0.6, 0.2, 0.2)  # mixed: shares of chat turns, long documents, shared prefixes

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"unknown workload {self.kind!r}; choose one of {', '.join(WORKLOAD_KINDS)}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"--input-len and --output-len must be >= 1, got {self.input_len} and {self.output_len}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.kind == "prefix" and (self.num_prefixes < 1 or self.prefix_len < 1):
            raise ValueError(
                f"--num-prefixes and --prefix-len must be >= 1, got {self.num_prefixes} and {self.prefix_len}"
            )
        if self.prefix_order not in PREFIX_ORDERS:
            raise ValueError(f"unknown prefix order {self.prefix_order!r}; choose one of {', '.join(PREFIX_ORDERS)}")
        if self.kind == "mixed" and (self.long_len < 1 or self.num_prefixes < 1 or self.prefix_len < 1):
            raise ValueError(f"--long-len, --num-prefixes and --prefix-len must be >= 1, got {self.long_len}, "
                             f"{self.num_prefixes} and {self.prefix_len}")
        if len(self.mix) != 3 or any(not math.isfinite(w) or w < 0 for w in self.mix) or not sum(self.mix) > 0:
            raise ValueError(f"--mix must be three non-negative weights (chat, long, prefix) with a positive sum, "
                             f"got {','.join(str(w) for w in self.mix)}")
        if self.kind == "file" and self.dataset is None:
            raise ValueError("the file workload needs --dataset PATH.jsonl")


def length_bounds(mean: int, range_ratio: float) -> tuple[int, int]:
    """The integers in ``[mean * (1 - r), mean * (1 + r)]``, at least 1, as (low, high) inclusive."""
    low = max(1, math.ceil(mean * (1 - range_ratio)))
    return low, max(low, math.floor(mean * (1 + range_ratio)))


def build_workload(config: WorkloadConfig, vocab_size: int) -> tuple[BenchRequest, ...]:
    if config.kind == "random":
        return random_workload(config, vocab_size)
    if config.kind == "prefix":
        return prefix_workload(config, vocab_size)
    if config.kind == "mixed":
        return mixed_workload(config, vocab_size)
    from pdserve.bench.dataset import load_dataset

    assert config.dataset is not None  # checked by WorkloadConfig
    return load_dataset(config.dataset, config.num_prompts, default_output_len=config.output_len)


def random_workload(config: WorkloadConfig, vocab_size: int) -> tuple[BenchRequest, ...]:
    """Prompts of random ids, input and output lengths uniform within ``range_ratio`` of their means."""
    _check_vocab(vocab_size)
    rng = np.random.default_rng(config.seed)
    input_lens = _draw_lengths(rng, config.input_len, config.range_ratio, config.num_prompts)
    output_lens = _draw_lengths(rng, config.output_len, config.range_ratio, config.num_prompts)
    return tuple(
        BenchRequest(prompt_token_ids=_random_ids(rng, n, vocab_size), prompt=None, output_len=out)
        for n, out in zip(input_lens, output_lens)
    )


def prefix_workload(config: WorkloadConfig, vocab_size: int) -> tuple[BenchRequest, ...]:
    """``num_prefixes`` shared prefixes of ``prefix_len`` ids, each request one of them plus its own suffix.

    Models a shared system prompt or a multi-turn conversation: a server with a
    prefix cache should serve the prefix from it after the first request. The
    suffixes are pairwise distinct, so no two requests share more than the prefix
    by construction (beyond that only by chance, token by token).
    """
    _check_vocab(vocab_size)
    rng = np.random.default_rng(config.seed)
    prefixes = [_random_ids(rng, config.prefix_len, vocab_size) for _ in range(config.num_prefixes)]
    if config.prefix_order == "round-robin":
        choices = [i % config.num_prefixes for i in range(config.num_prompts)]
    else:
        choices = [int(c) for c in rng.integers(0, config.num_prefixes, size=config.num_prompts)]
    suffix_lens = _draw_lengths(rng, config.input_len, config.range_ratio, config.num_prompts)
    output_lens = _draw_lengths(rng, config.output_len, config.range_ratio, config.num_prompts)
    seen: set[tuple[int, ...]] = set()
    requests = []
    for choice, suffix_len, output_len in zip(choices, suffix_lens, output_lens):
        suffix = _random_ids(rng, suffix_len, vocab_size)
        while suffix in seen:  # redraw from the same stream: still reproducible
            suffix = _random_ids(rng, suffix_len, vocab_size)
        seen.add(suffix)
        requests.append(BenchRequest(prompt_token_ids=prefixes[choice] + suffix, prompt=None, output_len=output_len))
    return tuple(requests)


MIXED_KINDS = ("chat", "long", "prefix")


def mixed_workload(config: WorkloadConfig, vocab_size: int) -> tuple[BenchRequest, ...]:
    """A serving mix: short chat turns, long documents and questions on shared prefixes, in a random order.

    Each request is a chat turn (``input_len`` tokens), a long document
    (``long_len``) or one of ``num_prefixes`` prefixes of ``prefix_len`` tokens
    plus an ``input_len`` suffix, drawn with the weights of ``mix``; lengths
    vary within ``range_ratio`` and every prompt but the shared prefixes is fresh.
    """
    _check_vocab(vocab_size)
    rng = np.random.default_rng(config.seed)
    weights = np.array(config.mix, dtype=float) / sum(config.mix)
    kinds = [MIXED_KINDS[int(k)] for k in rng.choice(len(MIXED_KINDS), size=config.num_prompts, p=weights)]
    prefixes = [_random_ids(rng, config.prefix_len, vocab_size) for _ in range(config.num_prefixes)]
    output_lens = _draw_lengths(rng, config.output_len, config.range_ratio, config.num_prompts)
    requests = []
    for kind, output_len in zip(kinds, output_lens):
        if kind == "long":
            [length] = _draw_lengths(rng, config.long_len, config.range_ratio, 1)
            prompt = _random_ids(rng, length, vocab_size)
        else:
            [length] = _draw_lengths(rng, config.input_len, config.range_ratio, 1)
            prefix = prefixes[int(rng.integers(0, config.num_prefixes))] if kind == "prefix" else ()
            prompt = prefix + _random_ids(rng, length, vocab_size)
        requests.append(BenchRequest(prompt_token_ids=prompt, prompt=None, output_len=output_len))
    return tuple(requests)


def warmup_requests(
    requests: tuple[BenchRequest, ...], count: int, vocab_size: int, seed: int
) -> tuple[BenchRequest, ...]:
    """``count`` requests shaped like the workload's first ones, with fresh random ids.

    Fresh ids (from a stream separate from the workload's) warm the server
    without filling its prefix cache with the prompts about to be measured.
    """
    _check_vocab(vocab_size)
    rng = np.random.default_rng([seed, WARMUP_STREAM])
    warmups = []
    for i in range(count):
        model = requests[i % len(requests)]
        length = model.prompt_len or WARMUP_TEXT_PROMPT_LEN
        warmups.append(BenchRequest(prompt_token_ids=_random_ids(rng, length, vocab_size), prompt=None,
                                    output_len=model.output_len))
    return tuple(warmups)


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= LOWEST_ORDINARY_TOKEN_ID:
        raise ValueError(f"random prompts need a vocabulary above {LOWEST_ORDINARY_TOKEN_ID} ids, got {vocab_size}")


def _draw_lengths(rng: np.random.Generator, mean: int, range_ratio: float, count: int) -> list[int]:
    low, high = length_bounds(mean, range_ratio)
    return [int(n) for n in rng.integers(low, high + 1, size=count)]


def _random_ids(rng: np.random.Generator, length: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(LOWEST_ORDINARY_TOKEN_ID, vocab_size, size=length))
