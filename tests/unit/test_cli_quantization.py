"""``--quantization``, ``--quantization-group-size`` and ``--disable-hybrid-kv-cache-manager`` reach the engine
config of every engine role, and ``up``'s workers."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.serve import engine_config
from pdserve.up import up_engine_args


@pytest.mark.parametrize("role", ["offline", "prefill", "decode", "colocated"])
def test_every_engine_role_takes_the_quantization_flags(role: str) -> None:
    args = build_parser().parse_args([role, "--quantization", "int4", "--quantization-group-size", "32"])
    model = engine_config(args).model
    assert (model.quantization, model.quantization_group_size) == ("int4", 32)
    default = engine_config(build_parser().parse_args([role])).model
    assert (default.quantization, default.quantization_group_size) == (None, 32)


def test_an_unknown_quantization_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--quantization", "int3"])
    assert "--quantization: invalid choice: 'int3'" in capsys.readouterr().err


def test_up_passes_the_quantization_flags_to_its_workers() -> None:
    args = build_parser().parse_args(["up", "--quantization", "int8", "--num-kv-blocks", "40"])
    assert up_engine_args(args) == ("--num-kv-blocks", "40", "--quantization", "int8", "--quantization-group-size", "32")
    assert up_engine_args(build_parser().parse_args(["up"])) == ()
    # What up passes, each worker parses back.
    worker = build_parser().parse_args(["decode", *up_engine_args(args)])
    assert engine_config(worker).model.quantization == "int8"


@pytest.mark.parametrize("role", ["offline", "prefill", "decode", "colocated"])
def test_every_engine_role_and_up_take_the_hybrid_kv_cache_manager_switch(role: str) -> None:
    args = build_parser().parse_args([role, "--disable-hybrid-kv-cache-manager"])
    assert engine_config(args).cache.disable_hybrid_kv_cache_manager is True
    assert engine_config(build_parser().parse_args([role])).cache.disable_hybrid_kv_cache_manager is False
    up = build_parser().parse_args(["up", "--disable-hybrid-kv-cache-manager"])
    assert up_engine_args(up) == ("--disable-hybrid-kv-cache-manager",)
    worker = build_parser().parse_args([role, *up_engine_args(up)])
    assert engine_config(worker).cache.disable_hybrid_kv_cache_manager is True
