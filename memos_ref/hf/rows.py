"""The rows of a :class:`~memos_ref.hf.PagedCache`: which sequences it may start from, the blocks a step needs
before any row is written, and how a dropped cache gives its rows back.

Each batch row is a :class:`~memos_ref.paged.sequence.SequenceCache` of one shared
:class:`~memos_ref.paged.store.PagedKV`. :class:`Rows` holds them apart from the cache so that a finalizer
(:func:`release_rows`) can free them after the cache itself is gone; when a garbage collection starts inside the
allocator, the rows wait in a pending list that :func:`drain_pending` frees on the next cache operation.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch

from memos_ref.errors import (
    DTypeError,
    InvalidArgumentError,
    OutOfBlocksError,
    ShapeError,
    StagingFullError,
    UseAfterFreeError,
    check_type,
)
from memos_ref.paged.sequence import UNKNOWN_TOKEN, SequenceCache
from memos_ref.paged.store import PagedKV

__all__ = [
    "Rows",
    "check_prefix_ids",
    "check_sequences",
    "check_token_mask",
    "drain_pending",
    "ensure_blocks",
    "ensure_staging",
    "fork_rows",
    "prefix_rows",
    "release_rows",
    "row_token_ids",
    "select_rows",
]


# ---------------------------------------------------------------------------------------------- lifetime
class Rows:
    """The sequences of one :class:`~memos_ref.hf.PagedCache`, kept apart from it so that a finalizer can free them
    after the cache itself is gone."""

    __slots__ = ("kv", "sequences")

    def __init__(self, kv: PagedKV, sequences: list[SequenceCache]) -> None:
        self.kv, self.sequences = kv, sequences


#: dropped caches' rows, when they could not be freed at once. No lock guards it: a finalizer can run inside any
#: code, this module's included, so one that waited for a lock held lower in its own thread would wait for good;
#: ``list.extend`` and ``list.pop`` are each atomic.
_pending: list[SequenceCache] = []


def release_rows(rows: Rows) -> None:
    """The finalizer of a dropped cache: free its rows now, unless this thread is inside the allocator (a garbage
    collection can start in the middle of any code), then on the next PagedCache operation."""
    seqs, rows.sequences = rows.sequences, []
    lock = getattr(rows.kv.allocator, "lock", None)  # the public RLock; a null pool's allocator may have none
    owned = getattr(lock, "_is_owned", None)
    if owned is not None and owned():
        _pending.extend(seqs)
        return
    for seq in seqs:
        seq.free()


def drain_pending() -> None:
    """Free the rows that finalizers had to defer."""
    while _pending:
        try:
            seq = _pending.pop()
        except IndexError:  # another thread took the last one
            return
        seq.free()


def fork_rows(sequences: Sequence[SequenceCache]) -> list[SequenceCache]:
    """A fork of each sequence (sharing its blocks); all or none (a failed fork frees the ones made)."""
    rows: list[SequenceCache] = []
    try:
        for seq in sequences:
            rows.append(seq.fork())
    except BaseException:
        for seq in rows:
            seq.free()
        raise
    return rows


def select_rows(sequences: Sequence[SequenceCache], indices: list[int]) -> list[SequenceCache]:
    """A fork of ``sequences[i]`` for each ``i`` of ``indices`` (beam reordering, batch selection); all or none."""
    for i in indices:
        if not 0 <= i < len(sequences):
            raise InvalidArgumentError(f"row {i} is not in [0, {len(sequences)})")
    return fork_rows([sequences[i] for i in indices])


def prefix_rows(kv: PagedKV, input_ids: torch.Tensor, cache_salt: str | None) -> list[SequenceCache]:
    """One sequence per row of ``input_ids [B, S]`` holding its longest cached prefix, all trimmed to the shortest
    hit (the trimmed tokens are uncounted as prefix hits); all or none."""
    rows: list[SequenceCache] = []
    try:
        for ids in input_ids:
            rows.append(kv.start_from_prefix(ids.tolist(), cache_salt))
    except BaseException:
        for seq in rows:
            seq.free()
        raise
    shortest = min(seq.num_tokens for seq in rows)
    for seq in rows:
        if seq.num_tokens > shortest:
            if kv.prefix_cache is not None:
                kv.prefix_cache.uncount_hits(seq.num_tokens - shortest)  # looked up but not reused
            seq.truncate(shortest)
    return rows


# ---------------------------------------------------------------------------------------------- checks
def check_sequences(
    kv: PagedKV, sequences: Sequence[SequenceCache] | None, ragged: bool = False
) -> list[SequenceCache]:
    """The rows a cache starts from: live sequences of this very ``kv``, all at one length (unless ``ragged``)."""
    if sequences is None:
        return []
    check_type("sequences", sequences, (list, tuple))
    rows = list(sequences)
    for i, seq in enumerate(rows):
        check_type(f"sequences[{i}]", seq, SequenceCache)
        if seq.allocator is not kv.allocator:
            raise InvalidArgumentError(f"sequences[{i}] belongs to another PagedKV than kv")
        if seq.freed:
            raise UseAfterFreeError(f"sequences[{i}] was freed; create a new sequence (or fork() before free())")
    if not ragged and len({seq.num_tokens for seq in rows}) > 1:
        raise InvalidArgumentError(
            f"sequences: every row must hold the same number of tokens, got {[seq.num_tokens for seq in rows]}"
        )
    if len({id(seq) for seq in rows}) != len(rows):
        raise InvalidArgumentError("sequences: a sequence appears twice (fork() it for a second row)")
    return rows


def check_prefix_ids(input_ids: Any, cache_salt: Any) -> None:
    """Refuse prompt ids that are not an integer tensor ``[batch >= 1, tokens]``, or a salt that is not a str."""
    check_type("input_ids", input_ids, torch.Tensor)
    if cache_salt is not None:
        check_type("cache_salt", cache_salt, str)
    if input_ids.ndim != 2 or input_ids.shape[0] == 0:
        raise ShapeError(f"input_ids: expected [batch >= 1, tokens], got {tuple(input_ids.shape)}")
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise DTypeError(f"input_ids: expected an integer tensor, got {input_ids.dtype}")


def row_token_ids(
    sequences: list[SequenceCache], input_ids: Any, attention_mask: Any, *, padded: bool
) -> list[list[int]]:
    """The token ids each row records (``set_token_ids``): its first ``num_tokens`` of ``input_ids [B, >= held]``,
    masked (pad) positions of ``attention_mask`` as :data:`~memos_ref.paged.UNKNOWN_TOKEN`. A cache that saw
    padding (``padded``) must be given the mask."""
    check_type("input_ids", input_ids, torch.Tensor)
    if input_ids.ndim != 2:
        raise ShapeError(f"input_ids: expected [batch, tokens], got {tuple(input_ids.shape)}")
    if input_ids.shape[0] != len(sequences):
        raise ShapeError(f"{len(sequences)} rows in the cache, {input_ids.shape[0]} rows of ids given")
    held = max((seq.num_tokens for seq in sequences), default=0)
    if input_ids.shape[1] < held:
        raise ShapeError(f"the cache holds {held} tokens per row but only {input_ids.shape[1]} ids were given")
    if attention_mask is None and padded:
        raise InvalidArgumentError(
            "this cache was written with a padded batch: pass the attention_mask it was generated with, "
            "set_token_ids(ids, attention_mask=mask) (pad positions must not enter the prefix cache)"
        )
    keep = check_token_mask(attention_mask, input_ids.shape[0], held)
    rows = []
    for row, (seq, ids) in enumerate(zip(sequences, input_ids)):
        tokens = ids[: seq.num_tokens].tolist()
        if keep is not None:
            tokens = [t if k else UNKNOWN_TOKEN for t, k in zip(tokens, keep[row])]
        rows.append(tokens)
    return rows


def check_token_mask(mask: torch.Tensor | None, batch: int, held: int) -> list[list[bool]] | None:
    """``attention_mask [B, >= held]`` of 0/1 (or bool) as per-row lists of the first ``held`` positions."""
    if mask is None:
        return None
    check_type("attention_mask", mask, torch.Tensor)
    if mask.ndim != 2 or mask.shape[0] != batch or mask.shape[1] < held:
        raise ShapeError(f"attention_mask: expected [{batch}, >= {held}], got {tuple(mask.shape)}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise DTypeError(f"attention_mask: expected an integer or bool tensor, got {mask.dtype}")
    part = mask[:, :held]
    if mask.dtype != torch.bool and bool(((part != 0) & (part != 1)).any()):
        raise InvalidArgumentError("attention_mask: expected 0 (pad) or 1 (token) entries")
    return part.bool().tolist()


def ensure_staging(kv: PagedKV, rows: list[Any], n: int) -> None:
    """Raise :class:`StagingFullError` before any row is written unless a quantized pool with a residual
    window has the full-precision staging blocks every row needs for ``n`` more tokens (a row that ran out
    half-way would leave the earlier rows appended). Rows sharing a partly filled tail each count one copy,
    so the check errs on the side of refusing. ``None`` rows are rows not created yet."""
    pool = kv.pool
    if not pool.tracks_windows:
        return
    need = sum(seq.staging_needed(n) if seq else kv.spec.blocks_for(n) for seq in rows)
    available = pool.staging_available
    if need > available:
        raise StagingFullError(
            f"staging blocks: needed {need} for {len(rows)} rows of {n} tokens, available {available}; "
            f"free finished caches, raise staging_blocks or lower residual_tokens",
            needed=need,
            capacity=available,
        )


def ensure_blocks(kv: PagedKV, needed_blocks: Callable[[], int]) -> None:
    """Raise :class:`OutOfBlocksError` (saying what to do) unless the pool can give ``needed_blocks()`` blocks;
    collects dropped caches first."""
    needed = needed_blocks()
    if needed <= kv.allocator.num_available:
        return
    gc.collect()  # a dropped cache in a reference cycle frees its blocks when collected
    drain_pending()
    needed, available = needed_blocks(), kv.allocator.num_available
    if needed <= available:
        return
    err = OutOfBlocksError(needed=needed, available=available)
    live = len(kv.sequences)
    err.args = (
        f"{err.args[0]}. {live} sequences of this PagedKV still hold blocks: call cache.free() when a request "
        f"is done (or use `with PagedCache(kv) as cache:`); a PagedCache dropped without free() returns its "
        f"blocks only when it is garbage-collected",
    )
    raise err
