"""KV quantization: error bounds against a float64 reference, packing, saturation, and the quantized paged pool
(contents against the standalone quantizers, attention against dense attention on dequantized K/V, sharing,
copy-on-write, truncation, staging limits) and generation with every scheme."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memos_ref.attention import attend_sequences, paged_attention
from memos_ref.errors import ConfigError, ShapeError, StagingFullError
from memos_ref.paged import PagedKV
from memos_ref.quant import FP8E4M3, KIVI, Float16, PerTensorInt8, PerTokenInt8, pack, unpack
from memos_ref.spec import KVSpec


def kv_like(h=2, t=64, d=32, seed=0, outlier_channel=True) -> torch.Tensor:
    """Keys with a few large channels (as real keys have) and a spread of magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(h, t, d, generator=g) * torch.rand(h, t, 1, generator=g) * 3
    if outlier_channel:
        x[:, :, 3] *= 12
    return x


# ---------------------------------------------------------------------- quantizers vs float64
def test_per_token_int8_error_bound():
    x = kv_like().double()
    q = PerTokenInt8()
    err = (q.dequantize(q.quantize(x.float())).double() - x).abs()
    absmax = x.abs().amax(-1, keepdim=True)  # [H, T, 1]
    bound = absmax / 127 / 2 + absmax * 2**-10  # half a step, plus the fp16 rounding of the scale
    assert (err <= bound + 1e-6).all()
    assert q.quantize(x.float()).nbytes == 2 * 64 * (32 + 2)  # codes + fp16 scale per (head, token)


def test_per_tensor_int8_calibrated_and_fixed_scale_clipping():
    x = kv_like().double()
    q = PerTensorInt8()
    err = (q.dequantize(q.quantize(x.float())).double() - x).abs()
    assert float(err.max()) <= float(x.abs().max()) / 127 / 2 + 1e-6
    fixed = PerTensorInt8(scale=0.1)  # seed 003 §6.1: everything beyond ±12.7 is clipped
    qt = fixed.quantize(x.float())
    beyond = int((x.abs() > 12.75).sum())
    assert qt.meta["clipped"] == beyond > 0
    deq = fixed.dequantize(qt).double()
    inside = x.abs() <= 12.7
    assert ((deq - x).abs()[inside] <= 0.05 + 1e-6).all()
    assert torch.allclose(deq[~inside].abs(), torch.full_like(deq[~inside], 12.7, dtype=torch.float64))


