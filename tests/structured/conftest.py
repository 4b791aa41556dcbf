"""A tiny Llama with a byte-level tokenizer (tests/http/conftest.py's), so grammars map to its tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.http.conftest import build_byte_tokenizer


@pytest.fixture(scope="session")
def chat_llama(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama-structured")
    for path in llama_checkpoint.iterdir():
        shutil.copy(path, directory / path.name)
    build_byte_tokenizer(directory)
    return directory
