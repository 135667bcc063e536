"""memos-ref: a Jupyter-first reference implementation of the KV-cache memory layer of an agent memory OS.

Start with :class:`KVSpec` (the geometry and byte arithmetic), the shipped model in :mod:`memos_ref.model`,
and the dense caches in :mod:`memos_ref.caches`.
"""

from memos_ref.caches import ConcatCache, ContiguousCache
from memos_ref.errors import KVCacheError
from memos_ref.spec import KVSpec

__version__ = "0.1.0"

__all__ = ["ConcatCache", "ContiguousCache", "KVCacheError", "KVSpec", "__version__"]
