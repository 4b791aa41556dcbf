"""The fused decode step (one C call for every layer) against the layer-by-layer bf16 path: bit for bit.

Both paths run the same decode steps on two copies of one prefilled KV pool;
hidden states and every byte of the pools must be equal after each step, on
the tiny Llama (GQA, llama3 RoPE) and Qwen2 (q/k/v biases) checkpoints, INT8,
INT4 and unquantized bf16 weights, bf16 and int8 KV, batch 1 and the largest batch the fused path takes,
positions crossing block boundaries, and a speculative step's short chunks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention.backend import AttentionBatch
from pdserve.engine.attention.selector import select_backend
from pdserve.engine.kv.cache import KVCache
from pdserve.engine.layers import linear as linear_module
from pdserve.engine.layers.dense_kernels import load_dense_kernels
from pdserve.engine.model_loader import load_hf_config, load_model
from pdserve.engine.models.fused_decode import FUSED_DECODE_MAX_ROWS, build_fused_decoder
from pdserve.engine.models.llama import LlamaForCausalLM
from tests.conftest import random_prompts

BLOCK_SIZE = 4
NUM_BLOCKS = 6 * (FUSED_DECODE_MAX_ROWS + 1)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request: pytest.FixtureRequest) -> Path:
    """The families with Llama's layer layout, the one the fused step computes."""
    return request.getfixturevalue(f"{request.param}_checkpoint")


@pytest.mark.parametrize("family", ["qwen3", "olmo2", "mistral"])
def test_families_outside_the_fused_layout_decode_layer_by_layer(family: str, request: pytest.FixtureRequest) -> None:
    # q/k norms (Qwen3, OLMo 2), norms after each sublayer (OLMo 2) and sliding windows shorter than the
    # model length (the tiny Mistral's 48) are not in the C step: every step runs the layers.
    path = request.getfixturevalue(f"{family}_checkpoint")
    model = load_model(path, load_hf_config(path), 256, torch.bfloat16, CPU, "int8", 32)
    assert model.fused_decode_layout is False
    assert model.fused_decoder is None


