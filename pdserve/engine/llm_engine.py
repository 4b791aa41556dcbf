"""The engine: requests in, one ``step()`` at a time, outputs out.

``step()`` reads like the pipeline: schedule, run the model and sample, update.
The engine is single-threaded and knows nothing of asyncio or gRPC; the offline
``LLM`` drives it in a loop, the services drive it from a worker thread.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.engine.attention.selector import select_backend
from pdserve.engine.default_model import DEFAULT_MODEL_ID
from pdserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from pdserve.engine.kv.block_manager import BlockEvent, BlockManager
from pdserve.engine.kv.cache import KVCache, bytes_per_block, resolve_kv_cache_dtype, size_kv_pool
from pdserve.engine.kv.connector import ConnectorParts, DecodeKVConnector
from pdserve.engine.kv.handoff import dtype_name
from pdserve.engine.kv.leases import LeaseTable
from pdserve.engine.kv.pages import PagedBlockManager, PageLayout
from pdserve.engine.kv.push import LayerPusher
from pdserve.engine.lora import LoRAManager
from pdserve.engine.model_loader import TORCH_DTYPES, load_eos_token_ids, load_hf_config, load_model, resolve_model_path
from pdserve.engine.model_runner import ModelRunner, StepResult
from pdserve.engine.native import cpu_has_native_bf16
from pdserve.engine.parallel.kv_shards import ShardedKV, import_on_ranks
from pdserve.engine.parallel.sharding import TensorParallelShard, check_tensor_parallel, kv_heads_of_rank
from pdserve.engine.parallel.workers import TensorParallelWorkers
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode.decoder import SpecDecoder, build_spec_decoder, load_draft
from pdserve.engine.spec_decode.draft_model import DraftTarget
from pdserve.engine.step_trace import StepTrace
from pdserve.engine.structured_output import GrammarCompiler, RequestGrammar, build_tokenizer, check_grammar
from pdserve.engine.types.config import EngineConfig
from pdserve.engine.types.handoff import KVHandoff, KVHoldParams, KVLayout
from pdserve.engine.types.hashing import BlockHash, adapter_model_id
from pdserve.engine.types.lora import LoRARequest
from pdserve.engine.types.outputs import EngineStats, RequestOutput, SpecDecodeStats, TokenLogprobs
from pdserve.engine.types.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """One model on one device with its KV pool, scheduler and sampler."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_cfg, cache_cfg = config.model, config.cache
        self.model_path: Path = resolve_model_path(model_cfg.model)
        self.model_id = DEFAULT_MODEL_ID if model_cfg.model in (None, "default") else str(model_cfg.model)
        hf_config = load_hf_config(self.model_path)
        self.hf_config = hf_config
        self.device = _resolve_device(model_cfg.device)
        self.dtype = _resolve_dtype(model_cfg.dtype, self.device)
        max_positions = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        self.max_model_len = model_cfg.max_model_len or max_positions
        if max_positions and self.max_model_len > max_positions:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) exceeds the model's max_position_embeddings ({max_positions})"
            )
        self.vocab_size = int(hf_config.vocab_size)

        self.kv_cache_dtype = resolve_kv_cache_dtype(cache_cfg.kv_cache_dtype, self.dtype)
        self.tensor_parallel_size = tp = config.parallel.tensor_parallel_size
        self.parallel: TensorParallelWorkers | None = None
        if tp > 1:
            check_tensor_parallel(hf_config, tp)
            _check_parallel_features(config)
            # Started first: the other ranks load their shards while this one loads its own.
            self.parallel = TensorParallelWorkers(
                config, str(self.model_path), self.dtype, self.device, self.kv_cache_dtype, self.max_model_len
            )
        try:
            self._build(config, hf_config)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, hf_config: object) -> None:
        model_cfg, cache_cfg = config.model, config.cache
        tp = self.tensor_parallel_size
        self.model = load_model(
            self.model_path, hf_config, self.max_model_len, self.dtype, self.device,
            model_cfg.quantization, model_cfg.quantization_group_size, model_cfg.quantize_lm_head,
            shard=TensorParallelShard(0, tp) if tp > 1 else None, enforce_eager=model_cfg.enforce_eager,
        )
        self.tokenizer = _load_tokenizer(self.model_path)
        self.eos_token_ids = load_eos_token_ids(self.model_path, hf_config)
        # A draft model is loaded before the pool is sized: its weights and its parallel KV pool share the memory.
        spec_config = config.speculative_config
        draft = load_draft(spec_config, self._draft_target()) if spec_config else None

        block_size = cache_cfg.block_size
        num_layers = int(hf_config.num_hidden_layers)
        # This rank's KV heads (all of them without tensor parallelism): every rank's pool has num_blocks blocks.
        block_bytes = bytes_per_block(
            num_layers, block_size, self.model.num_kv_heads, self.model.head_dim, self.kv_cache_dtype,
            self.model.kv_parts,
        ) + (draft.block_bytes if draft else 0)
        max_useful = config.scheduler.max_num_seqs * -(-self.max_model_len // block_size)
        fraction = cache_cfg.kv_memory_fraction or (0.8 if self.device.type == "cuda" else 0.1)
        num_blocks = cache_cfg.num_kv_blocks or size_kv_pool(block_bytes, fraction, self.device, max_useful)
        # Sliding-window layers free what their window has left behind (engine.kv.pages; every rank's pool
        # alike under tensor parallelism) unless disabled, or with a draft model (whose pool shares the block
        # ids); there every layer keeps every block.
        windows = [layer.self_attn.window for layer in self.model.model.layers]
        paged = draft is None and not cache_cfg.disable_hybrid_kv_cache_manager
        layout = PageLayout.of(windows) if paged else None
        self.kv_cache = KVCache(
            num_layers, num_blocks, block_size, self.model.num_kv_heads, self.model.head_dim, self.kv_cache_dtype,
            self.device, self.model.kv_parts, layout,
        )
        if layout is not None:
            self.block_manager: BlockManager = PagedBlockManager(
                num_blocks, block_size, layout, cache_cfg.enable_prefix_caching
            )
            self.kv_cache.page_map = self.block_manager
        else:
            sliding = [window for window in windows if window is not None]
            self.block_manager = BlockManager(
                num_blocks, block_size, cache_cfg.enable_prefix_caching, max(sliding) if sliding else None
            )
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        backend = select_backend(model_cfg.attention_backend, self.device, self.dtype, self.kv_cache_dtype)
        if self.model.kv_parts == 1 and backend.name == "flash_attn":
            raise ValueError("attention_backend 'flash_attn' does not serve latent attention (MLA): its latent rows "
                             "exceed flash-attn's head sizes; use 'sdpa' (or 'cpu_paged' on CPU)")
        sampler = Sampler(model_cfg.seed, self.eos_token_ids)
        if self.parallel is not None:
            self.parallel.connect(num_blocks, layout is not None)
            self.parallel.install(self.model)
        self.runner = ModelRunner(self.model, self.kv_cache, backend, sampler, self.device, self.parallel)
        # LoRA adapters: the model's projections wrapped, adapters loaded on first use (None: off).
        self.lora: LoRAManager | None = None
        if config.lora_config is not None:
            _check_lora_features(config)
            self.lora = self.runner.lora = LoRAManager(self.model, config.lora_config)
        self.scheduler.on_finish = self._finished
        # Requests whose adapter waits for a slot (every slot pinned by other adapters' requests).
        self._lora_waiting: list[Sequence] = []
        self._lora_remote: set[str] = set()  # ids of those waiting whose prompt KV comes from another engine
        # Structured output: grammars compiled off the engine thread, once per distinct spec (None: no tokenizer).
        self.grammar_compiler = GrammarCompiler(self._grammar_tokenizer) if self.tokenizer is not None else None
        # Requests whose grammar is still compiling: they join the scheduler's queue when it is done.
        self._compiling: list[Sequence] = []
        # The model's KV heads (all ranks together): what a handoff carries.
        self.kv_layout = KVLayout(
            num_layers=num_layers,
            num_kv_heads=self.model.total_kv_heads,
            head_dim=self.model.head_dim,
            block_size=block_size,
            dtype=dtype_name(self.kv_cache_dtype),
            kv_parts=self.model.kv_parts,
        )
        # Requests held with push=True hand each layer's KV to its sink as it is written.
        self.kv_pusher = LayerPusher(self.model.model.layers, self.kv_cache, block_size)
        self.spec_decoder: SpecDecoder | None = None
        if spec_config is not None:
            self.spec_decoder = build_spec_decoder(spec_config, draft, num_blocks, self.max_model_len, self.vocab_size)
        self.step_trace = StepTrace.from_env()  # PDSERVE_STEP_TRACE_DIR: each step timed, to a file
        self.draft = draft
        # Set: held requests get the draft's prompt KV too, handed over as the handoff's draft section.
        self._handoff_draft = draft if config.handoff_draft_kv else None
        # Finished requests whose blocks stay pinned for a decode worker: owned there alone.
        exported = self.kv_cache if self.parallel is None else ShardedKV(self.kv_cache, self.parallel,
                                                                          self.kv_layout.num_kv_heads)
        # One deadline for whatever a handoff holds that nobody claims: a lease here, a push or an early
        # start on the decode side (kv_connector, decode_service.early_start).
        self.kv_handoff_timeout_s = config.kv_handoff_timeout_s
        self.leases = LeaseTable(
            self.block_manager, exported, self.kv_handoff_timeout_s,
            draft_kv_cache=self._handoff_draft.kv_cache if self._handoff_draft is not None else None,
        )
        self._requests: dict[str, Sequence] = {}
        # The decode side of handoffs: requests prefilled elsewhere and the KV pushed here for them.
        self.kv_connector = DecodeKVConnector(ConnectorParts(
            host=self, queue=self.scheduler, block_manager=self.block_manager, kv_cache=self.kv_cache,
            kv_layout=self.kv_layout, timeout_s=self.kv_handoff_timeout_s, draft=draft,
            import_on_ranks=None if self.parallel is None else functools.partial(import_on_ranks, self.parallel),
        ))
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._request_counter = itertools.count()

    def _draft_target(self) -> DraftTarget:
        """What a draft model must agree with: this engine's vocabulary, pool geometry and device."""
        config = self.config
        return DraftTarget(
            model_id=self.model_id,
            vocab_size=self.vocab_size,
            block_size=config.cache.block_size,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            device=self.device,
            attention_backend=config.model.attention_backend,
            max_num_seqs=config.scheduler.max_num_seqs,
            enforce_eager=config.model.enforce_eager,
        )

    @property
    def local_kv_heads(self) -> range:
        """The KV heads (global indices) this process's pool holds: rank 0's, or all of them."""
        return kv_heads_of_rank(self.kv_layout.num_kv_heads, self.tensor_parallel_size, 0)

    def check_ranks(self) -> None:
        """``TensorParallelError`` when one of the engine's other ranks has died (nothing to check with one)."""
        if self.parallel is not None:
            self.parallel.check_alive()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do with one rank) and the grammar threads;
        idempotent."""
        compiler = getattr(self, "grammar_compiler", None)
        if compiler is not None:
            compiler.shutdown()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.shutdown()
        parallel, self.parallel = self.parallel, None
        if parallel is not None:
            parallel.shutdown()

    # ---- requests ------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"prompt text needs a tokenizer, and the checkpoint at {self.model_path} has none")
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        hold_kv: KVHoldParams | None = None,
        lora_request: LoRARequest | None = None,
        resume_token_ids: list[int] | tuple[int, ...] = (),
    ) -> str:
        """Queue a request; returns its id. Raises ``ValueError`` naming the bad argument.

        ``hold_kv``: when the request finishes, its blocks go to ``leases``
        (pinned until released or expired) and its last output carries the
        ``KVHandoff`` — what a prefill worker does while a decode worker fetches them.
        ``lora_request``: the LoRA adapter the request runs under (None: the base model).
        ``resume_token_ids``: output the request already generated elsewhere (a stream moved from a worker that
        failed): computed here after the prompt, as a preempted request's are, and continued from, with a seeded
        request's random stream where it stood and its stop strings, grammar and limits counting them.
        """
        request_id = self.new_request_id(request_id)
        token_ids = self.validate_request(prompt, params)
        self._check_resume(resume_token_ids, params)
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("lora_request needs an engine built with LoRA (enable_lora=True)")
            self.lora.load(lora_request)  # ValueError naming the adapter when it cannot be served
        seq = self.new_sequence(request_id, token_ids, params, num_draws_done=len(resume_token_ids),
                                lora_request=lora_request)
        for token_id in resume_token_ids:
            seq.append_token(token_id)
        seq.kv_hold = hold_kv
        self.register(seq)
        if seq.grammar is not None and not seq.grammar.is_ready:
            # Queued once its grammar is compiled (_admit_compiled): it holds up nothing meanwhile.
            self._compiling.append(seq)
        else:
            self._queue(seq)
        return request_id

    def _check_resume(self, resume_token_ids: list[int] | tuple[int, ...], params: SamplingParams) -> None:
        if len(resume_token_ids) >= params.max_tokens:
            raise ValueError(f"resume_token_ids holds {len(resume_token_ids)} tokens: nothing is left of max_tokens "
                             f"({params.max_tokens})")
        for token_id in resume_token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < self.vocab_size:
                raise ValueError(f"resume token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})")

    def _queue(self, seq: Sequence, remote: bool = False) -> None:
        """Into the scheduler's queue, once the request's adapter (if any) holds a slot; else it waits for one.
        ``remote``: its prompt KV comes from another engine (``Scheduler.add_remote``)."""
        if seq.lora_request is not None and seq.lora_slot is None:
            if self.lora is None:
                raise ValueError(f"LoRA adapter {seq.lora_request.lora_name!r}: this worker serves no LoRA adapters "
                                 "(start it with --enable-lora)")
            seq.lora_slot = self.lora.acquire(seq.lora_request)
            if seq.lora_slot is None:
                self._lora_waiting.append(seq)
                if remote:
                    self._lora_remote.add(seq.request_id)
                return
        if remote:
            self.scheduler.add_remote(seq)
        else:
            self.scheduler.add(seq)


    def _admit_lora_waiting(self) -> None:
        """Requests whose adapter can have a slot now join the queue, in arrival order."""
        waiting, self._lora_waiting = self._lora_waiting, []
        for seq in waiting:
            remote = seq.request_id in self._lora_remote
            self._lora_remote.discard(seq.request_id)
            self._queue(seq, remote)

    def _finished(self, seq: Sequence) -> None:
        if seq.lora_slot is not None:
            assert self.lora is not None
            self.lora.release(seq.lora_slot)
            seq.lora_slot = None

    def _grammar_tokenizer(self) -> object:
        return build_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar finished compiling; end (abort) those whose compile failed.
        With nothing else to run, waits a little for a compile rather than spin."""
        if not self._compiling:
            return []
        if not self.scheduler.has_work():
            concurrent.futures.wait([seq.grammar.compiled for seq in self._compiling if seq.grammar is not None],
                                    timeout=0.005, return_when=concurrent.futures.FIRST_COMPLETED)
        outputs = []
        still = []
        for seq in self._compiling:
            assert seq.grammar is not None
            if not seq.grammar.is_ready:
                still.append(seq)
                continue
            if seq.grammar.matcher(seq.output_token_ids) is None and seq.grammar.error is not None:
                logger.error("request %s aborted: %s", seq.request_id, seq.grammar.error)
                outputs.append(self._end(seq, "abort"))
                continue
            self._queue(seq)
        self._compiling = still
        return outputs

    def _end(self, seq: Sequence, reason: str) -> RequestOutput:
        """Finish ``seq`` outside a step (freeing its blocks) and forget it; its final output."""
        self.scheduler.finish(seq, reason)
        self._requests.pop(seq.request_id, None)
        return self._output(seq, self._detokenizers.pop(seq.request_id, None))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish ``request_id`` with reason "abort" and free its blocks now (held ones too); None if unknown."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            # Finished already, its KV held for a decode worker that will not come.
            self.leases.release(request_id)
            return None
        self.kv_pusher.end(request_id, complete=False)
        self.kv_connector.request_finished(request_id)
        if seq in self._compiling:
            self._compiling.remove(seq)
        if seq in self._lora_waiting:
            self._lora_waiting.remove(seq)
            self._lora_remote.discard(seq.request_id)
        self.scheduler.finish(seq, "abort")
        return self._output(seq, self._detokenizers.pop(request_id, None))

    def expire_unclaimed(self) -> None:
        """End what handoffs hold past the handoff deadline that nobody claimed: leases on KV held here
        for a decode worker, KV pushed here for a request that never came."""
        self.leases.expire()
        self.kv_connector.expire()

    def stats(self) -> EngineStats:
        scheduler, manager, spec = self.scheduler, self.block_manager, self.spec_decoder
        return EngineStats(
            # A request whose KV is on its way holds its blocks and runs at the next step after it lands.
            num_running=len(scheduler.running) + len(scheduler.receiving),
            num_waiting=scheduler.num_waiting + len(self._compiling) + len(self._lora_waiting),
            num_queued_tokens=scheduler.num_queued_tokens,
            num_free_blocks=manager.num_free_blocks,
            num_total_blocks=manager.num_blocks,
            num_held=len(self.leases),
            num_preemptions=scheduler.num_preemptions,
            num_pushed=len(self.kv_connector.pushes),
            num_pushed_bytes=self.kv_connector.pushes.num_bytes,
            num_expired_leases=self.leases.num_expired,
            num_expired_pushes=self.kv_connector.pushes.num_expired,
            spec_num_drafts=spec.num_drafts if spec else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            lora_adapters=tuple(self.lora.held()) if self.lora is not None else (),
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def between_layers(self) -> Callable[[], None] | None:
        """Called on the engine thread between two decoder layers of a step that runs layer by layer (every
        step but a fused decode step's): a worker's OpenMP spin governor (pdserve/shared_cores/openmp.py) follows the other
        processes through a multi-second prefill step with it, not only from one step to the next."""
        return self.model.between_layers

    @between_layers.setter
    def between_layers(self, fn: Callable[[], None] | None) -> None:
        self.model.between_layers = fn

    def has_work(self) -> bool:
        """Whether ``step()`` may do anything now: false while every request only waits for remote KV."""
        return self.scheduler.has_work() or bool(self._compiling) or bool(self._lora_waiting)

    def next_step_has_room_for_prompts(self) -> bool:
        """Whether prompts wait here and the next step could take more: see ``Scheduler``'s."""
        return self.scheduler.next_step_has_room_for_prompts()

    def drain_block_events(self) -> list[BlockEvent]:
        """Prefix blocks stored and evicted since the last call (for the cluster index)."""
        return self.block_manager.drain_events()

    # ---- the step --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that got a token (or finished) in it."""
        admitted = self._admit_compiled()
        if self._lora_waiting:
            self._admit_lora_waiting()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return admitted
        traced = self.step_trace.begin() if self.step_trace is not None else None
        spec = self.spec_decoder
        started = spec.step_started() if spec else 0.0
        generator_states = spec.save_generators(scheduler_output) if spec else {}
        self.kv_pusher.begin_step(scheduler_output.scheduled, scheduler_output.preempted)
        try:
            result = self.runner.execute(scheduler_output)
            self.scheduler.complete_step(scheduler_output)
            outputs = self._update(result, generator_states, spec)
        finally:
            self.kv_pusher.end_step()
        if spec is not None:
            spec.observe_step(scheduler_output, started)
            spec.propose(self.scheduler)
        if traced is not None:
            assert self.step_trace is not None
            self.step_trace.end(traced, len(scheduler_output.scheduled), scheduler_output.num_batched_tokens)
        return admitted + outputs

    def _update(
        self, result: StepResult, generator_states: dict[str, torch.Tensor], spec: SpecDecoder | None
    ) -> list[RequestOutput]:
        for seq, entries in result.prompt_logprobs:
            assert seq.prompt_logprobs is not None
            seq.prompt_logprobs.extend(entries)
        sampled = result.sampled
        if sampled is None:
            return []
        token_ids = sampled.token_ids.tolist()
        logprobs = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        top_ids = sampled.top_token_ids.tolist() if sampled.top_token_ids is not None else None
        top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        outputs = []
        proposals = result.spec_token_ids or ((),) * len(result.sampled_seqs)
        first_row = 0
        for seq, proposal in zip(result.sampled_seqs, proposals):
            samples = token_ids[first_row : first_row + 1 + len(proposal)]
            num_accepted = SpecDecoder.num_accepted(samples, proposal)
            detokenizer = self._detokenizers.get(seq.request_id)
            # The accepted proposed tokens, then the target's own: appended one by
            # one so that a stop condition cuts the run where plain decoding would stop.
            num_appended = 0
            for row in range(first_row, first_row + num_accepted + 1):
                token_id = token_ids[row]
                num_appended += 1
                seq.append_token(token_id)
                if seq.logprobs is not None and logprobs is not None:
                    n = seq.params.logprobs or 0
                    top = tuple(zip(top_ids[row][:n], top_lps[row][:n])) if top_ids is not None else ()
                    seq.logprobs.append(TokenLogprobs(token_id, logprobs[row], top))
                reason = self._finish_reason(seq, token_id, detokenizer)
                if seq.grammar is not None and reason is None and seq.grammar.advance(token_id):
                    # The grammar is complete (only the end could follow), or it failed (logged, aborted).
                    reason = "stop" if seq.grammar.error is None else "abort"
                    if seq.grammar.error is not None:
                        logger.error("request %s aborted: %s", seq.request_id, seq.grammar.error)
                if reason is not None:
                    break
            first_row += 1 + len(proposal)
            if proposal:
                assert spec is not None
                spec.record(seq, len(proposal), num_accepted, generator_states)
                # Every appended token but the last has its KV computed now, as after plain decoding.
                self.scheduler.accept_proposed(seq, num_appended - 1)
            handoff = None
            if reason is not None:
                self.scheduler.finish(seq, reason, free_blocks=seq.kv_hold is None)
                if seq.kv_hold is not None:
                    if self._handoff_draft is not None:
                        self._handoff_draft.fill([seq])
                    handoff = self._handoff(seq, seq.kv_hold)
                    self.leases.grant(seq, handoff, seq.kv_hold.claim_deadline)
                    self.kv_pusher.end(seq.request_id, complete=True)
                self._requests.pop(seq.request_id, None)
                self._detokenizers.pop(seq.request_id, None)
            outputs.append(self._output(seq, detokenizer, handoff))
        return outputs

    def _handoff(self, seq: Sequence, hold: KVHoldParams) -> KVHandoff:
        """The descriptor of a finished request's held prompt KV, from what the sequence already has."""
        num_tokens = seq.num_computed_tokens  # the prompt: the first token's KV was never computed
        return KVHandoff(
            request_id=seq.request_id,
            model_id=self.model_id,
            layout=self.kv_layout,
            # Hashed as the tokens arrived (the prefix cache needed them): not computed again.
            block_hashes=tuple(seq.block_hashes()[: num_tokens // self.block_size]),
            num_tokens=num_tokens,
            first_token_id=seq.output_token_ids[0],
            transport=hold.transport,
            address=hold.address,
            lease_deadline_ms=int((time.time() + self._lease_s(hold)) * 1000),
            worker_id=hold.worker_id,
            epoch=hold.epoch,
            draft_layout=self._handoff_draft.kv_layout if self._handoff_draft is not None else None,
            draft_model_id=self._handoff_draft.identity if self._handoff_draft is not None else "",
            tensor_parallel_size=self.tensor_parallel_size,
            lora=seq.lora_request,
        )

    def _lease_s(self, hold: KVHoldParams) -> float:
        """How long a lease granted now lasts: the handoff deadline, or less when the request's own comes first."""
        if hold.claim_deadline is None:
            return self.kv_handoff_timeout_s
        return max(0.0, min(self.kv_handoff_timeout_s, hold.claim_deadline - time.monotonic()))

    def _finish_reason(self, seq: Sequence, token_id: int, detokenizer: IncrementalDetokenizer | None) -> str | None:
        params = seq.params
        # Nothing ends a request before min_tokens tokens (vLLM): EOS and stop ids were
        # masked until then, and stop strings count from the token after the min_tokens-th.
        may_stop = seq.num_output_tokens > params.min_tokens
        if may_stop and not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if may_stop and token_id in params.stop_token_ids:
            return "stop"
        if detokenizer is not None:
            new_text = detokenizer.add(seq.output_token_ids)
            if may_stop and params.stop and new_text:
                index = find_stop(detokenizer.text, len(new_text), params.stop)
                if index is not None:
                    detokenizer.text = detokenizer.text[:index]
                    return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ---- internals -------------------------------------------------------------------

    # ---- what the KV connector asks of the engine (kv.connector.ConnectorHost) -------------------

    def remote_sequence(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, handoff: KVHandoff
    ) -> Sequence:
        """The sequence of a request prefilled elsewhere: its prompt computed, its first token appended.
        ``ValueError`` naming the field when ``handoff`` or the request cannot be served here."""
        if handoff.model_id != self.model_id:
            raise ValueError(f"handoff.model_id {handoff.model_id!r} is not this worker's model {self.model_id!r}")
        if handoff.layout.block_size != self.block_size:
            raise ValueError(f"handoff.layout.block_size {handoff.layout.block_size} != {self.block_size}")
        if handoff.num_tokens != len(prompt_token_ids):
            raise ValueError(f"handoff.num_tokens {handoff.num_tokens} != prompt length {len(prompt_token_ids)}")
        request_id = self.new_request_id(request_id)
        token_ids = self.validate_request(prompt_token_ids, params)
        if handoff.lora is not None:
            if self.lora is None:
                raise ValueError(f"handoff.lora {handoff.lora.lora_name!r}: this worker serves no LoRA adapters "
                                 "(start it with --enable-lora)")
            self.lora.load(handoff.lora)  # ValueError naming the adapter when it cannot be served
        seq = self.new_sequence(request_id, token_ids, params, num_draws_done=1, block_hashes=handoff.block_hashes,
                                lora_request=handoff.lora)
        seq.prompt_logprobs = None  # delivered by the engine that prefilled it
        seq.append_token(handoff.first_token_id)
        seq.num_cached_tokens = 0
        # Nothing of the prompt is computed here: only the first token is left to run.
        seq.num_computed_tokens = seq.num_prompt_tokens
        return seq

    def admit_remote(self, seq: Sequence) -> None:
        """Track ``seq`` (from ``remote_sequence``) and queue it for blocks, once its adapter has a slot."""
        self.register(seq)
        self._queue(seq, remote=True)

    def output_of(self, seq: Sequence) -> RequestOutput:
        """The state of the running request ``seq``, as a step would report it."""
        return self._output(seq, self._detokenizers.get(seq.request_id))

    # ---- a request's id, validation, sequence and registration ---------------------------------

    def new_request_id(self, request_id: str | None) -> str:
        """``request_id``, or a new one when None; ``ValueError`` when it is not a string or in use here."""
        if request_id is None:
            request_id = f"req-{next(self._request_counter)}"
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        # A finished request whose KV is still held counts: reusing its id would orphan its blocks.
        if request_id in self._requests or request_id in self.leases:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return request_id

    def validate_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, or ``ValueError`` naming what makes the request unservable here."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            token_ids = self.tokenize(prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        for token_id in token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < self.vocab_size:
                raise ValueError(f"prompt token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})")
        for token_id, _ in params.logit_bias:
            if token_id >= self.vocab_size:
                raise ValueError(f"logit_bias key {token_id} is outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this checkpoint has none")
        if params.structured_outputs is not None:
            if self.grammar_compiler is None:
                raise ValueError("structured_outputs needs a tokenizer, and this checkpoint has none")
            check_grammar(params.structured_outputs)  # GrammarError (a ValueError) naming the field
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        capacity = self.block_manager.num_blocks * self.block_size
        if len(token_ids) + params.max_tokens > capacity:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the KV pool "
                f"({capacity} tokens); raise num_kv_blocks"
            )
        return token_ids

    def new_sequence(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        num_draws_done: int = 0,
        block_hashes: tuple[BlockHash, ...] = (),
        lora_request: LoRARequest | None = None,
    ) -> Sequence:
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed)
            # A request continued from another worker resumes the same random stream.
            if not params.is_greedy:
                for _ in range(num_draws_done):
                    torch.empty(self.vocab_size).exponential_(generator=generator)
        # The prefix cache is keyed by adapter: blocks computed under one are never another's, or the base's.
        model_id = adapter_model_id(self.model_id, None if lora_request is None else lora_request.lora_name)
        seq = Sequence(request_id, token_ids, params, self.block_size, model_id, generator, block_hashes)
        seq.lora_request = lora_request
        return seq

    def register(self, seq: Sequence) -> None:
        """Track ``seq`` as one of this engine's requests (its text detokenized from the tokens it has); a
        grammar it asks for starts compiling."""
        self._requests[seq.request_id] = seq
        spec = seq.params.structured_outputs
        if spec is not None:
            if self.grammar_compiler is None:
                raise ValueError("structured_outputs needs a tokenizer, and this checkpoint has none")
            activation = ()
            if spec.reasoning_end is not None:
                activation = tuple(self.tokenizer(spec.reasoning_end, add_special_tokens=False)["input_ids"])
            seq.grammar = RequestGrammar(spec, self.grammar_compiler.submit(spec), activation)
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens)
            # A request prefilled elsewhere comes with its first token, a resumed one with its output so far:
            # token by token, so the text and its held-back tail are what they were where they were generated.
            outputs = seq.output_token_ids
            for end in range(1, len(outputs) + 1):
                detokenizer.add(outputs[:end])
            self._detokenizers[seq.request_id] = detokenizer

    def state_of(self, request_id: str) -> RequestOutput:
        """The state of the unfinished request ``request_id`` now, as a step would report it."""
        return self.output_of(self._requests[request_id])

    def _output(
        self, seq: Sequence, detokenizer: IncrementalDetokenizer | None, kv_handoff: KVHandoff | None = None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=detokenizer.text if detokenizer is not None else "",
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens or 0,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            # Complete from the first output on (the step that samples it ends the
            # prompt); an abort before then reports none rather than a part.
            prompt_logprobs=None if seq.needs_prompt_logprobs else seq.prompt_logprobs,
            kv_handoff=kv_handoff,
            spec_decode_stats=None
            if self.spec_decoder is None
            else SpecDecodeStats(seq.num_spec_steps, seq.num_draft_tokens, seq.num_accepted_tokens),
        )


