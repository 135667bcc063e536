"""What the short-term memory stores: keys (validated: they become Redis keys too) and values (compact, strict
JSON text, written by one C encoder built once), the "nothing found" marker :data:`MISSING`, and the
:class:`AbsentKeyError` of a key with no live value. Shared by :class:`~memos_ref.memory.store.TTLStore` and
the Redis backend; re-exported from :mod:`memos_ref.memory.store`.
"""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Callable
from typing import Any

from memos_ref.errors import ArgumentTypeError, CapacityExceededError, ConfigError, KVCacheError

__all__ = ["MAX_KEY", "MISSING", "NEGATIVE", "AbsentKeyError", "encode_value", "json_text", "validate_key"]


class AbsentKeyError(KVCacheError, KeyError):
    """``ttl()`` of a key with no live value (absent, expired, negatively cached, or unreachable on Redis): a
    package error that is still the ``KeyError`` the store's contract names."""

    def __str__(self) -> str:
        key = self.args[0] if self.args else ""
        text = key if isinstance(key, str) else repr(key)
        return f"no live value for key {text[:80]!r}" + (f" ({len(text)} characters)" if len(text) > 80 else "")


#: The longest key, in characters.
MAX_KEY = 250


def _json_text_fn() -> Callable[[Any], str]:
    """Compact, strict JSON text (no NaN or infinities), as ``json.dumps(value, separators=(",", ":"),
    allow_nan=False)`` writes it, from one C encoder built once (``json.dumps`` with any option builds a new
    encoder, and ``JSONEncoder.encode`` a new C encoder, on every call). Without the circular-reference check: a
    cycle ends in RecursionError, which :func:`encode_value` refuses like any value nested too deeply."""
    proto = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
    make = json.encoder.c_make_encoder
    if make is None:  # pragma: no cover - CPython always has the C accelerator
        return proto.encode
    args = (proto.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, False)
    encoder = make(None, *args)
    join = "".join

    def json_text(value: Any) -> str:
        if isinstance(value, str):  # the C encoder answers a bare string as a 1-tuple
            return json.encoder.encode_basestring_ascii(value)
        return join(encoder(value, 0))

    return json_text


#: ``value`` as compact, strict JSON text (see :func:`_json_text_fn`); the memory benchmark gives its
#: cachetools peer this same function, so both sides pay the same JSON copy.
json_text = _json_text_fn()
#: The payload of a negatively cached key: no JSON value encodes to zero characters.
NEGATIVE = ""


class _Missing:
    """The type of :data:`MISSING` (one instance; no JSON document decodes to it)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


#: What a lookup answers for a key that holds a cached "nothing found" (``get_or_compute``'s negative caching).
#: A private object: it is never equal to a value a user stored, and decoding JSON can never produce it.
MISSING = _Missing()


def validate_key(key: str) -> str:
    """Keys become Redis keys: printable, no whitespace or control characters, at most 250 characters."""
    # str.isprintable() is False for every whitespace character except the ASCII space, checked separately.
    if not isinstance(key, str):
        raise ArgumentTypeError(f"key: expected str, got {type(key).__name__} ({key!r:.80})")
    if not 0 < len(key) <= MAX_KEY or not key.isprintable() or " " in key:
        raise ConfigError(
            f"invalid key {key!r:.80} ({len(key)} characters): expected 1-{MAX_KEY} printable characters"
            " without whitespace"
        )
    return key


def encode_value(key: str, value: Any, max_value_bytes: int) -> bytes:
    """``value`` as compact JSON, refused when not JSON-serialisable or when it (with its key) exceeds
    ``max_value_bytes`` (seed 002 §4.3, §7.3)."""
    try:
        payload = json_text(value).encode()
    except (TypeError, ValueError, RecursionError) as exc:  # ValueError: NaN, a cycle; RecursionError: too deep
        raise ConfigError(f"value for {key!r} is not JSON-serialisable: {type(exc).__name__}: {exc}") from None
    size = len(payload) + len(key)
    if size > max_value_bytes:
        raise CapacityExceededError(
            f"value for {key!r} is {size} bytes; the largest allowed is {max_value_bytes}",
            needed=size,
            capacity=max_value_bytes,
        )
    return payload
