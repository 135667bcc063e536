"""The launch planner (issue 25 item 3): ``aot_check`` compiles exactly the launches the package can make.

The oracle is the wrappers themselves: every jitted kernel is replaced by a recorder, and each wrapper is called
over a domain wider than the planner's (head dims 8-256, groups 1-32, every block size, dtype, quantization and
split count) with the GPU's ``tl.dot`` flags; what it launches (kernel, data pointer element types, constexprs,
warps, stages) must be one of ``aot_check``'s configurations, and every configuration must be launched by some
call. Geometries outside the set are refused on a compiled device (``meta`` stands in for a GPU)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - triton is part of the dev install
    if os.environ.get("CI"):
        raise
    pytest.skip("triton is not installed (pip install 'memos-ref[kernels]')", allow_module_level=True)

from memos_kernels import aot_check, decode_launch, launch_plan
from memos_kernels import copy_blocks as cb
from memos_kernels import kivi_decode as kd
from memos_kernels import paged_decode as pd
from memos_kernels import paged_prefill as pp
from memos_kernels import write_kv as wk
from memos_kernels.aot_check import configs, specializations
from memos_kernels.launch_plan import INDEX_POINTERS, Launch

from memos_ref.errors import ConfigError, DTypeError

ELT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8", torch.uint8: "u8"}
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
WIDE_HEAD_DIMS = (8, 16, 32, 64, 128, 256)
WIDE_GROUPS = (1, 2, 3, 4, 5, 7, 8, 12, 16, 17, 32)


def _constexprs(kernel) -> list[str]:
    """The ``tl.constexpr`` parameters of a jitted (or interpreted) kernel, from its Python signature."""
    fn = getattr(kernel, "fn", kernel)
    return [p.name for p in inspect.signature(fn).parameters.values() if "constexpr" in str(p.annotation)]


class Recorder:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kwargs)`` records the launch's key, runs nothing."""

    def __init__(self, fn, seen: set[Launch]) -> None:
        self.fn, self.seen = fn, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            bound = dict(zip(self.fn.arg_names, args, strict=False)) | kwargs
            pointers = {n: ELT[v.dtype] for n, v in bound.items() if n.endswith("_ptr") and n not in INDEX_POINTERS}
            consts = {name: bound[name] for name in _constexprs(self.fn)}
            key = Launch(self.fn.__name__, tuple(sorted(pointers.items())), tuple(sorted(consts.items())),
                         kwargs.get("num_warps", 4), kwargs.get("num_stages", 3))  # fmt: skip
            self.seen.add(key)

        return launch


@pytest.fixture
def recorded(monkeypatch):
    """Every kernel replaced by a :class:`Recorder` writing into the returned set; ``dot_flags`` as on a GPU (no
    interpreter upcast, exact fp32 products) and 132 SMs, so the wrappers plan as on an H200."""
    seen: set[Launch] = set()
    for mod in (pd, kd, pp, wk, cb):
        for kernel in mod.KERNELS:
            monkeypatch.setattr(mod, kernel.__name__, Recorder(kernel, seen))
        if hasattr(mod, "dot_flags"):
            monkeypatch.setattr(mod, "dot_flags", lambda q: (False, "ieee" if q.dtype == torch.float32 else "tf32"))
    monkeypatch.setattr(decode_launch, "sm_count", lambda device: 132)
    return seen


def _gpu_fits(d: int, t: int, g: int, dtype: torch.dtype) -> bool:
    return launch_plan.fits(d, t, g, dtype, torch.device("meta"))


