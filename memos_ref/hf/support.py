"""Model-family support checks of :class:`~memos_ref.hf.PagedCache`: what a model may hand the cache, and what it
is refused with.

The paged pool stores K and V of one ``head_dim`` for attention layers, causal, without extra biases. A model
outside that — multi-head latent attention (K and V of different widths), hybrid linear-attention / state-space
layers asking for recurrent state, sparse-attention indexers, bidirectional attention, attention biases, dropout
in training — raises :class:`~memos_ref.errors.UnsupportedModelError` naming the feature, before anything is
written, instead of computing something else. Whole configs are checked up front
(:func:`check_model_config`).
"""

from __future__ import annotations

from typing import Any

import torch

from memos_ref.errors import DeviceError, DTypeError, ShapeError, UnsupportedModelError, check_type
from memos_ref.spec import KVSpec, check_supported_config, warn_sliding_window

__all__ = [
    "INDEXER_HINT",
    "LINEAR_HINT",
    "MLA_HINT",
    "check_model_config",
    "check_step_kv",
    "refuse_unsupported_attention",
]

#: Why K and V of different widths are refused.
MLA_HINT = (
    "K and V of different widths, as in multi-head latent attention (DeepSeek-V2/V3): MLA is not supported — "
    "the paged pool stores K and V of one head_dim; use transformers' DynamicCache for it"
)
#: Why a request for recurrent state (linear attention, state-space layers) is refused.
LINEAR_HINT = (
    "a hybrid linear-attention / state-space model (Qwen3-Next, ...) asked the cache for recurrent state: linear "
    "attention is not supported by PagedCache, which holds only K/V of attention layers; use the model's own cache"
)
#: Why a sparse-attention indexer cache is refused.
INDEXER_HINT = "sparse-attention indexer caches (DeepSeek-V3.2) are not supported by PagedCache"


def check_model_config(config: Any) -> None:
    """Refuse a model (config, or the model) whose attention cannot live in the paged cache, before any forward
    (:func:`memos_ref.spec.check_supported_config`), and warn once about sliding-window layers' memory."""
    check_supported_config(config)
    warn_sliding_window(config)


def check_step_kv(key: Any, value: Any, spec: KVSpec, device: torch.device, rows: int | None) -> None:
    """Refuse a step's K/V ``[B, H_kv, n, D]`` that the pool of ``spec`` on ``device`` cannot store (a cache of
    ``rows`` rows, or ``None`` before its first write): MLA's unequal K/V widths, a wrong shape, dtype or device, or
    another batch size. Raises before anything is written."""
    check_type("key_states", key, torch.Tensor)
    check_type("value_states", value, torch.Tensor)
    if key.ndim == 4 and value.ndim == 4 and key.shape[-1] != value.shape[-1]:
        raise UnsupportedModelError(f"key head_dim {key.shape[-1]} != value head_dim {value.shape[-1]}: {MLA_HINT}")
    if key.ndim != 4 or key.shape != value.shape:
        raise ShapeError(
            f"key/value must both be [batch, kv_heads, tokens, head_dim], got {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    if (key.shape[1], key.shape[3]) != (spec.num_kv_heads, spec.head_dim):
        raise ShapeError(
            f"key shape {tuple(key.shape)}: expected kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}"
        )
    if key.dtype != spec.dtype or value.dtype != spec.dtype:
        raise DTypeError(
            f"key dtype {key.dtype} (value {value.dtype}) does not match the pool's {spec.dtype}: build the "
            f"pool in the model's dtype, e.g. PagedKV(KVSpec.from_hf_config(model), ...) (it reads the model's "
            f"parameters) or KVSpec.from_hf_config(config, dtype=model.dtype)"
        )
    for name, t in (("key", key), ("value", value)):
        if t.device != device:
            raise DeviceError(f"{name} device {t.device} does not match the pool's {device}")
    if rows and key.shape[0] != rows:
        raise ShapeError(f"batch of {key.shape[0]} rows, but this cache holds {rows}")


def refuse_unsupported_attention(module: torch.nn.Module, dropout: float, kwargs: dict[str, Any]) -> None:
    """Raise :class:`UnsupportedModelError` for attention the paged read does not compute: dropout in training,
    bidirectional attention, position biases, head masks, attention biases, ALiBi."""
    if dropout and getattr(module, "training", False):
        raise UnsupportedModelError(f"attention dropout ({dropout}) in training mode is not supported by PagedCache")
    if kwargs.get("is_causal", True) is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedModelError("bidirectional (non-causal) attention is not supported by PagedCache")
    for name in ("position_bias", "head_mask", "attention_bias", "alibi"):
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"attention with {name} is not supported by PagedCache(direct=True)")