def test_fp8_error_bound_and_saturation():
    x = kv_like().double()
    q = FP8E4M3()
    qt = q.quantize(x.float())
    err = (q.dequantize(qt).double() - x).abs()
    scale = qt.scale.double()[:, None, None]
    assert (err <= x.abs() * 2**-4 + scale * 2**-10 + 1e-9).all()  # 3 mantissa bits; subnormal floor
    frozen = qt.scale / 4  # a scale frozen on smaller data (transformers' fp8 layer freezes it at prefill)
    clip = FP8E4M3(saturation="clip").quantize(x.float(), scale=frozen)
    assert clip.meta["clipped"] > 0
    assert float((FP8E4M3().dequantize(clip).double() - x).abs().max()) > 1.0  # clipped values are far off
    grown = FP8E4M3().quantize(x.float(), scale=frozen)  # rescale: the scale grows, nothing clips
    assert grown.meta["clipped"] == 0 and torch.equal(grown.scale, torch.maximum(frozen, q.needed_scale(x.float())))


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("group", [32, 64])
def test_kivi_error_bound_and_bytes(bits, group):
    x = kv_like(t=128, d=64).double()
    q = KIVI(bits, group)
    for kind in ("key", "value"):
        qt = q.quantize(x.float(), kind)
        err = (q.dequantize(qt).double() - x).abs()
        if kind == "key":  # per channel over groups of `group` tokens
            xg = x.reshape(2, 128 // group, group, 64)
            span = (xg.amax(2, keepdim=True) - xg.amin(2, keepdim=True)).expand_as(xg).reshape(2, 128, 64)
            lo = xg.amin(2, keepdim=True).abs().expand_as(xg).reshape(2, 128, 64)
        else:  # per token over groups of min(group, D) channels
            g = min(group, 64)
            xg = x.reshape(2, 128, 64 // g, g)
            span = (xg.amax(3, keepdim=True) - xg.amin(3, keepdim=True)).expand_as(xg).reshape(2, 128, 64)
            lo = xg.amin(3, keepdim=True).abs().expand_as(xg).reshape(2, 128, 64)
        step = span / q.levels
        assert (err <= step / 2 + (span + lo) * 2**-10 + 1e-6).all()
        assert qt.data.numel() == 2 * 128 * 64 * bits // 8  # packed: 8 // bits codes per byte
    per_token = q.bytes_per_token(2, 64)
    measured = (q.quantize(x.float(), "key").nbytes + q.quantize(x.float(), "value").nbytes) / 128
    assert per_token == pytest.approx(measured)


def test_keys_want_per_channel_scales():
    """With an outlier channel, per-channel (KIVI key) scales beat per-token scales at the same bit width."""
    x = kv_like(t=128)
    per_channel = (KIVI(4, 32).round_trip(x, "key") - x).pow(2).mean()
    per_token = (KIVI(4, 32).round_trip(x, "value") - x).pow(2).mean()
    assert per_channel < per_token


@given(st.integers(1, 6), st.sampled_from([2, 4]), st.integers(0, 2**31 - 1))
@settings(max_examples=30, deadline=None)
def test_pack_unpack_round_trip(n, bits, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (3, n * 8 // bits), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (3, n) and torch.equal(unpack(packed, bits), codes)


def test_bad_input_errors():
    with pytest.raises(ConfigError, match="bits must be 2 or 4"):
        KIVI(3)
    with pytest.raises(ShapeError, match="groups of 32 tokens"):
        KIVI(4, 32).quantize(torch.randn(2, 40, 32), "key")
    with pytest.raises(ShapeError, match="heads, tokens, head_dim"):
        PerTokenInt8().quantize(torch.randn(40, 32))
    with pytest.raises(ConfigError, match="scale must be positive"):
        PerTensorInt8(scale=0.0)
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=16)
    with pytest.raises(ConfigError, match="block_size=32"):
        PagedKV(spec, 8, quant=KIVI(4, 32))
    with pytest.raises(ConfigError, match="layer_scales"):
        PagedKV(spec, 8, quant=PerTensorInt8())


# ---------------------------------------------------------------------- the quantized pool
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype=torch.float32)
SCHEMES = {
    "fp16": (Float16(), {}),
    "int8_token": (PerTokenInt8(), {}),
    "int8_tensor": (PerTensorInt8(), {"layer_scales": torch.full((2, 2), 0.05)}),
    "fp8": (FP8E4M3(), {}),
    "kivi4": (KIVI(4, 32), {"residual_tokens": 64}),
    "kivi2": (KIVI(2, 32), {"residual_tokens": 0}),
    "int8_aging": (PerTokenInt8(), {"residual_tokens": 64}),
}


def fill(kv: PagedKV, n: int, seed: int = 0, chunks=(40, 1, 1, 23, 1)):
    """A sequence of n tokens written in uneven chunks, layer by layer; returns it and the K/V written."""
    seq = kv.new_sequence()
    g = torch.Generator().manual_seed(seed)
    keys = [kv_like(t=n, seed=seed + layer) for layer in range(2)]
    values = [torch.randn(2, n, 32, generator=g) for _ in range(2)]
    done, i = 0, 0
    while done < n:
        step = min(chunks[i % len(chunks)], n - done)
        for layer in range(2):
            seq.append(layer, keys[layer][:, done : done + step], values[layer][:, done : done + step])
        done, i = done + step, i + 1
    return seq, keys, values


def expected(name: str, x: torch.Tensor, kind: str, n: int) -> torch.Tensor:
    """What the pool should hold for one layer's K or V, from the standalone quantizers."""
    scheme, kw = SCHEMES[name]
    if name in ("int8_token", "fp16"):
        return scheme.round_trip(x, kind)
    if name == "int8_tensor":
        return (x / 0.05).round().clamp(-127, 127) * 0.05
    residual = kw["residual_tokens"]
    sealed = max(0, n - residual) // 32 * 32
    out = x.clone()
    if sealed:
        out[:, :sealed] = torch.cat([scheme.round_trip(x[:, s : s + 32], kind) for s in range(0, sealed, 32)], dim=1)
    return out


@pytest.mark.parametrize("name", [k for k in SCHEMES if k != "fp8"])
def test_pool_holds_what_the_quantizer_gives(name):
    scheme, kw = SCHEMES[name]
    kv = PagedKV(SPEC, 16, quant=scheme, prefix_caching=False, **kw)
    n = 150
    seq, keys, values = fill(kv, n)
    for layer in range(2):
        k, v = seq.to_dense(layer)
        assert torch.allclose(k, expected(name, keys[layer], "key", n), atol=1e-6)
        assert torch.allclose(v, expected(name, values[layer], "value", n), atol=1e-6)
    kv.check()


def test_fp8_pool_grows_block_scales_instead_of_clipping():
    kv = PagedKV(SPEC, 16, quant=FP8E4M3(), prefix_caching=False)
    seq = kv.new_sequence()
    small, big = torch.randn(2, 20, 32) * 0.1, torch.randn(2, 1, 32) * 50  # a decode token 500x larger
    for layer in range(2):
        seq.append(layer, small, small)
    for layer in range(2):
        seq.append(layer, big, big)
    k, _ = seq.to_dense(0)
    x = torch.cat([small, big], dim=1)
    assert kv.pool.rescales > 0
    scale = kv.pool.payload["scale"][seq.block_table[0], 0, 0]  # [H]
    # twice-rounded small values (encoded, re-encoded under the grown scale) and the big one: no clipping
    assert ((k - x).abs() <= x.abs() * 2**-3 + scale[:, None, None] * 2**-9 + 1e-7).all()
    assert float((k[:, -1] - big[:, 0]).abs().max()) < float(big.abs().max()) * 2**-4 + 1e-6


@pytest.mark.parametrize("name", list(SCHEMES))
def test_paged_attention_over_dequantized_blocks_equals_dense(name):
    scheme, kw = SCHEMES[name]
    kv = PagedKV(SPEC, 24, quant=scheme, prefix_caching=False, **kw)
    seqs = [fill(kv, n, seed=n)[0] for n in (150, 1, 70)]
    q = torch.randn(3, 8, 1, 32)
    for layer in range(2):
        got = attend_sequences(q, seqs, layer)
        # oracle: decode every block of the layer, then the kernel-shaped reference over those caches
        blocks = kv.pool.read_blocks(torch.arange(kv.pool.num_blocks), layer)  # [N, 2, H, T, D]
        tables = torch.full((3, 5), -1, dtype=torch.long)
        for i, s in enumerate(seqs):
            tables[i, : s.num_blocks] = torch.tensor(s.block_table)
        lens = torch.tensor([s.num_tokens for s in seqs])
        want = paged_attention(q, blocks[:, 0], blocks[:, 1], tables, lens)
        assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("name", ["kivi4", "int8_aging", "fp8"])
def test_sharing_copy_on_write_and_truncate(name):
    scheme, kw = SCHEMES[name]
    kv = PagedKV(SPEC, 24, quant=scheme, prefix_caching=False, **kw)
    seq, _, _ = fill(kv, 100)
    before = [seq.to_dense(layer) for layer in range(2)]
    child = seq.fork()
    extra = torch.randn(2, 5, 32)
    for layer in range(2):
        child.append(layer, extra, extra)  # the shared partial tail block is copied first
    assert child.cow_copies == 1
    for layer in range(2):
        k, v = seq.to_dense(layer)
        assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])
        ck, _ = child.to_dense(layer)
        assert torch.equal(ck[:, :100], before[layer][0])
    seq.truncate(70)  # back into a sealed block (for kivi/aging), then write into its middle
    for layer in range(2):
        seq.append(layer, extra, extra)
    k, _ = seq.to_dense(0)
    assert torch.equal(k[:, :64], before[0][0][:, :64])  # what was sealed survives the re-staging
    kv.check()
    child.free()
    seq.free()
    assert kv.pool.staged_blocks == 0  # every staging slot came back
    kv.check()


