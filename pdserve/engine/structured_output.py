"""Structured output: a request's tokens held to a JSON schema, a regex, a list of choices or a grammar.

The grammar engine is llguidance (the Rust engine of Microsoft's guidance, also behind llama.cpp's
``--grammar`` and vLLM's ``guidance`` backend): it reads JSON schemas, regexes, Lark and GBNF grammars,
and keeps one ``LLMatcher`` per request whose token mask is exact for the model's own tokenizer.
docs/structured-output.md says why llguidance rather than xgrammar.

- ``StructuredOutputsParams`` (pdserve/engine/types/structured_outputs.py) is what a request asks, with
  vLLM's names (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``; ``disable_any_whitespace``),
  checked where it is built.
- ``grammar_of`` turns it into llguidance's grammar text and ``check_grammar`` validates that text without a
  tokenizer (the gateway does, before a request is accepted); errors name the field.
- ``GrammarCompiler`` (one per engine) builds matchers off the engine thread, at most one compile per
  distinct spec: a compiled matcher is kept (least recently used out) and each request gets a copy.
- ``RequestGrammar`` is one request's matcher: built from the compiled one on first use, after consuming
  the output tokens the request already has (a request prefilled elsewhere comes with its first token).
- ``engine.grammar_masks.GrammarMasks`` fills a step's token masks on its own thread while the model's
  forward runs and applies them to the logits before the sampler.

This module imports neither torch nor llguidance at import time: the gateway checks specs with it.

JSON is generated without free whitespace unless ``disable_any_whitespace=False``, which allows at most
``MAX_WHITESPACE_RUN`` whitespace characters in a row: a schema whose strings, numbers and arrays are
bounded then always completes in a bounded number of tokens.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pdserve.engine.types.structured_outputs import GrammarError, StructuredOutputsParams, structural_tag_structures

# Free-layout JSON allows this many whitespace characters in a row, no more.
MAX_WHITESPACE_RUN = 4
# Compiled grammars kept per engine (least recently used out).
GRAMMAR_CACHE_SIZE = 256
# How long ``check_grammar`` waits for a spec to compile before refusing it (the gateway's
# --structured-outputs-timeout sets it for its process).
DEFAULT_CHECK_TIMEOUT_S = 10.0
def _json_options(params: StructuredOutputsParams) -> dict[str, Any]:
    if params.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    return {"whitespace_pattern": f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_WHITESPACE_RUN}}}"}


def _struct_tags(text: str, where: str) -> list[Any]:
    """vLLM's structural tag as llguidance's ``StructTag`` list: each structure under the trigger its ``begin``
    starts with. ``GrammarError`` naming what is wrong."""
    from llguidance import StructTag

    return [StructTag(trigger=s.trigger, begin=s.begin, grammar=s.schema, end=s.end)
            for s in structural_tag_structures(text, where)]


def grammar_of(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for ``params`` (not yet validated: ``check_grammar``)."""
    from llguidance import LLMatcher, grammar_from

    kind = params.kind
    where = params.where
    try:
        if kind == "json":
            assert isinstance(params.json, str)
            return LLMatcher.grammar_from_json_schema(params.json, overrides=_json_options(params))
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=_json_options(params))
        if kind == "regex":
            assert params.regex is not None
            return LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return grammar_from("choice", json.dumps(list(params.choice or ())))
        if kind == "grammar":
            assert params.grammar is not None
            return grammar_from("grammar", params.grammar)
    except (ValueError, TypeError) as error:
        raise GrammarError(f"{where}: {error}") from None
    if kind == "structural_tag":
        from llguidance import StructTag

        assert isinstance(params.structural_tag, str)
        return StructTag.to_grammar(_struct_tags(params.structural_tag, where), assume_special=False)
    raise AssertionError(kind)  # __post_init__ admits no other kind


_check_timeout_s = DEFAULT_CHECK_TIMEOUT_S
_checker = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-grammar-check")


def set_check_timeout(seconds: float) -> None:
    """How long ``check_grammar`` waits for a compile, for this process; ``ValueError`` unless > 0."""
    global _check_timeout_s
    if not seconds > 0:
        raise ValueError(f"the structured-output compile timeout must be > 0 seconds, got {seconds!r}")
    _check_timeout_s = seconds


def check_grammar(params: StructuredOutputsParams) -> str:
    """The grammar text of ``params`` once llguidance accepts it; ``GrammarError`` naming the field with
    llguidance's reason otherwise, or when it takes longer than the check timeout (``set_check_timeout``) to
    compile. Needs no tokenizer: the gateway checks requests with it. The verdicts of the last
    ``GRAMMAR_CACHE_SIZE`` distinct specs are kept."""
    pending = _checker.submit(_checked, params.key)
    try:
        grammar, error = pending.result(timeout=_check_timeout_s)
    except concurrent.futures.TimeoutError:
        raise GrammarError(f"{params.where} did not compile within {_check_timeout_s:g} s") from None
    if error is not None:
        raise GrammarError(f"{params.where} does not compile: {error}")
    assert grammar is not None
    return grammar


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _checked(key: tuple[str, str, bool]) -> tuple[str | None, str | None]:
    """(grammar, None) or (None, llguidance's reason) for a spec's ``key``."""
    from llguidance import LLMatcher

    kind, text, disable_any_whitespace = key
    value: Any = tuple(json.loads(text)) if kind == "choice" else (True if kind == "json_object" else text)
    params = StructuredOutputsParams(**{kind: value}, disable_any_whitespace=disable_any_whitespace)
    try:
        grammar = grammar_of(params)
    except GrammarError as error:
        return None, str(error).split(": ", 1)[-1]
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        return None, messages[0]
    return grammar, None


