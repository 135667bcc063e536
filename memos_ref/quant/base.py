"""What every quantization scheme shares: the :class:`Quantizer` interface (one layer's keys or values, tensor by
tensor), the :class:`BlockCodec` interface (a scheme's blocks inside the quantized pool: payload layout, encode,
decode, streaming writes, bytes, the kernel arguments; it lives in :mod:`~memos_ref.quant.codec`, below the pool, and
is re-exported here), :class:`QTensor`, bit packing and the fitting-scale rule.

One file per scheme implements both: :mod:`~memos_ref.quant.fp16`, :mod:`~memos_ref.quant.int8_token`,
:mod:`~memos_ref.quant.int8_tensor`, :mod:`~memos_ref.quant.fp8`, :mod:`~memos_ref.quant.kivi`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from memos_ref.errors import ConfigError, DTypeError, InvalidArgumentError, ShapeError, check_type
from memos_ref.quant.codec import BlockCodec
from memos_ref.quant.pool import QuantizedBlockPool
from memos_ref.spec import KVSpec

__all__ = [
    "SCALE_FLOOR",
    "BlockCodec",
    "QTensor",
    "Quantizer",
    "check_bits",
    "check_kind",
    "check_kv_tensor",
    "check_qtensor",
    "fitting_scale",
    "pack",
    "unpack",
]

SCALE_FLOOR = 1e-8  # floor for scales, so an all-zero group does not divide by zero


def fitting_scale(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """The scale ``amax / limit`` (floored at a tiny value), raised by one float32 ulp wherever the division
    rounded down far enough that ``amax / scale`` would land above ``limit``: a scale chosen to fit must fit,
    exactly as the quantizer will compute it (one ulp always suffices: the error of two roundings is < 1 ulp)."""
    amax = amax.float()
    scale = (amax / limit).clamp(min=SCALE_FLOOR)
    over = amax / scale > limit
    return torch.where(over, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)


@dataclass
class QTensor:
    """Quantized codes and what is needed to decode them; ``nbytes`` counts all of it."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    shape: tuple[int, ...] = ()
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        n = self.data.nbytes + (self.scale.nbytes if self.scale.ndim else 0)
        return n + (self.zero.nbytes if self.zero is not None else 0)


def check_kv_tensor(x: torch.Tensor) -> None:
    """Refuse anything but one layer's floating-point keys or values ``[H, T, D]``."""
    check_type("x", x, torch.Tensor)
    if x.ndim != 3:
        raise ShapeError(f"expected one layer's keys or values [heads, tokens, head_dim], got {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise DTypeError(f"expected a floating-point tensor, got {x.dtype}")


def check_bits(bits: int) -> None:
    """Code widths that fill whole bytes: 1, 2, 4 or 8."""
    check_type("bits", bits, int)
    if bits not in (1, 2, 4, 8):
        raise InvalidArgumentError(f"bits: expected 1, 2, 4 or 8 (codes that fill whole bytes), got {bits}")


def check_kind(kind: str) -> None:
    """``"key"`` or ``"value"``."""
    if kind not in ("key", "value"):
        raise InvalidArgumentError(f"kind: expected 'key' or 'value', got {kind!r}")


def check_qtensor(q: QTensor) -> None:
    """A :class:`QTensor`."""
    check_type("q", q, QTensor)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes (uint8, last dim divisible by 8 // bits) into bytes, low bits first."""
    check_type("codes", codes, torch.Tensor)
    check_bits(bits)
    per = 8 // bits
    if codes.shape[-1] % per:
        raise ShapeError(f"last dimension {codes.shape[-1]} is not a multiple of {per} ({bits}-bit packing)")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = torch.zeros(c.shape[:-1], dtype=torch.uint8, device=codes.device)
    for i in range(per):
        out |= c[..., i] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[..., n]`` bytes to ``[..., n · 8 // bits]`` codes (uint8)."""
    check_type("packed", packed, torch.Tensor)
    check_bits(bits)
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per)


class Quantizer:
    """Base: ``quantize(x [H, T, D], kind)`` and ``dequantize(q)``; ``kind`` is ``"key"`` or ``"value"``."""

    name = "quantizer"
    bits = 16

    def quantize(self, x: torch.Tensor, kind: str = "key") -> QTensor:
        raise NotImplementedError

    def dequantize(self, q: QTensor) -> torch.Tensor:
        raise NotImplementedError

    def bytes_per_token(self, num_heads: int, head_dim: int) -> float:
        """Stored bytes per token for keys *and* values of one layer, scales included (residual excluded)."""
        raise NotImplementedError

    def round_trip(self, x: torch.Tensor, kind: str = "key") -> torch.Tensor:
        return self.dequantize(self.quantize(x, kind)).to(x.dtype)

    def build_pool(
        self,
        spec: KVSpec,
        num_blocks: int,
        *,
        residual_tokens: int | None = None,
        staging_blocks: int | None = None,
        layer_scales: torch.Tensor | None = None,
        device: str | torch.device = "cpu",
    ) -> QuantizedBlockPool:
        """A :class:`~memos_ref.quant.pool.QuantizedBlockPool` of this scheme (what ``PagedKV(spec, n, quant=self)``
        holds: the paged layer asks the scheme for its pool instead of importing the quant layer)."""
        return QuantizedBlockPool(
            spec,
            num_blocks,
            self,
            residual_tokens=residual_tokens,
            staging_blocks=staging_blocks,
            layer_scales=layer_scales,
            device=device,
        )

    def codec(self, spec: KVSpec, device: torch.device, layer_scales: torch.Tensor | None = None) -> BlockCodec:
        """This scheme's :class:`BlockCodec` for a pool of ``spec`` on ``device`` (:class:`ConfigError` when the
        scheme has no block layout, or ``spec`` does not fit it)."""
        raise ConfigError(
            f"unsupported scheme {self!r}: expected Float16, PerTokenInt8, PerTensorInt8, FP8E4M3 or KIVI"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"
