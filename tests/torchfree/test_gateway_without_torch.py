"""A gateway in a process where torch is not installed (tests/torchfree/environment.py) serves text prompts,
and gets the default model's tokenizer without torch."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from pdserve.engine.default_model import DEFAULT_MODEL_ID, _marker_for, default_gguf_path
from pdserve.client import AsyncClient, SamplingOptions
from tests.conftest import VOCAB_SIZE, Oracle
from tests.support.waiting import wait_until
from tests.torchfree import workers
from tests.torchfree.environment import REPO_ROOT, torch_free_command

MAX_TOKENS = 10


def _word_tokenizer(directory: Path) -> None:
    """A whitespace word-level tokenizer over the tiny model's whole vocabulary: id i is the word ``w<i>``.

    No special tokens: they would be matched inside words ("w1" in "w12").
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB_SIZE)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(directory)


@asynccontextmanager
async def _gateway_without_torch(
    tmp_path: Path, model_dir: Path, prefill: str, decode: str
) -> AsyncIterator[tuple[str, Path]]:
    """``pdserve gateway`` in a process without torch; yields its gRPC address and its log file."""
    ready, log = tmp_path / "ready", tmp_path / "gateway.log"
    argv, env = torch_free_command(
        tmp_path / "site-packages", "-m", "pdserve", "gateway", "--model", str(model_dir), "--port", "0",
        "--http-port", "0", "--ready-file", str(ready), "--prefill", prefill, "--decode", decode,
        "--wait-for-workers", "30",
    )
    with open(log, "wb") as log_file:
        process = await asyncio.create_subprocess_exec(*argv, env=env, cwd=REPO_ROOT, stdout=log_file,
                                                       stderr=subprocess.STDOUT)
    try:
        try:
            await wait_until(lambda: ready.exists() or process.returncode is not None, "the gateway to start", 120.0)
        except AssertionError as error:
            raise AssertionError(f"{error}:\n{log.read_text()}") from None
        assert process.returncode is None, f"the gateway exited with {process.returncode}:\n{log.read_text()}"
        yield ready.read_text(), log
    finally:
        if process.returncode is None:
            process.terminate()
            await asyncio.wait_for(process.wait(), timeout=30)


def test_the_torch_free_environment_has_no_torch(tmp_path: Path) -> None:
    argv, env = torch_free_command(tmp_path / "site-packages", "-c", "import torch")
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'torch'"


@pytest.mark.asyncio
async def test_a_gateway_without_torch_serves_text_prompts_exactly(tmp_path: Path, llama_checkpoint: Path) -> None:
    model_dir = tmp_path / "model"
    shutil.copytree(llama_checkpoint, model_dir)
    _word_tokenizer(model_dir)
    text = "w12 w300 w45 w9 w128 w77 w3"
    prompt = [12, 300, 45, 9, 128, 77, 3]
    expected = Oracle(model_dir).generate(prompt, MAX_TOKENS)

    async with workers(model_dir) as (prefill, decode), \
            _gateway_without_torch(tmp_path, model_dir, prefill, decode) as (target, log):
        async with AsyncClient(target, timeout=60) as client:
            completion = await client.generate(text, SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0))
        assert list(completion.token_ids) == expected
        assert completion.text == " ".join(f"w{token}" for token in expected)
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (len(prompt), len(expected))

        (http_port,) = re.findall(r"OpenAI HTTP API on http://127\.0\.0\.1:(\d+)/v1", log.read_text())
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{http_port}/v1/completions",
                                    json={"model": "m", "prompt": text, "max_tokens": MAX_TOKENS,
                                          "temperature": 0.0}) as response:
                assert response.status == 200, await response.text()
                body = await response.json()
        assert body["choices"][0]["text"] == completion.text
        assert body["usage"]["prompt_tokens"] == len(prompt)


def test_without_torch_the_default_tokenizer_is_built_from_the_gguf_metadata(tmp_path: Path) -> None:
    """Exactly what transformers' own GGUF path (which needs torch) saves, bookkeeping keys aside."""
    from transformers import AutoTokenizer

    cache = tmp_path / "cache"
    reading = (
        "import json, sys; from pdserve.gateway.tokenizer import load_tokenizer; tokenizer = load_tokenizer(None); "
        "print(json.dumps([tokenizer.name_or_path, tokenizer('The capital of France is')['input_ids'], "
        "tokenizer.eos_token, 'torch' in sys.modules]))"
    )
    argv, env = torch_free_command(tmp_path / "site-packages", "-c", reading)
    env["PDSERVE_CACHE_DIR"] = str(cache)
    result = subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    folder, ids, eos, loaded_torch = json.loads(result.stdout.splitlines()[-1])
    built = cache / "tokenizers" / DEFAULT_MODEL_ID
    assert (folder, ids, eos, loaded_torch) == (str(built), [504, 3575, 282, 4649, 314], "<|im_end|>", False)
    assert sorted(p.name for p in built.iterdir()) == [
        "chat_template.jinja", "pdserve-converted.json", "tokenizer.json", "tokenizer_config.json"
    ]

    gguf_path = default_gguf_path()
    reference = tmp_path / "reference"
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True).save_pretrained(
        reference
    )
    assert json.loads((built / "tokenizer.json").read_text()) == json.loads((reference / "tokenizer.json").read_text())
    assert (built / "chat_template.jinja").read_text() == (reference / "chat_template.jinja").read_text()
    bookkeeping = {"is_local", "local_files_only"}
    expected_config = {k: v for k, v in json.loads((reference / "tokenizer_config.json").read_text()).items()
                       if k not in bookkeeping}
    assert json.loads((built / "tokenizer_config.json").read_text()) == expected_config
    assert json.loads((built / "pdserve-converted.json").read_text()) == _marker_for(gguf_path, DEFAULT_MODEL_ID)


def test_the_workers_converted_folder_is_the_default_tokenizer_when_present(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pdserve.engine.default_model

    converted = tmp_path / "models" / DEFAULT_MODEL_ID
    converted.mkdir(parents=True)
    (converted / "pdserve-converted.json").write_text(json.dumps(_marker_for(default_gguf_path(), DEFAULT_MODEL_ID)))

    def must_not_convert(*args: object) -> None:
        raise AssertionError("converted although the workers' folder is there")

    monkeypatch.setattr(pdserve.engine.default_model, "_convert", must_not_convert)
    assert pdserve.engine.default_model.ensure_default_tokenizer(tmp_path) == converted
