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

The package, top to bottom (each module imports only those below it):

* :mod:`~memos_ref.hf.register` — the ``memos_paged`` attention function and :func:`register_paged_attention`;
* :mod:`~memos_ref.hf.cache` — the ``Cache`` adapter: :class:`PagedCache`, :class:`PagedLayer`, :class:`PagedView`;
* :mod:`~memos_ref.hf.rows` — a cache's rows: which sequences it may start from, blocks a step needs, lifetime;
* :mod:`~memos_ref.hf.dense` — dense reads: the per-step gather and the dense mirror;
* :mod:`~memos_ref.hf.support` — the model-family support checks (MLA, linear attention, attention features).
"""

from memos_ref.hf.cache import PagedCache, PagedLayer, PagedView
from memos_ref.hf.register import PAGED_ATTENTION, register_paged_attention

__all__ = ["PAGED_ATTENTION", "PagedCache", "PagedLayer", "PagedView", "register_paged_attention"]
