"""memos_kernels: Triton (and CUDA C++) kernels that read the paged KV pool in place, through block tables.

One kernel story per file, each in the Triton tutorials' order — reference (plain torch) → kernel (``@triton.jit``)
→ wrapper (shape/dtype checks, launch) → check (kernel against reference) → benchmark:

* :mod:`~memos_kernels.write_kv` — reshape-and-cache, plain, int8 and fp8;
* :mod:`~memos_kernels.paged_decode` — split-K decode attention and its reduce (float, int8, fp8 blocks);
* :mod:`~memos_kernels.kivi_decode` — decode over KIVI's packed 4/2-bit blocks and residual window;
* :mod:`~memos_kernels.paged_prefill` — chunked prefill through the decode kernels;
* :mod:`~memos_kernels.copy_blocks` — block copies for copy-on-write and compaction.

:mod:`~memos_kernels.common` holds the shared layout checks, :mod:`~memos_kernels.launch_plan` every launch's
configuration and the enumeration of the launches the package can make, :mod:`~memos_kernels.decode_launch` the
decode wrappers' input checks and split-K plan, :mod:`~memos_kernels.timing` the one timer,
:mod:`~memos_kernels.triton_paged` re-exports every wrapper, :mod:`~memos_kernels.bench` is the GPU benchmark,
:mod:`~memos_kernels.aot_check` compiles every kernel for a GPU target without one, and
:mod:`~memos_kernels.cuda` is the decode kernel in CUDA C++. The package imports nothing from ``memos_ref`` but
its errors. It is installed from the ``kernels/`` folder under the import name ``memos_kernels`` (``kernels`` is
taken on PyPI); importing it does not import Triton.
"""

__all__: list[str] = []
