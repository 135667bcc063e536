"""The kernel path (issue 18 item 2): the package's forward, the engine and ``PagedCache`` write K/V with
``memos_kernels``' ``write_kv`` and attend decode steps with the kernels (plain, int8, fp8, KIVI), chosen once per
step by ``attention.step_path``; the torch reference is the oracle. Here the kernels run in Triton's interpreter
(``MEMOS_REF_KERNELS=interpret``; tests/conftest.py sets ``TRITON_INTERPRET=1`` before Triton is imported), natively
on a GPU. The interpreter is slow (about a second per decode launch), so the models are one layer deep and the
steps few."""

from __future__ import annotations

import subprocess
import sys
from typing import ClassVar

import pytest
import torch

pytest.importorskip("triton")

from memos_kernels import triton_paged

from memos_ref import attention
from memos_ref.engine import Engine, Request
from memos_ref.errors import BackendUnavailableError, KVCacheError
from memos_ref.hf import PagedCache
from memos_ref.model.llama import LlamaConfig, LlamaForward
from memos_ref.paged import PagedKV
from memos_ref.quant import FP8E4M3, KIVI, PerTensorInt8, PerTokenInt8
from memos_ref.spec import KVSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_MODE = "triton" if DEVICE == "cuda" else "interpret"
FP8_OK = DEVICE == "cpu" or torch.cuda.get_device_capability() >= (8, 9)
SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=8, num_q_heads=4)
SPEC16 = KVSpec(num_layers=1, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16, num_q_heads=4)


@pytest.fixture(scope="module")
def tiny():
    """A one-layer Llama forward with seeded random weights (2 KV heads of 16, GQA 2)."""
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16
    )
    torch.manual_seed(0)
    return LlamaForward(cfg).to(DEVICE).eval()


