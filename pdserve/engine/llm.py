"""The offline API: ``LLM(...).generate(prompts, SamplingParams(...))``, named as in vLLM."""

from __future__ import annotations

from typing import Any
from typing import Sequence as Seq

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.types.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pdserve.engine.types.lora import LoRAConfig, LoRARequest
from pdserve.engine.types.outputs import RequestOutput
from pdserve.engine.types.sampling_params import SamplingParams
from pdserve.engine.types.speculative import SpeculativeConfig

# A prompt: text, token ids, or vLLM's prompt dicts ({"prompt": ...} / {"prompt_token_ids": [...]}).
PromptInput = str | list[int] | dict[str, Any]


class LLM:
    """Runs a model in this process and generates for a batch of prompts with continuous batching.

    ``model`` is a local folder, a hub id, or None for the embedded default
    (SmolLM2-135M-Instruct). ``num_kv_blocks=None`` sizes the KV pool from
    available memory. ``speculative_config`` (vLLM's shape, e.g. ``{"method": "ngram",
    "num_speculative_tokens": 4}``; see ``engine.spec_decode.SpeculativeConfig``)
    turns on speculative decoding. ``tensor_parallel_size=N`` runs the model over N ranks
    (this process and N-1 it starts; pdserve/engine/parallel/): call ``shutdown()`` or use the
    ``LLM`` as a context manager to stop them. Invalid arguments raise ``ValueError``
    naming the argument.
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        *,
        device: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        attention_backend: str = "auto",
        kv_memory_fraction: float | None = None,
        quantization: str | None = None,
        quantization_group_size: int = 32,
        quantize_lm_head: bool = True,
        enforce_eager: bool = False,
        kv_cache_dtype: str = "auto",
        disable_hybrid_kv_cache_manager: bool = False,
        speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
        tensor_parallel_size: int = 1,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
    ) -> None:
        config = EngineConfig(
            model=ModelConfig(
                model=model,
                dtype=dtype,
                device=device,
                max_model_len=max_model_len,
                seed=seed,
                attention_backend=attention_backend,
                quantization=quantization,
                quantization_group_size=quantization_group_size,
                quantize_lm_head=quantize_lm_head,
                enforce_eager=enforce_eager,
            ),
            cache=CacheConfig(
                block_size=block_size,
                num_kv_blocks=num_kv_blocks,
                enable_prefix_caching=enable_prefix_caching,
                kv_memory_fraction=kv_memory_fraction,
                kv_cache_dtype=kv_cache_dtype,
                disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
            ),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            speculative_config=(
                speculative_config
                if speculative_config is None or isinstance(speculative_config, SpeculativeConfig)
                else SpeculativeConfig.from_dict(speculative_config)
            ),
            lora_config=LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None,
        )
        self.engine = LLMEngine(config)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any; idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An ``LLM`` from a full engine configuration (what the CLI builds)."""
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One finished ``RequestOutput`` per prompt, in input order.

        ``prompts`` is a string, a list of token ids, a vLLM prompt dict (``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}``), or a list of any of these. ``lora_request`` (vLLM's): the LoRA adapter
        every prompt runs under, or one per prompt (None: the base model); needs ``enable_lora=True``.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list: list[LoRARequest | None] = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(f"lora_request has {len(lora_list)} entries for {len(prompt_list)} prompts")
        request_ids = []
        try:
            for prompt, params, lora in zip(prompt_list, params_list, lora_list):
                request_ids.append(self.engine.add_request(prompt, params, lora_request=lora))
        except Exception:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in request_ids]

    def chat(
        self,
        conversations: Seq[dict[str, str]] | Seq[Seq[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to chat conversations, rendered with the tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template, and this checkpoint has none")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [
            list(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
            for messages in conversations
        ]
        return self.generate(prompts, sampling_params)


def _as_prompt_list(prompts: PromptInput | Seq[PromptInput]) -> list[str | list[int]]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompt_list = list(prompts)
    if not prompt_list:
        raise ValueError("prompts must not be empty")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt_list):
        return [prompt_list]  # one prompt given as token ids
    for prompt in prompt_list:
        if not isinstance(prompt, (str, list, tuple, dict)):
            raise ValueError(
                f"prompts must be strings, lists of token ids or prompt dicts, got {type(prompt).__name__}"
            )
    return [_from_dict(p) if isinstance(p, dict) else p if isinstance(p, str) else list(p) for p in prompt_list]


def _from_dict(prompt: dict[str, Any]) -> str | list[int]:
    """vLLM's prompt dicts: ``{"prompt": text}`` (TextPrompt) or ``{"prompt_token_ids": ids}`` (TokensPrompt)."""
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if unknown:
        raise ValueError(f"prompt dict keys {unknown} are not supported (supported: 'prompt', 'prompt_token_ids')")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of 'prompt' (text) or 'prompt_token_ids' (token ids)")
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompt must be a string, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"]
    return list(prompt["prompt_token_ids"])
