"""The handoff descriptor and layout: exact sizes, a lossless proto round trip, and validation that names the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.kv.handoff import layout_of, torch_dtype_of
from pdserve.engine.types.hashing import BlockHash
from pdserve.kv_transfer import KVHandoff, KVLayout, TransferConfig, make_receiver, make_stager
from pdserve.kv_transfer.descriptor import handoff_from_proto, handoff_to_proto, layout_from_proto, layout_to_proto

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")


def _handoff(**changes: object) -> KVHandoff:
    fields: dict[str, object] = dict(
        request_id="req-1",
        model_id="tiny-llama",
        layout=LAYOUT,
        block_hashes=(BlockHash(b"\x01" * 16), BlockHash(b"\x02" * 16)),
        num_tokens=10,  # two full blocks of 4 and a partial one
        first_token_id=42,
        transport="shm",
        address="10.0.0.7:50061",
        lease_deadline_ms=1_700_000_000_000,
        worker_id="prefill-0",
        epoch=3,
    )
    fields.update(changes)
    return KVHandoff(**fields)  # type: ignore[arg-type]


def test_layout_sizes_match_the_exported_tensor() -> None:
    assert LAYOUT.tensor_shape(5) == (3, 2, 5, 4, 2, 8)
    assert torch_dtype_of(LAYOUT) == torch.bfloat16
    assert LAYOUT.bytes_per_block == 3 * 2 * 4 * 2 * 8 * 2 == 768
    blocks = torch.zeros(LAYOUT.tensor_shape(5), dtype=torch.bfloat16)
    assert layout_of(blocks) == LAYOUT
    assert blocks.numel() * blocks.element_size() == 5 * LAYOUT.bytes_per_block


def test_int8_layout_counts_each_rows_scale_bytes() -> None:
    layout = dataclasses.replace(LAYOUT, dtype="int8")
    assert layout.tensor_shape(5) == (3, 2, 5, 4, 2, 8 + 4)
    assert torch_dtype_of(layout) == torch.int8
    assert layout.bytes_per_block == 3 * 2 * 4 * 2 * (8 + 4) == 576
    blocks = torch.zeros(layout.tensor_shape(5), dtype=torch.int8)
    assert layout_of(blocks) == layout
    assert blocks.numel() * blocks.element_size() == 5 * layout.bytes_per_block
    assert layout_from_proto(layout_to_proto(layout)) == layout


def test_handoff_round_trips_through_proto_unchanged() -> None:
    handoff = _handoff()
    message = handoff_to_proto(handoff)
    assert message.layout.dtype == "bfloat16" and list(message.block_hashes) == [b"\x01" * 16, b"\x02" * 16]
    assert handoff_from_proto(message) == handoff
    assert handoff.num_blocks == 3


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("request_id", ""),
        ("model_id", ""),
        ("address", "no-port"),
        ("worker_id", ""),
        ("num_tokens", 0),
        ("first_token_id", -1),
        ("epoch", 2**64),
        ("lease_deadline_ms", -5),
        ("transport", "carrier_pigeon"),
        ("block_hashes", (b"\x01",) * 3),  # 10 tokens fill only 2 blocks
        ("layout", "float32"),
    ],
)
def test_invalid_handoff_field_raises_value_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        _handoff(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"), [("num_layers", 0), ("head_dim", -1), ("dtype", "int4"), ("block_size", True)]
)
def test_invalid_layout_field_raises_value_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(LAYOUT, **{field: value})


def test_handoff_without_layout_in_proto_is_rejected() -> None:
    message = handoff_to_proto(_handoff())
    message.ClearField("layout")
    with pytest.raises(ValueError, match="layout"):
        handoff_from_proto(message)


def test_factories_reject_unknown_names_listing_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="grpc, shm, torch_dist, cuda_ipc"):
        make_receiver("rdma")
    with pytest.raises(ValueError, match="shm, torch_dist, cuda_ipc"):
        make_stager("grpc")
    assert make_receiver("grpc").name == "grpc"


@pytest.mark.parametrize(
    ("field", "value"),
    [("chunk_bytes", (1 << 20) + 1), ("chunk_bytes", 0), ("shm_prefix", "a/b"), ("torch_dist_backend", "mpi")],
)
def test_invalid_transfer_config_raises_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        TransferConfig(**{field: value})  # type: ignore[arg-type]
