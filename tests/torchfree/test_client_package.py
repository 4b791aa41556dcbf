"""The client package on its own: built from ./client, installed into a fresh venv that holds only
grpcio and protobuf (copied from this environment, so nothing is downloaded), talking to a live gateway."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from tests.conftest import Oracle, random_prompts
from tests.support.cluster import ClusterOptions, InProcessCluster
from tests.torchfree.environment import REPO_ROOT

# What a request from the fresh venv prints: the client's result and where it was imported from.
_CLIENT_SCRIPT = """
import json, sys
import pdserve_client
from pdserve_client import Client, SamplingOptions
with Client(sys.argv[1], timeout=60) as client:
    completion = client.generate(json.loads(sys.argv[2]), SamplingOptions(max_tokens=int(sys.argv[3]), temperature=0.0))
print(json.dumps({
    "file": pdserve_client.__file__,
    "token_ids": list(completion.token_ids),
    "finish_reason": completion.finish_reason,
    "usage": [completion.usage.prompt_tokens, completion.usage.completion_tokens],
    "heavy": sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "pdserve", "transformers")),
}))
"""


def _build_wheel(source: Path, out_dir: Path) -> Path:
    # Without build isolation, so no build requirement is fetched; the test extra has setuptools.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(out_dir), str(source)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = out_dir.glob("*.whl")
    return wheel


def _copy_distribution(name: str, site_dir: Path, done: set[str]) -> None:
    """``name`` and what it requires, copied file by file (with their dist-info) into ``site_dir``."""
    distribution = importlib.metadata.distribution(name)
    key = distribution.metadata["Name"].lower()
    if key in done:
        return
    done.add(key)
    for file in distribution.files or []:
        if file.parts and file.parts[0] != ".." and "__pycache__" not in file.parts:
            target = site_dir / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(distribution.locate_file(file), target)
    from packaging.requirements import Requirement

    for line in distribution.requires or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            _copy_distribution(requirement.name, site_dir, done)


def _pip_list(python: Path) -> set[str]:
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], check=True,
                            capture_output=True, text=True, timeout=120).stdout
    return {entry["name"].lower().replace("_", "-") for entry in json.loads(listed)}


def _checkout_copy(destination: Path) -> Path:
    """The repository's files (tracked and new, not ignored) copied, so in-tree builds leave nothing behind."""
    listed = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True, text=True).stdout
    for name in filter(None, listed.split("\0")):
        source = REPO_ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    checkout = _checkout_copy(tmp_path_factory.mktemp("checkout"))
    out = tmp_path_factory.mktemp("wheels")
    return {"client": _build_wheel(checkout / "client", out / "client"),
            "server": _build_wheel(checkout, out / "server")}


def _payload(wheel: Path) -> set[str]:
    return {name for name in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in name}


def test_the_client_and_the_server_distributions_own_disjoint_files(wheels: dict[str, Path]) -> None:
    client, server = _payload(wheels["client"]), _payload(wheels["server"])
    assert client == {
        "pdserve_client/__init__.py", "pdserve_client/channels.py", "pdserve_client/client.py",
        "pdserve_client/py.typed", "pdserve_client/v1/__init__.py", "pdserve_client/v1/generation_pb2.py",
        "pdserve_client/v1/generation_pb2.pyi", "pdserve_client/v1/generation_pb2_grpc.py",
    }
    assert "pdserve/client.py" in server and "pdserve/protos/pdserve/v1/generation_pb2.py" in server
    # One import namespace: nothing the server installs can clash with a user's own top-level package.
    assert {name.split("/")[0] for name in server} == {"pdserve"}
    assert {"pdserve/engine/__init__.py", "pdserve/gateway/__init__.py", "pdserve/kv_transfer/__init__.py"} <= server
    # The CPU kernels come built, every ISA variant in one library: nothing compiles at run time.
    assert [name for name in server if name.startswith("pdserve/engine/kernels/_C.")] == [
        f"pdserve/engine/kernels/_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    ]
    assert client & server == set()
    requires = zipfile.ZipFile(wheels["server"]).read(
        next(n for n in zipfile.ZipFile(wheels["server"]).namelist() if n.endswith(".dist-info/METADATA"))
    ).decode()
    assert "Requires-Dist: pdserve-client==0.1.0" in requires.splitlines()


@pytest.mark.asyncio
async def test_the_client_installs_alone_with_grpcio_and_protobuf_and_serves_a_request(
    tmp_path: Path, wheels: dict[str, Path], llama_checkpoint: Path
) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site_dir = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                   check=True, capture_output=True, text=True).stdout.strip())
    before = _pip_list(python)  # pip (and setuptools on Python < 3.12)
    copied: set[str] = set()
    for name in ("grpcio", "protobuf"):
        _copy_distribution(name, site_dir, copied)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-index", str(wheels["client"])],
                   check=True, capture_output=True, timeout=300)
    installed = _pip_list(python)
    assert installed - before == {"grpcio", "protobuf", "typing-extensions", "pdserve-client"}
    assert "torch" not in installed

    prompt = random_prompts([11], seed=71)[0]
    expected = Oracle(llama_checkpoint).generate(prompt, 9)
    script = tmp_path / "request.py"
    script.write_text(_CLIENT_SCRIPT)
    async with InProcessCluster(llama_checkpoint, ClusterOptions(num_kv_blocks=64)) as cluster:
        # -I: neither this repository nor PYTHONPATH is on the path, only the venv.
        process = await asyncio.create_subprocess_exec(
            str(python), "-I", str(script), str(cluster.gateway_address), json.dumps(prompt), "9",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=tmp_path,
        )
        stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
        assert process.returncode == 0, stderr.decode()
    result = json.loads(stdout)
    assert Path(result["file"]).is_relative_to(site_dir)
    assert result["token_ids"] == expected
    assert result["finish_reason"] == ("length" if len(expected) == 9 else "stop")
    assert result["usage"] == [len(prompt), len(expected)]
    assert result["heavy"] == []
