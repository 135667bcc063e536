"""Compile every Triton kernel launch the package can make for a GPU architecture without a GPU, and report
registers, spills and local memory (``python -m memos_kernels.aot_check 87 90 [--full] [--table]``).

The interpreter that runs the kernel tests on a CPU skips some of the compiler's rules (for example, jit code
may only read module globals declared ``tl.constexpr``) and says nothing about resources, so this compiles each
kernel ahead of time for a real target — to PTX and, with the ptxas bundled in Triton, to a cubin — the way
Triton's launcher would specialize it at run time: integer arguments equal to 1 become constants, the others
32-bit with a divisibility-by-16 hint where the real value has one (strides of the canonical pool
``[N, L, 2, H, T, D]``), except the kernels' ``do_not_specialize`` geometry (block size, group), pointers 16-byte
aligned. ptxas' own report (``-v``) gives each configuration's registers, spill stores/loads and stack frame
(local memory) per thread.

The set is not a hand list: it is :func:`memos_kernels.launch_plan.launches`, the launch planner's enumeration of
every compilation the wrappers can ask for (element types, head dims, tiles, padded groups, one or several
splits, warps and stages). ``--full`` compiles all of it; the default compiles its :func:`hot` subset (head dim
128). Any spill fails the check (``spills``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

from memos_kernels.launch_plan import Launch, launches

__all__ = ["Config", "Resources", "compile_all", "compile_key", "config_for", "configs", "format_table",
           "format_versions", "hot", "load_results", "specializations", "spills"]  # fmt: skip

LAYERS = 32  # the pool's layer axis, for realistic strides (Llama-3-8B)


@dataclass(frozen=True)
class Config:
    """One specialization to compile: the kernel's name in its module, every pointer's element type,
    constexprs, integer argument values (as the wrapper would pass them), the launch options and the planner's
    :class:`~memos_kernels.launch_plan.Launch` it compiles."""

    name: str
    module: str
    kernel: str
    pointers: dict[str, str]
    consts: dict[str, Any]
    ints: dict[str, int]
    num_warps: int = 4
    num_stages: int = 3
    launch: Launch | None = None


@dataclass(frozen=True)
class Resources:
    """What ptxas reported for one compiled configuration (per thread)."""

    name: str
    capability: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    stages: tuple[str, ...]

    @property
    def spilled(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


_INDEX_TYPES = {"tables_ptr": "*i32", "lens_ptr": "*i32", "qlens_ptr": "*i32", "slots_ptr": "*i64",
                "slot_ptr": "*i64", "pairs_ptr": "*i64"}  # the package's own index dtypes  # fmt: skip


def _ints(launch: Launch) -> dict[str, int]:
    """The integer arguments a wrapper passes for ``launch`` on a layer view of a 32-layer pool with 8 KV heads,
    2,048-token tables and 4,096 blocks (its runtime geometry from ``launch.example``)."""
    c, ex, h = dict(launch.consts), dict(launch.example), 8
    d, t, g = c.get("D", 128), ex.get("T", 16), ex.get("G", 4)
    tile = c.get("TILE", 64)
    q = dict(s_qb=h * g * d, s_qh=d)
    cache = dict(s_cb=LAYERS * 2 * h * t * d, s_ch=t * d, s_ct=d)
    table = dict(s_tb=2048 // t, s_tc=1, width=2048 // t, num_blocks=4096)
    kernel = launch.kernel
    if kernel == "decode_split_kernel":
        quant = c["QUANT"]
        scales = [dict(s_sb=0, s_sh=0, s_st=0), dict(s_sb=LAYERS * 2 * h * t, s_sh=t, s_st=1),
                  dict(s_sb=LAYERS * 2 * h, s_sh=1, s_st=0)][quant]  # fmt: skip
        return dict(**q, **cache, **scales, **table, tokens_per_split=8 * tile, s_ob=h * g * d, s_oh=d, G=g, T=t,
                    DIRECT=0)  # fmt: skip
    if kernel == "decode_reduce_kernel":
        return dict(s_ob=h * g * d, s_oh=d, num_splits=8, tokens_per_split=512, G=g)
    if kernel == "decode_kivi_split_kernel":
        bits, gk, gv = c["BITS"], ex["GK"], min(ex["GV"], d)
        packed = d * bits // 8
        return dict(
            **q, s_cb=LAYERS * h * t * packed, s_ch=t * packed, s_ct=packed,
            s_kb=LAYERS * h * (t // gk) * d, s_kh=(t // gk) * d, s_kg=d,
            s_vb=LAYERS * h * t * (d // gv), s_vh=t * (d // gv), s_vt=d // gv,
            s_fb=LAYERS * 2 * h * t * d, s_fk=h * t * d, s_fh=t * d, s_ft=d,
            **table, num_staged=512, tokens_per_split=8 * tile, s_ob=h * g * d, s_oh=d,
            G=g, T=t, GK=gk, GV=gv, DIRECT=0,
        )  # fmt: skip
    if kernel == "prefill_kernel":
        n = 512
        pq = dict(s_qb=h * g * n * d, s_qh=n * d, s_qq=d)
        return dict(**pq, s_ob=pq["s_qb"], s_oh=pq["s_qh"], s_oq=d, **cache, **table, num_q=n, G=g, T=t)
    if kernel.startswith("write_kv"):
        ints = dict(s_kn=h * d, s_kh=d, s_vn=h * d, s_vh=d, **cache, num_slots=4096 * t, T=t)
        if kernel == "write_kv_int8_kernel":
            ints.update(s_sb=LAYERS * 2 * h * t, s_sh=t, s_st=1)
        elif kernel == "write_kv_fp8_kernel":
            ints.update(s_sb=LAYERS * 2 * h, s_sh=1, s_st=0)
        return ints
    if kernel == "copy_blocks_kernel":
        return dict(block_numel=2 * h * 16 * 128, num_blocks=4096)
    raise RuntimeError(f"no integer arguments known for {kernel}: teach aot_check._ints about it")


def config_for(launch: Launch) -> Config:
    """The :class:`Config` that compiles ``launch``: its pointer types (index pointers the package's own
    int32/int64), constexprs, warps and stages, and realistic integer arguments."""
    pointers = {k: f"*{v}" for k, v in launch.pointers} | _INDEX_TYPES
    return Config(launch.name, _MODULES[launch.kernel], launch.kernel, pointers, dict(launch.consts), _ints(launch),
                  launch.num_warps, launch.num_stages, launch)  # fmt: skip


_MODULES = {"decode_split_kernel": "paged_decode", "decode_reduce_kernel": "paged_decode",
            "decode_kivi_split_kernel": "kivi_decode", "prefill_kernel": "paged_prefill",
            "write_kv_kernel": "write_kv", "write_kv_int8_kernel": "write_kv", "write_kv_fp8_kernel": "write_kv",
            "copy_blocks_kernel": "copy_blocks"}  # fmt: skip


def hot(launch: Launch) -> bool:
    """The default (quick) subset: head dim 128 (the heaviest), fp32 and fp16 queries (bf16 compiles to the same
    16-bit ``tl.dot`` path and registers as fp16), every cache (float, int8, fp8, KIVI 2/4-bit), the prefill at 1,
    4 and 16 query heads per KV head, and one fp16 launch of each light kernel (reduce, writes, copy);
    ``--full`` compiles every launch."""
    c, p = dict(launch.consts), dict(launch.pointers)
    elt = p.get("q_ptr") or p.get("key_ptr") or p.get("pool_ptr") or p.get("out_ptr")
    if c.get("D", 128) != 128 or elt not in ("fp32", "fp16"):
        return False
    if launch.kernel == "prefill_kernel":
        return c["GP"] in (1, 4, 16)
    return launch.kernel.startswith("decode_split") or "kivi" in launch.kernel or elt == "fp16"


def configs(capability: int, full: bool = False) -> list[Config]:
    """The configurations to compile for ``sm_<capability>``: every launch of the package's launch planner
    (:func:`memos_kernels.launch_plan.launches`), the :func:`hot` ones first, or without ``full`` only those."""
    every = launches(capability)
    chosen = [x for x in every if hot(x)] + ([x for x in every if not hot(x)] if full else [])
    return [config_for(x) for x in chosen]


def _signature(fn: Any, config: Config) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int], list]]:
    """Triton's run-time specialization of ``config``: ints equal to 1 are constants, others i32 (a divisibility
    hint when a multiple of 16); pointers typed from ``config.pointers`` (default ``*fp16``), 16-byte aligned;
    ``scale``-like floats fp32."""
    signature, consts, attrs = {}, dict(config.consts), {}
    runtime = set(getattr(fn, "do_not_specialize", ()) or ())
    for i, name in enumerate(fn.arg_names):
        if name in config.consts:
            signature[name] = "constexpr"
        elif name in runtime or i in runtime:
            signature[name] = "i32"  # do_not_specialize: no ==1 constant, no divisibility hint
        elif name.endswith("_ptr"):
            signature[name] = config.pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in config.ints and config.ints[name] == 1:
            signature[name] = "constexpr"
            consts[name] = 1
        elif name in config.ints:
            signature[name] = "i32"
            if config.ints[name] % 16 == 0 and config.ints[name]:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    return signature, consts, attrs


_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def _compile(config: Config, capability: int) -> Resources:
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"memos_kernels.{config.module}"), config.kernel)
    signature, consts, attrs = _signature(fn, config)
    source = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    log = io.StringIO()
    with contextlib.redirect_stdout(log), knobs.nvidia.scope():
        knobs.nvidia.dump_ptxas_log = True
        kernel = triton.compile(
            source,
            target=GPUTarget("cuda", capability, 32),
            options={"num_warps": config.num_warps, "num_stages": config.num_stages},
        )
    text = log.getvalue()
    if not _REGS.search(text):  # a cache hit ran no ptxas: ask ptxas for the report on the cached PTX
        text = _ptxas_report(kernel.asm["ptx"], capability)
    regs = _REGS.search(text)
    spill = _PTXAS.search(text)
    if regs is None or spill is None:
        raise RuntimeError(f"{config.name}: no resource report from ptxas:\n{text[-2000:]}")
    stack, stores, loads = (int(x) for x in spill.groups())
    return Resources(config.name, capability, int(regs.group(1)), stores, loads, stack, tuple(sorted(kernel.asm)))


def _ptxas_report(ptx: str, capability: int) -> str:
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        arch = sm_arch_from_capability(capability)
        cmd = [get_ptxas(capability).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", src, "-o",
               os.path.join(tmp, "k.cubin")]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stderr


def compile_all(capability: int, full: bool = False, *, only: str | None = None,
                jsonl: str | None = None) -> list[Resources]:  # fmt: skip
    """Compile every configuration of :func:`configs` for ``sm_<capability>`` (those whose name contains one of
    the comma-separated ``only``, when given); without ``only`` every kernel of every kernel file (their
    ``KERNELS`` tuples) must have one (fp8 kernels only at sm_89+). ``jsonl`` names a file that gets each result
    as a JSON line as soon as it is compiled (a long run that is cut short keeps what it measured)."""
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("unset TRITON_INTERPRET: ahead-of-time compilation needs the real compiler")
    import importlib

    import triton

    chosen = configs(capability, full)
    if only:
        chosen = [c for c in chosen if any(part in c.name for part in only.split(","))]
    else:
        modules = ("write_kv", "paged_decode", "kivi_decode", "paged_prefill", "copy_blocks")
        every = {k.__name__ for m in modules for k in importlib.import_module(f"memos_kernels.{m}").KERNELS}
        covered = {c.kernel for c in chosen} | ({"write_kv_fp8_kernel"} if capability < 89 else set())
        if every - covered:
            raise RuntimeError(f"kernels without an ahead-of-time case: {sorted(every - covered)}: add them")
    out, done = [], {}
    for config in chosen:  # each distinct specialization compiled once; every launch it covers gets its row
        key = compile_key(config)
        if key not in done:
            done[key] = _compile(config, capability)
        out.append(replace(done[key], name=config.name))
        if jsonl:
            with open(jsonl, "a") as f:
                f.write(json.dumps({"triton": triton.__version__, **asdict(out[-1])}) + "\n")
    return out


def compile_key(config: Config) -> tuple:
    """What Triton compiles for ``config``: the kernel, its run-time signature (pointer and integer types,
    ``==1`` constants), constexprs, divisibility hints, warps and stages. Two configurations with one key share
    one binary (:func:`compile_all` compiles it once)."""
    import importlib

    fn = getattr(importlib.import_module(f"memos_kernels.{config.module}"), config.kernel)
    signature, consts, attrs = _signature(fn, config)
    consts_key = tuple(sorted((k, repr(v)) for k, v in consts.items()))
    attrs_key = tuple(sorted((k, repr(v)) for k, v in attrs.items()))
    return (config.module, config.kernel, tuple(signature.items()), consts_key, attrs_key, config.num_warps,
            config.num_stages)  # fmt: skip


def specializations(capability: int, full: bool = True) -> dict[tuple, list[str]]:
    """The launches of :func:`configs` grouped by :func:`compile_key`: each key is one compilation, its list the
    launch names it serves."""
    groups: dict[tuple, list[str]] = {}
    for config in configs(capability, full):
        groups.setdefault(compile_key(config), []).append(config.name)
    return groups


def spills(resources: list[Resources]) -> list[str]:
    """The configurations that spill (any launch the package can make): each as ``name@sm_XX``."""
    return [f"{r.name}@sm_{r.capability}" for r in resources if r.spilled]


def format_table(resources: list[Resources]) -> str:
    """A markdown table: configuration, target, registers, spill stores/loads and stack bytes per thread."""
    lines = [
        "| config | target | registers | spill stores (B) | spill loads (B) | stack (B) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r.name} | sm_{r.capability} | {r.registers} | {r.spill_stores} | {r.spill_loads} | {r.stack_bytes} |"
              for r in resources]  # fmt: skip
    return "\n".join(lines)


def load_results(*paths: str) -> list[dict[str, Any]]:
    """JSON lines of ``--jsonl`` runs (several files, several Triton versions), the last result of each (Triton
    version, target, configuration) kept."""
    rows: dict[tuple[str, int, str], dict[str, Any]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    rows[(r["triton"], r["capability"], r["name"])] = r
    return list(rows.values())


def format_versions(rows: list[dict[str, Any]], capabilities: tuple[int, ...] = (87, 90)) -> str:
    """The register table of every launch the planner enumerates, one column per (Triton version, target):
    ``registers`` or ``registers, stores/loads B`` when it spills, ``—`` where the launch does not exist (fp8
    at sm_87), ``?`` where it was not compiled; a summary line first."""
    got = {(r["triton"], r["capability"], r["name"]): r for r in rows}
    versions = sorted({r["triton"] for r in rows}, key=lambda v: tuple(int(x) for x in v.split(".")))
    cols = [(v, c) for v in versions for c in capabilities]
    names = {c: {x.name for x in launches(c)} for c in capabilities}
    order = list(dict.fromkeys(x.name for c in capabilities for x in launches(c)))

    def cell(v: str, c: int, name: str) -> str:
        if name not in names[c]:
            return "—"
        r = got.get((v, c, name))
        if r is None:
            return "?"
        spill = f", {r['spill_stores']}/{r['spill_loads']} B" if r["spill_stores"] or r["spill_loads"] else ""
        return f"{r['registers']}{spill}"

    cells = {(v, c, n): cell(v, c, n) for v, c in cols for n in order}
    spilled = sum("B" in x for x in cells.values())
    missing = sum(x == "?" for x in cells.values())
    lines = [f"{len(order)} launches × {len(cols)} (Triton version, target) columns: {spilled} spill, "
             f"{missing} not compiled.", "",
             "| launch | " + " | ".join(f"{v} sm_{c}" for v, c in cols) + " |",
             "|---|" + "---|" * len(cols)]  # fmt: skip
    lines += [f"| {n} | " + " | ".join(cells[(v, c, n)] for v, c in cols) + " |" for n in order]
    return "\n".join(lines)


def _option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None


def main(argv: list[str] | None = None) -> int:
    """``aot_check [CAPABILITY...] [--full] [--table] [--only NAME,...] [--jsonl PATH]``: one JSON report on the
    last line of stdout (the Triton version, every configuration's resources, the spilled ones);
    ``aot_check --render RESULTS.jsonl...`` prints :func:`format_versions` of earlier runs."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--render"]:  # aot_check --render RESULTS.jsonl...: the docs' table of several runs
        print(format_versions(load_results(*args[1:])))
        return 0
    full, table = "--full" in args, "--table" in args
    only, jsonl = _option(args, "--only"), _option(args, "--jsonl")
    caps = [int(a) for a in args if a.isdigit()] or [90]
    resources = [r for cap in caps for r in compile_all(cap, full, only=only, jsonl=jsonl)]
    if table:
        print(format_table(resources))
    import triton

    report = {"triton": triton.__version__, "full": full, "resources": [asdict(r) for r in resources],
              "hot_spills": spills(resources)}  # fmt: skip
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
