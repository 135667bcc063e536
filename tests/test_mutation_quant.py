"""Re-staging a sealed quantized block (issue 30's survivor: the test that said it wrote "back into a sealed block"
after a truncate landed in a block still staged). Here the block is checked to be sealed before the write; the
oracle is the K/V the test wrote, within the scheme's quantization error."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from memos_ref.paged import PagedKV
from memos_ref.quant import FP8E4M3, PerTokenInt8, QuantizedBlockPool
from memos_ref.spec import KVSpec

T = 8
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=T)


def _write(seq, n, gen):
    """n tokens into every layer; returns [(k, v)] per layer, each [H, n, D]."""
    out = []
    for layer in range(SPEC.num_layers):
        k, v = torch.randn(2, 2, n, 16, generator=gen).unbind(0)
        seq.append(layer, k, v)
        out.append((k, v))
    return out


@pytest.mark.parametrize("kept", [1, 4])
@pytest.mark.parametrize("scheme", [PerTokenInt8(), FP8E4M3()], ids=["int8", "fp8"])
def test_writing_into_the_middle_of_a_sealed_block_keeps_its_earlier_tokens(scheme, kept):
    """Truncate into a block that was sealed (quantized, no staging slot), then write the next token: the block is
    re-staged with its sealed contents decoded, so the tokens before the write read back as written (within the
    codec's error), not as zeros, and the new token reads back at full precision."""
    kv = PagedKV(SPEC, 16, quant=scheme, residual_tokens=T, staging_blocks=4, prefix_caching=False)
    gen = torch.Generator().manual_seed(21)
    seq = kv.new_sequence()
    written = _write(seq, 3 * T, gen)
    seq.truncate(T + kept)  # into block 1
    block = seq.block_table[1]
    assert not kv.pool.is_staged(block), "the premise: block 1 is sealed before the write"
    new = _write(seq, 1, gen)
    assert kv.pool.is_staged(block)  # re-staged for the write
    for layer in range(SPEC.num_layers):
        k, v = seq.to_dense(layer)  # [H, T + kept + 1, D]
        for got, want in ((k, written[layer][0]), (v, written[layer][1])):
            err = (got[:, T : T + kept] - want[:, T : T + kept]).abs().max().item()
            assert err <= 0.05 * want.abs().max().item(), err  # quantization error, never a zeroed token
            torch.testing.assert_close(got[:, :T], want[:, :T], atol=0.05 * want.abs().max().item(), rtol=0)
        torch.testing.assert_close(k[:, T + kept :], new[layer][0])
        torch.testing.assert_close(v[:, T + kept :], new[layer][1])
    kv.check()


def test_a_whole_block_written_from_offset_zero_into_a_sealed_block_needs_no_decode():
    """At pool level: a write covering offset 0 of a sealed block replaces it (nothing to keep); a write that starts
    past offset 0 keeps the earlier offsets' decoded values; both leave other blocks' codes untouched."""
    pool = QuantizedBlockPool(SPEC, 4, PerTokenInt8(), residual_tokens=T, staging_blocks=2)
    gen = torch.Generator().manual_seed(22)
    first = [torch.randn(T, 2, 16, generator=gen) for _ in range(2 * SPEC.num_layers)]
    slots = torch.arange(T)  # block 0
    for layer in range(SPEC.num_layers):
        pool.write(layer, slots, first[2 * layer], first[2 * layer + 1])
    pool.seal([0])
    assert not pool.is_staged(0)
    sealed = [pool.read_blocks(torch.tensor([0]), layer).clone() for layer in range(SPEC.num_layers)]
    tail = [torch.randn(3, 2, 16, generator=gen) for _ in range(2)]
    for layer in range(SPEC.num_layers):
        pool.write(layer, torch.arange(5, 8), tail[0], tail[1])  # offsets 5..7 only
    assert pool.is_staged(0)
    for layer in range(SPEC.num_layers):
        now = pool.read_blocks(torch.tensor([0]), layer)  # [1, 2, H, T, D]
        torch.testing.assert_close(now[..., :5, :], sealed[layer][..., :5, :])  # decoded, kept exactly
        torch.testing.assert_close(now[0, 0, :, 5:8], tail[0].transpose(0, 1))


# ----------------------------------------------------------------------------------------------------------------
# Codec / scheme contracts, each against the format's definition (issue 30: the quant modules' surviving mutants).
# ----------------------------------------------------------------------------------------------------------------

from memos_ref.errors import ArgumentTypeError, ConfigError, InvalidArgumentError, ShapeError  # noqa: E402
from memos_ref.quant import Float16, PerTensorInt8, fitting_scale, pack, unpack  # noqa: E402
from memos_ref.quant.base import Quantizer, check_bits, check_kind, check_kv_tensor, check_qtensor  # noqa: E402
from memos_ref.quant.codec import BlockCodec  # noqa: E402

CPU, META = torch.device("cpu"), torch.device("meta")
L, H, D = SPEC.num_layers, SPEC.num_kv_heads, SPEC.head_dim


def _blocks(m, gen, amp=1.0):
    """Full-precision blocks ``kv [m, L, 2, H, T, D]``."""
    return amp * torch.randn(m, L, 2, H, T, D, generator=gen)


@pytest.mark.parametrize("scheme", [Float16(), PerTokenInt8(), FP8E4M3(), PerTensorInt8(0.05)], ids=str)
def test_a_codec_allocates_its_payload_on_the_pools_device(scheme):
    """A pool on a device gets its codec's payload (codes and scales) and per-tensor scales on that device, not on
    the default one (checked with the ``meta`` device, which no default ever is)."""
    codec = scheme.codec(SPEC, META)
    assert codec.device == META and codec.scheme is scheme
    for name, t in codec.allocate(2).items():
        assert t.device == META, name
    if codec.layer_scales is not None:
        assert codec.layer_scales.device == META
    pool = scheme.build_pool(SPEC, 4, device=META)
    assert pool.device == META and pool.staging.device == META


def test_build_pool_defaults_to_the_cpu():
    """``build_pool`` without a device builds a CPU pool."""
    pool = Float16().build_pool(SPEC, 3)
    assert pool.device == CPU and pool.staging.device == CPU


@pytest.mark.parametrize("scheme", [Float16(), PerTokenInt8(), FP8E4M3()], ids=str)
def test_a_scheme_without_per_tensor_scales_holds_no_extra_bytes(scheme):
    """``extra_nbytes`` is 0 for a scheme with no per-tensor scales, and a per-tensor scheme holds its [L, 2]
    float32 scales (8 bytes per layer)."""
    assert scheme.codec(SPEC, CPU).layer_scales is None
    assert scheme.codec(SPEC, CPU).extra_nbytes == 0
    assert PerTensorInt8(0.1).codec(SPEC, CPU).extra_nbytes == L * 2 * 4


def test_bytes_per_block_follow_each_format():
    """One sealed block's bytes, from each format's definition: fp16 2 B/value; int8 per token 1 B/value plus an
    fp16 scale per (layer, K/V, head, token); fp8 1 B/value plus an fp32 scale per (layer, K/V, head); int8 per
    tensor 1 B/value (its scales are outside the blocks)."""
    values = L * 2 * H * T * D
    assert Float16().codec(SPEC, CPU).bytes_per_block() == 2 * values
    assert PerTokenInt8().codec(SPEC, CPU).bytes_per_block() == values + 2 * L * 2 * H * T
    assert FP8E4M3().codec(SPEC, CPU).bytes_per_block() == values + 4 * L * 2 * H
    assert PerTensorInt8(0.1).codec(SPEC, CPU).bytes_per_block() == values


def test_bytes_per_token_follow_each_format():
    """Stored bytes per token for keys and values of one layer: fp16 2·2·H·D, int8/fp8 2·H·D (per-tensor or
    per-block scales negligible), int8 per token 2·H·(D + 2) (an fp16 scale per head)."""
    h, d = 3, 16
    assert Float16().bytes_per_token(h, d) == 4.0 * h * d
    assert PerTensorInt8().bytes_per_token(h, d) == 2.0 * h * d
    assert FP8E4M3().bytes_per_token(h, d) == 2.0 * h * d
    assert PerTokenInt8().bytes_per_token(h, d) == 2.0 * h * (d + 2)


def test_a_block_only_codec_refuses_token_writes_naming_the_scheme():
    """A codec that cannot stream refuses a token write with a ConfigError that names its scheme."""
    codec = BlockCodec(Float16(), SPEC, CPU)
    with pytest.raises(ConfigError, match=r"^fp16 blocks cannot be written token by token"):
        codec.write({}, 0, 0, torch.tensor([0]), torch.tensor([0]), torch.zeros(1, H, D))


def test_poison_makes_only_that_blocks_scales_nan():
    """Debug poisoning sets every scale of the block to NaN (so it decodes to NaN), leaves its codes and the other
    blocks as they were; a scheme with no scales (fp16) is left exactly as is."""
    gen = torch.Generator().manual_seed(5)
    codec = PerTokenInt8().codec(SPEC, CPU)
    payload = codec.allocate(3)
    codec.encode(payload, torch.arange(3), _blocks(3, gen))
    before = {k: v.clone() for k, v in payload.items()}
    codec.poison(payload, 1)
    assert torch.isnan(payload["scale"][1].float()).all()
    torch.testing.assert_close(payload["scale"][[0, 2]], before["scale"][[0, 2]])
    assert torch.equal(payload["codes"], before["codes"])
    assert torch.isnan(codec.decode(payload, torch.tensor([1]), 0)).all()
    f16 = Float16().codec(SPEC, CPU)
    p16 = f16.allocate(2)
    f16.encode(p16, torch.arange(2), _blocks(2, gen))
    kept = p16["codes"].clone()
    f16.poison(p16, 0)
    assert torch.equal(p16["codes"], kept)


# -- fp16 ---------------------------------------------------------------------------------------------------------


def test_fp16_quantize_is_a_plain_cast_with_unit_scale():
    """fp16 ``quantize`` (default kind: key) stores the fp16 cast, a unit scale and the input's shape; it
    dequantizes to the cast exactly, and counts only the codes' bytes."""
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    q = Float16().quantize(x)
    assert q.data.dtype == torch.float16 and torch.equal(q.data, x.to(torch.float16))
    assert float(q.scale) == 1.0 and q.shape == (2, 5, 16)
    assert q.nbytes == 2 * x.numel()
    assert torch.equal(Float16().dequantize(q), x.to(torch.float16).float())
    assert Float16().quantize(x, "value").shape == (2, 5, 16)


def test_fp16_codec_writes_encodes_and_exposes_the_plain_cache():
    """fp16 blocks: a token write casts in place and reports nothing clipped or rescaled; ``encode`` casts whole
    blocks (0 clipped); ``kernel_args`` are the layer's key and value caches ``[N, H, T, D]`` as views."""
    gen = torch.Generator().manual_seed(2)
    codec = Float16().codec(SPEC, CPU)
    payload = codec.allocate(3)
    kv = _blocks(2, gen)
    assert codec.encode(payload, torch.tensor([0, 2]), kv) == 0
    assert torch.equal(payload["codes"][[0, 2]], kv.to(torch.float16))
    torch.testing.assert_close(codec.decode(payload, torch.tensor([2]), 1), kv[1:2, 1].to(torch.float16).float())
    x = torch.randn(2, H, D, generator=gen)
    assert codec.write(payload, 1, 0, torch.tensor([1, 1]), torch.tensor([3, 4]), x) == (0, 0)
    assert torch.equal(payload["codes"][1, 1, 0, :, 3:5], x.transpose(0, 1).to(torch.float16))
    for layer in range(L):
        args = codec.kernel_args(payload, layer)
        assert set(args) == {"key_cache", "value_cache"}
        assert torch.equal(args["key_cache"], payload["codes"][:, layer, 0])
        assert torch.equal(args["value_cache"], payload["codes"][:, layer, 1])
        assert args["key_cache"].shape == (3, H, T, D) and args["key_cache"].dtype == torch.float16
        assert args["key_cache"].data_ptr() == payload["codes"][:, layer, 0].data_ptr()  # a view


# -- int8 per tensor ----------------------------------------------------------------------------------------------


def test_int8_tensor_scale_must_be_a_positive_finite_number_and_names_the_scheme():
    """A fixed scale is a positive finite number (a wrong type is refused naming ``scale``); the scheme's name says
    whether it is fixed or calibrated."""
    with pytest.raises(ArgumentTypeError, match=r"^scale: "):
        PerTensorInt8("0.1")
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError):
            PerTensorInt8(bad)
    assert PerTensorInt8().name == "int8_tensor" and PerTensorInt8(0.1).name == "int8_tensor_fixed0.1"


