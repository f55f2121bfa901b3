"""The numpy KV-cache specification (ott_gguf/reference): quantizer, layout, schedule, OTT,
attention and footprint."""

import numpy as np
import pytest

from ott_gguf.errors import InvalidArgumentError
from ott_gguf.reference import (
    KVConfig,
    LayerCache,
    attend,
    dequantize_groups,
    footprint,
    forward_chunk,
    measure,
    pack_codes,
    prefill,
    preset,
    quantize_block,
    quantize_groups,
    unpack_codes,
)
from ott_gguf.reference.quant import CLIP_SHRINK, decode_scale8

# A small OTT config so that many events happen in few tokens.
SMALL = KVConfig(
    bits_k=2, bits_v=2, group_k=8, group_v=4, block=16, window=4, pool=2, extra_pool=5, skip_layers=0, sink=2
)


def rng(seed):
    return np.random.default_rng(seed)


def scalar_quantize(x, bits, lo=None, hi=None):
    """The quant.py recipe written one float32 scalar at a time (the C reference shape), for
    the range [lo, hi] (default: the group's min-max range): codes, the fp16 scale and min,
    and their f32 values."""
    f = [np.float32(e) for e in x]
    lo = min(f) if lo is None else lo
    hi = max(f) if hi is None else hi
    levels = np.float32(2**bits - 1)
    scale, mn16 = np.float16(np.float32(hi - lo) / levels), np.float16(lo)
    s32, m32 = np.float32(scale), np.float32(mn16)
    inv = np.float32(1.0) / s32 if s32 != 0 else np.float32(0.0)
    codes = [int(min(max(np.rint(np.float32(np.float32(e - m32) * inv)), 0), levels)) for e in f]
    return codes, scale, mn16, s32, m32


def scalar_clipped(x, bits, encode):
    """The clipped-range search of quant.py one scalar at a time (kv_quant.c's shape);
    encode(x, bits, lo, hi) -> codes, stored scale, stored min, f32 scale, f32 min
    (scalar_quantize: fp16 parameters, scalar_params8: 8-bit ones)."""
    f = [np.float32(e) for e in x]
    mn, mx = min(f), max(f)
    width = np.float32(mx - mn)
    best = None
    for c in CLIP_SHRINK:
        d = np.float32(c * width)
        codes, scale, mn_stored, s32, m32 = encode(x, bits, np.float32(mn + d), np.float32(mx - d))
        err = 0.0
        for code, e in zip(codes, f):
            r = np.float32(np.float32(np.float32(code) * s32) + m32) - e
            err += float(r) * float(r)
        if best is None or err < best[0]:
            best = (err, codes, scale, mn_stored)
    return best[1:]


# ---------------------------------------------------------------- quantizer and packing


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_error_within_half_scale(bits):
    x = (rng(bits).standard_normal((500, 32)) * rng(1).uniform(0.01, 20, (500, 1))).astype(np.float16)
    codes, scale, mn = quantize_groups(x, bits)
    err = np.abs(x.astype(np.float64) - dequantize_groups(codes, scale, mn))
    assert (err <= scale.astype(np.float64)[:, None] / 2 * (1 + 2**-9)).all()
    assert codes.max() == 2**bits - 1
    # the minimum element always gets code 0, the maximum the top code
    rows = np.arange(len(x))
    assert (codes[rows, x.argmin(axis=1)] == 0).all()
    assert (codes[rows, x.argmax(axis=1)] == 2**bits - 1).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_quantize_matches_scalar_recipe(bits):
    x = (rng(7).standard_normal((200, 16)) * 3).astype(np.float16)
    codes, scale, mn = quantize_groups(x, bits)
    for g in range(len(x)):
        c, s, m, _, _ = scalar_quantize(x[g], bits)
        assert codes[g].tolist() == c
        assert scale[g].tobytes() == s.tobytes() and mn[g].tobytes() == m.tobytes()


@pytest.mark.parametrize("bits", [2, 4])
def test_clipped_quantize_matches_scalar_recipe(bits):
    # heavy tails (some groups with one far outlier) so that the clipped ranges win
    x = rng(11).standard_normal((120, 32)) * 2
    x[::3, 5] *= 9
    x = x.astype(np.float16)
    codes, scale, mn = quantize_groups(x, bits, clip=True)
    for g in range(len(x)):
        c, s, m = scalar_clipped(x[g], bits, scalar_quantize)
        assert codes[g].tolist() == c
        assert scale[g].tobytes() == s.tobytes() and mn[g].tobytes() == m.tobytes()


def test_clipped_ranges_halve_the_error_of_gaussian_groups():
    """At 2 bits the best clipped range of a 128-element Gaussian group has about the error of
    the best uniform quantizer (0.1188 of the variance), min-max about twice as much."""
    x = rng(12).standard_normal((400, 128)).astype(np.float16)
    mse = {}
    for clip in (False, True):
        y = dequantize_groups(*quantize_groups(x, 2, clip=clip))
        mse[clip] = float(((y - x.astype(np.float64)) ** 2).mean())
    assert 0.11 < mse[True] < 0.13 and mse[False] > 1.9 * mse[True]
    # the whole range is the first candidate: a group that cannot gain keeps it exactly
    flat = np.array([[0, 1, 2, 3] * 8], dtype=np.float16)
    assert [a.tobytes() for a in quantize_groups(flat, 2, clip=True)] == [a.tobytes() for a in quantize_groups(flat, 2)]


