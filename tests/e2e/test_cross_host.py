"""Across hosts without a cluster: Redis, two prefill workers, two decode workers and the gateway, each in its
own network namespace (what a pod is), running the commands of deploy/kubernetes/base with TLS everywhere
and the bearer token, reached only at their own addresses.

Shown: exact greedy outputs (transformers' generate on the tiny checkpoint), prefix routing to the worker
that holds a prefix, and a killed decode worker whose streams fail fast while traffic moves on, then
whose restart (same host, same address, new epoch) takes traffic again.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml

from pdserve.cluster_index import WorkerRegistry, connect
from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.service_common.security import TlsConfig, bearer_metadata, open_channel
from pdserve.service_common.server import LIVENESS_SERVICE, channel_options
from tests.conftest import Oracle, greedy_continuations, random_prompts
from tests.deploy.manifests import KUBERNETES_DIR
from tests.support.netns import Host, Hosts, cannot_create_reason, stop
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
TLS_DIR, AUTH_DIR = "/etc/pdserve/tls/", "/etc/pdserve/auth/"
MAX_TOKENS = 12
LONG_RUN = 300

_reason = cannot_create_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=f"SKIPPED, not passed: no network namespaces here ({_reason})")


def _manifest_command(role: str) -> tuple[list[str], dict[str, str]]:
    """The container's command and args in deploy/kubernetes/base/ROLE.yaml, and its ConfigMap's values."""
    deployment = next(d for d in yaml.safe_load_all((KUBERNETES_DIR / "base" / f"{role}.yaml").read_text())
                      if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    kustomization = yaml.safe_load((KUBERNETES_DIR / "base" / "kustomization.yaml").read_text())
    [config] = [g for g in kustomization["configMapGenerator"] if g["name"] == "pdserve-config"]
    values = dict(literal.split("=", 1) for literal in config["literals"])
    return [*container["command"], *container["args"]], values


@dataclass
class CrossHostCluster:
    hosts: Hosts
    directory: Path
    redis_prefix: str
    redis_url: str  # as this (test) host reaches it
    gateway: Host
    workers: dict[str, Host]
    token: str
    client_tls: TlsConfig
    env: dict[str, str]
    checkpoint: Path

    @property
    def endpoint(self) -> str:
        return f"{self.gateway.address}:50051"

    def spawn(self, host: Host, role: str, extra: list[str]) -> tuple[subprocess.Popen, Path]:
        """Start ROLE on ``host`` with the manifest's command; the process and its ready file."""
        command, values = _manifest_command(role)
        values.pop("PDSERVE_CACHE_DIR")  # the machine's cache: the CPU kernel is compiled once, not per run
        values.update(PDSERVE_REDIS_URL=f"redis://{self.hosts.hosts['redis'].address}:6379/0",
                      PDSERVE_REDIS_PREFIX=self.redis_prefix, PDSERVE_DRAIN_SECONDS="5",
                      POD_IP=host.address, POD_NAME=host.name)
        argv = []
        for part in command:
            for name, value in values.items():
                part = part.replace(f"$({name})", value)
            part = part.replace(TLS_DIR, f"{self.directory}/tls/").replace(AUTH_DIR, f"{self.directory}/auth/")
            argv.append(part)
        assert argv[0] == "pdserve" and "$(" not in " ".join(argv), argv
        ready = self.directory / f"{host.name}.ready"
        ready.unlink(missing_ok=True)
        env = {**self.env, **{k: v for k, v in values.items() if not k.startswith("POD_")}}
        process = self.hosts.start(host, [sys.executable, "-m", "pdserve", *argv[1:], *extra, "--ready-file", str(ready)],
                                   env, self.directory / f"{host.name}.log")
        return process, ready

    def wait_ready(self, host: Host, process: subprocess.Popen, ready: Path, timeout_s: float = 360.0) -> None:
        # Generous: five processes import torch at once on CI's two cores, often shared.
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                log = (self.directory / f"{host.name}.log").read_text()[-3000:]
                stop(process)
                raise AssertionError(f"{host.name} did not start (exit {process.poll()}):\n{log}")
            time.sleep(0.1)

    def start(self, host: Host, role: str, extra: list[str]) -> subprocess.Popen:
        process, ready = self.spawn(host, role, extra)
        self.wait_ready(host, process, ready)
        return process

    def spawn_worker(self, name: str) -> tuple[subprocess.Popen, Path]:
        role = name.split("-")[0]
        return self.spawn(self.workers[name], role, ["--model", str(self.checkpoint), "--dtype", "float32",
                                                     "--num-kv-blocks", "256", "--torch-threads", "1"])

    def start_worker(self, name: str) -> subprocess.Popen:
        process, ready = self.spawn_worker(name)
        self.wait_ready(self.workers[name], process, ready)
        return process

    def channel(self) -> grpc.aio.Channel:
        return open_channel(self.endpoint, self.client_tls, channel_options())


