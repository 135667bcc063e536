"""TierStore: the tiers below the device pool, fastest first (host → disk → Redis), each with its codec.

``put`` encodes a block (:mod:`~memos_ref.tiering.blockfile`) into one tier; a block a tier evicts to stay in
its budget is demoted to the next tier; ``get`` looks through the tiers in order and decodes the first copy it
finds. A copy that fails its checks (truncated, garbled, wrong checksum,
another model) is counted as ``corrupt``, deleted, and treated as a miss — the caller recomputes; nothing
damaged is ever returned. Every transfer is timed: ``bandwidth(tier)`` is the measured bytes per second of raw
KV (an exponential moving average), which the tier manager uses to choose between reloading and recomputing.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from memos_ref.errors import (
    ArgumentTypeError,
    BackendUnavailableError,
    ConfigError,
    CorruptCacheError,
    check_index,
    check_type,
)
from memos_ref.spec import KVSpec
from memos_ref.tiering.backends import TierBackend, validate_block_key
from memos_ref.tiering.blockfile import decode_block, encode_block, max_encoded_bytes
from memos_ref.tiering.codecs import Codec

__all__ = ["Tier", "TierStore"]


@dataclass
class Tier:
    """One tier: a backend and the codec its blocks are stored with."""

    backend: TierBackend
    codec: Codec = field(default_factory=Codec)

    @property
    def name(self) -> str:
        return self.backend.name


class TierStore:
    """Ordered tiers for one model's KV blocks.

    Args:
        tiers: fastest first; names must be distinct.
        spec: the KV geometry of every block.
        fingerprint: the model fingerprint written into, and checked against, every block.
    """

    def __init__(self, tiers: list[Tier], *, spec: KVSpec, fingerprint: str) -> None:
        check_type("tiers", tiers, (list, tuple))
        for i, t in enumerate(tiers):
            check_type(f"tiers[{i}]", t, Tier)
            check_type(f"tiers[{i}].backend", t.backend, TierBackend)
            check_type(f"tiers[{i}].codec", t.codec, Codec)
        check_type("spec", spec, KVSpec)
        check_type("fingerprint", fingerprint, str)
        names = [t.name for t in tiers]
        if not tiers or len(set(names)) != len(names):
            raise ConfigError(f"tiers must be a non-empty list with distinct names, got {names}")
        self.tiers, self.spec, self.fingerprint = list(tiers), spec, fingerprint
        for t in self.tiers:  # no tier reads more than the largest block file of this geometry
            t.backend.limit_item_bytes(max_encoded_bytes(spec))
        self.by_name = {t.name: t for t in tiers}
        self.counts: dict[str, Counter[str]] = {t.name: Counter() for t in tiers}
        self._bandwidth: dict[str, float] = {}
        for upper, lower in itertools.pairwise(tiers):  # a block a tier evicts to fit its budget moves down
            if hasattr(upper.backend, "on_evict"):
                upper.backend.on_evict = self._demoter(upper, lower)

    def _demoter(self, upper: Tier, lower: Tier):
        def demote(key: str, data: bytes) -> None:
            if lower.backend.put(key, data):  # it keeps the codec it was written with (the header says which)
                self.counts[upper.name]["demoted_out"] += 1
                self.counts[lower.name]["demoted_in"] += 1

        return demote

    def tier(self, name: str | int) -> Tier:
        """A tier by name or by position (0 = fastest)."""
        if isinstance(name, int) and not isinstance(name, bool):
            return self.tiers[check_index("tier", name, lo=0, hi=len(self.tiers) - 1)]
        check_type("tier", name, (str, int))
        if name not in self.by_name:
            raise ConfigError(f"unknown tier {name!r}: expected one of {list(self.by_name)}")
        return self.by_name[name]

    def _observe(self, tier: str, raw_bytes: int, seconds: float) -> None:
        rate = raw_bytes / max(seconds, 1e-9)
        old = self._bandwidth.get(tier)
        self._bandwidth[tier] = rate if old is None else 0.8 * old + 0.2 * rate

    def bandwidth(self, tier: str) -> float | None:
        """Measured bytes of raw KV per second read back from ``tier`` (None until something was read)."""
        return self._bandwidth.get(tier)

    # ------------------------------------------------------------------ moving blocks
    def put(self, key: str, block: torch.Tensor, tier: str | int = 0) -> bool:
        """Encode ``block [L, 2, H, T, D]`` and store it in ``tier``; False if the tier refused it."""
        validate_block_key(key)
        target = self.tier(tier)
        started = time.perf_counter()
        data = encode_block(block, spec=self.spec, fingerprint=self.fingerprint, codec=target.codec, key=key)
        ok = target.backend.put(key, data)
        counts = self.counts[target.name]
        if ok:
            counts["swap_out_blocks"] += 1
            counts["swap_out_bytes"] += len(data)
            counts["swap_out_raw_bytes"] += self.spec.bytes_per_block
            counts["swap_out_seconds_x1e6"] += round((time.perf_counter() - started) * 1e6)
        else:
            counts["refused"] += 1
        return ok

    def get(self, key: str, *, tiers: list[str] | None = None) -> tuple[torch.Tensor, str] | None:
        """The block stored under ``key`` and the tier it came from, or None (absent, or every copy damaged)."""
        validate_block_key(key)
        if tiers is not None:
            if isinstance(tiers, str) or not isinstance(tiers, (list, tuple, set, frozenset)):
                raise ArgumentTypeError(f"tiers: expected a list of tier names or None, got {type(tiers).__name__}")
            for name in tiers:
                self.tier(name)  # unknown names are refused, not silently skipped
        for target in self.tiers:
            if tiers is not None and target.name not in tiers:
                continue
            started = time.perf_counter()
            data = target.backend.get(key)
            if data is None:
                continue
            try:
                block = decode_block(data, spec=self.spec, fingerprint=self.fingerprint, key=key)
            except CorruptCacheError:
                self.counts[target.name]["corrupt"] += 1
                target.backend.delete(key)
                continue
            except BackendUnavailableError:  # this process cannot decode it; the copy may be fine for others
                self.counts[target.name]["undecodable"] += 1
                continue
            seconds = time.perf_counter() - started
            self._observe(target.name, self.spec.bytes_per_block, seconds)
            counts = self.counts[target.name]
            counts["swap_in_blocks"] += 1
            counts["swap_in_bytes"] += len(data)
            return block, target.name
        return None

    def locate(self, key: str) -> str | None:
        """The first tier holding ``key`` (without reading it)."""
        validate_block_key(key)
        for target in self.tiers:
            if target.backend.contains(key):
                return target.name
        return None

    def delete(self, key: str) -> int:
        """Remove ``key`` from every tier; returns how many copies were removed."""
        validate_block_key(key)
        return sum(int(t.backend.delete(key)) for t in self.tiers)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for t in self.tiers:
            backend = t.backend.stats()
            mine = self.counts[t.name]
            out[t.name] = {
                **backend,
                **mine,
                # both count damaged copies: the backend what it refused to read, the store what failed to decode
                "corrupt": backend.get("corrupt", 0) + mine.get("corrupt", 0),
                "codec": t.codec.name,
                "bandwidth_bytes_per_s": self._bandwidth.get(t.name),
            }
        return out
