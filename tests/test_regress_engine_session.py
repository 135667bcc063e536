"""Regressions of issue 13, items 9 (one model identity), 14 (engine faults), 15 (session load) and 16
(package errors on wrong argument types, use after close) for the engine, the sessions and the model."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import memos_ref.attention as attention_mod
import memos_ref.session as session_mod
from memos_ref.engine import GREEDY_TEMPERATURE, Engine, Request
from memos_ref.errors import (
    ArgumentTypeError,
    CorruptCacheError,
    DTypeError,
    InvalidArgumentError,
    KVCacheError,
    ModelMismatchError,
    StagingFullError,
    StateError,
    UseAfterFreeError,
)
from memos_ref.hf import PagedCache
from memos_ref.model import load_hf_model, model_fingerprint, shipped_model_dir
from memos_ref.model.identity import fingerprint
from memos_ref.model.tokenizer import ByteTokenizer
from memos_ref.paged import PagedKV
from memos_ref.session import SegmentKind, SessionManager, manifest_checksum

tok = ByteTokenizer()


# ====================================================================== item 9: one model identity
def test_same_model_same_fingerprint_by_every_route(shipped_pair):
    ours, hf = shipped_pair
    expected = fingerprint(ours)
    routes = {
        "default (shipped)": fingerprint(),
        "folder str": fingerprint(str(shipped_model_dir())),
        "folder Path": fingerprint(shipped_model_dir()),
        "transformers model": fingerprint(hf),
        "model_fingerprint()": model_fingerprint(),
        "model_fingerprint(model)": model_fingerprint(ours),
        "SessionManager.fingerprint_of": SessionManager.fingerprint_of(ours),
        "SessionManager default": SessionManager(ours, num_blocks=8).fingerprint,
        "SessionManager prefix hashes": SessionManager(ours, num_blocks=8).kv.prefix_cache.fingerprint,
    }
    assert routes == dict.fromkeys(routes, expected)
    assert len(expected) == 16 and int(expected, 16) >= 0


@pytest.mark.parametrize("family", ["llama-tied", "gpt2"])
def test_fingerprint_routes_agree_for_tied_and_other_families(tmp_path, family):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0)
        )
    else:
        cfg = LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=100,
            tie_word_embeddings=True,
        )
        model = LlamaForCausalLM(cfg)
    model.eval().save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    ids = {fingerprint(model), fingerprint(reloaded), fingerprint(tmp_path)}
    if family == "llama-tied":
        from memos_ref.model import load_model

        ids.add(fingerprint(load_model(tmp_path)))
    assert len(ids) == 1


@settings(max_examples=10, deadline=None)
@given(
    name_index=st.integers(0, 38),
    flat_index=st.integers(0, 10**9),
    delta=st.sampled_from([1e-3, -0.5, 2.0]),
)
def test_any_changed_weight_changes_the_fingerprint(shipped_pair, name_index, flat_index, delta):
    ours, _ = shipped_pair
    base = fingerprint(ours)
    changed = copy.deepcopy(ours)
    name, tensor = sorted(changed.state_dict().items())[name_index % len(changed.state_dict())]
    with torch.no_grad():
        tensor.view(-1)[flat_index % tensor.numel()] += delta
    assert fingerprint(changed) != base, name


def test_dtype_and_config_changes_change_the_fingerprint(shipped_pair):
    ours, _ = shipped_pair
    base = fingerprint(ours)
    as_bf16 = copy.deepcopy(ours).to(torch.bfloat16)
    other_theta = copy.deepcopy(ours)
    other_theta.config = dataclasses.replace(ours.config, rope_theta=500000.0)  # same weights, other model
    other_eps = copy.deepcopy(ours)
    other_eps.config = dataclasses.replace(ours.config, rms_norm_eps=1e-6)
    ids = [base, fingerprint(as_bf16), fingerprint(other_theta), fingerprint(other_eps)]
    assert len(set(ids)) == 4
    # the config's dtype note is not an identity: the tensors carry the dtype
    relabelled = copy.deepcopy(ours)
    relabelled.config = dataclasses.replace(ours.config, dtype="bfloat16")
    assert fingerprint(relabelled) == base


def test_session_saved_with_one_route_loads_with_another(shipped_pair, tmp_path):
    ours, _ = shipped_pair
    default = SessionManager(ours, num_blocks=64)  # fingerprint computed from the model object
    session = default.new_session()
    session.append(SegmentKind.USER, "u", "def f(x):\n")
    path = session.save(tmp_path / "s")
    by_folder = SessionManager(ours, num_blocks=64, fingerprint=model_fingerprint(shipped_model_dir()))
    restored = by_folder.load(path)
    assert restored.token_ids == session.token_ids
    # and back: saved by the folder-fingerprinted manager, loaded by a default one
    path2 = restored.save(tmp_path / "s2")
    assert SessionManager(ours, num_blocks=64).load(path2).token_ids == session.token_ids


def test_tier_store_keyed_by_model_fingerprint_accepts_a_default_session_pool(shipped_pair):
    from memos_ref.tiering.backends import HostMemoryBackend
    from memos_ref.tiering.manager import TierManager
    from memos_ref.tiering.store import Tier, TierStore

    ours, _ = shipped_pair
    manager = SessionManager(ours, num_blocks=32)
    store = TierStore([Tier(HostMemoryBackend(1 << 20))], spec=manager.spec, fingerprint=model_fingerprint())
    TierManager(manager.kv, store)  # refused with ConfigError when the two fingerprints differ


def test_fingerprint_refuses_what_is_not_a_model(tmp_path):
    with pytest.raises(ArgumentTypeError, match="expected a model"):
        fingerprint(42)
    with pytest.raises(KVCacheError, match=r"config\.json"):
        fingerprint(tmp_path)  # an empty folder


# ====================================================================== item 14: the engine
PROMPTS = [
    tok.encode("def load(path):\n", add_bos=True),
    tok.encode("class Store:\n    def __init__(self):\n", add_bos=True),
    tok.encode("import json\nx = ", add_bos=True),
]
N_NEW = 9


def _engine(model: Any, num_blocks: int = 64) -> Engine:
    return Engine(model, PagedKV(model.kv_spec(block_size=8), num_blocks), max_batch=3)


@pytest.fixture(scope="module")
def solo_outputs(shipped_pair) -> list[list[int]]:
    """Each prompt generated alone (greedy) on its own engine: the oracle of the fault tests."""
    ours, _ = shipped_pair
    outs = []
    for prompt in PROMPTS:
        engine = _engine(ours)
        request = engine.submit(Request(prompt, N_NEW))
        engine.run()
        outs.append(request.output)
    return outs


BAD_REQUESTS = [
    ("out-of-vocabulary token", lambda v: Request([1, v], 3), InvalidArgumentError),
    ("negative token", lambda v: Request([1, -1], 3), InvalidArgumentError),
    ("float token", lambda v: Request([1, 2.0], 3), ArgumentTypeError),
    ("bool token", lambda v: Request([True], 3), ArgumentTypeError),
    ("empty prompt", lambda v: Request([], 3), InvalidArgumentError),
    ("prompt is a str", lambda v: Request("abc", 3), ArgumentTypeError),
    ("max_new_tokens 0", lambda v: Request([1], 0), InvalidArgumentError),
    ("max_new_tokens float", lambda v: Request([1], 2.5), ArgumentTypeError),
    ("temperature NaN", lambda v: Request([1], 3, temperature=float("nan")), InvalidArgumentError),
    ("temperature inf", lambda v: Request([1], 3, temperature=float("inf")), InvalidArgumentError),
    ("temperature negative", lambda v: Request([1], 3, temperature=-0.5), InvalidArgumentError),
    ("temperature str", lambda v: Request([1], 3, temperature="1"), ArgumentTypeError),
    ("seed negative", lambda v: Request([1], 3, seed=-1), InvalidArgumentError),
    ("stop id out of vocabulary", lambda v: Request([1], 3, stop_ids=(v,)), InvalidArgumentError),
    ("not a request", lambda v: "def f():", ArgumentTypeError),
]


@pytest.mark.parametrize(("what", "make", "error"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_requests_are_refused_at_submission_and_nothing_is_queued(shipped_pair, what, make, error):
    ours, _ = shipped_pair
    engine = _engine(ours)
    vocab = ours.config.vocab_size
    with pytest.raises(error) as info:
        engine.submit(make(vocab))
    assert "expected" in str(info.value), what
    assert not engine.waiting and not engine.running and not engine.finished
    good = engine.submit(Request(PROMPTS[0], 3))  # the engine is not wedged
    assert engine.run() == [good] and not good.failed


def test_a_request_mutated_after_submission_fails_alone_and_the_engine_keeps_serving(shipped_pair, solo_outputs):
    ours, _ = shipped_pair
    engine = _engine(ours)
    start = engine.kv.allocator.num_available
    good = engine.submit(Request(PROMPTS[0], N_NEW))
    bad = engine.submit(Request(PROMPTS[1], N_NEW))
    bad.prompt.append(ours.config.vocab_size + 5)  # bypasses submission's checks: the forward refuses it
    engine.run()
    assert bad.failed and isinstance(bad.error, InvalidArgumentError) and bad.finished
    assert good.output == solo_outputs[0] and not good.failed
    assert engine.kv.allocator.num_available == start and engine.kv.allocator.num_active == 0
    again = engine.submit(Request(PROMPTS[2], N_NEW))  # later run() calls work
    engine.run()
    assert again.output == solo_outputs[2]


def test_resubmitting_a_request_is_refused(shipped_pair):
    ours, _ = shipped_pair
    engine = _engine(ours)
    request = engine.submit(Request(PROMPTS[0], 2))
    with pytest.raises(StateError, match="already submitted"):
        engine.submit(request)
    engine.run()
    with pytest.raises(StateError, match="already submitted"):
        engine.submit(request)
    assert len(engine.finished) == 1


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 1e-30, GREEDY_TEMPERATURE / 2, 0.0])
def test_vanishing_temperature_is_greedy_and_leaks_nothing(shipped_pair, solo_outputs, temperature):
    ours, _ = shipped_pair
    engine = _engine(ours)
    request = engine.submit(Request(PROMPTS[0], N_NEW, temperature=temperature, seed=3))
    engine.run()
    assert not request.failed and request.output == solo_outputs[0]
    assert engine.kv.allocator.num_active == 0


def test_small_temperature_above_the_greedy_threshold_samples_without_nan(shipped_pair):
    ours, _ = shipped_pair
    engine = _engine(ours)
    requests = [engine.submit(Request(p, N_NEW, temperature=GREEDY_TEMPERATURE * 2, seed=1)) for p in PROMPTS]
    engine.run()
    for r in requests:
        assert not r.failed and len(r.output) == N_NEW and all(0 <= t < ours.config.vocab_size for t in r.output)


class _Boom(RuntimeError):
    """The injected fault."""


def _is_bad(seq, bad_prompt: list[int]) -> bool:
    return seq.token_ids[: len(bad_prompt)] == bad_prompt


def _inject(stage: str, engine: Engine, monkeypatch, bad_prompt: list[int]) -> None:
    """Make one request fail at ``stage``; every other request is untouched."""
    if stage == "admission":
        real_start = engine.kv.start_from_prefix

        def start_from_prefix(ids, *a, **k):
            if list(ids)[: len(bad_prompt)] == bad_prompt:
                raise _Boom("admission")
            return real_start(ids, *a, **k)

        monkeypatch.setattr(engine.kv, "start_from_prefix", start_from_prefix)
    elif stage == "prefill-layer-2":  # the bad prompt's prefill fails after layers 0 and 1 wrote its K/V
        real = attention_mod.attend_step

        def attend_bad(query, step, layer, *a, **k):
            if layer == 2:
                raise _Boom("prefill")
            return real(query, step, layer, *a, **k)

        def model_wrapper(real_model):
            def call(ids, cache, **kw):
                if ids.shape[1] > 1 and ids[0].tolist() == bad_prompt[-ids.shape[1] :]:
                    monkeypatch.setattr(attention_mod, "attend_step", attend_bad)
                    try:
                        return real_model(ids, cache, **kw)
                    finally:
                        monkeypatch.setattr(attention_mod, "attend_step", real)
                return real_model(ids, cache, **kw)

            return call

        _wrap_model(engine, model_wrapper)
    elif stage.startswith("decode-layer-"):  # a batched decode step fails after some layers wrote every row
        layer_at = int(stage.rsplit("-", 1)[1])
        real = attention_mod.attend_step

        def attend(query, step, layer, *a, **k):
            if query.shape[2] == 1 and layer == layer_at:
                bad = [s for s in step.sequences if _is_bad(s, bad_prompt)]
                if bad and len(bad[0].token_ids) >= len(bad_prompt) + 3:  # from its third decode step on
                    raise _Boom("decode")
            return real(query, step, layer, *a, **k)

        monkeypatch.setattr(attention_mod, "attend_step", attend)
    elif stage == "sampling":
        real_sample = engine._sample
        seen = {"n": 0}

        def sample(request, logits):
            if request.prompt == bad_prompt:
                seen["n"] += 1
                if seen["n"] == 4:
                    raise _Boom("sampling")
            return real_sample(request, logits)

        monkeypatch.setattr(engine, "_sample", sample)
    else:  # pragma: no cover
        raise AssertionError(stage)


def _wrap_model(engine: Engine, wrapper) -> None:
    real_model = engine.model

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = real_model.config
            self.inner = real_model
            self.fn = wrapper(real_model)

        def forward(self, ids, cache=None, **kw):
            return self.fn(ids, cache, **kw)

    engine.model = Wrapped()


STAGES = ["admission", "prefill-layer-2", "decode-layer-0", "decode-layer-3", "sampling"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("bad_index", [0, 2])
def test_a_failure_in_one_request_finishes_it_with_an_error_and_spares_the_others(
    shipped_pair, solo_outputs, monkeypatch, stage, bad_index
):
    ours, _ = shipped_pair
    engine = _engine(ours)
    start = (engine.kv.allocator.num_available, engine.kv.allocator.num_active)
    requests = [engine.submit(Request(p, N_NEW)) for p in PROMPTS]
    _inject(stage, engine, monkeypatch, PROMPTS[bad_index])
    done = engine.run()
    assert sorted(r.request_id for r in done) == sorted(r.request_id for r in requests)  # none lost
    bad = requests[bad_index]
    assert bad.finished and bad.failed and isinstance(bad.error, _Boom), stage
    assert engine.failures == 1
    for i, request in enumerate(requests):
        if i != bad_index:
            assert not request.failed and request.output == solo_outputs[i], (stage, i)
    engine.kv.check()
    assert (engine.kv.allocator.num_available, engine.kv.allocator.num_active) == start  # no leaked block
    monkeypatch.undo()  # the fault is gone: the engine serves the same prompt correctly
    engine.model = ours
    again = engine.submit(Request(PROMPTS[bad_index], N_NEW))
    engine.run()
    assert not again.failed and again.output == solo_outputs[bad_index]
    assert engine.kv.allocator.num_active == 0


def test_a_failed_decode_keeps_the_tokens_generated_before_it(shipped_pair, solo_outputs, monkeypatch):
    ours, _ = shipped_pair
    engine = _engine(ours)
    requests = [engine.submit(Request(p, N_NEW)) for p in PROMPTS]
    _inject("decode-layer-3", engine, monkeypatch, PROMPTS[1])
    engine.run()
    bad = requests[1]
    assert bad.failed and 0 < len(bad.output) < N_NEW
    assert bad.output == solo_outputs[1][: len(bad.output)]


class _Interrupt(BaseException):
    """Not an Exception: like KeyboardInterrupt, it must propagate, and lose nothing."""


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_an_interrupt_propagates_and_a_later_run_resumes_every_request(shipped_pair, solo_outputs, monkeypatch, stage):
    ours, _ = shipped_pair
    engine = _engine(ours)
    requests = [engine.submit(Request(p, N_NEW)) for p in PROMPTS]
    real = attention_mod.attend_step
    armed = {"left": 1}

    def attend(query, step, layer, *a, **k):
        is_stage = (query.shape[2] > 1) == (stage == "prefill")
        if armed["left"] and layer == 1 and is_stage and (stage == "prefill" or engine.steps == 2):
            armed["left"] -= 1
            raise _Interrupt
        return real(query, step, layer, *a, **k)

    monkeypatch.setattr(attention_mod, "attend_step", attend)
    with pytest.raises(_Interrupt):
        engine.run()
    engine.kv.check()
    engine.run()  # resumes: nothing was lost or left half-written
    for request, expected in zip(requests, solo_outputs):
        assert not request.failed and request.output == expected
    assert engine.kv.allocator.num_active == 0


def test_a_request_whose_prompt_outgrows_the_pool_fails_instead_of_wedging(shipped_pair):
    ours, _ = shipped_pair
    engine = Engine(ours, PagedKV(ours.kv_spec(block_size=8), 3), max_batch=2)
    long = engine.submit(Request(PROMPTS[0][:16], 40))  # 16 tokens fit in 24 slots; generating 40 cannot
    engine.run()
    assert long.failed and "out of KV blocks" in str(long.error)
    assert engine.kv.allocator.num_active == 0
    ok = engine.submit(Request(PROMPTS[0][:8], 3))
    engine.run()
    assert not ok.failed and len(ok.output) == 3


# ====================================================================== item 15: session load
@pytest.fixture
def saved(shipped_pair, tmp_path):
    ours, _ = shipped_pair
    manager = SessionManager(ours, num_blocks=64)
    manager.register_system_prompt("agent", "v1", "You are a careful agent.\n")
    session = manager.new_session(system=("agent", "v1"))
    session.append(SegmentKind.USER, "u", "Summarise the layout.\n")
    path = session.save(tmp_path / "s")
    return manager, session, path


def _state(manager: SessionManager) -> tuple[int, int, int, int]:
    a = manager.kv.allocator
    return a.num_free, a.num_cached, a.num_active, len(list(manager.sessions))


def _rewrite(path: Path, change, *, resign: bool) -> None:
    manifest = json.loads(path.with_suffix(".json").read_text())
    change(manifest)
    if resign:
        manifest["manifest_sha256"] = manifest_checksum(manifest)
    path.with_suffix(".json").write_text(json.dumps(manifest))


def _set(key: str, value: Any):
    def change(m: dict) -> None:
        m[key] = value

    return change


def _tokens(fn):
    def change(m: dict) -> None:
        m["token_ids"] = fn(m["token_ids"])

    return change


def _spec(key: str, value: Any):
    def change(m: dict) -> None:
        m["kv_spec"][key] = value

    return change


def _segment(i: int, key: str, value: Any):
    def change(m: dict) -> None:
        m["segments"][i][key] = value

    return change


TAMPERS = {
    "token_ids str": _tokens(lambda t: ["a", *t[1:]]),
    "token_ids negative": _tokens(lambda t: [-1, *t[1:]]),
    "token_ids out of vocabulary": _tokens(lambda t: [*t[:-1], 10_000]),
    "token_ids float": _tokens(lambda t: [float(t[0]), *t[1:]]),
    "token_ids bool": _tokens(lambda t: [True, *t[1:]]),
    "token_ids nested": _tokens(lambda t: [[t[0]], *t[1:]]),
    "token_ids shorter": _tokens(lambda t: t[:-1]),
    "token_ids longer": _tokens(lambda t: [*t, 1]),
    "token_ids empty": _tokens(lambda t: []),
    "token_ids not a list": _tokens(lambda t: {"0": t[0]}),
    "dtype float16": _spec("dtype", "float16"),
    "dtype unknown": _spec("dtype", "float128"),
    "num_layers": _spec("num_layers", 3),
    "head_dim": _spec("head_dim", 16),
    "kv_spec extra field": _spec("extra", 1),
    "kv_spec string number": _spec("num_layers", "4"),
    "kv_spec not an object": _set("kv_spec", [4, 2]),
    "bytes_per_token": _spec("bytes_per_token", 1),
    "segment start after stop": _segment(0, "start", 99),
    "segment past the end": _segment(-1, "stop", 10_000),
    "segment kind": _segment(0, "kind", "root"),
    "segment extra field": _segment(0, "blocks", [0]),
    "segment negative": _segment(0, "start", -1),
    "segments overlap": lambda m: m["segments"].append(dict(m["segments"][0])),
    "extra manifest field": _set("note", "hi"),
    "missing manifest field": lambda m: m.pop("segments"),
    "fingerprint": _set("fingerprint", "0" * 16),
    "fingerprint not a str": _set("fingerprint", 7),
    "sha256 format": _set("sha256", "xyz"),
    "bytes huge": _set("bytes", 10**12),
    "bytes negative": _set("bytes", -1),
    "version": _set("version", 1),
}


@pytest.mark.parametrize("resign", [False, True], ids=["as-tampered", "checksum-recomputed"])
@pytest.mark.parametrize("name", list(TAMPERS))
def test_tampered_manifest_fields_are_refused_before_anything_is_written(saved, name, resign):
    manager, _, path = saved
    _rewrite(path, TAMPERS[name], resign=resign)
    before = _state(manager)
    with pytest.raises(CorruptCacheError):  # ModelMismatchError is a CorruptCacheError
        manager.load(path)
    assert _state(manager) == before, name
    manager.kv.check()


def test_a_resigned_foreign_spec_or_fingerprint_is_a_model_mismatch(saved):
    manager, _, path = saved
    original = json.loads(path.with_suffix(".json").read_text())["kv_spec"]

    def three_layers(m: dict) -> None:  # a consistent spec of another model
        m["kv_spec"].update(num_layers=3, bytes_per_token=original["bytes_per_token"] * 3 // 4)

    _rewrite(path, three_layers, resign=True)
    with pytest.raises(ModelMismatchError, match="KVSpec"):
        manager.load(path)
    _rewrite(path, _set("kv_spec", original), resign=True)
    _rewrite(path, _set("fingerprint", "0" * 16), resign=True)
    with pytest.raises(ModelMismatchError, match="0000000000000000"):
        manager.load(path)


def test_an_untampered_manifest_still_loads(saved):
    manager, session, path = saved
    _rewrite(path, lambda m: None, resign=False)  # re-serialised with other whitespace: still valid
    assert manager.load(path).token_ids == session.token_ids


def _retype_tensor(path: Path, dtype: torch.dtype, *, view: bool) -> None:
    """Replace the stored KV by the same values (``view=False``) or the same bytes (``view=True``) in
    ``dtype``, with the manifest's tensor checksum and size updated and the manifest re-signed."""
    tensor_path = path.with_suffix(".safetensors")
    kv = load_file(str(tensor_path))["kv"]
    save_file({"kv": kv.view(dtype) if view else kv.to(dtype)}, str(tensor_path))
    data = tensor_path.read_bytes()

    def change(m: dict) -> None:
        import hashlib

        m["sha256"], m["bytes"] = hashlib.sha256(data).hexdigest(), len(data)

    _rewrite(path, change, resign=True)