def test_int8_tensor_quantize_is_round_half_even_of_x_over_the_scale_clamped_to_127():
    """Codes are round-half-even(x / scale) clamped to ±127; the shape is kept; a value clips only when |x/scale|
    is beyond 127.5 (127.5 itself rounds to 128 -> 127 but is counted as in range)."""
    s = 0.5
    x = torch.tensor([0.25, 0.75, -0.25, 63.75, 63.0, -70.0, 64.0, 63.75]).reshape(1, 2, 4)  # /s: .5 1.5 -.5 127.5 ..
    q = PerTensorInt8(s).quantize(x)
    want = torch.tensor([0, 2, 0, 127, 126, -127, 127, 127], dtype=torch.int8).reshape(1, 2, 4)
    assert torch.equal(q.data, want) and q.shape == (1, 2, 4)
    assert q.meta["clipped"] == 2  # -140 and 128, never the 127.5s
    codes, clipped = PerTensorInt8.encode_with(torch.tensor([128.5, 128.4, 127.6]), 1.0)
    assert clipped == 3 and codes.tolist() == [127, 127, 127]


def test_int8_tensor_codec_needs_calibrated_scales_of_the_right_shape():
    """A calibrated per-tensor codec needs ``layer_scales [L, 2]``: missing -> ConfigError naming quant.calibrate,
    wrong shape -> ShapeError naming expected and actual; the scales are kept as float32 on the codec's device, and
    a fixed scheme fills them with its scale."""
    with pytest.raises(ConfigError, match=r"^a calibrated PerTensorInt8 needs layer_scales \[L, 2\]"):
        PerTensorInt8().codec(SPEC, CPU)
    with pytest.raises(ShapeError, match=rf"^layer_scales must be \[{L}, 2\], got \(2, {L}, 1\)$"):
        PerTensorInt8().codec(SPEC, CPU, torch.ones(2, L, 1))
    codec = PerTensorInt8().codec(SPEC, META, torch.ones(L, 2, dtype=torch.float64))
    assert codec.scheme.name == "int8_tensor"
    assert codec.layer_scales.device == META and codec.layer_scales.dtype == torch.float32
    assert torch.equal(PerTensorInt8(0.25).codec(SPEC, CPU).layer_scales, torch.full((L, 2), 0.25))


