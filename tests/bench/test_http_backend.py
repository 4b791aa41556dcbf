"""``pdserve bench --backend http``: the gateway's OpenAI API, streamed, measured like the gRPC API."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from pdserve.bench.backend import BackendRequest
from pdserve.bench.cli import bench
from pdserve.bench.config import BenchConfig
from pdserve.bench.http_backend import to_json
from pdserve.bench.runner import SamplingConfig
from pdserve.bench.workload import WorkloadConfig
from pdserve.service_common.server import ServerConfig
from tests.support.cluster import ClusterOptions, InProcessCluster

TOKEN = "bench-token"


def _config(backend: str, target: str, result_json: Path, **workload: object) -> BenchConfig:
    return BenchConfig(
        workload=WorkloadConfig(**{"kind": "random", "num_prompts": 6, "input_len": 24, "output_len": 8, "seed": 3,
                                   **workload}),
        backend=backend,
        target=target,
        sampling=SamplingConfig(temperature=0.0, ignore_eos=True, timeout_s=60.0),
        result_json=result_json,
        show_progress=False,
    )


@pytest.mark.asyncio
async def test_http_and_grpc_runs_of_one_workload_count_the_same_tokens(llama_checkpoint: Path, tmp_path: Path) -> None:
    options = ClusterOptions(num_kv_blocks=64, http=True, gateway_server=ServerConfig(auth_token=TOKEN))
    async with InProcessCluster(llama_checkpoint, options) as cluster:
        assert cluster.gateway is not None
        http_target = f"127.0.0.1:{cluster.gateway.http_port}"
        documents = {}
        for backend, target in (("grpc", cluster.gateway_address), ("http", http_target)):
            path = tmp_path / f"{backend}.json"
            assert await bench(_config(backend, target, path), out=io.StringIO(), auth_token=TOKEN) == 0
            documents[backend] = json.loads(path.read_text())
        # Without the token the HTTP API refuses to describe the model: the run ends at once.
        out = io.StringIO()
        assert await bench(_config("http", http_target, tmp_path / "refused.json"), out=out) == 1
    http, grpc = documents["http"], documents["grpc"]
    # /v1/models says what the benchmark needs to draw random prompts.
    assert http["model"] == grpc["model"] and http["model"]["vocab_size"] == 512
    (http_run,), (grpc_run,) = http["runs"], grpc["runs"]
    for run in (http_run, grpc_run):
        metrics = run["metrics"]
        assert (metrics["completed"], metrics["failed"]) == (6, 0)
        assert (metrics["total_prompt_tokens"], metrics["total_output_tokens"]) == (6 * 24, 6 * 8)
        # Every chunk's token count comes from the stream (continuous usage over HTTP), summing to max_tokens.
        assert all(sum(r["chunk_tokens"]) == 8 and min(r["chunk_tokens"]) >= 1 for r in run["requests"])
        assert metrics["itl"]["count"] == sum(len(r["chunk_times"]) - 1 for r in run["requests"])
        assert metrics["tpot"]["count"] == 6


@pytest.mark.asyncio
async def test_a_refused_http_request_is_recorded_by_its_status(llama_checkpoint: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "requests.jsonl"
    # Token 600 is past the tiny model's 512-token vocabulary: the gateway answers 400.
    dataset.write_text('{"prompt_token_ids": [20, 21, 22], "output_len": 3}\n{"prompt_token_ids": [600], "output_len": 3}\n')
    options = ClusterOptions(num_kv_blocks=64, http=True)
    async with InProcessCluster(llama_checkpoint, options) as cluster:
        assert cluster.gateway is not None
        path = tmp_path / "result.json"
        config = _config("http", f"127.0.0.1:{cluster.gateway.http_port}", path, kind="file", dataset=dataset,
                         num_prompts=2)
        assert await bench(config, out=io.StringIO()) == 0
    (run,) = json.loads(path.read_text())["runs"]
    metrics = run["metrics"]
    assert (metrics["completed"], metrics["failed"], metrics["errors_by_code"]) == (1, 1, {"400": 1})
    assert "600" in metrics["first_errors"][0]
    assert (metrics["total_prompt_tokens"], metrics["total_output_tokens"]) == (3, 3)


def test_the_request_body_streams_with_usage_on_every_chunk() -> None:
    request = BackendRequest(request_id="r-1", prompt_token_ids=(5, 6), prompt=None, max_tokens=4, temperature=0.0,
                             ignore_eos=True, seed=9, timeout_s=5.0)
    assert to_json(request, "m") == {
        "prompt": [5, 6], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "model": "m", "seed": 9,
    }
