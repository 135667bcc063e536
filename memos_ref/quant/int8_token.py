"""int8 per token: a symmetric scale per (head, token) — one outlier spoils only its own token.

Blocks: ``codes [N, L, 2, H, T, D]`` int8 + ``scale [N, L, 2, H, T]`` fp16 (absmax / 127, rounded to fp16);
streamed token by token, or staged and sealed behind a residual window.
"""

from __future__ import annotations

import torch

from memos_ref.errors import InvalidArgumentError
from memos_ref.quant.base import SCALE_FLOOR, BlockCodec, QTensor, Quantizer, check_kind, check_kv_tensor, check_qtensor
from memos_ref.spec import KVSpec

__all__ = ["PerTokenInt8", "PerTokenInt8Codec"]


class PerTokenInt8(Quantizer):
    """Symmetric int8 with an fp16 scale per (head, token)."""

    name = "int8_token"
    bits = 8

    @staticmethod
    def scales(x: torch.Tensor) -> torch.Tensor:
        """fp16 scales ``[..., T]`` (absmax over channels / 127); quantize with exactly these."""
        return (x.float().abs().amax(-1) / 127.0).clamp(min=SCALE_FLOOR).to(torch.float16).clamp(min=2**-24)

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
        check_kv_tensor(x)
        check_kind(kind)
        self.check_range(x, kind)
        scale = self.scales(x)  # [H, T]
        return QTensor(self.encode_with(x, scale), scale, shape=tuple(x.shape))

    def dequantize(self, q: QTensor) -> torch.Tensor:
        check_qtensor(q)
        return q.data.float() * q.scale.float()[..., None]

    def bytes_per_token(self, num_heads: int, head_dim: int) -> float:
        return 2.0 * num_heads * (head_dim + 2)

    @staticmethod
    def encode_with(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """int8 codes of ``x [..., D]`` under fp16 scales ``[...]`` (from :meth:`scales`): round half to even."""
        return (x.float() / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8)

    def codec(self, spec: KVSpec, device: torch.device, layer_scales: torch.Tensor | None = None) -> PerTokenInt8Codec:
        return PerTokenInt8Codec(self, spec, device)


class PerTokenInt8Codec(BlockCodec):
    """int8 per token blocks: ``codes [N, L, 2, H, T, D]`` int8 + ``scale [N, L, 2, H, T]`` fp16."""

    def allocate(self, n: int) -> dict[str, torch.Tensor]:
        s = self.spec
        nl, h, t, d = s.num_layers, s.num_kv_heads, s.block_size, s.head_dim
        return {
            "codes": self._zeros((n, nl, 2, h, t, d), torch.int8),
            "scale": self._zeros((n, nl, 2, h, t), torch.float16),
        }

    def check_values(self, x: torch.Tensor, what: str) -> None:
        PerTokenInt8.check_range(x, what)

    def write(self, payload, layer, kv, blocks, offsets, x):  # type: ignore[no-untyped-def]  # see BlockCodec
        scale = PerTokenInt8.scales(x)  # [n, H]
        payload["codes"][blocks, layer, kv, :, offsets] = PerTokenInt8.encode_with(x, scale)
        payload["scale"][blocks, layer, kv, :, offsets] = scale
        return 0, 0

    def encode(self, payload: dict[str, torch.Tensor], idx: torch.Tensor, kv: torch.Tensor) -> int:
        m, nl, _, h, t, d = kv.shape
        q = self.scheme.quantize(kv.reshape(m * nl * 2 * h, t, d))
        payload["codes"][idx] = q.data.reshape(m, nl, 2, h, t, d)
        payload["scale"][idx] = q.scale.reshape(m, nl, 2, h, t)
        return 0

    def decode(self, payload: dict[str, torch.Tensor], idx: torch.Tensor, layer: int) -> torch.Tensor:
        return payload["codes"][idx, layer].float() * payload["scale"][idx, layer].float()[..., None]

    def kernel_args(self, payload: dict[str, torch.Tensor], layer: int) -> dict[str, object]:
        """``write_kv_int8``'s codes ``[N, H, T, D]`` int8 and scales ``[N, H, T]`` fp16 (same scale law; the
        kernel rounds ties half up, torch half to even)."""
        c, s = payload["codes"][:, layer], payload["scale"][:, layer]
        return {"key_codes": c[:, 0], "value_codes": c[:, 1], "key_scale": s[:, 0], "value_scale": s[:, 1]}
