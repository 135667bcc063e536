"""Re-staging a sealed quantized block (issue 30's survivor: the test that said it wrote "back into a sealed block"
after a truncate landed in a block still staged). Here the block is checked to be sealed before the write; the
oracle is the K/V the test wrote, within the scheme's quantization error."""

from __future__ import annotations

import pytest
import torch

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
