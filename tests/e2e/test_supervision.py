"""`pdserve up` as a user runs it, under failures: it restarts what dies and the cluster keeps serving.

One real `pdserve up` (2 prefill, 2 decode workers, its own Redis) serves the
tests of this module in order; each leaves it whole again. Children are
killed by the PIDs `pdserve up` prints. Every completed generation is checked
token for token against transformers' greedy output.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.cluster_index import WorkerRegistry, connect
from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.service_common.server import channel_options
from tests.conftest import EOS_TOKEN_ID, random_prompts
from tests.e2e.conftest import load
from tests.support.waiting import wait_until, wait_until_sync

REPO_ROOT = Path(__file__).resolve().parents[2]
FAULTS = Path(__file__).resolve().parent / "faults"
START_TIMEOUT_S = 180.0
WORKERS = ["decode-0", "decode-1", "prefill-0", "prefill-1"]
PREFIX = f"pdserve-test-{uuid.uuid4().hex}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Up:
    """A running `pdserve up` subprocess and what it printed (stdout and stderr in one file)."""

    def __init__(self, args: list[str], output: Path, env: dict[str, str] | None = None) -> None:
        self.output_path = output
        self.redis_url = args[args.index("--redis-url") + 1]
        with open(output, "wb") as sink:
            self.process = subprocess.Popen([sys.executable, "-m", "pdserve", "up", *args], stdout=sink,
                                            stderr=subprocess.STDOUT, env=env or _env(), cwd=REPO_ROOT)
        self.endpoint = ""
        self.addresses: dict[str, str] = {}
        self.metrics: dict[str, str] = {}

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
        """The first match of ``pattern`` (multiline) in the output, polled until ``timeout_s``."""

        def match_or_exited() -> re.Match[str] | bool:
            return re.search(pattern, self.output(), re.MULTILINE) or self.process.poll() is not None

        try:
            match = wait_until_sync(match_or_exited, f"{pattern!r} in the output of pdserve up", timeout_s)
        except AssertionError:
            match = None
        if not isinstance(match, re.Match):
            raise AssertionError(f"no {pattern!r} in the output of pdserve up "
                                 f"(exit status {self.process.returncode}):\n{self.output()[-4000:]}")
        return match

    def wait_serving(self) -> None:
        line = self.wait_for(r"^pdserve is serving .*$", START_TIMEOUT_S).group(0)
        self.wait_for(r"^  gateway: ", 10)
        self.endpoint = re.search(r" on (\S+) \(", line).group(1)
        self.metrics = dict(re.findall(r"(\S+) (http://\S+/metrics)", line))
        self.addresses = dict(re.findall(r"^  (\S+): (\S+) \(pid \d+\)$", self.output(), re.MULTILINE))

    def pid(self, name: str) -> int:
        """The PID of the newest ``name``: from the startup listing or its latest restart line."""
        pids = re.findall(rf"^(?:  {name}: \S+ \(pid (\d+)\)|{name} is back on \S+ \(pid (\d+)\))$", self.output(), re.MULTILINE)
        assert pids, f"pdserve up printed no PID for {name}"
        return int("".join(pids[-1]))

    def count(self, pattern: str) -> int:
        return len(re.findall(pattern, self.output(), re.MULTILINE))

    def stop(self) -> None:
        """SIGTERM (drained), then SIGKILL if it hangs; then any child it printed that still runs, by PID."""
        children = [int(pid) for pid in re.findall(r"\(pid (\d+)\)$", self.output(), re.MULTILINE)]
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid in children:
            if _is_our_child(pid):
                os.kill(pid, signal.SIGKILL)


def _is_our_child(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"pdserve" in cmdline or b"redis-server" in cmdline


def _env(**extra: str) -> dict[str, str]:
    # The worktree first, so every child imports this code; then the fault-injection hook.
    path = os.pathsep.join([str(REPO_ROOT), str(FAULTS), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def _greedy(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` for equal-length prompts in one batch, each cut after its EOS."""
    input_ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
    rows = out[:, input_ids.shape[1]:].tolist()
    return [row[: row.index(EOS_TOKEN_ID) + 1] if EOS_TOKEN_ID in row else row for row in rows]


