"""The LM head split by vocabulary under tensor parallelism: which rank keeps which rows, that a step
with few sampled rows splits the matmul and one with many has rank 0 compute alone, and that both give
transformers' greedy tokens (tie rule: tests/parallel/support.py), with vocabularies that do not divide
evenly by the rank count."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.layers import linear
from pdserve.engine.llm import LLM
from pdserve.engine.model_loader import load_hf_config, load_model
from pdserve.engine.parallel import vocab_head
from pdserve.engine.parallel.sharding import TensorParallelShard, check_tensor_parallel
from pdserve.engine.parallel.vocab_head import VocabSplitHead, install_split_head, uses_split_head, vocab_range
from pdserve.engine.types.sampling_params import SamplingParams
from tests.conftest import random_prompts
from tests.parallel.support import ODD_VOCAB_SIZE, Reference, build, llama_config
from tests.support.near_ties import comparable

MAX_TOKENS = 8
HIDDEN = 48  # tests/parallel/support.py's configs


@pytest.fixture(scope="module")
def odd_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("odd_vocab"), "odd_vocab")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("qwen2"), "qwen2")


def _llm(path: Path, tp: int) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, tensor_parallel_size=tp)


def test_vocab_ranges_cover_the_vocabulary_once_in_order_when_it_does_not_divide() -> None:
    assert [vocab_range(509, 2, r) for r in range(2)] == [range(0, 255), range(255, 509)]
    assert [vocab_range(509, 3, r) for r in range(3)] == [range(0, 170), range(170, 340), range(340, 509)]
    assert [vocab_range(512, 3, r) for r in range(3)] == [range(0, 171), range(171, 342), range(342, 512)]
    assert [vocab_range(4, 4, r) for r in range(4)] == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    assert [uses_split_head(n) for n in (0, 1, 64, 65)] == [False, True, True, False]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must not exceed the model's vocab_size \(2\)"):
        check_tensor_parallel(llama_config(6, 6, bias=False, vocab_size=2), 3)


def test_a_follower_keeps_only_its_part_of_an_untied_head_and_rank_0_all_of_it_once(
    odd_vocab: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The weights as loaded (the library path keeps them; pdserve's dense kernel keeps its own panels instead).
    monkeypatch.setattr(linear, "_dense_kernels", lambda dtype: None)
    hf_config = load_hf_config(odd_vocab)

    def load(rank: int) -> torch.nn.Module:
        return load_model(odd_vocab, hf_config, 64, torch.float32, torch.device("cpu"),
                          shard=TensorParallelShard(rank, 2))

    follower = load(1)
    weight = follower.lm_head_packed.weight
    assert weight.shape == (254, HIDDEN)
    assert weight.untyped_storage().nbytes() == 254 * HIDDEN * 4  # the full head was not kept
    leader = load(0)
    install_split_head(leader)
    head = leader.lm_head_packed
    assert isinstance(head, VocabSplitHead)
    assert (head.own.weight.shape, head.rest.weight.shape) == ((255, HIDDEN), (254, HIDDEN))
    # Two views of the one loaded head: rank 0 holds it once, as a replicated head did.
    storage = head.own.weight.untyped_storage()
    assert storage.data_ptr() == head.rest.weight.untyped_storage().data_ptr()
    assert storage.nbytes() == ODD_VOCAB_SIZE * HIDDEN * 4
    hidden = torch.randn(3, HIDDEN)
    expected = torch.nn.functional.linear(hidden, torch.cat((head.own.weight, head.rest.weight)))
    torch.testing.assert_close(head(hidden), expected, rtol=1e-5, atol=1e-5)


def test_a_tied_heads_parts_are_views_of_the_embedding(qwen2: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear, "_dense_kernels", lambda dtype: None)  # the weights as loaded, as above
    model = load_model(qwen2, load_hf_config(qwen2), 64, torch.float32, torch.device("cpu"),
                       shard=TensorParallelShard(2, 3))
    embedding = model.model.embed_tokens.weight
    assert embedding.shape == (512, HIDDEN)  # the lookup stays replicated
    part = model.lm_head_packed.weight
    assert part.shape == (170, HIDDEN)
    assert part.data_ptr() == embedding[342].data_ptr()
    assert torch.equal(part, embedding[342:])


@pytest.mark.parametrize("tp", [2, 3])
def test_split_and_rank_0_logits_both_give_transformers_tokens_with_an_uneven_vocabulary(
    odd_vocab: Path, tp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At most 2 sampled rows split the head: two prompts split it, three have rank 0 compute alone.
    monkeypatch.setattr(vocab_head, "SPLIT_LM_HEAD_MAX_ROWS", 2)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    prompts = random_prompts([5, 11, 17, 8, 23], seed=50 + tp, vocab_size=ODD_VOCAB_SIZE)
    with _llm(odd_vocab, tp) as llm:
        parallel, model = llm.engine.parallel, llm.engine.model
        split_rows: list[int] = []
        alone_rows: list[int] = []
        gather, compute = parallel.gather_logits, model.compute_logits
        parallel.gather_logits = lambda m, rows: (split_rows.append(rows.shape[0]), gather(m, rows))[1]
        model.compute_logits = lambda rows: (alone_rows.append(rows.shape[0]), compute(rows))[1]
        outputs = [o.token_ids for o in llm.generate(prompts[:2], params)]
        assert split_rows and max(split_rows) <= 2 and alone_rows == []
        outputs += [o.token_ids for o in llm.generate(prompts[2:], params)]
        assert alone_rows and min(alone_rows) >= 3 and max(split_rows) <= 2
    reference = Reference(odd_vocab)
    cut = 0
    for prompt, output in zip(prompts, outputs):
        expected, margins = reference.generate(prompt, MAX_TOKENS)
        n = comparable(expected, margins)
        cut += n < len(expected)
        assert output[:n] == expected[:n], (prompt[:4], output, expected, n)
    assert cut <= 1


def test_prompt_logprobs_under_tensor_parallelism_equal_one_rank(odd_vocab: Path) -> None:
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    (prompt,) = random_prompts([30], seed=61, vocab_size=ODD_VOCAB_SIZE)
    results = []
    for tp in (1, 2):
        with _llm(odd_vocab, tp) as llm:
            results.append(llm.generate([prompt], params)[0].prompt_logprobs)
    one, two = results
    assert len(one) == len(two) == len(prompt) - 1
    assert [entry.token_id for entry in two] == prompt[1:]
    torch.testing.assert_close(
        torch.tensor([entry.logprob for entry in two]), torch.tensor([entry.logprob for entry in one]),
        rtol=1e-5, atol=1e-5,
    )


def test_a_steps_logits_rows_cross_the_step_codec_after_its_block_tables() -> None:
    from pdserve.engine.attention.backend import AttentionBatch
    from pdserve.engine.parallel.step_codec import StepInputs, decode_step, encode_step

    cpu = torch.device("cpu")
    batch = AttentionBatch(
        num_decodes=1, query_lens=[1, 3], context_lens=[6, 3], block_tables=[[4, 9], [2]],
        slot_mapping=torch.tensor([37, 8, 9, 10]), block_size=4, device=cpu, num_heads=6, num_kv_heads=6,
    )
    for rows in (torch.tensor([0, 3]), None):
        inputs = StepInputs(torch.tensor([11, 12, 13, 14]), torch.tensor([5, 0, 1, 2]), batch, rows)
        header, payload = encode_step(inputs)
        decoded = decode_step(header, payload, 4, 3, 3, cpu)
        assert header[6].item() == (0 if rows is None else 2)
        if rows is None:
            assert decoded.logits_rows is None
        else:
            assert decoded.logits_rows.tolist() == [0, 3]
        assert decoded.input_ids.tolist() == [11, 12, 13, 14] and decoded.positions.tolist() == [5, 0, 1, 2]
        assert decoded.batch.block_tables == [[4, 9], [2]] and decoded.batch.context_lens == [6, 3]
        assert decoded.batch.slot_mapping.tolist() == [37, 8, 9, 10] and decoded.batch.num_heads == 3