def build_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> Any:
    """llguidance's view of the model's tokenizer: ``vocab_size`` mask bits (the logits' width: ids past the
    tokenizer's own are never allowed), the engine's end-of-sequence ids as the grammar's end."""
    import llguidance.hf

    eos = sorted(eos_token_ids) or None
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)


class GrammarCompiler:
    """Matchers for structured-output specs, compiled on a thread of their own and kept by spec.

    ``submit`` returns a future of a fresh matcher (a copy of the cached one where the spec was compiled
    before); the engine thread never waits on a compile. The llguidance tokenizer is built on the first
    spec (0.3-0.5 s for a 49k vocabulary), on that thread too."""

    def __init__(self, tokenizer_factory: Callable[[], Any], cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-grammar")
        self.num_compiled = 0  # distinct specs compiled (cache misses)

    def submit(self, params: StructuredOutputsParams) -> Future[Any]:
        with self._lock:
            cached = self._cache.get(params.key)
            if cached is not None:
                self._cache.move_to_end(params.key)
                done: Future[Any] = Future()
                done.set_result(cached.deep_copy())
                return done
        return self._executor.submit(self._compile, params)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """A matcher for ``params``, compiled on the calling thread (or copied from the cache)."""
        return self.submit(params).result()

    def _compile(self, params: StructuredOutputsParams) -> Any:
        from llguidance import LLMatcher

        with self._lock:
            cached = self._cache.get(params.key)
            if cached is not None:
                return cached.deep_copy()
        if self._tokenizer is None:
            self._tokenizer = self._tokenizer_factory()
        matcher = LLMatcher(self._tokenizer, check_grammar(params), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{params.where} does not compile: {matcher.get_error()}")
        with self._lock:
            self._cache[params.key] = matcher
            self.num_compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher.deep_copy()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's grammar state: the compile's future, then its matcher, advanced token by token.

    With ``activation`` (the token ids of the spec's ``reasoning_end``), the grammar holds only the tokens after
    the first place the output holds them: until then ``matcher`` is None and the row samples freely.
    A compile that failed, or an output token the grammar refuses, leaves ``error`` set: the engine then
    ends the request ("abort") instead of generating unconstrained."""

    def __init__(self, params: StructuredOutputsParams, compiled: Future[Any], activation: tuple[int, ...] = ()) -> None:
        self.params = params
        self.compiled = compiled
        self.activation = activation
        self._matcher: Any = None
        self.error: str | None = None

    @property
    def is_ready(self) -> bool:
        """Whether the matcher can be had without waiting (the compile is done, or failed)."""
        return self._matcher is not None or self.error is not None or self.compiled.done()

    def matcher(self, output_token_ids: list[int]) -> Any:
        """The matcher, in the state after the output tokens it holds (consumed on first use; waits for the
        compile if it is still running); None while the grammar is not active yet, or once ``error`` is set."""
        if self._matcher is None and self.error is None:
            start = self._start(output_token_ids)
            if start is None:
                return None
            try:
                matcher = self.compiled.result()
            except Exception as error:  # noqa: BLE001 - kept and reported as the request's end
                self.error = f"{self.params.where} did not compile: {error}"
                return None
            for index in range(start, len(output_token_ids)):
                token_id = output_token_ids[index]
                if not matcher.consume_token(token_id):
                    self.error = (f"output token {index} (id {token_id}) breaks {self.params.where}: "
                                  f"{matcher.get_error()}")
                    return None
            self._matcher = matcher
        return self._matcher

    def _start(self, output_token_ids: list[int]) -> int | None:
        """Where the grammar's tokens begin in the output: 0, or after the first ``activation``; None: not yet."""
        marker = list(self.activation)
        if not marker:
            return 0
        for index in range(len(output_token_ids) - len(marker) + 1):
            if output_token_ids[index : index + len(marker)] == marker:
                return index + len(marker)
        return None

    def advance(self, token_id: int) -> bool:
        """Consume the sampled ``token_id``; whether the request must end: the grammar is complete (nothing
        but the end may follow), or it refused the token (``error`` set; the mask allows none such). Before the
        grammar is active (the step's ``matcher`` was None) the token is free, and consumed when it activates."""
        matcher = self._matcher
        if matcher is None:
            return self.error is not None
        if not matcher.consume_token(token_id):
            self.error = f"token id {token_id} breaks {self.params.where}: {matcher.get_error()}"
            return True
        return bool(matcher.is_stopped())