def scalar_params8(x, bits, lo=None, hi=None):
    """The 8-bit parameter recipe of quant.py one scalar at a time (kv_quant.c's shape), for the
    range [lo, hi] (default: the group's min-max range): codes, s8, z and the f32 scale and min."""
    from ott_gguf.reference.quant import decode_scale8

    f = [np.float32(e) for e in x]
    lo = min(f) if lo is None else lo
    hi = max(f) if hi is None else hi
    levels = np.float32(2**bits - 1)
    t = np.float32(np.float32(hi - lo) / levels)
    h = int(np.float16(t).view(np.uint16))
    if np.float32(np.uint16(h).view(np.float16)) < t:
        h += 1
    s8 = max(1, (h + 127) >> 7)
    while True:
        s = decode_scale8(np.uint8(s8))
        z = np.floor(np.float32(np.float32(lo / s) * np.float32(4)))
        if -128 <= z <= 127:
            break
        s8 += 1
    m = np.float32(np.float32(np.float32(z) * np.float32(0.25)) * s)
    inv = np.float32(1) / s
    codes = [int(min(max(np.rint(np.float32(np.float32(e - m) * inv)), 0), levels)) for e in f]
    return codes, np.uint8(s8), np.int8(z), s, m


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_params8_match_scalar_recipe_and_never_clip(bits):
    x = rng(13).standard_normal((300, 32)) * rng(14).uniform(0.001, 30, (300, 1)) + rng(15).uniform(-200, 200, (300, 1))
    x[:5] = 3.5  # constant groups
    x[5] = 0.0
    x = x.astype(np.float16)
    codes, s8, z = quantize_groups(x, bits, param_bits=8)
    assert s8.dtype == np.uint8 and z.dtype == np.int8
    for g in range(len(x)):
        c, s, m, _, _ = scalar_params8(x[g], bits)
        assert codes[g].tolist() == c and s8[g] == s and z[g] == m
    from ott_gguf.reference.quant import decode_min8, decode_scale8

    scale = decode_scale8(s8).astype(np.float64)
    lo = decode_min8(z, decode_scale8(s8)).astype(np.float64)
    xf = x.astype(np.float64)
    # the levels span the group: the minimum at most a quarter step below, the top level at
    # most a quarter step short of the maximum; so every error is within half a step
    assert (lo <= xf.min(axis=1) + 1e-12).all() and (xf.min(axis=1) - lo < scale / 4 + 1e-9).all()
    assert (lo + (2**bits - 1) * scale >= xf.max(axis=1) - scale / 4 - 1e-9).all()
    err = np.abs(dequantize_groups(codes, s8, z) - xf)
    assert (err <= scale[:, None] / 2 * (1 + 2**-9) + 1e-9).all()
    # a constant group keeps its value to 1/128 of it, zeros exactly
    assert np.abs(dequantize_groups(codes[:6], s8[:6], z[:6]) - xf[:6]).max() <= 3.5 / 128
    assert (dequantize_groups(codes[5:6], s8[5:6], z[5:6]) == 0).all()


def test_keys_per_token_are_grouped_like_values():
    """key_axis 1: a key group is group_k channels of one token, quantized exactly as a value
    group of that width would be, in the same byte counts as per-channel groups."""
    rng = np.random.default_rng(5)
    k = (rng.standard_normal((32, 64)) * 3).astype(np.float16)
    v = rng.standard_normal((32, 64)).astype(np.float16)
    masked = np.zeros(32, bool)
    base = KVConfig(
        bits_k=2, bits_v=2, group_k=8, group_v=16, block=32, window=4, pool=0, extra_pool=0, skip_layers=0, sink=0
    )
    per_token = base.with_overrides(key_axis=1, group_k=16).for_head_dim(64)
    b = quantize_block(k, v, masked, 0, per_token)
    as_values = quantize_block(v, k, masked, 0, base.with_overrides(group_v=16))  # keys in the value slot
    assert np.array_equal(b.k_codes, as_values.v_codes)
    assert np.array_equal(b.k_scale, as_values.v_scale) and np.array_equal(b.k_min, as_values.v_min)
    per_channel = quantize_block(k, v, masked, 0, base.with_overrides(group_k=16))
    assert b.k_codes.nbytes == per_channel.k_codes.nbytes and b.k_scale.size == per_channel.k_scale.size
    kh, _ = b.dequantize(per_token)
    step = (np.ptp(k.reshape(32, 4, 16).astype(np.float64), axis=2) / 3)[..., None]  # 2 bits: 3 steps
    assert np.all(np.abs(kh - k).reshape(32, 4, 16) <= step / 2 + 0.02)  # + fp16 parameters
    with pytest.raises(InvalidArgumentError, match="group_k=24 of per-token keys does not divide head_dim=64"):
        base.with_overrides(key_axis=1, group_k=24).for_head_dim(64)
    with pytest.raises(InvalidArgumentError, match="key_axis=2"):
        base.with_overrides(key_axis=2)


