"""Block hashes: chained, deterministic across processes, and pure Python."""

from __future__ import annotations

import subprocess
import sys

from pdserve.engine.types.hashing import hash_block, hash_prompt_blocks


def test_only_full_blocks_are_hashed_and_each_covers_its_whole_prefix() -> None:
    hashes = hash_prompt_blocks(list(range(10)), 4, "m")
    assert len(hashes) == 2
    assert hashes[0] == hash_block(None, [0, 1, 2, 3], "m")
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7], "m")
    # Same block tokens after a different prefix: a different hash.
    other = hash_prompt_blocks([9, 1, 2, 3, 4, 5, 6, 7], 4, "m")
    assert other[1] != hashes[1]


def test_model_identity_is_part_of_the_hash() -> None:
    assert hash_prompt_blocks([1, 2, 3, 4], 4, "a") != hash_prompt_blocks([1, 2, 3, 4], 4, "b")


def test_hash_is_identical_in_another_process_with_another_hash_seed() -> None:
    code = "from pdserve.engine.types.hashing import hash_prompt_blocks; print(hash_prompt_blocks(list(range(32)), 16, 'm')[1].hex())"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "123", "PATH": ""},
        cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
    )
    assert result.stdout.strip() == hash_prompt_blocks(list(range(32)), 16, "m")[1].hex()


def test_importing_the_hash_module_loads_neither_torch_nor_grpc() -> None:
    code = (
        "import sys, pdserve.engine.types.hashing; "
        "print(sorted(m for m in ('torch', 'grpc', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
    )
    assert result.stdout.strip() == "[]"


def test_importing_the_engine_does_not_import_grpc() -> None:
    code = "import sys, pdserve.engine; from pdserve import LLM; print('grpc' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
    )
    assert result.stdout.strip() == "False"
