"""The package's Triton kernels under one name (kept for code that imports ``memos_kernels.triton_paged``).

Each kernel story lives in its own file, told in the Triton tutorials' order (reference → kernel → wrapper →
check → benchmark): :mod:`memos_kernels.write_kv`, :mod:`memos_kernels.paged_decode`,
:mod:`memos_kernels.kivi_decode`, :mod:`memos_kernels.paged_prefill` and :mod:`memos_kernels.copy_blocks`. This
module only re-exports their wrappers.

They run natively on a CUDA GPU and, with ``TRITON_INTERPRET=1`` (set before Triton is imported), in Triton's
interpreter on CPU tensors.
"""

from __future__ import annotations

from memos_kernels.copy_blocks import copy_blocks
from memos_kernels.decode_step import DecodeStepLaunch
from memos_kernels.kivi_decode import paged_decode_attention_kivi, paged_decode_attention_kivi_packed
from memos_kernels.paged_decode import QUANT_MODES, paged_decode_attention
from memos_kernels.paged_prefill import paged_prefill_attention
from memos_kernels.write_kv import write_kv, write_kv_fp8, write_kv_int8

__all__ = [
    "QUANT_MODES",
    "DecodeStepLaunch",
    "copy_blocks",
    "paged_decode_attention",
    "paged_decode_attention_kivi",
    "paged_decode_attention_kivi_packed",
    "paged_prefill_attention",
    "write_kv",
    "write_kv_fp8",
    "write_kv_int8",
]
