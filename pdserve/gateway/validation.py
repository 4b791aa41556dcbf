"""The gateway's checks of a GenerateRequest, made before routing so a bad request costs no worker anything.

Every failure is a ``ValueError`` whose message starts with the offending
field's name (``sampling_params.top_p must be in (0, 1], got 1.5``); the
``grpc_errors`` decorator turns it into INVALID_ARGUMENT. The sampling
parameters' rules are ``SamplingParams``' own (pdserve/engine/types/sampling_params.py),
checked here by building the parameters the worker's engine will build; the
gateway adds the limits only a public endpoint needs (sizes of ids and stop
lists, logprobs) and the served model's (context length, vocabulary), which the
worker's engine checks again when it admits the request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.engine.structured_output import check_grammar
from pdserve.engine.types.sampling_params import SamplingParams, SamplingParamsError
from pdserve.protos.pdserve.v1 import generation_pb2
from pdserve.service_common.convert import sampling_params_from_proto

DEFAULT_MAX_LOGPROBS = 20


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the cluster.

    ``vocab_size`` and ``max_context_length`` describe the served model and are
    None until a worker has reported them; the checks that need them are then
    skipped (the workers' engines still make them).
    """

    vocab_size: int | None = None
    max_context_length: int | None = None  # prompt plus completion, in tokens
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_stop_strings: int = 16
    max_stop_string_len: int = 256  # characters
    max_stop_token_ids: int = 256
    max_logit_bias: int = 1024  # entries
    max_request_id_len: int = 256  # characters

    def for_model(self, vocab_size: int, max_context_length: int) -> RequestLimits:
        return dataclasses.replace(self, vocab_size=vocab_size, max_context_length=max_context_length)


def validate_generate_request(
    request: generation_pb2.GenerateRequest, token_ids: list[int] | None, limits: RequestLimits
) -> None:
    """Raise ``ValueError`` naming the first field that makes ``request`` unservable.

    ``token_ids``: the prompt as the gateway would send it (``prompt_token_ids``,
    or the text prompt tokenized); None when the prompt is text and the gateway
    has no tokenizer.
    """
    _check_request_id(request.request_id, limits)
    prompt_ids = _check_prompt(request, token_ids)
    sampling = _check_sampling_params(request.sampling_params, limits)
    _check_model_fit(request, prompt_ids, request.sampling_params, sampling.max_tokens, limits)


def _check_request_id(request_id: str, limits: RequestLimits) -> None:
    # Empty is fine: the gateway assigns one.
    if len(request_id) > limits.max_request_id_len:
        raise ValueError(f"request_id is {len(request_id)} characters long; the limit is {limits.max_request_id_len}")
    for index, char in enumerate(request_id):
        # Ids go into logs and metric labels: no control, format or line-separator characters.
        if not char.isprintable():
            raise ValueError(
                f"request_id must hold printable characters only; found U+{ord(char):04X} at index {index}"
            )


def _check_prompt(request: generation_pb2.GenerateRequest, token_ids: list[int] | None) -> list[int]:
    if request.prompt and request.prompt_token_ids:
        raise ValueError("prompt and prompt_token_ids: set exactly one of them, not both")
    if not request.prompt and not request.prompt_token_ids:
        raise ValueError("prompt must not be empty: set prompt or prompt_token_ids")
    if token_ids is None:
        raise ValueError("prompt (text) needs a tokenizer, and this gateway has none; send prompt_token_ids")
    if not token_ids:
        raise ValueError("prompt tokenized to no tokens")
    return token_ids


def _check_sampling_params(params: generation_pb2.SamplingParams, limits: RequestLimits) -> SamplingParams:
    """The engine's parameters for ``params``, after the limits only a public endpoint sets; the ranges are
    ``SamplingParams``' own checks, their messages naming the field as the request does."""
    _check_endpoint_limits(params, limits)
    try:
        sampling = sampling_params_from_proto(params)
    except SamplingParamsError as error:
        raise ValueError(f"sampling_params.{error.typed_message}") from None
    if sampling.structured_outputs is not None:
        # GrammarError, a ValueError naming the field (sampling_params.structured_outputs.json ...).
        check_grammar(sampling.structured_outputs)
    return sampling


def _check_endpoint_limits(params: generation_pb2.SamplingParams, limits: RequestLimits) -> None:
    # logprobs' ranges hold the engine's lower bound too: a negative value is told the whole range.
    if params.HasField("logprobs") and not 0 <= params.logprobs <= limits.max_logprobs:
        raise ValueError(f"sampling_params.logprobs must be in [0, {limits.max_logprobs}], got {params.logprobs}")
    if params.HasField("prompt_logprobs") and not 0 <= params.prompt_logprobs <= limits.max_logprobs:
        raise ValueError(
            f"sampling_params.prompt_logprobs must be in [0, {limits.max_logprobs}], got {params.prompt_logprobs}"
        )
    if len(params.logit_bias) > limits.max_logit_bias:
        raise ValueError(
            f"sampling_params.logit_bias holds {len(params.logit_bias)} entries; the limit is {limits.max_logit_bias}"
        )
    if len(params.stop) > limits.max_stop_strings:
        raise ValueError(
            f"sampling_params.stop holds {len(params.stop)} strings; the limit is {limits.max_stop_strings}"
        )
    for index, stop in enumerate(params.stop):
        if len(stop) > limits.max_stop_string_len:
            raise ValueError(
                f"sampling_params.stop[{index}] is {len(stop)} characters long; "
                f"the limit is {limits.max_stop_string_len}"
            )
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise ValueError(
            f"sampling_params.stop_token_ids holds {len(params.stop_token_ids)} ids; "
            f"the limit is {limits.max_stop_token_ids}"
        )


def _check_model_fit(
    request: generation_pb2.GenerateRequest,
    token_ids: list[int],
    params: generation_pb2.SamplingParams,
    max_tokens: int,
    limits: RequestLimits,
) -> None:
    prompt_field = "prompt_token_ids" if request.prompt_token_ids else "prompt"
    if limits.max_context_length is not None:
        if len(token_ids) + max_tokens > limits.max_context_length:
            default = "" if params.HasField("max_tokens") else ", the default"
            raise ValueError(
                f"{prompt_field} ({len(token_ids)} tokens) plus sampling_params.max_tokens ({max_tokens}{default}) "
                f"exceeds the model's context length ({limits.max_context_length})"
            )
    if limits.vocab_size is not None:
        vocab_size = limits.vocab_size
        for field, ids in ((prompt_field, token_ids), ("sampling_params.stop_token_ids", params.stop_token_ids)):
            # max() first: one pass in C for the common, valid case.
            if ids and max(ids) >= vocab_size:
                index = next(i for i, token_id in enumerate(ids) if token_id >= vocab_size)
                raise ValueError(f"{field}[{index}] = {ids[index]} is outside the vocabulary [0, {vocab_size})")
        if params.logit_bias and max(params.logit_bias) >= vocab_size:
            token_id = min(t for t in params.logit_bias if t >= vocab_size)
            raise ValueError(
                f"sampling_params.logit_bias key {token_id} is outside the vocabulary [0, {vocab_size})"
            )
