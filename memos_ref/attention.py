"""Attention over dense and paged K/V: the torch reference, and the one switch to the kernels.

``paged_attention`` has a kernel-shaped signature (one layer's K and V caches in pool layout, block tables,
sequence lengths), the same inputs a Triton or CUDA paged-attention kernel takes, so the kernels of
``memos_kernels`` are checked against it element for element. That torch reference (:func:`dense_attention`,
:func:`gather_kv`, :func:`paged_attention`) lives in :mod:`memos_ref.attention_reference` and is re-exported here;
this module is the switch between it and the kernels, and the per-step path.

Where a decode step runs (:func:`paged_decode`) is chosen by ``MEMOS_REF_KERNELS``:

* ``auto`` (default): Triton on CUDA tensors when Triton is installed, the reference otherwise;
* ``reference``: always the torch reference;
* ``triton``: always Triton (CUDA tensors);
* ``interpret``: Triton's interpreter on CPU tensors (slow; for tests and learning). It must be chosen before
  Triton is first imported — this module sets ``TRITON_INTERPRET=1`` itself when it sees ``interpret``.

The package's forward, the engine and ``PagedCache`` (its ``memos_paged`` attention function included) reach
the kernels through one per-step decision, :func:`step_path`, taken once per :class:`~memos_ref.paged.step.StepBatch`
and kept in ``step.notes["path"]``: ``"plain"`` (a float pool: writes with ``memos_kernels``' ``write_kv``, decode
with ``paged_decode_attention``), ``"int8"`` (a streaming per-token int8 pool: ``write_kv_int8``, the int8 decode
kernel), ``"fp8"`` (a streaming fp8 pool: the pool grows its block scales and encodes, the fp8 decode kernel
reads), ``"kivi"`` (a KIVI pool: the pool stages and seals, the KIVI decode kernel reads codes and staging), or
``"reference"`` (torch). :func:`write_step` writes a layer through it and :func:`attend_step` attends. Decode
steps (one query per row, no mask, window, softcap or sinks) take the kernels, and so do prefill chunks of a float
pool (the tiled causal prefill kernel); quantized prefill and feature cases run the reference (the oracle the
kernels are tested against). A kernel that fails raises
:class:`~memos_ref.errors.BackendUnavailableError` naming the kernel (``MEMOS_REF_KERNELS=reference`` avoids it).
(``memos_ref.ops`` re-exports the switch for older imports.)

Cost: the reference reads a sequence's pages with one indexed copy of *its* blocks (:func:`gather_kv`), so a
decode step costs the same in a pool of 300 blocks or of 30,000.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from memos_ref.attention_reference import dense_attention, drop_trivial_mask, gather_kv, paged_attention
from memos_ref.errors import (
    BackendUnavailableError,
    ConfigError,
    InvalidArgumentError,
    KVCacheError,
    ShapeError,
    check_type,
)

if TYPE_CHECKING:
    from memos_ref.paged.sequence import SequenceCache
    from memos_ref.paged.step import StepBatch

__all__ = [
    "MODES",
    "PATHS",
    "attend_sequences",
    "attend_step",
    "dense_attention",
    "gather_kv",
    "kernel_mode",
    "paged_attention",
    "paged_decode",
    "step_path",
    "use_kernels",
    "write_step",
]

#: The values of ``MEMOS_REF_KERNELS``.
MODES = ("auto", "reference", "triton", "interpret")

#: What a step runs on (:func:`step_path`).
PATHS = ("reference", "plain", "int8", "fp8", "kivi")


def attend_sequences(
    query: torch.Tensor,
    sequences: Sequence[SequenceCache],
    layer: int,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each sequence's newest queries ``[B, Hq, Q, D]`` over its own pages in one layer.

    Builds the block tables and lengths :func:`paged_attention` takes (the call a kernel replaces); a pool in
    several segments has no single cache tensor, and a quantized pool must be decoded, so their sequences are
    gathered (dequantized on read) one by one instead. ``mask``, ``sliding_window``, ``softcap`` and ``sinks``
    are those of :func:`paged_attention`; a decode step with any of them runs the reference, not the kernel.
    """
    check_type("query", query, torch.Tensor)
    if not sequences:
        raise InvalidArgumentError("sequences: expected at least one sequence, got none")
    if query.ndim != 4 or query.shape[0] != len(sequences):
        raise ShapeError(f"query: expected [{len(sequences)}, q_heads, queries, head_dim], got {tuple(query.shape)}")
    mask = drop_trivial_mask(mask)
    extras = dict(mask=mask, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    pool = sequences[0].pool
    if len(pool.segments) != 1 or pool.quantized:  # gather (and dequantize) per sequence
        lens = torch.tensor([seq.layer_tokens[layer] for seq in sequences])
        if mask is not None and (mask.ndim != 4 or mask.shape[3] < int(lens.max())):
            raise ShapeError(f"mask: expected [batch, heads, queries, >= {int(lens.max())}], got {tuple(mask.shape)}")
        rows = []
        for i, seq in enumerate(sequences):
            row_mask = None if mask is None else mask[i if mask.shape[0] > 1 else 0, :, :, : int(lens[i])]
            k, v = seq.to_dense(layer)
            rows.append(dense_attention(query[i], k, v, scale=scale, **{**extras, "mask": row_mask}))
        return torch.stack(rows)
    widest = max(seq.num_blocks for seq in sequences)
    tables = torch.full((len(sequences), widest), -1, dtype=torch.long)  # [B, max_blocks], -1 = padding
    for i, seq in enumerate(sequences):
        tables[i, : seq.num_blocks] = seq.block_table_tensor()
    lens = torch.tensor([seq.layer_tokens[layer] for seq in sequences])  # [B]
    view = pool.layer_view(layer)  # [num_blocks, 2, H, T, D]
    plain = all(value is None for value in extras.values())
    if query.shape[2] == 1 and plain:  # a decode step: the kernel when MEMOS_REF_KERNELS says so, else the reference
        device = view.device
        out = paged_decode(query[:, :, 0], view[:, 0], view[:, 1], tables.to(device), lens.to(device), scale=scale)
        return out[:, :, None]
    return paged_attention(query, view[:, 0], view[:, 1], tables, lens, scale=scale, **extras)


def attend_step(
    query: torch.Tensor,
    step: StepBatch,
    layer: int,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a prepared step's queries ``[B, Hq, n, D]`` over its rows' pages in one layer (after the layer
    wrote the step): the block tables and lengths come from the :class:`~memos_ref.paged.step.StepBatch`, built
    once for every layer, and the kernel choice is made once per step. A quantized or segmented pool gathers its
    rows one by one (:func:`attend_sequences`). Options as in :func:`paged_attention`."""
    check_type("query", query, torch.Tensor)
    b = len(step.sequences)
    if query.ndim != 4 or query.shape[0] != b or query.shape[2] != step.query_len:
        raise ShapeError(f"query: expected [{b}, q_heads, {step.query_len}, head_dim], got {tuple(query.shape)}")
    pool = step.pool
    extras = dict(mask=drop_trivial_mask(mask), sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    path = step_path(step)
    plain = all(value is None for value in extras.values()) and query.dtype == pool.spec.dtype
    if path != "reference" and plain and _group_fits(query, pool):
        if step.query_len == 1:
            return _attend_kernel(path, query[:, :, 0], step, layer, scale)[:, :, None]
        if path == "plain":  # a chunk of queries per row: the tiled causal prefill kernel, one launch
            return _prefill_kernel(query, step, layer, scale)
    if len(pool.segments) != 1 or pool.quantized:
        return attend_sequences(query, step.sequences, layer, scale=scale, **extras)
    view = pool.segments[0][:, layer]  # [num_blocks, 2, H, T, D]
    return paged_attention(query, view[:, 0], view[:, 1], step.block_tables, step.seq_lens, scale=scale, **extras)


# ---------------------------------------------------------------------------------------------- kernel switch
def kernel_mode() -> str:
    """``MEMOS_REF_KERNELS`` (read at each call, so a test can change it), one of :data:`MODES`."""
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
    """The kernels' launch set (:func:`memos_kernels.launch_plan.fits`: on a GPU head dims 16-128, block sizes
    8-128, groups up to 16; in the interpreter powers of two) and one dtype: outside them, the reference."""
    from memos_kernels.launch_plan import fits

    t, d = key_cache.shape[2], key_cache.shape[3]
    group = query.shape[1] // max(1, key_cache.shape[1])
    ok = query.shape[1] % max(1, key_cache.shape[1]) == 0 and fits(d, t, group, query.dtype, query.device)
    same = query.dtype == key_cache.dtype == value_cache.dtype and key_cache.stride() == value_cache.stride()
    return ok and same  # outside the limits even the explicit modes fall back, rather than fail mid-generation


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
    return paged_attention(query[:, :, None], key_cache, value_cache, block_tables, seq_lens, scale=scale)[:, :, 0]


# ---------------------------------------------------------------------------------------------- kernel path
def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _fp8_ok(device: torch.device) -> bool:
    """Triton's e4m3 needs sm_89+ on a GPU (the interpreter has it on the CPU)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _pool_path(pool: Any) -> str:
    """:func:`step_path` for a pool: which kernels can read and write it (duck-typed: this layer is below quant)."""
    from memos_kernels.launch_plan import fits as launch_fits

    spec = pool.spec
    fits = launch_fits(spec.head_dim, spec.block_size, 1, spec.dtype, pool.device)  # the group: per call
    if len(pool.segments) != 1 or not fits or not use_kernels(pool.device):
        return "reference"
    if not pool.quantized:
        return "plain"
    name = getattr(pool.scheme, "name", "")
    streaming = getattr(pool, "streaming", False)  # no residual window: every token is encoded as it is written
    if name == "int8_token" and streaming:
        return "int8"
    if name == "fp8_e4m3" and streaming and _fp8_ok(pool.device):
        return "fp8"
    group = getattr(pool.scheme, "group_size", 0)
    if name.startswith("kivi") and _pow2(group) and spec.block_size % group == 0:
        return "kivi"
    return "reference"  # per-tensor int8, fp16 codes, residual windows over int8/fp8: the torch reference


def _group_fits(query: torch.Tensor, pool: Any) -> bool:
    """Whether the query group (query heads per KV head) is in the kernels' launch set on the pool's device (at
    most 16 on a GPU: :data:`memos_kernels.launch_plan.MAX_GROUP`); a wider group runs the reference."""
    from memos_kernels.launch_plan import fits

    spec, hq = pool.spec, query.shape[1]
    if hq % spec.num_kv_heads:
        return False
    return fits(spec.head_dim, spec.block_size, hq // spec.num_kv_heads, spec.dtype, pool.device)


def step_path(step: StepBatch) -> str:
    """The one switch: what ``step`` writes and attends with, one of :data:`PATHS`, decided at its first call and
    kept in ``step.notes["path"]`` (every layer of the step then takes the same path).

    ``MEMOS_REF_KERNELS`` (:func:`use_kernels`) says whether kernels run on the pool's device at all; then the
    pool says which: a float pool ``"plain"``, a streaming per-token int8 pool ``"int8"``, a streaming fp8 pool
    ``"fp8"`` (sm_89+), a KIVI pool ``"kivi"``; anything else, or a geometry outside the kernels' limits
    (head_dim and block size powers of two, block size 8-128), ``"reference"``."""
    path = step.notes.get("path")
    if path is None:
        path = step.notes["path"] = _pool_path(step.pool)
    return path  # type: ignore[return-value]


def _launch(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a ``memos_kernels`` wrapper; a failure that is not already one of the package's errors (a Triton
    compile or launch error) becomes :class:`BackendUnavailableError` naming the kernel and the way around it."""
    try:
        return fn(*args, **kwargs)
    except KVCacheError:
        raise
    except Exception as exc:
        raise BackendUnavailableError(
            f"the Triton kernel {what} failed ({type(exc).__name__}: {exc}); MEMOS_REF_KERNELS=reference runs the "
            f"torch reference instead"
        ) from exc


def _validate(step: StepBatch, what: str) -> bool | None:
    """The ``validate`` argument of a kernel wrapper: the metadata's values (block tables, lengths, slots) are
    checked at the step's first call of ``what`` — on the CPU; on a GPU that would be a host sync, and the kernels
    mask every index they derive instead — and never again for the step's other layers."""
    key = f"validated:{what}"
    if key in step.notes:
        return False
    step.notes[key] = True
    return None


def _store_plain(step: StepBatch, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """``write_kv`` of ``key, value [B·n, H, D]`` into a float pool's layer at the step's slots."""
    view = step.pool.segments[0][:, layer]  # [N, 2, H, T, D]
    _launch("write_kv", _triton().write_kv, key, value, step.slot_mapping, view[:, 0], view[:, 1],
            validate=_validate(step, "write"))  # fmt: skip


def _store_int8(step: StepBatch, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """``write_kv_int8`` into a streaming per-token int8 pool (the pool refuses values it cannot encode first)."""
    pool = step.pool
    pool.check_kv(key, value, layer)
    _launch("write_kv_int8", _triton().write_kv_int8, key, value, step.slot_mapping, **pool.kernel_args(layer),
            validate=_validate(step, "write"))  # fmt: skip


#: The kernel write of each path; a path without one writes through the pool (fp8 grows its block scales, KIVI
#: stages full-precision blocks and seals them: the pool's own bookkeeping).
_STORES = {"plain": _store_plain, "int8": _store_int8}


def write_step(step: StepBatch, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write layer ``layer``'s K/V ``[B, H, n, D]`` of every row of ``step`` through :func:`step_path`'s choice:
    ``write_kv`` / ``write_kv_int8`` on the kernel path, the pool's own store otherwise
    (:meth:`~memos_ref.paged.step.StepBatch.write` checks before and counts after either way)."""
    step.write(layer, key, value, store=_STORES.get(step_path(step)))


def _prefill_kernel(query: torch.Tensor, step: StepBatch, layer: int, scale: float | None) -> torch.Tensor:
    """A chunk ``query [B, Hq, n, D]`` of every row, causal over its pages, through ``paged_prefill_attention``."""
    qlens = step.notes.get("query_lens")
    if qlens is None:  # once per step, on the pool's device
        qlens = step.notes["query_lens"] = torch.full_like(step.seq_lens, step.query_len)
    view = step.pool.segments[0][:, layer]  # [N, 2, H, T, D]
    return _launch(
        "paged_prefill_attention",
        _triton().paged_prefill_attention,
        query, view[:, 0], view[:, 1], step.block_tables, step.seq_lens, qlens, scale=scale,
        validate=_validate(step, "prefill"),
    )  # fmt: skip


def _attend_kernel(path: str, query: torch.Tensor, step: StepBatch, layer: int, scale: float | None) -> torch.Tensor:
    """One decode step ``query [B, Hq, D]`` of layer ``layer`` through the ``path`` kernel; returns ``[B, Hq, D]``."""
    tk, pool = _triton(), step.pool
    tables, lens = step.block_tables, step.seq_lens
    longest = step.notes.get("longest")
    if longest is None:  # once per step
        longest = step.notes["longest"] = max(step.lens)
    if path == "plain":  # checked and planned at the step's first layer (step_memo), the others only launch
        view = pool.segments[0][:, layer]  # [N, 2, H, T, D]
        return _launch(
            "paged_decode_attention",
            tk.paged_decode_attention,
            query, view[:, 0], view[:, 1], tables, lens, scale=scale, max_seq_len=longest,
            validate=_validate(step, "decode"), step_memo=step.notes,
        )  # fmt: skip
    if path in ("int8", "fp8"):
        args = pool.kernel_args(layer)
        return _launch(
            f"paged_decode_attention(quant={path!r})",
            tk.paged_decode_attention,
            query, args["key_codes"], args["value_codes"], tables, lens, scale=scale, max_seq_len=longest,
            quant=path, key_scale=args["key_scale"], value_scale=args["value_scale"],
            validate=_validate(step, "decode"),
        )  # fmt: skip
    from memos_kernels.kivi_decode import KIVI_PAYLOAD, KiviBlocks

    args = pool.kernel_args(layer)  # every tensor on the pool's device (the staging slot map refreshed if stale)
    blocks = KiviBlocks(
        *(args[name] for name in KIVI_PAYLOAD),
        args["staging"],
        args["staging_slot"],
        bits=args["bits"],
        group_size=args["group_size"],
    )
    return _launch(
        "paged_decode_attention_kivi",
        tk.paged_decode_attention_kivi_packed,
        query, blocks, tables, lens, scale=scale, max_seq_len=longest, validate=_validate(step, "decode"),
    )  # fmt: skip
