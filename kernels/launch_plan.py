"""The launch planner: every kernel launch's configuration (token tile, padded group, warps, stages), the domain of
launches the package makes with compiled code (a GPU), and its enumeration for ahead-of-time compilation.

Each wrapper asks this module how to launch (:func:`decode_config`, :func:`prefill_launch`, :func:`kivi_config`)
and refuses, on a compiled device, a geometry outside :func:`fits` (``ConfigError``); the package's attention
switch sends such geometries to the torch reference instead. :func:`launches` lists every distinct compilation
those wrappers can ask Triton for on ``sm_<capability>`` — the kernel, the element type of each data pointer, the
``constexpr`` values, ``num_warps`` and ``num_stages`` — so ``python -m memos_kernels.aot_check`` compiles
exactly the set the package can launch, never a hand-picked one (``tests/test_kernels_plan.py`` records the
wrappers' real launches and checks each is in it).

Block size ``T``, query group ``G`` and KIVI's groups are *runtime* arguments of the kernels (``do_not_specialize``:
they enter only masks and address arithmetic), so they add no compilation; the tile, the padded group ``GP`` and
the element types do. Index tensors (block tables, lengths, slot maps, pairs) may be int32 or int64; their width is
not part of a launch's key (one load per token; :data:`INDEX_POINTERS`), the compilation uses the package's own
(int32 tables and lengths, int64 slots).

Interpreted launches (CPU tensors, ``TRITON_INTERPRET=1``) are not compiled: there any power-of-two head dim and
group works, as the interpreter tests use.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from memos_ref.errors import ConfigError

__all__ = [
    "BLOCK_SIZES",
    "DTYPES",
    "HEAD_DIMS",
    "INDEX_POINTERS",
    "KIVI_BITS",
    "KIVI_GROUPS",
    "MAX_GROUP",
    "POOL_DTYPES",
    "RUNTIME_ARGS",
    "DecodeConfig",
    "Launch",
    "PrefillConfig",
    "check_launchable",
    "compiled",
    "decode_config",
    "fits",
    "kivi_config",
    "launches",
    "prefill_launch",
]

#: The element types of float pools and queries, by Triton's name.
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: Head dims a compiled launch takes (others run the reference on a GPU): the models' 64 and 128, and the 16 and
#: 32 of the tests' tiny models.
HEAD_DIMS = (16, 32, 64, 128)
#: Block sizes of a pool the kernels read (powers of two).
BLOCK_SIZES = (8, 16, 32, 64, 128)
#: The largest query group (query heads per KV head) of a compiled launch: the decode kernels pad it to 16 rows.
MAX_GROUP = 16
KIVI_BITS = (2, 4)
KIVI_GROUPS = (16, 32, 64, 128)
#: Pointer arguments holding indices (int32 or int64): not part of a launch's key.
INDEX_POINTERS = frozenset({"tables_ptr", "lens_ptr", "qlens_ptr", "slots_ptr", "slot_ptr", "pairs_ptr"})
#: The kernels' runtime geometry (``do_not_specialize``): block size, query group, KIVI's key and value groups,
#: and the one-split flag (a uniform branch at the end: one compilation serves one split and several).
RUNTIME_ARGS = ("G", "T", "GK", "GV", "DIRECT")
#: What ``copy_blocks`` copies: float pools, int8 and fp8 (uint8) codes.
POOL_DTYPES: dict[str, torch.dtype] = {**DTYPES, "i8": torch.int8, "u8": torch.uint8}
_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# ---------------------------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class DecodeConfig:
    """The launch configuration of one decode specialization: the token tile (independent of the block size),
    the query group padded to ``tl.dot``'s 16 rows, warps and pipeline stages."""

    tile: int
    gp: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class PrefillConfig:
    """The prefill kernel's launch: ``QB`` query positions × the group padded to ``GP`` rows per program, the
    token tile, warps and stages."""

    qb: int
    gp: int
    tile: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=256)