class Pair:
    """One model and two KV pools that the fused and the layer-by-layer path advance side by side."""

    def __init__(self, checkpoint: Path, quantization: str, kv_dtype: torch.dtype) -> None:
        hf_config = load_hf_config(checkpoint)
        self.model = load_model(checkpoint, hf_config, 256, torch.bfloat16, CPU, quantization, 32)
        assert self.model.fused_decoder is not None, "a bf16 model on pdserve's CPU kernels must get the fused step"
        self.fused = self.model.fused_decoder
        self.backend = select_backend("cpu_paged", CPU, torch.bfloat16, kv_dtype)
        pools = [KVCache(len(self.model.model.layers), NUM_BLOCKS, BLOCK_SIZE, self.model.num_kv_heads,
                         self.model.head_dim, kv_dtype, CPU) for _ in range(2)]
        self.pools = pools
        self.layers = [pool.layers() for pool in pools]
        self.next_block = 0
        self.tables: list[list[int]] = []

    def add_sequences(self, lengths: list[int]) -> list[list[int]]:
        """Prefill random prompts of ``lengths`` into both pools (layer by layer): the sequences' tokens."""
        prompts = random_prompts(lengths, seed=len(self.tables))
        chunks = []
        for prompt in prompts:
            blocks = -(-(len(prompt) + 8) // BLOCK_SIZE)
            self.tables.append(list(range(self.next_block, self.next_block + blocks)))
            self.next_block += blocks
            chunks.append((len(self.tables) - 1, prompt, 0))
        for layers in self.layers:
            self._run(layers, chunks, fused=False)
        return prompts

    def step(self, chunks: list[tuple[int, list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run (sequence, tokens, first position) chunks over both pools: (fused hidden, layer-by-layer hidden)."""
        return self._run(self.layers[0], chunks, fused=True), self._run(self.layers[1], chunks, fused=False)

    def _run(self, layers: list, chunks: list[tuple[int, list[int], int]], fused: bool) -> torch.Tensor:
        tokens, positions, slots = [], [], []
        for index, chunk, start in chunks:
            table = self.tables[index]
            tokens += chunk
            positions += range(start, start + len(chunk))
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + len(chunk))]
        decodes = sum(1 for _, chunk, start in chunks if len(chunk) == 1 and start > 0)
        batch = AttentionBatch(
            num_decodes=decodes,
            query_lens=[len(chunk) for _, chunk, _ in chunks],
            context_lens=[start + len(chunk) for _, chunk, start in chunks],
            block_tables=[self.tables[index] for index, _, _ in chunks],
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_size=BLOCK_SIZE,
            device=CPU,
            num_heads=self.model.num_heads,
            num_kv_heads=self.model.num_kv_heads,
        )
        metadata = self.backend.build_metadata(batch)
        if fused:
            assert self.fused.serves(len(tokens), metadata), "this step must take the fused path"
        self.model.fused_decoder = self.fused if fused else None
        try:
            with torch.inference_mode():
                return self.model(torch.tensor(tokens), torch.tensor(positions), layers, self.backend, metadata)
        finally:
            self.model.fused_decoder = self.fused

    def assert_pools_equal(self) -> None:
        first, second = self.pools
        assert torch.equal(first.data.view(torch.uint8), second.data.view(torch.uint8))
        if first.scales is not None:
            assert torch.equal(first.scales, second.scales)

    def greedy(self, hidden: torch.Tensor) -> list[int]:
        with torch.inference_mode():
            return self.model.compute_logits(hidden).argmax(dim=-1).tolist()


SETTINGS = [
    pytest.param("int8", torch.bfloat16, id="int8-bf16kv"),
    pytest.param(None, torch.bfloat16, id="bf16-bf16kv"),
    pytest.param("int4", torch.bfloat16, id="int4-bf16kv"),
    pytest.param("int8", torch.int8, id="int8-int8kv"),
    pytest.param("int4", torch.int8, id="int4-int8kv"),
    pytest.param(None, torch.int8, id="bf16-int8kv"),
]


@pytest.fixture(autouse=True)
def dense_kernels_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unquantized bf16 layers on pdserve's dense kernel on every CPU: its native build, the portable path where
    the CPU lacks AVX512-BF16 (the engine itself uses the kernel only on AVX512-BF16 without AMX), so that
    the fused step, which compiles the same kernel natively, serves them here too."""
    kernels = load_dense_kernels()
    assert kernels is not None
    monkeypatch.setattr(linear_module, "_dense_kernels", lambda dtype: kernels)


@pytest.mark.parametrize(("quantization", "kv_dtype"), SETTINGS)
@pytest.mark.parametrize("num_seqs", [1, FUSED_DECODE_MAX_ROWS])
def test_fused_decode_steps_equal_the_layer_by_layer_path_bit_for_bit(
    checkpoint: Path, quantization: str, kv_dtype: torch.dtype, num_seqs: int
) -> None:
    pair = Pair(checkpoint, quantization, kv_dtype)
    # Lengths 2, 3, 5, ... so that the decode positions cross block boundaries (block size 4) at different steps.
    prompts = pair.add_sequences([2 + (i * 3) % 11 for i in range(num_seqs)])
    last = [prompt[-1] for prompt in prompts]
    for step in range(6):
        chunks = [(i, [last[i]], len(prompts[i]) + step) for i in range(num_seqs)]
        fused, layer_by_layer = pair.step(chunks)
        assert fused.dtype == torch.bfloat16 and fused.shape == (num_seqs, pair.model.model.norm.weight.shape[0])
        assert torch.equal(fused, layer_by_layer), f"step {step}"
        pair.assert_pools_equal()
        last = pair.greedy(fused)


@pytest.mark.parametrize(("quantization", "kv_dtype"), SETTINGS[:3])
def test_fused_verify_chunks_equal_the_layer_by_layer_path(checkpoint: Path, quantization: str, kv_dtype: torch.dtype) -> None:
    # A speculative step verifies a few tokens per sequence over its cached context: also one fused call.
    pair = Pair(checkpoint, quantization, kv_dtype)
    prompts = pair.add_sequences([6, 9, 3])
    chunks = [(0, [5, 9, 11, 4], 6), (1, [8], 9), (2, [30, 31, 2], 3)]
    fused, layer_by_layer = pair.step(chunks)
    assert torch.equal(fused, layer_by_layer)
    pair.assert_pools_equal()
    assert len(prompts) == 3


def test_steps_the_fused_path_does_not_serve_run_layer_by_layer(llama_checkpoint: Path) -> None:
    pair = Pair(llama_checkpoint, "int8", torch.bfloat16)
    pair.add_sequences([5] * (FUSED_DECODE_MAX_ROWS + 1))
    too_many = [(i, [3], 5) for i in range(FUSED_DECODE_MAX_ROWS + 1)]
    with_prefill = [(0, [3], 5), (1, list(range(20, 30)), 0)]  # a prompt's first chunk goes to SDPA
    for chunks in (too_many, with_prefill):
        tokens = sum(len(chunk) for _, chunk, _ in chunks)
        batch = AttentionBatch(
            num_decodes=1 if chunks is with_prefill else len(chunks),
            query_lens=[len(c) for _, c, _ in chunks],
            context_lens=[s + len(c) for _, c, s in chunks],
            block_tables=[pair.tables[i] for i, _, _ in chunks],
            slot_mapping=torch.zeros(tokens, dtype=torch.long),
            block_size=BLOCK_SIZE, device=CPU, num_heads=pair.model.num_heads, num_kv_heads=pair.model.num_kv_heads,
        )
        assert not pair.fused.serves(tokens, pair.backend.build_metadata(batch))
    one_decode = pair.backend.build_metadata(AttentionBatch(
        num_decodes=1, query_lens=[1], context_lens=[6], block_tables=[pair.tables[0]],
        slot_mapping=torch.tensor([5]), block_size=BLOCK_SIZE, device=CPU,
        num_heads=pair.model.num_heads, num_kv_heads=pair.model.num_kv_heads,
    ))
    assert pair.fused.serves(1, one_decode)
    # The KV pusher exports each layer's blocks from a forward hook: a hooked layer must run on its own.
    handle = pair.model.model.layers[2].register_forward_hook(lambda module, args, output: None)
    assert not pair.fused.serves(1, one_decode)
    handle.remove()
    assert pair.fused.serves(1, one_decode)


def test_only_bf16_cpu_models_on_pdserve_kernels_get_the_fused_step(
    llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf_config = load_hf_config(llama_checkpoint)

    def loaded(dtype: torch.dtype, quantization: str | None, **options: bool) -> LlamaForCausalLM:
        return load_model(llama_checkpoint, hf_config, 64, dtype, CPU, quantization, 32, **options)

    assert loaded(torch.bfloat16, "int4").fused_decoder is not None
    assert loaded(torch.float32, "int8").fused_decoder is None  # float32: the exactness oracle, never fused
    assert loaded(torch.float32, None).fused_decoder is None  # even with its projections on the dense kernel
    assert loaded(torch.bfloat16, None).fused_decoder is not None  # bf16 projections on pdserve's bf16 kernel
    with monkeypatch.context() as patch:
        patch.setattr(linear_module, "_dense_kernels", lambda dtype: None)  # AMX, or no AVX512-BF16: oneDNN, layer by layer
        assert loaded(torch.bfloat16, None).fused_decoder is None
    assert loaded(torch.bfloat16, "int8", enforce_eager=True).fused_decoder is None
    model = loaded(torch.bfloat16, "int8")
    model.model.layers[1].self_attn.o_proj.method.__class__ = type("Other", (type(model.model.layers[1].self_attn.o_proj.method),), {})
    assert build_fused_decoder(model) is not None  # a subclass of a served method is still that method
    model.model.layers[1].mlp.fused = None  # an activation the C side does not compute (not SiLU)
    assert build_fused_decoder(model) is None


def test_fused_decode_rejects_a_position_outside_the_rotary_tables(llama_checkpoint: Path) -> None:
    pair = Pair(llama_checkpoint, "int8", torch.bfloat16)
    pair.add_sequences([3])
    pool_before = pair.pools[0].data.clone()
    metadata = pair.backend.build_metadata(AttentionBatch(
        num_decodes=1, query_lens=[1], context_lens=[4], block_tables=[pair.tables[0]],
        slot_mapping=torch.tensor([3]), block_size=BLOCK_SIZE, device=CPU,
        num_heads=pair.model.num_heads, num_kv_heads=pair.model.num_kv_heads,
    ))
    embeddings = pair.model.model.embed_tokens(torch.tensor([5]))
    with pytest.raises(ValueError, match="positions must lie in"):
        pair.fused(embeddings, torch.tensor([256]), pair.layers[0], metadata)
    assert torch.equal(pair.pools[0].data, pool_before)


@pytest.mark.parametrize("quantization", ["int8", "int4", None])
def test_greedy_generations_are_equal_with_and_without_the_fused_step(checkpoint: Path, quantization: str) -> None:
    prompts = random_prompts([7, 30, 61], seed=4)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    fused_steps = []
    for eager in (False, True):
        llm = LLM(model=str(checkpoint), dtype="bfloat16", num_kv_blocks=64, quantization=quantization,
                  enforce_eager=eager)
        model = llm.engine.model
        assert (model.fused_decoder is None) == eager
        if not eager:
            model.fused_decoder = CountingDecoder(model.fused_decoder, fused_steps)
        outputs[eager] = [out.token_ids for out in llm.generate(prompts, params)]
    assert outputs[False] == outputs[True]
    assert all(len(tokens) == 24 for tokens in outputs[False])
    # The engine's decode steps took the fused path (its KV pusher hooks no layer outside a pushing step).
    assert len(fused_steps) >= 23


class CountingDecoder:
    """A fused decoder that records the row count of every step it runs."""

    def __init__(self, decoder: object, steps: list[int]) -> None:
        self.decoder, self.steps = decoder, steps

    def serves(self, num_tokens: int, attn_metadata: object) -> bool:
        return self.decoder.serves(num_tokens, attn_metadata)

    def __call__(self, residual: torch.Tensor, *args: object) -> torch.Tensor:
        self.steps.append(residual.shape[0])
        return self.decoder(residual, *args)
