"""LoRA through the cluster: the gRPC lora_name and the OpenAI model field select an adapter; the handoff carries it
(pushed and pulled KV), a local prefill runs under it; greedy float32 output equals transformers' with the adapter
merged, token for token. Unknown names are NOT_FOUND / 404, workers without LoRA refuse clearly, adapters load and
unload at run time, and load reports (and the Redis registry) say which adapters each worker holds."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import openai
import pytest

from pdserve.cluster_index import WorkerRegistry, connect
from pdserve.engine.types.lora import LoRAConfig
from pdserve.gateway.lora import LoRAAdapters, LoRAModule
from pdserve.gateway.tokenizer import load_tokenizer
from pdserve.protos.pdserve.v1 import generation_pb2
from tests.conftest import random_prompts
from tests.lora.conftest import write_adapter
from tests.lora.test_lora_engine import MAX_TOKENS, MergedOracle
from tests.support.cluster import REDIS_URL, ClusterOptions, InProcessCluster

LORA = LoRAConfig(max_loras=2, max_lora_rank=8)


@pytest.fixture(scope="module")
def oracle(llama_checkpoint: Path) -> MergedOracle:
    return MergedOracle(llama_checkpoint)


def _gateway_adapters(adapters: dict[str, Path], **kwargs: object) -> LoRAAdapters:
    return LoRAAdapters([LoRAModule(name, str(path)) for name, path in sorted(adapters.items())], **kwargs)  # type: ignore[arg-type]


def _request(prompt: list[int], lora_name: str = "") -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=prompt, lora_name=lora_name,
        sampling_params=generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))


def _tokens(responses: list[generation_pb2.GenerateResponse]) -> list[int]:
    return [token for response in responses for token in response.token_ids]


@pytest.mark.asyncio
@pytest.mark.parametrize("layout", ["push", "pull", "local", "colocated"])
async def test_adapters_and_base_through_the_cluster_equal_the_merged_models(
    llama_checkpoint: Path, adapters: dict[str, Path], oracle: MergedOracle, layout: str
) -> None:
    """Handoffs with the KV pushed and pulled, a prefill on the decode worker, one colocated worker: each request
    under its adapter (or the base) in one concurrent burst, then the same prompts again (prefix hits, per adapter)."""
    roles: dict[str, object] = dict(prefill_workers=0, decode_workers=0, colocated_workers=1) if layout == "colocated" else {}
    options = ClusterOptions(
        num_kv_blocks=128, lora_config=LORA, disaggregation="never" if layout == "local" else "always",
        gateway_args={"lora_adapters": _gateway_adapters(adapters), "kv_push": layout != "pull"}, **roles)  # type: ignore[arg-type]
    prompts = random_prompts([21, 40, 9, 33, 50, 17], seed=90)
    chosen = ["attn", "", "mlp", "attn", "mlp", ""]
    async with InProcessCluster(llama_checkpoint, options) as cluster:
        for attempt in range(2):
            results = await asyncio.gather(*(cluster.generate(_request(prompt, name))
                                             for prompt, name in zip(prompts, chosen)))
            for prompt, name, responses in zip(prompts, chosen, results):
                assert _tokens(responses) == oracle.generate(prompt, adapters[name] if name else None), (attempt, name)
            if attempt == 1 and layout != "local":
                # The second round finds each prompt cached under its own adapter on the prefill side.
                cached = [responses[-1].usage.cached_prompt_tokens for responses in results]
                assert cached == [len(prompt) - 1 - (len(prompt) - 1) % 16 for prompt in prompts]
        # The adapters changed the output (the comparison would pass trivially otherwise).
        assert oracle.generate(prompts[0], adapters["attn"]) != oracle.generate(prompts[0], None)
        assert oracle.generate(prompts[2], adapters["mlp"]) != oracle.generate(prompts[2], None)
        loads = await cluster.loads()
        # Each worker that ran a request under an adapter holds it (a local prefill leaves the prefill worker out).
        held = [[], ["attn", "mlp"]] if layout == "local" else [["attn", "mlp"]] * len(loads)
        assert [sorted(load.lora_adapters) for load in loads] == held
        await cluster.wait_idle()


@pytest.mark.asyncio
async def test_unknown_adapters_and_workers_without_lora_are_refused_clearly(
    llama_checkpoint: Path, adapters: dict[str, Path]
) -> None:
    prompt = random_prompts([12], seed=91)[0]
    # Workers without --enable-lora behind a gateway that names adapters.
    options = ClusterOptions(num_kv_blocks=64, gateway_args={"lora_adapters": _gateway_adapters(adapters)})
    async with InProcessCluster(llama_checkpoint, options) as cluster:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await cluster.generate(_request(prompt, "nope"))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert refused.value.details() == "lora_name 'nope' is not a LoRA adapter this server serves (served: attn, mlp)"
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await cluster.generate(_request(prompt, "attn"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == ("LoRA adapter 'attn': this worker serves no LoRA adapters "
                                           "(start it with --enable-lora)")
        assert len(_tokens(await cluster.generate(_request(prompt)))) == MAX_TOKENS  # still serving
        await cluster.wait_idle()
    # A gateway without LoRA: any lora_name is NOT_FOUND.
    async with InProcessCluster(llama_checkpoint, ClusterOptions(num_kv_blocks=64, lora_config=LORA)) as cluster:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await cluster.generate(_request(prompt, "attn"))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert "this server serves no LoRA adapters" in refused.value.details()


@pytest.mark.asyncio
async def test_openai_model_field_models_list_runtime_load_unload_and_404(
    llama_checkpoint: Path, chat_checkpoint: Path, adapters: dict[str, Path], oracle: MergedOracle, tmp_path: Path
) -> None:
    """Served from the tiny Llama with a tokenizer (the same weights): text prompts and chat."""
    late = write_adapter(llama_checkpoint, tmp_path / "late", 5, r=2, lora_alpha=4, target_modules=["v_proj", "up_proj"])
    too_big = write_adapter(llama_checkpoint, tmp_path / "big", 6, r=16, target_modules=["q_proj"])
    modules = [LoRAModule("attn", str(adapters["attn"])), LoRAModule("mlp", str(adapters["mlp"]), base_model_name="tiny")]
    options = ClusterOptions(
        num_kv_blocks=128, lora_config=LORA, http=True, tokenizer=load_tokenizer(str(chat_checkpoint)),
        redis=True, gateway_args={"lora_adapters": LoRAAdapters(modules, allow_runtime_updating=True)})
    prompt = random_prompts([24], seed=92)[0]
    tokenizer = load_tokenizer(str(chat_checkpoint))

    def expected(adapter: Path | None) -> str:
        # The byte tokenizer's output may end inside a character, which the stream holds back.
        return tokenizer.decode(oracle.generate(prompt, adapter)).removesuffix("\ufffd")

    async with InProcessCluster(chat_checkpoint, options) as cluster:
        assert cluster.gateway is not None
        base_url = f"http://127.0.0.1:{cluster.gateway.http_port}/v1"
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            listed = (await client.models.list()).data
            base_id = listed[0].id
            assert [(m.id, m.parent, m.root) for m in listed] == [  # type: ignore[attr-defined]
                (base_id, None, base_id), ("attn", base_id, str(adapters["attn"])), ("mlp", "tiny", str(adapters["mlp"]))]

            async def complete(model: str) -> str:
                reply = await client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                        temperature=0.0, extra_body={"ignore_eos": True})
                # An adapter's name is echoed; the base answers as the model it serves, whatever alias was sent.
                assert reply.model == (base_id if model == "pdserve" else model) and reply.usage is not None
                assert reply.usage.completion_tokens == MAX_TOKENS
                return reply.choices[0].text

            assert await complete("attn") == expected(adapters["attn"])
            assert await complete("mlp") == expected(adapters["mlp"])
            assert await complete(base_id) == await complete("pdserve") == expected(None)
            assert expected(adapters["attn"]) != expected(None) != expected(adapters["mlp"])
            chat = await client.chat.completions.create(model="mlp", messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=4, temperature=0.0)
            assert chat.model == "mlp" and chat.choices[0].message.content is not None

            with pytest.raises(openai.NotFoundError) as missing:
                await complete("nope")
            assert missing.value.status_code == 404
            assert missing.value.body == {"message": "The model `nope` does not exist.", "type": "invalid_request_error",
                                          "param": "model", "code": "model_not_found"}

            # Loading at run time: every worker reads it, then requests may name it.
            http = client._client  # the openai client's httpx client: vLLM's endpoints are not in its API
            loaded = await http.post(f"{base_url}/load_lora_adapter",
                                     json={"lora_name": "late", "lora_path": str(late)})
            assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'late' added successfully.")
            assert await complete("late") == expected(late)
            assert [m.id for m in (await client.models.list()).data][1:] == ["attn", "mlp", "late"]
            again = await http.post(f"{base_url}/load_lora_adapter", json={"lora_name": "late", "lora_path": str(late)})
            assert again.status_code == 400
            assert again.json()["error"]["message"] == "The lora adapter 'late' has already been loaded."
            big = await http.post(f"{base_url}/load_lora_adapter", json={"lora_name": "big", "lora_path": str(too_big)})
            assert big.status_code == 400
            assert big.json()["error"]["message"] == (f"LoRA adapter 'big' ({too_big}): rank 16 is above "
                                                     "--max-lora-rank 8")
            assert "big" not in [m.id for m in (await client.models.list()).data]
            bad = await http.post(f"{base_url}/load_lora_adapter", json={"lora_name": "x", "lora_path": 3})
            assert (bad.status_code, bad.json()["error"]["param"]) == (400, "lora_path")

            # The Redis registry records what each worker holds.
            await asyncio.sleep(0)
            redis = connect(REDIS_URL)
            try:
                async def registered() -> list[list[str]]:
                    statuses = await WorkerRegistry(redis, cluster.redis_prefix).live_statuses()  # type: ignore[arg-type]
                    return [sorted(status.lora_adapters) for status in statuses]

                for _ in range(100):
                    if await registered() == [["attn", "late", "mlp"]] * 2:
                        break
                    await asyncio.sleep(0.1)
                assert await registered() == [["attn", "late", "mlp"]] * 2
            finally:
                await redis.aclose()

            unloaded = await http.post(f"{base_url}/unload_lora_adapter", json={"lora_name": "late"})
            assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'late' removed successfully.")
            with pytest.raises(openai.NotFoundError):
                await complete("late")
            gone = await http.post(f"{base_url}/unload_lora_adapter", json={"lora_name": "late"})
            assert gone.status_code == 404
            assert gone.json()["error"]["message"] == "The lora adapter 'late' cannot be found."
            assert all("late" not in load.lora_adapters for load in await cluster.loads())
            assert await complete("attn") == expected(adapters["attn"])  # the others keep serving
        await cluster.wait_idle()


@pytest.mark.asyncio
async def test_runtime_updating_is_off_unless_enabled(llama_checkpoint: Path, adapters: dict[str, Path]) -> None:
    options = ClusterOptions(num_kv_blocks=64, lora_config=LORA, http=True,
                             gateway_args={"lora_adapters": _gateway_adapters(adapters)})
    async with InProcessCluster(llama_checkpoint, options) as cluster:
        assert cluster.gateway is not None
        base_url = f"http://127.0.0.1:{cluster.gateway.http_port}/v1"
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            response = await client._client.post(f"{base_url}/load_lora_adapter",
                                                 json={"lora_name": "x", "lora_path": str(adapters["attn"])})
            assert response.status_code == 404
            assert [m.id for m in (await client.models.list()).data][1:] == ["attn", "mlp"]


def test_lora_modules_flag_forms() -> None:
    from pdserve.cli import build_parser

    args = build_parser().parse_args([
        "gateway", "--lora-modules", "a=/x/a", json.dumps({"name": "b", "path": "/y", "base_model_name": "m"}),
        "--lora-modules", "c=/z=1"])
    assert args.lora_modules == [LoRAModule("a", "/x/a"), LoRAModule("b", "/y", base_model_name="m"),
                                 LoRAModule("c", "/z=1")]
    assert [module.to_arg() for module in args.lora_modules] == [
        "a=/x/a", '{"name": "b", "path": "/y", "base_model_name": "m"}', "c=/z=1"]
    for bad, message in (("a", "expected name=path"), ("=/p", "name must be a non-empty string"),
                         ('{"name": "a"}', "path must be a non-empty string"), ('{"name": "a", "path": "/p", "x": 1}',
                                                                               "unknown: ['x']")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["gateway", "--lora-modules", bad])
        from pdserve.gateway.lora import lora_module

        with pytest.raises(Exception, match=message.replace("[", r"\[").replace("]", r"\]")):
            lora_module(bad)
    with pytest.raises(ValueError, match="The lora adapter 'a' has already been loaded."):
        LoRAAdapters([LoRAModule("a", "/1"), LoRAModule("a", "/2")])


@pytest.mark.asyncio
async def test_a_stream_resumed_on_another_worker_keeps_its_adapter(
    llama_checkpoint: Path, adapters: dict[str, Path], oracle: MergedOracle
) -> None:
    """What the gateway sends when a stream's decode worker fails mid-stream (pdserve/gateway/migration.py): the
    prompt, the tokens sent so far and the adapter; the continuation is the merged model's."""
    from pdserve.gateway.migration import resume_request

    options = ClusterOptions(num_kv_blocks=128, lora_config=LORA,
                             gateway_args={"lora_adapters": _gateway_adapters(adapters)})
    prompt = random_prompts([26], seed=94)[0]
    async with InProcessCluster(llama_checkpoint, options) as cluster:
        assert cluster.gateway is not None
        lora = cluster.gateway.servicer.lora_of("mlp")
        expected = oracle.generate(prompt, adapters["mlp"])
        request = _request(prompt, "mlp")
        resumed = [piece async for piece in cluster.worker_stubs[1].Decode(
            resume_request(request, "moved", prompt, expected[:6], lora), timeout=30)]
        assert expected[:6] + _tokens(resumed) == expected  # type: ignore[arg-type]
        await cluster.wait_idle()
