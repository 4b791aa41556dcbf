"""``pdserve up`` puts OpenMP threads to sleep at once only where several engine processes share the cores and
some of them do not govern their own spin (``--openmp-spin``)."""

from __future__ import annotations

import pytest

from pdserve.launcher import ClusterConfig, LocalCluster, _option_values, _tensor_parallel_sizes


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


@pytest.mark.parametrize(
    ("overrides", "asleep"),
    [
        ({}, False),  # 1 prefill + 1 decode worker, each governing its spin (--openmp-spin adaptive)
        ({"engine_args": ("--openmp-spin", "libgomp")}, True),
        ({"prefill_args": ("--openmp-spin=libgomp",)}, True),
        ({"decode_args": ("--openmp-spin", "adaptive")}, False),
        ({"colocated_workers": 1, "engine_args": ("--openmp-spin", "libgomp")}, False),  # one engine alone
        ({"colocated_workers": 1, "decode_args": ("--tensor-parallel-size", "2")}, True),  # ranks have no governor
        ({"colocated_workers": 2}, False),
    ],
)
def test_engines_sleep_at_once_only_where_some_do_not_govern_their_spin(
    overrides: dict[str, object], asleep: bool
) -> None:
    cluster = LocalCluster(ClusterConfig(**overrides))  # type: ignore[arg-type]
    try:
        assert cluster.engines_sleep_at_once() is asleep
    finally:
        cluster.stop()


def test_option_values_read_both_spellings() -> None:
    args = ("--openmp-spin", "libgomp", "--num-kv-blocks", "8", "--openmp-spin=adaptive", "--openmp-spin")
    assert _option_values(args, "--openmp-spin") == ["libgomp", "adaptive"]
    assert _option_values(args, "--torch-threads") == []
