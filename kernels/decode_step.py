"""A float-cache decode call checked and planned once per step, launched once per layer.

Every layer of a decode step calls the decode wrapper with the same block tables, lengths, query shape and pool
geometry; only the query's and the layer's cache *addresses* change. :func:`paged_decode_attention` checks and
plans every call (shapes, dtypes, devices, bounds, the launch configuration, the split plan, the workspace views,
the stride arguments): about 30 µs of host time a layer. :class:`DecodeStepLaunch` does all of that once, for
the step's first layer, and then each layer only checks that its query and caches have the planned shape,
strides, dtype and device (a few tuple compares) and launches with the prepared arguments. The results are the
wrapper's: same kernels, same arguments (``tests/test_kernels_step.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from memos_kernels.common import check_cache
from memos_kernels.decode_launch import DecodeWorkspace, decode_bounds, dot_flags, plan_decode, validate_decode_inputs

from memos_ref.errors import DeviceError, DTypeError, ShapeError

__all__ = ["DecodeStepLaunch"]

LOG2E = 1.4426950408889634  # the kernels work in base 2 (as memos_kernels.paged_decode.LOG2E)


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.shape, t.stride(), t.dtype, t.device)


class DecodeStepLaunch:
    """``paged_decode_attention`` planned for a step: build it with the step's first layer's arguments (the
    wrapper's full checks, ``validate`` as there), then ``launch(query, key_cache, value_cache)`` per layer.

    ``launch`` refuses (``ShapeError``) a query or cache whose shape, strides, dtype or device differ from the
    planned ones; the block tables and lengths are the step's (kept, not re-read). Each call writes a fresh
    ``out`` unless one is passed; the split partials come from ``workspace`` (default: the device's), as in the
    wrapper. ``kernels()`` returns the split and reduce kernels, looked up at each launch."""

    def __init__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        *,
        kernels: Callable[[], tuple[Any, Any]],
        scale: float | None = None,
        max_seq_len: int | None = None,
        tokens_per_split: int | None = None,
        workspace: DecodeWorkspace | None = None,
        validate: bool | None = None,
    ) -> None:
        n, h, t, d = check_cache(key_cache, value_cache)
        if key_cache.stride() != value_cache.stride():
            raise ShapeError("key and value caches must have the same strides (two views of one pool)")
        if query.dtype != key_cache.dtype:
            raise DTypeError(f"query dtype {query.dtype} does not match the caches' {key_cache.dtype}")
        validate_decode_inputs(query, h, d, block_tables, seq_lens)
        if query.device != key_cache.device:
            raise DeviceError("query, caches, block tables and lengths must be on one device")
        max_len = decode_bounds(block_tables, seq_lens, n, t, max_seq_len, validate)
        plan = plan_decode(query, h, t, max_len, tokens_per_split=tokens_per_split, workspace=workspace)
        self.plan, self.kernels = plan, kernels
        self.scale, self.max_seq_len = scale, max_seq_len
        self.query_layout = _layout(query)
        self.cache_layout = _layout(key_cache)
        self.block_tables, self.seq_lens = block_tables, seq_lens
        dot_f32, prec = dot_flags(query)
        cfg = plan.config
        self._grid = plan.grid
        self._head = (plan.acc, plan.m, plan.l_sum)
        self._tail = (
            (scale if scale is not None else 1.0 / math.sqrt(d)) * LOG2E,
            query.stride(0), query.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            0, 0, 0,
            block_tables.stride(0), block_tables.stride(1), block_tables.shape[1], n,
            plan.tokens_per_split,
        )  # fmt: skip
        self._consts = dict(G=plan.group, GP=cfg.gp, T=t, D=d, TILE=cfg.tile, QUANT=0, DOT_F32=dot_f32, PREC=prec,
                            DIRECT=int(plan.num_splits == 1), num_warps=cfg.num_warps,
                            num_stages=cfg.num_stages)  # fmt: skip

    def matches(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None,
                max_seq_len: int | None) -> bool:  # fmt: skip
        """Whether a call with these arguments is this plan's: the same block tables and lengths (the tensors
        themselves), scale and bound, and the planned layouts of the query and caches."""
        if block_tables is not self.block_tables or seq_lens is not self.seq_lens:
            return False
        if scale != self.scale or max_seq_len != self.max_seq_len or _layout(query) != self.query_layout:
            return False
        return _layout(key_cache) == self.cache_layout == _layout(value_cache)

    def launch(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        checked: bool = False,
    ) -> torch.Tensor:
        """Decode attention of one layer: ``query [B, Hq, D]`` over ``key_cache, value_cache`` (this layer's
        views, laid out as planned); returns ``out`` (new when not given) ``[B, Hq, D]``. ``checked``: the
        caller has just seen :meth:`matches` hold."""
        if not checked and _layout(query) != self.query_layout:
            raise ShapeError(f"query {_layout(query)} differs from the planned {self.query_layout}")
        cache = self.cache_layout
        if not checked and (_layout(key_cache) != cache or _layout(value_cache) != cache):
            raise ShapeError(f"caches {_layout(key_cache)}, {_layout(value_cache)} differ from the planned {cache}")
        if out is None:
            out = torch.empty_like(query)
        elif _layout(out)[:2] != self.query_layout[:2] or out.dtype != query.dtype:
            raise ShapeError(f"out must be like the query {tuple(query.shape)}, got {tuple(out.shape)}")
        plan = self.plan
        if plan.grid[0] == 0:
            return out
        split_kernel, reduce_kernel = self.kernels()
        split_kernel[self._grid](
            query, key_cache, value_cache, self.block_tables, self.seq_lens, *self._head, out, out.stride(0),
            out.stride(1), key_cache, key_cache, *self._tail, **self._consts,
        )  # fmt: skip
        if plan.num_splits > 1:
            b, h, _ = plan.grid
            reduce_kernel[(b, h)](
                plan.acc, plan.m, plan.l_sum, out, self.seq_lens, out.stride(0), out.stride(1),
                plan.num_splits, plan.tokens_per_split, G=plan.group, GP=plan.config.gp, D=out.shape[2],
                num_warps=4,
            )  # fmt: skip
        return out
