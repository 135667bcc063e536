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
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("unset TRITON_INTERPRET: ahead-of-time compilation needs the real compiler")
    import triton
    from memos_kernels import triton_paged as tp
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, 32)
    i32, i64, f32 = "i32", "i64", "fp32"
    decode = dict(
        q_ptr="*fp16", kc_ptr="*fp16", vc_ptr="*fp16", tables_ptr="*i64", lens_ptr="*i64", acc_ptr="*fp32",
        m_ptr="*fp32", l_ptr="*fp32", ks_ptr="*fp16", vs_ptr="*fp16", scale=f32, s_qb=i32, s_qh=i32, s_cb=i64,
        s_ch=i64, s_ct=i64, s_sb=i64, s_sh=i64, s_st=i64, s_tb=i32, max_blocks=i32, num_splits=i32,
    )  # fmt: skip
    dconst = dict(G=4, GP=4, T=16, D=128, BLOCKS_PER_SPLIT=32)
    cases = {
        "decode_fp16": (tp._decode_split_kernel, decode, {**dconst, "QUANT": 0}),
        "decode_int8": (tp._decode_split_kernel, {**decode, "kc_ptr": "*i8", "vc_ptr": "*i8"}, {**dconst, "QUANT": 1}),
        "decode_reduce": (
            tp._decode_reduce_kernel,
            dict(acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", out_ptr="*fp16", s_ob=i32, s_oh=i32, num_splits=i32),
            dict(G=4, GP=4, D=128),
        ),
        "write_kv": (
            tp._write_kv_kernel,
            dict(
                key_ptr="*fp16",
                value_ptr="*fp16",
                slots_ptr="*i64",
                kc_ptr="*fp16",
                vc_ptr="*fp16",
                s_kn=i32,
                s_kh=i32,
                s_vn=i32,
                s_vh=i32,
                s_cb=i64,
                s_ch=i64,
                s_ct=i64,
            ),
            dict(T=16, D=128),
        ),
        "write_kv_int8": (
            tp._write_kv_int8_kernel,
            dict(
                key_ptr="*fp16",
                value_ptr="*fp16",
                slots_ptr="*i64",
                kc_ptr="*i8",
                vc_ptr="*i8",
                ks_ptr="*fp16",
                vs_ptr="*fp16",
                s_kn=i32,
                s_kh=i32,
                s_vn=i32,
                s_vh=i32,
                s_cb=i64,
                s_ch=i64,
                s_ct=i64,
                s_sb=i64,
                s_sh=i64,
                s_st=i64,
            ),
            dict(T=16, D=128),
        ),
        "copy_blocks": (
            tp._copy_blocks_kernel,
            dict(pool_ptr="*fp16", pairs_ptr="*i64", block_numel=i64),
            {"CHUNK": 1024},
        ),
    }
    cases["decode_kivi4"] = (
        tp._decode_kivi_split_kernel,
        dict(
            q_ptr="*fp16",
            tables_ptr="*i64",
            lens_ptr="*i64",
            acc_ptr="*fp32",
            m_ptr="*fp32",
            l_ptr="*fp32",
            kc_ptr="*u8",
            ks_ptr="*fp16",
            kz_ptr="*fp16",
            vc_ptr="*u8",
            vs_ptr="*fp16",
            vz_ptr="*fp16",
            stg_ptr="*fp16",
            slot_ptr="*i64",
            scale=f32,
            s_qb=i32,
            s_qh=i32,
            s_cb=i64,
            s_ch=i64,
            s_ct=i64,
            s_kb=i64,
            s_kh=i64,
            s_kg=i64,
            s_vb=i64,
            s_vh=i64,
            s_vt=i64,
            s_fb=i64,
            s_fk=i64,
            s_fh=i64,
            s_ft=i64,
            s_tb=i32,
            max_blocks=i32,
            num_splits=i32,
        ),
        {**dconst, "T": 32, "BITS": 4, "GK": 32, "GV": 32},
    )
    if capability >= 89:  # float8e4nv needs sm_89+
        cases["decode_fp8"] = (
            tp._decode_split_kernel,
            {**decode, "kc_ptr": "*u8", "vc_ptr": "*u8", "ks_ptr": "*fp32", "vs_ptr": "*fp32"},
            {**dconst, "QUANT": 2},
        )
        cases["write_kv_fp8"] = (
            tp._write_kv_fp8_kernel,
            dict(
                key_ptr="*fp16",
                value_ptr="*fp16",
                slots_ptr="*i64",
                kc_ptr="*u8",
                vc_ptr="*u8",
                ks_ptr="*fp32",
                vs_ptr="*fp32",
                s_kn=i32,
                s_kh=i32,
                s_vn=i32,
                s_vh=i32,
                s_cb=i64,
                s_ch=i64,
                s_ct=i64,
                s_sb=i64,
                s_sh=i64,
            ),
            dict(T=16, D=128),
        )
    built = {}
    for name, (fn, sig, consts) in cases.items():
        signature = {**sig, **dict.fromkeys(consts, "constexpr")}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=target)
        built[name] = sorted(kernel.asm)
    return built


if __name__ == "__main__":
    print(json.dumps(compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90)))
