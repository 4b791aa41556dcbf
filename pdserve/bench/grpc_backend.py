"""The benchmark's backend for pdserve's public gRPC API (``pdserve.v1.Generation``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import grpc

from pdserve.bench.backend import BackendError, BackendRequest, ModelDescription, StreamChunk, Usage
from pdserve.protos.pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.service_common.security import TlsConfig, bearer_metadata, open_channel
from pdserve.service_common.server import DEFAULT_MAX_MESSAGE_BYTES, channel_options

MODEL_INFO_TIMEOUT_S = 10.0


class GrpcBackend:
    """Streams requests to a gateway over one channel (HTTP/2 multiplexes every request on it).

    Construct it inside the event loop that will use it: a grpc.aio channel
    belongs to the loop it was created on.
    """

    def __init__(
        self,
        target: str,
        clock: Callable[[], float] = time.perf_counter,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        tls: TlsConfig | None = None,
        auth_token: str | None = None,
    ) -> None:
        self.target = target
        self._clock = clock
        self._channel = open_channel(target, tls, channel_options(max_message_bytes))
        self._metadata = bearer_metadata(auth_token)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def model_info(self) -> ModelDescription:
        try:
            info = await self._stub.ModelInfo(
                generation_pb2.ModelInfoRequest(), timeout=MODEL_INFO_TIMEOUT_S, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as error:
            raise BackendError(error.code().name, error.details() or "") from error
        return ModelDescription(
            model_id=info.model_id, vocab_size=info.vocab_size, max_context_length=info.max_context_length
        )

    async def stream(self, request: BackendRequest) -> AsyncIterator[StreamChunk]:
        call = self._stub.Generate(to_proto(request), timeout=request.timeout_s, metadata=self._metadata)
        try:
            async for response in call:
                timestamp = self._clock()
                usage = None
                if response.HasField("usage"):
                    usage = Usage(
                        prompt_tokens=response.usage.prompt_tokens,
                        completion_tokens=response.usage.completion_tokens,
                        cached_prompt_tokens=response.usage.cached_prompt_tokens,
                        spec_decode_drafts=response.usage.spec_decode_drafts,
                        spec_decode_draft_tokens=response.usage.spec_decode_draft_tokens,
                        spec_decode_accepted_tokens=response.usage.spec_decode_accepted_tokens,
                    )
                yield StreamChunk(timestamp=timestamp, num_tokens=len(response.token_ids), usage=usage)
        except grpc.aio.AioRpcError as error:
            raise BackendError(error.code().name, error.details() or "") from error
        finally:
            call.cancel()  # a no-op once the stream has ended; aborts it on the server if the caller stopped early

    async def close(self) -> None:
        await self._channel.close()


def to_proto(request: BackendRequest) -> generation_pb2.GenerateRequest:
    params = generation_pb2.SamplingParams(
        max_tokens=request.max_tokens, temperature=request.temperature, ignore_eos=request.ignore_eos
    )
    if request.seed is not None:
        params.seed = request.seed
    proto = generation_pb2.GenerateRequest(request_id=request.request_id, sampling_params=params)
    if request.prompt_token_ids is not None:
        proto.prompt_token_ids.extend(request.prompt_token_ids)
    else:
        proto.prompt = request.prompt or ""
    return proto
