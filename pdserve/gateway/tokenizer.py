"""The served model's tokenizer, loaded the same way the workers load it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model: str | None) -> Any | None:
    """AutoTokenizer for ``model`` (a local folder, a hub id, or None for the embedded default).

    None for a local folder without tokenizer files: the gateway then serves
    token-id prompts only. The default model's tokenizer comes from the
    workers' converted folder, or is built from the GGUF file's metadata
    (``ensure_default_tokenizer``), and is loaded without torch even where torch
    is installed: it is a plain fast tokenizer (``tokenizer_class``
    ``TokenizersBackend``, what AutoTokenizer picks for it too), and
    AutoTokenizer's model-config lookup is what imports torch. Other models go
    through AutoTokenizer, which imports torch only where it is installed.
    """
    if model is None or model == "default":
        from transformers import PreTrainedTokenizerFast

        from pdserve.engine.default_model import ensure_default_tokenizer

        return PreTrainedTokenizerFast.from_pretrained(str(ensure_default_tokenizer()))
    from transformers import AutoTokenizer

    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        from pdserve.engine.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(path)  # from the file's metadata, without torch, as the default model's
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(str(path) if path.is_dir() else model)
