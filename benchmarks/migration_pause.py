"""The pause a stream migration adds, against the time to first token of a prompt of the same length.

    python -m benchmarks.migration_pause [--lengths 1024 4096] [--tokens-before 20] [--repeats 2]

A local cluster of the default model (`pdserve up`'s processes: 1 prefill, 2 decode workers, prefills on the
prefill worker), greedy streams of seeded random prompts. For each prompt length: ``ttft`` is the time from the
request to its first token on an undisturbed stream; ``pause`` is, on another stream of a fresh prompt of that
length, the gap between the last token before a kill -9 of the decode worker serving it (after ``--tokens-before``
tokens) and the first token after, which the other decode worker sends once it has computed the prompt and the
tokens already sent (nothing of it is cached there). The killed worker is started again between runs. Best of
``--repeats`` each; the ratio pause / ttft.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import grpc

MAX_TOKENS = 60


async def _ttft(stub, prompt: list[int]) -> float:  # noqa: ANN001
    from pdserve.protos.pdserve.v1 import generation_pb2

    params = generation_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    call = stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params), timeout=600)
    await call.read()
    elapsed = time.perf_counter() - started
    await _drain(call)
    return elapsed


async def _drain(call) -> None:  # noqa: ANN001
    while await call.read() is not grpc.aio.EOF:
        pass


async def _serving_decode(cluster) -> str:  # noqa: ANN001
    """The name of the decode worker with a running sequence."""
    from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc

    for index, address in enumerate(cluster.decode_addresses):
        async with grpc.aio.insecure_channel(address) as channel:
            report = await worker_pb2_grpc.DecodeWorkerStub(channel).Load(worker_pb2.LoadRequest(), timeout=5)
        if report.num_running:
            return f"decode-{index}"
    raise RuntimeError("no decode worker runs the stream")


async def _pause(stub, cluster, prompt: list[int], tokens_before: int) -> float:  # noqa: ANN001
    from pdserve.protos.pdserve.v1 import generation_pb2

    params = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    call = stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params), timeout=600)
    received = 0
    while received < tokens_before:
        received += len((await call.read()).token_ids)
    victim = await _serving_decode(cluster)
    last = time.perf_counter()
    cluster.kill(victim)
    await call.read()
    pause = time.perf_counter() - last
    await _drain(call)
    cluster.respawn(victim)
    while not cluster.is_ready(victim):
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.5)  # the gateway's load poll brings it back into rotation
    return pause


async def run(args: argparse.Namespace) -> list[dict[str, float]]:
    from pdserve.launcher import ClusterConfig, LocalCluster
    from pdserve.protos.pdserve.v1 import generation_pb2_grpc

    config = ClusterConfig(port=0, decode_workers=2, disaggregation="always", redis_url=None,
                           engine_args=("--max-model-len", str(max(args.lengths) + 2 * MAX_TOKENS)))
    rng = random.Random(0)
    rows = []
    with LocalCluster(config) as cluster:
        async with grpc.aio.insecure_channel(cluster.endpoint) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            await _ttft(stub, [rng.randrange(100, 40000) for _ in range(64)])  # warm up
            for length in args.lengths:
                def prompt() -> list[int]:
                    return [rng.randrange(100, 40000) for _ in range(length)]

                ttft = min([await _ttft(stub, prompt()) for _ in range(args.repeats)])
                pause = min([await _pause(stub, cluster, prompt(), args.tokens_before) for _ in range(args.repeats)])
                rows.append({"length": length, "ttft_s": ttft, "pause_s": pause, "ratio": pause / ttft})
                print(f"{length:6d} tokens: time to first token {ttft:.3f} s, migration pause {pause:.3f} s "
                      f"({pause / ttft:.2f}x)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--tokens-before", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
