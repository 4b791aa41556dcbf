"""StructuredOutput messages <-> the engine's ``StructuredOutputsParams`` (torch-free: the gateway checks specs)."""

from __future__ import annotations

from pdserve.engine.types.structured_outputs import StructuredOutputsParams
from pdserve.protos.pdserve.v1 import generation_pb2


def structured_outputs_from_proto(
    message: generation_pb2.StructuredOutput, prefix: str = "sampling_params.structured_outputs"
) -> StructuredOutputsParams:
    """The engine's spec; ``GrammarError`` (a ``ValueError``) naming the field when no kind is set."""
    kind = message.WhichOneof("kind")
    kwargs: dict[str, object] = {"field_name": f"{prefix}.{kind}" if kind else prefix}
    if message.HasField("disable_any_whitespace"):
        kwargs["disable_any_whitespace"] = message.disable_any_whitespace
    if message.reasoning_end:
        kwargs["reasoning_end"] = message.reasoning_end
    if kind == "choice":
        kwargs["choice"] = tuple(message.choice.choices)
    elif kind is not None:
        kwargs[kind] = getattr(message, kind)
    return StructuredOutputsParams(**kwargs)  # type: ignore[arg-type]


def structured_outputs_to_proto(params: StructuredOutputsParams) -> generation_pb2.StructuredOutput:
    message = generation_pb2.StructuredOutput(disable_any_whitespace=params.disable_any_whitespace,
                                              reasoning_end=params.reasoning_end or "")
    kind = params.kind
    if kind == "choice":
        message.choice.choices.extend(params.choice or ())
    elif kind == "json_object":
        message.json_object = True
    else:
        setattr(message, kind, getattr(params, kind))
    return message
