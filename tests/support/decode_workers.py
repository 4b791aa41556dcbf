"""Hand-made decode workers for the gateway's unit tests (no servers): Decode calls that send given pieces, then end,
fail with a status or hang; a router over them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from pdserve.gateway.router import Router
from pdserve.gateway.workers import WorkerHandle, WorkerPool
from pdserve.protos.pdserve.v1.internal import worker_pb2


class DecodeCall:
    """A Decode call that sends ``pieces`` (token ids, or whole responses), then fails with ``fail`` (a status
    code; True: UNAVAILABLE) or hangs (``hang``); ``cancelled`` once the gateway cancels it."""

    def __init__(self, pieces: list[list[int] | worker_pb2.DecodeResponse], fail: bool | grpc.StatusCode = False,
                 hang: bool = False) -> None:
        self.pieces, self.hang, self.cancelled = pieces, hang, False
        self.fail = grpc.StatusCode.UNAVAILABLE if fail is True else fail or None

    def __aiter__(self) -> AsyncIterator[worker_pb2.DecodeResponse]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[worker_pb2.DecodeResponse]:
        for piece in self.pieces:
            yield piece if isinstance(piece, worker_pb2.DecodeResponse) else worker_pb2.DecodeResponse(token_ids=piece)
        if self.fail is not None:
            raise grpc.aio.AioRpcError(self.fail, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
        if self.hang:
            await asyncio.sleep(3600)

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class DecodeStub:
    """A decode worker's stub whose Decode returns ``call``; ``requests`` and ``aborts`` hold what it was sent."""

    def __init__(self, call: DecodeCall) -> None:
        self.call = call
        self.requests: list[worker_pb2.DecodeRequest] = []
        self.aborts: list[worker_pb2.AbortRequest] = []

    def Decode(self, request: worker_pb2.DecodeRequest, timeout: float | None = None) -> DecodeCall:  # noqa: N802
        self.requests.append(request)
        return self.call

    async def Abort(self, request: worker_pb2.AbortRequest, timeout: float | None = None  # noqa: N802
                    ) -> worker_pb2.AbortResponse:
        self.aborts.append(request)
        return worker_pb2.AbortResponse()


def decode_router(calls: list[DecodeCall]) -> tuple[Router, list[DecodeStub]]:
    """A router over one healthy decode worker per call (``127.0.0.1:<index + 1>``, worker id ``d<index>``), which
    it prefers in that order (its load report says ``index`` requests run there)."""
    pool = WorkerPool([], [])
    stubs = [DecodeStub(call) for call in calls]
    for index, stub in enumerate(stubs):
        report = worker_pb2.LoadReport(worker_id=f"d{index}", role="decode", epoch=1, num_running=index)
        pool.workers[f"decode@{index}"] = WorkerHandle(address=f"127.0.0.1:{index + 1}", role="decode", channel=None,  # type: ignore[arg-type]
                                                       stub=stub, report=report, healthy=True)  # type: ignore[arg-type]
    return Router(pool, None), stubs
