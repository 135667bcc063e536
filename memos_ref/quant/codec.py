"""The seam between a quantization scheme and the quantized pool: :class:`BlockCodec`, the interface of one
scheme's blocks inside :class:`~memos_ref.quant.pool.QuantizedBlockPool` (payload layout, encode, decode, streaming
writes, bytes, the kernel arguments), and :class:`BlockScheme`, the one thing the pool asks of a scheme (its codec).

It sits below both: the pool imports this module, not :mod:`~memos_ref.quant.base`, so the scheme interface there
can build its pool (:meth:`~memos_ref.quant.base.Quantizer.build_pool`) without a file circle.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from memos_ref.errors import ConfigError
from memos_ref.spec import KVSpec

__all__ = ["BlockCodec", "BlockScheme"]


@runtime_checkable
class BlockScheme(Protocol):
    """What the quantized pool needs of a scheme: its name and its block codec (every
    :class:`~memos_ref.quant.base.Quantizer` is one)."""

    name: str

    def codec(self, spec: KVSpec, device: torch.device, layer_scales: torch.Tensor | None = None) -> BlockCodec:
        """This scheme's :class:`BlockCodec` for a pool of ``spec`` on ``device``."""
        ...


class BlockCodec:
    """One scheme's blocks in the quantized pool (:class:`~memos_ref.quant.pool.QuantizedBlockPool`).

    The payload is a dict of tensors, each ``[N, ...]`` (one row per block); the pool owns it and the staging
    slab, the codec owns what the rows mean. ``kv`` below is full-precision K/V ``[m, L, 2, H, T, D]``; a layer's
    decoded blocks are float32 ``[m, 2, H, T, D]``.

    Attributes:
        streams: tokens can be encoded as they are written (False: blocks are staged and sealed whole).
        default_residual_tokens: the residual window a pool of this scheme keeps when none is given.
        layer_scales: ``[L, 2]`` per-tensor scales on the device, for schemes that have them (else None).
    """

    streams = True
    default_residual_tokens = 0

    def __init__(self, scheme: BlockScheme, spec: KVSpec, device: torch.device) -> None:
        self.scheme, self.spec, self.device = scheme, spec, device
        self.layer_scales: torch.Tensor | None = None

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def allocate(self, n: int) -> dict[str, torch.Tensor]:
        """The payload of ``n`` blocks, zeroed."""
        raise NotImplementedError

    def check_values(self, x: torch.Tensor, what: str) -> None:
        """Refuse finite K/V ``x [n, H, D]`` this scheme cannot encode (:class:`InvalidArgumentError`)."""

    def write(
        self, payload: dict[str, torch.Tensor], layer: int, kv: int, blocks: torch.Tensor, offsets: torch.Tensor,
        x: torch.Tensor,
    ) -> tuple[int, int]:  # fmt: skip
        """Encode tokens ``x [n, H, D]`` (keys: ``kv`` 0, values: 1) of ``layer`` into ``payload`` at
        ``(blocks [n], offsets [n])``. Returns ``(clipped values, blocks whose scale grew)``."""
        raise ConfigError(f"{self.scheme.name} blocks cannot be written token by token; stage and seal them")

    def encode(self, payload: dict[str, torch.Tensor], idx: torch.Tensor, kv: torch.Tensor) -> int:
        """Seal full-precision blocks ``kv [m, L, 2, H, T, D]`` into ``payload`` rows ``idx [m]``; returns how
        many values were clipped."""
        raise NotImplementedError

    def decode(self, payload: dict[str, torch.Tensor], idx: torch.Tensor, layer: int) -> torch.Tensor:
        """Blocks ``idx [m]`` of ``layer`` dequantized: float32 ``[m, 2, H, T, D]``."""
        raise NotImplementedError

    def poison(self, payload: dict[str, torch.Tensor], block: int) -> None:
        """Debug mode: make ``block`` decode to NaN (its scales become NaN; a scheme with none stays as is)."""
        for name, tensor in payload.items():
            if "scale" in name:
                tensor[block] = float("nan")

    @property
    def extra_nbytes(self) -> int:
        """Bytes held outside the per-block payload (per-tensor scales)."""
        return self.layer_scales.nbytes if self.layer_scales is not None else 0

    def bytes_per_block(self) -> int:
        """Bytes of one sealed block's codes and scales."""
        return sum(p[0].nbytes for p in self.allocate(1).values())

    def kernel_args(self, payload: dict[str, torch.Tensor], layer: int) -> dict[str, object]:
        """The arguments ``memos_kernels`` takes for one layer of this payload (views, nothing copied)."""
        raise NotImplementedError
