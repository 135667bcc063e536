"""Compile every Triton kernel for a GPU architecture without a GPU (``python -m memos_kernels.aot_check 90``).

The interpreter that runs the kernel tests on a CPU skips some of the compiler's rules (for example, jit code
may only read module globals declared ``tl.constexpr``), so this compiles each kernel ahead of time for a real
target — to PTX and, with the ptxas bundled in Triton, to a cubin — and prints what it built.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["compile_all"]


def compile_all(capability: int) -> dict[str, list[str]]:
    """Compile every kernel of every kernel file (their ``KERNELS`` tuples) for ``sm_<capability>``; returns
    each case's compiled stages (``ttir`` ... ``cubin``). A kernel with no case here is an error."""
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("unset TRITON_INTERPRET: ahead-of-time compilation needs the real compiler")
    import triton
    from memos_kernels import copy_blocks, kivi_decode, paged_decode, paged_prefill, write_kv
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, 32)
    d16 = dict(G=4, GP=4, T=16, D=128, BLOCKS_PER_SPLIT=32)
    f32s = {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32"}  # the split-K partials
    # kernel, pointer dtypes (default *fp16), constexprs
    cases: dict[str, tuple] = {
        "decode_fp16": (paged_decode.decode_split_kernel, f32s, {**d16, "QUANT": 0}),
        "decode_int8": (
            paged_decode.decode_split_kernel,
            {**f32s, "kc_ptr": "*i8", "vc_ptr": "*i8"},
            {**d16, "QUANT": 1},
        ),
        "decode_reduce": (paged_decode.decode_reduce_kernel, f32s, dict(G=4, GP=4, D=128)),
        "decode_kivi4": (
            kivi_decode.decode_kivi_split_kernel,
            {**f32s, "kc_ptr": "*u8", "vc_ptr": "*u8"},
            {**d16, "T": 32, "BITS": 4, "GK": 32, "GV": 32},
        ),
        "write_kv": (write_kv.write_kv_kernel, {}, dict(T=16, D=128)),
        "write_kv_int8": (write_kv.write_kv_int8_kernel, {"kc_ptr": "*i8", "vc_ptr": "*i8"}, dict(T=16, D=128)),
        "copy_blocks": (copy_blocks.copy_blocks_kernel, {}, {"CHUNK": 1024}),
    }
    refused = set()
    if capability >= 89:  # float8e4nv needs sm_89+
        fp8 = {"kc_ptr": "*u8", "vc_ptr": "*u8", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
        cases["decode_fp8"] = (paged_decode.decode_split_kernel, {**f32s, **fp8}, {**d16, "QUANT": 2})
        cases["write_kv_fp8"] = (write_kv.write_kv_fp8_kernel, fp8, dict(T=16, D=128))
    else:
        refused.add(write_kv.write_kv_fp8_kernel)
    every = [k for module in (write_kv, paged_decode, kivi_decode, paged_prefill, copy_blocks) for k in module.KERNELS]
    covered = {case[0] for case in cases.values()} | refused
    missing = [k.__name__ for k in every if k not in covered]
    if missing:
        raise RuntimeError(f"kernels without an ahead-of-time case: {missing}: add them to compile_all")

    def signature(fn, pointers: dict[str, str], consts: dict[str, int]) -> dict[str, str]:
        """Every argument typed from its name: constexprs, pointers (``*_ptr``), the fp32 scale, else int64."""
        out = {}
        for name in fn.arg_names:
            if name in consts:
                out[name] = "constexpr"
            elif name.endswith("_ptr"):
                out[name] = pointers.get(
                    name,
                    "*i64" if name in ("slots_ptr", "tables_ptr", "lens_ptr", "slot_ptr", "pairs_ptr") else "*fp16",
                )
            else:
                out[name] = "fp32" if name == "scale" else "i64"
        return out

    built = {}
    for name, (fn, pointers, consts) in cases.items():
        source = ASTSource(fn=fn, signature=signature(fn, pointers, consts), constexprs=consts)
        kernel = triton.compile(source, target=target)
        built[name] = sorted(kernel.asm)
    return built


if __name__ == "__main__":
    print(json.dumps(compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
