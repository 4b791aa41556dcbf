"""A tiny checkpoint with a real (byte-level BPE) tokenizer and chat template, built offline at test time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tests.conftest import EOS_TOKEN_ID, VOCAB_SIZE

# A ChatML-like template that renders content with {{ }}: a list of parts reaching
# it unconverted would show up in the prompt as Python's repr of the list.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# id 1 is the checkpoint's BOS and EOS_TOKEN_ID (7) its EOS.
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|reserved_0|>", "<|reserved_1|>", "<|im_end|>"]


def build_byte_tokenizer(directory: Path, special_tokens: Sequence[str] = SPECIAL_TOKENS) -> object:
    """Byte-level BPE over the checkpoint's whole vocabulary: 8 special tokens (``special_tokens``, ids 0-7, the EOS
    at ``EOS_TOKEN_ID``), 256 bytes, then letter pairs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    assert len(special_tokens) == 8 and list(special_tokens[:5]) == SPECIAL_TOKENS[:5]
    assert special_tokens.index("<|im_end|>") == EOS_TOKEN_ID
    vocab = {token: index for index, token in enumerate(special_tokens)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    merges = []
    letters = "etaoinsrhldcumfpgwybvkxjqz"
    for first in letters:
        for second in letters:
            if len(vocab) < VOCAB_SIZE:
                vocab[first + second] = len(vocab)
                merges.append((first, second))
    assert len(vocab) == VOCAB_SIZE
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="<pad>", unk_token="<unk>",
                                   additional_special_tokens=list(special_tokens[4:7]))
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast
