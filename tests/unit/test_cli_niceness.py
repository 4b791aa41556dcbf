"""``--niceness`` lowers a worker's CPU priority; ``up --prefill-niceness`` passes it to prefill workers only."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.up import up_decode_args, up_engine_args, up_prefill_args


def test_up_passes_prefill_niceness_to_prefill_workers_only_and_a_bad_one_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["up", "--prefill-niceness", "7", "--prefill-tp", "2"])
    assert up_prefill_args(args) == ("--niceness", "7", "--tensor-parallel-size", "2")
    assert up_decode_args(args) == () and up_engine_args(args) == ()
    assert build_parser().parse_args(["prefill", *up_prefill_args(args)]).niceness == 7
    assert build_parser().parse_args(["decode"]).niceness == 0
    for bad, message in (("20", "must be 0-19"), ("-1", "must be 0-19"), ("high", "not an integer: 'high'")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["up", "--prefill-niceness", bad])
        assert message in capsys.readouterr().err
