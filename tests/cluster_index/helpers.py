"""Small builders shared by the cluster_index tests."""

from __future__ import annotations

from pdserve.cluster_index import WorkerInfo, WorkerRole
from pdserve.engine.types.hashing import BlockHash, hash_prompt_blocks

REDIS_URL = "redis://127.0.0.1:6379/0"
BLOCK_SIZE = 4
MODEL_ID = "tiny-llama"


def make_worker(worker_id: str, role: WorkerRole = "prefill", epoch: int = 1) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        role=role,
        address=f"10.0.0.{len(worker_id)}:7000",
        epoch=epoch,
        model_id=MODEL_ID,
        block_size=BLOCK_SIZE,
    )


def prompt_hashes(num_blocks: int, first_token: int = 2) -> list[BlockHash]:
    """Chained hashes of a prompt of ``num_blocks`` full blocks, as the gateway computes them."""
    tokens = list(range(first_token, first_token + num_blocks * BLOCK_SIZE))
    return hash_prompt_blocks(tokens, BLOCK_SIZE, MODEL_ID)
