"""memos_kernels: Triton (and CUDA C++) kernels for the paged KV cache.

Empty for now: the kernels arrive with the paged-attention work. The package is installed from the
``kernels/`` folder under the import name ``memos_kernels`` (``kernels`` is taken on PyPI).
"""

__all__: list[str] = []
