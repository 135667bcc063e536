"""KIVI: asymmetric b-bit quantization (b = 4 or 2) — keys per *channel* over groups of ``group_size`` tokens
(key outliers live in fixed channels), values per *token* over groups of ``group_size`` channels; codes packed
two or four to a byte; scales and zero points in fp16. Blocks are kept at full precision inside the residual
window (default 128 tokens) and sealed whole.

Blocks: packed key codes ``[N, L, H, T, D·b/8]`` with fp16 scale/zero per channel per group ``[N, L, H, T/G, D]``,
packed value codes ``[N, L, H, T, D·b/8]`` with fp16 scale/zero per token per channel group ``[N, L, H, T, D/G]``.
"""

from __future__ import annotations

import torch

from memos_ref.errors import ConfigError, InvalidArgumentError, ShapeError, check_type
from memos_ref.quant.base import (
    SCALE_FLOOR,
    BlockCodec,
    QTensor,
    Quantizer,
    check_kv_tensor,
    check_qtensor,
    pack,
    unpack,
)
from memos_ref.spec import KVSpec

__all__ = ["KIVI", "KIVI_PAYLOAD", "KIVICodec"]

#: A KIVI block payload's tensors, in the order ``memos_kernels.kivi_decode`` takes them.
KIVI_PAYLOAD = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")


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
        scale = ((hi - lo) / self.levels).clamp(min=SCALE_FLOOR).to(torch.float16).clamp(min=2**-24)
        zero = lo.to(torch.float16)
        codes = ((x - zero.float()) / scale.float()).round().clamp(0, self.levels).to(torch.uint8)
        return codes, scale, zero

    def quantize(self, x: torch.Tensor, kind: str = "key") -> QTensor:
        check_kv_tensor(x)
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
        check_qtensor(q)
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

    def codec(self, spec: KVSpec, device: torch.device, layer_scales: torch.Tensor | None = None) -> KIVICodec:
        return KIVICodec(self, spec, device)


class KIVICodec(BlockCodec):
    """KIVI blocks (see the module docstring): staged at full precision and sealed whole, never streamed."""

    streams = False
    default_residual_tokens = 128

    def __init__(self, scheme: KIVI, spec: KVSpec, device: torch.device) -> None:
        super().__init__(scheme, spec, device)
        t, d = spec.block_size, spec.head_dim
        if t % scheme.group_size:
            raise ConfigError(
                f"KIVI groups of {scheme.group_size} tokens must fit whole blocks: block_size {t} is not a "
                f"multiple; use block_size={scheme.group_size} (or a multiple)"
            )
        if d % min(scheme.group_size, d) or (d * scheme.bits) % 8:
            raise ConfigError(f"head_dim {d} does not split into KIVI value groups / packed bytes")

    def allocate(self, n: int) -> dict[str, torch.Tensor]:
        s, q = self.spec, self.scheme
        nl, h, t, d = s.num_layers, s.num_kv_heads, s.block_size, s.head_dim
        packed, gk, gv = d * q.bits // 8, q.group_size, min(q.group_size, d)
        return {
            "k_codes": self._zeros((n, nl, h, t, packed), torch.uint8),
            "k_scale": self._zeros((n, nl, h, t // gk, d), torch.float16),
            "k_zero": self._zeros((n, nl, h, t // gk, d), torch.float16),
            "v_codes": self._zeros((n, nl, h, t, packed), torch.uint8),
            "v_scale": self._zeros((n, nl, h, t, d // gv), torch.float16),
            "v_zero": self._zeros((n, nl, h, t, d // gv), torch.float16),
        }

    def encode(self, payload: dict[str, torch.Tensor], idx: torch.Tensor, kv: torch.Tensor) -> int:
        m, nl, _, h, t, d = kv.shape
        qk = self.scheme.quantize(kv[:, :, 0].reshape(m * nl * h, t, d), "key")
        qv = self.scheme.quantize(kv[:, :, 1].reshape(m * nl * h, t, d), "value")
        payload["k_codes"][idx] = qk.data.reshape(m, nl, h, t, -1)
        payload["k_scale"][idx] = qk.scale.reshape(m, nl, h, -1, d)
        payload["k_zero"][idx] = qk.zero.reshape(m, nl, h, -1, d)
        payload["v_codes"][idx] = qv.data.reshape(m, nl, h, t, -1)
        payload["v_scale"][idx] = qv.scale.reshape(m, nl, h, t, -1)
        payload["v_zero"][idx] = qv.zero.reshape(m, nl, h, t, -1)
        return 0

    def decode(self, payload: dict[str, torch.Tensor], idx: torch.Tensor, layer: int) -> torch.Tensor:
        p, s = payload, self.scheme
        m, h, t, d = idx.numel(), self.spec.num_kv_heads, self.spec.block_size, self.spec.head_dim
        qk = QTensor(
            p["k_codes"][idx, layer].reshape(m * h, t, -1),
            p["k_scale"][idx, layer].reshape(m * h, -1, d),
            p["k_zero"][idx, layer].reshape(m * h, -1, d),
            shape=(m * h, t, d),
            meta={"kind": "key"},
        )
        qv = QTensor(
            p["v_codes"][idx, layer].reshape(m * h, t, -1),
            p["v_scale"][idx, layer].reshape(m * h, t, -1),
            p["v_zero"][idx, layer].reshape(m * h, t, -1),
            shape=(m * h, t, d),
            meta={"kind": "value"},
        )
        return torch.stack([s.dequantize(qk).reshape(m, h, t, d), s.dequantize(qv).reshape(m, h, t, d)], dim=1)

    def kernel_args(self, payload: dict[str, torch.Tensor], layer: int) -> dict[str, object]:
        """``kivi_decode``'s packed tensors (``memos_kernels.kivi_decode.KIVI_PAYLOAD`` names) of one layer,
        with ``bits`` and ``group_size``."""
        args: dict[str, object] = {name: payload[name][:, layer] for name in KIVI_PAYLOAD}
        return {**args, "bits": self.scheme.bits, "group_size": self.scheme.group_size}
