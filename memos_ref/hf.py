"""PagedCache: the paged KV memory as a ``transformers.Cache``, for transformers models and the package's forward.

Each batch row is a :class:`~memos_ref.paged.sequence.SequenceCache` over a shared :class:`PagedKV`, so rows
of one cache, and different caches over the same memory, share blocks: ``fork()`` gives sub-agents the
prefix for free, and ``from_prefix()`` starts a new prompt from the prefix cache so only the rest is
computed.

How attention reads the pages, three ways:

* the package's forward calls :meth:`PagedCache.attend`, which runs the kernel-shaped
  :func:`memos_ref.attention.paged_attention` on the pool;
* a transformers model loaded with ``attn_implementation="memos_paged"`` (after
  :func:`register_paged_attention`) and a ``PagedCache(kv, direct=True)`` does the same: ``update`` returns a
  handle instead of dense K/V, and the registered attention function attends over the pages, honouring the
  attention mask (left padding), sliding windows, logit softcapping (Gemma 2) and attention sinks (GPT-OSS);
* otherwise ``update`` gathers each row's blocks into a dense ``[B, H, S, D]`` tensor every step, which any
  attention implementation accepts.

In this reference the gather is one indexed copy of each row's own blocks per layer and step (its cost follows
the sequence, not the pool); a kernel that reads the pool in place (``memos_kernels``) removes the copy behind
the same two seams. Where no kernel runs, ``PagedCache(kv, dense_mirror=True)`` instead keeps a dense copy of
each layer's K/V beside the pages that grows by appends (as ``DynamicCache`` holds its K/V), so a decode step
copies only its new token: ``update`` returns a view of it and ``attend`` reads it. It costs the memory of that
copy (not shared between forks, outside the pool's byte budget, not swapped by tiering), so it is off by
default; it is never used over a quantized pool (reads there must see the dequantized values).

Lifetime: ``free()`` (or leaving a ``with PagedCache(kv) as cache:`` block) returns the blocks at once; a cache
dropped without ``free()`` returns them when it is garbage-collected; ``copy.deepcopy(cache)`` is ``fork()``
(the copies share blocks copy-on-write); a freed cache raises :class:`UseAfterFreeError`.
"""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from memos_ref import attention
from memos_ref.errors import (
    ConfigError,
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    KVCacheError,
    OutOfBlocksError,
    ShapeError,
    StagingFullError,
    StateError,
    UnsupportedModelError,
    UseAfterFreeError,
    check_layer_index,
    check_type,
)
from memos_ref.paged.pool import gather_blocks
from memos_ref.paged.sequence import UNKNOWN_TOKEN, SequenceCache
from memos_ref.paged.step import StepBatch
from memos_ref.paged.store import PagedKV
from memos_ref.spec import check_supported_config, warn_sliding, warn_sliding_window

__all__ = ["PAGED_ATTENTION", "PagedCache", "PagedLayer", "PagedView", "register_paged_attention"]

_MIN_MIRROR_TOKENS = 256  # the first capacity of a dense mirror (it doubles when full)

#: The name under which :func:`register_paged_attention` registers the paged attention function.
PAGED_ATTENTION = "memos_paged"

_MLA_HINT = (
    "K and V of different widths, as in multi-head latent attention (DeepSeek-V2/V3): MLA is not supported — "
    "the paged pool stores K and V of one head_dim; use transformers' DynamicCache for it"
)
_LINEAR_HINT = (
    "a hybrid linear-attention / state-space model (Qwen3-Next, ...) asked the cache for recurrent state: linear "
    "attention is not supported by PagedCache, which holds only K/V of attention layers; use the model's own cache"
)


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
        cache = self._cache()
        if cache is None:
            raise StateError("this PagedView outlived its PagedCache (views are valid during one forward step)")
        return cache


# ---------------------------------------------------------------------------------------------- attention
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
    _refuse_unsupported(module, dropout, kwargs)  # before this step's K/V are written: a refusal writes nothing
    cache = key.cache
    mask = _pages_mask(attention_mask, query)
    if sliding_window is not None:
        cache._note_sliding(int(sliding_window))
    elif _has_padding(mask):
        cache._saw_padding = True
    step = key._flush()
    if step is None:  # a second read of one layer's view: the step as built
        step = StepBatch.resume(cache.sequences, key.layer, 0) if cache._step is None else cache._step
    out = cache._attend_stored(  # [B, Hq, S, D]
        query, step, key.layer, scaling, mask=mask, sliding_window=sliding_window, softcap=softcap, sinks=s_aux
    )
    return out.transpose(1, 2).contiguous(), None


