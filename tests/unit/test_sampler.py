"""The sampler: greedy and sampled rows, seeding, filtered distributions, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from pdserve.engine.sampler import Sampler, SamplerOutput, first_argmax
from pdserve.engine.types.sampling_params import SamplingParams

# Distinct values in no particular order, so that sorting and scattering back
# to vocabulary order are both exercised.
TINY_LOGITS = [1.2, -0.4, 2.0, 0.3, 1.6, -1.5, 0.9, -0.8]
NUM_DRAWS = 20_000


def seeded(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def expected_filtered_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution the sampler should draw from, computed independently in float64."""
    scaled = np.asarray(logits, dtype=np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")  # most likely first
    if top_k != -1:
        order = order[:top_k]
    probs = np.exp(scaled[order] - scaled[order].max())
    probs /= probs.sum()
    # Nucleus: the smallest prefix whose mass reaches top_p.
    kept = 0
    mass = 0.0
    while kept < len(order):
        mass += probs[kept]
        kept += 1
        if mass >= top_p:
            break
    result = np.zeros(len(logits))
    result[order[:kept]] = probs[:kept] / probs[:kept].sum()
    return result


def draw(sampler: Sampler, logits: list[float], params: SamplingParams, per_row_generators: bool) -> np.ndarray:
    """Counts of each token over NUM_DRAWS rows that share the same logits, in one call."""
    batch = torch.tensor(logits, dtype=torch.float32).expand(NUM_DRAWS, len(logits)).contiguous()
    generators = [seeded(1000 + i) for i in range(NUM_DRAWS)] if per_row_generators else [None] * NUM_DRAWS
    out = sampler(batch, [params] * NUM_DRAWS, generators)
    return np.bincount(out.token_ids.numpy(), minlength=len(logits))


def test_greedy_rows_take_argmax_with_ties_to_lowest_id_and_leave_generator_untouched() -> None:
    logits = torch.tensor(
        [
            [0.1, 3.0, -1.0, 2.0],
            [5.0, 5.0, 1.0, 5.0],  # three-way tie: lowest id wins
            [-2.0, -3.0, -1.0, -4.0],
        ]
    )
    generator = seeded(3)
    state_before = generator.get_state().clone()
    greedy = SamplingParams(temperature=0.0)

    out = Sampler(seed=0)(logits, [greedy] * 3, [generator, None, None])

    assert out.token_ids.tolist() == [1, 0, 2]
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(generator.get_state(), state_before)
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None


def test_mixed_batch_samples_only_non_greedy_rows() -> None:
    logits = torch.tensor(
        [
            [0.0, 1.0, 4.0, 2.0, 3.0],
            [0.0, 1.0, 4.0, 2.0, 3.0],
            [9.0, 1.0, 0.0, 2.0, 3.0],
            [0.0, 1.0, 4.0, 2.0, 3.0],
        ]
    )
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),  # sampled, but only one token survives
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=5.0, top_k=2),
    ]
    sampler = Sampler(seed=0)
    seen_in_last_row: set[int] = set()
    for step in range(200):
        out = sampler(logits, params, [None, seeded(step), None, None])
        assert out.token_ids[:3].tolist() == [2, 2, 0]
        seen_in_last_row.add(int(out.token_ids[3]))
    # top_k=2 keeps ids 2 and 4; with a high temperature both come up.
    assert seen_in_last_row == {2, 4}


def test_same_seed_generators_give_identical_tokens_across_samplers() -> None:
    vocab_size = 50
    step_logits = torch.randn(60, 3, vocab_size, generator=seeded(0))
    params = [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.8, top_k=10, top_p=0.9, seed=12),
        SamplingParams(temperature=1.5, top_p=0.5, seed=13),
    ]

    def run(sampler: Sampler) -> list[list[int]]:
        generators = [seeded(p.seed) for p in params]
        return [sampler(logits, params, generators).token_ids.tolist() for logits in step_logits]

    # The samplers' own seeds differ: seeded rows must not touch them.
    first, second = run(Sampler(seed=1)), run(Sampler(seed=2))

    assert first == second
    assert len({tuple(row) for row in first}) > 1  # actually random, not stuck


