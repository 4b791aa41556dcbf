"""A short soak: rounds of mixed load with cancels and deadlines against real processes; nothing lost, leaked or growing.

The long form is ``python -m benchmarks.soak``; both drive the load with the same functions.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.soak import LoadShape, cluster_rss_kib, drive, leaked_blocks, make_request, wait_idle
from tests.conftest import VOCAB_SIZE
from tests.e2e.conftest import cluster_config

NUM_ROUNDS = 3  # the first warms allocators; the third's memory is compared with the second's
REQUESTS_PER_ROUND = 60
CLIENTS = 6
SHAPE = LoadShape(
    vocab_size=VOCAB_SIZE, max_prompt_len=200, max_max_tokens=48, cancel_fraction=0.3, deadline_fraction=0.15,
    deadline_s=(0.005, 0.15),  # short enough to end some requests in prefill, the handoff or decode
    lowest_token_id=8,  # clear of the tiny model's EOS (7)
)
MAX_RSS_GROWTH = 0.10


@pytest.mark.asyncio
async def test_mixed_load_with_cancels_and_deadlines_loses_nothing_leaks_no_blocks_and_memory_plateaus(
    llama_checkpoint: Path, start_cluster
) -> None:
    cluster = start_cluster(cluster_config(llama_checkpoint))
    rss_after_round = []
    for round_index in range(NUM_ROUNDS):
        rng = random.Random(200 + round_index)
        requests = [make_request(rng, SHAPE, index) for index in range(REQUESTS_PER_ROUND)]
        tally = await drive(cluster.endpoint, iter(requests), CLIENTS, hang_s=30.0)

        # Every request ended, the way its fault allows: faultless ones OK with every token.
        assert tally.lost == []
        assert tally.faults() == Counter(r.fault for r in requests)
        assert tally.codes("none") == {"OK": sum(r.fault == "none" for r in requests)}
        assert set(tally.codes("cancel")) <= {"OK", "CANCELLED"}
        assert set(tally.codes("deadline")) <= {"OK", "DEADLINE_EXCEEDED"}

        # Once the cluster settles, no worker runs, queues or holds a block.
        reports = await wait_idle(cluster, timeout_s=10.0)
        assert leaked_blocks(reports) == {"prefill-0": 0, "decode-0": 0}
        assert [(r.num_running, r.num_waiting) for r in reports.values()] == [(0, 0), (0, 0)]
        rss_after_round.append(cluster_rss_kib(cluster))
        print(f"round {round_index + 1}: {dict(tally.codes())} by fault "
              f"{ {f: dict(tally.codes(f)) for f in ('none', 'cancel', 'deadline')} }, RSS KiB {rss_after_round[-1]}")

    baseline, final = rss_after_round[1], rss_after_round[2]
    for name in ("prefill-0", "decode-0"):
        assert final[name] <= baseline[name] * (1 + MAX_RSS_GROWTH), f"{name} RSS grew: {rss_after_round}"
