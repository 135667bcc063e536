"""KV quantizers, by their former one-file home: each scheme now lives in its own module with its block codec —
:mod:`~memos_ref.quant.fp16`, :mod:`~memos_ref.quant.int8_tensor`, :mod:`~memos_ref.quant.int8_token`,
:mod:`~memos_ref.quant.fp8` (with the one fp8 scale law), :mod:`~memos_ref.quant.kivi`; shared parts in
:mod:`~memos_ref.quant.base`. Kept so that ``memos_ref.quant.schemes`` imports keep working.

Every scheme works on one layer's keys or values in the pool's head-major order, ``x [H, T, D]`` (heads,
tokens, channels), and returns a :class:`QTensor` — the stored integer or fp8 codes plus their scales — whose
``nbytes`` is exactly what the cache holds. ``dequantize`` returns float32.
"""

from __future__ import annotations

from memos_ref.quant.base import BlockCodec, QTensor, Quantizer, fitting_scale, pack, unpack
from memos_ref.quant.fp8 import FP8_MAX, FP8E4M3, fp8_block_scale, fp8_encode, fp8_scale
from memos_ref.quant.fp16 import Float16
from memos_ref.quant.int8_tensor import PerTensorInt8
from memos_ref.quant.int8_token import PerTokenInt8
from memos_ref.quant.kivi import KIVI

__all__ = [
    "FP8E4M3",
    "FP8_MAX",
    "KIVI",
    "BlockCodec",
    "Float16",
    "PerTensorInt8",
    "PerTokenInt8",
    "QTensor",
    "Quantizer",
    "fitting_scale",
    "fp8_block_scale",
    "fp8_encode",
    "fp8_scale",
    "pack",
    "unpack",
]