def test_int8_tensor_codec_encodes_writes_and_exposes_codes_and_scales():
    """Blocks are coded under their (layer, K/V) scale: ``encode`` stores round(kv / scale) clamped to ±127 and
    counts the clipped values; a token write reports its clipped count and no rescale; ``kernel_args`` are the
    layer's key/value codes ``[N, H, T, D]`` (views) and its two float scales."""
    gen = torch.Generator().manual_seed(7)
    scales = torch.tensor([[0.01, 0.02], [0.03, 0.04]])
    codec = PerTensorInt8().codec(SPEC, CPU, scales)
    payload = codec.allocate(3)
    kv = _blocks(2, gen)
    want = (kv / scales[None, :, :, None, None, None]).round().clamp(-127, 127).to(torch.int8)
    n_clip = int(((kv / scales[None, :, :, None, None, None]).abs() > 127.5).sum())
    assert n_clip > 0
    assert codec.encode(payload, torch.tensor([2, 0]), kv) == n_clip
    assert torch.equal(payload["codes"][[2, 0]], want)
    assert not payload["codes"][1].any()
    torch.testing.assert_close(
        codec.decode(payload, torch.tensor([0]), 1), want[1:2, 1].float() * scales[1][None, :, None, None, None]
    )
    x = torch.tensor([[[3.0] * D] * H, [[0.001] * D] * H])  # [2, H, D]: the first clips under 0.02
    assert codec.write(payload, 0, 1, torch.tensor([1, 1]), torch.tensor([0, 1]), x) == (H * D, 0)
    assert (payload["codes"][1, 0, 1, :, 0] == 127).all() and (payload["codes"][1, 0, 1, :, 1] == 0).all()
    for layer in range(L):
        args = codec.kernel_args(payload, layer)
        assert set(args) == {"key_codes", "value_codes", "key_scale", "value_scale"}
        assert torch.equal(args["key_codes"], payload["codes"][:, layer, 0])
        assert torch.equal(args["value_codes"], payload["codes"][:, layer, 1])
        assert args["key_codes"].data_ptr() == payload["codes"][:, layer, 0].data_ptr()
        assert args["key_scale"] == pytest.approx(float(scales[layer, 0]))
        assert args["value_scale"] == pytest.approx(float(scales[layer, 1]))
        assert isinstance(args["key_scale"], float)


# -- base: checks, packing, the fitting scale, the Quantizer interface ---------------------------------------------


def test_argument_checks_name_the_argument():
    """Each check refuses a wrong type with an ArgumentTypeError that names the argument (``x``, ``bits``, ``q``,
    ``codes``, ``packed``), and a wrong kind with one naming both kinds and the value given."""
    for call, name in (
        (lambda: check_kv_tensor([1.0]), "x"),
        (lambda: check_bits(4.0), "bits"),
        (lambda: check_qtensor(torch.zeros(1)), "q"),
        (lambda: pack([1], 4), "codes"),
        (lambda: unpack([1], 4), "packed"),
    ):
        with pytest.raises(ArgumentTypeError, match=rf"^{name}: expected "):
            call()
    with pytest.raises(InvalidArgumentError, match=r"^kind: expected 'key' or 'value', got 'keys'$"):
        check_kind("keys")
    for bits in (1, 2, 4, 8):
        check_bits(bits)
    for bits in (0, 3, 9, 16):
        with pytest.raises(InvalidArgumentError, match=rf"got {bits}$"):
            check_bits(bits)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_puts_codes_low_bits_first_and_unpack_inverts_it(bits):
    """``pack`` puts 8 // bits codes per byte, the first in the lowest bits (written out here bit by bit), from
    any integer dtype, on the codes' device; ``unpack`` gives the codes back."""
    per = 8 // bits
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 2, 2 * per), generator=gen)  # int64
    packed = pack(codes, bits)
    want = torch.zeros(3, 2, 2, dtype=torch.int64)
    for i in range(per):
        want |= codes[..., i::per] << (bits * i)
    assert packed.dtype == torch.uint8 and torch.equal(packed.long(), want)
    assert torch.equal(unpack(packed, bits), codes.to(torch.uint8))
    assert pack(torch.zeros(2, 2 * per, dtype=torch.uint8, device=META), bits).device == META


def test_pack_refuses_a_last_dimension_that_does_not_fill_whole_bytes():
    """The last dimension must be a multiple of 8 // bits, whatever the others are; the error names it."""
    pack(torch.zeros(3, 5, 4, dtype=torch.uint8), 2)  # dim 1 (5) is not the one packed
    with pytest.raises(ShapeError, match=r"^last dimension 6 is not a multiple of 4 \(2-bit packing\)$"):
        pack(torch.zeros(4, 8, 6, dtype=torch.uint8), 2)


def test_fitting_scale_is_exact_when_the_division_is():
    """``amax / limit`` is kept exactly when ``amax / scale`` lands on ``limit`` (no needless ulp), and raised by
    one ulp only where it would overshoot; the result always fits."""
    s = fitting_scale(torch.tensor([127.0, 254.0, 1.0]), 127.0)
    assert s.tolist() == [1.0, 2.0, float(torch.tensor(1.0) / 127.0)]
    amax = torch.rand(1000, generator=torch.Generator().manual_seed(3)) * 100
    fs = fitting_scale(amax, 127.0)
    assert bool((amax / fs <= 127.0).all())
    assert bool((fs <= torch.nextafter(amax / 127.0, torch.tensor(float("inf")))).all())


def test_the_quantizer_interface():
    """The base Quantizer has no codes (NotImplementedError) and no block layout (a ConfigError listing the schemes
    that have one); its repr names the class and the scheme; ``round_trip`` keeps the input's dtype."""
    with pytest.raises(NotImplementedError):
        Quantizer().quantize(torch.zeros(1, 1, 1))
    with pytest.raises(ConfigError, match=r"^unsupported scheme Quantizer\(quantizer\): expected Float16, "):
        Quantizer().codec(SPEC, CPU)
    assert repr(Float16()) == "Float16(fp16)" and repr(PerTensorInt8(0.5)) == "PerTensorInt8(int8_tensor_fixed0.5)"
    x = torch.randn(1, 2, 8, dtype=torch.float64)
    assert Float16().round_trip(x).dtype == torch.float64
    assert PerTensorInt8().round_trip(x.half(), "value").dtype == torch.float16


def test_pack_takes_whole_number_codes_of_any_dtype():
    """``pack`` converts its codes to bytes first, so whole-number codes as floats (fresh from ``round``) pack
    exactly as their uint8 values do."""
    codes = torch.tensor([[1.0, 2.0, 15.0, 0.0]])
    assert pack(codes, 4).tolist() == [[1 | 2 << 4, 15]]


# -- int8 per token -----------------------------------------------------------------------------------------------

from memos_ref.quant import KIVI, fp8_block_scale, fp8_encode  # noqa: E402


def test_int8_token_scale_is_absmax_over_127_in_fp16_never_below_the_smallest_fp16():
    """Per (head, token) scale = fp16(absmax / 127); an all-zero token gets the smallest positive fp16 (2^-24),
    never 0 (which would divide by zero)."""
    x = torch.zeros(2, 3, 8)
    x[0, 1, 2], x[1, 2, 0] = 12.7, -254.0
    s = PerTokenInt8.scales(x)
    assert s.dtype == torch.float16
    want = torch.full((2, 3), 2.0**-24, dtype=torch.float16)
    want[0, 1], want[1, 2] = torch.tensor(12.7 / 127.0).half(), 2.0
    assert torch.equal(s, want)
    q = PerTokenInt8().quantize(x)
    assert torch.equal(q.scale, want) and q.shape == (2, 3, 8)


def test_int8_token_encode_with_clamps_to_plus_minus_127():
    """Codes are round-half-even(x / scale) clamped to [-127, 127] (symmetric: never -128)."""
    x = torch.tensor([[200.0, -200.0, 127.0, -127.4, 2.5, -2.5, 126.6, -300.0]])
    codes = PerTokenInt8.encode_with(x, torch.tensor([1.0]))
    assert codes.dtype == torch.int8 and codes.tolist() == [[127, -127, 127, -127, 2, -2, 127, -127]]


