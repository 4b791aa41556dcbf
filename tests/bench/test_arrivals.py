"""Arrival times: seeded gamma gaps of mean 1/rate, burstiness as the shape, inf sending all at once."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets, inter_arrival_gaps

SAMPLES = 20_000


def test_the_same_seed_gives_the_same_gaps_and_another_seed_other_gaps() -> None:
    first = inter_arrival_gaps(100, request_rate=5.0, burstiness=1.0, seed=3)
    assert first == inter_arrival_gaps(100, request_rate=5.0, burstiness=1.0, seed=3)
    assert first != inter_arrival_gaps(100, request_rate=5.0, burstiness=1.0, seed=4)


@pytest.mark.parametrize("burstiness", [1.0, 0.5])
def test_mean_gap_is_one_over_the_rate_and_burstiness_sets_the_spread(burstiness: float) -> None:
    gaps = np.array(inter_arrival_gaps(SAMPLES, request_rate=20.0, burstiness=burstiness, seed=0))
    # Standard error of the mean is sqrt(1 / shape) / (rate * sqrt(n)): 0.7% (shape 1), 1% (shape 0.5); allow 3%.
    assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.03)
    # A gamma of shape k has coefficient of variation 1 / sqrt(k): 1 for Poisson, sqrt(2) for burstiness 0.5.
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)
    assert (gaps >= 0).all()


def test_an_infinite_rate_sends_everything_at_once() -> None:
    assert inter_arrival_gaps(5, request_rate=math.inf, burstiness=0.5, seed=1) == (0.0,) * 5
    assert arrival_offsets(4, request_rate=math.inf, burstiness=1.0, seed=1) == (0.0,) * 4


def test_offsets_start_at_zero_and_accumulate_the_gaps() -> None:
    gaps = inter_arrival_gaps(3, request_rate=2.0, burstiness=1.0, seed=7)
    offsets = arrival_offsets(4, request_rate=2.0, burstiness=1.0, seed=7)
    assert offsets == pytest.approx((0.0, gaps[0], gaps[0] + gaps[1], gaps[0] + gaps[1] + gaps[2]), rel=1e-12)
    assert arrival_offsets(0, request_rate=2.0, burstiness=1.0, seed=7) == ()


@pytest.mark.parametrize(("rate", "burstiness", "message"), [
    (0.0, 1.0, "request rate must be positive"),
    (-1.0, 1.0, "request rate must be positive"),
    (1.0, 0.0, "burstiness must be a positive finite"),
    (1.0, math.inf, "burstiness must be a positive finite"),
])
def test_bad_rates_and_shapes_are_refused(rate: float, burstiness: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        inter_arrival_gaps(3, request_rate=rate, burstiness=burstiness, seed=0)
