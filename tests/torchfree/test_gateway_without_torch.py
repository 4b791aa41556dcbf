"""A gateway in a process where torch is not installed (tests/torchfree/environment.py) serves text prompts,
and finds the default model's tokenizer in the cache its workers share."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.default_model import DEFAULT_MODEL_ID, _marker_for, default_gguf_path
from engine.llm_engine import LLMEngine
from pdserve.client import AsyncClient, SamplingOptions
from prefill_service.server import PrefillServer
from service_common.server import ServerConfig
from service_common.worker import WorkerConfig
from tests.conftest import VOCAB_SIZE, Oracle
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


async def _wait_for_file(path: Path, process: asyncio.subprocess.Process, log: Path, timeout_s: float = 120.0) -> str:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not path.exists():
        assert process.returncode is None, f"the gateway exited with {process.returncode}:\n{log.read_text()}"
        assert loop.time() < deadline, f"no {path.name} after {timeout_s} s:\n{log.read_text()}"
        await asyncio.sleep(0.1)
    return path.read_text()


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

    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(model=ModelConfig(model=str(model_dir), dtype="float32"),
                                      cache=CacheConfig(num_kv_blocks=64)))

    prefill = PrefillServer(engine(), ServerConfig(), WorkerConfig("prefill", "p0"))
    decode = DecodeServer(engine(), ServerConfig(), WorkerConfig("decode", "d0"))
    servers: list = []
    process = None
    log = tmp_path / "gateway.log"
    try:
        p_port = await prefill.start()
        servers.append(prefill)
        d_port = await decode.start()
        servers.append(decode)
        ready = tmp_path / "ready"
        argv, env = torch_free_command(
            tmp_path / "site-packages", "-m", "pdserve", "gateway", "--model", str(model_dir), "--port", "0",
            "--http-port", "0", "--ready-file", str(ready), "--prefill", f"127.0.0.1:{p_port}",
            "--decode", f"127.0.0.1:{d_port}", "--wait-for-workers", "30",
        )
        with open(log, "wb") as log_file:
            process = await asyncio.create_subprocess_exec(*argv, env=env, cwd=REPO_ROOT, stdout=log_file,
                                                           stderr=subprocess.STDOUT)
        target = await _wait_for_file(ready, process, log)

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
    finally:
        if process is not None and process.returncode is None:
            process.terminate()
            await asyncio.wait_for(process.wait(), timeout=30)
        for server in reversed(servers):
            await server.stop()


def test_without_torch_the_default_tokenizer_is_the_workers_converted_folder(tmp_path: Path) -> None:
    """It waits for a worker to publish the folder (here: this test, by one rename), then loads it."""
    from transformers import AutoTokenizer

    gguf_path = default_gguf_path()
    cache = tmp_path / "cache"
    reading = (
        "import json, sys; from gateway.tokenizer import load_tokenizer; "
        "tokenizer = load_tokenizer(None, wait_s=float(sys.argv[1])); "
        "print(json.dumps([tokenizer('The capital of France is')['input_ids'], "
        "'torch' in sys.modules, tokenizer.eos_token]))"
    )
    env_dir = tmp_path / "site-packages"
    argv, env = torch_free_command(env_dir, "-c", reading, "0.2")
    env["PDSERVE_CACHE_DIR"] = str(cache)
    missing = subprocess.run(argv, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1
    assert "which a worker writes on its first start, and it was not there after 0.2 s" in missing.stderr
    assert "pass --model a folder with tokenizer files" in missing.stderr

    argv, env = torch_free_command(env_dir, "-c", reading, "120")
    env["PDSERVE_CACHE_DIR"] = str(cache)
    waiting = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # What the conversion publishes, tokenizer-wise: the GGUF's tokenizer, saved, and the marker last.
        staged = tmp_path / "staged"
        reference = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
        reference.save_pretrained(staged)
        (staged / "pdserve-converted.json").write_text(json.dumps(_marker_for(gguf_path)))
        (cache / "models").mkdir(parents=True)
        os.replace(staged, cache / "models" / DEFAULT_MODEL_ID)
        stdout, stderr = waiting.communicate(timeout=120)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    assert waiting.returncode == 0, stderr
    ids, loaded_torch, eos = json.loads(stdout.splitlines()[-1])
    assert ids == reference("The capital of France is")["input_ids"] == [504, 3575, 282, 4649, 314]
    assert (loaded_torch, eos) == (False, "<|im_end|>")
