"""LoRA through the real processes `pdserve up` starts (a prefill and a decode worker, the gateway with its OpenAI
HTTP API), its flags parsed as `pdserve up` parses them, with the official openai client: /v1/models, completions
and chat under two adapters and the base (greedy output equal to transformers' with the adapter merged), an adapter
loaded and unloaded at run time, the 404."""

from __future__ import annotations

import socket
from pathlib import Path

import openai
import pytest

from pdserve.cli import build_parser
from pdserve.gateway.tokenizer import load_tokenizer
from pdserve.up import up_engine_args, up_lora_gateway_args
from tests.conftest import random_prompts
from tests.e2e.conftest import cluster_config, start_cluster  # noqa: F401 - start_cluster is a fixture
from tests.lora.conftest import write_adapter
from tests.lora.test_lora_engine import MAX_TOKENS, MergedOracle


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.asyncio
async def test_adapters_load_unload_and_404_through_the_processes_of_pdserve_up(
    llama_checkpoint: Path, chat_checkpoint: Path, adapters: dict[str, Path], tmp_path: Path,
    start_cluster  # noqa: F811 - the fixture
) -> None:
    late = write_adapter(llama_checkpoint, tmp_path / "late", 7, r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"])
    args = build_parser().parse_args([
        "up", "--lora-modules", f"attn={adapters['attn']}", f"mlp={adapters['mlp']}", "--max-loras", "2",
        "--max-lora-rank", "8", "--allow-runtime-lora-updating"])
    http_port = _free_port()
    start_cluster(cluster_config(chat_checkpoint, http_port=http_port,
                                 engine_args=("--num-kv-blocks", "256", *up_engine_args(args)),
                                 gateway_args=up_lora_gateway_args(args)))
    oracle, tokenizer = MergedOracle(llama_checkpoint), load_tokenizer(str(chat_checkpoint))
    prompt = random_prompts([30], seed=93)[0]

    def expected(adapter: Path | None) -> str:
        # The byte tokenizer's output may end inside a character, which the stream holds back.
        return tokenizer.decode(oracle.generate(prompt, adapter)).removesuffix("\ufffd")

    base_url = f"http://127.0.0.1:{http_port}/v1"
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        listed = (await client.models.list()).data
        base = listed[0].id
        assert [(m.id, m.parent) for m in listed] == [(base, None), ("attn", base), ("mlp", base)]  # type: ignore[attr-defined]

        async def complete(model: str) -> str:
            reply = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                                    extra_body={"ignore_eos": True})
            return reply.choices[0].text

        assert await complete("attn") == expected(adapters["attn"])
        assert await complete("mlp") == expected(adapters["mlp"])
        assert await complete(base) == expected(None)
        assert expected(adapters["attn"]) != expected(None)
        for model in ("attn", "mlp", base):
            chat = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=6, temperature=0.0)
            assert chat.model == model and chat.usage is not None and chat.usage.completion_tokens >= 1

        with pytest.raises(openai.NotFoundError) as missing:
            await complete("late")
        assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]
        http = client._client  # vLLM's endpoints are not in the openai client's API
        loaded = await http.post(f"{base_url}/load_lora_adapter", json={"lora_name": "late", "lora_path": str(late)})
        assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'late' added successfully.")
        assert await complete("late") == expected(late)
        unloaded = await http.post(f"{base_url}/unload_lora_adapter", json={"lora_name": "late"})
        assert unloaded.status_code == 200
        with pytest.raises(openai.NotFoundError):
            await complete("late")
        assert await complete("mlp") == expected(adapters["mlp"])
