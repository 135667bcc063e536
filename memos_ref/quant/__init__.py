"""KV-cache quantization: quantizers (int8 per tensor and per token, fp8 e4m3, KIVI 4/2-bit), the quantized
paged pool (streaming writes, or a full-precision residual window sealed into codes — mixed-precision aging),
and calibration of static per-tensor scales. Accuracy: ``python -m memos_ref.bench quant``; notebook 07."""

from memos_ref.quant.pool import QuantizedBlockPool
from memos_ref.quant.schemes import (
    FP8E4M3,
    KIVI,
    Float16,
    PerTensorInt8,
    PerTokenInt8,
    QTensor,
    Quantizer,
    pack,
    unpack,
)

__all__ = [
    "FP8E4M3",
    "KIVI",
    "Float16",
    "PerTensorInt8",
    "PerTokenInt8",
    "QTensor",
    "QuantizedBlockPool",
    "Quantizer",
    "pack",
    "unpack",
]
