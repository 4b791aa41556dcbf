"""``pdserve up`` puts OpenMP threads to sleep at once only where several engine processes share the cores."""

from __future__ import annotations

import pytest

from pdserve.launcher import ClusterConfig, LocalCluster, _tensor_parallel_sizes


@pytest.mark.parametrize(
    ("overrides", "shared"),
    [
        ({}, True),  # 1 prefill + 1 decode worker: the default cluster
        ({"prefill_workers": 0, "decode_workers": 1}, False),
        ({"colocated_workers": 1}, False),
        ({"colocated_workers": 2}, True),
        ({"colocated_workers": 1, "decode_args": ("--tensor-parallel-size", "2")}, True),
        ({"colocated_workers": 1, "engine_args": ("--num-kv-blocks", "64", "--tensor-parallel-size=2")}, True),
        ({"colocated_workers": 1, "decode_args": ("--tensor-parallel-size", "1")}, False),
        # A colocated cluster ignores the prefill/decode counts, so their defaults do not count.
        ({"colocated_workers": 1, "prefill_workers": 3}, False),
    ],
)
def test_engines_share_cores(overrides: dict[str, object], shared: bool) -> None:
    cluster = LocalCluster(ClusterConfig(**overrides))  # type: ignore[arg-type]
    try:
        assert cluster.engines_share_cores() is shared
    finally:
        cluster.stop()  # nothing started: removes its temporary directory


def test_tensor_parallel_sizes_read_both_spellings_and_skip_the_rest() -> None:
    assert _tensor_parallel_sizes(("--tensor-parallel-size", "4", "--num-kv-blocks", "8")) == [4]
    assert _tensor_parallel_sizes(("--tensor-parallel-size=2",)) == [2]
    assert _tensor_parallel_sizes(("--num-kv-blocks", "2", "--tensor-parallel-size")) == []  # no value: the CLI says so
    assert _tensor_parallel_sizes(()) == []