def test_key_tiers_give_the_widest_channels_more_bits():
    """hi_k / lo_k: channels ranked by range, the widest coded with 4 bits, the narrowest with
    1, each within half a step of its own width; ties keep channel order; the block's key codes
    take block·Σ bits/8 bytes."""
    r = rng(9)
    width = np.repeat(np.array([0.5, 8.0, 1.0, 2.0]), 16)  # channels 16..31 widest, 0..15 narrowest
    k = (r.uniform(-0.5, 0.5, (32, 64)) * width).astype(np.float16)
    k[:, 40] = 0  # a constant channel ranks last
    v = r.standard_normal((32, 64)).astype(np.float16)
    base = KVConfig(
        bits_k=2, bits_v=2, group_k=32, group_v=16, block=32, window=4, pool=0, extra_pool=0, skip_layers=0, sink=0
    )
    cfg = base.with_overrides(hi_k=4, lo_k=4).for_head_dim(64)  # 16 channels at 4 bits, 16 at 1
    b = quantize_block(k, v, np.zeros(32, bool), 0, cfg)
    kf = k.astype(np.float32)
    ptp = kf.max(axis=0) - kf.min(axis=0)
    assert b.k_order.tolist() == sorted(range(64), key=lambda c: (-ptp[c], c))
    assert set(b.k_order[:16].tolist()) == set(range(16, 32))
    assert set(b.k_order[48:63].tolist()) < set(range(16)) and b.k_order[63] == 40
    assert b.k_codes.shape == (32 * (16 * 4 + 32 * 2 + 16 * 1) // 8,) and b.k_scale.shape == (1, 64)
    kh, _ = b.dequantize(cfg)
    bits = np.empty(64, int)
    bits[b.k_order] = cfg.key_row_bits(64)
    step = ptp.astype(np.float64) / (2.0**bits - 1)
    assert (np.abs(kh - kf).max(axis=0) <= step / 2 * (1 + 2**-9) + 1e-9).all()
    # the query scale weighs the ranges: a wide channel the queries ignore ranks last (tie with
    # the constant channel 40: the lower channel first), a narrow one they weigh ranks first
    u = np.ones(64, np.float32)
    u[[16, 3]] = [0.0, 1000.0]
    scaled = quantize_block(k, v, np.zeros(32, bool), 0, cfg, tier_scale=u)
    assert scaled.k_order[0] == 3 and scaled.k_order[62:].tolist() == [16, 40]
    untiered, _ = quantize_block(k, v, np.zeros(32, bool), 0, base.for_head_dim(64)).dequantize(base)
    assert np.abs(kh - kf)[:, 16:32].max() < np.abs(untiered - kf)[:, 16:32].max() / 4
    with pytest.raises(InvalidArgumentError, match="key tiers .* need bits_k=2, key_axis=0 and group_k=block"):
        base.with_overrides(hi_k=4, group_k=16)
    with pytest.raises(InvalidArgumentError, match="exceed 16"):
        base.with_overrides(hi_k=9, lo_k=8)
    with pytest.raises(InvalidArgumentError, match="multiple of 16 up to 256, not 72"):
        cfg.with_overrides(group_v=8).for_head_dim(72)
    with pytest.raises(InvalidArgumentError, match="hi_k=4 does not apply to the fp16 cache"):
        preset("f16").with_overrides(hi_k=4)


@pytest.mark.parametrize("bits", [2, 4])
def test_clipped_params8_match_scalar_recipe(bits):
    # heavy tails so that the clipped ranges win; groups far from zero widen their scale
    x = rng(16).standard_normal((150, 64)) * 2
    x[::3, 7] *= 9
    x[::5] += 300
    x = x.astype(np.float16)
    codes, s8, z = quantize_groups(x, bits, clip=True, param_bits=8)
    assert s8.dtype == np.uint8 and z.dtype == np.int8
    for g in range(len(x)):
        c, s, m = scalar_clipped(x[g], bits, scalar_params8)
        assert codes[g].tolist() == c and s8[g] == s and z[g] == m


def test_clipped_params8_keep_the_gain_on_gaussian_groups():
    """8-bit parameters cost the clipped ranges little: a 64-element Gaussian group (a rotated
    head's keys) at 2 bits stays near the best uniform quantizer's error, min-max far above."""
    x = rng(17).standard_normal((400, 64)).astype(np.float16)
    mse = {}
    for clip in (False, True):
        y = dequantize_groups(*quantize_groups(x, 2, clip=clip, param_bits=8))
        mse[clip] = float(((y - x.astype(np.float64)) ** 2).mean())
    assert mse[True] < 0.12 and mse[False] > 1.8 * mse[True]


@pytest.mark.parametrize("param_bits", [16, 8])
@pytest.mark.parametrize("bits", [2, 4])
def test_symmetric_groups_store_the_scale_alone(bits, param_bits):
    """sym: the levels lie symmetric around zero, (code - (2^b-1)/2)·scale; the range [-a, a]
    covers the group, so min-max codes err by half a step at most; no minimum is returned."""
    x = (rng(40).standard_normal((300, 64)) * rng(41).uniform(0.01, 20, (300, 1))).astype(np.float16)
    x[0] = 0.0
    codes, scale, mn = quantize_groups(x, bits, param_bits=param_bits, sym=True)
    assert mn is None and scale.dtype == (np.uint8 if param_bits == 8 else np.float16)
    y = dequantize_groups(codes, scale, None, bits)
    s = (decode_scale8(scale) if param_bits == 8 else scale).astype(np.float64)
    assert np.array_equal(y, (codes - (2**bits - 1) / 2) * s[:, None])
    assert (np.abs(y - x.astype(np.float64)) <= s[:, None] / 2 * (1 + 2**-9) + 1e-9).all()
    assert (np.abs(y[0]) <= s[0] / 2).all()  # a zero group: the two middle levels


def test_symmetric_groups_cost_rotated_values_nothing():
    """A Hadamard-rotated value group is close to a Gaussian of mean zero: with clipped ranges
    and 8-bit parameters, symmetric 2-bit groups err within 3 % of asymmetric ones."""
    x = rng(42).standard_normal((400, 64)).astype(np.float16)
    mse = {}
    for sym in (False, True):
        codes, scale, mn = quantize_groups(x, 2, clip=True, param_bits=8, sym=sym)
        mse[sym] = float(((dequantize_groups(codes, scale, mn, 2) - x.astype(np.float64)) ** 2).mean())
    assert mse[True] < 1.03 * mse[False]


def test_rounding_is_half_to_even():
    # scale = (3 - 0)/3 = 1 exactly, so t = x and the ties are real ties
    x = np.array([[0, 0.5, 1.5, 2.5, 3]], dtype=np.float16)
    codes, scale, mn = quantize_groups(x, 2)
    assert codes[0].tolist() == [0, 0, 2, 2, 3]
    assert float(scale[0]) == 1.0 and float(mn[0]) == 0.0


def test_constant_group_has_zero_scale():
    x = np.full((3, 32), -1.25, dtype=np.float16)
    codes, scale, mn = quantize_groups(x, 2)
    assert (scale == 0).all() and (codes == 0).all()
    assert (dequantize_groups(codes, scale, mn) == -1.25).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_round_trip(bits):
    codes = rng(bits).integers(0, 2**bits, size=(5, 64), dtype=np.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (5, 64 * bits // 8)
    assert (unpack_codes(packed, bits) == codes).all()


def test_pack_is_lsb_first():
    assert pack_codes(np.array([1, 2, 3, 0], np.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    assert pack_codes(np.array([0xA, 0x3], np.uint8), 4).tolist() == [0x3A]


def test_block_layout():
    cfg = KVConfig(
        bits_k=2, bits_v=4, group_k=8, group_v=4, block=16, window=0, pool=0, extra_pool=0, skip_layers=0, sink=0
    )
    k = rng(3).standard_normal((16, 8)).astype(np.float16)
    v = rng(4).standard_normal((16, 8)).astype(np.float16)
    masked = np.zeros(16, bool)
    masked[[3, 9]] = True
    b = quantize_block(k, v, masked, pos0=100, cfg=cfg)
    assert b.k_codes.shape == (8, 4) and b.k_scale.shape == (2, 8)
    assert b.v_codes.shape == (16, 4) and b.v_scale.shape == (16, 2)
    assert b.mask.tolist() == [1 << 3, 1 << 1]
    assert b.positions.tolist() == list(range(100, 116))
    # key row c = channel c, along tokens; group g = slots 8g..8g+7
    codes, scale, mn = quantize_groups(np.ascontiguousarray(k[8:16, 5]), 2)
    assert (unpack_codes(b.k_codes[5], 2)[8:16] == codes).all()
    assert b.k_scale[1, 5] == scale and b.k_min[1, 5] == mn
    # value row t = slot t, along channels
    codes, scale, mn = quantize_groups(np.ascontiguousarray(v[9, 4:8]), 4)
    assert (unpack_codes(b.v_codes[9], 4)[4:8] == codes).all()
    assert b.v_scale[9, 1] == scale and b.v_min[9, 1] == mn
    kh, vh = b.dequantize(cfg)
    assert np.abs(kh - k).max() <= b.k_scale.astype(np.float64).max() / 2 * (1 + 2**-9)
    assert np.abs(vh - v).max() <= b.v_scale.astype(np.float64).max() / 2 * (1 + 2**-9)


# ---------------------------------------------------------------- config


def test_presets():
    ott2 = preset("ott2")
    assert (
        ott2.bits_k,
        ott2.bits_v,
        ott2.block,
        ott2.group_k,
        ott2.group_v,
        ott2.window,
        ott2.pool,
        ott2.extra_pool,
        ott2.skip_layers,
        ott2.sink,
    ) == (2, 2, 128, 128, 64, 32, 3, 32, 2, 0)
    kivi2 = preset("kivi2")
    assert (kivi2.pool, kivi2.extra_pool, kivi2.group_k, kivi2.group_v, kivi2.window) == (0, 0, 32, 32, 128)
    assert preset("ott4").bits_k == 4 and preset("kivi4").bits_v == 4
    assert not preset("f16").quantized
    assert ott2.for_head_dim(32).group_v == 32 and ott2.for_head_dim(128).group_v == 64
    assert not ott2.traces(1) and ott2.traces(2) and not kivi2.traces(5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(block=100), "block=100"),
        (dict(block=96, group_k=64), "not a multiple of group_k"),
        (dict(bits_k=3), "bits_k=3"),
        (dict(bits_v=16), "both fp16"),
        (dict(pool=128), "pool=128"),
        (dict(pool=0), "extra_pool=32 needs pool"),
        (dict(group_k=2), "group_k=2"),
        (dict(window=-1), "window=-1"),
        (dict(colour=1), "unknown knob"),
        (dict(recent=1, bits_k=8), "recent=1 needs"),
        (dict(recent=65), "recent=65"),
        (dict(sym_v=2), "sym_v=2"),
        (dict(pre_rope=2), "pre_rope=2"),
        (dict(pre_rope=1, rot_k=1), "does not compose with pre_rope=1"),
    ],
)
def test_invalid_configs(overrides, message):
    with pytest.raises(InvalidArgumentError, match=message):
        preset("ott2").with_overrides(**overrides)


def test_invalid_for_model():
    with pytest.raises(InvalidArgumentError, match="group_v=48 does not divide head_dim=64"):
        preset("ott2").with_overrides(group_v=48).for_head_dim(64)
    with pytest.raises(InvalidArgumentError, match="window=32 does not apply"):
        preset("f16").with_overrides(window=32)
    with pytest.raises(InvalidArgumentError, match="kv mode 'ott3'"):
        preset("ott3")


# ---------------------------------------------------------------- schedule


def test_schedule_counts_every_token_once():
    cfg, r = SMALL, rng(11)
    layer = LayerCache.new(cfg, il=0, n_head_kv=2, head_dim=8)
    n = 0
    for size in [1, 3, 17, 1, 1, 40, 16, 2, 33, 1]:
        layer.append(r.standard_normal((size, 2, 8)), r.standard_normal((size, 2, 8)))
        n += size
        for head in layer.heads:
            w = len(head.window)
            if n >= cfg.sink + cfg.window:
                assert cfg.window <= w < cfg.window + cfg.block
            assert len(head.blocks) == (n - len(head.sink) - w) // cfg.block
            masked = sum(int(b.masked.sum()) for b in head.blocks)
            assert masked == len(head.pool) + len(head.extra)
            live = len(head.sink) + len(head.blocks) * cfg.block - masked + len(head.pool) + len(head.extra) + w
            assert live == n
            pos, k, v = head.tokens()
            assert sorted(pos.tolist()) == list(range(n))
    assert layer.n_tokens == n


def test_sink_holds_first_tokens():
    layer = LayerCache.new(SMALL, il=0, n_head_kv=1, head_dim=8)
    k = rng(2).standard_normal((60, 1, 8)).astype(np.float32)
    layer.append(k, k)
    head = layer.heads[0]
    assert head.sink.pos.tolist() == [0, 1]
    assert (head.sink.k == k[:2, 0].astype(np.float16)).all()
    assert head.blocks[0].pos0 == 2


def test_f16_mode_keeps_everything_in_window():
    layer = LayerCache.new(preset("f16"), il=0, n_head_kv=1, head_dim=8)
    x = rng(5).standard_normal((300, 1, 8)).astype(np.float32)
    layer.append(x, x)
    head = layer.heads[0]
    assert len(head.window) == 300 and not head.blocks and layer.tokens_until_event() is None
    assert (head.window.k == x[:, 0].astype(np.float16)).all()


# ---------------------------------------------------------------- outlier token tracing


def keys_with_outliers(n, head_dim, outliers, seed, base=1.0):
    """Keys in [base, 2·base) per channel except `outliers` {slot: scale}, which are scaled down."""
    k = rng(seed).uniform(base, 2 * base, (n, head_dim))
    for slot, s in outliers.items():
        k[slot] *= s
    return k


def test_selection_keeps_smallest_l1_and_masks_them():
    cfg = SMALL.with_overrides(sink=0)
    layer = LayerCache.new(cfg, il=0, n_head_kv=1, head_dim=8)
    k = keys_with_outliers(20, 8, {5: 0.01, 11: 0.02, 12: 0.03}, seed=1)
    layer.append(k[:, None], k[:, None])
    head = layer.heads[0]
    assert len(head.blocks) == 1
    assert head.pool.pos.tolist() == [5, 11]  # the two smallest, position order
    assert head.blocks[0].masked.nonzero()[0].tolist() == [5, 11]
    assert (head.pool.k == k[[5, 11]].astype(np.float16)).all()
    # mean substitution: selected keys no longer set the minimum of their key group (slots
    # 0..7), the unselected small key 12 still does in slots 8..15
    assert (head.blocks[0].k_min[0].astype(np.float32) >= 1.0).all()
    assert (head.blocks[0].k_min[1] == k[12].astype(np.float16)).all()
    kh, _ = head.blocks[0].dequantize(cfg)
    mean = k[[i for i in range(16) if i not in (5, 11)]].astype(np.float16).astype(np.float64).mean(0)
    assert np.abs(kh[5] - mean).max() < 0.2


def test_tracing_improves_the_block_holding_an_outlier():
    # channels 0..3 sit near +4 for every token but the outlier (slot 6), whose key is tiny:
    # quantized with it, those key groups span [0, 5]; without it, about [4, 5]
    k = keys_with_outliers(20, 8, {6: 0.01}, seed=4)
    k[:, :4] += 3.0
    k[6] *= 0.01
    errors = {}
    for pool in (0, 2):
        cfg = SMALL.with_overrides(sink=0, pool=pool, extra_pool=5 if pool else 0)
        layer = LayerCache.new(cfg, il=0, n_head_kv=1, head_dim=8)
        layer.append(k[:, None], k[:, None])
        block = layer.heads[0].blocks[0]
        kh, _ = block.dequantize(cfg)
        live = ~block.masked
        assert live[6] == (pool == 0)
        errors[pool] = np.abs(kh[live] - k[:16][live].astype(np.float16)).max()
    assert errors[2] < errors[0] / 3


def test_equal_scores_lower_position_wins():
    cfg = SMALL.with_overrides(sink=0)
    layer = LayerCache.new(cfg, il=0, n_head_kv=1, head_dim=8)
    k = keys_with_outliers(20, 8, {}, seed=2)
    k[[3, 7, 9]] = 0.125  # three identical smallest keys
    layer.append(k[:, None], k[:, None])
    assert layer.heads[0].pool.pos.tolist() == [3, 7]


def test_extra_pool_and_stop_rule():
    # each block's two smallest keys beat the pool, so every event evicts the whole pool
    cfg = SMALL.with_overrides(sink=0)  # pool 2, extra pool 5, block 16, R 4
    layer = LayerCache.new(cfg, il=0, n_head_kv=1, head_dim=8)
    blocks = [keys_with_outliers(16, 8, {2: 0.1, 9: 0.1}, seed=j, base=0.5**j) for j in range(6)]
    k = np.concatenate(blocks + [np.ones((4, 8))])
    layer.append(k[:, None], k[:, None])
    head = layer.heads[0]
    assert len(head.blocks) == 6
    # event 1 fills the pool; 2 and 3 evict 2 each (extra 4); at event 4 only 1 slot is free < 2
    assert head.extra.pos.tolist() == [2, 9, 18, 25]
    assert head.pool.pos.tolist() == [34, 41]
    assert not head.tracing
    assert [b.masked.nonzero()[0].tolist() for b in head.blocks] == [[2, 9]] * 3 + [[]] * 3
    pos, _, _ = head.tokens()
    assert sorted(pos.tolist()) == list(range(len(k)))


def test_skip_layers_have_no_pool():
    cfg = SMALL.with_overrides(sink=0, skip_layers=1)
    k = keys_with_outliers(40, 8, {5: 0.01, 11: 0.02}, seed=3)[:, None]
    skipped = LayerCache.new(cfg, il=0, n_head_kv=1, head_dim=8)
    traced = LayerCache.new(cfg, il=1, n_head_kv=1, head_dim=8)
    skipped.append(k, k)
    traced.append(k, k)
    assert len(skipped.heads[0].pool) == 0 and not skipped.heads[0].blocks[0].masked.any()
    assert traced.heads[0].pool.pos.tolist() == [5, 11]


# ---------------------------------------------------------------- attention


def exact_attention(q, k, v):
    """Causal softmax attention in float64 over fp16-rounded K/V, GQA by h // n_rep."""
    n, n_head, d = q.shape
    n_rep = n_head // k.shape[1]
    k = k.astype(np.float16).astype(np.float64)
    v = v.astype(np.float16).astype(np.float64)
    out = np.empty(q.shape)
    for h in range(n_head):
        s = q[:, h].astype(np.float64) @ k[:, h // n_rep].T / np.sqrt(d)
        s[np.triu_indices(n, 1)] = -np.inf
        p = np.exp(s - s.max(1, keepdims=True))
        out[:, h] = p @ v[:, h // n_rep] / p.sum(1, keepdims=True)
    return out


def qkv(n, n_head, n_head_kv, d, seed):
    r = rng(seed)
    q = r.standard_normal((n, n_head, d)).astype(np.float32)
    k = r.standard_normal((n, n_head_kv, d)).astype(np.float32)
    v = r.standard_normal((n, n_head_kv, d)).astype(np.float32)
    return q, k, v


def decode(layer, q, k, v):
    return np.concatenate([forward_chunk(layer, q[i : i + 1], k[i : i + 1], v[i : i + 1]) for i in range(len(q))])


@pytest.mark.parametrize("n_head, n_head_kv", [(4, 4), (6, 2), (7, 1)])
def test_f16_attention_is_exact(n_head, n_head_kv):
    q, k, v = qkv(70, n_head, n_head_kv, 16, seed=n_head)
    want = exact_attention(q, k, v)
    got = decode(LayerCache.new(preset("f16"), 0, n_head_kv, 16), q, k, v)
    assert np.abs(got - want).max() < 1e-12
    got = prefill(LayerCache.new(preset("f16"), 0, n_head_kv, 16), q, k, v)
    assert np.abs(got - want).max() < 1e-12


def test_faithful_prefill_equals_decode():
    q, k, v = qkv(90, 4, 2, 8, seed=9)
    by_token = decode(LayerCache.new(SMALL, 2, 2, 8), q, k, v)
    layer = LayerCache.new(SMALL, 2, 2, 8)
    assert np.abs(prefill(layer, q, k, v) - by_token).max() < 1e-12
    # events fire at sink + R + j·block tokens: 22, 38, ...
    assert LayerCache.new(SMALL, 2, 2, 8).tokens_until_event() == 22


def test_prefill_fp16_attends_in_full_precision_then_quantizes():
    q, k, v = qkv(90, 4, 2, 8, seed=10)
    layer = LayerCache.new(SMALL, 2, 2, 8)
    assert np.abs(prefill(layer, q, k, v, fp16=True) - exact_attention(q, k, v)).max() < 1e-12
    decoded = LayerCache.new(SMALL, 2, 2, 8)
    decode(decoded, q, k, v)
    for a, b in zip(layer.heads, decoded.heads):
        assert len(a.blocks) == len(b.blocks) == (90 - 2 - 4) // 16
        for x, y in zip(a.blocks, b.blocks):
            for name in ("k_codes", "k_scale", "k_min", "v_codes", "v_scale", "v_min", "mask"):
                assert getattr(x, name).tobytes() == getattr(y, name).tobytes(), name
        for store in ("sink", "pool", "extra", "window"):
            assert (getattr(a, store).pos == getattr(b, store).pos).all(), store
            assert getattr(a, store).k.tobytes() == getattr(b, store).k.tobytes(), store


def test_quantized_attention_error_shrinks_with_bits():
    # relative L2 error of the output; random keys give near-uniform attention and a small
    # output norm, so the 2-bit error is large in relative terms. Ideal scaling from 2 to 4
    # bits is 15/3 = 5 and from 4 to 8 bits 255/15 = 17.
    n, d = 600, 64
    q, k, v = qkv(n + 4, 4, 2, d, seed=21)
    k[:, :, 3] += 6.0  # a key outlier channel, as in real models
    want = exact_attention(q, k, v)[n:]
    for name in ("kivi2", "ott2"):
        err = []
        for bits in (2, 4, 8):
            layer = LayerCache.new(preset(name).with_overrides(bits_k=bits, bits_v=bits), il=2, n_head_kv=2, head_dim=d)
            layer.append(k[:n], v[:n])
            got = decode(layer, q[n:], k[n:], v[n:])
            err.append(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert err[0] < 1.0, name
        assert err[1] < err[0] / 4 and err[2] < err[1] / 8, (name, err)


def test_attention_rejects_bad_shapes():
    layer = LayerCache.new(preset("ott2"), 0, 2, 64)
    q, k, v = qkv(1, 3, 2, 64, seed=0)
    with pytest.raises(InvalidArgumentError, match="multiple of n_head_kv=2"):
        attend(layer, q, k, v)
    with pytest.raises(InvalidArgumentError, match=r"not \[n_tokens, 2, 64\]"):
        layer.append(k[:, :1], v[:, :1])


# ---------------------------------------------------------------- footprint


def test_footprint_ott2_head_dim_64_at_4k():
    # SmolLM2-135M shape: 30 layers, 3 KV heads, head_dim 64; ott2 skips 2 layers.
    f = footprint(preset("ott2"), 4096, head_dim=64, n_head_kv=3, n_layer=30)
    # per head: 31 blocks (31·128 = 3968 tokens), window 128 tokens
    #   codes  31·(64·128·4/8) = 126976      scales 31·(1·64 + 128·1)·4 = 23808
    #   masks  31·16 = 496 (28 layers)       window 128·256 = 32768
    #   pool   3·260 = 780, extra 32·260 = 8320 (28 layers)
    heads = 3
    assert f.bytes["codes"] == 30 * heads * 126976
    assert f.bytes["scales"] == 30 * heads * 23808
    assert f.bytes["masks"] == 28 * heads * 496
    assert f.bytes["window"] == 30 * heads * 32768
    assert f.bytes["pool"] == 28 * heads * 780 and f.bytes["extra_pool"] == 28 * heads * 8320
    assert f.bits_per_element == pytest.approx((28 * 193148 + 2 * 183552) * 8 / (30 * 4096 * 128))
    # quantized part alone is ≈2.38 bits; window and pools bring it to ≈2.94 at 4K
    assert 2.9 < f.bits_per_element < 3.0
    assert 2.4 < footprint(preset("ott2"), 32768, 64, 3, 30).bits_per_element < 2.5
    assert footprint(preset("kivi2"), 4096, 64, 3, 30).bits_per_element == pytest.approx(3.40625)
    assert footprint(preset("f16"), 4096, 64, 3, 30).bits_per_element == 16.0
    assert f.bytes_per_token_per_layer == pytest.approx(f.total_bytes / (4096 * 30))


@pytest.mark.parametrize(
    "tiers",
    [
        {},
        {"hi_k": 4, "lo_k": 4, "group_k": 128},
        {"recent": 2},
        {"hi_k": 4, "group_k": 128, "recent": 1},
        {"sym_v": 1, "param_bits": 8, "recent": 1},
    ],
)
def test_measured_footprint_matches_formula(tiers):
    cfg = preset("ott2").with_overrides(skip_layers=1, **tiers)
    n, d, r = 700, 64, rng(30)
    layers = [LayerCache.new(cfg, il, 2, d) for il in range(3)]
    for layer in layers:
        layer.append(r.standard_normal((n, 2, d)), r.standard_normal((n, 2, d)))
    got, want = measure(layers), footprint(cfg, n, d, 2, 3)
    for store in ("sink", "codes", "scales", "masks", "pool", "window"):
        assert got.bytes[store] == want.bytes[store], store
    assert 0 < got.bytes["extra_pool"] <= want.bytes["extra_pool"]


def test_recent_blocks_are_4bit_then_recoded():
    """The newest `recent` blocks hold 4-bit codes (a quarter of the 2-bit error or less);
    older ones were re-coded to 2 bits from them and are about as close to the keys and
    values as 2-bit codes of the fp16 originals."""
    cfg = preset("ottr2").with_overrides(block=32, group_k=32, pool=0, extra_pool=0, recent=2)
    n, d, r = 32 * 6 + 5, 64, rng(31)
    k, v = r.standard_normal((n, 1, d)), r.standard_normal((n, 1, d))
    layer, plain = LayerCache.new(cfg, 0, 1, d), LayerCache.new(cfg.with_overrides(recent=0), 0, 1, d)
    layer.append(k, v)
    plain.append(k, v)
    head, ref = layer.heads[0], plain.heads[0]
    assert len(head.blocks) == 6 and len(head.window) == 5
    k16 = k[:, 0].astype(np.float16).astype(np.float64)
    for j, (b, b2) in enumerate(zip(head.blocks, ref.blocks)):
        rows = slice(32 * j, 32 * (j + 1))
        err = ((b.dequantize(head.block_cfg(j))[0] - k16[rows]) ** 2).mean()
        err2 = ((b2.dequantize(ref.cfg)[0] - k16[rows]) ** 2).mean()
        if j >= 4:  # recent: 4-bit key codes
            assert b.k_codes.nbytes == d * 32 * 4 // 8 and err < err2 / 4, j
        else:
            assert b.k_codes.nbytes == d * 32 * 2 // 8 and err < 1.2 * err2, j
    # attention reads every token once, each block through its own config
    pos, kh, _ = head.tokens()
    assert pos.tolist() == list(range(n)) and np.abs(kh - k16).max() < 2


# ---------------------------------------------------------------- rotations


@pytest.mark.parametrize("head_dim", [1, 2, 64, 128])
def test_hadamard_is_orthogonal_and_round_trips(head_dim):
    from ott_gguf.reference.rotation import hadamard, restore, rotate

    R = hadamard(head_dim, il=3, head=1, values=True)
    assert np.allclose(R @ R.T, np.eye(head_dim), atol=1e-12)
    assert set(np.unique(np.abs(R) * np.sqrt(head_dim)).round(12)) == {1.0}
    x = rng(5).standard_normal((7, head_dim))
    c = rng(6).standard_normal(head_dim)
    assert np.allclose(restore(rotate(x, R, c), R, c), x, atol=1e-12)


def test_hadamard_signs_differ_by_layer_head_and_kind():
    from ott_gguf.reference.rotation import hadamard_signs

    s = {(il, h, v): tuple(hadamard_signs(64, il, h, v)) for il in range(3) for h in range(2) for v in (False, True)}
    assert len(set(s.values())) == len(s)
    # the generator is splitmix64 (its published first output from state 0), started at
    # GOLDEN for layer 0, head 0, keys: first output 0x6e789e6aa1b965f4, top bit clear: +1
    from ott_gguf.reference.rotation import _GOLDEN, _splitmix64

    assert _splitmix64(0)[1] == 0xE220A8397B1DCDAF
    assert _splitmix64(_GOLDEN)[1] == 0x6E789E6AA1B965F4 and hadamard_signs(1, 0, 0, False)[0] == 1.0


def test_rotated_scores_differ_by_a_constant_per_query():
    """q'·k' = q·k - q·c_k: the softmax over a query's keys is unchanged."""
    from ott_gguf.reference.rotation import hadamard, rotate

    R, c = hadamard(16, 0, 0, False), rng(8).standard_normal(16)
    q, k = rng(9).standard_normal((3, 16)), rng(10).standard_normal((20, 16))
    d = rotate(q, R) @ rotate(k, R, c).T - q @ k.T  # [3, 20]
    assert np.allclose(d, d[:, :1], atol=1e-12)


@pytest.mark.parametrize("head_dim", [48, 96])
def test_hadamard_needs_a_power_of_two(head_dim):
    from ott_gguf.reference.rotation import sylvester

    with pytest.raises(InvalidArgumentError, match="power of two"):
        preset("ott2").with_overrides(rot_v=1).for_head_dim(head_dim)
    with pytest.raises(InvalidArgumentError, match="power of two"):
        sylvester(head_dim)
