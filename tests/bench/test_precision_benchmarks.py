"""The precision benchmarks: the accuracy math on hand-made numbers, the text, the CLIs, memory and roofline figures."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch

from benchmarks import accuracy, precision
from benchmarks.accuracy_metrics import (
    Window,
    agreement,
    perplexity,
    sliding_windows,
    top1_agreement,
    truncated_kl,
)
from benchmarks.accuracy_text import LICENSE_DIR, LICENSE_FILES, load_text, load_token_ids
from benchmarks.precision import PrecisionSetting, Unsupported, parse_setting, parse_settings, with_llm
from tests.conftest import random_prompts

LN2, LN3 = math.log(2), math.log(3)


def test_sliding_windows_score_every_token_after_the_first_once() -> None:
    assert sliding_windows(10, 4, 2) == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]
    # No overlap: a window's first token has no context in it and is not scored.
    assert sliding_windows(10, 4, 4) == [Window(0, 4, 1), Window(4, 8, 5), Window(8, 10, 9)]
    assert list(Window(4, 8, 5).scored_entries()) == [0, 1, 2]
    assert sum(w.num_scored for w in sliding_windows(10, 4, 4)) == 7
    assert sliding_windows(9, 4, 4) == [Window(0, 4, 1), Window(4, 8, 5)]  # [8, 9) would score nothing
    assert sliding_windows(5, 8, 8) == [Window(0, 5, 1)]
    # The last start whose window adds nothing new is skipped: [6, 9) was scored by [3, 9).
    assert sliding_windows(9, 6, 3) == [Window(0, 6, 1), Window(3, 9, 6)]
    # Entry j of a window's prompt_logprobs is token begin + j + 1: [2, 6) scoring 4 and 5 uses entries 1 and 2.
    assert list(Window(2, 6, 4).scored_entries()) == [1, 2]
    assert list(Window(0, 4, 1).scored_entries()) == [0, 1, 2]


@pytest.mark.parametrize(("args", "message"), [
    ((10, 1, 1), "window must be at least 2"),
    ((10, 4, 5), "stride must be in"),
    ((10, 4, 0), "stride must be in"),
    ((1, 4, 4), "at least 2 tokens"),
])
def test_bad_windows_are_refused(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sliding_windows(*args)


def test_perplexity_is_exp_of_the_mean_negative_logprob() -> None:
    assert perplexity([math.log(0.5), math.log(0.25)]) == pytest.approx(math.sqrt(8), rel=1e-12)
    assert perplexity([0.0, 0.0]) == 1.0
    with pytest.raises(ValueError, match="no tokens"):
        perplexity([])


def test_top1_agreement_compares_the_first_entries() -> None:
    reference = [[(1, -0.1), (2, -3.0)], [(5, -0.2)], [(7, -1.0), (8, -1.1)], [(9, -0.5)]]
    candidate = [[(1, -0.2)], [(6, -0.1), (5, -0.3)], [(7, -0.9)], [(4, -0.4)]]
    assert top1_agreement(reference, candidate) == 0.5


def test_truncated_kl_on_swapped_probabilities() -> None:
    # P = (.5, .25, rest .25), Q = (.25, .5, rest .25): .5 ln 2 + .25 ln .5 + 0.
    kl, coverage = truncated_kl([(1, math.log(0.5)), (2, math.log(0.25))], [(2, math.log(0.5)), (1, math.log(0.25))])
    assert kl == pytest.approx(0.25 * LN2, rel=1e-12)
    assert coverage == pytest.approx(0.75, rel=1e-12)


def test_truncated_kl_puts_tokens_missing_from_either_list_in_the_rest_bucket() -> None:
    # Only token 1 is in both lists: P (.5, rest .5), Q (.5, rest .5) -> 0, though the lists differ.
    kl, coverage = truncated_kl([(1, math.log(0.5)), (2, math.log(0.25))], [(1, math.log(0.5)), (3, math.log(0.25))])
    assert kl == pytest.approx(0.0, abs=1e-15)
    assert coverage == pytest.approx(0.5, rel=1e-12)
    # P (.8, rest .2), Q (.4, rest .6): .8 ln 2 + .2 ln(1/3).
    kl, coverage = truncated_kl([(1, math.log(0.8))], [(1, math.log(0.4))])
    assert kl == pytest.approx(0.8 * LN2 - 0.2 * LN3, rel=1e-12)
    assert coverage == pytest.approx(0.8, rel=1e-12)


def test_truncated_kl_of_identical_lists_is_zero_and_agreement_averages_positions() -> None:
    same = [(3, math.log(0.6)), (4, math.log(0.3))]
    assert truncated_kl(same, same)[0] == pytest.approx(0.0, abs=1e-15)
    result = agreement(
        [same, [(1, math.log(0.5)), (2, math.log(0.25))]],
        [same, [(2, math.log(0.5)), (1, math.log(0.25))]],
    )
    assert result.top1_agreement == 0.5
    assert result.mean_kl == pytest.approx(0.25 * LN2 / 2, rel=1e-12)
    assert result.mean_coverage == pytest.approx((0.9 + 0.75) / 2, rel=1e-12)
    with pytest.raises(ValueError, match="reference has 1 positions, candidate 2"):
        agreement([same], [same, same])
    with pytest.raises(ValueError, match="prompt_logprobs >= 1"):
        agreement([()], [()])


def test_the_text_is_five_licences_in_a_fixed_order_of_23535_default_tokens() -> None:
    from transformers import AutoTokenizer

    from pdserve.engine.default_model import ensure_default_tokenizer

    text = load_text()
    assert text.startswith("                    GNU GENERAL PUBLIC LICENSE\n                       Version 3")
    assert len(text) == sum(len((LICENSE_DIR / name).read_text()) for name in LICENSE_FILES) + 2 * 4
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_tokenizer()))
    assert len(load_token_ids(tokenizer)) == 23535


def test_a_missing_licence_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "GPL-3").write_text("x")
    with pytest.raises(FileNotFoundError, match="GPL-2, LGPL-2.1, Apache-2.0, MPL-2.0 in .*base-files"):
        load_text(tmp_path)


def test_settings_parse_with_unset_parts_and_float32_first() -> None:
    assert parse_setting("bfloat16") == PrecisionSetting("bfloat16")
    assert parse_setting("bfloat16:int4:int8") == PrecisionSetting("bfloat16", "int4", "int8")
    assert parse_setting("bfloat16::int8") == PrecisionSetting("bfloat16", None, "int8")
    assert parse_setting("float32:-:auto") == PrecisionSetting("float32", None, "auto")
    head = parse_setting("bfloat16:int4::float")
    assert head == PrecisionSetting("bfloat16", "int4", None, "float") and head.name == "bfloat16:int4::float"
    assert head.llm_kwargs() == {"dtype": "bfloat16", "quantization": "int4", "quantize_lm_head": False}
    eager = parse_setting("bfloat16:int4:::eager")
    assert eager == PrecisionSetting("bfloat16", "int4", execution="eager") and eager.name == "bfloat16:int4:::eager"
    assert eager.llm_kwargs() == {"dtype": "bfloat16", "quantization": "int4", "enforce_eager": True}
    library = parse_setting("bfloat16::::library")
    assert library == PrecisionSetting("bfloat16", execution="library") and library.name == "bfloat16::::library"
    assert library.llm_kwargs() == {"dtype": "bfloat16"}
    assert PrecisionSetting("bfloat16", None, "int8").name == "bfloat16::int8"
    assert PrecisionSetting("bfloat16", "int8").name == "bfloat16:int8"
    assert PrecisionSetting("bfloat16", "int4", "int8").base == PrecisionSetting("bfloat16", "int4")
    assert PrecisionSetting("bfloat16", "int4").llm_kwargs() == {"dtype": "bfloat16", "quantization": "int4"}
    assert parse_settings(["bfloat16", "float32", "bfloat16"]) == [PrecisionSetting("float32"), PrecisionSetting("bfloat16")]


@pytest.mark.parametrize(("text", "message"), [
    ("fp8", "dtype must be one of"),
    ("bfloat16:int2", "quantization must be one of"),
    ("bfloat16:int8:fp8", "kv_cache_dtype must be one of"),
    ("bfloat16:int8:int8:x", "lm_head must be one of"),
    ("bfloat16:int8:int8:float:x", "execution must be one of"),
    ("bfloat16:int8:int8:float:eager:x", "expected DTYPE"),
])
def test_bad_settings_are_refused_naming_the_part(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"setting '{text}': {message}"):
        parse_setting(text)


def test_cli_rejects_a_bad_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        accuracy.parse_args(["--setting", "bfloat16:int3"])
    assert "--setting: setting 'bfloat16:int3': quantization must be one of ('int8', 'int4')" in capsys.readouterr().err


def test_a_setting_the_engine_refuses_is_reported_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(setting: PrecisionSetting, **kwargs: object) -> object:
        raise TypeError("LLM.__init__() got an unexpected keyword argument 'quantization'")

    monkeypatch.setattr(precision, "build_llm", refuse)
    with pytest.raises(Unsupported) as caught:
        with_llm(PrecisionSetting("bfloat16", "int8"), lambda llm: llm)
    line = precision.failure_line(caught.value)
    assert line == "unsupported: TypeError: LLM.__init__() got an unexpected keyword argument 'quantization'"
    args = argparse.Namespace(settings=[PrecisionSetting("float32"), PrecisionSetting("bfloat16", "int8")],
                              window=4, stride=4, top_n=2, model=None)
    scored = {PrecisionSetting("float32"): accuracy.ScoredText((math.log(0.5),), (((1, math.log(0.5)),),), 0.1)}
    report = accuracy.build_report(args, 2, [Window(0, 2, 1)], scored, {PrecisionSetting("bfloat16", "int8"): line})
    assert report["settings"][1] == {"setting": "bfloat16:int8", "error": line}
    assert report["settings"][0]["perplexity"] == pytest.approx(2.0, rel=1e-12)


def test_targets_follow_the_issue() -> None:
    assert accuracy.target_for(PrecisionSetting("float32")) is None
    assert accuracy.target_for(PrecisionSetting("bfloat16")) == (PrecisionSetting("float32"), 0.01)
    assert accuracy.target_for(PrecisionSetting("bfloat16", "int8")) == (PrecisionSetting("float32"), 0.01)
    assert accuracy.target_for(PrecisionSetting("bfloat16", "int4")) == (PrecisionSetting("float32"), 0.05)
    assert accuracy.target_for(PrecisionSetting("bfloat16", "int4", "int8")) == (
        PrecisionSetting("bfloat16", "int4"), 0.005)


def test_scored_logprobs_match_transformers_window_by_window(llama_checkpoint: Path) -> None:
    from transformers import AutoModelForCausalLM

    from pdserve.engine import LLM

    token_ids = random_prompts([70], seed=3)[0]
    windows = sliding_windows(len(token_ids), 32, 16) + sliding_windows(len(token_ids), 32, 32)
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=64)
    scored = accuracy.score_text(llm, token_ids, windows, top_n=3)
    # Overlapping windows score every token but the first; windows without overlap not their first ones.
    assert len(scored.logprobs) == len(scored.tops) == (len(token_ids) - 1) + (len(token_ids) - 3)
    assert all(len(top) == 3 for top in scored.tops)
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32).eval()
    expected: list[float] = []
    for w in windows:
        ids = torch.tensor([token_ids[w.begin : w.end]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)  # (len, vocab)
        for t in range(w.first_scored, w.end):
            expected.append(logprobs[t - w.begin - 1, token_ids[t]].item())
    assert scored.logprobs == pytest.approx(expected, abs=1e-4)
    # Scoring a few windows at a time (--windows-at-once) changes memory and time, not the figures.
    grouped = accuracy.score_text(llm, token_ids, windows, top_n=3, windows_at_once=2)
    assert grouped.logprobs == pytest.approx(scored.logprobs, abs=1e-5) and len(grouped.tops) == len(scored.tops)


def test_weight_bytes_count_a_tied_head_once_and_skip_the_rotary_tables() -> None:
    from benchmarks.precision_speed import kv_bytes_per_token, weight_bytes

    class Rotary(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cos", torch.zeros(100, 8), persistent=False)
            self.register_buffer("sin", torch.zeros(100, 8), persistent=False)

    def model(tied: bool) -> torch.nn.Module:
        module = torch.nn.Module()
        module.embed_tokens = torch.nn.Embedding(10, 4)  # 160 bytes
        module.proj = torch.nn.Linear(4, 6, bias=False).to(torch.bfloat16)  # 48 bytes
        module.rotary = Rotary()
        module.lm_head = torch.nn.Linear(4, 10, bias=False)  # 160 bytes, or the embedding's storage
        if tied:
            module.lm_head.weight = torch.nn.Parameter(module.embed_tokens.weight.data)
        return module

    assert weight_bytes(model(tied=True)) == (208, 208)  # the head reads the embedding: all of it is read
    assert weight_bytes(model(tied=False)) == (368, 208)  # the lookup reads rows, the head its own copy

    class FakeKVCache:
        def __init__(self) -> None:
            self.data = torch.zeros(2, 2, 4, 16, 3, 8, dtype=torch.int8)  # layers, K/V, blocks, slots, heads, dim
            self.scales = torch.zeros(2, 2, 4, 16, 3, dtype=torch.float32)
            self.num_blocks, self.block_size = 4, 16

    assert kv_bytes_per_token(FakeKVCache()) == 2 * 2 * 3 * (8 + 4)


def test_speed_cli_parses_settings_and_refuses_a_single_token_decode(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import precision_speed

    args = precision_speed.parse_args(["--setting", "bfloat16:int4:int8", "--setting", "bfloat16"])
    assert args.settings == [
        PrecisionSetting("float32"), PrecisionSetting("bfloat16", "int4", "int8"), PrecisionSetting("bfloat16")
    ]
    with pytest.raises(SystemExit):
        precision_speed.parse_args(["--batch1-output-len", "1"])
    assert "--batch1-output-len must be at least 2" in capsys.readouterr().err


def test_roofline_bound_uses_the_settings_bytes_and_rate() -> None:
    from benchmarks.machine_limits import MachineLimits
    from benchmarks.roofline import ModelCost, decode_step_bound
    from benchmarks.workload import RunResult, Workload

    cost = ModelCost(non_embedding_params=900, lm_head_params=100, num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=4, weight_bytes_per_value=0.5, kv_bytes_per_value=1.25)
    assert cost.weight_bytes == 500
    assert cost.kv_bytes_per_token == 2 * 2 * 1 * 4 * 1.25
    workload = Workload(prompts=((1, 2, 3, 4), (5, 6, 7, 8)), output_len=5)  # mean context 4 + 2.5
    limits = MachineLimits(matmul_gflops={"m": 1.0}, copy_gbps=1e-6, sum_gbps=0.5e-6, num_threads=2)
    bound = decode_step_bound(cost, workload, limits, 2, RunResult("w1", 9.0, ()), RunResult("p", 1.0, ()),
                              gflops=2e-6)
    assert bound["kv_bytes"] == 2 * 6.5 * 20
    assert bound["memory_bound_s"] == pytest.approx((500 + 260) / 1e3)
    # 2 × 1000 params × 2 rows + 2 layers × 4 × 2 heads × 4 dims × 2 queries × 6 positions (6.5 rounded).
    assert bound["compute_bound_s"] == pytest.approx((4000 + 2 * 4 * 2 * 4 * 2 * 6) / 2e3)
    assert bound["measured_step_s"] == 2.0


def test_the_library_execution_keeps_layers_off_pdserves_dense_kernels(
    llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.engine.layers import linear
    from pdserve.engine.layers.dense_kernels import load_dense_kernels

    kernels = load_dense_kernels()  # the native build: its portable bf16 path where the CPU lacks AVX512-BF16
    monkeypatch.setattr(linear, "_dense_kernels", lambda dtype: kernels)
    for text, on_kernel in (("bfloat16::::library", False), ("bfloat16", True), ("float32::::library", False)):
        llm = precision.build_llm(parse_setting(text), model=str(llama_checkpoint), num_kv_blocks=16)
        model = llm.engine.model
        assert (model.model.layers[0].self_attn.qkv_proj._dense_gemm is not None) == on_kernel, text
        assert (model.fused_decoder is not None) == on_kernel, text
    assert linear._dense_kernels(torch.float32) is kernels, "the switch is put back after construction"


def test_timed_decode_steps_time_only_steps_where_every_request_decodes(llama_checkpoint: Path) -> None:
    from benchmarks.precision_speed import time_decode_steps
    from benchmarks.workload import Workload

    llm = precision.build_llm(parse_setting("float32"), model=str(llama_checkpoint), num_kv_blocks=32)
    engine = llm.engine
    workload = Workload(prompts=((1, 2, 3), (4, 5, 6, 7, 8), (9, 10, 11, 12)), output_len=8)
    step_s, context = time_decode_steps(engine, workload, 3)
    # One step prefills all three prompts and samples their first tokens; the three timed
    # steps then attend to prompt + 1, + 2 and + 3 tokens: the mean prompt length 4, plus 2.
    assert context == 4 + 2
    assert step_s > 0
    assert not engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="0 of 3 requests left to decode: lower --timed-steps"):
        time_decode_steps(engine, workload, 8)  # the first requests finish after 8 tokens
    assert not engine.has_unfinished_requests()


def test_speed_cli_bounds_the_timed_steps(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import precision_speed

    assert precision_speed.parse_args([]).timed_steps == 24
    with pytest.raises(SystemExit):
        precision_speed.parse_args(["--output-len", "16", "--timed-steps", "9"])
    assert "--timed-steps must be between 0 and half of --output-len" in capsys.readouterr().err