def test_int8_token_range_check_names_what_it_refuses_and_accepts_empty_input():
    """A value beyond 127·65504 is refused naming the argument (``x`` by default, the kind inside ``quantize``);
    an empty tensor has nothing to refuse."""
    big = torch.full((1, 1, 4), 127.0 * 65504.0 * 2)
    with pytest.raises(InvalidArgumentError, match=r"^x: absmax "):
        PerTokenInt8.check_range(big)
    with pytest.raises(InvalidArgumentError, match=r"^value: absmax "):
        PerTokenInt8().quantize(big, "value")
    PerTokenInt8.check_range(torch.zeros(0, 2, 4))


def test_int8_token_codec_writes_and_seals_without_clipping_or_rescaling():
    """Per-token int8 blocks report nothing clipped and nothing rescaled, on a token write and on a seal."""
    gen = torch.Generator().manual_seed(9)
    codec = PerTokenInt8().codec(SPEC, CPU)
    payload = codec.allocate(2)
    assert codec.write(payload, 0, 0, torch.tensor([0, 0]), torch.tensor([0, 1]), torch.randn(2, H, D)) == (0, 0)
    assert codec.encode(payload, torch.tensor([1]), _blocks(1, gen, 50.0)) == 0


# -- fp8 ----------------------------------------------------------------------------------------------------------


def _is_pow2(t):
    m, _ = torch.frexp(t)
    return bool((m == 0.5).all())


def test_fp8_block_scale_is_the_smallest_power_of_two_that_fits():
    """A streamed block's scale: the smallest power of two s with amax / s <= 448 (as float32 divides), including
    where float32's log2 rounds 2^k·(1+ε) down to k."""
    amax = torch.tensor([448.0, 1000.0, 1.0, 0.4375000596046448, 0.8750001192092896, 1.750000238418579, 3e-3])
    s = fp8_block_scale(amax)
    assert _is_pow2(s)
    assert bool((amax / s <= 448.0).all()) and bool((amax / (s / 2) > 448.0).all())
    assert s[:2].tolist() == [1.0, 4.0]


def test_fp8_encode_saturates_at_448_and_counts_what_saturated():
    """Values beyond ±448·scale saturate to ±448 (never NaN), and are counted."""
    codes, clipped = fp8_encode(torch.tensor([1000.0, -1000.0, 448.0, -3.0]), torch.tensor(1.0))
    assert codes.dtype == torch.float8_e4m3fn and codes.float().tolist() == [448.0, -448.0, 448.0, -3.0]
    assert clipped == 2


def test_fp8_arguments_are_checked_by_name():
    """fp8's checks name the argument they refuse (``saturation``, ``x``, ``scale``) and the valid choices."""
    with pytest.raises(ArgumentTypeError, match=r"^saturation: "):
        FP8E4M3(1)
    with pytest.raises(ConfigError, match=r"^saturation must be 'rescale' or 'clip', got 'wrap'$"):
        FP8E4M3("wrap")
    with pytest.raises(ArgumentTypeError, match=r"^x: "):
        FP8E4M3.needed_scale([1.0])
    with pytest.raises(ArgumentTypeError, match=r"^scale: "):
        FP8E4M3().quantize(torch.ones(1, 2, 4), scale=[1.0])
    assert FP8E4M3().quantize(torch.ones(2, 3, 4)).shape == (2, 3, 4)


def test_fp8_streamed_scales_grow_reset_and_count_rescales():
    """A token at offset 0 starts its block afresh (scale = the token's power-of-two scale, 0 rescales); a token
    needing no more range re-encodes nothing; each block whose held scale grows counts once."""
    codec = FP8E4M3().codec(SPEC, CPU)
    payload = codec.allocate(3)
    tok = torch.full((1, H, D), 1.0)
    for b in (0, 1):
        assert codec.write(payload, 0, 0, torch.tensor([b]), torch.tensor([0]), 100 * tok) == (0, 0)
    assert codec.write(payload, 0, 0, torch.tensor([0]), torch.tensor([1]), 100 * tok) == (0, 0)  # same need
    assert codec.write(payload, 0, 0, torch.tensor([0, 1]), torch.tensor([2, 1]), 1000 * tok.expand(2, H, D)) == (
        0,
        2,
    )
    assert bool((payload["scale"][0, 0, 0] == 4.0).all())
    assert codec.write(payload, 0, 0, torch.tensor([0]), torch.tensor([0]), tok) == (0, 0)  # reused block
    assert torch.equal(payload["scale"][0, 0, 0], fp8_block_scale(torch.ones(H)))


# -- KIVI ---------------------------------------------------------------------------------------------------------

KSPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_size=32)


def _kivi_oracle(x, bits, g, kind):
    """KIVI written out: asymmetric min/max groups (keys: g tokens per channel; values: g channels per token),
    fp16 scale (range / levels, at least 2^-24) and zero (the min), codes round-half-even clamped to [0, levels]."""
    h, t, d = x.shape
    levels = 2**bits - 1
    grp = x.reshape(h, t // g, g, d) if kind == "key" else x.reshape(h, t, d // g, g)
    dim = 2 if kind == "key" else 3
    lo, hi = grp.amin(dim, keepdim=True), grp.amax(dim, keepdim=True)
    scale = torch.clamp(((hi - lo) / levels).clamp(min=1e-8).half(), min=2.0**-24)
    zero = lo.half()
    codes = ((grp - zero.float()) / scale.float()).round().clamp(0, levels)
    return (codes * scale.float() + zero.float()).reshape(h, t, d)


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_round_trip_matches_the_written_out_scheme_with_several_groups(bits):
    """Keys per channel over groups of tokens, values per token over groups of channels, two groups each way;
    offset data whose fp16 zero rounds away from the true min still decodes within [min, max] of its group."""
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(2, 32, 32, generator=gen)
    x[0] += 1000.3  # fp16 zero rounds: codes must clamp at both ends
    q = KIVI(bits, 16)
    for kind in ("key", "value"):
        torch.testing.assert_close(q.dequantize(q.quantize(x, kind)), _kivi_oracle(x, bits, 16, kind))
    assert q.quantize(x).meta["kind"] == "key"
    const = torch.full((1, 16, 16), 3.0)
    assert bool((q.quantize(const, "key").scale == 2.0**-24).all())
    assert bool((q.quantize(const, "value").scale == 2.0**-24).all())


def test_kivi_codec_seals_and_decodes_blocks_with_several_groups():
    """Sealed KIVI blocks (two key groups per block, two value groups per token) decode exactly as the scheme
    decodes the same tensors; ``encode`` reports nothing clipped; the payload lives on the codec's device."""
    gen = torch.Generator().manual_seed(11)
    scheme = KIVI(4, 16)
    codec = scheme.codec(KSPEC, CPU)
    payload = codec.allocate(3)
    kv = torch.randn(2, 2, 2, 2, 32, 32, generator=gen)  # [m, L, 2, H, T, D]
    assert codec.encode(payload, torch.tensor([2, 0]), kv) == 0
    out = codec.decode(payload, torch.tensor([0, 2]), 1)  # [2, 2, H, T, D]
    for j, m in enumerate((1, 0)):
        for kvi, kind in enumerate(("key", "value")):
            torch.testing.assert_close(out[j, kvi], _kivi_oracle(kv[m, 1, kvi], 4, 16, kind))
    assert all(t.device == META for t in scheme.codec(KSPEC, META).allocate(1).values())


def test_kivi_configuration_is_checked_by_name():
    """KIVI's defaults are 4 bits in groups of 32; a wrong type names ``bits`` or ``group_size``; group sizes
    16..128 are accepted, others refused naming the choices; a head dim that does not split into value groups is
    refused (scheme and codec), naming it."""
    assert KIVI().name == "kivi4_g32"
    with pytest.raises(ArgumentTypeError, match=r"^bits: "):
        KIVI("4")
    with pytest.raises(ArgumentTypeError, match=r"^group_size: "):
        KIVI(4, 32.0)
    assert KIVI(2, 128).group_size == 128
    with pytest.raises(ConfigError, match=r"^KIVI group_size must be one of 16, 32, 64, 128, got 129$"):
        KIVI(4, 129)
    with pytest.raises(ShapeError, match=r"^head_dim 48 is not a multiple of the value group size 32$"):
        KIVI().quantize(torch.zeros(1, 32, 48), "value")
    bad = KVSpec(num_layers=1, num_kv_heads=1, head_dim=48, dtype=torch.float32, block_size=32)
    with pytest.raises(ConfigError, match=r"^head_dim 48 does not split into KIVI value groups / packed bytes$"):
        KIVI(4, 32).codec(bad, CPU)


def test_kivi_dequantize_reads_the_key_groups_from_the_codes_and_handles_no_tokens():
    """Keys decode with the group size their scales imply (a QTensor from another group size decodes right), and
    zero tokens decode to an empty tensor."""
    x = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(4))
    q32 = KIVI(4, 32).quantize(x, "key")
    torch.testing.assert_close(KIVI(4, 16).dequantize(q32), KIVI(4, 32).dequantize(q32))
    assert KIVI(4, 16).dequantize(KIVI(4, 16).quantize(torch.zeros(1, 0, 16), "key")).shape == (1, 0, 16)


