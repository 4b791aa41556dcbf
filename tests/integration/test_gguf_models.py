"""``--model file.gguf``: a GGUF file of a served family is converted once (dequantized), then served as any
checkpoint; greedy float32 output equals transformers reading the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.conftest import FAMILY_CONFIGS, build_checkpoint, random_prompts
from tests.support.gguf_files import write_gguf

MAX_TOKENS = 16


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_gguf_file_serves_what_transformers_reads_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    config = FAMILY_CONFIGS[family]()
    checkpoint = build_checkpoint(tmp_path / "hf", config)
    gguf_file = write_gguf(checkpoint, config, family, tmp_path / f"tiny-{family}.Q8_0.gguf")
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_file.name, dtype=torch.float32)
    prompts = random_prompts([5, 40], seed=90)
    llm = LLM(model=str(gguf_file), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                      do_sample=False, min_new_tokens=MAX_TOKENS, pad_token_id=0)[0, len(prompt):]
        assert out.token_ids == expected.tolist(), f"{len(prompt)}-token prompt"
    # Dequantized Q8_0, not the checkpoint's floats: the file's weights are what is served.
    served = llm.engine.model.model.embed_tokens.weight
    original = AutoModelForCausalLM.from_pretrained(checkpoint).model.embed_tokens.weight
    assert torch.equal(served, reference.model.embed_tokens.weight) and not torch.equal(served, original)
    # Converted once, into the cache, with the file's tokenizer.
    (converted,) = (tmp_path / "cache" / "models").iterdir()
    assert converted.name.startswith(f"gguf-tiny-{family}.Q8_0-") and (converted / "tokenizer.json").is_file()
    again = LLM(model=str(gguf_file), dtype="float32", num_kv_blocks=32, quantization="int8")
    assert again.engine.model_path == converted


def test_the_gateway_reads_a_gguf_files_tokenizer_from_its_metadata(tmp_path: Path) -> None:
    from pdserve.gateway.tokenizer import load_tokenizer

    config = FAMILY_CONFIGS["qwen2"]()
    gguf_file = write_gguf(build_checkpoint(tmp_path / "hf", config), config, "qwen2", tmp_path / "q.gguf")
    tokenizer = load_tokenizer(str(gguf_file))
    assert tokenizer.vocab_size == 512 and tokenizer.convert_ids_to_tokens([9]) == ["<t9>"]


def test_a_gguf_file_transformers_cannot_map_is_refused_naming_it(tmp_path: Path, monkeypatch) -> None:
    import gguf

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=rf"--model {path}: .*rwkv6"):
        LLM(model=str(path), dtype="float32", num_kv_blocks=8)
    with pytest.raises(ValueError, match="no such GGUF file"):
        LLM(model=str(tmp_path / "missing.gguf"), dtype="float32", num_kv_blocks=8)