def _check_parallel_features(config: EngineConfig) -> None:
    """ValueError naming the option that tensor_parallel_size > 1 does not serve yet."""
    tp = config.parallel.tensor_parallel_size
    if config.model.quantization is not None:
        raise ValueError(
            f"quantization={config.model.quantization!r} is not supported with tensor_parallel_size={tp}; "
            "use quantization=None or tensor_parallel_size=1"
        )
    if config.speculative_config is not None:
        raise ValueError(
            f"speculative_config is not supported with tensor_parallel_size={tp}; "
            "drop speculative_config or use tensor_parallel_size=1"
        )


def _check_lora_features(config: EngineConfig) -> None:
    """ValueError naming what LoRA adapters are not served with yet."""
    if config.parallel.tensor_parallel_size > 1:
        raise ValueError("LoRA adapters are not served with tensor_parallel_size > 1 yet; use tensor_parallel_size=1")
    if config.speculative_config is not None:
        raise ValueError("LoRA adapters are not served with speculative decoding yet; drop speculative_config")


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device {device!r} is not a valid torch device") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available")
    return resolved


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return auto_dtype(device)
    if dtype == "bfloat16" and device.type == "cpu" and not cpu_has_native_bf16():
        logger.warning(
            "dtype='bfloat16' on a CPU without bf16 units (no avx512_bf16 or amx_bf16): its products are emulated, "
            "several times slower than float32 (dtype='auto' picks float32 here; quantized layers dequantize to float32)"
        )
    return TORCH_DTYPES[dtype]


def auto_dtype(device: torch.device) -> torch.dtype:
    """What ``dtype="auto"`` serves in: bf16 on GPUs, and on CPUs whose matrix units run it natively
    (AMX or AVX512-BF16: there bf16 matches float32's perplexity on the default model and runs its
    GEMMs 2.3-6.5x faster: 2.3x on a Zen 4, 6.5x with AMX, benchmarks/linear_methods.py); float32 on other
    CPUs, where bf16 is emulated.
    vLLM picks bf16 on CPU too."""
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def _load_tokenizer(path: Path) -> object | None:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / name).is_file() for name in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
