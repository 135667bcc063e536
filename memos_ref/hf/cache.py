"""The paged KV memory as a ``transformers.Cache``: :class:`PagedCache`, its per-layer face :class:`PagedLayer`,
and the :class:`PagedView` that ``update`` hands the registered attention function with ``direct=True``.

How attention reads the pages, the dense mirror and the lifetime rules: :mod:`memos_ref.hf`. The rows are kept by
:mod:`memos_ref.hf.rows`, dense reads made by :mod:`memos_ref.hf.dense`, models refused by :mod:`memos_ref.hf.support`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from memos_ref import attention
from memos_ref.errors import (
    ConfigError,
    InvalidArgumentError,
    KVCacheError,
    ShapeError,
    StateError,
    UnsupportedModelError,
    UseAfterFreeError,
    check_layer_index,
    check_type,
)
from memos_ref.hf.dense import DenseMirror, gather_step
from memos_ref.hf.rows import (
    Rows,
    check_prefix_ids,
    check_sequences,
    drain_pending,
    ensure_blocks,
    ensure_staging,
    fork_rows,
    prefix_rows,
    release_rows,
    row_token_ids,
    select_rows,
)
from memos_ref.hf.support import INDEXER_HINT, LINEAR_HINT, check_model_config, check_step_kv
from memos_ref.paged.sequence import SequenceCache
from memos_ref.paged.step import StepBatch
from memos_ref.paged.store import PagedKV
from memos_ref.spec import warn_sliding

__all__ = ["PagedCache", "PagedLayer", "PagedView"]


class PagedView:
    """What ``PagedCache(direct=True).update`` returns instead of dense K/V: which cache and layer to read.

    It holds the cache weakly (a layer keeps its last view; a strong reference would keep the cache alive), and this
    step's validated K/V until the attention function writes them (after its refusal checks, so a refused step
    writes nothing)."""

    __slots__ = ("_cache", "_pending", "layer")

    def __init__(self, cache: PagedCache, layer: int, pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self._cache, self.layer, self._pending = weakref.ref(cache), layer, pending

    def _flush(self) -> StepBatch | None:
        """Write the K/V held since ``update`` into the pages (once); returns the step they were written in."""
        if self._pending is None:
            return None
        key, value = self._pending
        self._pending = None
        return self.cache._write(key, value, self.layer)

    @property
    def cache(self) -> PagedCache:
        """The cache this view reads (:class:`StateError` once the cache is gone)."""
        cache = self._cache()
        if cache is None:
            raise StateError("this PagedView outlived its PagedCache (views are valid during one forward step)")
        return cache

    def attend(
        self,
        query: torch.Tensor,
        *,
        scale: float | None = None,
        mask: torch.Tensor | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        padded: bool = False,
    ) -> torch.Tensor:
        """The registered attention function's read: write this step's K/V (once; a second read reads the step as
        built), then attend ``query [B, Hq, n, D]`` over the layer's pages with transformers' ``mask [B, 1|Hq, n, K]``,
        ``sliding_window``, ``softcap`` and ``sinks``; ``padded``: the mask hides padding. Returns ``[B, Hq, n, D]``."""
        cache = self.cache
        if sliding_window is not None:
            cache._note_sliding(int(sliding_window))
        elif padded:
            cache._saw_padding = True
        step = self._flush()
        if step is None:
            step = StepBatch.resume(cache.sequences, self.layer, 0) if cache._step is None else cache._step
        cache._check_live()
        return attention.attend_step(
            query, step, self.layer, scale=scale, mask=mask, sliding_window=sliding_window, softcap=softcap, sinks=sinks
        )


class PagedLayer(CacheLayerMixin):
    """One layer's face of a :class:`PagedCache` (the storage is the shared pool; the cache is held weakly)."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, owner: PagedCache, layer_idx: int) -> None:
        super().__init__()
        self._owner, self.layer_idx = weakref.ref(owner), layer_idx

    @property
    def owner(self) -> PagedCache:
        owner = self._owner()
        if owner is None:
            raise StateError(f"layer {self.layer_idx} outlived its PagedCache")
        return owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        keys, values = self.owner._update(key_states, value_states, self.layer_idx)
        self.is_initialized = True
        self.keys, self.values = keys, values
        return keys, values

    def get_seq_length(self) -> int:
        owner = self.owner
        seqs = owner.sequences
        if not seqs:
            return 0
        if owner.owns_rows:  # rows of one owned cache hold the same number of tokens
            return seqs[0].layer_tokens[self.layer_idx]
        return max(seq.layer_tokens[self.layer_idx] for seq in seqs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.layer_idx == 0:
            self.owner._release()

    def crop(self, tokens_to_remove: int) -> None:
        if self.layer_idx == 0:
            self.owner.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.layer_idx == 0:
            self.owner._select_rows([int(i) for i in beam_idx])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.layer_idx == 0:
            idx = torch.as_tensor(indices)
            rows = idx.nonzero().flatten() if idx.dtype == torch.bool else idx
            self.owner._select_rows([int(i) for i in rows])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.layer_idx == 0:
            self.owner._select_rows([i for i in range(len(self.owner.sequences)) for _ in range(repeats)])

    def offload(self) -> None:
        raise NotImplementedError("PagedCache does not support transformers' layer offloading")

    prefetch = offload


class PagedCache(Cache):
    """A paged, refcounted KV cache over a :class:`PagedKV` (one :class:`SequenceCache` per batch row).

    Args:
        kv: the shared paged memory (pool, allocator, prefix cache).
        sequences: start from these sequences (e.g. forks or prefix hits); default: created on first use.
        cache_salt: tenant salt for prefix hashing.
        direct: hand the registered ``memos_paged`` attention function a page view instead of dense K/V.
        dense_mirror: keep a dense per-layer copy of the K/V beside the pages, grown by appends, for ``update``
            (without ``direct``) and ``attend`` where no kernel runs: a decode step copies only its new token
            instead of gathering every row's history, at the memory cost of that copy (see the module notes).
            Ignored over a quantized pool.
        config: the model's config (or the model): refuses unsupported models (MLA, linear attention) here
            rather than in the middle of a forward, and warns about sliding-window memory.
        owns_rows: ``False`` borrows ``sequences`` (the engine's continuous batch): rows may hold different
            lengths (the package forward with explicit ``position_ids``), and ``free()``, ``reset()`` or garbage
            collection detach them without freeing their blocks — their owner frees them.

    Each forward step's metadata (slot mapping, block tables, lengths) is a
    :class:`~memos_ref.paged.step.StepBatch` built once, before the first layer writes (the package forward
    asks for it with :meth:`prepare_step` before its layer loop; under transformers the first layer's
    ``update`` builds it); every layer then writes with one indexed store and attends with one call.

    Supports greedy/sampled generation, left-padded batches, ``crop``, beam reordering (rows are forked,
    sharing blocks), sliding-window layers (every token is kept: see
    :class:`~memos_ref.spec.SlidingWindowMemoryWarning`), softcapping and attention sinks. Not supported:
    MLA, linear attention, layer offloading, ``torch.compile``.

    Lifetime: call :meth:`free` (or use ``with PagedCache(kv) as cache:``) when a request is done; a cache
    dropped without it frees its blocks when garbage-collected. ``copy.deepcopy`` is :meth:`fork`.
    """

    def __init__(
        self,
        kv: PagedKV,
        sequences: Sequence[SequenceCache] | None = None,
        *,
        cache_salt: str | None = None,
        direct: bool = False,
        config: Any = None,
        dense_mirror: bool = False,
        owns_rows: bool = True,
    ) -> None:
        check_type("kv", kv, PagedKV)
        check_type("direct", direct, bool)
        check_type("dense_mirror", dense_mirror, bool)
        check_type("owns_rows", owns_rows, bool)
        if cache_salt is not None:
            check_type("cache_salt", cache_salt, str)
        rows = check_sequences(kv, sequences, ragged=not owns_rows)
        if config is not None:
            check_model_config(config)
        drain_pending()
        self.kv, self.cache_salt, self.direct = kv, cache_salt, direct
        self.dense_mirror, self.owns_rows = dense_mirror, owns_rows
        self._mirrors: list[DenseMirror | None] = [None] * kv.spec.num_layers
        self._rows = Rows(kv, rows)
        self._step: StepBatch | None = None  # this forward step's metadata (built once, before the layers)
        self._step_rows: list[SequenceCache] | None = None  # the row list it was built for
        self._freed = False
        self._sliding_noted = False
        self._saw_padding = False  # set when the memos_paged attention saw a padding mask (direct=True)
        if owns_rows:
            self._finalizer = weakref.finalize(self, release_rows, self._rows)
            self._finalizer.atexit = False
        super().__init__(layers=[PagedLayer(self, i) for i in range(kv.spec.num_layers)])

    @property
    def sequences(self) -> list[SequenceCache]:
        """One :class:`SequenceCache` per batch row (empty before the first write and after ``free()``)."""
        return self._rows.sequences

    @sequences.setter
    def sequences(self, value: list[SequenceCache]) -> None:
        self._rows.sequences = value

    def _check_live(self) -> None:
        if self._freed:
            raise UseAfterFreeError(
                "this PagedCache was freed: create a new PagedCache(kv) for a new request, or fork() it before free()"
            )

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_prefix(cls, kv: PagedKV, input_ids: torch.Tensor, *, cache_salt: str | None = None) -> PagedCache:
        """A cache already holding the longest cached prefix of each row of ``input_ids [B, S]``.

        Give the same ``input_ids`` to ``generate`` (or feed ``input_ids[:, cache.get_seq_length():]`` to a
        forward): only the uncached rest is computed. Rows must reuse the same number of tokens (they are
        trimmed to the shortest hit).
        """
        check_type("kv", kv, PagedKV)
        check_prefix_ids(input_ids, cache_salt)
        drain_pending()
        rows = prefix_rows(kv, input_ids, cache_salt)
        return cls(kv, rows, cache_salt=cache_salt)

    def fork(self) -> PagedCache:
        """A new cache sharing every block of this one (a sub-agent); writes copy a shared tail first."""
        self._check_live()
        rows = fork_rows(self.sequences)
        child = PagedCache(
            self.kv, rows, cache_salt=self.cache_salt, direct=self.direct, dense_mirror=self.dense_mirror
        )
        child._saw_padding = self._saw_padding
        return child

    def __deepcopy__(self, memo: dict[int, Any]) -> PagedCache:
        """``copy.deepcopy(cache)`` (transformers' prompt-reuse recipe) is :meth:`fork`: the copy shares every
        block copy-on-write, so generating from it never changes this cache."""
        return self.fork()

    def __copy__(self) -> PagedCache:
        return self.fork()

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def set_token_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """Record the token ids ``[B, S]`` of the first S positions so full blocks enter the prefix cache
        (``update`` sees only K/V; call this after ``generate`` with its output, minus the last token).

        A padded batch must pass the ``attention_mask [B, >= S]`` it was generated with: masked (pad) positions
        are recorded as unknown (:data:`~memos_ref.paged.UNKNOWN_TOKEN`), so neither their blocks nor any later
        block of the row are prefix-cached (their K/V were computed with shifted positions; reusing them for an
        unpadded prompt of the same ids would give wrong tokens). Only ``direct=True`` sees the padding itself
        (the plain ``update`` path is not told): there, omitting the mask after a padded batch raises
        :class:`InvalidArgumentError`.
        """
        self._check_live()
        tokens = row_token_ids(self.sequences, input_ids, attention_mask, padded=self._saw_padding)
        for seq, ids in zip(self.sequences, tokens):
            seq.set_token_ids(ids)

    # ------------------------------------------------------------------ the Cache protocol
    def _check(self, key: torch.Tensor, value: torch.Tensor) -> None:
        check_step_kv(key, value, self.kv.spec, self.kv.pool.device, len(self.sequences))

    def prepare_step(self, batch: int, n: int) -> StepBatch:
        """Reserve ``n`` new tokens in each of ``batch`` rows and build the step's metadata, once, before the layer
        loop (all rows or none; :class:`OutOfBlocksError` / :class:`StagingFullError` before anything changes).
        Rows are created on the first step of an empty cache."""
        self._check_live()
        drain_pending()
        rows = self.sequences or [None] * batch
        if self.sequences and batch != len(self.sequences):
            raise ShapeError(f"batch of {batch} rows, but this cache holds {len(self.sequences)}")
        ensure_blocks(self.kv, lambda: sum(seq.blocks_needed(n) if seq else self.kv.spec.blocks_for(n) for seq in rows))
        ensure_staging(self.kv, rows, n)
        if not self.sequences:
            self.sequences = [self.kv.new_sequence(self.cache_salt) for _ in range(batch)]
        self._step = StepBatch.reserve(self.sequences, n)
        self._step_rows = self.sequences
        return self._step

    def _step_for(self, layer: int, batch: int, n: int) -> StepBatch:
        """The step layer ``layer`` writes: the prepared one, a new one (the first layer past the reserved
        tokens reserves them for every row), or one over already reserved positions (a layer catching up)."""
        step = self._step
        if (
            step is not None
            and self._step_rows is self.sequences
            and not step.written[layer]
            and step.query_len == n
            and all(seq.layer_tokens[layer] == start for seq, start in zip(step.sequences, step.starts))
        ):
            return step
        if not self.sequences or self.sequences[0].layer_tokens[layer] + n > self.sequences[0].num_tokens:
            return self.prepare_step(batch, n)
        return StepBatch.resume(self.sequences, layer, n)

    def _write(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> StepBatch:
        """Store this step's K/V ``[B, H, n, D]`` of one layer in every row (all rows or none); returns the step."""
        self._check_live()
        self._check(key, value)
        had_rows = bool(self.sequences)
        step = self._step_for(layer, key.shape[0], key.shape[2])
        try:
            attention.write_step(step, layer, key, value)
        except Exception as exc:
            self._abandon(step, had_rows)
            if isinstance(exc, KVCacheError) and not isinstance(exc, InvalidArgumentError):
                raise
            # a slot the storage does not hold (allocator and pool apart), refused or raw
            pool, alloc = self.kv.pool, self.kv.allocator
            raise StateError(
                f"writing layer {layer} failed: the pool holds {pool.num_blocks} blocks and the allocator "
                f"{alloc.num_blocks} ({exc}); the step's blocks were given back"
            ) from exc
        return step

    def _abandon(self, step: StepBatch, had_rows: bool) -> None:
        """Give back what a failed step reserved: every row back to where the step started (rows made by this
        step are freed and dropped)."""
        self._step = None
        fresh = not had_rows
        for seq, start in zip(step.sequences, step.starts):
            if fresh:
                seq.free()
            else:
                seq.rollback_step(min(start, *seq.layer_tokens))
        if fresh:
            self.sequences = []

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int) -> torch.Tensor:
        """Store this step's K/V and compute causal attention of ``query [B, Hq, n, D]`` over each row's pages.

        The package's forward calls this instead of ``update`` (no dense ``[B, H, S, D]`` is handed back);
        it is the seam where a paged-attention kernel reads the pool directly. Returns ``[B, Hq, n, D]``.
        """
        check_type("query", query, torch.Tensor)
        before = self._held(layer)
        step = self._write(key, value, layer)
        if self._mirrored(query.device):
            keys, values = self._mirror_step(layer, before, key, value)  # [B, H, S, D] views
            return torch.stack([attention.dense_attention(query[i], keys[i], values[i]) for i in range(query.shape[0])])
        return attention.attend_step(query, step, layer)

    def _held(self, layer: int) -> int:
        """Tokens layer ``layer`` holds in the first row (rows of an owned cache hold the same number)."""
        return self.sequences[0].layer_tokens[layer] if self.sequences else 0

    def _mirrored(self, device: torch.device) -> bool:
        """Whether reads go through the dense mirror: asked for, a plain pool, and no kernel on ``device``."""
        if not self.dense_mirror or self.kv.pool.quantized:
            return False
        return not attention.use_kernels(device)

    def _mirror_step(
        self, layer: int, before: int, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The dense K/V ``[B, H, S, D]`` of ``layer`` after this step's K/V ``[B, H, n, D]`` were written to the
        pages (rows held ``before`` tokens), from the layer's :meth:`DenseMirror.follow`."""
        mirror = DenseMirror.follow(self._mirrors[layer], self.sequences, layer, before, key, value)
        self._mirrors[layer] = mirror
        return mirror.view()

    def _note_sliding(self, window: int) -> None:
        if not self._sliding_noted:  # the attention function sees the window on every layer and step
            self._sliding_noted = True
            warn_sliding(window)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Any, Any]:
        """Store the new K/V ``[B, H_kv, S_new, D]`` of layer ``layer_idx``; return all of that layer's K/V (or a
        :class:`PagedView` with ``direct=True``). A rejected call leaves the cache and the pool unchanged."""
        layer_idx = check_layer_index(layer_idx, len(self.layers), "layer_idx")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[Any, Any]:
        if self.direct:  # the registered attention function writes (after its refusal checks) and reads the pages
            self._check_live()
            self._check(key, value)
            view = PagedView(self, layer, (key, value))
            return view, view
        before = self._held(layer)
        step = self._write(key, value, layer)
        if self._mirrored(key.device):
            return self._mirror_step(layer, before, key, value)
        return gather_step(step, layer)  # [B, H, S, D]: the gather transformers' attention needs

    # linear-attention models ask the cache for recurrent state: refuse them clearly (transformers would fail)
    def get_conv_state(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedModelError(LINEAR_HINT)

    get_recurrent_state = update_conv_state = update_recurrent_state = get_conv_state

    def update_indexer(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedModelError(INDEXER_HINT)

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every row (transformers' negative convention)."""
        self._check_live()
        check_type("tokens_to_remove", tokens_to_remove, int)
        if tokens_to_remove > 0:
            raise ConfigError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        for seq in self.sequences:
            seq.truncate(max(0, seq.num_tokens + tokens_to_remove))

    def _select_rows(self, rows: list[int]) -> None:
        self._check_live()
        new = select_rows(self.sequences, rows)  # beams share their common blocks
        for seq in self.sequences:
            seq.free()
        self.sequences = new

    def _release(self) -> None:
        """Free every row's blocks (detach borrowed rows); the cache stays usable (``reset``)."""
        seqs, self.sequences = self.sequences, []
        self._mirrors = [None] * len(self._mirrors)
        self._step = self._step_rows = None
        if self.owns_rows:
            for seq in seqs:
                seq.free()

    def reset(self) -> None:
        """Forget every token (transformers' ``Cache.reset``): the blocks go back, the cache can be reused."""
        self._release()
        self._freed = False

    def free(self) -> None:
        """Release every row's blocks back to the shared memory; using the cache afterwards raises
        :class:`UseAfterFreeError` (calling ``free()`` again does nothing)."""
        self._release()
        self._freed = True

    @property
    def is_freed(self) -> bool:
        """Whether :meth:`free` was called."""
        return self._freed

    def stats(self) -> dict[str, Any]:
        return {
            "tokens": self.get_seq_length(),
            "rows": len(self.sequences),
            "blocks": sum(seq.num_blocks for seq in self.sequences),
            **self.kv.stats(),
        }
