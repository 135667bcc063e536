"""TensorRT, when present: build an engine from the ONNX decode graph. Absent here (and in CI), so this module
only draws the boundary — it raises a clear error instead of failing somewhere inside."""

from __future__ import annotations

from pathlib import Path

from memos_ref.errors import BackendUnavailableError

__all__ = ["build_onnx_engine", "tensorrt_available"]


def tensorrt_available() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


def build_onnx_engine(onnx_path: str | Path, engine_path: str | Path, *, fp16: bool = True) -> Path:
    """Build a serialized TensorRT engine from ``onnx_path`` (the same as ``trtexec --onnx=… --saveEngine=…``)."""
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise BackendUnavailableError(
            f"TensorRT is not installed here; on the Jetson run: trtexec --onnx={onnx_path} "
            f"--saveEngine={engine_path}{' --fp16' if fp16 else ''} --skipInference"
        ) from exc
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(Path(onnx_path).read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BackendUnavailableError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    engine = builder.build_serialized_network(network, config)
    if engine is None:  # TensorRT reports a failed build by returning None (its log says why)
        raise BackendUnavailableError(
            f"TensorRT could not build an engine from {onnx_path} (see the TensorRT log above); try "
            f"trtexec --onnx={onnx_path} --verbose --skipInference on the device"
        )
    Path(engine_path).write_bytes(bytes(engine))
    return Path(engine_path)
