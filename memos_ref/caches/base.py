"""What every dense (non-paged) cache of the package shares: input checks, byte accounting, the transformers
``Cache`` protocol.

A cache here is a ``transformers.Cache`` whose per-layer objects do the storing. That one protocol
(``update(k, v, layer_idx) -> (K_all, V_all)``, ``get_seq_length()``) is what both the package's teaching
forward and every transformers model call, so each cache works in both without adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from memos_ref.errors import (
    DeviceError,
    DTypeError,
    LayerIndexError,
    ShapeError,
    UnsupportedModelError,
    check_layer_index,
    check_type,
)

__all__ = ["MAX_LAZY_LAYERS", "MLA_HINT", "MemosCache", "check_new_kv"]

#: Why K and V of different head dims are refused (the hint :class:`~memos_ref.hf.PagedCache` gives too).
MLA_HINT = (
    "K and V of different widths, as in multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2, MiniCPM3): MLA "
    "is not supported — the package's caches store K and V of one head_dim; use transformers' DynamicCache for it"
)

#: Without ``num_layers``, layers are created on first use; an index past this is surely a mistake.
MAX_LAZY_LAYERS = 1024


def check_new_kv(layer: CacheLayerMixin, key: torch.Tensor, value: torch.Tensor) -> None:
    """Reject K/V that this layer cannot store, before anything is changed.

    Expected: two tensors of one shape ``[B, H_kv, S_new, D]``; once the layer holds data, the same batch,
    heads, head dim, dtype and device as before.
    """
    check_type("key_states", key, torch.Tensor)
    check_type("value_states", value, torch.Tensor)
    if key.ndim != 4:
        raise ShapeError(f"key must be 4-D [batch, kv_heads, new_tokens, head_dim], got shape {tuple(key.shape)}")
    if value.ndim == 4 and key.shape[:-1] == value.shape[:-1] and key.shape[-1] != value.shape[-1]:
        raise UnsupportedModelError(
            f"{type(layer).__name__}: key head_dim {key.shape[-1]} != value head_dim {value.shape[-1]} "
            f"(key {tuple(key.shape)}, value {tuple(value.shape)}): {MLA_HINT}"
        )
    if key.shape != value.shape:
        raise ShapeError(f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}")
    if key.dtype != value.dtype:
        raise DTypeError(f"key and value dtypes differ: {key.dtype} vs {value.dtype}")
    if key.device != value.device:
        raise DeviceError(f"key and value devices differ: {key.device} vs {value.device}")
    if not getattr(layer, "is_initialized", False):
        return
    b, h, _, d = key.shape
    expected = (layer.batch_size, layer.num_heads, layer.head_dim)
    if (b, h, d) != expected:
        raise ShapeError(
            f"key shape {tuple(key.shape)} does not fit this layer: expected [batch={expected[0]}, "
            f"kv_heads={expected[1]}, *, head_dim={expected[2]}]"
        )
    if key.dtype != layer.dtype:
        raise DTypeError(f"key dtype {key.dtype} does not match the cache dtype {layer.dtype}")
    if key.device != layer.device:
        raise DeviceError(f"key device {key.device} does not match the cache device {layer.device}")


class MemosCache(Cache):
    """A ``transformers.Cache`` made of the package's layer objects, with checks and byte accounting.

    Args:
        layer_factory: builds one layer object.
        num_layers: when given, layers are created up front and a ``layer_idx`` outside ``[0, num_layers)``
            raises :class:`LayerIndexError`; when ``None`` they are created on first use, as transformers'
            ``DynamicCache`` does.
    """

    def __init__(self, layer_factory: Callable[[], CacheLayerMixin], num_layers: int | None = None) -> None:
        if num_layers is not None:
            check_type("num_layers", num_layers, int)
            if num_layers <= 0:
                raise LayerIndexError(f"num_layers must be a positive int or None, got {num_layers!r}")
        self.num_layers = num_layers
        if num_layers is None:
            super().__init__(layer_class_to_replicate=layer_factory)
        else:
            super().__init__(layers=[layer_factory() for _ in range(num_layers)])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new K/V ``[B, H_kv, S_new, D]`` of layer ``layer_idx``; return all of that layer's K/V.

        A rejected call leaves the cache exactly as it was, including layers it would have created.
        """
        check_type("layer_idx", layer_idx, int)
        if self.num_layers is not None:
            check_layer_index(layer_idx, self.num_layers, "layer_idx")
        elif not 0 <= layer_idx < MAX_LAZY_LAYERS:
            raise LayerIndexError(
                f"layer_idx {layer_idx} is out of range: expected a layer index in [0, {MAX_LAZY_LAYERS}) (the most "
                f"a lazily grown cache accepts; pass num_layers to bound the cache explicitly), got {layer_idx}"
            )
        layers_before = len(self.layers)
        try:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except Exception:
            del self.layers[layers_before:]  # undo lazily created layers
            raise

    # ------------------------------------------------------------------ accounting
    @property
    def bytes_copied(self) -> int:
        """Bytes written into cache memory so far, growth and concatenation copies included."""
        return sum(getattr(layer, "bytes_copied", 0) for layer in self.layers)

    def nbytes_used(self) -> int:
        """Bytes of K/V actually holding tokens."""
        return sum(layer.nbytes_used() for layer in self.layers)

    def nbytes_reserved(self) -> int:
        """Bytes of memory the cache holds (preallocated capacity included)."""
        return sum(layer.nbytes_reserved() for layer in self.layers)

    def stats(self) -> dict[str, int]:
        """Tokens, bytes used, bytes reserved and bytes copied, as a dict."""
        return {
            "tokens": self.get_seq_length(),
            "layers": len(self.layers),
            "nbytes_used": self.nbytes_used(),
            "nbytes_reserved": self.nbytes_reserved(),
            "bytes_copied": self.bytes_copied,
        }