def test_staging_exhaustion_is_refused_cleanly():
    kv = PagedKV(SPEC, 16, quant=KIVI(4, 32), residual_tokens=128, staging_blocks=3, prefix_caching=False)
    seq, _, _ = fill(kv, 90)  # 3 blocks, all inside the residual window
    other = kv.new_sequence()
    with pytest.raises(StagingFullError, match="raise staging_blocks"):
        other.append(0, torch.randn(2, 4, 32), torch.randn(2, 4, 32))
    assert other.num_tokens == 0 or kv.pool.staged_blocks == 3
    assert kv.pool.staged_blocks == 3
    seq.free()
    assert kv.pool.staged_blocks == 0


@pytest.mark.parametrize("name", list(SCHEMES))
def test_generation_with_every_scheme(name, shipped_pair):
    """Greedy generation through the package's forward and through transformers' generate, both on a
    quantized PagedCache: identical tokens (they read the same quantized blocks)."""
    from memos_ref.hf import PagedCache

    model, hf = shipped_pair
    scheme, kw = SCHEMES[name]
    if name == "int8_tensor":
        kw = {"layer_scales": torch.full((4, 2), 0.05)}
    ids = torch.tensor([list(b"def quantize(x, scale):\n    return ")])
    outs = []
    for run in ("package", "transformers"):
        kv = PagedKV(model.kv_spec(block_size=32), 16, quant=scheme, **kw)
        cache = PagedCache(kv)
        if run == "package":
            outs.append(model.generate(ids, 24, cache))
        else:
            outs.append(hf.generate(ids, cache=cache, max_new_tokens=24, min_new_tokens=24, do_sample=False))
        kv.check()
    assert torch.equal(outs[0], outs[1])