@pytest.mark.parametrize(
    ("dtype", "view"), [(torch.int32, True), (torch.float16, False), (torch.float64, False)], ids=str
)
def test_a_tensor_whose_dtype_contradicts_the_manifest_is_refused_not_converted(saved, dtype, view):
    manager, _, path = saved
    _retype_tensor(path, dtype, view=view)
    before = _state(manager)
    with pytest.raises(CorruptCacheError):
        manager.load(path)
    assert _state(manager) == before


def test_the_int32_view_is_refused_for_its_dtype(saved):
    manager, _, path = saved
    _retype_tensor(path, torch.int32, view=True)  # same size: only the dtype check can see it
    with pytest.raises(CorruptCacheError, match="refusing to convert"):
        manager.load(path)


def test_nonfinite_kv_is_refused(saved):
    manager, _, path = saved
    tensor_path = path.with_suffix(".safetensors")
    kv = load_file(str(tensor_path))["kv"]
    kv[0, 0, 0, 0, 0] = float("nan")
    save_file({"kv": kv}, str(tensor_path))
    data = tensor_path.read_bytes()
    import hashlib

    _rewrite(path, lambda m: m.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data)), resign=True)
    with pytest.raises(CorruptCacheError, match="NaN"):
        manager.load(path)


def test_oversized_files_are_refused_before_being_read(saved, monkeypatch):
    manager, _, path = saved
    manifest_path = path.with_suffix(".json")
    size = manifest_path.stat().st_size
    monkeypatch.setattr(session_mod, "MAX_MANIFEST_BYTES", size + 10)
    manifest_path.write_text(manifest_path.read_text() + " " * 20)  # still valid JSON, but too big
    before = _state(manager)
    with pytest.raises(CorruptCacheError, match="more than"):
        manager.load(path)
    assert _state(manager) == before


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_a_session_file_is_refused_without_blocking(saved):
    manager, _, path = saved
    manifest_path = path.with_suffix(".json")
    manifest_path.unlink()
    os.mkfifo(manifest_path)
    outcome: list[BaseException | None] = []

    def load() -> None:
        try:
            manager.load(path)
            outcome.append(None)
        except BaseException as exc:  # recorded for the assertion
            outcome.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(60)  # a hang detector, not a timing: the load opens with O_NONBLOCK and checks the file type
    assert outcome and isinstance(outcome[0], CorruptCacheError) and "regular file" in str(outcome[0])