@pytest.mark.parametrize(
    "seeded_params",
    [
        SamplingParams(temperature=0.9, seed=7),  # no filter: alone it skips the sort path
        SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=7),
    ],
)
def test_seeded_row_tokens_do_not_depend_on_the_rest_of_the_batch(seeded_params: SamplingParams) -> None:
    vocab_size = 257  # not a multiple of any vector width
    num_steps = 50
    own_logits = torch.randn(num_steps, vocab_size, generator=seeded(21))
    other_logits = torch.randn(num_steps, 4, vocab_size, generator=seeded(22))
    other_params = [
        SamplingParams(temperature=1.0),  # unseeded, draws from the sampler's generator
        SamplingParams(temperature=0.0),  # greedy
        SamplingParams(temperature=1.2, top_k=5, top_p=0.5, seed=99),
        SamplingParams(temperature=0.5, top_p=0.3),  # unseeded, forces the sort path
    ]

    alone_generator = seeded(7)
    alone_sampler = Sampler(seed=0)
    alone = [
        int(alone_sampler(own_logits[step : step + 1], [seeded_params], [alone_generator]).token_ids[0])
        for step in range(num_steps)
    ]

    batched_generator = seeded(7)
    other_generator = seeded(99)
    batched_sampler = Sampler(seed=123)
    batched = []
    for step in range(num_steps):
        # Put the seeded row in the middle of the batch.
        logits = torch.cat([other_logits[step, :2], own_logits[step : step + 1], other_logits[step, 2:]])
        params = other_params[:2] + [seeded_params] + other_params[2:]
        generators = [None, None, batched_generator, other_generator, None]
        batched.append(int(batched_sampler(logits, params, generators).token_ids[2]))

    assert batched == alone
    assert len(set(alone)) > 10


@pytest.mark.parametrize("per_row_generators", [False, True], ids=["sampler-generator", "per-row-generators"])
@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.7, -1, 1.0), (1.0, 3, 1.0), (1.0, -1, 0.6), (1.3, 5, 0.9), (1.5, 5, 0.8)],
    ids=["temperature", "top-k", "top-p", "all-three", "top-p-after-temperature"],
)
def test_draws_follow_the_filtered_softmax(
    temperature: float, top_k: int, top_p: float, per_row_generators: bool
) -> None:
    expected = expected_filtered_probs(TINY_LOGITS, temperature, top_k, top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)

    counts = draw(Sampler(seed=5), TINY_LOGITS, params, per_row_generators)

    kept = expected > 0
    assert counts.sum() == NUM_DRAWS
    assert counts[~kept].tolist() == [0] * int((~kept).sum())
    result = stats.chisquare(counts[kept], expected[kept] * NUM_DRAWS)
    assert result.pvalue > 1e-3, (counts.tolist(), (expected * NUM_DRAWS).round(1).tolist())


def test_expected_filter_sets_are_the_intended_ones() -> None:
    # Guards the distribution test against logits that would make it vacuous.
    def kept_ids(temperature: float, top_k: int, top_p: float) -> list[int]:
        return np.flatnonzero(expected_filtered_probs(TINY_LOGITS, temperature, top_k, top_p)).tolist()

    assert kept_ids(0.7, -1, 1.0) == list(range(8))
    assert kept_ids(1.0, 3, 1.0) == [0, 2, 4]
    assert kept_ids(1.0, -1, 0.6) == [0, 2, 4]  # mass 0.593 after two tokens, so the third is kept
    assert kept_ids(1.3, 5, 0.9) == [0, 2, 4, 6]  # mass 0.909 after four
    # Top-p sees the tempered distribution: at temperature 1 it would keep only three.
    assert kept_ids(1.5, 5, 0.8) == [0, 2, 4, 6]
    assert kept_ids(1.0, 5, 0.8) == [0, 2, 4]


def test_top_p_keeps_the_token_that_crosses_the_threshold() -> None:
    logits = [math.log(0.5), math.log(0.3), math.log(0.2)]
    sampler = Sampler(seed=8)

    def drawn(top_p: float) -> list[int]:
        counts = draw(sampler, logits, SamplingParams(temperature=1.0, top_p=top_p), per_row_generators=False)
        return np.flatnonzero(counts).tolist()

    assert drawn(0.45) == [0]  # 0.5 alone reaches 0.45
    assert drawn(0.55) == [0, 1]  # 0.5 falls short; 0.3 crosses and stays
    assert drawn(0.85) == [0, 1, 2]


def test_top_p_one_keeps_every_token() -> None:
    logits = [math.log(0.495), math.log(0.495), math.log(0.01)]
    sampler = Sampler(seed=9)

    def drawn(top_p: float) -> list[int]:
        counts = draw(sampler, logits, SamplingParams(temperature=1.0, top_p=top_p), per_row_generators=False)
        return np.flatnonzero(counts).tolist()

    assert drawn(0.98) == [0, 1]
    assert drawn(1.0) == [0, 1, 2]


def test_logprobs_are_raw_log_softmax_of_sampled_and_top_tokens() -> None:
    logits = torch.randn(4, 30, generator=seeded(4)) * 3.0
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.5, top_k=3, logprobs=5),
        SamplingParams(temperature=1.0),  # asks for nothing, still gets the batch's tensors
        SamplingParams(temperature=2.0, top_p=0.5, logprobs=0),
    ]

    out = Sampler(seed=0)(logits, params, [None, seeded(1), None, None])

    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_token_ids is not None and out.top_logprobs is not None
    assert out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert out.top_token_ids.shape == (4, 5) and out.top_token_ids.dtype == torch.int64
    expected_ids = torch.argsort(raw, dim=-1, descending=True)[:, :5]
    assert torch.equal(out.top_token_ids, expected_ids)
    assert torch.equal(out.top_logprobs, raw.gather(1, expected_ids))


def test_logprobs_zero_returns_only_the_sampled_logprob() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])

    out = Sampler(seed=0)(logits, [SamplingParams(temperature=0.0, logprobs=0)], [None])

    assert out.token_ids.tolist() == [1]
    assert out.logprobs is not None
    assert torch.equal(out.logprobs, torch.log_softmax(logits, dim=-1)[:, 1])
    assert out.top_token_ids is None and out.top_logprobs is None


def test_logprobs_are_none_when_no_row_asks() -> None:
    logits = torch.randn(3, 10, generator=seeded(6))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(top_k=2)]

    out = Sampler(seed=0)(logits, params, [None, None, seeded(2)])

    assert out == SamplerOutput(token_ids=out.token_ids, logprobs=None, top_token_ids=None, top_logprobs=None)


def test_bfloat16_logits_are_upcast_before_sampling_and_logprobs() -> None:
    logits = (torch.randn(2, 16, generator=seeded(5)) * 4.0).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0, logprobs=1)]

    out = Sampler(seed=0)(logits, params, [None, None])

    upcast = logits.float()
    assert out.token_ids.tolist() == upcast.argmax(dim=-1).tolist()
    assert out.logprobs is not None and out.top_logprobs is not None
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.dtype == torch.float32
    assert torch.equal(out.top_logprobs, torch.log_softmax(upcast, dim=-1).topk(3, dim=-1).values)


def test_plain_greedy_bfloat16_batch_picks_the_float32_argmax_ties_to_lowest_id() -> None:
    # Coarse values: bfloat16 keeps many exact ties, across the whole 49,152-token vocabulary.
    logits = (torch.randn(6, 49152, generator=seeded(7)) * 2).round().to(torch.bfloat16)
    logits[1, [5, 9, 40000]] = 100.0  # a three-way tie at the top
    logits[2, 49151] = 100.0  # the last id
    greedy = SamplingParams(temperature=0.0)

    out = Sampler(seed=0)(logits, [greedy] * 6, [None] * 6)

    assert out.token_ids.tolist() == logits.float().argmax(dim=-1).tolist()
    assert out.token_ids[1] == 5 and out.token_ids[2] == 49151
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None


def test_mismatched_params_or_generators_are_rejected() -> None:
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="one SamplingParams and one generator per row"):
        Sampler()(logits, [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match="one SamplingParams and one generator per row"):
        Sampler()(logits, [SamplingParams()] * 2, [None])


def test_temperatures_too_small_for_float32_sample_greedily() -> None:
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0]])
    for temperature in (1e-6, 1e-39):
        params = SamplingParams(temperature=temperature, seed=1)
        assert params.is_greedy
        out = Sampler(seed=0)(logits, [params], [torch.Generator().manual_seed(1)])
        assert out.token_ids.tolist() == [1]


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token() -> None:
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0]])
    params = SamplingParams(temperature=1.0, top_p=1e-46)
    draws = [Sampler(seed=s)(logits, [params], [None]).token_ids.item() for s in range(20)]
    assert draws == [1] * 20


def test_first_argmax_finds_the_first_maximum_as_torch_argmax_does() -> None:
    width = 16 * 256 + 100  # past the chunked path's minimum, with a short last chunk
    x = torch.zeros(6, width)
    x[0, 5], x[0, 3000] = 2.0, 2.0  # a tie across chunks: the first wins
    x[1, width - 1] = 1.0  # in the short last chunk, its last column
    x[2, 300], x[2, 4000] = float("nan"), float("nan")  # the first NaN, as torch ranks it
    x[2, 10] = 9.0
    x[3] = float("-inf")  # nothing above -inf: column 0
    x[4, 4095], x[4, 4096] = 3.0, 3.0  # across the boundary of the full chunks and the short one
    x[5] = torch.arange(width, dtype=torch.float32).flip(0)  # descending: column 0
    assert first_argmax(x).tolist() == [5, width - 1, 300, 0, 4095, 0]
    assert first_argmax(x).tolist() == x.argmax(dim=-1).tolist()
    generator = torch.Generator().manual_seed(0)
    for columns in (4096, 4097, 49152, 151936):
        y = torch.randint(-4, 4, (9, columns), generator=generator).float()  # many ties
        assert torch.equal(first_argmax(y), y.argmax(dim=-1)), columns