# -- the pool: staging, sealing, bookkeeping (memos_ref/quant/pool.py) -------------------------------------------
# Oracles: the K/V a test wrote (a staged block holds them at full precision), and a separate codec's own
# encode/decode of the same values (what a sealed block must read back as).

from memos_ref.errors import InvalidBlockError, StagingFullError  # noqa: E402

SPEC16 = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, block_size=T)


def _pool(scheme=None, num_blocks=6, spec=SPEC, **kw):
    """A pool with a residual window (blocks are staged at full precision, then sealed) unless ``residual_tokens=0``
    is given; 4 staging blocks by default."""
    kw.setdefault("residual_tokens", T)
    kw.setdefault("staging_blocks", 4)
    return QuantizedBlockPool(spec, num_blocks, scheme or PerTokenInt8(), **kw)


def _fill(pool, block, gen, amp=1.0, dtype=torch.float32):
    """Write one whole block (every layer) with random K/V; returns them as ``kv [L, 2, H, T, D]``."""
    kv = (amp * torch.randn(L, 2, H, T, D, generator=gen)).to(dtype)
    slots = torch.arange(block * T, (block + 1) * T)
    for layer in range(L):
        pool.write(layer, slots, kv[layer, 0].transpose(0, 1), kv[layer, 1].transpose(0, 1))
    return kv


def _sealed(scheme, kv):
    """What a sealed block holding ``kv [L, 2, H, T, D]`` reads back as, by a codec of its own: ``[L, 2, H, T, D]``."""
    codec = scheme.codec(SPEC, CPU)
    payload = codec.allocate(1)
    codec.encode(payload, torch.tensor([0]), kv[None].float())
    return torch.stack([codec.decode(payload, torch.tensor([0]), layer)[0] for layer in range(L)])


def _read(pool, block):
    """``[L, 2, H, T, D]`` of one block, layer by layer through ``read_blocks``."""
    return torch.stack([pool.read_blocks(torch.tensor([block]), layer)[0] for layer in range(L)])


def _count_decodes(pool, monkeypatch):
    """Count the pool codec's ``decode`` calls (a list that grows by one per call)."""
    calls, decode = [], pool.codec.decode
    monkeypatch.setattr(pool.codec, "decode", lambda *a: calls.append(a[1].tolist()) or decode(*a))
    return calls


@pytest.mark.parametrize(
    "name, kw",
    [
        ("num_blocks", {"num_blocks": 4.0}),
        ("residual_tokens", {"residual_tokens": 8.0}),
        ("staging_blocks", {"staging_blocks": 2.0}),
        ("layer_scales", {"layer_scales": [[0.1, 0.1]] * L}),
    ],
)
def test_pool_arguments_of_the_wrong_type_are_refused_by_name(name, kw):
    """Each size or scale of the wrong type raises an ArgumentTypeError that starts with the argument's name."""
    args = {"num_blocks": 4, **kw}
    with pytest.raises(ArgumentTypeError, match=rf"^{name}: expected "):
        QuantizedBlockPool(SPEC, args.pop("num_blocks"), PerTokenInt8(), **args)


def test_pool_sizes_and_schemes_out_of_range_are_refused_naming_the_value():
    """0 blocks, a negative residual window or staging count, and a scheme with no block layout are refused with a
    ConfigError naming the value; the smallest valid sizes (1 block, 0 staging blocks) are accepted."""
    for n in (0, -1):
        with pytest.raises(ConfigError, match=rf"^num_blocks must be a positive int, got {n}$"):
            QuantizedBlockPool(SPEC, n, PerTokenInt8())
    with pytest.raises(ConfigError, match=r"^residual_tokens must be >= 0, got -1$"):
        QuantizedBlockPool(SPEC, 4, PerTokenInt8(), residual_tokens=-1)
    with pytest.raises(ConfigError, match=r"^staging_blocks must be >= 0, got -1$"):
        QuantizedBlockPool(SPEC, 4, PerTokenInt8(), staging_blocks=-1)
    schemes = "Float16, PerTokenInt8, PerTensorInt8, FP8E4M3 or KIVI"
    with pytest.raises(ConfigError, match=rf"^unsupported scheme 'int8': expected {schemes}$"):
        QuantizedBlockPool(SPEC, 4, "int8")
    assert QuantizedBlockPool(SPEC, 1, PerTokenInt8()).num_blocks == 1
    pool = QuantizedBlockPool(SPEC, 4, PerTokenInt8(), residual_tokens=T, staging_blocks=0)
    assert pool.staging_capacity == 0 and pool.staging_available == 0


def test_default_staging_is_none_when_streaming_else_a_quarter_of_the_pool_but_at_least_8():
    """A streaming pool (no residual window) stages nothing; a pool with one gets max(8, num_blocks // 4) staging
    blocks."""
    for scheme in (PerTokenInt8(), FP8E4M3(), PerTensorInt8(0.1)):
        pool = QuantizedBlockPool(SPEC, 40, scheme)
        assert pool.streaming and pool.staging_capacity == 0 and pool.staging.shape[0] == 0
    for n, want in ((4, 8), (16, 8), (36, 9), (40, 10), (43, 10)):
        pool = QuantizedBlockPool(SPEC, n, PerTokenInt8(), residual_tokens=T)
        assert pool.staging_capacity == want and pool.staging_available == want, n


def test_staging_and_reads_are_in_the_models_dtype():
    """An fp16 model's pool stages its K/V in fp16 (the slab the kernels read) and reads back fp16: a staged block
    bit for bit, a sealed one as its codec decodes it, rounded once to fp16."""
    gen = torch.Generator().manual_seed(31)
    pool = _pool(spec=SPEC16)
    assert pool.staging.dtype == torch.float16 and pool.kernel_args(1)["staging"].dtype == torch.float16
    kv = [_fill(pool, b, gen, dtype=torch.float16) for b in (0, 1)]
    pool.seal([0])
    staged, sealed = _read(pool, 1), _read(pool, 0)
    assert staged.dtype == sealed.dtype == torch.float16
    assert torch.equal(staged, kv[1])
    assert torch.equal(sealed, _sealed(PerTokenInt8(), kv[0]).half())


