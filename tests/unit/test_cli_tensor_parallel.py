"""``--tensor-parallel-size`` (vLLM's flag) reaches every engine role's config; ``up --prefill-tp/--decode-tp``
pass it to the right workers only."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.serve import engine_config
from pdserve.up import up_decode_args, up_engine_args, up_prefill_args


@pytest.mark.parametrize("role", ["offline", "prefill", "decode", "colocated"])
def test_every_engine_role_takes_the_tensor_parallel_size(role: str) -> None:
    config = engine_config(build_parser().parse_args([role, "--tensor-parallel-size", "3"]))
    assert config.parallel.tensor_parallel_size == 3
    assert engine_config(build_parser().parse_args([role])).parallel.tensor_parallel_size == 1


def test_a_bad_tensor_parallel_size_names_the_option() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        engine_config(build_parser().parse_args(["decode", "--tensor-parallel-size", "0"]))


def test_up_passes_prefill_tp_and_decode_tp_to_their_workers_only() -> None:
    args = build_parser().parse_args(["up", "--prefill-tp", "2", "--decode-tp", "3"])
    assert up_engine_args(args) == ()
    assert up_prefill_args(args) == ("--tensor-parallel-size", "2")
    assert up_decode_args(args) == ("--tensor-parallel-size", "3")
    prefill = build_parser().parse_args(["prefill", *up_prefill_args(args)])
    assert engine_config(prefill).parallel.tensor_parallel_size == 2
    default = build_parser().parse_args(["up"])
    assert up_prefill_args(default) == () and up_decode_args(default) == ()
