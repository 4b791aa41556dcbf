"""The fixed English text perplexity is measured on: five licence texts from Debian's base system.

``/usr/share/common-licenses`` belongs to ``base-files`` (essential: present on
every Debian or Ubuntu machine, this project's Docker image included). Five
distinct licences, in this fixed order, joined by a blank line; the near-duplicate
older versions (GPL-1, GFDL-1.2, LGPL-2) are left out so the text does not repeat
itself. Tokenized without special tokens: 23,535 tokens with SmolLM2-135M's tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

LICENSE_DIR = Path("/usr/share/common-licenses")
LICENSE_FILES = ("GPL-3", "GPL-2", "LGPL-2.1", "Apache-2.0", "MPL-2.0")
SEPARATOR = "\n\n"


def load_text(directory: Path = LICENSE_DIR) -> str:
    missing = [name for name in LICENSE_FILES if not (directory / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"the accuracy text needs {', '.join(missing)} in {directory} (Debian's base-files package)"
        )
    return SEPARATOR.join((directory / name).read_text(encoding="utf-8") for name in LICENSE_FILES)


def load_token_ids(tokenizer: Any, directory: Path = LICENSE_DIR) -> list[int]:
    """The text's token ids under ``tokenizer`` (a transformers tokenizer), no BOS or EOS added."""
    return list(tokenizer(load_text(directory), add_special_tokens=False)["input_ids"])
