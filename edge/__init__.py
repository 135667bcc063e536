"""memos_edge: the NVIDIA Jetson Orin path — memory planner (:mod:`.plan`), TensorRT-LLM v0.12 checkpoint
export (:mod:`.export_trtllm`), build and run commands (:mod:`.build_config`), the pool-layout bridge
(:mod:`.layout`) and an ONNX graph of one paged decode step (:mod:`.export_onnx`). See ``edge/README.md``.

Installed from the ``edge/`` folder under the import name ``memos_edge``. Nothing in ``memos_ref`` depends on it.
"""

__all__: list[str] = []