def test_a_failure_while_writing_the_loaded_kv_rolls_back(saved, monkeypatch):
    manager, _, path = saved
    real_update = PagedCache.update

    def update(self, key, value, layer_idx, *a, **k):
        if layer_idx == 2:
            raise _Boom("write")
        return real_update(self, key, value, layer_idx, *a, **k)

    monkeypatch.setattr(PagedCache, "update", update)
    before = _state(manager)
    with pytest.raises(_Boom):
        manager.load(path)
    assert _state(manager) == before
    manager.kv.check()


# ====================================================================== item 16: argument types, closed sessions
def test_engine_constructor_refuses_wrong_types(shipped_pair):
    ours, _ = shipped_pair
    kv = PagedKV(ours.kv_spec(), 8)
    cases = [
        (lambda: Engine("model", kv), ArgumentTypeError),
        (lambda: Engine(ours, "kv"), ArgumentTypeError),
        (lambda: Engine(ours, kv, max_batch="4"), ArgumentTypeError),
        (lambda: Engine(ours, kv, max_batch=0), InvalidArgumentError),
        (lambda: Engine(ours, kv).run(max_steps=0), InvalidArgumentError),
    ]
    for make, error in cases:
        with pytest.raises(error, match="expected"):
            make()


@pytest.fixture
def manager(shipped_pair):
    ours, _ = shipped_pair
    mgr = SessionManager(ours, num_blocks=64)
    mgr.register_system_prompt("agent", "v1", "Be brief.\n")
    return mgr