def _drive_every_wrapper() -> None:
    """Call every wrapper over the wide domain, on the CPU, where the package's own gate (``fits`` for a GPU)
    says a GPU would launch it. Two table widths: one tile (one split, the direct store) and many (the reduce)."""
    h = 2
    for dtype, d, t, g, width in itertools.product(FLOATS, WIDE_HEAD_DIMS, (8, 16, 32, 64, 128), WIDE_GROUPS, (1, 64)):
        if not _gpu_fits(d, t, g, dtype):
            continue
        q = torch.zeros(1, h * g, d, dtype=dtype)
        tables = torch.zeros(1, width, dtype=torch.int32)
        lens = torch.full((1,), t, dtype=torch.int32)
        pool = torch.zeros(2, h, t, d, dtype=dtype)
        pd.paged_decode_attention(q, pool, pool, tables, lens, validate=False)
        codes8, s16 = torch.zeros(2, h, t, d, dtype=torch.int8), torch.ones(2, h, t, dtype=torch.float16)
        pd.paged_decode_attention(q, codes8, codes8, tables, lens, quant="int8", key_scale=s16, value_scale=s16,
                                  validate=False)  # fmt: skip
        codes_u8, s32 = torch.zeros(2, h, t, d, dtype=torch.uint8), torch.ones(2, h, dtype=torch.float32)
        pd.paged_decode_attention(q, codes_u8, codes_u8, tables, lens, quant="fp8", key_scale=s32, value_scale=s32,
                                  validate=False)  # fmt: skip
        for bits in (2, 4):
            kivi_group = min(t, 32)
            if kivi_group < 16:
                continue
            blocks = kd.random_kivi_blocks(0, 2, bits=bits, group_size=kivi_group, kv_heads=h, block_size=t,
                                           head_dim=d, staged=(1,))  # fmt: skip
            blocks.staging = blocks.staging.to(dtype)
            kd.paged_decode_attention_kivi_packed(q, blocks, tables, lens, validate=False)
        qp = torch.zeros(1, h * g, 3, d, dtype=dtype)
        pp.paged_prefill_attention(qp, pool, pool, tables, lens, torch.full((1,), 3, dtype=torch.int32),
                                   validate=False)  # fmt: skip
        if g == 1 and width == 1:
            kv, slots = torch.zeros(1, h, d, dtype=dtype), torch.zeros(1, dtype=torch.int64)
            wk.write_kv(kv, kv, slots, pool, pool, validate=False)
            wk.write_kv_int8(kv, kv, slots, codes8, codes8, s16, s16, validate=False)
            wk.write_kv_fp8(kv, kv, slots, codes_u8, codes_u8, s32, s32, validate=False)
    for dtype in launch_plan.POOL_DTYPES.values():
        cb.copy_blocks(torch.zeros(2, 4, dtype=dtype), torch.tensor([[0, 1]]))


def test_the_aot_set_is_every_launch_the_wrappers_make(recorded):
    """Every launch the wrappers make over the wide domain is compiled by ``aot_check --full`` at sm_90, and
    every compiled configuration is launched by some call (no phantom entry). The old hand list (27 entries)
    missed fp32 decode at head dim 128, block-128 tiles and the fp32 prefill, among others."""
    _drive_every_wrapper()
    aot = {c.launch for c in configs(90, full=True)}
    assert recorded - aot == set(), sorted(x.name for x in recorded - aot)[:10]
    assert aot - recorded == set(), sorted(x.name for x in aot - recorded)[:10]
    assert len({c.name for c in configs(90, full=True)}) == len(aot)  # the names are unique


def test_sm87_drops_only_the_fp8_launches():
    """Orin (sm_87) has no e4m3: its set is sm_90's without fp8 decode and writes."""
    at87, at90 = {c.launch for c in configs(87, full=True)}, {c.launch for c in configs(90, full=True)}
    assert at87 < at90
    assert all(dict(x.pointers).get("kc_ptr") == "u8" and "kivi" not in x.kernel for x in at90 - at87)


def test_the_aot_set_follows_the_planner(monkeypatch, recorded):
    """The set is generated, not listed: a planner change (here 8 warps for every float decode) changes what the
    wrappers launch and what ``aot_check`` compiles alike."""
    real = launch_plan.decode_config

    def eight_warps(group, block, head_dim, dtype, quant="none"):
        cfg = real(group, block, head_dim, dtype, quant)
        return launch_plan.DecodeConfig(cfg.tile, cfg.gp, 8, cfg.num_stages)

    monkeypatch.setattr(launch_plan, "decode_config", eight_warps)
    monkeypatch.setattr(decode_launch, "decode_config", eight_warps)
    q = torch.zeros(1, 8, 128, dtype=torch.float16)
    pool = torch.zeros(2, 2, 16, 128, dtype=torch.float16)
    pd.paged_decode_attention(q, pool, pool, torch.zeros(1, 64, dtype=torch.int32), torch.full((1,), 16),
                              validate=False)  # fmt: skip
    (launch,) = [x for x in recorded if x.kernel == "decode_split_kernel"]
    assert launch.num_warps == 8
    assert launch in {c.launch for c in configs(90, full=True)}


