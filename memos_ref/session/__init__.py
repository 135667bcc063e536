"""The semantic layer: sessions that know what their tokens are for an agent (seed 000 §3.4, §4.3, §6.3, §6.5).

A :class:`CacheSession` is one agent conversation over the shared paged memory; a :class:`SessionManager` owns
the memory, the model and the registry of system prompts and memories. The package, one concept per module:

* :mod:`~memos_ref.session.segments` — the one session token layout (:class:`SegmentKind`, :class:`Segment`,
  :class:`SessionLayout`, :func:`tool_set_key`), used by sessions and by the tiering simulator;
* :mod:`~memos_ref.session.manager` — :class:`SessionManager` and :class:`Memory`;
* :mod:`~memos_ref.session.session` — :class:`CacheSession` (append, generate, fork, compact, suspend/resume) and
  :class:`SessionHost`, what a session needs of its manager (a Protocol: the session never imports the manager);
* :mod:`~memos_ref.session.persist` — save/load (safetensors + a checksummed JSON manifest; untrusted files are
  bounded, confined and never unpickled).

Every public name is importable from ``memos_ref.session``. ``MAX_MANIFEST_BYTES`` is read here at each load.
"""

from memos_ref.session.manager import Memory, SessionManager
from memos_ref.session.persist import (
    MANIFEST_VERSION,
    MAX_MANIFEST_BYTES,
    MAX_TENSOR_HEADER_BYTES,
    manifest_checksum,
)
from memos_ref.session.segments import Segment, SegmentKind, SessionLayout, block_kinds, segment_kind, tool_set_key
from memos_ref.session.session import CacheSession, SessionHost

__all__ = [
    "MANIFEST_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_TENSOR_HEADER_BYTES",
    "CacheSession",
    "Memory",
    "Segment",
    "SegmentKind",
    "SessionHost",
    "SessionLayout",
    "SessionManager",
    "block_kinds",
    "manifest_checksum",
    "segment_kind",
    "tool_set_key",
]
