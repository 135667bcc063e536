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


# ---------------------------------------------------------------------- issue 16 item 6
def test_opset_is_pinned_to_tensorrt_10_3s(graph):
    import onnx
    from memos_edge.export_onnx import OPSET

    proto = onnx.load(str(graph[1]), load_external_data=False)
    assert OPSET == 20 and {o.domain: o.version for o in proto.opset_import}[""] == OPSET  # before: unpinned


def test_onnx_generate_feeds_new_kv_back_and_equals_the_package(graph):
    from memos_edge.export_onnx import onnx_generate

    model, path = graph
    prompts = [list(b"def add(a, b):\n    return "), list(b"for i in range(9):\n   prin")]
    assert len(prompts[0]) == len(prompts[1])
    got = onnx_generate(path, model, prompts, 6, blocks=16)
    for prompt, tokens in zip(prompts, got):
        kv = PagedKV(model.kv_spec(block_size=16), 8, prefix_caching=False)
        cache, ids, want = PagedCache(kv), torch.tensor([prompt]), []
        with torch.no_grad():
            for _ in range(6):
                want.append(int(model(ids, cache)[0, -1].argmax()))
                ids = torch.tensor([[want[-1]]])
        assert tokens == want
    with pytest.raises(ConfigError, match="one length"):
        onnx_generate(path, model, [prompts[0], prompts[1][:-1]], 2, blocks=16)


def test_large_models_get_external_data(monkeypatch, tmp_path):
    import memos_edge.export_onnx as mod

    seen = []
    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: seen.append(k))
    model = load_model()
    mod.export(model, tmp_path / "a.onnx", blocks=4, max_blocks=2)
    monkeypatch.setattr(mod, "EXTERNAL_DATA_BYTES", 0)  # as if the weights were over protobuf's 2 GB
    mod.export(model, tmp_path / "b.onnx", blocks=4, max_blocks=2)
    assert [k["external_data"] for k in seen] == [False, True]  # before: always False
    assert all(k["opset_version"] == mod.OPSET for k in seen)


def test_a_failed_tensorrt_build_is_a_package_error(monkeypatch, tmp_path):
    # TensorRT's build_serialized_network returns None when the build fails; before, bytes(None) raised TypeError
    import types

    from memos_edge.trt import build_onnx_engine

    from memos_ref.errors import BackendUnavailableError

    class Anything:
        def __init__(self, *a, **k):
            pass

        def __getattr__(self, name):
            return lambda *a, **k: self

        def parse(self, data):
            return True

        def build_serialized_network(self, network, config):
            return None

    fake = types.SimpleNamespace(Logger=Anything, Builder=Anything, OnnxParser=Anything, BuilderFlag=Anything())
    fake.Logger.WARNING = 0
    monkeypatch.setitem(__import__("sys").modules, "tensorrt", fake)
    (tmp_path / "g.onnx").write_bytes(b"graph")
    with pytest.raises(BackendUnavailableError, match="could not build"):
        build_onnx_engine(tmp_path / "g.onnx", tmp_path / "g.plan")
    assert not (tmp_path / "g.plan").exists()
