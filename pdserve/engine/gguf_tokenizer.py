"""A GGUF file's tokenizer, read without torch.

transformers builds a GGUF file's tokenizer from the file's metadata alone
(``integrations.gguf.gguf_tokenizer_mapping``), but its GGUF reader also maps
tensors and imports torch for them, so ``AutoTokenizer.from_pretrained(folder,
gguf_file=...)`` fails where torch is not installed (the gateway's image). This
reads the same metadata keys with the ``gguf`` package and hands them to
transformers' own conversion: the steps of transformers'
``get_gguf_tokenizer``, with another reader. ``tests/torchfree`` checks that
the result saves to the same files as transformers' path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The special tokens' names and the metadata keys holding their ids, as transformers reads them.
_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def load_gguf_tokenizer(gguf_path: Path) -> Any:
    """The fast tokenizer (``PreTrainedTokenizerFast``) that ``gguf_path``'s metadata describes."""
    from gguf import GGUFReader
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    fields = GGUFReader(gguf_path).fields
    grouped = {
        group: {name: fields[f"tokenizer.{key}"].contents() for key, name in renames.items() if f"tokenizer.{key}" in fields}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    tokenizer_type = tokenizer_dict.get("tokenizer_type")
    if tokenizer_type == "llama":
        # Older files have no flag, and llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":
        tokenizer_config["add_bos_token"] = False
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        token_id = fields[key].contents() if key in fields else None
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None

    backend, extra = convert_gguf_tokenizer(fields["general.architecture"].contents(), tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
