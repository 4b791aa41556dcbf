"""min_tokens, logit_bias and the penalties: hand-computed logits and tokens, alone, combined and batched."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.logits_processors import TokenHistory, adjust_logits_
from pdserve.engine.sampler import Sampler
from pdserve.engine.types.sampling_params import SamplingParams

INF = float("inf")
# Values that are exact in float32, so every expected number below is exact too.
ROW = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
EOS = {3}


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, **kwargs)


def history(prompt: list[int], output: list[int]) -> TokenHistory:
    return TokenHistory(prompt + output, len(prompt))


def adjusted(params: SamplingParams, prompt: list[int], output: list[int], row: list[float] = ROW) -> list[float]:
    logits = torch.tensor([row])
    adjust_logits_(logits, [params], [history(prompt, output)], EOS)
    return logits[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output() -> None:
    # Token 0 (2.0) and 1 (-1.0) are in the prompt, 4 (-2.0) in the output; 2, 3, 5 are untouched.
    assert adjusted(greedy(repetition_penalty=2.0), prompt=[0, 1], output=[4]) == [1.0, -2.0, 0.5, 3.0, -4.0, 1.0]
    # A penalty below 1 rewards repetition the same way round.
    assert adjusted(greedy(repetition_penalty=0.5), prompt=[0, 1], output=[4, 4]) == [4.0, -0.5, 0.5, 3.0, -1.0, 1.0]


def test_frequency_and_presence_penalties_count_the_output_only() -> None:
    # Output: token 2 twice, token 5 once. Token 0 is only in the prompt: untouched.
    params = greedy(frequency_penalty=0.5, presence_penalty=0.25)
    assert adjusted(params, prompt=[0], output=[2, 5, 2]) == [
        2.0,
        -1.0,
        0.5 - 2 * 0.5 - 0.25,
        3.0,
        -2.0,
        1.0 - 0.5 - 0.25,
    ]
    # Negative values reward what was generated.
    assert adjusted(greedy(presence_penalty=-1.0), prompt=[0], output=[4, 4]) == [2.0, -1.0, 0.5, 3.0, -1.0, 1.0]
    # Nothing generated yet: nothing to penalise.
    assert adjusted(params, prompt=[0, 2], output=[]) == ROW


def test_logit_bias_is_added_to_its_tokens() -> None:
    assert adjusted(greedy(logit_bias={1: 5.0, 3: -100.0}), prompt=[0], output=[]) == [
        2.0, 4.0, 0.5, -97.0, -2.0, 1.0
    ]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached() -> None:
    params = greedy(min_tokens=2, stop_token_ids=[5])
    masked = [2.0, -1.0, 0.5, -INF, -2.0, -INF]  # EOS 3 and stop id 5
    assert adjusted(params, prompt=[0], output=[]) == masked
    assert adjusted(params, prompt=[0], output=[4]) == masked
    assert adjusted(params, prompt=[0], output=[4, 1]) == ROW
    # ignore_eos: EOS is an ordinary token, the stop ids are still masked.
    ignoring = greedy(min_tokens=1, stop_token_ids=[5], ignore_eos=True)
    assert adjusted(ignoring, prompt=[0], output=[]) == [2.0, -1.0, 0.5, 3.0, -2.0, -INF]
    # A stop id past the vocabulary cannot be sampled: nothing to mask, and no error.
    assert adjusted(greedy(min_tokens=1, stop_token_ids=[900], ignore_eos=True), prompt=[0], output=[]) == ROW


def test_bias_comes_before_the_penalties_as_in_vllm_and_transformers() -> None:
    # Token 0 is in the prompt: (2 + 2) / 2 = 2, not 2 / 2 + 2 = 3; token 5 in the output: (1 + 1) / 2 - 1.
    params = greedy(logit_bias={0: 2.0, 5: 1.0}, repetition_penalty=2.0, frequency_penalty=1.0)
    assert adjusted(params, prompt=[0], output=[5]) == [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]
    # Masked tokens stay masked through every later adjustment.
    params = greedy(min_tokens=1, logit_bias={3: 50.0}, repetition_penalty=3.0, presence_penalty=-2.0)
    assert adjusted(params, prompt=[3], output=[]) == [2.0, -1.0, 0.5, -INF, -2.0, 1.0]


def test_only_asking_rows_change() -> None:
    logits = torch.tensor([ROW, ROW, ROW])
    params = [greedy(), greedy(repetition_penalty=2.0), greedy(logit_bias={2: 1.0})]
    histories = [None, history([0], []), history([0], [])]
    adjust_logits_(logits, params, histories, EOS)
    assert logits.tolist() == [ROW, [1.0, -1.0, 0.5, 3.0, -2.0, 1.0], [2.0, -1.0, 1.5, 3.0, -2.0, 1.0]]
    # No row asks: nothing is read or written, and no history is needed.
    plain = torch.tensor([ROW, ROW])
    adjust_logits_(plain, [greedy(), SamplingParams(temperature=0.7)], None, EOS)
    assert plain.tolist() == [ROW, ROW]


def test_a_row_that_adjusts_without_its_history_is_rejected() -> None:
    with pytest.raises(ValueError, match="row 1 adjusts its logits and needs its token history"):
        adjust_logits_(torch.tensor([ROW, ROW]), [greedy(), greedy(min_tokens=1)], None, EOS)


def test_greedy_rows_take_the_argmax_of_the_adjusted_logits_and_logprobs_stay_raw() -> None:
    logits = torch.tensor([ROW, ROW, ROW, ROW])
    params = [
        greedy(logprobs=1),  # argmax 3
        greedy(repetition_penalty=4.0, logprobs=1),  # 3 in the prompt: 0.75 < 2.0, so token 0
        greedy(min_tokens=1, logprobs=1),  # EOS 3 masked: token 0
        greedy(logit_bias={4: 6.0}, logprobs=1),  # -2 + 6 = 4: token 4
    ]
    histories = [history([1], []), history([3], []), history([1], []), history([1], [])]
    out = Sampler(seed=0, eos_token_ids=EOS)(logits, params, [None] * 4, histories)
    assert out.token_ids.tolist() == [3, 0, 0, 4]
    raw = torch.log_softmax(torch.tensor(ROW), dim=-1)
    assert out.logprobs is not None and out.top_token_ids is not None
    assert out.logprobs.tolist() == [raw[3].item(), raw[0].item(), raw[0].item(), raw[4].item()]
    assert out.top_token_ids[:, 0].tolist() == [3, 3, 3, 3]  # the raw distribution's top token


def test_sampled_rows_draw_from_the_adjusted_distribution() -> None:
    # Every token but 1 biased by -100: exp(-100) relative mass never wins a draw in float32.
    others = {t: -100.0 for t in range(len(ROW)) if t != 1}
    params = SamplingParams(temperature=1.0, logit_bias=others)
    num_rows = 200
    logits = torch.tensor([ROW] * num_rows)
    out = Sampler(seed=4, eos_token_ids=EOS)(logits, [params] * num_rows, [None] * num_rows, [history([0], [])] * num_rows)
    assert out.token_ids.tolist() == [1] * num_rows


def test_seeded_rows_draw_the_same_noise_with_or_without_adjustments() -> None:
    # An adjustment changes the distribution, never the random stream: with a bias of 0.0 on
    # a row (which counts as asking) the tokens equal those of the unadjusted row.
    logits = torch.tensor([ROW] * 3)
    plain = SamplingParams(temperature=1.0, seed=11)
    zero_bias = SamplingParams(temperature=1.0, seed=11, logit_bias={2: 0.0})
    assert zero_bias.adjusts_logits
    runs = []
    for params in (plain, zero_bias):
        generators = [torch.Generator().manual_seed(11 + i) for i in range(3)]
        out = Sampler(seed=0)(logits, [params] * 3, generators, [history([0], [])] * 3)
        runs.append(out.token_ids.tolist())
    assert runs[0] == runs[1]


def test_params_freeze_logit_bias_into_sorted_pairs_and_stay_hashable() -> None:
    params = SamplingParams(logit_bias={9: -1.5, 2: 3.0})
    assert params.logit_bias == ((2, 3.0), (9, -1.5))
    assert params == SamplingParams(logit_bias=[(9, -1.5), (2, 3.0)])
    assert hash(params) == hash(SamplingParams(logit_bias=((2, 3.0), (9, -1.5))))
    assert not SamplingParams().adjusts_logits
    assert not SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, min_tokens=0).adjusts_logits
    for kwargs in ({"min_tokens": 1}, {"logit_bias": {0: 1.0}}, {"repetition_penalty": 1.1},
                   {"presence_penalty": 0.1}, {"frequency_penalty": -0.1}):
        assert SamplingParams(**kwargs).adjusts_logits, kwargs
