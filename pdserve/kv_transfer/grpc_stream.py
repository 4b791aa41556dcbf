"""The grpc transport's receiver: reads FetchKV's chunks straight into a preallocated tensor.

Works wherever the prefill worker's internal gRPC server is reachable, so it is
the default across hosts on CPUs. The sending side is ``KVSenderServicer.FetchKV``.
"""

from __future__ import annotations

import torch

from pdserve.kv_transfer.base import KVReceiver, KVTransferError, head_fields
from pdserve.kv_transfer.buffers import byte_view, empty_blocks
from pdserve.kv_transfer.descriptor import KVHandoff
from pdserve.protos.pdserve.v1.internal import worker_pb2, worker_pb2_grpc


class GrpcReceiver(KVReceiver):
    name = "grpc"

    async def _fetch(
        self,
        handoff: KVHandoff,
        first_block: int,
        num_blocks: int,
        stub: worker_pb2_grpc.PrefillWorkerStub,
        heads: range,
    ) -> torch.Tensor:
        blocks = empty_blocks(handoff.layout, num_blocks, len(heads))
        target = byte_view(blocks)
        total = target.nbytes
        received = 0
        call = stub.FetchKV(
            worker_pb2.FetchKVRequest(
                request_id=handoff.request_id, first_block=first_block, **head_fields(handoff, heads)
            ),
            timeout=self.config.rpc_timeout_s,
        )
        try:
            async for chunk in call:
                size = len(chunk.data)
                # The stream is ordered, so every chunk must start where the last ended.
                if (
                    chunk.total_bytes != total
                    or chunk.num_blocks != num_blocks
                    or chunk.offset != received
                    or received + size > total
                ):
                    raise KVTransferError(
                        f"FetchKV of {handoff.request_id!r} sent {size} bytes at offset {chunk.offset} of "
                        f"{chunk.total_bytes} ({chunk.num_blocks} blocks); expected offset {received} of "
                        f"{total} ({num_blocks} blocks)"
                    )
                target[received : received + size] = chunk.data
                received += size
        except BaseException:
            call.cancel()  # stop the sender streaming into a receiver that gave up
            raise
        if received != total:
            raise KVTransferError(f"FetchKV of {handoff.request_id!r} ended after {received} of {total} bytes")
        return blocks
