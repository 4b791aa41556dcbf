"""Shared fixtures: tiny random checkpoints built at test time, transformers as the oracle, in-process clusters."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import pytest_asyncio
import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:  # imported by the fixture itself: most tests need no grpc
    from tests.support.cluster import InProcessCluster

VOCAB_SIZE = 512
EOS_TOKEN_ID = 7


def _tiny_llama_config() -> object:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        # Llama 3.1-style scaled RoPE, so the scaling code is exercised too.
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        # Larger than the usual 0.02 so greedy argmax is not decided by float noise.
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )


def _tiny_qwen2_config() -> object:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )


def _tiny_qwen3_config() -> object:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # explicit, not hidden_size / heads (16): q/k/v widths differ from the hidden size
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )


def _tiny_mistral_config() -> object:
    from transformers import MistralConfig

    return MistralConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,  # multi-query
        max_position_embeddings=1024,
        # Shorter than most test prompts, and not a multiple of the block size: windows end mid-block.
        sliding_window=48,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )


def _tiny_olmo2_config() -> object:
    from transformers import Olmo2Config

    return Olmo2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        initializer_range=0.25,
        bos_token_id=1,
        pad_token_id=0,
        eos_token_id=EOS_TOKEN_ID,
    )


def _tiny_phi3_config() -> object:
    from transformers import Phi3Config

    return Phi3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        original_max_position_embeddings=1024,
        # Phi-4 mini's shape of RoPE: LongRoPE short factors on the first 3/4 of each head (12 of 16
        # features), and cos/sin scaled by an attention factor.
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
            "attention_factor": 1.2,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.25,
        bos_token_id=1,
        pad_token_id=0,
        eos_token_id=EOS_TOKEN_ID,
    )


def _tiny_gemma2_config() -> object:
    from transformers import Gemma2Config

    return Gemma2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,  # sliding, global, sliding, global
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,  # scores scaled by 24 ** -0.5, not head_dim ** -0.5
        max_position_embeddings=1024,
        sliding_window=40,
        # Caps the tiny random model's scores and logits actually reach (Gemma 2 ships 50 and 30).
        attn_logit_softcapping=5.0,
        final_logit_softcapping=8.0,
        rms_norm_eps=1e-6,
        # Gemma ties them; tied and scaled by sqrt(hidden), a random model's output repeats its input token
        # (the tied path itself is the tiny Qwen2's).
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.25,
        bos_token_id=1,
        pad_token_id=0,
        eos_token_id=EOS_TOKEN_ID,
    )


def _tiny_gemma3_config() -> object:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=1024,
        sliding_window=40,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,  # as the tiny Gemma 2's
        # Gemma 3's two RoPEs: the sliding layers' local base, the global layers' long base with linear scaling.
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        },
        initializer_range=0.25,
        bos_token_id=1,
        pad_token_id=0,
        eos_token_id=EOS_TOKEN_ID,
    )


def _tiny_mixtral_config() -> object:
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=6,  # more experts than top-k: each token leaves most of them out
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        sliding_window=None,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )


def _tiny_qwen3_moe_config() -> object:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,  # the dense layer's
        moe_intermediate_size=64,  # a multiple of INT4's group size 32
        num_hidden_layers=3,
        mlp_only_layers=[1],  # layers 0 and 2 routed, layer 1 dense
        decoder_sparse_step=1,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )


def _tiny_deepseek_v2_config() -> object:
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,  # the dense first layer's
        moe_intermediate_size=64,
        num_hidden_layers=3,
        first_k_dense_replace=1,  # layer 0 dense, layers 1 and 2 routed
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,  # V2-Lite: queries projected directly
        kv_lora_rank=32,  # the cached latent: smaller than heads x head_dim (4 x 24)
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=3,  # 3 experts from the best 2 of 4 groups: the limit bites
        n_shared_experts=1,
        topk_method="group_limited_greedy",  # groups scored by their best expert
        n_group=4,
        topk_group=2,
        routed_scaling_factor=1.5,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        # YaRN as DeepSeek ships it: mscale_all_dim scales the scores as well as the rotation.
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
        },
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )


def _tiny_deepseek_v3_config() -> object:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=64,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=64,  # queries compressed too
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=32,  # values wider than the keys' no-rope part
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_interleave=True,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.25,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    )


# The families every engine path is checked on (the ``checkpoint`` fixture), each by its own tiny config.
FAMILY_CONFIGS = {
    "llama": _tiny_llama_config,
    "qwen2": _tiny_qwen2_config,
    "qwen3": _tiny_qwen3_config,
    "mistral": _tiny_mistral_config,
    "olmo2": _tiny_olmo2_config,
    "phi3": _tiny_phi3_config,
    "gemma2": _tiny_gemma2_config,
    "gemma3": _tiny_gemma3_config,
    "mixtral": _tiny_mixtral_config,
    "qwen3_moe": _tiny_qwen3_moe_config,
    "deepseek_v2": _tiny_deepseek_v2_config,
    "deepseek_v3": _tiny_deepseek_v3_config,
}


def build_checkpoint(directory: Path, config: object, seed: int = 0, draw_biases_and_norms: bool = False) -> Path:
    """Save a random model of ``config`` as a Hugging Face folder (config, safetensors, generation config).

    transformers starts every projection's bias at zero and every norm's weight at its identity (one; zero for
    Gemma's ``1 + w``): ``draw_biases_and_norms`` draws them too, so that a path which drops a bias or a norm's
    weight changes the output."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # DeepSeek-V3's routing bias starts at zero; random values make it change which experts win.
                buffer.normal_(0.0, 0.3)
        if draw_biases_and_norms:
            for name, parameter in model.named_parameters():
                if name.endswith(".bias") or name.endswith("norm.weight"):
                    parameter.add_(torch.randn_like(parameter) * 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=0).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-llama-"), _tiny_llama_config())


@pytest.fixture(scope="session")
def chat_checkpoint(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama checkpoint plus a tokenizer: text prompts, chat and echo work end to end."""
    from tests.http.conftest import build_byte_tokenizer

    directory = tmp_path_factory.mktemp("tiny-llama-chat")
    for path in llama_checkpoint.iterdir():
        shutil.copy(path, directory / path.name)
    build_byte_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def qwen2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-qwen2-"), _tiny_qwen2_config())


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Seed 3: no prompt of the stop-condition and preemption tests ends at EOS before their cut points.
    return build_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-"), _tiny_qwen3_config(), seed=3)


@pytest.fixture(scope="session")
def mistral_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Seed 1: no prompt of the preemption tests ends at EOS early, so their pools do fill up.
    return build_checkpoint(tmp_path_factory.mktemp("tiny-mistral-"), _tiny_mistral_config(), seed=1)


@pytest.fixture(scope="session")
def olmo2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-olmo2-"), _tiny_olmo2_config())


@pytest.fixture(scope="session")
def phi3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Seed 2: no prompt of the preemption tests ends at EOS early, so their pools do fill up.
    return build_checkpoint(tmp_path_factory.mktemp("tiny-phi3-"), _tiny_phi3_config(), seed=2)


@pytest.fixture(scope="session")
def gemma2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Seed 4: no prompt of the preemption and stop-condition tests ends at EOS early.
    return build_checkpoint(tmp_path_factory.mktemp("tiny-gemma2-"), _tiny_gemma2_config(), seed=4)


@pytest.fixture(scope="session")
def gemma3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Seed 1: as the tiny Gemma 2's seed 4.
    return build_checkpoint(tmp_path_factory.mktemp("tiny-gemma3-"), _tiny_gemma3_config(), seed=1)


@pytest.fixture(scope="session")
def mixtral_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-mixtral-"), _tiny_mixtral_config())


@pytest.fixture(scope="session")
def qwen3_moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Seed 3: the preemption, repetition-penalty and n-gram tests' premises hold (pools fill, outputs differ).
    return build_checkpoint(tmp_path_factory.mktemp("tiny-qwen3_moe-"), _tiny_qwen3_moe_config(), seed=3)


@pytest.fixture(scope="session")
def deepseek_v2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Seed 4: the n-gram, repetition-penalty and preemption tests' premises hold (proposals accepted, outputs differ).
    return build_checkpoint(tmp_path_factory.mktemp("tiny-deepseek_v2-"), _tiny_deepseek_v2_config(), seed=4)


@pytest.fixture(scope="session")
def deepseek_v3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-deepseek_v3-"), _tiny_deepseek_v3_config())


# The families whose MLPs are mixtures of experts: routing turns small differences (another rounding, a
# quantized weight) into another expert, so their agreement with float32 is judged on thresholds of their own.
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")
# The families with latent attention (one cached row per token and layer, no tensor parallelism yet).
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="session", params=list(FAMILY_CONFIGS))
def checkpoint(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_checkpoint")


# The decisive routers' construction (with_decisive_routers): the lead of each chosen expert over the next, in
# hidden-state units; the extra lead of the last chosen expert over the first left out; the router's gain.
_ROUTING_STEP, _ROUTING_GAP, _ROUTER_GAIN = 0.25, 1.0, 4.0


def with_decisive_routers(checkpoint: Path, directory: Path, seed: int = 0) -> Path:
    """A copy of a MoE checkpoint whose routers choose every token's experts by a wide margin, the same in any
    precision: what the agreement tests with reduced precision measure on (a random router's near ties move a
    token to another expert at any rounding, and nothing of the path under test is learnt from that).

    The first ``num_experts`` hidden features are reserved for routing: the embedding gives each token a
    level per expert there (its experts in a random order, whole groups first where the family limits routing
    to groups, levels ``_ROUTING_STEP`` apart and the ones left out ``_ROUTING_GAP`` further below), no layer
    writes them (those rows of every o_proj and down projection are zero, in any quantization), and each
    router reads its expert's feature alone. The residual stream keeps them as embedded, and RMSNorm scales
    them all by one positive factor, so every router ranks a token's experts as its embedding does, whatever
    the other features' rounding. DeepSeek-V3's routing bias is zero (a bias shifts the ranks by a constant
    the order of levels need not dominate).
    """
    directory.mkdir(parents=True, exist_ok=True)
    for item in checkpoint.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, directory / item.name)
    config = json.loads((checkpoint / "config.json").read_text())
    num_experts = config.get("num_local_experts") or config.get("num_experts") or config["n_routed_experts"]
    top_k, groups = config["num_experts_per_tok"], config.get("n_group") or 1
    per_group = num_experts // groups
    levels = -_ROUTING_STEP * torch.arange(num_experts, dtype=torch.float32)  # by rank, best first
    levels[top_k:] -= _ROUTING_GAP
    generator = torch.Generator().manual_seed(seed)
    for path in checkpoint.glob("*.safetensors"):
        tensors = load_file(str(path))
        embed = tensors["model.embed_tokens.weight"]  # (vocab, hidden)
        for token in range(embed.shape[0]):
            # Rank of each expert: the token's groups in a random order, within each its experts in a random one.
            ranks = torch.empty(num_experts, dtype=torch.long)
            for group_rank, group in enumerate(torch.randperm(groups, generator=generator).tolist()):
                for inner_rank, inner in enumerate(torch.randperm(per_group, generator=generator).tolist()):
                    ranks[group * per_group + inner] = group_rank * per_group + inner_rank
            embed[token, :num_experts] = levels[ranks]
        for key, value in tensors.items():
            if key.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):  # every writer of the residual
                value[:num_experts] = 0
            elif key.endswith(".gate.weight"):  # (num_experts, hidden): the routers
                value.zero_()
                value[:, :num_experts] = _ROUTER_GAIN * torch.eye(num_experts)
            elif key.endswith("e_score_correction_bias"):
                value.zero_()
        save_file(tensors, str(directory / path.name), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="session")
def agreement_checkpoint(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``checkpoint``, with decisive routers where it has experts (``with_decisive_routers``)."""
    family = family_of(checkpoint)
    if family not in MOE_FAMILIES:
        return checkpoint
    return with_decisive_routers(checkpoint, tmp_path_factory.mktemp(f"tiny-{family}-"))


def preempting_pool(checkpoint: Path) -> int:
    """KV blocks of 16 tokens that make the preemption tests' prompts (1 to 200 tokens, up to 24 generated)
    preempt: 21, or 14 where sliding windows free the blocks they have passed (the 200-token prompt and its
    outputs still fit)."""
    from pdserve.engine.models.llama import sliding_windows

    sliding = any(window is not None for window in sliding_windows(FAMILY_CONFIGS[family_of(checkpoint)]()))
    return 14 if sliding else 21


def family_of(checkpoint: Path) -> str:
    """The ``FAMILY_CONFIGS`` name of a checkpoint the fixtures built (its folder is ``tiny-<family>-N``)."""
    name = checkpoint.name.removeprefix("tiny-").rsplit("-", 1)[0]
    assert name in FAMILY_CONFIGS, checkpoint
    return name


class Oracle:
    """transformers' greedy ``generate``, one prompt at a time, memoised per prompt."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self._memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt), max_tokens)
        if key not in self._memo:
            input_ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.model.generate(
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
            self._memo[key] = out[0, len(prompt) :].tolist()
        return self._memo[key]


_ORACLES: dict[Path, Oracle] = {}


@pytest.fixture
def oracle(checkpoint: Path) -> Oracle:
    if checkpoint not in _ORACLES:
        _ORACLES[checkpoint] = Oracle(checkpoint)
    return _ORACLES[checkpoint]


def greedy_continuations(checkpoint: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations of ``max_tokens`` tokens, past EOS as ``ignore_eos`` does (EOS not masked)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    # ignore_eos generates past EOS without masking it (vLLM's meaning): no EOS here, rather than min_new_tokens.
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def random_prompts(lengths: list[int], seed: int, vocab_size: int = VOCAB_SIZE) -> list[list[int]]:
    """Seeded random prompts that avoid the EOS id (EOS in a prompt is legal, just confusing to read)."""
    rng = random.Random(seed)
    choices = [t for t in range(2, vocab_size) if t != EOS_TOKEN_ID]
    return [[rng.choice(choices) for _ in range(n)] for n in lengths]


StartInProcessCluster = Callable[..., Awaitable["InProcessCluster"]]


@pytest_asyncio.fixture
async def start_inprocess_cluster() -> AsyncIterator[StartInProcessCluster]:
    """``await start_inprocess_cluster(checkpoint, ClusterOptions(...))``: a started ``InProcessCluster``.

    Every cluster the test started is stopped after it, newest first, pass or fail.
    """
    from tests.support.cluster import ClusterOptions, InProcessCluster

    clusters: list[InProcessCluster] = []

    async def start(checkpoint: Path, options: ClusterOptions | None = None) -> InProcessCluster:
        cluster = InProcessCluster(checkpoint, options)
        clusters.append(cluster)
        await cluster.start()
        return cluster

    try:
        yield start
    finally:
        for cluster in reversed(clusters):
            await cluster.stop()
