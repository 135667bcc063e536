"""int8 per tensor: one symmetric scale for a whole tensor — fixed (seed 003 §6.1's ``scale=0.1``, which clips
everything beyond ±12.7) or calibrated from data (absmax / 127).

Blocks: ``codes [N, L, 2, H, T, D]`` int8; the pool keeps one scale per (layer, K/V), ``layer_scales [L, 2]``.
"""

from __future__ import annotations

import torch

from memos_ref.errors import ConfigError, ShapeError, check_type
from memos_ref.quant.base import SCALE_FLOOR, BlockCodec, QTensor, Quantizer, check_kind, check_kv_tensor, check_qtensor
from memos_ref.spec import KVSpec

__all__ = ["PerTensorInt8", "PerTensorInt8Codec"]


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
        return self.fixed if self.fixed is not None else max(float(x.abs().max()) / 127.0, SCALE_FLOOR)

    def quantize(self, x: torch.Tensor, kind: str = "key") -> QTensor:
        check_kv_tensor(x)
        check_kind(kind)
        scale = self.scale_for(x)
        data, clipped = self.encode_with(x, scale)
        return QTensor(data, torch.tensor(scale), shape=tuple(x.shape), meta={"clipped": clipped})

    def dequantize(self, q: QTensor) -> torch.Tensor:
        check_qtensor(q)
        return q.data.float() * q.scale

    def bytes_per_token(self, num_heads: int, head_dim: int) -> float:
        return 2.0 * num_heads * head_dim  # the one scale per tensor is negligible

    @staticmethod
    def encode_with(x: torch.Tensor, scale: float | torch.Tensor) -> tuple[torch.Tensor, int]:
        """int8 codes of ``x`` under ``scale`` (broadcast), and how many values clipped (beyond ±127.5·scale)."""
        scaled = x.float() / scale
        return scaled.round().clamp(-127, 127).to(torch.int8), int((scaled.abs() > 127.5).sum())

    def codec(self, spec: KVSpec, device: torch.device, layer_scales: torch.Tensor | None = None) -> PerTensorInt8Codec:
        return PerTensorInt8Codec(self, spec, device, layer_scales)


class PerTensorInt8Codec(BlockCodec):
    """int8 per tensor blocks: ``codes [N, L, 2, H, T, D]`` int8; one scale per (layer, K/V) ``layer_scales [L, 2]``
    (the scheme's fixed scale, or calibrated ones — see :func:`memos_ref.bench.accuracy.calibrate_layer_scales`)."""

    def __init__(
        self, scheme: PerTensorInt8, spec: KVSpec, device: torch.device, layer_scales: torch.Tensor | None
    ) -> None:
        super().__init__(scheme, spec, device)
        nl = spec.num_layers
        if scheme.fixed is None:
            if layer_scales is None:
                raise ConfigError("a calibrated PerTensorInt8 needs layer_scales [L, 2] (see quant.calibrate)")
            if tuple(layer_scales.shape) != (nl, 2):
                raise ShapeError(f"layer_scales must be [{nl}, 2], got {tuple(layer_scales.shape)}")
        fixed = torch.full((nl, 2), float(scheme.fixed)) if scheme.fixed is not None else layer_scales.float()
        self.layer_scales = fixed.to(device)

    def allocate(self, n: int) -> dict[str, torch.Tensor]:
        s = self.spec
        return {"codes": self._zeros((n, s.num_layers, 2, s.num_kv_heads, s.block_size, s.head_dim), torch.int8)}

    def write(self, payload, layer, kv, blocks, offsets, x):  # type: ignore[no-untyped-def]  # see BlockCodec
        codes, clipped = PerTensorInt8.encode_with(x, self.layer_scales[layer, kv])
        payload["codes"][blocks, layer, kv, :, offsets] = codes
        return clipped, 0

    def encode(self, payload: dict[str, torch.Tensor], idx: torch.Tensor, kv: torch.Tensor) -> int:
        codes, clipped = PerTensorInt8.encode_with(kv, self.layer_scales[None, :, :, None, None, None])
        payload["codes"][idx] = codes
        return clipped

    def decode(self, payload: dict[str, torch.Tensor], idx: torch.Tensor, layer: int) -> torch.Tensor:
        return payload["codes"][idx, layer].float() * self.layer_scales[layer][None, :, None, None, None]

    def kernel_args(self, payload: dict[str, torch.Tensor], layer: int) -> dict[str, object]:
        """Codes ``[N, H, T, D]`` int8 and the layer's two float scales (no kernel reads this layout yet)."""
        c = payload["codes"][:, layer]
        return {
            "key_codes": c[:, 0],
            "value_codes": c[:, 1],
            "key_scale": float(self.layer_scales[layer, 0]),
            "value_scale": float(self.layer_scales[layer, 1]),
        }
