"""``benchmarks.disaggregation_sweep``: the verdict per rate and the table, on hand-made bench metrics."""

from __future__ import annotations

from benchmarks.disaggregation_sweep import _row, _table, verdict


def _metrics(goodput: float, good: int, ttft_p50: float, tpot_p99: float) -> dict:
    latency = {"median_ms": 0.0, "p99_ms": 0.0}
    return {
        "goodput": goodput, "good_requests": good, "completed": 23, "failed": 1, "output_throughput": 17.04,
        "ttft": {"median_ms": ttft_p50, "p99_ms": 2024.0}, "tpot": {"median_ms": 25.0, "p99_ms": tpot_p99},
        "itl": latency,
    }


def test_the_verdict_and_the_table_show_a_goodput_lost_to_the_last_requests_end_alone() -> None:
    rows = {
        "colocated": _row(0.5, "colocated", _metrics(0.5411, 24, 141.0, 54.4), None),
        "disaggregated": _row(0.5, "disaggregated", _metrics(0.5395, 24, 239.0, 33.4), None),
        "auto": _row(0.5, "auto", _metrics(0.5392, 24, 126.0, 31.4), {"local/cheaper": 5.0, "remote/decode_stall": 7.0}),
    }
    # Every request of every layout within the SLOs, yet the strict comparison of rates fails: the table says why.
    assert verdict(rows) == {"goodput": False, "ttft_p50": True, "tpot_p99": True}
    table = _table(list(rows.values())).splitlines()
    assert table[0].startswith("| rate (req/s) | layout | goodput (req/s) | within the SLOs | out tok/s |")
    assert table[2] == "| 0.5 | colocated | 0.5411 | 24/24 | 17.0 | 141 | 2,024 | 25 | 54 |  |"
    assert table[4] == "| 0.5 | auto | 0.5392 | 24/24 | 17.0 | 126 | 2,024 | 25 | 31 | local/cheaper 5, remote/decode_stall 7 |"


def test_the_verdict_bounds_are_ten_percent() -> None:
    rows = {
        "colocated": _row(1, "colocated", _metrics(0.10, 2, 1000.0, 400.0), None),
        "disaggregated": _row(1, "disaggregated", _metrics(0.70, 17, 4000.0, 50.0), None),
        "auto": _row(1, "auto", _metrics(0.70, 17, 1100.0, 55.0), None),
    }
    assert verdict(rows) == {"goodput": True, "ttft_p50": True, "tpot_p99": True}
    rows["auto"] = _row(1, "auto", _metrics(0.69, 16, 1101.0, 55.1), None)
    assert verdict(rows) == {"goodput": False, "ttft_p50": False, "tpot_p99": False}
