"""The paged attention function, registered with transformers as ``attn_implementation="memos_paged"``.

A model loaded with the name :func:`register_paged_attention` returns, used with a ``PagedCache(kv, direct=True)``,
gets a :class:`~memos_ref.hf.PagedView` from the cache's ``update`` instead of dense K/V, and this function attends
over the pages (:meth:`~memos_ref.hf.PagedView.attend`), honouring the attention mask transformers built (left
padding), sliding windows, logit softcapping (Gemma 2) and attention sinks (GPT-OSS). Given dense K/V (any other
cache) it runs SDPA, or the model's own eager attention where SDPA cannot compute softcapping or sinks.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from memos_ref.errors import ShapeError, UnsupportedModelError
from memos_ref.hf.cache import PagedView
from memos_ref.hf.support import refuse_unsupported_attention

__all__ = ["PAGED_ATTENTION", "register_paged_attention"]

#: The name under which :func:`register_paged_attention` registers the paged attention function.
PAGED_ATTENTION = "memos_paged"


def _paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: Any,
    value: Any,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: attend over the pages when given a :class:`PagedView`, else dense.

    Honours the attention mask transformers built (padding, sliding window; registered as an SDPA-style bool
    mask), ``sliding_window``, ``softcap`` (Gemma 2) and ``s_aux`` attention sinks (GPT-OSS). Features it does
    not implement raise :class:`UnsupportedModelError` instead of computing something else.
    """
    if not isinstance(key, PagedView):
        return _dense_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            sliding_window=sliding_window,
            softcap=softcap,
            s_aux=s_aux,
            **kwargs,
        )
    # refused before this step's K/V are written (a refusal writes nothing), and a view that outlived its cache
    # before the mask is read
    refuse_unsupported_attention(module, dropout, kwargs)
    key.cache  # noqa: B018
    mask = _pages_mask(attention_mask, query)
    padded = sliding_window is None and _has_padding(mask)
    out = key.attend(  # [B, Hq, S, D]
        query, scale=scaling, mask=mask, sliding_window=sliding_window, softcap=softcap, sinks=s_aux, padded=padded
    )
    return out.transpose(1, 2).contiguous(), None


def _pages_mask(mask: Any, query: torch.Tensor) -> torch.Tensor | None:
    """transformers' mask as ``[B, 1|Hq, Q, K]`` (bool: may attend, or float: added), or ``None``."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise UnsupportedModelError(
            f"attention mask of type {type(mask).__name__} (e.g. a flex BlockMask) is not supported by "
            f"PagedCache(direct=True); load the model with attn_implementation={PAGED_ATTENTION!r}"
        )
    if mask.ndim == 2:  # [B, K] padding mask: every query sees the same keys (causality is applied separately)
        mask = mask.bool()[:, None, None, :].expand(-1, 1, query.shape[2], -1)
    if mask.ndim != 4:
        raise ShapeError(f"attention mask: expected [batch, 1 or heads, queries, keys], got {tuple(mask.shape)}")
    return mask


def _has_padding(mask: torch.Tensor | None) -> bool:
    """Whether a causal ``[B, 1|Hq, Q, K]`` mask hides a key from the last query (padding; without a sliding
    window the last query sees every earlier key)."""
    if mask is None:
        return False
    last = mask[..., -1, :]
    return bool((~last).any()) if last.dtype == torch.bool else bool((last < 0).any())


def _dense_attention_forward(module, query, key, value, attention_mask, *, scaling, dropout, **kwargs):
    """Dense K/V (any other cache): SDPA, or the model's own eager attention for softcapping and sinks (which SDPA
    does not compute)."""
    if kwargs.get("softcap") is None and kwargs.get("s_aux") is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise UnsupportedModelError(
            f"{type(module).__name__} asks for softcapping or attention sinks on dense K/V and its module has no "
            f"eager_attention_forward to compute them; use PagedCache(kv, direct=True) or attn_implementation='eager'"
        )
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool:  # eager adds its mask
        attention_mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(
            ~attention_mask, torch.finfo(query.dtype).min
        )
    return eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register_paged_attention() -> str:
    """Register the paged attention function with transformers (and an SDPA-style mask for it, so padding and
    sliding windows reach it); load models with the returned name as ``attn_implementation``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PAGED_ATTENTION, _paged_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PAGED_ATTENTION, sdpa_mask)
    return PAGED_ATTENTION
