"""The kernels package's layout (issue 15, items 3 and 5): one kernel story per file in the Triton tutorials'
order (reference -> kernel -> wrapper -> check -> benchmark), each file's check passing (Triton's interpreter on
a CPU, natively on a GPU), one timer, imports from ``memos_ref`` limited to its errors, and no private
attribute reached across modules."""

from __future__ import annotations

import ast
import importlib
import itertools
import os
from pathlib import Path

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - triton is part of the dev install
    if os.environ.get("CI"):
        raise
    pytest.skip("triton is not installed (pip install 'memos-ref[kernels]')", allow_module_level=True)

from memos_ref.errors import ConfigError

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
STORIES = ["write_kv", "paged_decode", "kivi_decode", "paged_prefill", "copy_blocks"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_OK = DEVICE == "cpu" or torch.cuda.get_device_capability() >= (8, 9)


def _sources() -> list[Path]:
    return sorted(KERNELS_DIR.rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


# ---------------------------------------------------------------------------------------------- checks pass
CHECKS = [
    ("write_kv", "check_write_kv", {}),
    ("write_kv", "check_write_kv_int8", {}),
    pytest.param("write_kv", "check_write_kv_fp8", {}, marks=pytest.mark.skipif(not FP8_OK, reason="fp8: sm_89+")),
    ("paged_decode", "check_paged_decode", {}),
    ("paged_decode", "check_paged_decode", {"quant": "int8"}),
    ("kivi_decode", "check_kivi_decode", {"bits": 4}),
    ("kivi_decode", "check_kivi_decode", {"bits": 2}),
    ("paged_prefill", "check_paged_prefill", {}),
    ("copy_blocks", "check_copy_blocks", {}),
]


@pytest.mark.parametrize("module,check,kwargs", CHECKS)
def test_each_kernel_files_check_passes(module, check, kwargs):
    result = getattr(importlib.import_module(f"memos_kernels.{module}"), check)(DEVICE, **kwargs)
    assert result.ok, result


def test_a_check_fails_when_kernel_and_reference_disagree(monkeypatch):
    """The checks compare for real: a reference shifted by 1e-3 makes check_paged_decode fail."""
    from memos_kernels import paged_decode

    reference = paged_decode.paged_decode_reference
    monkeypatch.setattr(paged_decode, "paged_decode_reference", lambda *a, **k: reference(*a, **k) + 1e-3)
    result = paged_decode.check_paged_decode(DEVICE)
    assert not result.ok and result.max_abs_err == pytest.approx(1e-3, rel=1e-2)


def test_check_result_rejects_nan_and_excess():
    from memos_kernels.common import CheckResult

    assert CheckResult("x", 0.0, 0.0).ok and CheckResult("x", 1e-6, 1e-5).ok
    assert not CheckResult("x", 2e-5, 1e-5).ok and not CheckResult("x", float("nan"), 1.0).ok


# ---------------------------------------------------------------------------------------------- one story per file
def _is_jit(node: ast.FunctionDef) -> bool:
    return any(ast.unparse(d.func if isinstance(d, ast.Call) else d).endswith("jit") for d in node.decorator_list)


@pytest.mark.parametrize("module", STORIES)
def test_each_kernel_file_tells_its_story_in_tutorial_order(module):
    """Top-level functions: every ``*_reference`` before every ``@triton.jit`` kernel, every kernel before the
    public wrappers, the wrappers before every ``check_*``, every check before every ``benchmark_*``."""
    mod = importlib.import_module(f"memos_kernels.{module}")
    funcs = [n for n in _tree(KERNELS_DIR / f"{module}.py").body if isinstance(n, ast.FunctionDef)]
    from memos_kernels import triton_paged

    wrappers = [f.lineno for f in funcs if f.name in triton_paged.__all__]
    sections = {
        "reference": [f.lineno for f in funcs if f.name.endswith("_reference")],
        "kernel": [f.lineno for f in funcs if _is_jit(f)],
        "wrapper": wrappers,
        "check": [f.lineno for f in funcs if f.name.startswith("check_")],
        "benchmark": [f.lineno for f in funcs if f.name.startswith("benchmark_")],
    }
    for name in ("reference", "wrapper", "check", "benchmark"):
        assert sections[name], f"{module}.py has no {name}"
    present = [lines for lines in sections.values() if lines]
    for earlier, later in itertools.pairwise(present):
        assert max(earlier) < min(later), f"{module}.py: sections out of order: {sections}"
    assert isinstance(mod.KERNELS, tuple)
    assert {f.name for f in funcs if _is_jit(f)} >= {k.__name__ for k in mod.KERNELS}


def test_triton_paged_re_exports_the_stories_public_wrappers():
    """``memos_kernels.triton_paged`` keeps every name it exported before the split, as the same objects."""
    from memos_kernels import triton_paged

    before = {"QUANT_MODES", "copy_blocks", "paged_decode_attention", "paged_decode_attention_kivi",
              "paged_prefill_attention", "write_kv", "write_kv_fp8", "write_kv_int8"}  # fmt: skip
    assert before <= set(triton_paged.__all__)
    stories = [importlib.import_module(f"memos_kernels.{m}") for m in STORIES]
    for name in triton_paged.__all__:
        homes = [m for m in stories if getattr(m, name, None) is getattr(triton_paged, name)]
        assert homes, f"triton_paged.{name} is not one of the kernel files' names"
    assert len(_tree(KERNELS_DIR / "triton_paged.py").body) < 12  # a re-export, no code of its own


# ---------------------------------------------------------------------------------------------- direction
def _imported_modules(tree: ast.Module) -> list[tuple[str, list[str]]]:
    """Every import anywhere in the file (function-level included): (module, names); import_module("...") too."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append(("." * node.level + (node.module or ""), [a.name for a in node.names]))
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.args[0].value, []))
    return found


def test_kernels_import_nothing_from_memos_ref_but_errors():
    offenders = []
    for path in _sources():
        for module, names in _imported_modules(_tree(path)):
            if module.startswith("."):
                offenders.append(f"{path.name}: relative import {module}")
            elif module == "memos_ref":
                offenders += [f"{path.name}: from memos_ref import {n}" for n in names if n != "errors"]
            elif module.startswith("memos_ref.") and module != "memos_ref.errors":
                offenders.append(f"{path.name}: {module}")
    assert not offenders, offenders


def test_no_private_attribute_is_reached_across_modules():
    """No ``x._name`` (other than ``self``/``cls`` and dunders) and no ``from m import _name`` in kernels/."""
    offenders = []
    for path in _sources():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("memos_"):
                offenders += [f"{path.name}:{node.lineno}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not offenders, offenders


# ---------------------------------------------------------------------------------------------- one timer
def test_every_benchmark_times_through_the_one_timer():
    """Only timing.py touches a clock or a timer: ``time.perf_counter``/``time.time``, ``do_bench`` and
    ``torch.utils.benchmark`` appear nowhere else in kernels/."""
    clocks = ("perf_counter", "time.time", "monotonic", "do_bench", "utils.benchmark", "Timer(")
    offenders = []
    for path in _sources():
        if path.name == "timing.py":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Attribute | ast.Call | ast.ImportFrom | ast.Import):
                text = ast.unparse(node)
                offenders += [f"{path.name}:{node.lineno}: {text}" for c in clocks if c in text]
    assert not offenders, sorted(set(offenders))


def test_the_timer_reports_median_and_range():
    from memos_kernels.timing import time_ms

    timing = time_ms(lambda: torch.ones(64).sum(), "cpu", budget_ms=2.0)
    assert timing.samples >= 1 and 0 < timing.min_ms <= timing.median_ms <= timing.max_ms
    assert set(timing.as_dict("x")) == {"x_ms", "x_ms_min", "x_ms_max"}


def test_a_kernel_benchmark_runs_through_the_timer():
    from memos_kernels.copy_blocks import benchmark_copy_blocks

    row = benchmark_copy_blocks(DEVICE, pairs=2, block_shape=(2, 16, 8))
    assert row["kernel_ms"] > 0 and row["reference_ms_min"] <= row["reference_ms"] <= row["reference_ms_max"]


# ---------------------------------------------------------------------------------------------- KIVI plain arguments
def test_kivi_wrapper_takes_plain_tensors_and_refuses_a_non_kivi_pool():
    """The KIVI kernel runs from plain tensors plus bits and group size; the pool-taking form reads the pool by
    duck typing and refuses anything without a KIVI scheme and payload."""
    from types import SimpleNamespace

    from memos_kernels import kivi_decode

    assert kivi_decode.check_kivi_decode(DEVICE, seed=3).ok
    blocks = kivi_decode.random_kivi_blocks(0, 4, staged=(1,), device=DEVICE)
    q = torch.zeros(1, 4, 32, device=DEVICE)
    tables, lens = torch.tensor([[1, 2]], device=DEVICE), torch.tensor([40], device=DEVICE)
    for pool in (object(), SimpleNamespace(scheme=SimpleNamespace(bits=8), payload={})):
        with pytest.raises(ConfigError, match="KIVI"):
            kivi_decode.paged_decode_attention_kivi(q, pool, 0, tables, lens)
    fake = SimpleNamespace(
        scheme=SimpleNamespace(bits=blocks.bits, group_size=blocks.group_size),
        payload={name: getattr(blocks, name)[:, None] for name in kivi_decode.KIVI_PAYLOAD},  # one layer
        staging=blocks.staging[:, None],
        staging_slot=blocks.staging_slot,
    )
    via_pool = kivi_decode.paged_decode_attention_kivi(q + 1, fake, 0, tables, lens)
    direct = kivi_decode.paged_decode_attention_kivi_packed(q + 1, blocks, tables, lens)
    assert torch.equal(via_pool, direct)
    with pytest.raises(ConfigError, match="multiple of the KIVI key group"):
        bad = kivi_decode.KiviBlocks(**{**vars(blocks), "group_size": 64})
        kivi_decode.paged_decode_attention_kivi_packed(q, bad, tables, lens)