def _refuse_unsupported(module: torch.nn.Module, dropout: float, kwargs: dict[str, Any]) -> None:
    if dropout and getattr(module, "training", False):
        raise UnsupportedModelError(f"attention dropout ({dropout}) in training mode is not supported by PagedCache")
    if kwargs.get("is_causal", True) is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedModelError("bidirectional (non-causal) attention is not supported by PagedCache")
    for name in ("position_bias", "head_mask", "attention_bias", "alibi"):
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"attention with {name} is not supported by PagedCache(direct=True)")


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


# ---------------------------------------------------------------------------------------------- dense mirror
class _Mirror:
    """One layer's K/V of every row, dense ``[B, H, capacity, D]``, valid for the first ``length`` positions of
    the rows whose sequence ids are ``rows`` (positions below a row's length never change while the sequence
    lives: appends go after them, and a truncation is seen as a shorter length)."""

    __slots__ = ("keys", "length", "rows", "values")

    def __init__(self, rows: tuple[int, ...], keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self.rows, self.keys, self.values, self.length = rows, keys, values, length

    @classmethod
    def from_pages(cls, sequences: list[SequenceCache], layer: int, length: int) -> _Mirror:
        """Gather the first ``length`` positions of every row from the pool (the one full copy)."""
        dense = [seq.pool.gather(layer, seq.block_table_tensor(), length) for seq in sequences]  # ([H, S, D],) * 2
        k0 = dense[0][0]
        shape = (len(sequences), k0.shape[0], max(_MIN_MIRROR_TOKENS, 2 * length), k0.shape[2])
        keys, values = k0.new_empty(shape), k0.new_empty(shape)
        for row, (k, v) in enumerate(dense):
            keys[row, :, :length] = k
            values[row, :, :length] = v
        return cls(tuple(seq.seq_id for seq in sequences), keys, values, length)

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Copy ``[B, H, n, D]`` after the valid positions (doubling the capacity when full)."""
        n, stop = key.shape[2], self.length + key.shape[2]
        if stop > self.keys.shape[2]:
            shape = (*self.keys.shape[:2], max(2 * self.keys.shape[2], stop), self.keys.shape[3])
            keys, values = self.keys.new_empty(shape), self.values.new_empty(shape)
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
            self.keys, self.values = keys, values
        self.keys[:, :, self.length : stop] = key
        self.values[:, :, self.length : stop] = value
        self.length += n

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The valid K/V ``[B, H, length, D]`` (views, no copy)."""
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]


# ---------------------------------------------------------------------------------------------- lifetime
class _Rows:
    """The sequences of one :class:`PagedCache`, kept apart from it so that a finalizer can free them after the
    cache itself is gone."""

    __slots__ = ("kv", "sequences")

    def __init__(self, kv: PagedKV, sequences: list[SequenceCache]) -> None:
        self.kv, self.sequences = kv, sequences


_pending: list[SequenceCache] = []  # dropped caches' rows, when they could not be freed at once
_pending_lock = threading.Lock()


def _release_rows(rows: _Rows) -> None:
    """The finalizer of a dropped cache: free its rows now, unless this thread is inside the allocator (a garbage
    collection can start in the middle of any code), then on the next PagedCache operation."""
    seqs, rows.sequences = rows.sequences, []
    lock = getattr(rows.kv.allocator, "lock", None)  # the public RLock; a null pool's allocator may have none
    owned = getattr(lock, "_is_owned", None)
    if owned is not None and owned():
        with _pending_lock:
            _pending.extend(seqs)
        return
    for seq in seqs:
        seq.free()


