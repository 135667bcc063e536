"""memos-ref: a Jupyter-first reference implementation of the KV-cache memory layer of an agent memory OS.

Start with :class:`KVSpec` (the geometry and byte arithmetic), the shipped model in :mod:`memos_ref.model`,
and the dense caches in :mod:`memos_ref.caches`.

The names below are imported on first use (module ``__getattr__``): ``import memos_ref.errors`` — all that
``memos_kernels`` imports of this package — then loads neither transformers nor the caches, so the kernels run on
a machine whose transformers is older than the package needs (or absent).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memos_ref.caches import ConcatCache, ContiguousCache
    from memos_ref.errors import KVCacheError
    from memos_ref.spec import KVSpec

__version__ = "0.1.0"

__all__ = ["ConcatCache", "ContiguousCache", "KVCacheError", "KVSpec", "__version__"]

#: Public name -> the module that defines it (imported when the name is first read).
_LAZY = {
    "ConcatCache": "memos_ref.caches",
    "ContiguousCache": "memos_ref.caches",
    "KVCacheError": "memos_ref.errors",
    "KVSpec": "memos_ref.spec",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memos_ref' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
