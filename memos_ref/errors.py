"""The one exception hierarchy of memos-ref.

Every error the package raises on bad input is a subclass of :class:`KVCacheError`, so callers can catch
the whole family, and each message names what was expected and what was found. A failed operation leaves
the structure it was called on exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "BackendDegradedWarning",
    "BackendUnavailableError",
    "CapacityExceededError",
    "ConfigError",
    "CorruptCacheError",
    "DTypeError",
    "DeviceError",
    "DoubleFreeError",
    "InvalidBlockError",
    "KVCacheError",
    "LayerIndexError",
    "ModelMismatchError",
    "OutOfBlocksError",
    "RefcountUnderflowError",
    "ShapeError",
    "StagingFullError",
]


class KVCacheError(Exception):
    """Base class of every error raised by memos-ref on bad input or exhausted resources."""


class ConfigError(KVCacheError, ValueError):
    """A configuration (model config, KVSpec, cache options) is missing a field or holds a bad value."""


class ShapeError(KVCacheError, ValueError):
    """A tensor has the wrong shape; the message gives the expected and actual shapes."""


class DTypeError(KVCacheError, TypeError):
    """A tensor has the wrong dtype; the message gives the expected and actual dtypes."""


class DeviceError(KVCacheError, ValueError):
    """A tensor is on the wrong device; the message gives the expected and actual devices."""


class LayerIndexError(KVCacheError, IndexError):
    """A layer index is outside ``[0, num_layers)``."""


class CapacityExceededError(KVCacheError):
    """A fixed-capacity structure (a preallocated cache with growth disabled, a byte budget) is full."""

    def __init__(self, message: str, *, needed: int | None = None, capacity: int | None = None) -> None:
        super().__init__(message)
        self.needed = needed
        self.capacity = capacity


class OutOfBlocksError(CapacityExceededError):
    """The block pool cannot satisfy an allocation; carries the needed and available block counts."""

    def __init__(self, needed: int, available: int) -> None:
        super().__init__(
            f"out of KV blocks: needed {needed}, available {available}; free sequences, evict cached "
            f"blocks, or build the pool with more blocks",
            needed=needed,
            capacity=available,
        )
        self.available = available


class StagingFullError(CapacityExceededError):
    """A quantized pool has no free full-precision staging block for a write (they hold the residual windows
    of live sequences)."""


class InvalidBlockError(KVCacheError, IndexError):
    """A block id is unknown (out of range) or refers to a block that is not allocated."""


class DoubleFreeError(KVCacheError):
    """A block was freed when it was already free."""


class RefcountUnderflowError(KVCacheError):
    """A block's reference count would drop below zero."""


class CorruptCacheError(KVCacheError):
    """Stored KV data failed a checksum, was truncated, or came from another model or KVSpec."""


class BackendUnavailableError(KVCacheError):
    """A storage backend (for example Redis) cannot be reached."""


class ModelMismatchError(CorruptCacheError):
    """Stored KV data belongs to a different model fingerprint or KVSpec than the one loading it."""


class InvariantError(KVCacheError, AssertionError):
    """The allocator, the block tables and the prefix cache disagree (a bug); carries the offending block ids."""

    def __init__(self, message: str, blocks: list[int] | None = None) -> None:
        super().__init__(message)
        self.blocks = blocks or []


class BackendDegradedWarning(RuntimeWarning):
    """A remote backend stopped answering; until it returns, reads answer as misses and writes are dropped."""
