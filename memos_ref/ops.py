"""One switch for the attention kernels: the Triton kernels of ``memos_kernels`` or the torch reference.

``MEMOS_REF_KERNELS`` chooses:

* ``auto`` (default): Triton on CUDA tensors when Triton is installed, the reference otherwise;
* ``reference``: always the torch reference (:mod:`memos_ref.attention`);
* ``triton``: always Triton (CUDA tensors);
* ``interpret``: Triton's interpreter on CPU tensors (slow; for tests and learning). It must be chosen before
  Triton is first imported — this module sets ``TRITON_INTERPRET=1`` itself when it sees ``interpret``.

``PagedCache.attend``, the ``memos_paged`` attention function and the engine all reach the kernels through
:func:`memos_ref.attention.attend_sequences`, which calls :func:`paged_decode` for decode steps.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from memos_ref.errors import BackendUnavailableError, ConfigError, ShapeError, check_type

__all__ = ["MODES", "kernel_mode", "paged_decode", "use_kernels"]

MODES = ("auto", "reference", "triton", "interpret")


def kernel_mode() -> str:
    mode = os.environ.get("MEMOS_REF_KERNELS", "auto")
    if mode not in MODES:
        raise ConfigError(f"MEMOS_REF_KERNELS must be one of {MODES}, got {mode!r}")
    return mode


@functools.cache
def _triton() -> Any:
    if kernel_mode() == "interpret":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from memos_kernels import triton_paged
    except ImportError as exc:
        raise BackendUnavailableError("Triton is not installed: pip install 'memos-ref[kernels]'") from exc
    return triton_paged


def use_kernels(device: torch.device) -> bool:
    """Whether attention on ``device`` goes through the Triton kernels under the current mode."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    if mode == "interpret":
        return True
    if mode == "triton":
        if device.type != "cuda":
            raise ConfigError("MEMOS_REF_KERNELS=triton needs CUDA tensors; use interpret on the CPU")
        return True
    if device.type != "cuda":
        return False
    try:
        _triton()
    except BackendUnavailableError:
        return False
    return True


def _kernel_fits(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """The kernel's limits (power-of-two head_dim, block size 8-128, one dtype): outside them, the reference."""
    t, d = key_cache.shape[2], key_cache.shape[3]
    pow2 = d > 0 and d & (d - 1) == 0 and t & (t - 1) == 0 and 8 <= t <= 128
    same = query.dtype == key_cache.dtype == value_cache.dtype and key_cache.stride() == value_cache.stride()
    return pow2 and same  # outside the limits even the explicit modes fall back, rather than fail mid-generation


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention ``query [B, Hq, D]`` over paged caches ``[N, H, T, D]``: the kernel or the reference."""
    for name, value in (
        ("query", query),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
    ):
        check_type(name, value, torch.Tensor)
    if query.ndim != 3:
        raise ShapeError(f"query: expected [batch, q_heads, head_dim] (one decode step), got {tuple(query.shape)}")
    if use_kernels(query.device) and _kernel_fits(query, key_cache, value_cache):
        return _triton().paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale=scale)
    from memos_ref.attention import paged_attention

    return paged_attention(query[:, :, None], key_cache, value_cache, block_tables, seq_lens, scale=scale)[:, :, 0]