def test_session_api_refuses_wrong_types_and_values_leaving_everything_as_it_was(shipped_pair, manager, tmp_path):
    ours, _ = shipped_pair
    session = manager.new_session(system=("agent", "v1"))
    memory = manager.build_memory("m", "x = 1\n")
    cases = [
        (lambda: SessionManager("model"), ArgumentTypeError),
        (lambda: SessionManager(ours, num_blocks="8"), ArgumentTypeError),
        (lambda: SessionManager(ours, num_blocks=0), InvalidArgumentError),
        (lambda: SessionManager(ours, block_size=16.0), ArgumentTypeError),
        (lambda: SessionManager(ours, fingerprint=3), ArgumentTypeError),
        (lambda: manager.register_system_prompt("agent", 2, "text"), ArgumentTypeError),
        (lambda: manager.new_session(system="agent"), ArgumentTypeError),
        (lambda: manager.new_session(system=("agent",)), ArgumentTypeError),
        (lambda: manager.new_session(tools="read_file"), ArgumentTypeError),
        (lambda: manager.new_session(tools=["read_file", 3]), ArgumentTypeError),
        (lambda: manager.new_session(memories=[memory, "m"]), ArgumentTypeError),
        (lambda: manager.build_memory(1, "x"), ArgumentTypeError),
        (lambda: manager.build_memory("n", "x", after="m"), ArgumentTypeError),
        (lambda: manager.load(3), ArgumentTypeError),
        (lambda: session.append("shout", "u", "hi"), InvalidArgumentError),
        (lambda: session.append(3, "u", "hi"), ArgumentTypeError),
        (lambda: session.append(SegmentKind.USER, 1, "hi"), ArgumentTypeError),
        (lambda: session.append(SegmentKind.USER, "u", b"hi"), ArgumentTypeError),
        (lambda: session.generate("3"), ArgumentTypeError),
        (lambda: session.generate(-1), InvalidArgumentError),
        (lambda: session.generate(2, seg_id=None), ArgumentTypeError),
        (lambda: session.fork("2"), ArgumentTypeError),
        (lambda: session.compact(None), ArgumentTypeError),
        (lambda: session.save(3), ArgumentTypeError),
    ]
    before = (_state(manager), list(session.token_ids), list(session.segment_list))
    for make, error in cases:
        with pytest.raises(error, match="expected"):
            make()
    assert (_state(manager), session.token_ids, session.segment_list) == before
    assert session.append("user", "u", "hi").kind is SegmentKind.USER  # the kind's value is accepted


