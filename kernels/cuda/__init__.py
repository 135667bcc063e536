"""The CUDA C++ paged decode kernel (``paged_decode.cu``): loaded as a torch extension when CUDA is present."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from memos_ref.errors import BackendUnavailableError, DeviceError, DTypeError, ShapeError

__all__ = ["SOURCE", "load", "paged_decode"]

SOURCE = Path(__file__).with_name("paged_decode.cu")

_BINDING = r"""
#include <torch/extension.h>
#include <cuda_fp16.h>
#include <c10/cuda/CUDAStream.h>
extern "C" int memos_paged_decode_f32(const float*, const float*, const float*, const int64_t*, const int64_t*,
    float*, int, int, int, int, int, int, int64_t, int64_t, int64_t, float, cudaStream_t);
extern "C" int memos_paged_decode_f16(const __half*, const __half*, const __half*, const int64_t*, const int64_t*,
    __half*, int, int, int, int, int, int, int64_t, int64_t, int64_t, float, cudaStream_t);
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables,
                           torch::Tensor lens, double scale) {
  auto out = torch::empty_like(q);
  auto stream = c10::cuda::getCurrentCUDAStream();
  int rc;
  if (q.scalar_type() == torch::kFloat) {
    rc = memos_paged_decode_f32(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
        tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(), q.size(0), q.size(1),
        k.size(1), k.size(3), k.size(2), tables.size(1), k.stride(0), k.stride(1), k.stride(2), scale, stream);
  } else {
    rc = memos_paged_decode_f16(reinterpret_cast<const __half*>(q.data_ptr<at::Half>()),
        reinterpret_cast<const __half*>(k.data_ptr<at::Half>()),
        reinterpret_cast<const __half*>(v.data_ptr<at::Half>()),
        tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), reinterpret_cast<__half*>(out.data_ptr<at::Half>()),
        q.size(0), q.size(1), k.size(1), k.size(3), k.size(2), tables.size(1), k.stride(0), k.stride(1), k.stride(2),
        scale, stream);
  }
  TORCH_CHECK(rc == 0, "memos paged decode kernel failed: ", rc);
  return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
"""


@functools.cache
def load() -> Any:
    """Compile and load the extension (needs CUDA and nvcc; cached by torch after the first build)."""
    if not torch.cuda.is_available():
        raise BackendUnavailableError("the CUDA kernel needs a CUDA device; the Triton kernels or the reference run")
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="memos_paged_decode",
        cpp_sources="",
        cuda_sources=[SOURCE.read_text(), _BINDING],
        with_cuda=True,
        extra_cuda_cflags=["-O3"],
    )


def paged_decode(query, key_cache, value_cache, block_tables, seq_lens, scale: float | None = None):
    """Decode attention ``[B, Hq, D]`` over caches ``[N, H, T, D]`` with the CUDA C++ kernel: a minimal teaching
    kernel (one thread block per query head, no split-K), fp32 and fp16 only — the Triton kernel
    (:func:`memos_kernels.paged_decode.paged_decode_attention`) is the fast path and the one for bf16."""
    import math

    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    if query.dtype not in (torch.float32, torch.float16) or key_cache.dtype != query.dtype:
        raise DTypeError(
            f"the CUDA C++ kernel takes fp32 or fp16 queries and caches of the same dtype, got {query.dtype} and "
            f"{key_cache.dtype}: use the Triton kernel for bf16"
        )
    if len({query.device, key_cache.device, value_cache.device, block_tables.device, seq_lens.device}) != 1:
        raise DeviceError("query, caches, block tables and lengths must be on one CUDA device")
    if key_cache.stride() != value_cache.stride():
        raise ShapeError("key and value caches must have the same strides (two views of one pool)")
    return load().paged_decode(
        query.contiguous(),
        key_cache,
        value_cache,
        block_tables.long().contiguous(),  # the kernel indexes rows as b · max_blocks + i
        seq_lens.long().contiguous(),
        float(scale),
    )
