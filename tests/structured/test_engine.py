"""Structured output in the engine: greedy float32 output equals transformers' generate with the same grammar's
mask applied, token for token, through batching, chunked prefill, preemption, prefix hits and the KV handoff;
bounded schemas end within their bound; bad specs are refused naming the field. The reference's masks are built
from llguidance's own API on the checkpoint's tokenizer, sharing nothing with pdserve's structured-output code."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.grammar_masks import GrammarMasks
from pdserve.engine.structured_output import MAX_WHITESPACE_RUN, GrammarCompiler, check_grammar
from pdserve.engine.types.structured_outputs import GrammarError, StructuredOutputsParams
from tests.conftest import VOCAB_SIZE, random_prompts
from tests.support.handoff import handoff_tokens

# The name of at most 8 characters, a bounded integer, a boolean, a choice: every field bounded.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "team": {"enum": ["red", "blue"]},
    },
    "required": ["name", "age", "admin", "team"],
    "additionalProperties": False,
}
SPECS = [
    StructuredOutputsParams(json=PERSON),
    StructuredOutputsParams(regex=r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)"),
    StructuredOutputsParams(choice=("alpha", "beta", "gamma")),
    StructuredOutputsParams(grammar='start: "(" expr ")"\nexpr: NUMBER ("+" NUMBER)*\nNUMBER: /[0-9]{1,3}/'),
    StructuredOutputsParams(json_object=True),
    None,  # an unconstrained row in the same batch
]
MAX_TOKENS = 48


class ReferenceGrammars:
    """llguidance on a checkpoint's tokenizer, set up here from llguidance's own API and nothing of pdserve's
    structured-output code (``grammar_of``, ``GrammarCompiler``, ``build_tokenizer``, ``GrammarMasks``), so that a
    bug there is not shared by the reference: the grammar from llguidance's constructors, the tokenizer by
    llguidance's Hugging Face integration with the model's vocabulary and the generation config's end ids, the
    masks by ``llguidance.numpy``'s bitmask helpers."""

    def __init__(self, path: Path) -> None:
        import llguidance.hf
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        self.vocab_size = int(AutoConfig.from_pretrained(path).vocab_size)  # the logits' width
        eos = GenerationConfig.from_pretrained(path).eos_token_id
        self.eos_token_ids = {eos} if isinstance(eos, int) else set(eos)
        self.tokenizer = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(path), n_vocab=self.vocab_size,
                                                      eos_token=sorted(self.eos_token_ids))

    def matcher(self, spec: StructuredOutputsParams) -> Any:
        """A fresh matcher of what ``spec`` asks, as its documentation says: JSON without free whitespace, with
        compact separators (or runs of at most ``MAX_WHITESPACE_RUN`` whitespace characters where
        ``disable_any_whitespace`` is False); the regex; one of the choices, exactly; the Lark grammar."""
        from llguidance import LLMatcher

        layout: dict[str, Any] = (
            {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
            if spec.disable_any_whitespace else
            {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_WHITESPACE_RUN}}}"}
        )
        if spec.json is not None or spec.json_object:
            schema = spec.json if spec.json is not None else '{"type": "object"}'
            grammar = LLMatcher.grammar_from_json_schema(schema, overrides=layout)  # type: ignore[arg-type]
        elif spec.regex is not None:
            grammar = LLMatcher.grammar_from_regex(spec.regex)
        elif spec.choice is not None:
            grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        else:
            assert spec.grammar is not None, spec
            grammar = LLMatcher.grammar_from_lark(spec.grammar)
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def mask(self, matcher: Any, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` (1, vocab) with every token ``matcher`` does not allow next at -inf."""
        import llguidance.numpy

        bitmask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(matcher, bitmask)
        masked = scores.detach().clone()
        llguidance.numpy.apply_token_bitmask_inplace(masked.numpy(), bitmask)
        return masked

    def allowed(self, matcher: Any) -> list[int]:
        """The token ids ``matcher`` allows next, ascending."""
        return np.flatnonzero(self.mask(matcher, torch.zeros(1, self.vocab_size))[0] == 0).tolist()

    def tokens_of(self, words: np.ndarray) -> list[int]:
        """The token ids one bitmask row (int32 words in llguidance's layout) allows, ascending."""
        import llguidance.numpy

        logits = np.zeros((1, self.vocab_size), dtype=np.float32)
        llguidance.numpy.apply_token_bitmask_inplace(logits, np.ascontiguousarray(words, dtype=np.int32)[None])
        return np.flatnonzero(logits[0] == 0).tolist()


class MaskedOracle:
    """transformers' greedy generate with a grammar's mask (``ReferenceGrammars``') applied to the scores of each
    step: the reference of a constrained greedy request. Tokens up to the one that completes the grammar (then
    the engine ends the request), else ``max_tokens``."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.grammars = ReferenceGrammars(path)

    def generate(self, prompt: list[int], spec: StructuredOutputsParams | None, max_tokens: int) -> list[int]:
        from transformers import LogitsProcessor, LogitsProcessorList

        grammars = self.grammars
        matcher = grammars.matcher(spec) if spec is not None else None

        class Masked(LogitsProcessor):  # type: ignore[misc]
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                if matcher is None:
                    return scores
                if input_ids.shape[1] > len(prompt):
                    assert matcher.consume_token(int(input_ids[0, -1]))
                return grammars.mask(matcher, scores)

        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens, do_sample=False,
                pad_token_id=0, logits_processor=LogitsProcessorList([Masked()]),
            )
        tokens = out[0, len(prompt):].tolist()
        if spec is None:
            return tokens
        # Where the engine stops: the token that completes the grammar (checked with a fresh matcher).
        check = grammars.matcher(spec)
        for index, token in enumerate(tokens):
            if token in grammars.eos_token_ids:
                return tokens[: index + 1]
            assert check.consume_token(token)
            if check.is_stopped():
                return tokens[: index + 1]
        return tokens


@pytest.fixture(scope="module")
def masked_oracle(chat_checkpoint: Path) -> MaskedOracle:
    return MaskedOracle(chat_checkpoint)


def _params(spec: StructuredOutputsParams | None, **overrides: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, "structured_outputs": spec, **overrides})


def _check_output(out: Any, spec: StructuredOutputsParams | None, expected: list[int]) -> None:
    assert out.token_ids == expected
    if spec is None:
        return
    assert out.finish_reason == ("stop" if len(expected) < MAX_TOKENS else out.finish_reason)
    if spec.kind == "json" and out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), json.loads(spec.json or "{}"))


def _run(llm: LLM, prompts: list[list[int]], specs: list[StructuredOutputsParams | None],
         oracle: MaskedOracle) -> list[Any]:
    outputs = llm.generate(prompts, [_params(spec) for spec in specs])
    for prompt, spec, out in zip(prompts, specs, outputs):
        _check_output(out, spec, oracle.generate(prompt, spec, MAX_TOKENS))
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    return outputs


def test_a_batch_of_grammars_and_a_free_row_each_equal_transformers_with_the_mask(
    chat_checkpoint: Path, masked_oracle: MaskedOracle
) -> None:
    prompts = random_prompts([3, 17, 40, 9, 25, 30], seed=31)
    llm = LLM(model=str(chat_checkpoint), dtype="float32", num_kv_blocks=64)
    outputs = _run(llm, prompts, SPECS, masked_oracle)
    # Every grammar completed: each request ended with "stop", none ran out of tokens.
    assert [out.finish_reason for out in outputs[:5]] == ["stop"] * 5
    assert outputs[2].text in ("alpha", "beta", "gamma")
    assert isinstance(json.loads(outputs[4].text), dict)


def test_chunked_prefill_preemption_and_prefix_hits_keep_the_constrained_tokens(
    chat_checkpoint: Path, masked_oracle: MaskedOracle
) -> None:
    # (seed 32 puts two allowed tokens within 4e-6 of each other at one step: rounding decides; 43 does not.)
    prompts = random_prompts([120, 95, 70, 150, 60, 33], seed=43)
    # 16 blocks of 16 tokens for 528 prompt tokens plus their outputs: sequences are preempted and recomputed;
    # 32-token chunks; prefix caching on.
    llm = LLM(model=str(chat_checkpoint), dtype="float32", num_kv_blocks=16, block_size=16, max_num_batched_tokens=32)
    _run(llm, prompts, SPECS, masked_oracle)
    assert llm.engine.scheduler.num_preemptions > 0
    # Prefix hits: the same prompts twice on a pool that keeps them; the grammars are compiled once.
    cached = LLM(model=str(chat_checkpoint), dtype="float32", num_kv_blocks=96, block_size=16)
    _run(cached, prompts, SPECS, masked_oracle)
    compiled = cached.engine.grammar_compiler.num_compiled  # type: ignore[union-attr]
    assert compiled == 5
    again = _run(cached, prompts, SPECS, masked_oracle)
    assert [out.num_cached_tokens for out in again] == [len(prompt) // 16 * 16 for prompt in prompts]
    assert cached.engine.grammar_compiler.num_compiled == compiled  # type: ignore[union-attr]


def test_the_handoff_continues_the_grammar_from_the_first_token(chat_checkpoint: Path, masked_oracle: MaskedOracle) -> None:
    prompts = random_prompts([20, 47], seed=33)
    prefill = LLM(model=str(chat_checkpoint), dtype="float32", num_kv_blocks=64).engine
    decode = LLM(model=str(chat_checkpoint), dtype="float32", num_kv_blocks=64).engine
    for spec in SPECS[:4]:
        outputs = handoff_tokens(prefill, decode, prompts, _params(spec))
        for i, prompt in enumerate(prompts):
            assert list(outputs.values())[i] == masked_oracle.generate(prompt, spec, MAX_TOKENS), spec.kind


def test_seeded_sampling_under_a_grammar_is_reproducible_and_valid(chat_checkpoint: Path) -> None:
    llm = LLM(model=str(chat_checkpoint), dtype="float32", num_kv_blocks=64)
    prompt = random_prompts([12], seed=34)[0]
    params = _params(SPECS[0], temperature=1.0, seed=5, max_tokens=200)
    first, second = llm.generate([prompt, prompt], [params, params])
    assert first.token_ids == second.token_ids and first.finish_reason == "stop"
    jsonschema.validate(json.loads(first.text), PERSON)


def _longest_person_bytes(whitespace: int) -> int:
    """The most bytes a PERSON document can take: 8 characters of name, each at most a 6-byte \\uXXXX escape;
    a 3-digit age; "false"; "blue"; ``whitespace`` characters in each of the gaps between JSON tokens."""
    compact = '{"name":"' + "\\u0000" * 8 + '","age":120,"admin":false,"team":"blue"}'
    gaps = 2 + 4 * 2 + 3  # around the braces, each key's colon, the separating commas
    return len(compact.encode()) + whitespace * gaps


@pytest.mark.parametrize("free_layout", [False, True])
def test_a_bounded_schema_always_completes_within_its_bound(chat_checkpoint: Path, free_layout: bool) -> None:
    """Sampled at a high temperature (a small random model likes to ramble), every request completes:
    each token holds at least one byte, and the document has at most ``_longest_person_bytes`` of them."""
    bound = _longest_person_bytes(MAX_WHITESPACE_RUN if free_layout else 0)
    spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=not free_layout)
    llm = LLM(model=str(chat_checkpoint), dtype="float32", num_kv_blocks=128)
    prompts = random_prompts([10] * 8, seed=35)
    outputs = llm.generate(prompts, [_params(spec, temperature=1.5, seed=i, max_tokens=bound + 1)
                                     for i in range(len(prompts))])
    for out in outputs:
        assert out.finish_reason == "stop" and len(out.token_ids) <= bound
        document = json.loads(out.text)
        jsonschema.validate(document, PERSON)
        if not free_layout:
            assert out.text == json.dumps(document, separators=(",", ":"), ensure_ascii=False) or "\\" in out.text
        assert " " * (MAX_WHITESPACE_RUN + 1) not in out.text


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (dict(regex="a(("), "structured_outputs.regex"),
        (dict(grammar="start: missing"), "structured_outputs.grammar"),
        (dict(json='{"type": "object", "properties": {"a": {"type": "strin"}}}'), "structured_outputs.json"),
        (dict(json="{not json"), "structured_outputs.json"),
        (dict(choice=()), "structured_outputs.choice"),
        (dict(structural_tag="{}"), "structured_outputs.structural_tag"),
        (dict(regex="a", choice=("b",)), "structured_outputs"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(chat_checkpoint: Path, spec: dict[str, Any], field: str) -> None:
    with pytest.raises(GrammarError) as caught:
        check_grammar(StructuredOutputsParams(**spec))
    assert str(caught.value).startswith(field)


def test_the_engine_refuses_a_bad_spec_and_keeps_serving(chat_checkpoint: Path, llama_checkpoint: Path) -> None:
    llm = LLM(model=str(chat_checkpoint), dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex does not compile"):
        llm.generate([[5, 6, 7]], _params(StructuredOutputsParams(regex="a((")))
    (out,) = llm.generate([[5, 6, 7]], _params(StructuredOutputsParams(choice=("yes", "no"))))
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    # A checkpoint without a tokenizer cannot map a grammar to tokens.
    bare = LLM(model=str(llama_checkpoint), dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="structured_outputs needs a tokenizer"):
        bare.generate([[5, 6, 7]], _params(StructuredOutputsParams(choice=("yes",))))


def test_the_mask_sets_exactly_the_disallowed_logits_to_minus_infinity() -> None:
    words = torch.zeros((2, 3), dtype=torch.int32)  # 70 tokens: 3 words of 32 bits, the last one partly used
    words[0, 0] = 0b1011  # tokens 0, 1, 3
    words[0, 2] = 1 << 5  # token 69
    words[1, 1] = -(2**31)  # token 63: the word's top bit

    class Fixed:
        """A matcher whose mask is a fixed row of ``words``."""

        def __init__(self, row: int) -> None:
            self.row = row

        def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
            assert size == 12
            ctypes.memmove(pointer, words[self.row].numpy().tobytes(), size)

    masks = GrammarMasks(70)
    logits = torch.arange(3 * 70, dtype=torch.float32).view(3, 70)
    original = logits.clone()
    masks.apply(logits, masks.start([(0, Fixed(0), ()), (2, Fixed(1), ())]))
    minus = float("-inf")
    assert [i for i in range(70) if logits[0, i] != minus] == [0, 1, 3, 69]
    assert torch.equal(logits[1], original[1])  # an unconstrained row is untouched
    assert [i for i in range(70) if logits[2, i] != minus] == [63]
    assert logits[0, 3] == original[0, 3] and logits[0, 69] == original[0, 69] and logits[2, 63] == original[2, 63]
    masks.shutdown()


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_speculative_decoding_verifies_proposals_under_the_grammar(chat_checkpoint: Path,
                                                                   masked_oracle: MaskedOracle) -> None:
    """n-gram proposals taken from a prompt that holds JSON like the output's: each proposed position gets the
    mask after the proposed tokens before it; greedy output equals transformers' with the mask."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    text = '{"name":"ab","age":12,"admin":true,"team":"red"} {"name":"cd","age":3,"admin":false,"team":"blue"}'
    example = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = [example + random_prompts([n], seed=36 + n)[0] + example for n in (3, 11, 20)]
    specs = [SPECS[0], StructuredOutputsParams(json_object=True), SPECS[0]]
    llm = LLM(model=str(chat_checkpoint), dtype="float32", num_kv_blocks=128,
              speculative_config={**NGRAM, "disable_by_batch_size": 8})
    outputs = llm.generate(prompts, [_params(spec) for spec in specs])
    for prompt, spec, out in zip(prompts, specs, outputs):
        _check_output(out, spec, masked_oracle.generate(prompt, spec, MAX_TOKENS))
    stats = [out.spec_decode_stats for out in outputs]
    assert sum(s.num_draft_tokens for s in stats) > 0 and sum(s.num_accepted_tokens for s in stats) > 0


def test_the_masks_of_a_verifying_sequence_follow_its_proposed_tokens_and_the_matcher_rolls_back(
    chat_checkpoint: Path,
) -> None:
    from transformers import AutoTokenizer

    from pdserve.engine.structured_output import build_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    compiler = GrammarCompiler(lambda: build_tokenizer(tokenizer, VOCAB_SIZE, {7}))
    spec = StructuredOutputsParams(regex="ab(c|d)e")
    a, b, c, d, x = (tokenizer.convert_tokens_to_ids(t) for t in "abcdx")
    reference = ReferenceGrammars(chat_checkpoint)

    def mask_after(tokens: list[int]) -> list[int]:
        matcher = reference.matcher(spec)
        for token in tokens:
            assert matcher.consume_token(token)
        return reference.allowed(matcher)

    masks = GrammarMasks(VOCAB_SIZE)
    matcher = compiler.compile(spec)
    # Row 0: before any proposed token; rows 1, 2: after "a", after "a b"; "x" is refused, so row 3 repeats row 2.
    rows, words = masks.fill([(0, matcher, (a, b, x, c))])
    assert rows == [0, 1, 2, 3, 4]
    assert [reference.tokens_of(words[i].numpy()) for i in range(5)] == [
        mask_after([]), mask_after([a]), mask_after([a, b]), mask_after([a, b]), mask_after([a, b])
    ]
    assert set(mask_after([a, b])) == {c, d}
    # The matcher is where it was: "a" is still the only start.
    assert matcher.consume_token(a) and not matcher.consume_token(x)
    masks.shutdown()


def test_logprobs_are_the_allowed_distributions_and_stop_strings_still_end_the_request(chat_checkpoint: Path) -> None:
    llm = LLM(model=str(chat_checkpoint), dtype="float32", num_kv_blocks=64)
    prompt = random_prompts([14], seed=37)[0]
    spec = StructuredOutputsParams(choice=("alpha beta", "alpha gamma", "delta"))
    (out,) = llm.generate([prompt], _params(spec, logprobs=3))
    assert out.finish_reason == "stop" and out.text in spec.choice  # type: ignore[operator]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    # The mask comes first: the logprobs are the allowed tokens' distribution (a disallowed alternative has
    # -inf), the chosen token the most likely of them (greedy).
    reference = ReferenceGrammars(chat_checkpoint)
    matcher = reference.matcher(spec)
    for entry in out.logprobs:
        allowed = set(reference.allowed(matcher))
        assert entry.logprob == max(lp for _, lp in entry.top) > float("-inf")
        assert all((lp > float("-inf")) == (token in allowed) for token, lp in entry.top), entry
        assert matcher.consume_token(entry.token_id)
    # A stop string inside the grammar's output ends the request there, with "stop", the text cut before it.
    (stopped,) = llm.generate([prompt], _params(StructuredOutputsParams(regex="abc[0-9]{2}xyz"), stop=["c"]))
    assert (stopped.text, stopped.finish_reason) == ("ab", "stop")


def test_a_spec_that_does_not_compile_in_time_is_refused_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from pdserve.engine import structured_output

    released = threading.Event()

    def compiling_forever(key: Any) -> tuple[str | None, str | None]:
        released.wait(30)  # a compile that outlasts the timeout
        return "grammar", None

    monkeypatch.setattr(structured_output, "_checked", compiling_forever)
    spec = StructuredOutputsParams(json={"type": "object"}, field_name="response_format.json_schema.schema")
    structured_output.set_check_timeout(0.05)
    try:
        with pytest.raises(GrammarError, match=r"^response_format\.json_schema\.schema did not compile within 0\.05 s"):
            check_grammar(spec)
    finally:
        released.set()
        structured_output.set_check_timeout(structured_output.DEFAULT_CHECK_TIMEOUT_S)
    with pytest.raises(ValueError, match="must be > 0"):
        structured_output.set_check_timeout(0)


def test_a_request_aborted_while_its_grammar_compiles_leaves_nothing(chat_checkpoint: Path) -> None:
    llm = LLM(model=str(chat_checkpoint), dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    spec = StructuredOutputsParams(json={"type": "object", "properties": {"late": {"type": "integer"}}})
    request_id = engine.add_request([5, 6, 7], _params(spec))
    # Never compiled before: the request waits outside the scheduler's queue (or joined it if the compile won).
    aborted = engine.abort_request(request_id)
    assert aborted is not None and aborted.finish_reason == "abort" and aborted.token_ids == []
    assert not engine.has_unfinished_requests() and engine.step() == []
    assert engine.stats().num_waiting == 0
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_a_structural_tag_leaves_text_free_and_holds_what_a_trigger_opens(chat_checkpoint: Path) -> None:
    from transformers import AutoTokenizer

    from pdserve.engine.structured_output import build_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_checkpoint)
    compiler = GrammarCompiler(lambda: build_tokenizer(tokenizer, VOCAB_SIZE, {7}))
    tag = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": "<function=get_weather>", "end": "</function>",
         "schema": {"type": "object", "properties": {"city": {"enum": ["paris", "rome"]}}, "required": ["city"],
                    "additionalProperties": False}}]}
    matcher = compiler.compile(StructuredOutputsParams(structural_tag=tag))
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731

    def allowed() -> set[int]:
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)
        return set(np.flatnonzero(GrammarMasks.allowed(torch.from_numpy(words.copy())[None], VOCAB_SIZE)[0]).tolist())

    assert matcher.consume_tokens(ids("any text at all, ")) and ids("x")[0] in allowed()  # free before a trigger
    assert matcher.consume_tokens(ids("<function=get_weather>"))
    assert allowed() == set(ids("{"))  # the trigger opened the structure: its JSON comes next
    assert matcher.validate_tokens(ids('{"city":"london"}')) < len(ids('{"city":"london"}'))  # not in the enum
    assert matcher.consume_tokens(ids('{"city":"rome"}</function>'))
    assert ids("x")[0] in allowed()  # free text again
    # Through the engine: the request is served, its text free unless a trigger appears.
    llm = LLM(model=str(chat_checkpoint), dtype="float32", num_kv_blocks=64)
    (out,) = llm.generate([[5, 6, 7]], _params(StructuredOutputsParams(structural_tag=tag), max_tokens=12))
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