def test_a_closed_session_raises_use_after_free_on_every_call(manager, tmp_path):
    session = manager.new_session(system=("agent", "v1"))
    session.close()
    session.close()  # closing twice is harmless
    calls = [
        lambda: session.append(SegmentKind.USER, "u", "hi"),
        lambda: session.generate(2),
        lambda: session.fork(),
        lambda: session.compact("summary"),
        lambda: session.segments(),
        lambda: session.save(tmp_path / "closed"),
    ]
    for call in calls:
        with pytest.raises(UseAfterFreeError, match="closed"):
            call()
    assert issubclass(UseAfterFreeError, StateError)
    assert not (tmp_path / "closed.json").exists()
    assert manager.kv.allocator.num_active == 0


def test_model_api_refuses_wrong_types(shipped_pair):
    from memos_ref.model import load_model
    from memos_ref.model.llama import LlamaConfig

    ours, _ = shipped_pair
    vocab = ours.config.vocab_size
    cases = [
        (lambda: ours([[1, 2]]), ArgumentTypeError),
        (lambda: ours(torch.tensor([[1.0, 2.0]])), DTypeError),
        (lambda: ours(torch.tensor([[1, vocab]])), InvalidArgumentError),
        (lambda: ours(torch.tensor([[-1, 2]])), InvalidArgumentError),
        (lambda: ours(torch.tensor([[1, 2]]), position_ids=[[0, 1]]), ArgumentTypeError),
        (lambda: ours.generate(torch.tensor([[1, 2]]), "4"), ArgumentTypeError),
        (lambda: ours.generate(torch.tensor([[1, 2]]), -1), InvalidArgumentError),
        (lambda: load_model(3), ArgumentTypeError),
        (lambda: LlamaConfig.from_hf_dict(["llama"]), ArgumentTypeError),
        (lambda: tok.encode(b"bytes"), ArgumentTypeError),
        (lambda: tok.decode([1, "a"]), ArgumentTypeError),
    ]
    for make, error in cases:
        with pytest.raises(error, match="expected"):
            make()
    with pytest.raises(KVCacheError, match="missing"):
        LlamaConfig.from_hf_dict({"model_type": "llama"})
    assert load_hf_model is not None  # the transformers route stays importable


