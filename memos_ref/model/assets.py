"""Where the shipped model's files live inside the package (``memos_ref/model/assets``): the one place both the
loaders (:mod:`memos_ref.model`) and the fingerprint (:mod:`memos_ref.model.identity`) find them."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["shipped_model_dir"]


def shipped_model_dir() -> Path:
    """Folder of the shipped weights (``config.json``, ``model.safetensors``, ``training_report.json``)."""
    return Path(str(resources.files("memos_ref.model").joinpath("assets")))
