"""Stopping rules, argument validation, seeded sampling and logprobs through the whole engine."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.types.structured_outputs import StructuredOutputsParams
from tests.conftest import random_prompts


def _llm(path: Path, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", num_kv_blocks=128, **kwargs)


@pytest.fixture(scope="module")
def tiny_llm(llama_checkpoint: Path) -> LLM:
    return _llm(llama_checkpoint)


def _greedy_tokens(llm: LLM, prompt: list[int], n: int) -> list[int]:
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return out.token_ids


def test_eos_comes_from_the_generation_config_and_ignore_eos_overrides_it(
    llama_checkpoint: Path, tmp_path: Path, tiny_llm: LLM
) -> None:
    prompt = random_prompts([12], seed=20)[0]
    free_run = _greedy_tokens(tiny_llm, prompt, 10)
    eos = free_run[3]
    assert eos not in free_run[:3]
    # Same weights, but the generation config names another EOS id (a list, as in Llama 3).
    copy = tmp_path / "eos-copy"
    shutil.copytree(llama_checkpoint, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 99999 % 512]}))
    llm = _llm(copy)
    (stopped,) = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))
    assert stopped.token_ids == free_run[:4]
    assert stopped.finish_reason == "stop"
    (ignored,) = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert ignored.token_ids == free_run
    assert ignored.finish_reason == "length"


def test_stop_token_ids_and_max_tokens_finish_requests(tiny_llm: LLM) -> None:
    prompt = random_prompts([20], seed=21)[0]
    free_run = _greedy_tokens(tiny_llm, prompt, 12)
    stop_id = free_run[5]
    first = free_run.index(stop_id)
    (out,) = tiny_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_id]))
    assert out.token_ids == free_run[: first + 1]
    assert out.finish_reason == "stop"
    (short,) = tiny_llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert short.token_ids == free_run[:3]
    assert short.finish_reason == "length"


def test_skip_special_tokens_false_writes_them_and_stop_strings_match_the_text_as_written(
    chat_checkpoint: Path,
) -> None:
    # The byte tokenizer's special tokens 5 and 6 (tests/http/conftest.py), which a grammar makes the model write.
    spec = StructuredOutputsParams(grammar='start: <[5]> "hi" <[6]> "there"')
    prompt = random_prompts([9], seed=23)[0]
    base = dict(max_tokens=16, temperature=0.0, structured_outputs=spec)
    skipped, written, cut_at_special, cut_in_text, not_cut_at_special, not_cut_in_text = _llm(chat_checkpoint).generate(
        [prompt] * 6,
        [
            SamplingParams(**base),
            SamplingParams(**base, skip_special_tokens=False),
            SamplingParams(**base, skip_special_tokens=False, stop=["<|reserved_1|>"]),
            SamplingParams(**base, stop=["ith"]),
            SamplingParams(**base, stop=["<|reserved_1|>"]),  # not in the text the default writes
            SamplingParams(**base, skip_special_tokens=False, stop=["ith"]),  # "hi" and "there" are apart
        ],
    )
    assert skipped.text == "hithere"
    assert written.text == "<|reserved_0|>hi<|reserved_1|>there"
    assert written.token_ids == skipped.token_ids and skipped.token_ids[0] == 5 and 6 in skipped.token_ids
    assert (cut_at_special.text, cut_at_special.finish_reason) == ("<|reserved_0|>hi", "stop")
    assert cut_at_special.token_ids == written.token_ids[: written.token_ids.index(6) + 1]
    assert (cut_in_text.text, cut_in_text.finish_reason) == ("h", "stop")
    assert (not_cut_at_special.text, not_cut_at_special.token_ids) == ("hithere", skipped.token_ids)
    assert (not_cut_in_text.text, not_cut_in_text.token_ids) == (written.text, written.token_ids)


def test_seeded_sampling_repeats_exactly_whatever_else_is_in_the_batch(tiny_llm: LLM) -> None:
    prompts = random_prompts([8, 30, 50], seed=22)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = tiny_llm.generate([prompts[0]], seeded)[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True), SamplingParams(max_tokens=16, temperature=0.0)]
    crowded = tiny_llm.generate(prompts, [seeded, *others])[0].token_ids
    assert crowded == alone
    other_seed = tiny_llm.generate([prompts[0]], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True))[0]
    assert other_seed.token_ids != alone


def test_logprobs_match_the_reference_distribution(llama_checkpoint: Path, tiny_llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    prompt = random_prompts([25], seed=23)[0]
    (out,) = tiny_llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, logprobs=4, ignore_eos=True))
    reference = AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + out.token_ids])).logits[0]
    expected = torch.log_softmax(logits[len(prompt) - 1 :], dim=-1)
    assert out.logprobs is not None and len(out.logprobs) == 3
    for step, entry in enumerate(out.logprobs):
        top = torch.topk(expected[step], 4)
        assert entry.token_id == out.token_ids[step] == top.indices[0].item()
        assert [token for token, _ in entry.top] == top.indices.tolist()
        assert entry.logprob == pytest.approx(expected[step, entry.token_id].item(), abs=1e-4)
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"num_kv_blocks": 0}, "num_kv_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"dtype": "float8"}, "dtype"),
        ({"max_model_len": 5000}, "max_model_len"),
        ({"attention_backend": "xformers"}, "attention_backend"),
    ],
)
def test_invalid_engine_arguments_raise_value_error_naming_them(
    llama_checkpoint: Path, kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        LLM(model=str(llama_checkpoint), **kwargs)


def test_request_larger_than_the_kv_pool_is_rejected_up_front(llama_checkpoint: Path) -> None:
    llm = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="KV pool"):
        llm.generate([[3] * 60], SamplingParams(max_tokens=10))
    (out,) = llm.generate([[3] * 54], SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(out.token_ids) == 10


def test_unknown_model_folder_raises_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model"):
        LLM(model=str(tmp_path / "no-such-model-here"))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_tokens": -1}, r"^min_tokens must be an integer in \[0, max_tokens=16\], got -1$"),
        ({"max_tokens": 3, "min_tokens": 4}, r"^min_tokens must be an integer in \[0, max_tokens=3\], got 4$"),
        ({"presence_penalty": 2.5}, r"^presence_penalty must be in \[-2, 2\], got 2.5$"),
        ({"frequency_penalty": float("nan")}, r"^frequency_penalty must be in \[-2, 2\], got nan$"),
        ({"repetition_penalty": 0.0}, r"^repetition_penalty must be in \(0, 10\], got 0.0$"),
        ({"repetition_penalty": 10.5}, r"^repetition_penalty must be in \(0, 10\], got 10.5$"),
        ({"logit_bias": {3: 100.5}}, r"^logit_bias\[3\] must be in \[-100, 100\], got 100.5$"),
        ({"logit_bias": {-1: 1.0}}, r"^logit_bias keys must be non-negative token ids, got -1$"),
        ({"logit_bias": [(3, 1.0), (3, 2.0)]}, r"^logit_bias holds a token id twice$"),
        ({"prompt_logprobs": -1}, r"^prompt_logprobs must be a non-negative integer or None, got -1$"),
        ({"skip_special_tokens": 0}, r"^skip_special_tokens must be a bool, got 0$"),
        ({"skip_special_tokens": "false"}, r"^skip_special_tokens must be a bool, got 'false'$"),
    ],
)
def test_invalid_sampling_params_raise_value_error_naming_them(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_invalid_prompts_raise_value_error_and_leave_the_engine_clean(tiny_llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        tiny_llm.generate([[]], greedy)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate([[1, 2, 512]], greedy)
    with pytest.raises(ValueError, match="max_model_len"):
        tiny_llm.generate([[3] * 1020], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="tokenizer"):
        tiny_llm.generate(["text needs a tokenizer"], greedy)
    with pytest.raises(ValueError, match=r"^logit_bias key 512 is outside the vocabulary \[0, 512\)$"):
        tiny_llm.generate([[1, 2]], SamplingParams(logit_bias={5: 1.0, 512: 1.0}))
    with pytest.raises(ValueError, match="sampling_params has 2 entries"):
        tiny_llm.generate([[1, 2]], [greedy, greedy])
    # A bad prompt in a batch rejects the batch; nothing is left queued or held.
    with pytest.raises(ValueError):
        tiny_llm.generate([[5, 6, 8], [1, 9999]], greedy)
    assert not tiny_llm.engine.has_unfinished_requests()
    assert tiny_llm.engine.block_manager.num_used_blocks == 0
    (ok,) = tiny_llm.generate([[5, 6, 8]], greedy)
    assert len(ok.token_ids) >= 1


@pytest.mark.parametrize("native", [True, False])
def test_an_explicit_bf16_on_a_cpu_without_bf16_units_warns_that_it_is_emulated(
    native: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pdserve.engine import llm_engine

    monkeypatch.setattr(llm_engine, "cpu_has_native_bf16", lambda: native)
    with caplog.at_level("WARNING", logger="pdserve.engine.llm_engine"):
        assert llm_engine._resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
        assert llm_engine._resolve_dtype("float32", torch.device("cpu")) == torch.float32
    warnings = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
    assert len(warnings) == (0 if native else 1)
    if warnings:
        assert warnings[0].startswith("dtype='bfloat16' on a CPU without bf16 units (no avx512_bf16 or amx_bf16)")


def test_dtype_auto_is_bf16_where_the_cpu_runs_it_natively(llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.engine import llm_engine

    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        flags = next(line for line in cpuinfo if line.startswith("flags")).split()
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    llm = LLM(model=str(llama_checkpoint), num_kv_blocks=16)
    assert llm.engine.dtype == (torch.bfloat16 if native else torch.float32)
    # A CPU without native bf16 serves float32; GPUs bf16.
    monkeypatch.setattr(llm_engine, "cpu_has_native_bf16", lambda: False)
    assert llm_engine.auto_dtype(torch.device("cpu")) == torch.float32
    monkeypatch.setattr(llm_engine, "cpu_has_native_bf16", lambda: True)
    assert llm_engine.auto_dtype(torch.device("cpu")) == torch.bfloat16
    assert llm_engine.auto_dtype(torch.device("cuda")) == torch.bfloat16


def test_vllm_prompt_dicts_are_accepted_and_bad_ones_refused_naming_the_key(tiny_llm: LLM) -> None:
    ids = random_prompts([7, 12], seed=90)
    greedy = SamplingParams(max_tokens=5, temperature=0.0)
    plain = [o.token_ids for o in tiny_llm.generate(ids, greedy)]
    # TokensPrompt dicts, alone or mixed with plain token ids, give what the ids give.
    as_dicts = tiny_llm.generate([{"prompt_token_ids": ids[0]}, ids[1]], greedy)
    assert [o.token_ids for o in as_dicts] == plain
    (single,) = tiny_llm.generate({"prompt_token_ids": ids[1]}, greedy)
    assert single.token_ids == plain[1] and single.prompt_token_ids == ids[1]
    with pytest.raises(ValueError, match=r"prompt dict keys \['multi_modal_data'\] are not supported"):
        tiny_llm.generate({"prompt_token_ids": ids[0], "multi_modal_data": {}}, greedy)
    with pytest.raises(ValueError, match="a prompt dict needs exactly one of 'prompt' .text. or 'prompt_token_ids'"):
        tiny_llm.generate([{}], greedy)
    with pytest.raises(ValueError, match="prompts must be strings, lists of token ids or prompt dicts, got float"):
        tiny_llm.generate([1.5], greedy)