# ====================================================================== engine: interrupts per row, staging, seeds
def _assert_interrupt_lost_nothing(engine: Engine, requests: list[Request], solo: list[list[int]]) -> None:
    """After an interrupt: every request is tracked, every sequence has all layers at one token count, no block
    leaked; a later run gives every request its solo output."""
    tracked = [*engine.waiting, *(r for r, _ in engine.running), *engine.finished]
    assert sorted(r.request_id for r in tracked) == sorted(r.request_id for r in requests)
    for _, seq in engine.running:
        assert len(set(seq.layer_tokens)) == 1 and seq.layer_tokens[0] == seq.num_tokens
    assert len(engine.kv.sequences) == len(engine.running)
    engine.kv.check()
    engine.run()
    for request, expected in zip(requests, solo):
        assert not request.failed and request.output == expected
    assert engine.kv.allocator.num_active == 0 and not engine.kv.sequences


@pytest.mark.parametrize("row", [0, 1, 2])
def test_an_interrupt_while_sampling_one_row_of_a_batched_step_loses_no_request(
    shipped_pair, solo_outputs, monkeypatch, row
):
    ours, _ = shipped_pair
    engine = _engine(ours)
    requests = [engine.submit(Request(p, N_NEW)) for p in PROMPTS]
    real_sample = engine._sample
    calls = {"n": 0}

    def sample(request, logits):
        calls["n"] += 1
        if calls["n"] == len(PROMPTS) + 1 + row:  # after the prefills: the first batched step, this row
            raise _Interrupt
        return real_sample(request, logits)

    monkeypatch.setattr(engine, "_sample", sample)
    with pytest.raises(_Interrupt):
        engine.run()
    monkeypatch.undo()
    _assert_interrupt_lost_nothing(engine, requests, solo_outputs)