def _make_pki(directory: Path) -> None:
    """What deploy/kubernetes/gen-secrets.sh makes for a cluster, here into directory/tls and directory/auth."""
    secrets = directory / "secrets"
    env = {**os.environ, "PDSERVE_SECRETS_DIR": str(secrets)}
    subprocess.run([str(KUBERNETES_DIR / "gen-secrets.sh")], env=env, check=True, capture_output=True)
    (directory / "tls").mkdir()
    (directory / "auth").mkdir()
    for name in ("ca.crt", "tls.crt", "tls.key"):
        (directory / "tls" / name).write_bytes((secrets / name).read_bytes())
    (directory / "auth" / "token").write_bytes((secrets / "auth-token").read_bytes())


@pytest.fixture(scope="module")
def cross_host(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CrossHostCluster]:
    directory = tmp_path_factory.mktemp("cross-host")
    _make_pki(directory)
    hosts = Hosts()
    try:
        redis_host = hosts.add("redis")
        workers = {name: hosts.add(name) for name in ("prefill-0", "prefill-1", "decode-0", "decode-1")}
        gateway = hosts.add("gateway")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PDSERVE_AUTH_TOKEN": ""}
        cluster = CrossHostCluster(
            hosts, directory, f"pdserve-test-{uuid.uuid4().hex}", f"redis://{redis_host.address}:6379/0",
            gateway, workers, (directory / "auth" / "token").read_text(),
            TlsConfig(ca_file=str(directory / "tls" / "ca.crt"), server_name="pdserve-gateway"), env, llama_checkpoint,
        )
        hosts.start(redis_host, ["redis-server", "--bind", redis_host.address, "--port", "6379", "--save", "",
                                 "--appendonly", "no", "--protected-mode", "no"], env, directory / "redis.log")
        # Started together, as a rollout starts pods: each loads its model while the others do.
        started = {name: cluster.spawn_worker(name) for name in workers}
        for name, (process, ready) in started.items():
            cluster.wait_ready(workers[name], process, ready)
        cluster.start(gateway, "gateway", ["--model", str(llama_checkpoint), "--wait-for-workers", "60"])
        yield cluster
    finally:
        hosts.close()


async def _generate(cluster: CrossHostCluster, prompt: list[int], params: generation_pb2.SamplingParams,
                    metadata: tuple = ()) -> list[generation_pb2.GenerateResponse]:
    async with cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params)
        return [r async for r in stub.Generate(request, timeout=60, metadata=metadata or bearer_metadata(cluster.token))]