@pytest.fixture(scope="module")
def model(llama_checkpoint: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def faults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def model_copy(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cluster's own copy of the checkpoint: the crash-loop test deletes it."""
    return Path(shutil.copytree(llama_checkpoint, tmp_path_factory.mktemp("model") / "tiny-llama"))


@pytest.fixture(scope="module")
def up(model_copy: Path, faults: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    # A port where nothing answers: `pdserve up` starts (and supervises) its own Redis there.
    # Each test restarts a child at most once: two restarts in the window are allowed, a third exit gives up.
    args = ["--model", str(model_copy), "--dtype", "float32", "--port", "0", "--no-http", "--prefill-workers", "2",
            "--decode-workers", "2", "--redis-url", f"redis://127.0.0.1:{_free_port()}/0", "--redis-prefix", PREFIX,
            "--num-kv-blocks", "256", "--metrics-port", "0", "--restart-delay", "1", "--unhealthy-after", "3",
            "--max-restarts", "2", "--restart-window", "600"]
    process = Up(args, tmp_path_factory.mktemp("up") / "output.txt",
                 _env(PDSERVE_TEST_ENGINE_FAULT_DIR=str(faults)))
    try:
        process.wait_serving()
        yield process
    finally:
        process.stop()


async def _generate(endpoint: str, prompt: list[int], max_tokens: int) -> tuple[grpc.StatusCode, list[int]]:
    params = generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    async with grpc.aio.insecure_channel(endpoint, options=channel_options()) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(
            generation_pb2.GenerateRequest(prompt_token_ids=prompt, sampling_params=params), timeout=60)
        return await _outcome(call)


async def _outcome(call: grpc.aio.UnaryStreamCall, tokens: list[int] | None = None) -> tuple[grpc.StatusCode, list[int]]:
    tokens = [] if tokens is None else tokens
    try:
        # read() throughout: grpc.aio forbids mixing it with iteration on one call.
        while (response := await call.read()) is not grpc.aio.EOF:
            tokens.extend(response.token_ids)
    except grpc.aio.AioRpcError as error:
        return error.code(), tokens
    return grpc.StatusCode.OK, tokens


async def _all_exact(up: Up, model: torch.nn.Module, seed: int, count: int = 4, max_tokens: int = 10) -> None:
    """``count`` concurrent requests all succeed with transformers' tokens."""
    prompts = random_prompts([48] * count, seed=seed)
    results = await asyncio.gather(*(_generate(up.endpoint, p, max_tokens) for p in prompts))
    assert results == [(grpc.StatusCode.OK, expected) for expected in _greedy(model, prompts, max_tokens)]


def _routed(up: Up, role: str, worker: str) -> float:
    """The gateway's count of requests it routed to ``worker``."""
    body = urllib.request.urlopen(up.metrics["gateway"], timeout=5).read().decode()
    match = re.search(rf'^pdserve_routing_decisions_total{{role="{role}",worker="{worker}"}} (\S+)$', body, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def _until_routed_to(up: Up, model: torch.nn.Module, role: str, worker: str, seed: int,
                           within_s: float = 30.0) -> None:
    """Send exact-checked batches until the gateway routes one request to ``worker``, for at most ``within_s``
    (a count of batches is no bound: on a loaded machine the gateway's next poll of a worker just back may
    come after twenty short batches)."""
    before = _routed(up, role, worker)
    deadline = time.monotonic() + within_s
    attempt = 0
    while time.monotonic() < deadline:
        await _all_exact(up, model, seed=seed + attempt)
        if _routed(up, role, worker) > before:
            return
        attempt += 1
    raise AssertionError(f"{worker} got no {role} traffic within {within_s:g} s of its restart ({attempt} batches)")


async def _epoch(up: Up, name: str) -> int:
    return (await load(up.addresses[name], name.split("-")[0])).epoch


def _scrape(up: Up, name: str) -> str:
    with urllib.request.urlopen(up.metrics[name], timeout=5) as response:
        assert response.status == 200
        return response.read().decode()


def test_every_process_serves_metrics_on_the_port_its_startup_line_lists(up: Up) -> None:
    assert sorted(up.metrics) == sorted(["gateway", *WORKERS])
    ports = [int(url.rsplit(":", 1)[1].split("/")[0]) for url in up.metrics.values()]
    assert len(set(ports)) == 5
    for name, url in up.metrics.items():
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200
            body = response.read().decode()
        assert ("pdserve_requests_total" if name == "gateway" else "pdserve_engine_requests_running") in body


@pytest.mark.asyncio
async def test_a_killed_decode_workers_streams_continue_elsewhere_and_it_rejoins_with_a_new_epoch(
    up: Up, model: torch.nn.Module
) -> None:
    max_tokens = 300
    # Prompts whose greedy run reaches max_tokens (no EOS), so every stream is still running at the kill.
    candidates = random_prompts([64] * 12, seed=80)
    expected_all = _greedy(model, candidates, max_tokens)
    chosen = [(p, e) for p, e in zip(candidates, expected_all) if len(e) == max_tokens][:6]
    assert len(chosen) == 6
    epoch_before = await _epoch(up, "decode-0")
    params = generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    async with grpc.aio.insecure_channel(up.endpoint, options=channel_options()) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        calls = [stub.Generate(generation_pb2.GenerateRequest(prompt_token_ids=p, sampling_params=params), timeout=60)
                 for p, _ in chosen]
        received: list[list[int]] = [[] for _ in calls]
        for call, tokens in zip(calls, received):  # every stream is decoding: the prefill token, then the decode's
            tokens.extend((await call.read()).token_ids)
            tokens.extend((await call.read()).token_ids)
        running = [(await load(up.addresses[name], "decode")).num_running for name in ("decode-0", "decode-1")]
        os.kill(up.pid("decode-0"), signal.SIGKILL)
        killed_at = time.monotonic()

        async def finish(call: grpc.aio.UnaryStreamCall, tokens: list[int]) -> tuple[grpc.StatusCode, list[int], float]:
            code, tokens = await _outcome(call, tokens)
            return code, tokens, time.monotonic() - killed_at

        streams = [asyncio.create_task(finish(c, t)) for c, t in zip(calls, received)]
        assert sum(running) == 6 and running[0] >= 1
        # The killed worker's streams move to decode-1 (pdserve/gateway/migration.py) and every stream
        # completes, token for token; new requests meanwhile are served exactly too.
        await _all_exact(up, model, seed=81)
        outcomes = await asyncio.gather(*streams)
    assert [code for code, _, _ in outcomes] == [grpc.StatusCode.OK] * 6
    assert [tokens for _, tokens, _ in outcomes] == [expected for _, expected in chosen]
    assert max(elapsed for _, _, elapsed in outcomes) < 30.0
    assert up.count(r"^decode-0 exited with status -9 \(SIGKILL\); restarting it in 1\.0 s") == 1
    up.wait_for(r"^decode-0 is back on ", 90)
    assert await _epoch(up, "decode-0") != epoch_before
    await _until_routed_to(up, model, "decode", "decode-0", seed=82)


@pytest.mark.asyncio
async def test_a_killed_prefill_worker_loses_no_request_and_rejoins(up: Up, model: torch.nn.Module) -> None:
    epoch_before = await _epoch(up, "prefill-0")
    prompts = random_prompts([48] * 16, seed=90)
    expected = _greedy(model, prompts, 12)
    first = [asyncio.create_task(_generate(up.endpoint, p, 12)) for p in prompts[:8]]
    done, _ = await asyncio.wait(first, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    assert done, "no request finished within 60 s"
    os.kill(up.pid("prefill-0"), signal.SIGKILL)
    # The rest arrive while prefill-0 is dead: every request is served, by prefill-1 when it must.
    rest = [asyncio.create_task(_generate(up.endpoint, p, 12)) for p in prompts[8:]]
    results = await asyncio.gather(*first, *rest)
    assert results == [(grpc.StatusCode.OK, tokens) for tokens in expected]
    up.wait_for(r"^prefill-0 is back on ", 90)
    assert await _epoch(up, "prefill-0") != epoch_before
    await _until_routed_to(up, model, "prefill", "prefill-0", seed=91)


@pytest.mark.asyncio
async def test_redis_started_by_up_is_restarted_and_serving_never_stops(up: Up, model: torch.nn.Module) -> None:
    recovered = asyncio.Event()

    async def serve_throughout() -> int:
        """Exact-checked batches back to back, from the kill until the registry is whole again."""
        rounds = 0
        while not recovered.is_set():
            await _all_exact(up, model, seed=100 + rounds)  # routed by load alone while the index is gone
            rounds += 1
        return rounds

    os.kill(up.pid("redis"), signal.SIGKILL)
    traffic = asyncio.create_task(serve_throughout())
    redis = connect(up.redis_url)
    try:
        await asyncio.to_thread(up.wait_for, r"^redis is back on ", 30)
        # Every worker re-registers in the new, empty Redis at its next heartbeat (every 3.3 s).

        async def live_ids() -> list[str]:
            return sorted(w.worker_id for w in await WorkerRegistry(redis, PREFIX).live_workers())

        live = await wait_until(live_ids, "every worker registered again", until=lambda live: live == WORKERS)
    finally:
        recovered.set()
        await redis.aclose()
        rounds = await traffic
    assert live == WORKERS
    assert rounds >= 1


@pytest.mark.asyncio
async def test_a_worker_whose_engine_died_exits_and_is_restarted(up: Up, model: torch.nn.Module, faults: Path) -> None:
    (faults / str(up.pid("decode-1"))).touch()  # its next engine step raises
    failures: list[grpc.StatusCode] = []
    for seed in range(110, 130):
        prompts = random_prompts([48] * 4, seed=seed)
        results = await asyncio.gather(*(_generate(up.endpoint, p, 10) for p in prompts))
        for (code, tokens), expected in zip(results, _greedy(model, prompts, 10)):
            if code == grpc.StatusCode.OK:
                assert tokens == expected
            else:
                failures.append(code)
        if up.count(r"^decode-1 exited"):
            break
    # Requests on decode-1 when its engine died: those it had streamed nothing of yet are retried on
    # decode-0 (their KV is still leased on the prefill worker), the others move there with what they had
    # streamed; all came back exact above (an UNAVAILABLE only if decode-0 failed them too). Then decode-1
    # exits and is restarted.
    assert set(failures) <= {grpc.StatusCode.UNAVAILABLE}
    up.wait_for(r"^decode-1 exited with status 3 \(its engine thread died\); restarting it in ", 10)
    up.wait_for(r"^decode-1 is back on ", 90)
    await _all_exact(up, model, seed=130)
    assert "pdserve_engine_requests_running" in _scrape(up, "decode-1")  # on the port its first start bound


@pytest.mark.asyncio
async def test_a_hung_worker_is_killed_after_failing_its_health_checks_and_restarted(
    up: Up, model: torch.nn.Module
) -> None:
    os.kill(up.pid("prefill-1"), signal.SIGSTOP)  # alive, answering nothing
    up.wait_for(r"^prefill-1 has not been serving for \d+ s \(health NOT_SERVING or no answer\); killing it$", 30)
    up.wait_for(r"^prefill-1 exited with status -9 \(SIGKILL\); killed: not serving for \d+ s; restarting it in ", 10)
    await _all_exact(up, model, seed=140)
    up.wait_for(r"^prefill-1 is back on ", 90)
    await _all_exact(up, model, seed=141)


@pytest.mark.asyncio
async def test_a_killed_gateway_comes_back_on_its_port(up: Up, model: torch.nn.Module) -> None:
    os.kill(up.pid("gateway"), signal.SIGKILL)
    up.wait_for(r"^gateway exited with status -9 \(SIGKILL\); restarting it in ", 10)
    up.wait_for(r"^gateway is back on ", 90)
    await _all_exact(up, model, seed=150)  # the same endpoint as before
    assert "pdserve_requests_total" in _scrape(up, "gateway")  # and the same metrics port

# Last of the shared cluster's tests: it ends `pdserve up`.
def test_a_crash_loop_is_given_up_on_with_one_error_and_a_non_zero_exit(up: Up, model_copy: Path) -> None:
    shutil.rmtree(model_copy)  # from now on decode-0 cannot start
    os.kill(up.pid("decode-0"), signal.SIGKILL)
    assert up.process.wait(timeout=90) == 1
    output = up.output()
    # Its restarts fail at once, each logged with the reason from its log; the third exit in the window gives up.
    assert f"    | pdserve: error: Model '{model_copy}' is neither a local folder" in output
    error = [line for line in output.splitlines() if line.startswith("pdserve: error: ")]
    assert error == ["pdserve: error: decode-0 exited with status 2 (2 restarts within 600 s already); giving up: fix "
                     "the cause its log ends with (below), or allow more with --max-restarts / --restart-window"]
    assert output.rstrip().endswith("pdserve stopped")


def _run(args: list[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, env=_env(),
                          cwd=REPO_ROOT, timeout=timeout_s)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--port", "the gateway's gRPC port) is already in use: stop what holds it or choose another with --port"),
        ("--http-port", "the gateway's HTTP port) is already in use: stop what holds it or choose another with --http-port"),
        ("--metrics-port", "gateway's metrics port) is already in use: stop what holds it or choose another with --metrics-port"),
    ],
    ids=["port", "http-port", "metrics-port"],
)
def test_up_on_a_taken_port_fails_with_one_line_naming_the_flag(flag: str, message: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["up", "--port", "0", "--redis-url", f"redis://127.0.0.1:{_free_port()}/0", flag, str(port)]
        if flag != "--http-port":
            args.append("--no-http")
        result = _run(args)
    assert result.returncode == 1
    assert result.stderr == f"pdserve: error: port {port} on 127.0.0.1 ({message}\n"


def _port_with_three_free_below() -> socket.socket:
    """A listening socket on a loopback port whose three ports below are free (an ephemeral port's neighbours
    are now and then taken by other connections: another port is tried then)."""
    from pdserve.service_common.server import port_free

    for _ in range(50):
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        if all(port_free("127.0.0.1", p) for p in range(port - 3, port)):
            return taken
        taken.close()
    raise AssertionError("no loopback port with three free ports below it in 50 tries")


def test_the_port_check_names_the_process_whose_metrics_port_is_taken() -> None:
    from pdserve.launcher import ClusterConfig, LocalCluster, StartupError

    with _port_with_three_free_below() as taken:
        port = taken.getsockname()[1]
        # The gateway gets base, then prefill-0, prefill-1, decode-0: decode-0's is the taken one.
        cluster = LocalCluster(ClusterConfig(port=0, prefill_workers=2, metrics_port=port - 3, redis_url=None))
        try:
            with pytest.raises(StartupError) as caught:
                cluster.start()
        finally:
            cluster.stop()
    assert cluster.processes == []
    assert cluster.metrics_ports == {"gateway": port - 3, "prefill-0": port - 2, "prefill-1": port - 1, "decode-0": port}
    assert str(caught.value) == (f"port {port} on 127.0.0.1 (decode-0's metrics port) is already in use: stop what "
                                 "holds it or choose another with --metrics-port")


def test_up_with_a_bad_model_fails_with_the_workers_one_line_reason(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = _run(["up", "--port", "0", "--no-http", "--model", str(missing),
                   "--redis-url", f"redis://127.0.0.1:{_free_port()}/0"])
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"pdserve: error: prefill-0 exited with status 2 before serving: Model '{missing}' "
                                    "is neither a local folder nor a downloadable Hugging Face hub id")


def test_single_role_commands_fail_with_one_line(llama_checkpoint: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        gateway = _run(["gateway", "--port", str(port), "--model", str(llama_checkpoint),
                        "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:1"])
    assert (gateway.returncode, gateway.stderr) == (
        1, f"pdserve: error: could not serve on 127.0.0.1:{port}: the port is in use; stop what holds it or choose "
           "another with --port\n")
    decode = _run(["decode", "--model", "/nonexistent"])
    assert decode.returncode == 2
    assert decode.stderr.count("\n") == 1
    assert decode.stderr.startswith("pdserve: error: Model '/nonexistent' is neither a local folder")