@pytest.mark.parametrize("row", [0, 1, 2])
def test_an_interrupt_while_retrying_a_failed_step_row_by_row_loses_no_request(
    shipped_pair, solo_outputs, monkeypatch, row
):
    ours, _ = shipped_pair
    engine = _engine(ours)
    requests = [engine.submit(Request(p, N_NEW)) for p in PROMPTS]
    real = attention_mod.attend_step
    state = {"batched_failed": False, "rows": 0}

    def attend(query, step, layer, *a, **k):
        if query.shape[2] == 1 and engine.steps == 1:
            if len(step.sequences) > 1 and not state["batched_failed"]:
                state["batched_failed"] = True
                raise _Boom("batched step")
            if len(step.sequences) == 1 and state["batched_failed"] and layer == 2:
                state["rows"] += 1
                if state["rows"] == row + 1:  # this row's retry is interrupted after layers 0, 1 wrote it
                    raise _Interrupt
        return real(query, step, layer, *a, **k)

    monkeypatch.setattr(attention_mod, "attend_step", attend)
    with pytest.raises(_Interrupt):
        engine.run()
    monkeypatch.undo()
    _assert_interrupt_lost_nothing(engine, requests, solo_outputs)


def _quant_engine(model: Any) -> Engine:
    from memos_ref.quant import PerTokenInt8

    kv = PagedKV(model.kv_spec(block_size=8), 64, quant=PerTokenInt8(), residual_tokens=256, staging_blocks=2)
    return Engine(model, kv, max_batch=2)


