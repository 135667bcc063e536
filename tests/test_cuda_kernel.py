"""The CUDA C++ paged decode kernel: compiled with nvcc for Jetson Orin (sm_87) and Hopper (sm_90) — compile
only here — and run against the reference where a CUDA device exists."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from memos_kernels.cuda import SOURCE


@pytest.mark.parametrize("arch", ["sm_87", "sm_90"])
def test_compiles_for(arch, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed here: the CUDA kernel can only be compiled where the CUDA toolkit is")
    obj = tmp_path / f"paged_decode_{arch}.o"
    done = subprocess.run([nvcc, "-c", f"-arch={arch}", "-o", str(obj), str(SOURCE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert obj.stat().st_size > 0
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump:
        listing = subprocess.run([cuobjdump, "--list-elf", str(obj)], capture_output=True, text=True).stdout
        assert arch in listing  # the object really holds code for that architecture


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the kernel is compiled, not run")
def test_runs_like_the_reference():  # pragma: no cover - needs a GPU
    from memos_kernels.cuda import paged_decode

    from memos_ref.attention import paged_attention

    g = torch.Generator().manual_seed(0)
    pool = torch.randn(12, 2, 2, 16, 64, generator=g).cuda()
    tables = torch.tensor([[3, 7, 1, -1], [0, 5, 9, 11]]).cuda()
    lens = torch.tensor([40, 64]).cuda()
    q = torch.randn(2, 8, 64, generator=g).cuda()
    got = paged_decode(q, pool[:, 0], pool[:, 1], tables, lens)
    want = paged_attention(q[:, :, None], pool[:, 0], pool[:, 1], tables, lens)[:, :, 0]
    assert torch.allclose(got, want, atol=1e-4)


def test_the_binding_refuses_bf16_and_mixed_devices():
    """Regression (issue 18): every non-fp32 dtype went down the fp16 path (bf16 failed with an unclear error) and
    no device was checked; now both are refused up front, before the extension is built."""
    from memos_kernels.cuda import paged_decode

    from memos_ref.errors import DeviceError, DTypeError

    pool = torch.zeros(2, 2, 2, 16, 64, dtype=torch.bfloat16)
    q, tables, lens = torch.zeros(1, 4, 64, dtype=torch.bfloat16), torch.tensor([[0]]), torch.tensor([3])
    with pytest.raises(DTypeError, match="bf16"):
        paged_decode(q, pool[:, 0], pool[:, 1], tables, lens)
    with pytest.raises(DeviceError, match="one CUDA device"):
        paged_decode(q.half(), pool[:, 0].half(), pool[:, 1].half(), tables.to("meta"), lens)
