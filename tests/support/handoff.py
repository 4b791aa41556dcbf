"""KV handed from one engine to another in-process: what the prefill and decode workers do, without servers."""

from __future__ import annotations

from engine import LLMEngine, SamplingParams


def handoff_tokens(
    prefill: LLMEngine, decode: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> dict[str, list[int]]:
    """Prefill every prompt on ``prefill``, move its KV to ``decode``, decode there to the end; tokens by request id.

    Asserts that ``decode`` holds no block afterwards.
    """
    for prompt in prompts:
        request_id = prefill.add_request(prompt, params)
        (first,) = prefill.step()
        kv = prefill.export_kv(request_id)
        prefill.abort_request(request_id)
        assert decode.import_request(request_id, prompt, first.token_ids[0], params, kv)
    outputs: dict[str, list[int]] = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    assert decode.block_manager.num_used_blocks == 0
    return outputs
