"""Compatibility name for the kernel switch, which now lives in :mod:`memos_ref.attention`.

``memos_ref.ops`` was a helper of attention only (and attention imported it back, a cycle); import
``paged_decode``, ``use_kernels``, ``kernel_mode`` and ``MODES`` from :mod:`memos_ref.attention` instead.
"""

from __future__ import annotations

from memos_ref.attention import MODES, kernel_mode, paged_decode, use_kernels

__all__ = ["MODES", "kernel_mode", "paged_decode", "use_kernels"]
