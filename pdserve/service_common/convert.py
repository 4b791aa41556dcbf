"""Protobuf <-> engine types, at the service edge only."""

from __future__ import annotations

from pdserve.engine.types.lora import LoRARequest
from pdserve.engine.types.outputs import TokenLogprobs
from pdserve.engine.types.sampling_params import SamplingParams
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.protos.pdserve.v1.internal import worker_pb2
from pdserve.service_common.structured_outputs import structured_outputs_from_proto, structured_outputs_to_proto

# The message's `optional` scalars, named as in SamplingParams; unset keeps the engine's default.
_OPTIONAL_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logprobs",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "prompt_logprobs",
    "use_speculation",
    "skip_special_tokens",
)

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
    for name in _OPTIONAL_FIELDS:
        if message.HasField(name):
            kwargs[name] = getattr(message, name)
    if message.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(message.structured_outputs)
    return SamplingParams(
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logit_bias=dict(message.logit_bias),
        **kwargs,  # type: ignore[arg-type]
    )


def sampling_params_to_proto(params: SamplingParams) -> generation_pb2.SamplingParams:
    """The message for ``params``; every field is set explicitly, defaults included."""
    message = generation_pb2.SamplingParams(
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        logit_bias=dict(params.logit_bias),
    )
    for name in _OPTIONAL_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    if params.structured_outputs is not None:
        message.structured_outputs.CopyFrom(structured_outputs_to_proto(params.structured_outputs))
    return message


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


def lora_to_proto(lora: LoRARequest | None) -> worker_pb2.LoRAAdapter | None:
    if lora is None:
        return None
    return worker_pb2.LoRAAdapter(name=lora.lora_name, id=lora.lora_int_id, path=lora.lora_path)


def lora_from_proto(message: worker_pb2.LoRAAdapter) -> LoRARequest | None:
    """The adapter a request names (None: the base model); ``ValueError`` naming the field when it is malformed."""
    if not message.name:
        return None
    try:
        return LoRARequest(message.name, message.id, message.path)
    except ValueError as error:
        raise ValueError(f"lora.{error}") from None
