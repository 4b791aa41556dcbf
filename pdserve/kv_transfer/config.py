"""Transport names and the one configuration object every transport reads."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.types.handoff import TRANSPORTS

# Every transport a handoff may name (the handoff type validates it, hence defined there).
STAGED_TRANSPORTS: tuple[str, ...] = ("shm", "torch_dist", "cuda_ipc")

# The FetchKV contract (worker.proto): chunks of at most 1 MiB.
MAX_CHUNK_BYTES = 1 << 20
# Internal API messages stay well under this; a chunk plus its header is ~1 MiB.
INTERNAL_MESSAGE_LIMIT = 4 << 20
# For every internal gRPC server and channel: explicit, so a default change in
# grpcio never silently breaks (or unbounds) the KV stream.
INTERNAL_GRPC_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", INTERNAL_MESSAGE_LIMIT),
    ("grpc.max_send_message_length", INTERNAL_MESSAGE_LIMIT),
)

TORCH_DIST_BACKENDS: tuple[str, ...] = ("gloo", "nccl")


def check_transport(name: str, allowed: tuple[str, ...] = TRANSPORTS) -> str:
    """``name`` if it is one of ``allowed``, else a ``ValueError`` listing them."""
    if name not in allowed:
        raise ValueError(f"unknown KV transport {name!r}; valid transports: {', '.join(allowed)}")
    return name


@dataclass(frozen=True)
class TransferConfig:
    """Settings of the KV transports, shared by the sending and receiving sides.

    ``torch_dist_backend`` must be the same on both sides of a pair: gloo moves
    CPU tensors (any host), nccl moves CUDA tensors (GPU peers).
    """

    chunk_bytes: int = MAX_CHUNK_BYTES  # grpc: bytes per KVChunk
    rpc_timeout_s: float = 60.0  # FetchKV / StageKV deadline seen by the receiver
    shm_prefix: str = "pdserve_kv_"  # shm: segment names start with this (find leaks with ls /dev/shm)
    torch_dist_backend: str = "gloo"
    torch_dist_timeout_s: float = 60.0  # torch_dist: pair rendezvous and each send/recv
    torch_dist_max_pairs: int = 64  # torch_dist: cached pair groups per side; the least recently used go first
    device: str = "cpu"  # receivers place blocks here when the transport can (cuda_ipc, nccl)
    # Push (grpc, shm): how long a prefill worker waits, once its first token is sampled, for the decode
    # worker to confirm it holds every pushed block (past it the decode worker pulls instead) ...
    push_ack_timeout_s: float = 2.0
    # ... the most KV a prefill worker queues to push, over all requests (past it: pulled) ...
    push_max_queued_bytes: int = 1 << 30
    # ... and, on a decode worker, the most pushed KV held for requests whose Decode has not come yet
    # (past it a push is refused and pulled; each is dropped when unclaimed at the engine's handoff deadline).
    push_inbox_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}")
        if self.rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s must be positive, got {self.rpc_timeout_s}")
        if not self.shm_prefix or "/" in self.shm_prefix:
            raise ValueError(f"shm_prefix must be non-empty and contain no '/', got {self.shm_prefix!r}")
        if self.torch_dist_backend not in TORCH_DIST_BACKENDS:
            raise ValueError(
                f"torch_dist_backend must be one of {list(TORCH_DIST_BACKENDS)}, got {self.torch_dist_backend!r}"
            )
        if self.torch_dist_max_pairs < 1:
            raise ValueError(f"torch_dist_max_pairs must be at least 1, got {self.torch_dist_max_pairs}")
        if not self.push_ack_timeout_s > 0:
            raise ValueError(f"push_ack_timeout_s must be positive, got {self.push_ack_timeout_s}")
        for name in ("push_max_queued_bytes", "push_inbox_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.torch_dist_timeout_s <= 0:
            raise ValueError(f"torch_dist_timeout_s must be positive, got {self.torch_dist_timeout_s}")
