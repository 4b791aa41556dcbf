"""Protobuf <-> engine types, at the service edge only."""

from __future__ import annotations

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from protos.pdserve.v1 import generation_pb2

_FINISH_REASONS = {
    None: generation_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": generation_pb2.FINISH_REASON_STOP,
    "length": generation_pb2.FINISH_REASON_LENGTH,
    "abort": generation_pb2.FINISH_REASON_ABORT,
}


def sampling_params_from_proto(message: generation_pb2.SamplingParams) -> SamplingParams:
    """The engine's parameters; unset optional fields keep the engine's defaults.

    Raises ``ValueError`` naming the field, as ``SamplingParams`` does.
    """
    kwargs: dict[str, object] = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "logprobs"):
        if message.HasField(name):
            kwargs[name] = getattr(message, name)
    return SamplingParams(
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        **kwargs,  # type: ignore[arg-type]
    )


def finish_reason_to_proto(reason: str | None) -> int:
    return _FINISH_REASONS[reason]


def logprobs_to_proto(entries: list[TokenLogprobs]) -> list[generation_pb2.TokenLogprobs]:
    return [
        generation_pb2.TokenLogprobs(
            token_id=entry.token_id,
            logprob=entry.logprob,
            top_token_ids=[token for token, _ in entry.top],
            top_logprobs=[lp for _, lp in entry.top],
        )
        for entry in entries
    ]
