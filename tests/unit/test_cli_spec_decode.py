"""``--speculative-config`` (vLLM's flag) reaches the engine config of every engine role, and ``up``'s
decoding workers only."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.serve import engine_config
from pdserve.up import up_decode_args, up_engine_args, up_prefill_args

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "disable_by_batch_size": 6}'


@pytest.mark.parametrize("role", ["offline", "prefill", "decode", "colocated"])
def test_every_engine_role_takes_the_speculative_config(role: str) -> None:
    spec = engine_config(build_parser().parse_args([role, "--speculative-config", NGRAM])).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.disable_by_batch_size) == (
        "ngram", 3, 2, 6,
    )
    assert engine_config(build_parser().parse_args([role])).speculative_config is None


def test_a_bad_speculative_config_is_refused_by_the_parser_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}'])
    assert "--speculative-config: speculative_config.num_speculative_tokens must be an integer >= 1, got -1" in (
        capsys.readouterr().err
    )


def test_up_passes_the_speculative_config_to_decoding_workers_only() -> None:
    args = build_parser().parse_args(["up", "--speculative-config", NGRAM])
    assert up_engine_args(args) == ()  # what every worker gets, prefill workers included
    decode_args = up_decode_args(args)
    assert decode_args == (
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "disable_by_batch_size": 6}',
    )
    worker = build_parser().parse_args(["decode", *decode_args])
    assert engine_config(worker).speculative_config == args.speculative_config
    assert up_decode_args(build_parser().parse_args(["up"])) == ()
    assert up_prefill_args(args) == ()


DRAFT = '{"method": "draft_model", "model": "default", "num_speculative_tokens": 3, "quantization": "int4"}'


def test_up_draft_prompt_kv_prefill_gives_prefill_workers_the_draft_and_handoff_draft_kv() -> None:
    args = build_parser().parse_args(["up", "--speculative-config", DRAFT, "--draft-prompt-kv", "prefill"])
    prefill_args = up_prefill_args(args)
    assert prefill_args == (
        "--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 3, "model": "default", '
        '"quantization": "int4"}', "--handoff-draft-kv",
    )
    config = engine_config(build_parser().parse_args(["prefill", *prefill_args]))
    assert config.handoff_draft_kv and config.speculative_config == args.speculative_config
    # The default: the decode worker recomputes the draft's prompt KV; prefill workers get no draft.
    default = build_parser().parse_args(["up", "--speculative-config", DRAFT])
    assert default.draft_prompt_kv == "recompute" and up_prefill_args(default) == ()
    assert not engine_config(build_parser().parse_args(["prefill"])).handoff_draft_kv


@pytest.mark.parametrize("spec", [[], ["--speculative-config", NGRAM]])
def test_up_draft_prompt_kv_prefill_needs_a_draft_model(spec: list[str]) -> None:
    args = build_parser().parse_args(["up", *spec, "--draft-prompt-kv", "prefill"])
    with pytest.raises(ValueError, match="--draft-prompt-kv prefill needs a draft_model --speculative-config"):
        up_prefill_args(args)


def test_a_prefill_worker_with_handoff_draft_kv_but_no_draft_is_refused() -> None:
    with pytest.raises(ValueError, match="handoff_draft_kv needs a speculative_config with method 'draft_model'"):
        engine_config(build_parser().parse_args(["prefill", "--handoff-draft-kv"]))