def test_idle_sequences_age_their_residual_window():
    kv = PagedKV(SPEC, 16, quant=PerTokenInt8(), residual_tokens=128, prefix_caching=False)
    seq, keys, _ = fill(kv, 100)
    assert kv.pool.staged_blocks == 4  # all 100 tokens inside the window
    assert seq.seal_idle() == 3  # the partial 4th block stays staged
    k, _ = seq.to_dense(0)
    assert torch.allclose(k[:, :96], PerTokenInt8().round_trip(keys[0][:, :96]), atol=1e-6)
    assert torch.equal(k[:, 96:], keys[0][:, 96:])
    kv.check()


def test_fp8_scale_growth_does_not_compound():
    """A block whose values grow slowly, token by token: power-of-two scales make each re-encoding an exact
    exponent shift, so the first token reads back within fp8's own error however often the scale grew."""
    kv = PagedKV(SPEC, 4, quant=FP8E4M3(), prefix_caching=False)
    seq = kv.new_sequence()
    first = torch.ones(2, 1, 32)
    for layer in range(2):
        seq.append(layer, first, first)
    for step in range(1, 31):
        x = torch.full((2, 1, 32), 1.03**step * 3)
        for layer in range(2):
            seq.append(layer, x, x)
    k, _ = seq.to_dense(0)
    assert float((k[:, 0] - 1.0).abs().max()) <= 2**-4  # 3 mantissa bits, no drift
    assert kv.pool.rescales > 0


def test_cached_blocks_do_not_hold_staging_slots():
    """Freed sequences' full blocks stay in the prefix cache; they are sealed, so new sequences can still stage."""
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, block_size=32, dtype=torch.float32)
    kv = PagedKV(spec, 64, quant=KIVI(4, 32), staging_blocks=16)  # prefix caching on
    for i in range(4):
        seq = kv.new_sequence()
        x = torch.randn(2, 128, 32)
        for layer in range(2):
            seq.append(layer, x, x, list(range(1000 * i, 1000 * i + 128)) if layer == 0 else None)
        seq.free()
    assert kv.allocator.num_cached == 16 and kv.pool.staged_blocks == 0
    fresh = kv.new_sequence()
    for layer in range(2):
        fresh.append(layer, torch.randn(2, 40, 32), torch.randn(2, 40, 32))
    kv.check()


def test_copy_on_write_with_a_full_staging_slab_leaks_nothing():
    kv = PagedKV(SPEC, 16, quant=KIVI(4, 32), residual_tokens=128, staging_blocks=2, prefix_caching=False)
    seq, _, _ = fill(kv, 40)  # two staged blocks: the slab is full
    child = seq.fork()
    with pytest.raises(StagingFullError):
        child.append(0, torch.randn(2, 1, 32), torch.randn(2, 1, 32))  # the shared partial tail must be copied
    child.free()
    seq.free()
    kv.check()
    assert kv.allocator.num_free == 16


# ---------------------------------------------------------------------- issue 15 item 4: one codec per scheme
CODEC_CASES = [
    (Float16(), {}, "Float16Codec"),
    (PerTokenInt8(), {}, "PerTokenInt8Codec"),
    (PerTensorInt8(0.05), {}, "PerTensorInt8Codec"),
    (FP8E4M3(), {}, "FP8Codec"),
    (KIVI(4, 32), {}, "KIVICodec"),
]


@pytest.mark.parametrize(("scheme", "kw", "codec"), CODEC_CASES, ids=lambda c: getattr(c, "name", ""))
def test_each_scheme_owns_its_block_codec_in_its_own_module(scheme, kw, codec):
    """The pool dispatches through the scheme's codec, which lives in the scheme's own module (no isinstance
    ladder over the schemes in the pool)."""
    kv = PagedKV(SPEC, 4, quant=scheme, prefix_caching=False, **kw)
    assert type(kv.pool.codec).__name__ == codec
    assert type(kv.pool.codec).__module__ == type(scheme).__module__ != "memos_ref.quant.schemes"
    assert kv.pool.codec.bytes_per_block() == kv.pool.block_payload_bytes
    import ast
    import inspect

    import memos_ref.quant.pool as qpool

    names = {"Float16", "PerTokenInt8", "PerTensorInt8", "FP8E4M3", "KIVI"}
    ladders = [
        node
        for node in ast.walk(ast.parse(inspect.getsource(qpool)))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", "") == "isinstance"
        and names & {getattr(n, "id", "") for n in ast.walk(node.args[1])}
    ]
    assert not ladders