@pytest.mark.parametrize("head_dim,group", [(256, 4), (8, 4), (128, 17), (64, 32)])
def test_a_gpu_launch_outside_the_set_is_refused(head_dim, group):
    """On a compiled device (``meta`` stands in for a GPU) a geometry the set does not hold is a ConfigError
    naming the set, before anything is launched; the interpreter (CPU) still takes it."""
    q = torch.zeros(1, 2 * group, head_dim, dtype=torch.float16, device="meta")
    pool = torch.zeros(2, 2, 16, head_dim, dtype=torch.float16, device="meta")
    tables = torch.zeros(1, 4, dtype=torch.int32, device="meta")
    lens = torch.zeros(1, dtype=torch.int32, device="meta")
    with pytest.raises(ConfigError, match="outside the compiled launch set"):
        pd.paged_decode_attention(q, pool, pool, tables, lens, max_seq_len=16)
    with pytest.raises(ConfigError, match="outside the compiled launch set"):
        pp.paged_prefill_attention(q[:, :, None], pool, pool, tables, lens, lens, validate=False)
    assert launch_plan.fits(head_dim, 16, group, torch.float16, torch.device("cpu"))


def test_wrappers_refuse_element_types_outside_the_set():
    """Element types the set does not compile are refused by name: a float64 pool copy, mixed key/value dtypes
    in a write, a KIVI staging slab in another dtype than the query."""
    with pytest.raises(DTypeError, match="copies"):
        cb.copy_blocks(torch.zeros(2, 4, dtype=torch.float64), torch.tensor([[0, 1]]))
    pool = torch.zeros(2, 2, 16, 32)
    with pytest.raises(DTypeError, match="share"):
        wk.write_kv(torch.zeros(1, 2, 32), torch.zeros(1, 2, 32, dtype=torch.float16), torch.zeros(1).long(), pool,
                    pool)  # fmt: skip
    blocks = kd.random_kivi_blocks(0, 2, kv_heads=2, block_size=32, head_dim=32, staged=(1,))
    q = torch.zeros(1, 4, 32, dtype=torch.float16)
    with pytest.raises(DTypeError, match="staging"):
        kd.paged_decode_attention_kivi_packed(q, blocks, torch.zeros(1, 1, dtype=torch.int32), torch.ones(1).int())


def test_the_retuned_launches_that_spilled():
    """The planner's choices that keep every launch below the register file under Triton 3.6 and 3.9 (issue 25;
    measured by aot_check, table in docs/gpu.md). Each was a spill before: fp32 decode at head dim 128 with a
    64-token tile at block 64+ (255 registers, up to 2,384 B), int8/fp8 under fp32 queries with 2 stages
    (~500 B), KIVI with 4 warps (~300 B) or a 64-token tile (16 B at sm_87 under 3.6; fp32 at head dim 64:
    ~560 B), the fp16 prefill with 4
    warps at sm_87 under 3.6 (36 B), the fp32 prefill with a 32-token tile at sm_90 (~1 KB)."""
    f32, f16 = torch.float32, torch.float16
    assert {launch_plan.decode_config(4, t, 128, f32).tile for t in (8, 64, 128)} == {32}
    for quant in ("int8", "fp8"):
        assert launch_plan.decode_config(4, 16, 128, f32, quant).num_stages == 1
        assert launch_plan.decode_config(4, 16, 128, f16, quant).num_stages == 3
    assert launch_plan.kivi_config(4, 32, 128, f16) == launch_plan.DecodeConfig(32, 16, 8, 3)
    assert launch_plan.kivi_config(4, 32, 128, f32) == launch_plan.DecodeConfig(16, 16, 8, 2)
    assert launch_plan.kivi_config(4, 32, 64, f16) == launch_plan.DecodeConfig(64, 16, 8, 3)
    assert launch_plan.kivi_config(4, 32, 64, f32) == launch_plan.DecodeConfig(32, 16, 8, 2)  # 64: ~560 B, 4 warps: 4 B
    assert launch_plan.prefill_launch(4, 16, 128, f16) == launch_plan.PrefillConfig(16, 4, 64, 8, 2)
    assert launch_plan.prefill_launch(4, 16, 128, f32) == launch_plan.PrefillConfig(8, 4, 16, 8, 2)
    assert launch_plan.prefill_launch(4, 16, 64, f16) == launch_plan.PrefillConfig(16, 4, 64, 8, 2)  # 128: 60 B
    assert launch_plan.prefill_launch(4, 16, 64, f32) == launch_plan.PrefillConfig(8, 4, 16, 8, 2)  # was ~1.8 KB
    assert launch_plan.prefill_launch(4, 16, 32, f16).num_warps == 4
    assert launch_plan.kivi_config(4, 32, 32, f16).tile == 64  # 128 spilled 8 B at sm_90 under 3.6