def decode_config(group: int, block_size: int, head_dim: int, dtype: torch.dtype, quant: str = "none") -> DecodeConfig:
    """Tile and launch parameters for a query group, block size, head dim, query element type and cache
    (``quant``: ``"none"``, ``"int8"``, ``"fp8"`` or ``"kivi"``): a tile of about 16 KiB of K per stage (128
    tokens at head dim 64 in 16 bits, 64 at 128; fp32 64 and 32), never below 16 tokens (``tl.dot``'s minimum)
    and at most 64 at head dim 128 and above (128 × 128 spills: block 128, int8 116 B, fp8 164 B); a tile may
    read part of a block or several, so ``block_size`` does not change the plan. 4 warps, 3 stages (2 at fp32,
    for shared memory). Retuned so that no launch spills under Triton 3.6 or 3.9 at sm_87/sm_90 (the registers
    are in docs/gpu.md):

    - int8/fp8 caches under fp32 queries: 1 stage (2 spill ~500 B: the dequantized fp32 tile of the next stage
      stays live beside the exact fp32 products);
    - KIVI: 8 warps and a tile of at most 4,096 unpacked elements (2,048 under fp32 queries): the unpacking holds
      codes, scales and zeros of a tile; at head dim 128 4 warps spill ~300 B under 3.6, a 64-token tile 16 B at
      sm_87, 32 tokens in fp32 ~150 B; at head dim 64 in fp32 64 tokens ~560 B, 32 tokens with 4 warps 4 B; at
      head dim 16 under 16-bit queries a 32-token tile (64: 8/4 B at sm_87 under 3.9, 2-bit; under fp32 queries
      32 spilled 8/12 B at sm_90 under 3.6 and 64 does not);
    - int8/fp8 caches: a tile of at most 64 tokens (128 at head dim 32 under 16-bit queries: 4 B at sm_90 under
      3.6);
    - fp32 queries on a float cache at head dim 64: 1 stage (2: 8/16 B at sm_90 under 3.6)."""
    del block_size
    elt = 4 if dtype == torch.float32 else 2
    tile = max(16, min(128, (16384 // elt) // head_dim))
    tile = min(tile, 64 if head_dim >= 128 else 128)
    warps, stages = 4, 2 if elt == 4 else 3
    if quant == "none" and elt == 4 and head_dim == 64:
        stages = 1  # 2 stages: 8/16 B spilled at sm_90 under 3.6 (96 registers)
    if quant in ("int8", "fp8"):
        tile = min(tile, 64)  # 128 tokens at head dim 32 in 16 bits: 4 B spilled at sm_90 under 3.6
        if elt == 4:
            stages = 1
    if quant == "kivi":  # 8 warps, the unpacked tile bounded: 16 elements a thread in 16 bits, 8 in fp32
        tile = max(16, min(tile, 64, (8192 // elt) // head_dim))  # 128 at head dim 32: 8 B under 3.6 at sm_90
        if head_dim <= 16 and elt == 2:
            tile = 32  # 64 at head dim 16, 2-bit, 16-bit queries: 8/4 B spilled at sm_87 under 3.9 (fp32: 32 did)
        warps = 8
    return DecodeConfig(tile=tile, gp=max(16, _next_pow2(group)), num_warps=warps, num_stages=stages)


def kivi_config(group: int, block_size: int, head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """The KIVI decode launch: :func:`decode_config` with ``quant="kivi"``."""
    return decode_config(group, block_size, head_dim, dtype, "kivi")


@functools.lru_cache(maxsize=256)
def prefill_launch(group: int, block_size: int, head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """The prefill launch: the group padded to a power of two, ``QB`` query positions so that a program holds 64
    rows (32 in fp32), at least 16 (``tl.dot``'s minimum); the decode kernel's token tile, at
    most 64 (128 at head dim 64 spills 60 B at sm_87 under 3.6), 16 in fp32 (the exact fp32
    products are scalar FMAs: 32 spills ~1 KB at sm_90 at head dim 128, 64 ~1.8 KB at head dim 64), 32 at head
    dim 16 (64 spilled 4 B at sm_87 under 3.6 with a group of 16); 8 warps at
    head dim 64+ (4 spill 36 bytes at 128, sm_87, Triton 3.6: the fp32 accumulator and the scores share 4
    warps' registers), else 4; 2 stages."""
    gp = _next_pow2(group)
    fp32 = dtype == torch.float32
    rows = 32 if fp32 else 64
    qb = max(1, rows // gp, 16 // gp)
    tile = min(64, decode_config(group, block_size, head_dim, dtype).tile)
    if head_dim <= 16:
        tile = 32  # 64 at head dim 16, 16 query heads a KV head: 4/4 B spilled at sm_87 under 3.6
    if fp32:
        tile = 16
    return PrefillConfig(qb, gp, tile, 8 if head_dim >= 64 else 4, 2)


# ---------------------------------------------------------------------------------------------- the domain
def compiled(device: torch.device) -> bool:
    """Whether a launch on ``device`` is compiled (a GPU; ``meta`` counts, for tests) rather than interpreted."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type  # no construction
    return kind != "cpu"


def fits(head_dim: int, block_size: int, group: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels take this geometry on ``device``: compiled, a head dim of :data:`HEAD_DIMS`, a block
    size of :data:`BLOCK_SIZES`, a group of at most :data:`MAX_GROUP` and a float dtype of :data:`DTYPES`;
    interpreted, powers of two (block size 8-128)."""
    return _fits(head_dim, block_size, group, dtype, compiled(device))


@functools.lru_cache(maxsize=1024)
def _fits(head_dim: int, block_size: int, group: int, dtype: torch.dtype, compiled_launch: bool) -> bool:
    if dtype not in _NAMES or not _pow2(head_dim) or block_size not in BLOCK_SIZES or group < 1:
        return False
    return not compiled_launch or (head_dim in HEAD_DIMS and group <= MAX_GROUP)


def check_launchable(what: str, head_dim: int, block_size: int, group: int, dtype: torch.dtype,
                     device: torch.device) -> None:  # fmt: skip
    """Refuse (``ConfigError``) a launch of ``what`` outside :func:`fits`: on a GPU nothing outside the set
    :func:`launches` enumerates (and ``aot_check`` compiled) is ever launched."""
    if not fits(head_dim, block_size, group, dtype, device):
        raise ConfigError(
            f"{what}: head_dim {head_dim}, block size {block_size}, group {group}, {dtype} on {device} is outside "
            f"the compiled launch set (head dims {HEAD_DIMS}, blocks {BLOCK_SIZES}, group <= {MAX_GROUP}, "
            f"{sorted(DTYPES)}); MEMOS_REF_KERNELS=reference runs the torch reference"
        )


# ---------------------------------------------------------------------------------------------- enumeration
@dataclass(frozen=True)
class Launch:
    """One compilation: the jitted kernel's name, its data pointers' element types and its ``constexpr`` values
    (each sorted by name), ``num_warps`` and ``num_stages``. ``example`` holds runtime values (block size, group,
    head dim...) that ``aot_check`` uses for realistic strides; it is not part of the key."""

    kernel: str
    pointers: tuple[tuple[str, str], ...]
    consts: tuple[tuple[str, Any], ...]
    num_warps: int
    num_stages: int
    example: tuple[tuple[str, int], ...] = field(default=(), compare=False)

    @property
    def name(self) -> str:
        """A short unique name: kernel, query (or key, or pool) element type, the cache's when it differs, head
        dim, tile, padded group (and query rows), KIVI bits, warps and stages."""
        p, c = dict(self.pointers), dict(self.consts)
        elt = p.get("q_ptr") or p.get("key_ptr") or p.get("pool_ptr") or p.get("out_ptr")
        parts = [self.kernel.removesuffix("_kernel"), elt]
        if p.get("kc_ptr", elt) != elt:
            parts.append(p["kc_ptr"])
        short = {"BITS": "b", "D": "d", "TILE": "t", "GP": "gp", "QB": "qb"}
        parts += [f"{short[k]}{c[k]}" for k in ("BITS", "D", "TILE", "GP", "QB") if k in c]
        parts.append(f"w{self.num_warps}s{self.num_stages}")
        return "_".join(parts)


def _launch(kernel: str, pointers: dict[str, str], consts: dict[str, Any], warps: int, stages: int,
            **example: int) -> Launch:  # fmt: skip
    data = {k: v for k, v in pointers.items() if k not in INDEX_POINTERS}
    return Launch(kernel, tuple(sorted(data.items())), tuple(sorted(consts.items())), warps, stages,
                  tuple(sorted(example.items())))  # fmt: skip


def _prec(dtype: str) -> str:
    return "ieee" if dtype == "fp32" else "tf32"


def _decode(capability: int) -> list[Launch]:
    out = []
    quants = ("none", "int8", "fp8") if capability >= 89 else ("none", "int8")
    for quant, dt, d in itertools.product(quants, DTYPES, HEAD_DIMS):
        cfg = decode_config(MAX_GROUP, 16, d, DTYPES[dt], quant)
        cache = {"none": dt, "int8": "i8", "fp8": "u8"}[quant]
        scale = {"none": dt, "int8": "fp16", "fp8": "fp32"}[quant]
        ptrs = {"q_ptr": dt, "kc_ptr": cache, "vc_ptr": cache, "ks_ptr": scale, "vs_ptr": scale, "out_ptr": dt,
                "acc_ptr": "fp32", "m_ptr": "fp32", "l_ptr": "fp32"}  # fmt: skip
        consts = dict(GP=cfg.gp, D=d, TILE=cfg.tile, QUANT={"none": 0, "int8": 1, "fp8": 2}[quant],
                      DOT_F32=False, PREC=_prec(dt))  # fmt: skip
        out.append(_launch("decode_split_kernel", ptrs, consts, cfg.num_warps, cfg.num_stages, G=4, T=16))
    for dt, d in itertools.product(DTYPES, HEAD_DIMS):  # the reduce (more than one split)
        ptrs = {"acc_ptr": "fp32", "m_ptr": "fp32", "l_ptr": "fp32", "out_ptr": dt}
        out.append(_launch("decode_reduce_kernel", ptrs, dict(GP=16, D=d), 4, 3, G=4))
    return out


def _kivi() -> list[Launch]:
    out = []
    for bits, dt, d in itertools.product(KIVI_BITS, DTYPES, HEAD_DIMS):
        cfg = kivi_config(MAX_GROUP, 32, d, DTYPES[dt])
        ptrs = {"q_ptr": dt, "out_ptr": dt, "stg_ptr": dt, "kc_ptr": "u8", "vc_ptr": "u8", "ks_ptr": "fp16",
                "kz_ptr": "fp16", "vs_ptr": "fp16", "vz_ptr": "fp16", "acc_ptr": "fp32", "m_ptr": "fp32",
                "l_ptr": "fp32"}  # fmt: skip
        consts = dict(GP=cfg.gp, D=d, TILE=cfg.tile, BITS=bits, DOT_F32=False, PREC=_prec(dt))
        out.append(_launch("decode_kivi_split_kernel", ptrs, consts, cfg.num_warps, cfg.num_stages, G=4, T=32,
                           GK=32, GV=32))  # fmt: skip
    return out


def _prefill() -> list[Launch]:
    out = []
    seen = set()
    for dt, d, group in itertools.product(DTYPES, HEAD_DIMS, range(1, MAX_GROUP + 1)):
        cfg = prefill_launch(group, 16, d, DTYPES[dt])
        ptrs = {"q_ptr": dt, "kc_ptr": dt, "vc_ptr": dt, "out_ptr": dt}
        consts = dict(GP=cfg.gp, QB=cfg.qb, D=d, TILE=cfg.tile, DOT_F32=False, PREC=_prec(dt))
        launch = _launch("prefill_kernel", ptrs, consts, cfg.num_warps, cfg.num_stages, G=group, T=16)
        if launch not in seen:
            seen.add(launch)
            out.append(launch)
    return out


def _writes(capability: int) -> list[Launch]:
    out = []
    for dt, d in itertools.product(DTYPES, HEAD_DIMS):
        kv = {"key_ptr": dt, "value_ptr": dt}
        out.append(_launch("write_kv_kernel", {**kv, "kc_ptr": dt, "vc_ptr": dt}, dict(D=d), 4, 3, T=16))
        out.append(_launch("write_kv_int8_kernel", {**kv, "kc_ptr": "i8", "vc_ptr": "i8", "ks_ptr": "fp16",
                                                    "vs_ptr": "fp16"}, dict(D=d), 4, 3, T=16))  # fmt: skip
        if capability >= 89:  # float8e4nv needs sm_89+
            out.append(_launch("write_kv_fp8_kernel", {**kv, "kc_ptr": "u8", "vc_ptr": "u8", "ks_ptr": "fp32",
                                                       "vs_ptr": "fp32"}, dict(D=d), 4, 3, T=16))  # fmt: skip
    return out


def _copies() -> list[Launch]:
    return [_launch("copy_blocks_kernel", {"pool_ptr": dt}, dict(CHUNK=1024), 4, 3) for dt in POOL_DTYPES]


def launches(capability: int) -> list[Launch]:
    """Every distinct compilation the package's wrappers can launch on ``sm_<capability>`` (fp8 only at sm_89+),
    over the whole domain of :func:`fits`: decode (float, int8, fp8; one split writing the output directly or
    several and the reduce), KIVI 2/4-bit decode, prefill, the three writes and block copies."""
    return _decode(capability) + _kivi() + _prefill() + _writes(capability) + _copies()
