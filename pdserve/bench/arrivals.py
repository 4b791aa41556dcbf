"""When requests are sent: seeded gamma-distributed gaps between arrivals (vLLM's model).

A gap is drawn from Gamma(shape=burstiness, scale=1 / (rate * burstiness)),
whose mean is 1 / rate whatever the shape: burstiness 1 is a Poisson process,
below 1 arrivals come in bursts (more variance), above 1 they are more even.
"""

from __future__ import annotations

import math

import numpy as np

# Arrivals draw from their own stream of --seed, so the gaps do not echo the
# workload's lengths and ids, which are drawn from the plain seed.
ARRIVAL_STREAM = 2


def inter_arrival_gaps(count: int, request_rate: float, burstiness: float, seed: int) -> tuple[float, ...]:
    """``count`` gaps in seconds; all zero for an infinite rate (every request at once)."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if not request_rate > 0:
        raise ValueError(f"the request rate must be positive (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")
    if math.isinf(request_rate):
        return (0.0,) * count
    rng = np.random.default_rng([seed, ARRIVAL_STREAM])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=count)
    return tuple(float(gap) for gap in gaps)


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, seed: int) -> tuple[float, ...]:
    """Each request's send time in seconds after the run starts; the first is sent at once."""
    if num_requests == 0:
        return ()
    gaps = inter_arrival_gaps(num_requests - 1, request_rate, burstiness, seed)
    return (0.0, *(float(offset) for offset in np.cumsum(gaps)))
