"""The handoff descriptor and KV layout on the wire: protobuf conversion at the service edge.

The types themselves are the engine's (``pdserve.engine.types.handoff``): the prefill
engine builds the ``KVHandoff`` and the decode engine takes it, so they cannot
carry protobuf methods. Parsing validates once, here, with a ``ValueError``
naming the field; nothing downstream checks the descriptor again.
"""

from __future__ import annotations

from pdserve.engine.types.handoff import KVHandoff, KVLayout
from pdserve.engine.types.hashing import BlockHash
from pdserve.protos.pdserve.v1.internal import worker_pb2
from pdserve.service_common.convert import lora_from_proto, lora_to_proto

__all__ = ["KVHandoff", "KVLayout", "handoff_from_proto", "handoff_to_proto", "layout_from_proto", "layout_to_proto"]


def layout_to_proto(layout: KVLayout) -> worker_pb2.KVLayout:
    return worker_pb2.KVLayout(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        dtype=layout.dtype,
        kv_parts=layout.kv_parts,
    )


def layout_from_proto(message: worker_pb2.KVLayout) -> KVLayout:
    return KVLayout(
        num_layers=message.num_layers,
        num_kv_heads=message.num_kv_heads,
        head_dim=message.head_dim,
        block_size=message.block_size,
        dtype=message.dtype,
        kv_parts=message.kv_parts or 2,
    )


def handoff_to_proto(handoff: KVHandoff) -> worker_pb2.KVHandoff:
    return worker_pb2.KVHandoff(
        request_id=handoff.request_id,
        model_id=handoff.model_id,
        layout=layout_to_proto(handoff.layout),
        block_hashes=list(handoff.block_hashes),
        num_tokens=handoff.num_tokens,
        first_token_id=handoff.first_token_id,
        transport=handoff.transport,
        address=handoff.address,
        lease_deadline_ms=handoff.lease_deadline_ms,
        worker_id=handoff.worker_id,
        epoch=handoff.epoch,
        draft_layout=layout_to_proto(handoff.draft_layout) if handoff.draft_layout is not None else None,
        draft_model_id=handoff.draft_model_id,
        tensor_parallel_size=handoff.tensor_parallel_size,
        lora=lora_to_proto(handoff.lora),
    )


def handoff_from_proto(message: worker_pb2.KVHandoff) -> KVHandoff:
    # An absent layout would parse as all zeros; say so rather than "num_layers must be in [1, ...]".
    if not message.HasField("layout"):
        raise ValueError("layout is missing from the handoff")
    return KVHandoff(
        request_id=message.request_id,
        model_id=message.model_id,
        layout=layout_from_proto(message.layout),
        block_hashes=tuple(BlockHash(h) for h in message.block_hashes),
        num_tokens=message.num_tokens,
        first_token_id=message.first_token_id,
        transport=message.transport,
        address=message.address,
        lease_deadline_ms=message.lease_deadline_ms,
        worker_id=message.worker_id,
        epoch=message.epoch,
        draft_layout=layout_from_proto(message.draft_layout) if message.HasField("draft_layout") else None,
        draft_model_id=message.draft_model_id,
        tensor_parallel_size=message.tensor_parallel_size or 1,
        lora=lora_from_proto(message.lora),
    )
