"""KV quantizers: what a key or value tensor becomes in memory, and back.

Every scheme works on one layer's keys or values in the pool's head-major order, ``x [H, T, D]`` (heads,
tokens, channels), and returns a :class:`QTensor` — the stored integer or fp8 codes plus their scales — whose
``nbytes`` is exactly what the cache holds. ``dequantize`` returns float32.

* :class:`Float16` — a plain cast, the "FP16 cache" of seed 001 §4.1 for an fp32 model.
* :class:`PerTensorInt8` — one symmetric scale for the whole tensor: fixed (seed 003 §6.1's ``scale=0.1``,
  which clips everything beyond ±12.7) or calibrated from data (absmax / 127).
* :class:`PerTokenInt8` — a symmetric scale per (head, token): one outlier spoils only its own token.
* :class:`FP8E4M3` — float8 e4m3 codes with a scale per head. Given a frozen scale (transformers freezes it at
  prefill), values beyond ±448·scale would be clipped silently by the cast; here they raise the scale instead
  (``saturation="rescale"``) or are counted (``"clip"``, to show the damage).
* :class:`KIVI` — KIVI's asymmetric b-bit scheme (b = 4 or 2): keys per *channel* over groups of
  ``group_size`` tokens (key outliers live in fixed channels), values per *token* over groups of
  ``group_size`` channels; codes packed two or four to a byte; scales and zero points in fp16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from memos_ref.errors import ConfigError, DTypeError, InvalidArgumentError, ShapeError, check_type
from memos_ref.spec import KVSpec

if TYPE_CHECKING:
    from memos_ref.quant.pool import QuantizedBlockPool

__all__ = [
    "FP8E4M3",
    "KIVI",
    "Float16",
    "PerTensorInt8",
    "PerTokenInt8",
    "QTensor",
    "Quantizer",
    "fitting_scale",
    "pack",
    "unpack",
]

FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TINY = 1e-8  # floor for scales, so an all-zero group does not divide by zero


def fitting_scale(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """The scale ``amax / limit`` (floored at a tiny value), raised by one float32 ulp wherever the division
    rounded down far enough that ``amax / scale`` would land above ``limit``: a scale chosen to fit must fit,
    exactly as the quantizer will compute it (one ulp always suffices: the error of two roundings is < 1 ulp)."""
    amax = amax.float()
    scale = (amax / limit).clamp(min=_TINY)
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


def _check(x: torch.Tensor) -> None:
    check_type("x", x, torch.Tensor)
    if x.ndim != 3:
        raise ShapeError(f"expected one layer's keys or values [heads, tokens, head_dim], got {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise DTypeError(f"expected a floating-point tensor, got {x.dtype}")


def _check_bits(bits: int) -> None:
    check_type("bits", bits, int)
    if bits not in (1, 2, 4, 8):
        raise InvalidArgumentError(f"bits: expected 1, 2, 4 or 8 (codes that fill whole bytes), got {bits}")


def _check_kind(kind: str) -> None:
    if kind not in ("key", "value"):
        raise InvalidArgumentError(f"kind: expected 'key' or 'value', got {kind!r}")


def _check_qtensor(q: QTensor) -> None:
    check_type("q", q, QTensor)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes (uint8, last dim divisible by 8 // bits) into bytes, low bits first."""
    check_type("codes", codes, torch.Tensor)
    _check_bits(bits)
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
    _check_bits(bits)
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
        from memos_ref.quant.pool import QuantizedBlockPool

        return QuantizedBlockPool(
            spec,
            num_blocks,
            self,
            residual_tokens=residual_tokens,
            staging_blocks=staging_blocks,
            layer_scales=layer_scales,
            device=device,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class Float16(Quantizer):
    """A plain fp16 cast (seed 001 §4.1's "FP16 cache" for an fp32 model): half the bytes, no scales."""

    name = "fp16"
    bits = 16

    def quantize(self, x: torch.Tensor, kind: str = "key") -> QTensor:
        _check(x)
        _check_kind(kind)
        return QTensor(x.to(torch.float16), torch.tensor(1.0), shape=tuple(x.shape))

    def dequantize(self, q: QTensor) -> torch.Tensor:
        _check_qtensor(q)
        return q.data.float()

    def bytes_per_token(self, num_heads: int, head_dim: int) -> float:
        return 4.0 * num_heads * head_dim


class PerTensorInt8(Quantizer):
    """Symmetric int8 with one scale for the whole tensor: ``scale`` fixed, or None to calibrate (absmax/127)."""

    bits = 8

    def __init__(self, scale: float | None = None) -> None:
        check_type("scale", scale, (int, float, type(None)))
        if scale is not None and not 0 < scale < float("inf"):
            raise ConfigError(f"scale must be positive and finite, got {scale}")
        self.fixed = scale
        self.name = f"int8_tensor_fixed{scale:g}" if scale is not None else "int8_tensor"

    def scale_for(self, x: torch.Tensor) -> float:
        return self.fixed if self.fixed is not None else max(float(x.abs().max()) / 127.0, _TINY)

    def quantize(self, x: torch.Tensor, kind: str = "key") -> QTensor:
        _check(x)
        _check_kind(kind)
        scale = self.scale_for(x)
        scaled = x.float() / scale
        clipped = int((scaled.abs() > 127.5).sum())
        data = scaled.round().clamp(-127, 127).to(torch.int8)
        return QTensor(data, torch.tensor(scale), shape=tuple(x.shape), meta={"clipped": clipped})

    def dequantize(self, q: QTensor) -> torch.Tensor:
        _check_qtensor(q)
        return q.data.float() * q.scale

    def bytes_per_token(self, num_heads: int, head_dim: int) -> float:
        return 2.0 * num_heads * head_dim  # the one scale per tensor is negligible


class PerTokenInt8(Quantizer):
    """Symmetric int8 with an fp16 scale per (head, token)."""

    name = "int8_token"
    bits = 8

    @staticmethod
    def scales(x: torch.Tensor) -> torch.Tensor:
        """fp16 scales ``[..., T]`` (absmax over channels / 127); quantize with exactly these."""
        return (x.float().abs().amax(-1) / 127.0).clamp(min=_TINY).to(torch.float16).clamp(min=2**-24)

    #: Largest ``|x|`` a token may hold: its fp16 scale ``absmax / 127`` must stay finite (fp16 max is 65504).
    MAX_ABS = 127.0 * 65504.0

    @staticmethod
    def check_range(x: torch.Tensor, what: str = "x") -> None:
        """Refuse ``x`` (:class:`InvalidArgumentError`) where a value is non-finite or beyond :attr:`MAX_ABS`:
        its per-token fp16 scale would overflow to inf and the token would read back as NaN."""
        amax = x.detach().float().abs().amax() if x.numel() else torch.zeros(())
        if not bool(torch.isfinite(amax)) or float(amax) > PerTokenInt8.MAX_ABS:
            raise InvalidArgumentError(
                f"{what}: absmax {float(amax):.6g} exceeds what a fp16 per-token int8 scale can represent "
                f"(127 * 65504 = {PerTokenInt8.MAX_ABS:.0f}); use an fp16/fp32 cache or another scheme"
            )

    def quantize(self, x: torch.Tensor, kind: str = "key") -> QTensor:
        _check(x)
        _check_kind(kind)
        self.check_range(x, kind)
        scale = self.scales(x)  # [H, T]
        data = (x.float() / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
        return QTensor(data, scale, shape=tuple(x.shape))

    def dequantize(self, q: QTensor) -> torch.Tensor:
        _check_qtensor(q)
        return q.data.float() * q.scale.float()[..., None]

    def bytes_per_token(self, num_heads: int, head_dim: int) -> float:
        return 2.0 * num_heads * (head_dim + 2)


class FP8E4M3(Quantizer):
    """float8 e4m3 codes with an fp32 scale per head (absmax over tokens and channels / 448).

    ``quantize(x, scale=s)`` uses a given per-head scale, as a cache does once its scale exists. Where ``x``
    needs more range, ``saturation="rescale"`` raises the scale to fit (nothing clips; the caller must
    re-encode what it already stored with the old scale — the paged pool does); ``"clip"`` keeps the scale
    and lets the cast saturate at ±448, counting how many values it clipped (transformers' behaviour).
    """

    name = "fp8_e4m3"
    bits = 8

    def __init__(self, saturation: str = "rescale") -> None:
        check_type("saturation", saturation, str)
        if saturation not in ("rescale", "clip"):
            raise ConfigError(f"saturation must be 'rescale' or 'clip', got {saturation!r}")
        self.saturation = saturation

    @staticmethod
    def needed_scale(x: torch.Tensor) -> torch.Tensor:
        """Per-head scale ``[H]`` that fits ``x [H, T, D]`` into ±448: the smallest float32 ``s`` with
        ``absmax / s <= 448`` *as float32 computes it* (``absmax / (absmax / 448)`` can round to 448.00003,
        one step past the range, so the quotient's scale is raised by one ulp where it does)."""
        check_type("x", x, torch.Tensor)
        return fitting_scale(x.float().abs().amax(dim=(-1, -2)), FP8_MAX)

    def quantize(self, x: torch.Tensor, kind: str = "key", scale: torch.Tensor | None = None) -> QTensor:
        _check(x)
        _check_kind(kind)
        check_type("scale", scale, (torch.Tensor, type(None)))
        need = self.needed_scale(x)
        if scale is not None and tuple(scale.shape) != tuple(need.shape):
            raise ShapeError(f"scale: expected one per head {tuple(need.shape)}, got {tuple(scale.shape)}")
        if scale is None:
            scale = need
        elif self.saturation == "rescale":
            scale = torch.maximum(scale.float(), need)
        scaled = x.float() / scale[:, None, None]
        clipped = int((scaled.abs() > FP8_MAX).sum())
        data = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QTensor(data, scale.float(), shape=tuple(x.shape), meta={"clipped": clipped})

    def dequantize(self, q: QTensor) -> torch.Tensor:
        _check_qtensor(q)
        return q.data.float() * q.scale[:, None, None]

    def bytes_per_token(self, num_heads: int, head_dim: int) -> float:
        return 2.0 * num_heads * head_dim  # the per-head scale is per block, negligible per token


class KIVI(Quantizer):
    """KIVI-style asymmetric ``bits``-bit quantization (keys per channel, values per token), packed.

    Args:
        bits: 4 or 2.
        group_size: tokens per key group (a key's scale and zero are shared by ``group_size`` tokens of one
            channel); channels per value group (capped at the head dim).
    """

    def __init__(self, bits: int = 4, group_size: int = 32) -> None:
        check_type("bits", bits, int)
        check_type("group_size", group_size, int)
        if bits not in (2, 4):
            raise ConfigError(f"KIVI bits must be 2 or 4, got {bits}")
        if group_size not in (16, 32, 64, 128):
            raise ConfigError(f"KIVI group_size must be one of 16, 32, 64, 128, got {group_size}")
        self.bits, self.group_size = bits, group_size
        self.name = f"kivi{bits}_g{group_size}"

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def _asym(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes, fp16 scale and fp16 zero with min/max taken over ``dim``."""
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
        scale = ((hi - lo) / self.levels).clamp(min=_TINY).to(torch.float16).clamp(min=2**-24)
        zero = lo.to(torch.float16)
        codes = ((x - zero.float()) / scale.float()).round().clamp(0, self.levels).to(torch.uint8)
        return codes, scale, zero

    def quantize(self, x: torch.Tensor, kind: str = "key") -> QTensor:
        _check(x)
        h, t, d = x.shape
        xf = x.float()
        if kind == "key":
            g = self.group_size
            if t % g:
                raise ShapeError(
                    f"KIVI keys are quantized in groups of {g} tokens; got {t} tokens (keep the remainder in the "
                    f"full-precision residual)"
                )
            grouped = xf.reshape(h, t // g, g, d)  # [H, T/G, G, D]: per channel over G tokens
            codes, scale, zero = self._asym(grouped, dim=2)  # scale/zero [H, T/G, 1, D]
            codes = codes.reshape(h, t, d)
            scale, zero = scale.squeeze(2), zero.squeeze(2)  # [H, T/G, D]
        elif kind == "value":
            g = min(self.group_size, d)
            if d % g:
                raise ShapeError(f"head_dim {d} is not a multiple of the value group size {g}")
            grouped = xf.reshape(h, t, d // g, g)  # [H, T, D/G, G]: per token over G channels
            codes, scale, zero = self._asym(grouped, dim=3)
            codes = codes.reshape(h, t, d)
            scale, zero = scale.squeeze(3), zero.squeeze(3)  # [H, T, D/G]
        else:
            raise InvalidArgumentError(f"kind: expected 'key' or 'value', got {kind!r}")
        return QTensor(pack(codes, self.bits), scale, zero, shape=(h, t, d), meta={"kind": kind})

    def dequantize(self, q: QTensor) -> torch.Tensor:
        _check_qtensor(q)
        h, t, d = q.shape
        codes = unpack(q.data, self.bits).float()  # [H, T, D]
        if q.meta["kind"] == "key":
            g = t // q.scale.shape[1] if q.scale.shape[1] else self.group_size
            codes = codes.reshape(h, t // g, g, d)
            out = codes * q.scale.float()[:, :, None, :] + q.zero.float()[:, :, None, :]
        else:
            g = d // q.scale.shape[2]
            codes = codes.reshape(h, t, d // g, g)
            out = codes * q.scale.float()[..., None] + q.zero.float()[..., None]
        return out.reshape(h, t, d)

    def bytes_per_token(self, num_heads: int, head_dim: int) -> float:
        data = 2 * num_heads * head_dim * self.bits / 8
        key_meta = num_heads * head_dim * 4 / self.group_size  # fp16 scale + zero per channel per group
        value_meta = num_heads * (head_dim // min(self.group_size, head_dim)) * 4
        return data + key_meta + value_meta
