"""`pdserve up --prefill-tp 2 --decode-tp 2`: every worker starts its ranks, serves exactly, and a worker
whose rank dies goes down whole (NOT_SERVING, exit 3) and is restarted with fresh ranks."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from tests.e2e.test_supervision import Up, _all_exact, _env, _free_port, _generate
from tests.support.waiting import wait_until_sync


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def _ranks_of(worker_pid: int) -> list[int]:
    """The worker's follower ranks: the children of its forkserver (the worker's child running forkserver)."""
    ranks = []
    for child in _children(worker_pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmdline:
            ranks += _children(child)
    return ranks


@pytest.mark.asyncio
async def test_up_runs_tensor_parallel_workers_and_restarts_one_whose_rank_died(
    llama_checkpoint: Path, tmp_path: Path
) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint, dtype=torch.float32).eval()
    args = ["--model", str(llama_checkpoint), "--dtype", "float32", "--port", "0", "--prefill-tp", "2",
            "--decode-tp", "2", "--redis-url", f"redis://127.0.0.1:{_free_port()}/0",
            "--redis-prefix", f"pdserve-test-{uuid.uuid4().hex}", "--num-kv-blocks", "256", "--restart-delay", "1",
            "--unhealthy-after", "60", "--max-restarts", "2", "--restart-window", "600"]
    up = Up(args, tmp_path / "output.txt", _env())
    try:
        up.wait_serving()
        assert "tensor parallel: prefill 2, decode 2" in up.output()
        await _all_exact(up, model, seed=300)
        (rank,) = wait_until_sync(lambda: _ranks_of(up.pid("decode-0")) or None, "decode-0's rank", 30)
        os.kill(rank, signal.SIGKILL)
        up.wait_for(r"^decode-0 exited with status 3 \(its engine thread died\); restarting it in ", 30)
        up.wait_for(r"^decode-0 is back on ", 120)
        # The gateway takes a moment to trust the restarted (only) decode worker again.
        for _ in range(60):
            if (await _generate(up.endpoint, [5, 6, 7], 2))[0] == grpc.StatusCode.OK:
                break
            await asyncio.sleep(1)
        await _all_exact(up, model, seed=301)
        assert _ranks_of(up.pid("decode-0")) not in ([], [rank])
    finally:
        up.stop()
