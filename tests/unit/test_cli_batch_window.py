"""``--batch-window-ms``: every worker's wait for the rest of a burst; ``up`` passes a changed one to every worker."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.up import up_decode_args, up_engine_args, up_prefill_args


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_a_worker_waits_30_ms_by_default_and_takes_its_own(role: str) -> None:
    assert build_parser().parse_args([role]).batch_window_ms == 30.0
    assert build_parser().parse_args([role, "--batch-window-ms", "0"]).batch_window_ms == 0.0


def test_up_passes_a_changed_window_to_every_worker_and_the_default_to_none() -> None:
    assert up_engine_args(build_parser().parse_args(["up"])) == ()
    args = build_parser().parse_args(["up", "--batch-window-ms", "0"])
    assert up_engine_args(args) == ("--batch-window-ms", "0")
    assert up_prefill_args(args) == () and up_decode_args(args) == ()
    assert build_parser().parse_args(["decode", *up_engine_args(args)]).batch_window_ms == 0.0
    assert up_engine_args(build_parser().parse_args(["up", "--batch-window-ms", "12.5"])) == ("--batch-window-ms", "12.5")


@pytest.mark.parametrize("command", [["prefill"], ["up"]])
def test_a_negative_or_unreadable_window_is_refused_naming_the_flag(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    for bad, message in (("-1", "must be >= 0, got -1"), ("soon", "not a number: 'soon'")):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--batch-window-ms", bad])
        err = capsys.readouterr().err
        assert "--batch-window-ms" in err and message in err
