"""memos_edge: the NVIDIA Jetson Orin export path (memory planner, TensorRT-LLM checkpoint, ONNX paged decode).

Empty for now. The package is installed from the ``edge/`` folder under the import name ``memos_edge``
(``edge`` is taken on PyPI). Nothing in ``memos_ref`` depends on it.
"""

__all__: list[str] = []