def _tokens(responses: list[generation_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


GREEDY = generation_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.mark.asyncio
async def test_greedy_outputs_across_hosts_over_tls_equal_transformers(cross_host: CrossHostCluster,
                                                                      llama_checkpoint: Path) -> None:
    oracle = Oracle(llama_checkpoint)
    # Every worker registered under its own host's address, as a pod does under its pod IP.
    redis = connect(cross_host.redis_url)
    try:
        registered = {w.worker_id: w.address for w in await WorkerRegistry(redis, cross_host.redis_prefix).live_workers()}
    finally:
        await redis.aclose()
    assert registered == {name: f"{host.address}:{50061 if name.startswith('prefill') else 50071}"
                          for name, host in cross_host.workers.items()}
    for prompt in random_prompts([5, 37, 90], seed=150):
        responses = await _generate(cross_host, prompt, GREEDY)
        assert _tokens(responses) == oracle.generate(prompt, MAX_TOKENS)


@pytest.mark.asyncio
async def test_the_gateway_refuses_plaintext_and_a_missing_token_and_probes_answer_in_plaintext(
    cross_host: CrossHostCluster,
) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _generate(cross_host, [1, 2, 3], GREEDY, metadata=(("authorization", "Bearer wrong"),))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with grpc.aio.insecure_channel(cross_host.endpoint) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # the TLS port does not speak plaintext
    # What the kubelet calls: the health-only plaintext ports of every "pod".
    for host, port in [(cross_host.gateway, 50052), *((h, 50062 if n.startswith("prefill") else 50072)
                                                     for n, h in cross_host.workers.items())]:
        async with grpc.aio.insecure_channel(f"{host.address}:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", LIVENESS_SERVICE):
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, (host.name, service)


@pytest.mark.asyncio
async def test_shared_prefixes_are_routed_to_the_host_that_holds_them(cross_host: CrossHostCluster,
                                                                       llama_checkpoint: Path) -> None:
    oracle = Oracle(llama_checkpoint)
    shared = random_prompts([160], seed=151)[0]  # 10 full blocks
    suffixes = random_prompts([5, 12, 20, 9], seed=152)
    first = await _generate(cross_host, shared + suffixes[0], GREEDY)
    assert first[-1].usage.cached_prompt_tokens == 0
    assert _tokens(first) == oracle.generate(shared + suffixes[0], MAX_TOKENS)
    # Publishing to the index is asynchronous: wait until a follow-up finds the prefix, then every
    # later one must too (with two prefill hosts, load alone would send some to the other).
    await wait_until(lambda: _generate(cross_host, shared + suffixes[1], GREEDY), "a prefix hit",
                     until=lambda responses: responses[-1].usage.cached_prompt_tokens == 160)
    for suffix in suffixes[2:]:
        responses = await _generate(cross_host, shared + suffix, GREEDY)
        assert responses[-1].usage.cached_prompt_tokens == 160
        assert _tokens(responses) == oracle.generate(shared + suffix, MAX_TOKENS)


async def _routed_to(cluster: CrossHostCluster, role: str, worker: str) -> float:
    """The gateway's routing counter for ``worker``, scraped from its metrics port across the bridge."""
    reader, writer = await asyncio.open_connection(cluster.gateway.address, 9090)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: gateway\r\n\r\n")
    body = (await reader.read()).decode()
    writer.close()
    line = f'pdserve_routing_decisions_total{{role="{role}",worker="{worker}"}} '
    return next((float(row[len(line):]) for row in body.splitlines() if row.startswith(line)), 0.0)


@pytest.mark.asyncio
async def test_a_killed_decode_hosts_streams_continue_on_the_other_and_its_restart_takes_traffic_again(
    cross_host: CrossHostCluster, llama_checkpoint: Path
) -> None:
    oracle = Oracle(llama_checkpoint)
    prompts = random_prompts([30, 41, 52, 63], seed=153)
    # Long enough that every stream still runs when its host dies (the tiny model decodes fast).
    long_run = generation_pb2.SamplingParams(max_tokens=LONG_RUN, temperature=0.0, ignore_eos=True)
    decode_hosts = ("decode-0", "decode-1")
    routed_before = {name: await _routed_to(cross_host, "decode", name) for name in decode_hosts}
    async with cross_host.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        metadata = bearer_metadata(cross_host.token)
        calls = [stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=long_run),
                               timeout=120, metadata=metadata) for p in prompts]
        received: list[list[int]] = [[] for _ in calls]
        for call, tokens in zip(calls, received):  # every stream is decoding before the crash
            tokens.extend((await call.read()).token_ids)
            tokens.extend((await call.read()).token_ids)
        # The victim is a decode host these streams run on (the router spreads them by load).
        routed = {name: await _routed_to(cross_host, "decode", name) - routed_before[name] for name in decode_hosts}
        assert sum(routed.values()) >= len(prompts)
        victim_name = "decode-0" if routed["decode-0"] >= 1 else "decode-1"
        cross_host.workers[victim_name].processes[-1].kill()  # SIGKILL: no drain, no deregistration

        async def rest(call: grpc.aio.UnaryStreamCall, tokens: list[int]) -> None:
            while (response := await call.read()) is not grpc.aio.EOF:
                tokens.extend(response.token_ids)

        await asyncio.wait_for(asyncio.gather(*(rest(c, t) for c, t in zip(calls, received))), 100)
    # The killed pod's streams went on on the other decode host (pdserve/gateway/migration.py), token for token.
    assert received == greedy_continuations(llama_checkpoint, prompts, LONG_RUN)
    # The surviving decode host serves new requests, exactly.
    for prompt in prompts:
        assert _tokens(await _generate(cross_host, prompt, GREEDY)) == oracle.generate(prompt, MAX_TOKENS)

    # The restarted worker (what Kubernetes does after a crash: same pod IP here) registers with a new
    # epoch and takes traffic again: concurrent requests spread over both decode hosts.
    before = await _routed_to(cross_host, "decode", victim_name)
    cross_host.start_worker(victim_name)

    async def spread() -> float:
        batch = random_prompts([20, 24, 28, 32], seed=154)
        results = await asyncio.gather(*(_generate(cross_host, p, GREEDY) for p in batch))
        for prompt, responses in zip(batch, results):
            assert _tokens(responses) == oracle.generate(prompt, MAX_TOKENS)
        return await _routed_to(cross_host, "decode", victim_name)

    after = await wait_until(spread, f"the restarted {victim_name} to be routed to", until=lambda count: count > before)
    assert after > before


