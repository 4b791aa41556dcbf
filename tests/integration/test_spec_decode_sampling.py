"""Sampled requests under speculative decoding: the target's distribution exactly (chi-square), and seeded
requests token-identical to plain decoding whatever the batch and whatever was accepted."""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine import LLM, SamplingParams
from tests.conftest import VOCAB_SIZE, random_prompts
from tests.support.proposers import ScriptedProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Chi-square critical value, 7 degrees of freedom, p = 0.001.
CHI2_7DOF_P001 = 24.322


def _llm(path: Path, **kwargs: object) -> LLM:
    return LLM(model=str(path), dtype="float32", **kwargs)


def test_seeded_sampling_is_token_identical_with_and_without_speculation(checkpoint: Path) -> None:
    prompts = random_prompts([4, 13, 27, 40], seed=41)
    params = [
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=100 + i, repetition_penalty=1.3, min_tokens=4)
        if i % 2
        else SamplingParams(max_tokens=20, temperature=1.0, top_k=5, seed=100 + i)
        for i in range(len(prompts))
    ]
    plain = _llm(checkpoint, num_kv_blocks=128)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    # The proposer knows plain decoding's tokens, with mistakes: runs of every length are accepted, and
    # every rejection discards draws that the generator must take back.
    spec = _llm(checkpoint, num_kv_blocks=128, speculative_config={**NGRAM, "disable_by_batch_size": 8})
    spec.engine.spec_decoder.proposer = ScriptedProposer(
        {tuple(p): w for p, w in zip(prompts, want)}, {1, 2, 6, 7, 8, 13}, VOCAB_SIZE
    )
    together = spec.generate(prompts, params)
    assert [o.token_ids for o in together] == want
    stats = [o.spec_decode_stats for o in together]
    assert all(0 < s.num_accepted_tokens < s.num_draft_tokens for s in stats)
    # Alone, in reverse order, with a different batch around them: the same tokens.
    alone = [spec.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
    assert alone == want
    reverse = spec.generate(prompts[::-1], params[::-1])
    assert [o.token_ids for o in reverse][::-1] == want


def _exact_distribution(path: Path, prompt: list[int], depth: int, top_k: int) -> dict[tuple[int, ...], float]:
    """Probability of every ``depth``-token continuation under temperature 1 and top-k, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    paths: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        grown = {}
        for prefix, prob in paths.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            top = logits.topk(top_k)
            probs = top.values.softmax(dim=-1)
            for token, p in zip(top.indices.tolist(), probs.tolist()):
                grown[prefix + (token,)] = prob * p
        paths = grown
    return paths


def test_rejection_sampling_follows_the_target_distribution(llama_checkpoint: Path) -> None:
    prompt = random_prompts([9], seed=42)[0]
    num_draws, depth = 1600, 3
    exact = _exact_distribution(llama_checkpoint, prompt, depth, top_k=2)
    # The proposer always proposes the greedy continuation: a sampled token agrees with it only sometimes,
    # so accepted, rejected and bonus positions all occur.
    greedy = _llm(llama_checkpoint, num_kv_blocks=64).generate([prompt], SamplingParams(max_tokens=depth, temperature=0.0))
    spec = _llm(
        llama_checkpoint, num_kv_blocks=400, seed=7,
        speculative_config={**NGRAM, "disable_by_batch_size": num_draws},
    )
    spec.engine.spec_decoder.proposer = _AlwaysProposes(greedy[0].token_ids)
    outputs = spec.generate([prompt] * num_draws, SamplingParams(max_tokens=depth, temperature=1.0, top_k=2))
    counts = {path: 0 for path in exact}
    for out in outputs:
        counts[tuple(out.token_ids)] += 1
    chi2 = sum((counts[path] - num_draws * p) ** 2 / (num_draws * p) for path, p in exact.items())
    print(f"chi2={chi2:.2f}", counts, {k: round(v * num_draws, 1) for k, v in exact.items()})
    assert len(exact) == 8 and chi2 < CHI2_7DOF_P001, (chi2, counts, exact)
    stats = spec.engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


class _AlwaysProposes(ScriptedProposer):
    """Proposes the tokens of one fixed path from wherever a sequence is, whatever it sampled so far."""

    def __init__(self, path: list[int]) -> None:
        super().__init__({}, set(), VOCAB_SIZE)
        self.path = path

    def propose(self, seqs, max_tokens):  # type: ignore[no-untyped-def]
        return [self.path[seq.num_output_tokens : seq.num_output_tokens + k] for seq, k in zip(seqs, max_tokens)]

