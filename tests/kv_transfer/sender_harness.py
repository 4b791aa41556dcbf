"""Start and stop ``sender_process.py`` as a real process, and build handoffs that point at it."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pdserve.kv_transfer import KVHandoff
from tests.kv_transfer.seeded_source import LAYOUT, NUM_BLOCKS, layout_of

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("sender_process.py")


@dataclass(frozen=True)
class SenderProcess:
    address: str  # 127.0.0.1:port of its gRPC server
    pid: int
    shm_prefix: str


@contextmanager
def running_sender(shm_prefix: str, *extra_args: str, start_timeout_s: float = 60.0) -> Iterator[SenderProcess]:
    """The sender process, serving; SIGTERM (then SIGKILL) by PID when the block ends, whatever happened."""
    env = dict(os.environ)
    # The script runs from the tests folder: put the repository root on the path for its imports.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), shm_prefix, *extra_args],
        stdout=subprocess.PIPE,
        cwd=REPO_ROOT,
        env=env,
        text=True,
    )
    try:
        port = _read_port(process, start_timeout_s)
        yield SenderProcess(address=f"127.0.0.1:{port}", pid=process.pid, shm_prefix=shm_prefix)
    finally:
        stop_sender(process)


def stop_sender(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    if process.stdout is not None:
        process.stdout.close()


def _read_port(process: subprocess.Popen[str], timeout_s: float) -> int:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if selector.select(timeout=0.5):
                line = process.stdout.readline()
                if line.strip().isdigit():
                    return int(line)
                raise RuntimeError(f"sender process printed {line!r} instead of its port (exit code {process.poll()})")
            if process.poll() is not None:
                raise RuntimeError(f"sender process exited with {process.returncode} before serving")
    raise RuntimeError(f"sender process did not print its port within {timeout_s} s")


def handoff(request_id: str, sender: SenderProcess, transport: str) -> KVHandoff:
    """A handoff for ``request_id`` as the sender would describe it (unknown ids get 2 blocks)."""
    num_blocks = NUM_BLOCKS.get(request_id, 2)
    return KVHandoff(
        request_id=request_id,
        model_id="test-model",
        layout=layout_of(request_id),
        block_hashes=(),
        num_tokens=num_blocks * LAYOUT.block_size - 3,  # last block partial
        first_token_id=5,
        transport=transport,
        address=sender.address,
        lease_deadline_ms=int(time.time() * 1000) + 60_000,
        worker_id="prefill-test",
        epoch=1,
    )


def shm_segments(prefix: str) -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(prefix))
