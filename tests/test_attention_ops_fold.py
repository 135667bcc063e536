"""The kernel switch lives in memos_ref.attention (issue 15: ``attention`` <-> ``ops`` was an import cycle);
``memos_ref.ops`` stays importable as a re-export of the same objects."""

from __future__ import annotations

import ast
import inspect

import torch

import memos_ref.attention as attention
import memos_ref.ops as ops


def _imported_modules(module) -> set[str]:
    """Every module a source file imports, lazy imports inside functions included."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_attention_does_not_import_ops():
    assert not {"memos_ref.ops", "memos_ref.ops.paged_decode"} & _imported_modules(attention)
    assert "memos_ref.ops" not in {n for n in _imported_modules(attention) if n.startswith("memos_ref.ops")}


def test_ops_reexports_the_attention_switch(monkeypatch):
    for name in ("MODES", "kernel_mode", "paged_decode", "use_kernels"):
        assert getattr(ops, name) is getattr(attention, name)
    monkeypatch.setenv("MEMOS_REF_KERNELS", "reference")
    assert not ops.use_kernels(torch.device("cpu")) and attention.kernel_mode() == "reference"