@pytest.mark.asyncio
async def test_a_partitioned_decode_hosts_streams_move_and_healed_it_holds_nothing_of_them(
    cross_host: CrossHostCluster, llama_checkpoint: Path
) -> None:
    """The decode host's cable is cut (its packets dropped, its process running): the gateway's keepalive drops
    its connection and its streams continue on the other decode host, token for token; once the cable is back,
    the worker finds those calls gone, ends them and frees their blocks."""
    prompts = random_prompts([33, 44, 55, 66], seed=155)
    long_run = generation_pb2.SamplingParams(max_tokens=LONG_RUN, temperature=0.0, ignore_eos=True)
    decode_hosts = ("decode-0", "decode-1")
    routed_before = {name: await _routed_to(cross_host, "decode", name) for name in decode_hosts}
    async with cross_host.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        metadata = bearer_metadata(cross_host.token)
        calls = [stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=long_run),
                               timeout=120, metadata=metadata) for p in prompts]
        received: list[list[int]] = [[] for _ in calls]
        for call, tokens in zip(calls, received):
            tokens.extend((await call.read()).token_ids)
            tokens.extend((await call.read()).token_ids)
        routed = {name: await _routed_to(cross_host, "decode", name) - routed_before[name] for name in decode_hosts}
        victim = cross_host.workers["decode-0" if routed["decode-0"] >= 1 else "decode-1"]
        cross_host.hosts.partition(victim)
        try:
            async def rest(call: grpc.aio.UnaryStreamCall, tokens: list[int]) -> None:
                while (response := await call.read()) is not grpc.aio.EOF:
                    tokens.extend(response.token_ids)

            await asyncio.wait_for(asyncio.gather(*(rest(c, t) for c, t in zip(calls, received))), 100)
        finally:
            cross_host.hosts.partition(victim, cut=False)
    assert received == greedy_continuations(llama_checkpoint, prompts, LONG_RUN)
    assert "moving gw-" in (cross_host.directory / "gateway.log").read_text()
    redis = connect(cross_host.redis_url)
    try:
        async def victim_load() -> dict:
            statuses = await WorkerRegistry(redis, cross_host.redis_prefix).live_statuses("decode")
            return next((dict(s.load) for s in statuses if s.info.address.startswith(victim.address)), {})

        load = await wait_until(victim_load, f"the healed {victim.name} to hold nothing of the moved streams", 60,
                                until=lambda load: load.get("num_running") == 0
                                and load.get("num_free_blocks") == load.get("num_total_blocks"))
        assert load["num_waiting"] == 0
    finally:
        await redis.aclose()
