"""``--kv-handoff-timeout``: one flag sets the one handoff deadline of every worker, ``pdserve up``'s included."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.serve import engine_config
from pdserve.up import up_engine_args


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_every_worker_takes_the_deadline_into_its_engine_config(role: str) -> None:
    assert engine_config(build_parser().parse_args([role])).kv_handoff_timeout_s == 30.0
    args = build_parser().parse_args([role, "--kv-handoff-timeout", "7.5"])
    assert engine_config(args).kv_handoff_timeout_s == 7.5


@pytest.mark.parametrize("role", ["prefill", "colocated"])
def test_the_former_lease_seconds_still_works_with_a_warning(role: str, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args([role, "--lease-seconds", "5"])
    assert engine_config(args).kv_handoff_timeout_s == 5.0
    assert capsys.readouterr().err == "pdserve: warning: --lease-seconds is deprecated; use --kv-handoff-timeout\n"


@pytest.mark.parametrize("value", ["0", "-1", "nan", "soon"])
def test_a_deadline_that_is_not_a_positive_number_is_refused_naming_the_flag(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["decode", "--kv-handoff-timeout", value])
    assert exited.value.code == 2
    assert "argument --kv-handoff-timeout: " in capsys.readouterr().err


def test_up_passes_the_deadline_to_every_worker_only_when_it_is_not_the_default() -> None:
    assert up_engine_args(build_parser().parse_args(["up"])) == ()
    args = build_parser().parse_args(["up", "--kv-handoff-timeout", "12"])
    assert up_engine_args(args) == ("--kv-handoff-timeout", "12")
    for role in ("prefill", "decode", "colocated"):
        worker = build_parser().parse_args([role, *up_engine_args(args)])
        assert engine_config(worker).kv_handoff_timeout_s == 12.0
