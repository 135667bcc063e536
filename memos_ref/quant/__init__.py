"""KV-cache quantization: quantizers (int8 per tensor and per token, fp8 e4m3, KIVI 4/2-bit), the quantized
paged pool (streaming writes, or a full-precision residual window sealed into codes — mixed-precision aging),
and the block codec of each scheme (the interface, :class:`BlockCodec`, and what the pool asks of a scheme,
:class:`BlockScheme`, sit in :mod:`~memos_ref.quant.codec`, below both). Accuracy and calibration of static
per-tensor scales (they run a model): :mod:`memos_ref.bench.accuracy`, ``python -m memos_ref.bench quant``;
notebook 07."""

from memos_ref.quant.base import QTensor, Quantizer, fitting_scale, pack, unpack
from memos_ref.quant.codec import BlockCodec, BlockScheme
from memos_ref.quant.fp8 import FP8_MAX, FP8E4M3, FP8Codec, fp8_block_scale, fp8_encode, fp8_scale
from memos_ref.quant.fp16 import Float16, Float16Codec
from memos_ref.quant.int8_tensor import PerTensorInt8, PerTensorInt8Codec
from memos_ref.quant.int8_token import PerTokenInt8, PerTokenInt8Codec
from memos_ref.quant.kivi import KIVI, KIVI_PAYLOAD, KIVICodec
from memos_ref.quant.pool import QuantizedBlockPool

__all__ = [
    "FP8E4M3",
    "FP8_MAX",
    "KIVI",
    "KIVI_PAYLOAD",
    "BlockCodec",
    "BlockScheme",
    "FP8Codec",
    "Float16",
    "Float16Codec",
    "KIVICodec",
    "PerTensorInt8",
    "PerTensorInt8Codec",
    "PerTokenInt8",
    "PerTokenInt8Codec",
    "QTensor",
    "QuantizedBlockPool",
    "Quantizer",
    "fitting_scale",
    "fp8_block_scale",
    "fp8_encode",
    "fp8_scale",
    "pack",
    "unpack",
]