def test_the_retuned_launches_that_spilled_in_the_full_run():
    """The full set under both Tritons (docs/gpu.md, 2026-12-02, second run) found more small spills, each
    retuned and recompiled without one: int8/fp8 under 16-bit queries at head dim 32 with a 128-token tile (4 B at
    sm_90 under 3.6; 64 tokens: 92-94 registers), fp32 decode at head dim 64 with 2 stages (8/16 B at sm_90 under
    3.6; 1 stage: 91), KIVI 2-bit under 16-bit queries at head dim 16 with a 64-token tile (8/4 B at sm_87 under
    3.9; 32 tokens: 107-128; under fp32 queries 32 spilled 8/12 B at sm_90 under 3.6, 64 none), the 16-bit
    prefill at head dim 16 with a 64-token tile and 16 query heads a KV head (4/4 B at sm_87 under 3.6; 32
    tokens: 76-106)."""
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    for quant, dtype, d in itertools.product(("int8", "fp8"), (f32, f16, bf16), (16, 32, 64, 128)):
        assert launch_plan.decode_config(16, 16, d, dtype, quant).tile <= 64
    assert launch_plan.decode_config(4, 16, 32, f16, "int8") == launch_plan.DecodeConfig(64, 16, 4, 3)
    assert launch_plan.decode_config(4, 16, 64, f32) == launch_plan.DecodeConfig(64, 16, 4, 1)
    assert launch_plan.decode_config(4, 16, 128, f32).num_stages == 2  # only head dim 64 needed it
    assert launch_plan.kivi_config(4, 32, 16, f16) == launch_plan.DecodeConfig(32, 16, 8, 3)
    assert launch_plan.kivi_config(4, 32, 16, f32) == launch_plan.DecodeConfig(64, 16, 8, 2)
    for dtype, tile in ((f16, 32), (bf16, 32), (f32, 16)):
        assert {launch_plan.prefill_launch(g, 16, 16, dtype).tile for g in (1, 4, 16)} == {tile}
    assert launch_plan.prefill_launch(16, 16, 32, f16).tile == 64
    assert launch_plan.kivi_config(4, 32, 32, f16).tile == 64


def test_each_launch_is_one_compilation_and_a_shared_one_compiles_once(monkeypatch):
    """The planner already dedupes: no two launches share a compilation (kernel, run-time signature, constexprs,
    hints, warps, stages), so every cell of the AOT table is its own compile. Were two to share one,
    ``compile_all`` compiles it once and gives both launches its row."""
    for capability in (87, 90):
        groups = specializations(capability)
        assert sorted(len(v) for v in groups.values()) == [1] * len(configs(capability, full=True))
    config = configs(90)[0]
    twin = dataclasses.replace(config, name=config.name + "_twin")
    compiled = []

    def fake_compile(cfg, capability):
        compiled.append(cfg.name)
        return aot_check.Resources(cfg.name, capability, 99, 0, 0, 0, ("ptx",))

    monkeypatch.setattr(aot_check, "_compile", fake_compile)
    monkeypatch.setattr(aot_check, "configs", lambda capability, full=False: [config, twin])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    got = aot_check.compile_all(90, only=config.name)
    assert compiled == [config.name]
    assert [(r.name, r.registers) for r in got] == [(config.name, 99), (twin.name, 99)]
    assert aot_check.compile_key(config) == aot_check.compile_key(twin)
    other = dataclasses.replace(config, num_warps=8)
    assert aot_check.compile_key(other) != aot_check.compile_key(config)
