"""fp8 e4m3: float8 codes with an fp32 scale per head — and the package's one fp8 scale law.

**The scale law** (:func:`fp8_scale`): a group's scale is ``absmax / 448`` computed in float32, raised by one ulp
where the quotient would land past 448 (:func:`~memos_ref.quant.base.fitting_scale`) — the smallest float32
scale under which nothing saturates. Encoding (:func:`fp8_encode`) divides by the scale, saturates at ±448 and
casts to ``float8_e4m3fn``; decoding multiplies the code by the scale. ``memos_kernels.write_kv_fp8`` encodes
exactly so (it takes the scales as given; it computes none).

A *streamed* block's scale must grow as tokens arrive; it grows to :func:`fp8_block_scale`, the law's scale
rounded up to a power of two, so that re-encoding what the block holds is an exact exponent shift and repeated
growth never compounds rounding. Sealed blocks (and :class:`FP8E4M3` on a tensor) use the law's scale itself.

Blocks: ``codes [N, L, 2, H, T, D]`` (float8 bits stored as uint8) + ``scale [N, L, 2, H]`` fp32.
"""

from __future__ import annotations

import torch

from memos_ref.errors import ConfigError, ShapeError, check_type
from memos_ref.quant.base import (
    BlockCodec,
    QTensor,
    Quantizer,
    check_kind,
    check_kv_tensor,
    check_qtensor,
    fitting_scale,
)
from memos_ref.spec import KVSpec

__all__ = ["FP8E4M3", "FP8_MAX", "FP8Codec", "fp8_block_scale", "fp8_encode", "fp8_scale"]

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The fp8 scale law: the smallest float32 scale ``s`` with ``amax / s <= 448`` as float32 computes it."""
    return fitting_scale(amax, FP8_MAX)


def fp8_block_scale(amax: torch.Tensor) -> torch.Tensor:
    """:func:`fp8_scale` rounded up to a power of two (what a streamed block's scale grows to)."""
    need = torch.exp2(torch.ceil(torch.log2(fp8_scale(amax))))
    # float32's log2 can round 2^k · (1 + ε) down to k: double such a scale so that it really fits
    return torch.where(amax.float() / need > FP8_MAX, need * 2, need)


def fp8_encode(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``float8_e4m3fn`` codes of ``x / scale`` (``scale`` broadcast) saturated at ±448, and how many values
    saturated (0 under a scale from the law)."""
    scaled = x.float() / scale
    clipped = int((scaled.abs() > FP8_MAX).sum())
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), clipped


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
        return fp8_scale(x.float().abs().amax(dim=(-1, -2)))

    def quantize(self, x: torch.Tensor, kind: str = "key", scale: torch.Tensor | None = None) -> QTensor:
        check_kv_tensor(x)
        check_kind(kind)
        check_type("scale", scale, (torch.Tensor, type(None)))
        need = self.needed_scale(x)
        if scale is not None and tuple(scale.shape) != tuple(need.shape):
            raise ShapeError(f"scale: expected one per head {tuple(need.shape)}, got {tuple(scale.shape)}")
        if scale is None:
            scale = need
        elif self.saturation == "rescale":
            scale = torch.maximum(scale.float(), need)
        data, clipped = fp8_encode(x, scale[:, None, None])
        return QTensor(data, scale.float(), shape=tuple(x.shape), meta={"clipped": clipped})

    def dequantize(self, q: QTensor) -> torch.Tensor:
        check_qtensor(q)
        return q.data.float() * q.scale[:, None, None]

    def bytes_per_token(self, num_heads: int, head_dim: int) -> float:
        return 2.0 * num_heads * head_dim  # the per-head scale is per block, negligible per token

    def codec(self, spec: KVSpec, device: torch.device, layer_scales: torch.Tensor | None = None) -> FP8Codec:
        return FP8Codec(self, spec, device)


class FP8Codec(BlockCodec):
    """fp8 e4m3 blocks: ``codes [N, L, 2, H, T, D]`` (float8 bits as uint8) + ``scale [N, L, 2, H]`` fp32.

    Sealed blocks take :func:`fp8_scale` per head; a streamed block grows its per-head scale to
    :func:`fp8_block_scale` of each new token and re-encodes what it holds (an exact exponent shift)."""

    def allocate(self, n: int) -> dict[str, torch.Tensor]:
        s = self.spec
        nl, h, t, d = s.num_layers, s.num_kv_heads, s.block_size, s.head_dim
        return {
            "codes": self._zeros((n, nl, 2, h, t, d), torch.uint8),  # float8 bits
            "scale": self._zeros((n, nl, 2, h), torch.float32),
        }

    def write(self, payload, layer, kv, blocks, offsets, x):  # type: ignore[no-untyped-def]  # see BlockCodec
        """A per-(block, head) scale that grows when a new token needs more range (see :func:`fp8_block_scale`)."""
        codes, scales = payload["codes"], payload["scale"]
        need = fp8_block_scale(x.float().abs().amax(-1))  # [n, H]
        rescales = 0
        for b in blocks.unique().tolist():
            mine = blocks == b
            need_b = need[mine].amax(0)  # [H]
            if bool((offsets[mine] == 0).any()):  # the block starts here: whatever it held before is gone
                scales[b, layer, kv] = 0.0
            current = scales[b, layer, kv]
            grow = need_b > current
            if bool(grow.any()):
                new = torch.maximum(current, need_b)
                held = current > 0
                if bool((grow & held).any()):  # re-encode what the block holds under the larger scale
                    old = codes[b, layer, kv].view(torch.float8_e4m3fn).float() * current[:, None, None]
                    codes[b, layer, kv] = (old / new[:, None, None]).to(torch.float8_e4m3fn).view(torch.uint8)
                    rescales += 1
                scales[b, layer, kv] = new
        q, clipped = fp8_encode(x, scales[blocks, layer, kv][..., None])  # clipped: always 0, every scale fits
        codes[blocks, layer, kv, :, offsets] = q.view(torch.uint8)
        return clipped, rescales

    def encode(self, payload: dict[str, torch.Tensor], idx: torch.Tensor, kv: torch.Tensor) -> int:
        m, nl, _, h, t, d = kv.shape
        q = self.scheme.quantize(kv.reshape(m * nl * 2 * h, t, d))  # scales chosen to fit: nothing clips
        payload["codes"][idx] = q.data.view(torch.uint8).reshape(m, nl, 2, h, t, d)
        payload["scale"][idx] = q.scale.reshape(m, nl, 2, h)
        return q.meta["clipped"]

    def decode(self, payload: dict[str, torch.Tensor], idx: torch.Tensor, layer: int) -> torch.Tensor:
        codes = payload["codes"][idx, layer].view(torch.float8_e4m3fn).float()
        return codes * payload["scale"][idx, layer][..., None, None]

    def kernel_args(self, payload: dict[str, torch.Tensor], layer: int) -> dict[str, object]:
        """``write_kv_fp8``'s codes ``[N, H, T, D]`` uint8 and per-(block, head) scales ``[N, H]`` fp32, already
        grown (:meth:`write` grows them; the kernel only encodes, as :func:`fp8_encode`)."""
        c, s = payload["codes"][:, layer], payload["scale"][:, layer]
        return {"key_codes": c[:, 0], "value_codes": c[:, 1], "key_scale": s[:, 0], "value_scale": s[:, 1]}