def test_a_prompt_the_staging_slab_can_never_hold_is_refused_at_submit(shipped_pair):
    ours, _ = shipped_pair
    engine = _quant_engine(ours)
    with pytest.raises(StagingFullError, match="staging"):
        engine.submit(Request([1, *range(3, 30)], 3))  # 28 tokens: 4 staged blocks, the slab has 2
    assert not engine.waiting
    small = engine.submit(Request([1, 5, 6], 3))
    engine.run()
    assert not small.failed and len(small.output) == 3
    assert engine.kv.allocator.num_active == 0


def test_a_queued_request_the_staging_slab_can_never_hold_fails_alone_instead_of_wedging(shipped_pair):
    ours, _ = shipped_pair
    engine = _quant_engine(ours)
    first = engine.submit(Request([1, 5, 6], 3))
    big = engine.submit(Request([1, 9], 3))
    after = engine.submit(Request([1, 7, 8], 3))
    big.prompt = [1, *range(3, 30)]  # grown after submission (as a preempted request's prompt grows)
    engine.run()
    assert big.failed and isinstance(big.error, StagingFullError)
    assert not first.failed and len(first.output) == 3
    assert not after.failed and len(after.output) == 3
    assert not engine.waiting and not engine.running and engine.kv.allocator.num_active == 0


@pytest.mark.parametrize("seed", [np.int64(7), np.uint64(7), np.uint64(2**64 - 1), np.int32(0)])
def test_a_numpy_integer_seed_is_accepted_and_samples_like_the_python_int(shipped_pair, seed):
    ours, _ = shipped_pair
    outputs = []
    for s in (seed, int(seed)):
        engine = _engine(ours)
        request = engine.submit(Request(PROMPTS[0], 4, temperature=0.8, seed=s))
        assert type(request.seed) is int
        engine.run()
        outputs.append(request.output)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 4
