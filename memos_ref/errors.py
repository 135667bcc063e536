"""The one exception hierarchy of memos-ref.

Every error the package raises on bad input is a subclass of :class:`KVCacheError`, so callers can catch
the whole family, and each message names what was expected and what was found. A failed operation leaves
the structure it was called on exactly as it was.
"""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError",
    "BackendDegradedWarning",
    "BackendUnavailableError",
    "CapacityExceededError",
    "ConfigError",
    "CorruptCacheError",
    "DTypeError",
    "DeviceError",
    "DoubleFreeError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "KVCacheError",
    "LayerIndexError",
    "ModelMismatchError",
    "ModelUnavailableError",
    "OutOfBlocksError",
    "RefcountUnderflowError",
    "ShapeError",
    "SlidingWindowMemoryWarning",
    "StagingFullError",
    "StateError",
    "UnsupportedModelError",
    "UseAfterFreeError",
    "check_index",
    "check_layer_index",
    "check_type",
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


class ArgumentTypeError(KVCacheError, TypeError):
    """A public API argument has the wrong type; the message names the argument, the expected type and the
    type received."""


class InvalidArgumentError(KVCacheError, ValueError):
    """A public API argument has the right type but a value outside its domain (a negative index, a start past
    the end, a NaN temperature); the message names the argument, the allowed range and the value received."""


class LayerIndexError(InvalidArgumentError, IndexError):
    """A layer index is outside ``[0, num_layers)`` — the one error for that mistake, from the dense caches, the
    paged pools, sequences and steps alike. It is an :class:`InvalidArgumentError` (the family of out-of-range
    arguments) and an ``IndexError``, so an ``except`` clause written for either keeps working."""


class StateError(KVCacheError, RuntimeError):
    """An object was used in a state that does not allow the call (for example after it was freed or closed)."""


class UseAfterFreeError(StateError):
    """A sequence or cache was used after ``free()``; create a new one (or ``fork()`` before freeing)."""


class UnsupportedModelError(ConfigError):
    """A model uses a feature the paged cache does not implement (MLA, linear attention, softcapping, ...);
    the message names the feature and what is supported instead. Raised before anything is written."""


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
    """A backend cannot serve the call: a storage backend (for example Redis) cannot be reached, or a compute
    backend (a Triton kernel) failed to compile or launch; the message names it and the fallback."""


class ModelUnavailableError(KVCacheError, LookupError):
    """A pretrained model's source file cannot be found (nor downloaded); the message gives the command that
    makes it available."""


class ModelMismatchError(CorruptCacheError):
    """Stored KV data belongs to a different model fingerprint or KVSpec than the one loading it."""


class InvariantError(KVCacheError, AssertionError):
    """The allocator, the block tables and the prefix cache disagree (a bug); carries the offending block ids."""

    def __init__(self, message: str, blocks: list[int] | None = None) -> None:
        super().__init__(message)
        self.blocks = blocks or []


class BackendDegradedWarning(RuntimeWarning):
    """A remote backend stopped answering; until it returns, reads answer as misses and writes are dropped."""


class SlidingWindowMemoryWarning(UserWarning):
    """A model has sliding-window attention layers: the paged cache keeps every token of them (attention still
    sees only the window, so outputs are unchanged), so their KV memory grows with the context, not the window."""


def check_type(name: str, value: object, expected: type | tuple[type, ...]) -> None:
    """Raise :class:`ArgumentTypeError` unless ``value`` is an instance of ``expected``.

    ``bool`` is refused where ``int`` is expected (``True`` is an ``int`` in Python, never a valid count).
    """
    types = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in types:
        ok = False
    else:
        ok = isinstance(value, types)
    if not ok:
        names = " or ".join(t.__name__ for t in types)
        raise ArgumentTypeError(f"{name}: expected {names}, got {type(value).__name__} ({value!r:.80})")


def _as_int(name: str, value: object) -> int:
    """``value`` as a Python ``int`` (an ``int``, a 0-d integer tensor, a numpy integer; never a bool), else
    :class:`ArgumentTypeError` naming the argument and the type received."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ArgumentTypeError(f"{name}: expected int, got {type(value).__name__} ({value!r:.80})")
    try:
        return value.__index__()  # type: ignore[attr-defined]
    except TypeError as exc:  # a float tensor has __index__ but refuses it
        raise ArgumentTypeError(f"{name}: expected int, got {type(value).__name__} ({value!r:.80})") from exc


def check_index(name: str, value: object, *, lo: int = 0, hi: int | None = None) -> int:
    """Validate an integer index argument: an ``int`` (or 0-d integer tensor / numpy integer), not a bool,
    with ``lo <= value <= hi`` (``hi`` inclusive, ``None`` = unbounded). Returns it as a Python ``int``.

    Raises :class:`ArgumentTypeError` for a wrong type and :class:`InvalidArgumentError` for a value out of
    range, each naming the argument, the expected range and the value received.
    """
    v = _as_int(name, value)
    if v < lo or (hi is not None and v > hi):
        bound = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise InvalidArgumentError(f"{name}: expected an integer in {bound}, got {v}")
    return v


def check_layer_index(layer: object, num_layers: int, name: str = "layer") -> int:
    """A layer index as a Python ``int`` in ``[0, num_layers)``: :class:`ArgumentTypeError` for a non-integer (a
    bool, a float), :class:`LayerIndexError` outside the range, naming the range and the value received."""
    v = _as_int(name, layer)
    if not 0 <= v < num_layers:
        raise LayerIndexError(
            f"{name} {v} is out of range: expected a layer index in [0, {num_layers}) ({num_layers} layers), got {v}"
        )
    return v