def _drain_pending() -> None:
    """Free the rows that finalizers had to defer."""
    if not _pending:
        return
    with _pending_lock:
        seqs = _pending[:]
        _pending.clear()
    for seq in seqs:
        seq.free()


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
        rows = _check_sequences(kv, sequences, ragged=not owns_rows)
        if config is not None:
            check_supported_config(config)
            warn_sliding_window(config)
        _drain_pending()
        self.kv, self.cache_salt, self.direct = kv, cache_salt, direct
        self.dense_mirror, self.owns_rows = dense_mirror, owns_rows
        self._mirrors: list[_Mirror | None] = [None] * kv.spec.num_layers
        self._rows = _Rows(kv, rows)
        self._step: StepBatch | None = None  # this forward step's metadata (built once, before the layers)
        self._step_rows: list[SequenceCache] | None = None  # the row list it was built for
        self._freed = False
        self._sliding_noted = False
        self._saw_padding = False  # set when the memos_paged attention saw a padding mask (direct=True)
        if owns_rows:
            self._finalizer = weakref.finalize(self, _release_rows, self._rows)
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
        check_type("input_ids", input_ids, torch.Tensor)
        if cache_salt is not None:
            check_type("cache_salt", cache_salt, str)
        if input_ids.ndim != 2 or input_ids.shape[0] == 0:
            raise ShapeError(f"input_ids: expected [batch >= 1, tokens], got {tuple(input_ids.shape)}")
        if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
            raise DTypeError(f"input_ids: expected an integer tensor, got {input_ids.dtype}")
        _drain_pending()
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
        return cls(kv, rows, cache_salt=cache_salt)

    def fork(self) -> PagedCache:
        """A new cache sharing every block of this one (a sub-agent); writes copy a shared tail first."""
        self._check_live()
        rows: list[SequenceCache] = []
        try:
            for seq in self.sequences:
                rows.append(seq.fork())
        except BaseException:
            for seq in rows:
                seq.free()
            raise
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
        check_type("input_ids", input_ids, torch.Tensor)
        if input_ids.ndim != 2:
            raise ShapeError(f"input_ids: expected [batch, tokens], got {tuple(input_ids.shape)}")
        if input_ids.shape[0] != len(self.sequences):
            raise ShapeError(f"{len(self.sequences)} rows in the cache, {input_ids.shape[0]} rows of ids given")
        held = max((seq.num_tokens for seq in self.sequences), default=0)
        if input_ids.shape[1] < held:
            raise ShapeError(f"the cache holds {held} tokens per row but only {input_ids.shape[1]} ids were given")
        if attention_mask is None and self._saw_padding:
            raise InvalidArgumentError(
                "this cache was written with a padded batch: pass the attention_mask it was generated with, "
                "set_token_ids(ids, attention_mask=mask) (pad positions must not enter the prefix cache)"
            )
        keep = _check_token_mask(attention_mask, input_ids.shape[0], held)
        for row, (seq, ids) in enumerate(zip(self.sequences, input_ids)):
            tokens = ids[: seq.num_tokens].tolist()
            if keep is not None:
                tokens = [t if k else UNKNOWN_TOKEN for t, k in zip(tokens, keep[row])]
            seq.set_token_ids(tokens)

    # ------------------------------------------------------------------ the Cache protocol
    def _check(self, key: torch.Tensor, value: torch.Tensor) -> None:
        check_type("key_states", key, torch.Tensor)
        check_type("value_states", value, torch.Tensor)
        spec = self.kv.spec
        if key.ndim == 4 and value.ndim == 4 and key.shape[-1] != value.shape[-1]:
            raise UnsupportedModelError(
                f"key head_dim {key.shape[-1]} != value head_dim {value.shape[-1]}: {_MLA_HINT}"
            )
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
        if key.device != self.kv.pool.device:
            raise DeviceError(f"key device {key.device} does not match the pool's {self.kv.pool.device}")
        if self.sequences and key.shape[0] != len(self.sequences):
            raise ShapeError(f"batch of {key.shape[0]} rows, but this cache holds {len(self.sequences)}")

    def prepare_step(self, batch: int, n: int) -> StepBatch:
        """Reserve ``n`` new tokens in each of ``batch`` rows and build the step's metadata, once, before the layer
        loop (all rows or none; :class:`OutOfBlocksError` / :class:`StagingFullError` before anything changes).
        Rows are created on the first step of an empty cache."""
        self._check_live()
        _drain_pending()
        rows = self.sequences or [None] * batch
        if self.sequences and batch != len(self.sequences):
            raise ShapeError(f"batch of {batch} rows, but this cache holds {len(self.sequences)}")
        self._ensure_blocks(lambda: sum(seq.blocks_needed(n) if seq else self.kv.spec.blocks_for(n) for seq in rows))
        self._ensure_staging(rows, n)
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

    def _ensure_staging(self, rows: list[Any], n: int) -> None:
        """Raise :class:`StagingFullError` before any row is written unless a quantized pool with a residual
        window has the full-precision staging blocks every row needs for ``n`` more tokens (a row that ran out
        half-way would leave the earlier rows appended). Rows sharing a partly filled tail each count one copy,
        so the check errs on the side of refusing."""
        pool = self.kv.pool
        if not pool.tracks_windows:
            return
        need = sum(seq.staging_needed(n) if seq else self.kv.spec.blocks_for(n) for seq in rows)
        available = pool.staging_available
        if need > available:
            raise StagingFullError(
                f"staging blocks: needed {need} for {len(rows)} rows of {n} tokens, available {available}; "
                f"free finished caches, raise staging_blocks or lower residual_tokens",
                needed=need,
                capacity=available,
            )

    def _ensure_blocks(self, needed_blocks: Any) -> None:
        """Raise :class:`OutOfBlocksError` (saying what to do) unless the pool can give ``needed_blocks()`` blocks;
        collects dropped caches first."""
        needed = needed_blocks()
        if needed <= self.kv.allocator.num_available:
            return
        gc.collect()  # a dropped cache in a reference cycle frees its blocks when collected
        _drain_pending()
        needed, available = needed_blocks(), self.kv.allocator.num_available
        if needed <= available:
            return
        err = OutOfBlocksError(needed=needed, available=available)
        live = len(self.kv.sequences)
        err.args = (
            f"{err.args[0]}. {live} sequences of this PagedKV still hold blocks: call cache.free() when a request "
            f"is done (or use `with PagedCache(kv) as cache:`); a PagedCache dropped without free() returns its "
            f"blocks only when it is garbage-collected",
        )
        raise err

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
        pages (rows held ``before`` tokens): the mirror grown by them, or rebuilt from the pages when its rows
        changed (fork, beam reorder, reset) or its length no longer follows theirs (rolled back, or written
        outside this cache)."""
        mirror = self._mirrors[layer]
        rows = tuple(seq.seq_id for seq in self.sequences)
        if mirror is None or mirror.rows != rows or mirror.length != before:
            mirror = _Mirror.from_pages(self.sequences, layer, before + key.shape[2])
            self._mirrors[layer] = mirror
        else:
            mirror.append(key, value)
        return mirror.view()

    def _attend_stored(self, query: torch.Tensor, step: StepBatch, layer: int, scale: float | None = None, **extras):
        self._check_live()
        return attention.attend_step(query, step, layer, scale=scale, **extras)

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
        return _gather_step(step, layer)  # [B, H, S, D]: the gather transformers' attention needs

    # linear-attention models ask the cache for recurrent state: refuse them clearly (transformers would fail)
    def get_conv_state(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedModelError(_LINEAR_HINT)

    get_recurrent_state = update_conv_state = update_recurrent_state = get_conv_state

    def update_indexer(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsupportedModelError("sparse-attention indexer caches (DeepSeek-V3.2) are not supported by PagedCache")

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
        for i in rows:
            if not 0 <= i < len(self.sequences):
                raise InvalidArgumentError(f"row {i} is not in [0, {len(self.sequences)})")
        new: list[SequenceCache] = []
        try:
            for i in rows:
                new.append(self.sequences[i].fork())  # beams share their common blocks
        except BaseException:
            for seq in new:
                seq.free()
            raise
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


def _check_token_mask(mask: torch.Tensor | None, batch: int, held: int) -> list[list[bool]] | None:
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


def _gather_step(step: StepBatch, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's K and V of ``layer`` as new dense ``[B, H, S, D]`` tensors (rows of one length): one copy of each
    row's own blocks straight into the result (a plain single-segment pool), else a gather per row (dequantized)
    and a stack."""
    pool, seqs, n = step.pool, step.sequences, step.lens[0]
    segs = pool.segments  # one snapshot: a growing pool publishes a new tuple
    if len(segs) != 1 or pool.quantized or len(set(step.lens)) > 1:
        dense = [seq.to_dense(layer) for seq in seqs]
        if len(dense) == 1:
            return dense[0][0].unsqueeze(0), dense[0][1].unsqueeze(0)
        return torch.stack([k for k, _ in dense]), torch.stack([v for _, v in dense])
    spec = pool.spec
    t, nb = spec.block_size, -(-n // spec.block_size)
    out = segs[0].new_empty((len(seqs), 2, spec.num_kv_heads, nb, t, spec.head_dim))
    view = segs[0][:, layer]  # [N, 2, H, T, D]
    for i, table in enumerate(step.tables):
        gather_blocks(view, table[:nb], out[i])  # [2, H, nb, T, D]
    kv = out.view(len(seqs), 2, spec.num_kv_heads, nb * t, spec.head_dim)[:, :, :, :n]
    return kv[:, 0], kv[:, 1]


def _check_sequences(
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
        if getattr(seq, "_freed", False):
            raise UseAfterFreeError(f"sequences[{i}] was freed; create a new sequence (or fork() before free())")
    if not ragged and len({seq.num_tokens for seq in rows}) > 1:
        raise InvalidArgumentError(
            f"sequences: every row must hold the same number of tokens, got {[seq.num_tokens for seq in rows]}"
        )
    if len({id(seq) for seq in rows}) != len(rows):
        raise InvalidArgumentError("sequences: a sequence appears twice (fork() it for a second row)")
    return rows