def test_the_fp8_scale_law_is_one_function():
    """One fp8 scale law (fp8_scale = the quantizer's); streamed blocks grow to it rounded up to a power of two,
    sealed blocks and FP8E4M3 take it as is."""
    from memos_ref.quant import FP8_MAX, fp8_block_scale, fp8_scale

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 32, 32, generator=g) * torch.tensor([3.0, 1e-3])[:, None, None]
    amax = x.abs().amax(dim=(-1, -2))
    assert torch.equal(FP8E4M3.needed_scale(x), fp8_scale(amax))
    assert torch.equal(FP8E4M3().quantize(x).scale, fp8_scale(amax))
    pow2 = fp8_block_scale(amax)
    assert bool((torch.log2(pow2) % 1 == 0).all()) and bool((pow2 >= fp8_scale(amax)).all())
    assert bool((amax / pow2 <= FP8_MAX).all())
    # the pool: a streamed block holding one token has the block scale of that token; a sealed one the law's
    tok = x[:, :1].transpose(0, 1)  # [1, H, D]
    streamed = PagedKV(SPEC, 4, quant=FP8E4M3(), prefix_caching=False)
    s = streamed.new_sequence()
    for layer in range(2):
        s.append(layer, tok.transpose(0, 1), tok.transpose(0, 1))
    assert torch.equal(streamed.pool.payload["scale"][s.block_table[0], 0, 0], fp8_block_scale(tok.abs().amax(-1))[0])
    sealed = PagedKV(SPEC, 4, quant=FP8E4M3(), residual_tokens=1, staging_blocks=4, prefix_caching=False)
    s = sealed.new_sequence()
    for layer in range(2):
        s.append(layer, x, x)  # a full block, then sealed once the window moves past it
    for layer in range(2):
        s.append(layer, x[:, :1], x[:, :1])
    assert int(sealed.pool.staging_slot[s.block_table[0]]) < 0
    assert torch.equal(sealed.pool.payload["scale"][s.block_table[0], 0, 0], fp8_scale(amax))


@pytest.mark.parametrize("scheme", [FP8E4M3(), PerTokenInt8()], ids=lambda s: s.name)
def test_codec_kernel_args_are_what_the_write_kernel_fills(scheme):
    """kernel_args maps the pool's payload to memos_kernels' write arguments: the kernel's reference write into
    those views stores what the pool's own streaming write stored (fp8 byte for byte; int8 up to the kernel's
    round-half-up ties)."""
    write_kv = pytest.importorskip("memos_kernels.write_kv")
    g = torch.Generator().manual_seed(1)
    key, value = torch.randn(40, 2, 32, generator=g) * 4, torch.randn(40, 2, 32, generator=g)
    slots = torch.arange(40)
    ref = PagedKV(SPEC, 4, quant=scheme, prefix_caching=False).pool
    mine = PagedKV(SPEC, 4, quant=type(scheme)(), prefix_caching=False).pool
    ref.write(1, slots, key, value)
    args = mine.kernel_args(1)
    if isinstance(scheme, FP8E4M3):
        mine.payload["scale"].copy_(ref.payload["scale"])  # the scales are grown by the pool, not the kernel
        write_kv.write_kv_fp8_reference(key, value, slots, **args)
        assert torch.equal(mine.payload["codes"], ref.payload["codes"])
    else:
        write_kv.write_kv_int8_reference(key, value, slots, **args)
        assert torch.equal(mine.payload["scale"], ref.payload["scale"])
        assert int((mine.payload["codes"].int() - ref.payload["codes"].int()).abs().max()) <= 1
    k, v = mine.gather(1, torch.tensor([0, 1]), 40)
    rk, rv = ref.gather(1, torch.tensor([0, 1]), 40)
    assert torch.allclose(k, rk, atol=0.05) and torch.allclose(v, rv, atol=0.05)


def test_accuracy_harness_lives_above_the_quant_layer():
    """The accuracy harness runs models through hf, so it moved to bench (quant imports nothing above it)."""
    import importlib.util

    assert importlib.util.find_spec("memos_ref.quant.accuracy") is None
    assert importlib.util.find_spec("memos_ref.bench.accuracy") is not None
