"""Blocks in host RAM: the tier right below the device pool (pinned when CUDA is available)."""

from __future__ import annotations

from typing import Any

import torch

from memos_ref.errors import check_type
from memos_ref.tiering.backend_base import BudgetLRU, check_data, validate_block_key

__all__ = ["HostMemoryBackend"]


class HostMemoryBackend(BudgetLRU):
    """Blocks in host RAM (pinned when CUDA is available, so device copies can be asynchronous)."""

    name = "host"

    def __init__(self, budget_bytes: int, *, pin: bool | None = None) -> None:
        super().__init__(budget_bytes)
        if pin is not None:
            check_type("pin", pin, bool)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._data: dict[str, Any] = {}

    def put(self, key: str, data: bytes) -> bool:
        validate_block_key(key)
        check_data(data)
        with self._lock:
            if not self._reserve(key, len(data)):
                return False
            try:
                if self.pin:
                    buf = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
                    buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                    self._data[key] = buf
                else:
                    self._data[key] = bytes(data)
            except RuntimeError:  # pinned memory can run out: refuse the block rather than fail the caller
                self.counts["errors"] += 1
                return False
            self._commit(key, len(data))
            return True

    def get(self, key: str) -> bytes | None:
        validate_block_key(key)
        with self._lock:
            value = self._data.get(key)
            if value is None:
                self.counts["misses"] += 1
                return None
            if len(value) > self.max_item_bytes:  # stored before the tier store lowered the bound
                self._drop(key)
                self.counts["corrupt"] += 1
                self.counts["misses"] += 1
                return None
            self._sizes.touch(key)
            self.counts["hits"] += 1
            return value.numpy().tobytes() if isinstance(value, torch.Tensor) else value

    def _drop(self, key: str) -> None:
        self._sizes.pop(key)
        del self._data[key]

    def _peek(self, key: str) -> bytes | None:
        value = self._data.get(key)
        return value.numpy().tobytes() if isinstance(value, torch.Tensor) else value
