"""The served model's tokenizer, loaded the same way the workers load it."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_tokenizer(model: str | None) -> Any:
    """AutoTokenizer for ``model`` (a local folder, a hub id, or None for the embedded default).

    The default model's folder is produced by the workers' first start; the
    locator imports neither torch nor the model code.
    """
    from transformers import AutoTokenizer

    if model is None or model == "default":
        from engine.default_model import ensure_default_model

        return AutoTokenizer.from_pretrained(str(ensure_default_model()))
    path = Path(model).expanduser()
    return AutoTokenizer.from_pretrained(str(path) if path.is_dir() else model)
