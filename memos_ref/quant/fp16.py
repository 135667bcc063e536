"""fp16: a plain cast, the "FP16 cache" of seed 001 §4.1 for an fp32 model — half the bytes, no scales.

Blocks: ``codes [N, L, 2, H, T, D]`` float16; the kernels' plain cache layout per layer.
"""

from __future__ import annotations

import torch

from memos_ref.quant.base import BlockCodec, QTensor, Quantizer, check_kind, check_kv_tensor, check_qtensor
from memos_ref.spec import KVSpec

__all__ = ["Float16", "Float16Codec"]


class Float16(Quantizer):
    """A plain fp16 cast (seed 001 §4.1's "FP16 cache" for an fp32 model): half the bytes, no scales."""

    name = "fp16"
    bits = 16

    def quantize(self, x: torch.Tensor, kind: str = "key") -> QTensor:
        check_kv_tensor(x)
        check_kind(kind)
        return QTensor(x.to(torch.float16), torch.tensor(1.0), shape=tuple(x.shape))

    def dequantize(self, q: QTensor) -> torch.Tensor:
        check_qtensor(q)
        return q.data.float()

    def bytes_per_token(self, num_heads: int, head_dim: int) -> float:
        return 4.0 * num_heads * head_dim

    def codec(self, spec: KVSpec, device: torch.device, layer_scales: torch.Tensor | None = None) -> Float16Codec:
        return Float16Codec(self, spec, device)


class Float16Codec(BlockCodec):
    """fp16 blocks: ``codes [N, L, 2, H, T, D]``."""

    def allocate(self, n: int) -> dict[str, torch.Tensor]:
        s = self.spec
        return {"codes": self._zeros((n, s.num_layers, 2, s.num_kv_heads, s.block_size, s.head_dim), torch.float16)}

    def write(self, payload, layer, kv, blocks, offsets, x):  # type: ignore[no-untyped-def]  # see BlockCodec
        payload["codes"][blocks, layer, kv, :, offsets] = x.to(torch.float16)
        return 0, 0

    def encode(self, payload: dict[str, torch.Tensor], idx: torch.Tensor, kv: torch.Tensor) -> int:
        payload["codes"][idx] = kv.to(torch.float16)
        return 0

    def decode(self, payload: dict[str, torch.Tensor], idx: torch.Tensor, layer: int) -> torch.Tensor:
        return payload["codes"][idx, layer].float()

    def kernel_args(self, payload: dict[str, torch.Tensor], layer: int) -> dict[str, object]:
        """``write_kv``/``paged_decode``'s ``key_cache``/``value_cache [N, H, T, D]`` (fp16)."""
        return {"key_cache": payload["codes"][:, layer, 0], "value_cache": payload["codes"][:, layer, 1]}
