"""KV handed from one engine to another in-process: what the prefill and decode workers do, without servers."""

from __future__ import annotations

import dataclasses

from pdserve.engine import LLMEngine, RequestOutput, SamplingParams
from pdserve.engine.types.handoff import KVHoldParams

# Where the held KV would be fetched from; nothing dials it in-process.
HOLD = KVHoldParams(transport="grpc", address="127.0.0.1:1", worker_id="prefill-test", epoch=1)


def prefill_and_hold(prefill: LLMEngine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    """Run ``prompt`` to its first token on ``prefill`` as a prefill worker does; the finished output, KV held."""
    assert params.min_tokens == 0, "the prefill service's first-token parameters are not modelled here"
    request_id = prefill.add_request(prompt, dataclasses.replace(params, max_tokens=1), hold_kv=HOLD)
    while True:
        for out in prefill.step():
            if out.request_id == request_id and out.finished:
                assert out.kv_handoff is not None and request_id in prefill.leases
                return out


def finished_outputs(decode: LLMEngine) -> dict[str, list[int]]:
    """Step ``decode`` until nothing is left; each finished request's token ids by request id."""
    outputs: dict[str, list[int]] = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    return outputs


def hold_together(prefill: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[RequestOutput]:
    """Run every prompt to its first token on ``prefill`` in the same steps, as ``LLM.generate`` batches them (one
    prefill worker's batch), KV held; the finished outputs in the prompts' order.

    A prompt prefilled alone and the same prompt in a batch can differ in the last bit where a float32 GEMM's
    sums depend on its row count (MKL's do, at a few rows; pdserve's panels do not): a handoff compared with
    an in-process run is compared like for like only when both prefill in the same batch."""
    assert params.min_tokens == 0, "the prefill service's first-token parameters are not modelled here"
    request_ids = [prefill.add_request(prompt, dataclasses.replace(params, max_tokens=1), hold_kv=HOLD)
                   for prompt in prompts]
    held: dict[str, RequestOutput] = {}
    for _ in range(sum(map(len, prompts))):  # a step prefills one token at least
        held.update((out.request_id, out) for out in prefill.step() if out.finished)
        if len(held) == len(request_ids):
            break
    assert all(held[request_id].kv_handoff is not None and request_id in prefill.leases for request_id in request_ids)
    return [held[request_id] for request_id in request_ids]


def hand_over(
    prefill: LLMEngine, decode: LLMEngine, prompt: list[int], params: SamplingParams,
    held: RequestOutput | None = None,
) -> RequestOutput:
    """Prefill ``prompt`` (unless ``held`` is its output, prefilled and held already), move its KV to ``decode``
    (only the blocks it lacks) and end the lease; the state at landing."""
    held = prefill_and_hold(prefill, prompt, params) if held is None else held
    assert held.kv_handoff is not None
    request_id = decode.kv_connector.add_remote_request(held.request_id, prompt, params, held.kv_handoff)
    (slot,) = decode.kv_connector.drain_kv_slots()
    assert slot.request_id == request_id
    blocks = prefill.leases.export(request_id, slot.first_block)
    assert prefill.leases.release(request_id)
    landed = decode.kv_connector.fill(request_id, slot.first_block, blocks)
    assert landed is not None
    return landed


def handoff_tokens(
    prefill: LLMEngine, decode: LLMEngine, prompts: list[list[int]], params: SamplingParams, together: bool = False
) -> dict[str, list[int]]:
    """Hand every prompt from ``prefill`` to ``decode``, decode there to the end; tokens by request id, in
    the prompts' order (whichever finishes first). ``together``: the prompts prefilled in one batch
    (``hold_together``), else one at a time.

    Asserts that neither engine holds a block afterwards.
    """
    held: list[RequestOutput | None] = [None] * len(prompts)
    if together:
        held = list(hold_together(prefill, prompts, params))
    request_ids = [hand_over(prefill, decode, prompt, params, out).request_id for prompt, out in zip(prompts, held)]
    outputs: dict[str, list[int]] = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    assert decode.block_manager.num_used_blocks == 0
    assert prefill.block_manager.num_used_blocks == 0
    return {request_id: outputs[request_id] for request_id in request_ids}
