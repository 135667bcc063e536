"""The ONNX paged-decode graph, run in onnxruntime, against the package's forward over a multi-step generation
of two sequences of different lengths sharing one pool."""

from __future__ import annotations

import os

import pytest
import torch

try:
    import onnxruntime  # noqa: F401
except ImportError:  # pragma: no cover - the dev install includes the edge extra
    if os.environ.get("CI"):
        raise
    pytest.skip("the edge extra (onnx, onnxruntime, onnxscript) is not installed", allow_module_level=True)

from memos_edge.export_onnx import export, run_onnx

from memos_ref.errors import ConfigError
from memos_ref.hf import PagedCache
from memos_ref.model import load_model
from memos_ref.paged import PagedKV


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    model = load_model()
    return model, export(model, tmp_path_factory.mktemp("onnx") / "decode.onnx", batch=2, blocks=16, max_blocks=6)


def test_onnx_decode_equals_the_package_forward(graph):
    model, path = graph
    kv = PagedKV(model.kv_spec(block_size=16), 16, prefix_caching=False)
    prompts = [list(b"def reverse(s):\n    return "), list(b"import os\nfor name in os.listdir('.'):\n    print(")]
    caches = [PagedCache(kv) for _ in prompts]
    tokens = []
    with torch.no_grad():
        for cache, ids in zip(caches, prompts):
            tokens.append(int(model(torch.tensor([ids]), cache)[0, -1].argmax()))
    worst = 0.0
    for _ in range(6):
        seqs = [c.sequences[0] for c in caches]
        lens = torch.tensor([s.num_tokens for s in seqs])
        tables = torch.tensor([s.block_table + [0] * (6 - len(s.block_table)) for s in seqs])
        pool_before = kv.pool.tensor.clone()
        logits, new_kv = run_onnx(path, torch.tensor([[t] for t in tokens]), lens, pool_before, tables, lens)
        logits, new_kv = torch.from_numpy(logits), torch.from_numpy(new_kv)  # [2, V], [2, L, 2, H, D]
        with torch.no_grad():
            refs = [model(torch.tensor([[t]]), c)[0, -1] for t, c in zip(tokens, caches)]
        for b, (seq, ref) in enumerate(zip(seqs, refs)):
            worst = max(worst, float((logits[b] - ref).abs().max()))
            for layer in range(4):  # the runtime's contract: new_kv is what the step appends at position len
                k, v = seq.to_dense(layer)
                assert torch.allclose(new_kv[b, layer, 0], k[:, -1], atol=1e-5)
                assert torch.allclose(new_kv[b, layer, 1], v[:, -1], atol=1e-5)
        tokens = [int(r.argmax()) for r in refs]
    assert worst < 1e-4


def test_export_refuses_a_table_wider_than_the_pool():
    with pytest.raises(ConfigError, match="exceeds the pool"):
        export(load_model(), "/nonexistent/x.onnx", blocks=4, max_blocks=8)


def test_tensorrt_boundary(graph, tmp_path):
    from memos_edge.trt import build_onnx_engine, tensorrt_available

    from memos_ref.errors import BackendUnavailableError

    if tensorrt_available():
        pytest.skip("TensorRT is installed: build and time the engine on the device (edge/README.md)")
    with pytest.raises(BackendUnavailableError, match="trtexec --onnx="):
        build_onnx_engine(graph[1], tmp_path / "decode.plan")