def test_the_block_to_staging_row_map_says_minus_one_for_every_block_not_staged():
    """The host map and the kernels' device copy of it hold -1 (sealed / no row) for every block of a fresh pool,
    the row for a staged block, and -1 again once it is sealed."""
    pool = _pool()
    for m in (pool.staging_slot, pool.device_staging_slot):
        assert m.dtype == torch.long and m.tolist() == [-1] * 6
    _fill(pool, 2, torch.Generator().manual_seed(32))
    want = [-1, -1, 0, -1, -1, -1]
    assert pool.staging_slot.tolist() == pool.device_staging_slot.tolist() == want
    pool.seal([2])
    assert pool.staging_slot.tolist() == pool.device_staging_slot.tolist() == [-1] * 6


def test_a_calibrated_per_tensor_pool_holds_the_scales_it_was_given():
    """``layer_scales`` of a calibrated per-tensor int8 pool are the ``[L, 2]`` scales it was built with (what its
    bytes and its encode use); other schemes have none."""
    scales = torch.tensor([[0.5, 0.25], [0.125, 2.0]])
    pool = QuantizedBlockPool(SPEC, 4, PerTensorInt8(), layer_scales=scales)
    assert torch.equal(pool.layer_scales, scales)
    assert QuantizedBlockPool(SPEC, 4, PerTokenInt8()).layer_scales is None


def test_stats_count_exactly_the_staged_and_sealed_blocks():
    """``stats()`` reports, by name: the blocks staged now, the slab's capacity and its free rows, the blocks sealed
    so far (summed over every seal), and nothing rescaled or clipped for per-token int8."""
    gen = torch.Generator().manual_seed(33)
    pool = _pool(num_blocks=8, staging_blocks=5)
    zero = {"staged_blocks": 0, "staging_capacity": 5, "seals": 0, "rescales": 0, "clipped": 0, "staging_free": 5}
    assert pool.stats() == zero
    for b in (0, 1, 2, 3):
        _fill(pool, b, gen)
    assert pool.stats() == {**zero, "staged_blocks": 4, "staging_free": 1}
    pool.seal([0, 1])
    pool.seal([3])
    assert pool.stats() == {**zero, "staged_blocks": 1, "seals": 3, "staging_free": 4}
    assert pool.seals == 3 and pool.staged_blocks == 1


def test_clipped_counts_every_value_beyond_a_fixed_per_tensor_scale_over_writes_and_seals():
    """A fixed per-tensor int8 scale clips values beyond ±127.5·scale; ``clipped`` is the running total of such
    values over keys and values, every streamed write and every seal."""
    scheme = PerTensorInt8(0.01)  # clips |x| > 1.275
    k, v = torch.zeros(2, H, D), torch.zeros(2, H, D)
    k[0, 0, :3] = 10.0
    v[1, 1, :2] = -10.0
    stream = QuantizedBlockPool(SPEC, 4, scheme)
    stream.write(0, torch.tensor([0, 1]), k, v)
    assert stream.clipped == 5
    stream.write(1, torch.tensor([T, T + 1]), k, v)
    assert stream.clipped == 10 and stream.stats()["clipped"] == 10
    staged = _pool(scheme)
    gen = torch.Generator().manual_seed(34)
    kv = [_fill(staged, b, gen, amp=2.0) for b in (0, 1)]
    want = [int((x.abs() / 0.01 > 127.5).sum()) for x in kv]
    assert staged.clipped == 0 and min(want) > 0
    staged.seal([0])
    assert staged.clipped == want[0]
    staged.seal([1])
    assert staged.clipped == want[0] + want[1]


@pytest.mark.parametrize("residual", [0, T], ids=["streaming", "staged"])
def test_a_write_skips_slots_of_minus_one(residual):
    """Slot -1 skips its token: the others land at their slots, and no other block (the last one included, which
    -1 would index from the end) is touched or staged."""
    pool = _pool(residual_tokens=residual, num_blocks=4)
    k, v = torch.randn(3, H, D), torch.randn(3, H, D)
    pool.write(0, torch.tensor([0, -1, 1]), k, v)
    got = pool.read_blocks(torch.arange(4), 0)  # [4, 2, H, T, D]
    codec = PerTokenInt8()
    for kv, x in ((0, k), (1, v)):
        want = x[[0, 2]].transpose(0, 1) if residual else codec.round_trip(x[[0, 2]].transpose(0, 1), "key")
        torch.testing.assert_close(got[0, kv, :, :2], want)
    assert not bool(got[1:].any()) and bool((got[0, :, :, 2:] == 0).all())
    assert pool.staging_slot.tolist() == ([-1] * 4 if not residual else [0, -1, -1, -1])


def test_a_non_finite_value_is_refused_naming_layer_kind_and_value_and_nothing_is_written():
    """NaN or inf in K/V raises an InvalidArgumentError naming the layer (when writing), key or value, and the
    first non-finite value itself; ``check_kv`` with no layer names only the kind. Nothing is written."""
    pool = _pool()
    k, v = torch.ones(2, H, D), torch.ones(2, H, D)
    v[1, 0, 3] = float("inf")
    with pytest.raises(InvalidArgumentError, match=r"^layer 1 value: found a non-finite value \(inf\); a int8_token"):
        pool.write(1, torch.tensor([0, 1]), k, v)
    k[0, 1, 1] = float("nan")
    with pytest.raises(InvalidArgumentError, match=r"^key: found a non-finite value \(nan\); "):
        pool.check_kv(k, v)
    with pytest.raises(InvalidArgumentError, match=r"^value: found a non-finite value \(inf\); "):
        pool.check_kv(torch.ones(2, H, D), v)
    assert pool.staging_slot.tolist() == [-1] * 6 and not bool(pool.staging.any())


def test_a_write_needing_more_staging_than_is_free_is_refused_with_the_counts():
    """A write whose blocks need more staging rows than are free raises StagingFullError saying how many it needs,
    how many of the slab's rows are free (``needed`` / ``capacity``) and what to change; nothing is staged."""
    pool = _pool(staging_blocks=1)
    with pytest.raises(StagingFullError) as e:
        pool.write(0, torch.tensor([0, T, 2 * T]), torch.ones(3, H, D), torch.ones(3, H, D))
    assert str(e.value) == (
        "3 blocks need full-precision staging but 1 of 1 staging blocks are free (they hold the residual windows "
        "of live sequences): raise staging_blocks or lower residual_tokens"
    )
    assert (e.value.needed, e.value.capacity) == (3, 1)
    assert pool.staging_slot.tolist() == [-1] * 6 and pool.staging_available == 1


def test_a_sealed_block_is_decoded_for_a_write_only_when_the_write_keeps_earlier_offsets(monkeypatch):
    """Writing into sealed blocks re-stages them: a block written from offset 0 starts afresh (no decode), a block
    written from a later offset is decoded first (once per layer, that block only), so its earlier offsets read
    back as sealed — also when both kinds are in one write."""
    gen = torch.Generator().manual_seed(35)
    pool = _pool()
    kv = [_fill(pool, b, gen) for b in (0, 1)]
    pool.seal([0, 1])
    calls = _count_decodes(pool, monkeypatch)
    k, v = torch.randn(4, H, D, generator=gen), torch.randn(4, H, D, generator=gen)
    pool.write(0, torch.tensor([0, 1, T + 3, T + 4]), k, v)  # block 0 from offset 0, block 1 from offset 3
    assert calls == [[1]] * L
    got = _read(pool, 1)
    torch.testing.assert_close(got[..., :3, :], _sealed(PerTokenInt8(), kv[1])[..., :3, :], rtol=0, atol=0)
    torch.testing.assert_close(got[0, 0, :, 3:5], k[2:].transpose(0, 1), rtol=0, atol=0)
    calls.clear()
    _fill(pool, 2, gen)  # a never-sealed block from offset 0: nothing to decode
    pool.seal([2])
    pool.write(1, torch.tensor([2 * T]), k[:1], v[:1])
    assert calls == []