class Spy:
    """Counts calls of the ``memos_kernels.triton_paged`` wrappers the kernel path calls, and keeps the lengths
    (``seq_lens``) each attention launch saw."""

    LENS_ARG: ClassVar[dict[str, int]] = {
        "paged_decode_attention": 4,
        "paged_prefill_attention": 4,
        "paged_decode_attention_kivi_packed": 3,
    }

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: dict[str, int] = {}
        self.lens: list[tuple[str, list[int]]] = []
        for name in ("write_kv", "write_kv_int8", *self.LENS_ARG):
            monkeypatch.setattr(triton_paged, name, self._wrap(name, getattr(triton_paged, name)))

    def _wrap(self, name, fn):
        def spy(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            if name in self.LENS_ARG:
                self.lens.append((name, args[self.LENS_ARG[name]].tolist()))
            return fn(*args, **kwargs)

        return spy


def _forward_steps(model, kv, monkeypatch, mode):
    """Prefill 2 rows of 5 tokens, then one decode step: (logits of both steps, cache)."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", mode)
    cache = PagedCache(kv)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 5), generator=g).to(DEVICE)
    with torch.no_grad():
        first = model(ids, cache)
        second = model(first[:, -1:].argmax(-1), cache)
    return first, second, cache


def _payload(kv):
    pool = kv.pool
    return {"kv": pool.segments[0].clone()} if not pool.quantized else {k: v.clone() for k, v in pool.payload.items()}


@pytest.mark.parametrize("quant", [None, "int8"])
def test_forward_writes_with_write_kv_and_decodes_with_the_kernel(tiny, monkeypatch, quant):
    """The package forward over a PagedCache: every layer's write goes through write_kv (write_kv_int8), the
    decode step through the decode kernel, and logits and stored K/V equal the reference path's."""
    make = (lambda: {}) if quant is None else (lambda: {"quant": PerTokenInt8()})
    ref_kv = PagedKV(tiny.kv_spec(block_size=8), 8, device=DEVICE, **make())
    ref = _forward_steps(tiny, ref_kv, monkeypatch, "reference")
    spy = Spy(monkeypatch)
    kv = PagedKV(tiny.kv_spec(block_size=8), 8, device=DEVICE, **make())
    got = _forward_steps(tiny, kv, monkeypatch, KERNEL_MODE)
    write = "write_kv" if quant is None else "write_kv_int8"
    prefill = {"paged_prefill_attention": 1} if quant is None else {}  # quantized prefill: the reference
    assert spy.calls == {write: 2, "paged_decode_attention": 1, **prefill}  # prefill + decode writes, one launch each
    assert got[2]._step.notes["path"] == ("plain" if quant is None else "int8")
    atol = 1e-5 if quant is None else 2e-3  # int8: the kernel rounds exact ties half up, torch half to even
    assert torch.allclose(got[0], ref[0], atol=atol) and torch.allclose(got[1], ref[1], atol=atol)
    mine, theirs = _payload(kv), _payload(ref_kv)
    if quant is None:
        assert torch.equal(mine["kv"], theirs["kv"])  # write_kv stored exactly what the indexed store stores
    else:
        assert torch.equal(mine["scale"], theirs["scale"])
        assert int((mine["codes"].int() - theirs["codes"].int()).abs().max()) <= 1


def test_engine_decodes_rows_of_different_lengths_through_the_kernel(tiny, monkeypatch):
    """The engine's continuous batch (rows of 3 and 11 tokens) prefills each prompt with one prefill launch and
    decodes both rows in one launch per step and layer, generating what the reference generates."""
    prompts = [[1, 2, 3], [5, 9, 2, 7, 7, 1, 0, 4, 3, 8, 6]]
    outputs = {}
    spy = None
    for mode in ("reference", KERNEL_MODE):
        monkeypatch.setenv("MEMOS_REF_KERNELS", mode)
        if mode != "reference":
            spy = Spy(monkeypatch)
        kv = PagedKV(tiny.kv_spec(block_size=8), 16, device=DEVICE)
        engine = Engine(tiny, kv, max_batch=2)
        requests = [engine.submit(Request(p, 2)) for p in prompts]
        engine.run()
        outputs[mode] = [r.output for r in requests]
        assert all(r.finished and not r.failed for r in requests)
        assert kv.allocator.num_active == 0
    assert outputs[KERNEL_MODE] == outputs["reference"]
    assert spy.calls["paged_decode_attention"] == 1  # one batched decode step of both rows
    assert ("paged_decode_attention", [4, 12]) in spy.lens  # one launch saw both rows, at their own lengths
    assert ("paged_prefill_attention", [3]) in spy.lens and ("paged_prefill_attention", [11]) in spy.lens


def _attend_steps(kv, q_prefill, kv_prefill, q_decode, kv_decode):
    """Prefill then one decode step straight through PagedCache.attend (one layer)."""
    cache = PagedCache(kv)
    cache.prepare_step(q_prefill.shape[0], q_prefill.shape[2])
    cache.attend(q_prefill, *kv_prefill, 0)
    cache.prepare_step(q_decode.shape[0], 1)
    return cache.attend(q_decode, *kv_decode, 0), cache


@pytest.mark.parametrize("scheme", ["fp8", "kivi"])
def test_paged_cache_decodes_quantized_pools_with_their_kernels(monkeypatch, scheme):
    """fp8 (streaming, per-block scales) and KIVI (sealed 4-bit blocks + the staged residual window) decode
    through their kernels and equal the reference, which reads the same pool through the torch decoders."""
    if scheme == "fp8" and not FP8_OK:
        pytest.skip("fp8 kernels need sm_89+")
    g = torch.Generator().manual_seed(2)
    spec = SPEC if scheme == "fp8" else SPEC16
    b, n = 2, 3 * spec.block_size + 3  # 3 full blocks and a partial one per row
    qp, kp, vp = (torch.randn(b, h, n, 16, generator=g).to(DEVICE) for h in (4, 2, 2))
    qd, kd, vd = (torch.randn(b, h, 1, 16, generator=g).to(DEVICE) for h in (4, 2, 2))

    def make():
        if scheme == "fp8":
            return PagedKV(spec, 12, device=DEVICE, quant=FP8E4M3())
        return PagedKV(spec, 12, device=DEVICE, quant=KIVI(bits=4, group_size=16), residual_tokens=16)

    outs = {}
    for mode in ("reference", KERNEL_MODE):
        monkeypatch.setenv("MEMOS_REF_KERNELS", mode)
        spy = Spy(monkeypatch)
        kv = make()
        outs[mode], cache = _attend_steps(kv, qp, (kp, vp), qd, (kd, vd))
        if mode != "reference":
            assert cache._step.notes["path"] == scheme
            name = "paged_decode_attention" if scheme == "fp8" else "paged_decode_attention_kivi_packed"
            assert spy.calls == {name: 1}  # the pool writes itself (fp8 grows scales, KIVI stages)
            if scheme == "kivi":
                assert kv.pool.seals > 0 and kv.pool.staged_blocks > 0  # both kinds of block were read
    assert torch.allclose(outs[KERNEL_MODE], outs["reference"], atol=1e-4)


def test_paths_follow_the_pool(monkeypatch):
    """step_path: the kernels for what they can read; the reference for the rest, and always under
    MEMOS_REF_KERNELS=reference."""

    def path(mode, spec=SPEC, **kw):
        monkeypatch.setenv("MEMOS_REF_KERNELS", mode)
        cache = PagedCache(PagedKV(spec, 8, device=DEVICE, **kw))
        return attention.step_path(cache.prepare_step(1, 1))

    assert path(KERNEL_MODE) == "plain"
    assert path(KERNEL_MODE, quant=PerTokenInt8()) == "int8"
    assert path(KERNEL_MODE, quant=PerTokenInt8(), residual_tokens=8) == "reference"  # staged int8: no kernel
    assert path(KERNEL_MODE, quant=PerTensorInt8(scale=0.1)) == "reference"
    assert path(KERNEL_MODE, spec=SPEC16, quant=KIVI(bits=2, group_size=16)) == "kivi"
    odd = KVSpec(num_layers=1, num_kv_heads=2, head_dim=24, dtype=torch.float32, block_size=8, num_q_heads=4)
    assert path(KERNEL_MODE, spec=odd) == "reference"  # head_dim 24: outside the kernels' limits
    assert path("reference") == "reference"


@pytest.mark.parametrize("broken", ["write_kv", "paged_decode_attention"])
def test_a_failing_kernel_raises_a_package_error_and_the_engine_gives_blocks_back(tiny, monkeypatch, broken):
    """A Triton failure (here a RuntimeError from the launch) surfaces as BackendUnavailableError naming the
    kernel and the way around it; the engine fails the request and returns every block."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", KERNEL_MODE)

    def boom(*args, **kwargs):
        raise RuntimeError("triton launch failed")

    monkeypatch.setattr(triton_paged, broken, boom)
    kv = PagedKV(tiny.kv_spec(block_size=8), 8, device=DEVICE)
    free = kv.allocator.num_available
    engine = Engine(tiny, kv, max_batch=1)
    request = engine.submit(Request([1, 2, 3], 2))
    engine.run()
    assert request.failed and isinstance(request.error, BackendUnavailableError)
    assert isinstance(request.error, KVCacheError)
    assert broken in str(request.error) and "MEMOS_REF_KERNELS=reference" in str(request.error)
    assert kv.allocator.num_available == free and kv.allocator.num_active == 0
    kv.check()


def test_a_failed_kernel_write_changes_no_row(monkeypatch):
    """A write that fails inside the kernel leaves the step's rows counted as before (the step can be rolled
    back and retried)."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", KERNEL_MODE)
    monkeypatch.setattr(triton_paged, "write_kv", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    cache = PagedCache(PagedKV(SPEC, 4, device=DEVICE))
    step = cache.prepare_step(1, 3)
    k = torch.randn(1, 2, 3, 16, device=DEVICE)
    with pytest.raises(BackendUnavailableError, match="write_kv"):
        attention.write_step(step, 0, k, k)
    assert step.sequences[0].layer_tokens == [0] and step.written == [False]


def test_importing_the_kernels_does_not_import_transformers():
    """memos_kernels (and memos_ref.errors, all it imports of the package) load without transformers, so the
    device script runs on an image whose transformers is older than the package wants."""
    code = (
        "import sys, memos_kernels, memos_ref.errors, memos_ref; assert 'transformers' not in sys.modules, 'imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    import memos_ref

    assert memos_ref.ConcatCache.__name__ == "ConcatCache" and memos_ref.KVSpec is KVSpec  # still public, lazily
    assert set(memos_ref.__all__) <= set(dir(memos_ref))


def test_kernel_metadata_is_validated_once_per_step_not_per_layer(monkeypatch):
    """Issue 25 item 5: every layer re-validated its block tables and lengths (on a GPU a host sync per layer).
    Now the step's first call of each kernel passes ``validate=None`` (checked on the CPU, masked in the kernel
    on a GPU) and every other layer ``validate=False``; the outputs still equal the reference's."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", KERNEL_MODE)
    seen: dict[str, list] = {"write_kv": [], "paged_decode_attention": []}
    for name in seen:
        real = getattr(triton_paged, name)

        def spy(*a, _real=real, _name=name, **k):
            seen[_name].append(k.get("validate", "absent"))
            return _real(*a, **k)

        monkeypatch.setattr(triton_paged, name, spy)
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=8, num_q_heads=4)
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, h, 1, 16, generator=g).to(DEVICE) for h in (4, 2, 2))
    outs = {}
    for mode in (KERNEL_MODE, "reference"):
        monkeypatch.setenv("MEMOS_REF_KERNELS", mode)
        cache = PagedCache(PagedKV(spec, 8, device=DEVICE))
        cache.prepare_step(2, 1)
        outs[mode] = [cache.attend(q, k, v, layer) for layer in range(3)]
    assert seen == {"write_kv": [None, False, False], "paged_decode_attention": [None, False, False]}
    for got, want in zip(outs[KERNEL_MODE], outs["reference"], strict=True):
        assert torch.allclose(got, want, atol=1e-5)
