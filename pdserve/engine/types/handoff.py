"""What crosses from a prefill engine to a decode engine: the KV layout and the handoff descriptor.

``KVHandoff`` is the one type of a handoff: the prefill engine builds it when a
held request finishes (block hashes taken from the sequence, which computed them
as its tokens arrived), the transports read it, and the decode engine takes it
as is. Both types are frozen and validated on construction, so a malformed
handoff fails where it is built or parsed with a ``ValueError`` that names the
field, never halfway through a transfer. Protobuf conversion lives at the
service edge (``kv_transfer.descriptor``): the engine imports no protos.

Torch-free, as all of ``pdserve.engine.types`` is: a layout names its dtype
(``"bfloat16"``); the torch side of a handoff (a layout's tensor dtype,
``KVFetch``) is ``pdserve.engine.kv.handoff``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.engine.types.hashing import BlockHash
from pdserve.engine.types.lora import LoRARequest

# Every transport a handoff may name. grpc streams with FetchKV; the others are
# staged with StageKV and read out of band (kv_transfer.config re-exports these).
TRANSPORTS: tuple[str, ...] = ("grpc", "shm", "torch_dist", "cuda_ipc")

# The KV cache dtypes the engine supports (config.SUPPORTED_DTYPES less "auto", and int8 KV), and the bytes of
# one element of each.
KV_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}
# int8 KV stores one float32 scale per (token, KV head); on the wire (export/import)
# its 4 bytes follow the head's head_dim int8 values, so a handoff stays one tensor.
SCALE_BYTES = 4
# Rows a pool keeps per token and layer: keys and values (2), or one latent (1: multi-head latent attention).
KV_PARTS = (1, 2)
# The draft model's section of a handoff is addressed as a request of its own on
# the prefill worker (``KVHandoff.draft_section``), so every transport moves it unchanged.
DRAFT_SECTION_SUFFIX = "#draft"
_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1


def _check_range(name: str, value: int, low: int, high: int) -> None:
    # bool is an int subclass; a True layer count is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


@dataclass(frozen=True)
class KVLayout:
    """Shape and type of KV blocks; the prefill and decode sides must agree on every field.

    A transfer of ``n`` blocks is one contiguous tensor of
    ``tensor_shape(n) == (num_layers, kv_parts, n, block_size, num_kv_heads, head_dim)``,
    the layout ``engine.kv.cache.KVCache.export_blocks`` returns: ``kv_parts`` 2
    for keys and values, 1 for a latent-attention model's latent rows. With dtype
    int8 the last dimension is ``head_dim + 4``: each row's float32 scale
    travels as 4 bytes after its values (``engine.kv.cache.pack_int8``).

    A decode worker whose ``kv_cache_dtype`` differs from the prefill worker's
    converts on import (``KVCache.import_blocks``): int8 is dequantized, float
    is cast or quantized as a local write would be.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name, e.g. "float32"
    kv_parts: int = 2  # rows per token and layer (engine.types.handoff.KV_PARTS)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            _check_range(name, getattr(self, name), 1, _UINT32_MAX)
        if self.kv_parts not in KV_PARTS:
            raise ValueError(f"kv_parts must be one of {KV_PARTS}, got {self.kv_parts!r}")
        if self.dtype not in KV_DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(KV_DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def bytes_per_block(self) -> int:
        return kv_block_bytes(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype, self.kv_parts
        )

    @property
    def row_size(self) -> int:
        """Elements of one (token, KV head) row on the wire: head_dim, plus the scale's 4 bytes for int8."""
        return self.head_dim + (SCALE_BYTES if self.dtype == "int8" else 0)

    def tensor_shape(self, num_blocks: int, num_heads: int | None = None) -> tuple[int, int, int, int, int, int]:
        """(num_layers, kv_parts, num_blocks, block_size, num_kv_heads, row_size); ``num_heads``: a transfer of some
        heads only."""
        _check_range("num_blocks", num_blocks, 0, _UINT32_MAX)
        heads = self.num_kv_heads if num_heads is None else num_heads
        return (self.num_layers, self.kv_parts, num_blocks, self.block_size, heads, self.row_size)

    def check_heads(self, heads: range | None) -> range:
        """``heads`` (None: all) if it is a non-empty range of this layout's KV heads, else ValueError."""
        if heads is None:
            return range(self.num_kv_heads)
        if heads.step != 1 or not 0 <= heads.start < heads.stop <= self.num_kv_heads:
            raise ValueError(f"kv heads must be a non-empty range within [0, {self.num_kv_heads}), got {heads}")
        return heads



@dataclass(frozen=True)
class KVHandoff:
    """Everything a decode worker needs to take over a prefilled request (mirrors ``worker_pb2.KVHandoff``).

    Built once, by the prefill engine when the request finishes
    (``RequestOutput.kv_handoff``); the decode engine takes it as is
    (``LLMEngine.add_remote_request``).
    The prefill worker holds ``num_blocks`` blocks for the request until
    ``lease_deadline_ms``; ``block_hashes`` cover its full blocks only, so a
    decode worker can skip the leading ones it already caches and fetch the
    rest from ``first_block`` on.
    """

    request_id: str
    model_id: str
    layout: KVLayout
    block_hashes: tuple[BlockHash, ...]
    num_tokens: int  # prompt tokens whose KV the blocks hold
    first_token_id: int
    transport: str  # one of TRANSPORTS
    address: str  # host:port of the prefill worker's internal gRPC server
    lease_deadline_ms: int  # Unix time after which the prefill worker frees the blocks
    worker_id: str
    epoch: int  # changes when the prefill worker restarts
    # Speculative decoding with a draft model: the draft's KV for the same blocks, built
    # beside the target's on the prefill worker (None: not built, the decode worker
    # recomputes it). ``draft_model_id`` names the draft as ``DraftModelProposer.identity``
    # does; a decode worker whose draft differs ignores the section.
    draft_layout: KVLayout | None = None
    draft_model_id: str = ""
    # How the sender is sharded (pdserve/engine/parallel/sharding.py places its KV heads); receivers ask
    # for heads by global index, so any sender size serves any receiver size.
    tensor_parallel_size: int = 1
    # The LoRA adapter the KV was computed under (None: the base model): the receiver serves the request under it.
    lora: LoRARequest | None = None

    def __post_init__(self) -> None:
        _check_range("tensor_parallel_size", self.tensor_parallel_size, 1, _UINT32_MAX)
        for name in ("request_id", "model_id", "address", "worker_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.layout, KVLayout):
            raise ValueError(f"layout must be a KVLayout, got {type(self.layout).__name__}")
        if not isinstance(self.block_hashes, tuple) or not all(isinstance(h, bytes) and h for h in self.block_hashes):
            raise ValueError("block_hashes must be a tuple of non-empty bytes")
        _check_range("num_tokens", self.num_tokens, 1, _UINT32_MAX)
        _check_range("first_token_id", self.first_token_id, 0, _UINT32_MAX)
        _check_range("lease_deadline_ms", self.lease_deadline_ms, 0, _UINT64_MAX)
        _check_range("epoch", self.epoch, 0, _UINT64_MAX)
        full_blocks = self.num_tokens // self.layout.block_size
        if len(self.block_hashes) > full_blocks:
            raise ValueError(
                f"block_hashes has {len(self.block_hashes)} hashes but {self.num_tokens} tokens "
                f"fill only {full_blocks} blocks of {self.layout.block_size}"
            )
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {self.transport!r}")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"address must be host:port, got {self.address!r}")
        if self.draft_layout is not None:
            if not isinstance(self.draft_layout, KVLayout):
                raise ValueError(f"draft_layout must be a KVLayout or None, got {type(self.draft_layout).__name__}")
            if self.draft_layout.block_size != self.layout.block_size:
                raise ValueError(
                    f"draft_layout.block_size {self.draft_layout.block_size} != layout.block_size "
                    f"{self.layout.block_size}: the draft's KV lives in the same blocks"
                )
            if not isinstance(self.draft_model_id, str) or not self.draft_model_id:
                raise ValueError("draft_model_id must name the draft when draft_layout is given")
        elif self.draft_model_id:
            raise ValueError("draft_model_id is given without draft_layout")

    @property
    def num_blocks(self) -> int:
        """Blocks the prefill worker holds for the request, the last possibly partial."""
        return -(-self.num_tokens // self.layout.block_size)

    def draft_section(self) -> KVHandoff | None:
        """The draft model's KV as a handoff of its own (same blocks, the draft's layout), which any
        transport fetches like a request's; None when the prefill worker built none."""
        if self.draft_layout is None:
            return None
        return replace(
            self, request_id=self.request_id + DRAFT_SECTION_SUFFIX, layout=self.draft_layout,
            draft_layout=None, draft_model_id="",
        )


@dataclass(frozen=True)
class KVHoldParams:
    """How a prefill worker holds a request's KV once its first token is out (vLLM's ``kv_transfer_params``).

    Given at ``LLMEngine.add_request``; when the request finishes, its blocks go
    to the engine's lease table (until the handoff deadline) and its output carries
    the ``KVHandoff`` built from these fields and the sequence. With ``push``
    the engine also hands each layer's blocks to its ``LayerPusher``'s sink as
    the prefill writes them (``pdserve.engine.kv.push``), from block ``push_first_block``
    on (the decode side caches the ones before it).
    """

    transport: str
    address: str  # host:port the decode side fetches from
    worker_id: str
    epoch: int
    push: bool = False
    push_first_block: int = 0
    # time.monotonic() after which no decode worker can use the held KV (the request's own deadline: its
    # Decode has the same one), so the lease ends then if that comes before the handoff deadline; None: none.
    claim_deadline: float | None = None

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {list(TRANSPORTS)}, got {self.transport!r}")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"address must be host:port, got {self.address!r}")
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError(f"worker_id must be a non-empty string, got {self.worker_id!r}")
        _check_range("epoch", self.epoch, 0, _UINT64_MAX)
        if not isinstance(self.push, bool):
            raise ValueError(f"push must be a bool, got {type(self.push).__name__}")
        _check_range("push_first_block", self.push_first_block, 0, _UINT32_MAX)
        if self.claim_deadline is not None and not isinstance(self.claim_deadline, (int, float)):
            raise ValueError(f"claim_deadline must be a time.monotonic() value or None, got {self.claim_deadline!r}")


@dataclass(frozen=True)
class KVReservation:
    """Blocks a decode engine holds for a request's pushed KV before the request itself arrives.

    Block ``i`` of the handoff (``i >= first_block``) is written into
    ``block_ids[i - first_block]`` as its pieces arrive; the request adopts the
    blocks when it is allocated, so its KV needs no copy then. The blocks before
    ``first_block`` were not pushed (the decode engine caches them).
    """

    first_block: int
    block_ids: tuple[int, ...]

    @property
    def end_block(self) -> int:
        return self.first_block + len(self.block_ids)


@dataclass(frozen=True)
class KVSlot:
    """Blocks allocated on a decode engine for a request waiting for remote KV.

    The blocks before ``first_block`` were found in this engine's prefix cache;
    the ones from ``first_block`` on must be filled from the handoff's source.
    """

    request_id: str
    first_block: int


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str, parts: int = 2) -> int:
    """Bytes of one block of every layer's keys and values (or latents: ``parts`` 1) in ``dtype`` (a name of
    ``KV_DTYPE_BYTES``), int8 scales included."""
    scale_bytes = SCALE_BYTES if dtype == "int8" else 0
    return num_layers * parts * block_size * num_kv_heads * (head_dim * KV_DTYPE_BYTES[dtype] + scale_bytes)