def test_copy_on_write_of_a_staged_block_is_refused_when_no_staging_row_is_free():
    """Copying a staged block (here the one in slab row 0) to an unstaged block when the slab is full raises
    StagingFullError (needing 1, 0 free) before anything is copied: the destination reads as before."""
    gen = torch.Generator().manual_seed(36)
    pool = _pool(staging_blocks=1)
    kv = _fill(pool, 1, gen)
    pool.seal([1])
    src = _fill(pool, 0, gen)
    assert pool.staging_slot.tolist()[:2] == [0, -1] and pool.staging_available == 0
    before = _read(pool, 1)
    with pytest.raises(StagingFullError) as e:
        pool.copy_block(0, 1)
    assert str(e.value) == (
        "no free staging block for a copy-on-write of a staged block: raise staging_blocks or lower residual_tokens"
    )
    assert (e.value.needed, e.value.capacity) == (1, 0)
    assert torch.equal(_read(pool, 1), before) and torch.equal(before, _sealed(PerTokenInt8(), kv))
    assert torch.equal(_read(pool, 0), src) and pool.staging_slot.tolist()[:2] == [0, -1]


def test_copy_on_write_into_a_staged_destination_reuses_its_staging_row():
    """With every staging row taken, copying a staged block onto another staged block (in row 0) needs no new
    row: the destination reads the source's values, the source is untouched, and no row is taken or freed."""
    gen = torch.Generator().manual_seed(37)
    pool = _pool(staging_blocks=2)
    _fill(pool, 3, gen)  # row 0
    src = _fill(pool, 1, gen)  # row 1
    assert pool.staging_slot.tolist()[1:4:2] == [1, 0] and pool.staging_available == 0
    pool.copy_block(1, 3)
    assert torch.equal(_read(pool, 3), src) and torch.equal(_read(pool, 1), src)
    assert pool.staging_slot.tolist()[1:4:2] == [1, 0] and pool.staging_available == 0


def test_copy_on_write_of_a_staged_block_onto_a_sealed_one_copies_the_row_without_decoding(monkeypatch):
    """Copying a staged block onto a sealed one gives the destination a staging row holding the source's exact
    values; the destination's old contents are replaced whole, so nothing is decoded."""
    gen = torch.Generator().manual_seed(38)
    pool = _pool()
    _fill(pool, 2, gen)
    pool.seal([2])
    src = _fill(pool, 4, gen)
    calls = _count_decodes(pool, monkeypatch)
    pool.copy_block(4, 2)
    assert calls == []
    assert pool.is_staged(2) and torch.equal(_read(pool, 2), src) and torch.equal(_read(pool, 4), src)


def test_block_is_a_dequantized_copy_of_every_layer_of_that_block():
    """``block(b)`` is ``[L, 2, H, T, D]``: each layer's keys and values of block b (not block 0), staged ones as
    written and sealed ones as their codec decodes them; it is a copy."""
    gen = torch.Generator().manual_seed(39)
    pool = _pool()
    kv = [_fill(pool, b, gen) for b in range(3)]
    assert torch.equal(pool.block(2), kv[2])
    pool.seal([1])
    got = pool.block(1)
    assert got.shape == (L, 2, H, T, D) and torch.equal(got, _sealed(PerTokenInt8(), kv[1]))
    got.zero_()
    assert torch.equal(pool.block(1), _sealed(PerTokenInt8(), kv[1]))


def test_read_blocks_refuses_block_ids_outside_the_pool_and_tables_that_are_not_tensors():
    """Every id passed to ``read_blocks`` is checked (a negative one too, which would otherwise index from the end)
    with an InvalidBlockError naming them; a list instead of a tensor is an ArgumentTypeError."""
    pool = _pool(num_blocks=4)
    for bad in ([-1], [0, 4]):
        with pytest.raises(InvalidBlockError, match=rf"^block_table holds block ids \[{bad[-1]}\] outside \[0, 4\)$"):
            pool.read_blocks(torch.tensor(bad), 0)
    with pytest.raises(ArgumentTypeError, match=r"^block_table: expected Tensor, got list"):
        pool.read_blocks([0, 1], 0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32])
def test_gather_reads_the_same_keys_and_values_from_a_block_table_of_any_integer_dtype(dtype):
    """A block table of uint8 (never taken as a mask), int16 or int32 ids gathers what the int64 table does."""
    gen = torch.Generator().manual_seed(40)
    pool = _pool()
    for b in (1, 3, 0):
        _fill(pool, b, gen)
    pool.seal([3])
    table = torch.tensor([3, 0, 1])
    for layer in range(L):
        want = pool.gather(layer, table, 2 * T + 3)
        got = pool.gather(layer, table.to(dtype), 2 * T + 3)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0].shape == (H, 2 * T + 3, D)


def test_seal_refuses_blocks_that_are_not_a_list_naming_the_argument():
    """``seal`` takes a list or tuple of block ids; anything else is an ArgumentTypeError naming ``blocks``."""
    pool = _pool()
    _fill(pool, 0, torch.Generator().manual_seed(41))
    with pytest.raises(ArgumentTypeError, match=r"^blocks: expected list or tuple, got int"):
        pool.seal(0)
    assert pool.is_staged(0) and pool.seals == 0


@pytest.mark.parametrize("scheme", [PerTokenInt8(), FP8E4M3()], ids=str)
def test_poison_makes_every_read_of_that_block_nan_and_nothing_else(scheme):
    """Poisoning a block (debug mode, after it is freed) makes all of it read NaN, sealed or staged (its staging
    row is given back); every other block reads as before."""
    gen = torch.Generator().manual_seed(42)
    pool = _pool(scheme)
    for b in range(4):
        _fill(pool, b, gen)
    pool.seal([0, 1])
    before = [_read(pool, b) for b in range(4)]
    free = pool.staging_available
    pool.poison(1)  # sealed
    pool.poison(3)  # staged
    assert bool(_read(pool, 1).isnan().all()) and bool(_read(pool, 3).isnan().all())
    assert torch.equal(_read(pool, 0), before[0]) and torch.equal(_read(pool, 2), before[2])
    assert not pool.is_staged(3) and pool.staging_available == free + 1


def test_an_unhold_without_a_matching_hold_is_caught_naming_the_blocks():
    """Window holds are counted per block; letting go of a block no window holds is a bookkeeping bug, raised at
    once (AssertionError naming the blocks) rather than leaving a negative count to seal blocks early."""
    pool = _pool()
    pool.hold([2, 2, 3])
    pool.unhold([2, 3])
    assert pool.window_holds.tolist() == [0, 0, 1, 0, 0, 0]
    with pytest.raises(AssertionError, match=r"^window holds below zero for blocks \[3\]$"):
        pool.unhold([3])


def test_seal_unheld_of_no_blocks_or_on_a_streaming_pool_seals_nothing():
    """``seal_unheld`` returns how many blocks it sealed: 0 for an empty list (blocks stay staged), 0 on a streaming
    pool, and the count of staged, unheld blocks otherwise."""
    gen = torch.Generator().manual_seed(43)
    pool = _pool()
    for b in (0, 1, 2):
        _fill(pool, b, gen)
    pool.hold([1])
    assert pool.seal_unheld([]) == 0 and pool.staged_blocks == 3
    assert pool.seal_unheld([0, 1, 2, 4]) == 2 and pool.staging_slot.tolist()[:3] == [-1, 1, -1]
    stream = QuantizedBlockPool(SPEC, 4, PerTokenInt8())
    assert stream.seal_unheld([0, 1]) == 0 and stream.seal_unheld([]) == 0 and stream.seals == 0


