"""One model identity for everything that stores or shares KV.

Prefix hashes (:class:`~memos_ref.paged.PagedKV` ``fingerprint=``), tier block files and Redis keys
(``TierStore``/``RedisTierBackend`` ``fingerprint=``) and saved sessions (:class:`~memos_ref.session.SessionManager`)
all carry a model fingerprint so that KV computed by one model is never served to another. They must agree
on what "the same model" means, so there is exactly one function, :func:`fingerprint`, and it gives the same
answer for the same weights however they are held:

* the package's forward (:class:`~memos_ref.model.llama.LlamaForward`, ``load_model()``),
* the transformers model on the same weights (``load_hf_model()``),
* the model folder on disk (``config.json`` + ``model.safetensors`` or a sharded index).

What is hashed (SHA-256, first 16 hex digits):

1. the architecture: for Llama / Mistral / Qwen2 configs the fields of
   :class:`~memos_ref.model.llama.LlamaConfig` (without its ``dtype`` note, which the tensors carry); for other
   transformers families the config's ``to_dict()`` minus bookkeeping keys (``transformers_version``,
   ``_name_or_path``, ``dtype``, ``architectures``, ``use_cache``, keys starting with ``_``, ...);
2. every tensor of the state dict by sorted name: its name, shape, dtype and bytes. A tied ``lm_head`` is
   hashed under both names, as a module's ``state_dict()`` lists it.

So the same weights in another dtype are another model (their KV differs), and a changed config field that
does not live in the weights (``rope_theta``, ``rms_norm_eps``, ...) is another model too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from memos_ref.errors import ArgumentTypeError, ConfigError
from memos_ref.model.assets import shipped_model_dir

__all__ = ["config_identity", "fingerprint"]

_FORMAT = b"memos-ref-model-identity-v1\x00"
#: transformers config keys that describe how a model was saved or is run, not what it computes.
_BOOKKEEPING = frozenset(
    {
        "transformers_version",
        "name_or_path",
        "dtype",
        "torch_dtype",
        "architectures",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "torchscript",
        "attn_implementation",
        "tie_encoder_decoder",
        "chunk_size_feed_forward",
        "problem_type",
        "id2label",
        "label2id",
    }
)


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def config_identity(config: Any) -> dict[str, Any]:
    """The architecture part of a model's identity as a JSON-safe dict (see the module docstring).

    ``config`` is a :class:`~memos_ref.model.llama.LlamaConfig`, a transformers ``PretrainedConfig``, or a
    ``config.json`` mapping.
    """
    from memos_ref.model.llama import LlamaConfig

    if isinstance(config, LlamaConfig):
        fields = dataclasses.asdict(config)
        fields.pop("dtype")
        return {"family": "llama-like", **fields}
    if hasattr(config, "to_dict") and callable(config.to_dict):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ArgumentTypeError(
            f"config: expected a LlamaConfig, a transformers PretrainedConfig or a config.json mapping, "
            f"got {type(config).__name__}"
        )
    try:
        return config_identity(LlamaConfig.from_hf_dict(config))
    except (ConfigError, KeyError, TypeError, ValueError):
        pass  # another family: its config as transformers describes it
    return {
        "family": "transformers",
        **{k: v for k, v in config.items() if k not in _BOOKKEEPING and not str(k).startswith("_")},
    }


def _update_tensor(digest: Any, name: str, tensor: torch.Tensor) -> None:
    tensor = tensor.detach().contiguous().cpu()
    digest.update(f"{name}:{tuple(tensor.shape)}:{str(tensor.dtype).removeprefix('torch.')}\x00".encode())
    digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def _folder_tensors(folder: Path, config: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of a model folder by sorted name, one tensor in memory at a time."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        single = folder / "model.safetensors"
        if not single.is_file():
            raise ConfigError(f"{folder} has no model.safetensors (nor a sharded index): expected a model folder")
        with safe_open(str(single), framework="pt") as fh:
            weight_map = {name: "model.safetensors" for name in fh.keys()}  # noqa: SIM118 (not a dict)
    tied = bool(config.get("tie_word_embeddings", False))
    if tied and "lm_head.weight" not in weight_map and "model.embed_tokens.weight" in weight_map:
        weight_map = {**weight_map, "lm_head.weight": weight_map["model.embed_tokens.weight"]}
        aliases = {"lm_head.weight": "model.embed_tokens.weight"}
    else:
        aliases = {}
    for name in sorted(weight_map):
        with safe_open(str(folder / weight_map[name]), framework="pt") as fh:
            yield name, fh.get_tensor(aliases.get(name, name))


def _is_llama_like(raw: Mapping[str, Any]) -> bool:
    from memos_ref.model.llama import LlamaConfig

    try:
        LlamaConfig.from_hf_dict(raw)
    except (ConfigError, KeyError, TypeError, ValueError):
        return False
    return True


def _folder_fingerprint(folder: Path) -> str:
    """Fingerprint of a model folder. Llama / Mistral / Qwen2 folders are hashed tensor by tensor from the
    files; other families are loaded with transformers first (their checkpoint names and tied weights differ
    from the loaded model's state dict in family-specific ways), falling back to the files."""
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} has no config.json: expected a model folder")
    raw = json.loads((folder / "config.json").read_text())
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{folder / 'config.json'} does not hold a JSON object")
    if not _is_llama_like(raw):
        try:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype="auto")
        except Exception:  # transformers cannot load it: hash the files as they are
            pass
        else:
            return fingerprint(model)
    digest = hashlib.sha256(_FORMAT)
    digest.update(_canonical(config_identity(raw)))
    for name, tensor in _folder_tensors(folder, raw):
        _update_tensor(digest, name, tensor)
    return digest.hexdigest()[:16]


def fingerprint(source: Any = None) -> str:
    """The model fingerprint (16 hex digits) of ``source``: a model (the package's ``LlamaForward`` or a
    transformers ``PreTrainedModel``), a model folder (``str`` / ``Path``), or ``None`` for the shipped model.

    The same weights and config give the same fingerprint by every route; any changed weight byte, dtype,
    tensor shape or architecture field gives another.
    """
    if source is None:
        source = shipped_model_dir()
    if isinstance(source, (str, os.PathLike)):
        return _folder_fingerprint(Path(source))
    if not (callable(getattr(source, "state_dict", None)) and hasattr(source, "config")):
        raise ArgumentTypeError(
            f"source: expected a model (with .config and .state_dict()), a model folder path or None, "
            f"got {type(source).__name__}"
        )
    digest = hashlib.sha256(_FORMAT)
    digest.update(_canonical(config_identity(source.config)))
    for name, tensor in sorted(source.state_dict().items()):
        _update_tensor(digest, name, tensor)
    return digest.hexdigest()[:16]
