"""Compile every Triton kernel for a GPU architecture without a GPU, with the signatures the package's calls would
get, and report registers, spills and local memory (``python -m memos_kernels.aot_check 90 [--full] [--table]``).

The interpreter that runs the kernel tests on a CPU skips some of the compiler's rules (for example, jit code
may only read module globals declared ``tl.constexpr``) and says nothing about resources, so this compiles each
kernel ahead of time for a real target — to PTX and, with the ptxas bundled in Triton, to a cubin — the way
Triton's launcher would specialize it at run time: integer arguments equal to 1 become constants, the others
32-bit with a divisibility-by-16 hint where the real value has one (strides of the canonical pool
``[N, L, 2, H, T, D]``), pointers 16-byte aligned, and the launch's ``num_warps``/``num_stages`` from
:func:`memos_kernels.paged_decode.decode_config`. ptxas' own report (``-v``) gives each configuration's
registers, spill stores/loads and stack frame (local memory) per thread.

The default set is the package's hot configurations (fp16/bf16 decode at GQA 4 and 8, head dim 64 and 128,
blocks 16 and 64, int8/fp8/KIVI decode, the writes, the reduce, block copies); ``--full`` compiles the whole
matrix: fp16/bf16 × GQA 1/4/8 × block 16/32/64 × head dim 64/128, and KIVI 2 and 4 bits.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["HOT_KERNELS", "Config", "Resources", "compile_all", "configs", "format_table", "spills"]

HOT_KERNELS = ("decode", "write_kv")  # a spill in these fails the check (the decode step's hot loop)
LAYERS = 32  # the pool's layer axis, for realistic strides (Llama-3-8B)


@dataclass(frozen=True)
class Config:
    """One specialization to compile: the kernel's name in its module, pointer element types (default
    ``*fp16``), constexprs, integer argument values (as the wrapper would pass them) and the launch options."""

    name: str
    module: str
    kernel: str
    pointers: dict[str, str]
    consts: dict[str, Any]
    ints: dict[str, int]
    num_warps: int = 4
    num_stages: int = 3


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


def _decode_config(dtype: str, group: int, block: int, head_dim: int, quant: str = "none") -> Config:
    """The decode split kernel as ``paged_decode_attention`` launches it on a layer view of a 32-layer pool."""
    import torch
    from memos_kernels.paged_decode import QUANT_MODES, decode_config

    tdtype = torch.float16 if dtype == "fp16" else torch.bfloat16
    cfg = decode_config(group, block, head_dim, tdtype)
    elt = {"fp16": "*fp16", "bf16": "*bf16"}[dtype]
    pointers = {"q_ptr": elt, "kc_ptr": elt, "vc_ptr": elt, "tables_ptr": "*i32", "lens_ptr": "*i32",
                "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "ks_ptr": elt, "vs_ptr": elt,
                "out_ptr": elt}  # fmt: skip
    s_st = 0
    if quant == "int8":
        pointers.update(kc_ptr="*i8", vc_ptr="*i8", ks_ptr="*fp16", vs_ptr="*fp16")
        s_sb, s_sh, s_st = LAYERS * 2 * 8 * block, block, 1
    elif quant == "fp8":
        pointers.update(kc_ptr="*u8", vc_ptr="*u8", ks_ptr="*fp32", vs_ptr="*fp32")
        s_sb, s_sh = LAYERS * 2 * 8, 1
    else:
        s_sb = s_sh = 0
    ints = dict(
        s_qb=8 * group * head_dim, s_qh=head_dim,
        s_cb=LAYERS * 2 * 8 * block * head_dim, s_ch=block * head_dim, s_ct=head_dim,
        s_sb=s_sb, s_sh=s_sh, s_st=s_st, s_tb=2048 // block, s_tc=1, tokens_per_split=8 * cfg.tile,
        s_ob=8 * group * head_dim, s_oh=head_dim, width=2048 // block, num_blocks=4096,
    )  # fmt: skip
    consts = dict(G=group, GP=cfg.gp, T=block, D=head_dim, TILE=cfg.tile, QUANT=QUANT_MODES[quant], DOT_F32=False,
                  PREC="tf32", DIRECT=False)  # fmt: skip
    name = f"decode_{quant if quant != 'none' else dtype}_g{group}_t{block}_d{head_dim}"
    return Config(name, "paged_decode", "decode_split_kernel", pointers, consts, ints, cfg.num_warps, cfg.num_stages)


def _kivi_config(bits: int, group: int, head_dim: int) -> Config:
    import torch
    from memos_kernels.kivi_decode import kivi_warps
    from memos_kernels.paged_decode import decode_config

    block, kg = 32, 32
    cfg = decode_config(group, block, head_dim, torch.float16)
    pointers = {"tables_ptr": "*i32", "lens_ptr": "*i32", "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32",
                "kc_ptr": "*u8", "vc_ptr": "*u8", "slot_ptr": "*i64", "out_ptr": "*fp16"}  # fmt: skip
    packed = head_dim * bits // 8
    ints = dict(
        s_qb=8 * group * head_dim, s_qh=head_dim,
        s_cb=LAYERS * 8 * block * packed, s_ch=block * packed, s_ct=packed,
        s_kb=LAYERS * 8 * (block // kg) * head_dim, s_kh=(block // kg) * head_dim, s_kg=head_dim,
        s_vb=LAYERS * 8 * block * (head_dim // kg), s_vh=block * (head_dim // kg), s_vt=head_dim // kg,
        s_fb=LAYERS * 2 * 8 * block * head_dim, s_fk=8 * block * head_dim, s_fh=block * head_dim, s_ft=head_dim,
        s_tb=64, s_tc=1, tokens_per_split=8 * cfg.tile,
        s_ob=8 * group * head_dim, s_oh=head_dim, width=64, num_blocks=4096, num_staged=512,
    )  # fmt: skip
    consts = dict(G=group, GP=cfg.gp, T=block, D=head_dim, TILE=cfg.tile, BITS=bits, GK=kg, GV=kg, DOT_F32=False,
                  PREC="tf32", DIRECT=False)  # fmt: skip
    return Config(f"decode_kivi{bits}_g{group}_d{head_dim}", "kivi_decode", "decode_kivi_split_kernel", pointers,
                  consts, ints, kivi_warps(head_dim), cfg.num_stages)  # fmt: skip


def _prefill_config(dtype: str, group: int, block: int, head_dim: int) -> Config:
    """The tiled prefill kernel as ``paged_prefill_attention`` launches it (a 512-query chunk, 32-layer pool)."""
    import torch
    from memos_kernels.paged_prefill import prefill_config

    qb, gp, tile = prefill_config(group, block, head_dim, torch.float16 if dtype == "fp16" else torch.bfloat16)
    elt = {"fp16": "*fp16", "bf16": "*bf16"}[dtype]
    pointers = {"q_ptr": elt, "kc_ptr": elt, "vc_ptr": elt, "out_ptr": elt, "tables_ptr": "*i32", "lens_ptr": "*i32",
                "qlens_ptr": "*i32"}  # fmt: skip
    q = dict(s_qb=8 * group * 512 * head_dim, s_qh=512 * head_dim, s_qq=head_dim)
    ints = dict(**q, s_ob=q["s_qb"], s_oh=q["s_qh"], s_oq=head_dim,
                s_cb=LAYERS * 2 * 8 * block * head_dim, s_ch=block * head_dim, s_ct=head_dim,
                s_tb=2048 // block, s_tc=1, width=2048 // block, num_blocks=4096, num_q=512)  # fmt: skip
    consts = dict(G=group, GP=gp, QB=qb, T=block, D=head_dim, TILE=tile, DOT_F32=False, PREC="tf32")
    return Config(f"prefill_{dtype}_g{group}_t{block}_d{head_dim}", "paged_prefill", "prefill_kernel", pointers,
                  consts, ints, num_warps=4, num_stages=2)  # fmt: skip


def _write_configs(block: int, head_dim: int, capability: int) -> list[Config]:
    h = 8
    strides = dict(s_kn=h * head_dim, s_kh=head_dim, s_vn=h * head_dim, s_vh=head_dim,
                   s_cb=LAYERS * 2 * h * block * head_dim, s_ch=block * head_dim, s_ct=head_dim,
                   num_slots=4096 * block)  # fmt: skip
    consts = dict(T=block, D=head_dim)
    out = [
        Config(f"write_kv_t{block}_d{head_dim}", "write_kv", "write_kv_kernel", {"slots_ptr": "*i64"}, consts,
               strides, num_stages=1),
        Config(f"write_kv_int8_t{block}_d{head_dim}", "write_kv", "write_kv_int8_kernel",
               {"slots_ptr": "*i64", "kc_ptr": "*i8", "vc_ptr": "*i8"}, consts,
               {**strides, "s_sb": LAYERS * 2 * h * block, "s_sh": block, "s_st": 1}, num_stages=1),
    ]  # fmt: skip
    if capability >= 89:  # float8e4nv needs sm_89+
        out.append(Config(f"write_kv_fp8_t{block}_d{head_dim}", "write_kv", "write_kv_fp8_kernel",
                          {"slots_ptr": "*i64", "kc_ptr": "*u8", "vc_ptr": "*u8", "ks_ptr": "*fp32",
                           "vs_ptr": "*fp32"}, consts,
                          {**strides, "s_sb": LAYERS * 2 * h, "s_sh": 1, "s_st": 0}, num_stages=1))  # fmt: skip
    return out


def configs(capability: int, full: bool = False) -> list[Config]:
    """The configurations to compile for ``sm_<capability>``: the hot set, or with ``full`` the whole matrix."""
    if full:
        grid = itertools.product(("fp16", "bf16"), (1, 4, 8), (16, 32, 64), (64, 128))
        decode = [_decode_config(dt, g, t, d) for dt, g, t, d in grid]
        kivi = [_kivi_config(bits, g, d) for bits, g, d in itertools.product((2, 4), (1, 4, 8), (64, 128))]
        writes = [c for t, d in itertools.product((16, 32, 64), (64, 128)) for c in _write_configs(t, d, capability)]
    else:
        decode = [_decode_config("fp16", 4, 16, 128), _decode_config("bf16", 8, 16, 128),
                  _decode_config("fp16", 8, 64, 64)]  # fmt: skip
        kivi = [_kivi_config(4, 4, 128)]
        writes = _write_configs(16, 128, capability)
    decode.append(_decode_config("fp16", 4, 128, 128))  # block 128: the tile capped at 64 (issue 25)
    quant = [_decode_config("fp16", 4, 16, 128, "int8"), _decode_config("fp16", 4, 128, 128, "int8")]
    if capability >= 89:
        quant += [_decode_config("fp16", 4, 16, 128, "fp8"), _decode_config("fp16", 4, 128, 128, "fp8")]
    reduce = Config("decode_reduce_g4_d128", "paged_decode", "decode_reduce_kernel",
                    {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "lens_ptr": "*i32"},
                    dict(G=4, GP=16, D=128),
                    dict(s_ob=32 * 128, s_oh=128, num_splits=8, tokens_per_split=512))  # fmt: skip
    copy = Config("copy_blocks", "copy_blocks", "copy_blocks_kernel", {"pairs_ptr": "*i64"}, {"CHUNK": 1024},
                  {"block_numel": 2 * 8 * 16 * 128, "num_blocks": 4096})  # fmt: skip
    prefill = [_prefill_config("fp16", 4, 16, 128)]
    return decode + quant + kivi + writes + prefill + [reduce, copy]


def _signature(fn: Any, config: Config) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int], list]]:
    """Triton's run-time specialization of ``config``: ints equal to 1 are constants, others i32 (a divisibility
    hint when a multiple of 16); pointers typed from ``config.pointers`` (default ``*fp16``), 16-byte aligned;
    ``scale``-like floats fp32."""
    signature, consts, attrs = {}, dict(config.consts), {}
    for i, name in enumerate(fn.arg_names):
        if name in config.consts:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = config.pointers.get(name, "*fp16")
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


def compile_all(capability: int, full: bool = False) -> list[Resources]:
    """Compile every configuration of :func:`configs` for ``sm_<capability>``; every kernel of every kernel
    file (their ``KERNELS`` tuples) must have one (fp8 kernels only at sm_89+)."""
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("unset TRITON_INTERPRET: ahead-of-time compilation needs the real compiler")
    import importlib

    chosen = configs(capability, full)
    modules = ("write_kv", "paged_decode", "kivi_decode", "paged_prefill", "copy_blocks")
    every = {k.__name__ for m in modules for k in importlib.import_module(f"memos_kernels.{m}").KERNELS}
    covered = {c.kernel for c in chosen} | ({"write_kv_fp8_kernel"} if capability < 89 else set())
    if every - covered:
        raise RuntimeError(f"kernels without an ahead-of-time case: {sorted(every - covered)}: add them to configs")
    return [_compile(c, capability) for c in chosen]


def spills(resources: list[Resources]) -> list[str]:
    """The hot configurations (:data:`HOT_KERNELS`) that spill: each as ``name@sm_XX``."""
    return [f"{r.name}@sm_{r.capability}" for r in resources if r.spilled and r.name.startswith(HOT_KERNELS)]


def format_table(resources: list[Resources]) -> str:
    """A markdown table: configuration, target, registers, spill stores/loads and stack bytes per thread."""
    lines = [
        "| config | target | registers | spill stores (B) | spill loads (B) | stack (B) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {r.name} | sm_{r.capability} | {r.registers} | {r.spill_stores} | {r.spill_loads} | {r.stack_bytes} |"
              for r in resources]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    full, table = "--full" in args, "--table" in args
    caps = [int(a) for a in args if a.isdigit()] or [90]
    resources = [r for cap in caps for r in compile_all(cap, full)]
    if table:
        print(format_table(resources))
    print(json.dumps({"resources": [asdict(r) for r in resources], "hot_spills": spills(resources)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