def test_a_cached_block_still_inside_a_live_window_is_not_sealed():
    """The prefix-cache hook seals a staged block only when no live sequence holds it inside its residual window;
    a held block stays staged, an unheld one is sealed, and an unstaged one is left alone."""
    gen = torch.Generator().manual_seed(44)
    pool = _pool()
    kv = _fill(pool, 0, gen)
    _fill(pool, 1, gen)
    pool.hold([0])
    pool.seal_cached(0)
    assert pool.is_staged(0) and pool.seals == 0 and torch.equal(_read(pool, 0), kv)
    pool.seal_cached(1)
    pool.seal_cached(2)
    assert not pool.is_staged(1) and pool.seals == 1 and pool.staged_blocks == 1


def test_a_quantized_pool_refuses_to_grow_saying_to_size_it_for_the_workload():
    """``grow`` on a quantized pool raises a ConfigError that says why and what to do, and changes nothing."""
    pool = _pool()
    with pytest.raises(ConfigError, match=r"^a quantized pool cannot grow; size it for the workload$"):
        pool.grow(2)
    assert pool.num_blocks == 6


def test_reads_land_on_the_pools_device_whatever_torchs_default_device_is():
    """``read_blocks`` and ``gather`` return tensors on the pool's device even when torch's default device is another
    one (``torch.set_default_device`` / ``with torch.device(...)``), with the same values."""
    gen = torch.Generator().manual_seed(45)
    pool = _pool()
    for b in (0, 1):
        _fill(pool, b, gen)
    pool.seal([0])
    table = torch.tensor([0, 1])
    want = pool.read_blocks(table, 1)
    want_k, want_v = pool.gather(1, table, T + 5)
    with torch.device(META):
        got = pool.read_blocks(table, 1)
        k, v = pool.gather(1, table, T + 5)
    assert got.device == k.device == v.device == CPU
    assert torch.equal(got, want) and torch.equal(k, want_k) and torch.equal(v, want_v)


def test_bookkeeping_works_whatever_torchs_default_device_is():
    """``hold``, ``unhold``, ``seal``, ``seal_unheld`` and ``block`` keep the pool's host maps on the CPU and its
    indices on the pool's device, so a caller inside ``with torch.device(...)`` (or after
    ``torch.set_default_device``) gets the same blocks as one outside it. They built their index tensors on torch's
    default device, and failed (``index_add_`` across devices, an ``IndexError``) or read garbage."""
    outside, inside = _pool(), _pool()
    for pool in (outside, inside):
        gen = torch.Generator().manual_seed(46)  # the same K/V in both pools
        for b in (0, 1, 2):
            _fill(pool, b, gen)
    want = []
    for pool, device in ((outside, None), (inside, META)):
        with torch.device(device) if device is not None else contextlib.nullcontext():
            pool.hold([1, 2])
            pool.seal([0])
            pool.unhold([1])
            sealed = pool.seal_unheld([1, 2])
            blocks = [pool.block(b) for b in (0, 1, 2)]
        assert all(b.device == CPU for b in blocks)
        want.append((sealed, [pool.is_staged(b) for b in (0, 1, 2)], blocks, pool.window_holds.tolist()))
    (s0, st0, b0, h0), (s1, st1, b1, h1) = want
    assert (s1, st1, h1) == (s0, st0, h0) == (1, [False, False, True], [0, 0, 1, 0, 0, 0])
    assert all(torch.equal(x, y) for x, y in zip(b0, b1, strict=True))


class _CastOverflowsToNaN(TorchFunctionMode):
    """torch < 2.12's cast to ``float8_e4m3fn`` (the c10 conversion before pytorch#178817, on the CPU and on CUDA):
    a value of magnitude >= 480 (the first one past 448's rounding range), infinities included, becomes NaN. From
    2.12 on the cast saturates at ±448 by itself; pyproject admits torch >= 2.4."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.Tensor.to and isinstance(out, torch.Tensor) and out.dtype == torch.float8_e4m3fn:
            source = args[0]
            if source.dtype != torch.float8_e4m3fn:
                bits = out.view(torch.uint8).clone()  # s.1111.111 is NaN; the sign is kept, as c10 kept it
                bits[source.float().abs() >= 480.0] |= 0x7F
                out = bits.view(torch.float8_e4m3fn)
        return out


def test_fp8_encode_saturates_at_448_even_where_torchs_cast_overflows_to_nan():
    """fp8_encode saturates values beyond ±448·scale itself, so its codes hold no NaN under a torch whose cast to
    float8_e4m3fn turns an overflow into NaN (torch < 2.12, emulated here; this torch saturates on its own)."""
    x = torch.tensor([1000.0, -1000.0, 500.0, -480.0, 448.0, -3.0, float("inf"), float("-inf")])
    with _CastOverflowsToNaN():
        assert torch.tensor([1000.0, -480.0, 3.0]).to(torch.float8_e4m3fn).float().isnan().tolist() == [
            True,
            True,
            False,
        ]  # the premise: the emulated cast gives NaN past the range
        codes, clipped = fp8_encode(x, torch.tensor(1.0))
    assert codes.dtype == torch.float8_e4m3fn
    assert codes.float().tolist() == [448.0, -448.0, 448.0, -448.0, 448.0, -3.0, 448.0, -448.0]
    assert clipped == 6


def _read_back(scheme, device: str) -> None:
    """Write 3 blocks of K/V through a sequence of a quantized pool on ``device`` (residual window of one block:
    the first blocks are sealed, the newest stays staged) and read them back with ``to_dense``, whose block table
    is a host tensor: every token within the codec's error of what was written, on the pool's device."""
    kv = PagedKV(SPEC, 8, device=device, quant=scheme, residual_tokens=T, staging_blocks=4, prefix_caching=False)
    seq = kv.new_sequence()
    gen, written = torch.Generator().manual_seed(47), []
    for layer in range(SPEC.num_layers):
        k, v = torch.randn(2, 2, 3 * T, 16, generator=gen).unbind(0)  # [H, 3T, D] each
        seq.append(layer, k.to(device), v.to(device))
        written.append((k, v))
    assert not kv.pool.is_staged(seq.block_table[0]) and kv.pool.is_staged(seq.block_table[-1])  # both kinds
    assert seq.block_table_tensor().device.type == "cpu"
    for layer, (want_k, want_v) in enumerate(written):
        k, v = seq.to_dense(layer)
        assert k.device.type == v.device.type == device
        for got, want in ((k, want_k), (v, want_v)):
            bound = 0.05 * want.abs().max().item()
            torch.testing.assert_close(got.cpu(), want, atol=bound, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: a GPU pool read through a host table")
@pytest.mark.parametrize("scheme", [PerTokenInt8(), FP8E4M3()], ids=["int8", "fp8"])
def test_a_gpu_quantized_pool_reads_sealed_and_staged_blocks_through_a_host_block_table(scheme):
    """A quantized pool on the GPU reads a sequence back through ``SequenceCache.to_dense`` (a host block table, as
    the reference attention path and the dense mirror pass it): sealed blocks decoded and the staged one at full
    precision, each token within the codec's error of what was written — as on the CPU. (It raised before the fix,
    found by reading: the staging mask was moved to the GPU and indexed the host block ids; unrun here, no GPU.)"""
    _read_back(scheme, "cuda")


@pytest.mark.parametrize("scheme", [PerTokenInt8(), FP8E4M3()], ids=["int8", "fp8"])
def test_a_quantized_pool_reads_sealed_and_staged_blocks_through_a_host_block_table(scheme):
    """The CPU twin of the GPU test above: the same writes read back through ``to_dense``, sealed and staged blocks
    each within the codec's error of what was written."""
    _read_back(scheme, "cpu")
