"""Finding a checkpoint and copying its safetensors weights into pdserve's model classes.

Checkpoints are Hugging Face folders (the embedded default, a local folder or a
hub id). Parameter names in pdserve's models are exactly Hugging Face's
(``model.layers.0.self_attn.q_proj.weight``...), so loading is a name-for-name
copy with strict checks: a missing, unexpected or misshapen tensor is an error,
never a silently random weight.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from pdserve.engine.default_model import ensure_default_model, ensure_gguf_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from pdserve.engine.models.llama import LlamaForCausalLM
    from pdserve.engine.parallel.sharding import TensorParallelShard

# What a hub download needs: configs, weights, tokenizer files (tokenizer.json,
# vocab.json, merges.txt, tokenizer.model, chat_template.jinja); never .bin/.pt/.gguf.
HUB_ALLOW_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja")

# The torch dtype of each named model dtype but "auto" (engine.types.config.SUPPORTED_DTYPES).
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INDEX_FILE_NAME = "model.safetensors.index.json"
# Older checkpoints saved the rotary frequencies; they are recomputed from the config.
_IGNORED_KEY_SUFFIXES = ("rotary_emb.inv_freq",)
_TIED_HEAD_NAME = "lm_head.weight"
_TIED_EMBEDDING_NAME = "model.embed_tokens.weight"
# How many names an error message lists per kind of problem.
_NAMES_SHOWN = 5


def resolve_model_path(model: str | None) -> Path:
    """The local folder of ``model``: the default model, a local folder, a GGUF file (converted once:
    ``default_model.ensure_gguf_model``), or a hub id downloaded once."""
    if model is None or model == "default":
        return ensure_default_model()
    local = Path(model).expanduser()
    if local.is_dir():
        return local
    if local.suffix == ".gguf":
        if not local.is_file():
            raise ValueError(f"--model {model}: no such GGUF file")
        return ensure_gguf_model(local)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=list(HUB_ALLOW_PATTERNS)))
    except Exception as error:
        raise ValueError(
            f"Model {model!r} is neither a local folder nor a downloadable Hugging Face hub id: {error}"
        ) from error


def load_hf_config(path: str | os.PathLike[str]) -> PretrainedConfig:
    """The checkpoint's transformers config (config.json)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def load_eos_token_ids(path: str | os.PathLike[str], config: PretrainedConfig) -> frozenset[int]:
    """The ids that end generation: generation_config.json's, else the model config's; empty if neither."""
    eos_token_id: int | list[int] | None = None
    # Checked first so that a folder without the file never triggers a hub lookup.
    if (Path(path) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        eos_token_id = GenerationConfig.from_pretrained(str(path)).eos_token_id
    if eos_token_id is None:
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    if isinstance(eos_token_id, int):
        return frozenset({eos_token_id})
    return frozenset(int(token_id) for token_id in eos_token_id)


def load_weights(model: torch.nn.Module, path: str | os.PathLike[str], *, tie_word_embeddings: bool) -> None:
    """Copy every tensor of the safetensors checkpoint in ``path`` into ``model``'s parameter of the same name.

    Every problem is found before anything is copied, so on ValueError the model is untouched.
    """
    folder = Path(path)
    files_by_key = _checkpoint_files_by_key(folder)
    if tie_word_embeddings:
        # A tied checkpoint may still store the head; the embedding is the tensor that counts.
        files_by_key.pop(_TIED_HEAD_NAME, None)
    keys_by_file: dict[Path, list[str]] = {}
    for key, file_path in files_by_key.items():
        keys_by_file.setdefault(file_path, []).append(key)
    # remove_duplicate=False: a tied head is listed under its own name too.
    params = dict(model.named_parameters(remove_duplicate=False))
    _check_tied_head(params, tie_word_embeddings)
    split = getattr(model, "checkpoint_parts", None)
    parts = {key: (split(key) if split is not None else None) or [(key, None)] for key in files_by_key}
    _check_matches(params, keys_by_file, parts, tie_word_embeddings)

    with torch.no_grad():
        for file_path, keys in keys_by_file.items():
            with safe_open(str(file_path), framework="pt") as checkpoint:
                for key in keys:
                    tensor = checkpoint.get_tensor(key)
                    for name, rows in parts[key]:
                        param = params[name]
                        param.data.copy_((tensor if rows is None else tensor[rows[0] : rows[1]]).to(param.dtype))


def load_model(
    path: Path,
    hf_config: PretrainedConfig,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    quantization_group_size: int = 32,
    quantize_lm_head: bool = True,
    shard: TensorParallelShard | None = None,
    enforce_eager: bool = False,
) -> LlamaForCausalLM:
    """The checkpoint at ``path`` as a ready pdserve model: built in ``dtype`` on ``device``, weights
    loaded, sliced to ``shard``'s part (tensor parallelism), projections packed with
    ``quantization``'s linear method, in eval mode.

    Under quantization the LM head is INT8 too unless ``quantize_lm_head`` is False
    (pdserve/engine/layers/linear.py's ``lm_head_method``; BENCHMARKS.md's ``accuracy`` has its effect).
    ``enforce_eager``: no fused decode step (pdserve/engine/models/fused_decode.py)."""
    from pdserve.engine.layers.linear import linear_method, lm_head_method
    from pdserve.engine.models import model_class

    cls = model_class(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            # Rotary tables are built in float32 explicitly; weights in `dtype`.
            model = cls(hf_config, max_positions)
    finally:
        torch.set_default_dtype(previous)
    load_weights(model, path, tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))
    if shard is not None:
        # Before packing: PackedLinear fuses (and the linear method processes) only this rank's slices.
        shard.shard(model)
    model.pack_weights(
        linear_method(quantization, quantization_group_size), lm_head_method(quantization, quantize_lm_head)
    )
    if enforce_eager:
        model.fused_decoder = None
    return model.eval()


def _checkpoint_files_by_key(folder: Path) -> dict[str, Path]:
    """Which file holds each checkpoint key, from the shard index when there is one."""
    index_path = folder / _INDEX_FILE_NAME
    files_by_key: dict[str, Path] = {}
    if index_path.is_file():
        weight_map: dict[str, str] = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        for key, file_name in weight_map.items():
            files_by_key[key] = folder / file_name
        missing_files = sorted({str(p) for p in files_by_key.values() if not p.is_file()})
        if missing_files:
            raise ValueError(f"{index_path} names shards that do not exist: {_first_names(missing_files)}")
    else:
        file_paths = sorted(folder.glob("*.safetensors"))
        if not file_paths:
            raise ValueError(f"No *.safetensors files in {folder}")
        for file_path in file_paths:
            with safe_open(str(file_path), framework="pt") as checkpoint:
                for key in checkpoint.keys():
                    if key in files_by_key:
                        raise ValueError(f"Tensor {key!r} is in both {files_by_key[key].name} and {file_path.name}")
                    files_by_key[key] = file_path
    return {key: p for key, p in files_by_key.items() if not key.endswith(_IGNORED_KEY_SUFFIXES)}


def _check_tied_head(params: dict[str, torch.nn.Parameter], tie_word_embeddings: bool) -> None:
    # With tied embeddings the checkpoint has no head of its own; a model that did not
    # share the tensor would keep a random head and generate garbage without any error.
    head, embedding = params.get(_TIED_HEAD_NAME), params.get(_TIED_EMBEDDING_NAME)
    if tie_word_embeddings and head is not None and head is not embedding:
        raise ValueError(
            f"tie_word_embeddings is set but the model's {_TIED_HEAD_NAME} is not the same tensor as "
            f"{_TIED_EMBEDDING_NAME}: the model must tie them before loading"
        )


# Which parameters a checkpoint tensor fills: (parameter name, None for all of it or (first, end) rows).
TensorParts = list[tuple[str, tuple[int, int] | None]]


def _check_matches(
    params: dict[str, torch.nn.Parameter],
    keys_by_file: dict[Path, list[str]],
    parts: dict[str, TensorParts],
    tie_word_embeddings: bool,
) -> None:
    filled = {name for key_parts in parts.values() for name, _ in key_parts}
    expected = set(params)
    if tie_word_embeddings:
        expected.discard(_TIED_HEAD_NAME)
    missing = sorted(expected - filled)
    unexpected = {key for key, key_parts in parts.items() if any(name not in params for name, _ in key_parts)}
    mismatched: list[str] = []
    for file_path, keys in keys_by_file.items():
        with safe_open(str(file_path), framework="pt") as checkpoint:
            for key in keys:
                if key in unexpected:
                    continue
                # get_slice reads the header only, not the tensor.
                shape = list(checkpoint.get_slice(key).get_shape())
                name, rows = parts[key][0]
                if rows is None:  # the whole tensor, under its own name or the one the model gives it
                    if shape != list(params[name].shape):
                        mismatched.append(f"{key}: checkpoint {shape} vs model {list(params[name].shape)}")
                    continue
                # A fused checkpoint tensor: its rows are the parts' rows, side by side.
                wanted = [sum(end - first for _, (first, end) in parts[key]), *params[parts[key][0][0]].shape[1:]]
                if shape != wanted or any(list(params[name].shape) != [end - first, *wanted[1:]]
                                          for name, (first, end) in parts[key]):
                    mismatched.append(f"{key}: checkpoint {shape} vs model parts "
                                      f"{[list(params[name].shape) for name, _ in parts[key]]}")
    problems: list[str] = []
    if missing:
        problems.append(f"{len(missing)} missing parameters: {_first_names(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected checkpoint tensors: {_first_names(sorted(unexpected))}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatches: {_first_names(sorted(mismatched))}")
    if problems:
        raise ValueError("Checkpoint does not match the model: " + "; ".join(problems))


def _first_names(names: Iterable[str]) -> str:
    listed = list(names)
    shown = ", ".join(listed[:_NAMES_SHOWN])
    return shown + (f", ... ({len(listed) - _NAMES_SHOWN} more)" if len(listed) > _NAMES_SHOWN else "")
