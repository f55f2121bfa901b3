"""The KVQuant scheme of the numpy specification (reference/kvquant.py, nuq.py, rope.py)."""

import numpy as np
import pytest

from ott_gguf.errors import InvalidArgumentError
from ott_gguf.reference import LayerCache, attend, footprint, measure, nuq, pack_codes, preset, unpack_codes
from ott_gguf.reference.kvquant import KVQLayer, n_outliers, quantize_block
from ott_gguf.reference.outliers import substitute_mean
from ott_gguf.reference.rope import Rope

HD, N_KV, N_HEAD = 64, 2, 4
ROPE = Rope(n_rot=HD, freq_base=10000.0)


def tables(cfg, rng, spread=1.0, uniform=False):
    """Tables of one layer: key thresholds around each channel's scale, random ascending
    codebooks (or uniform ones)."""
    lo = -spread * (0.5 + rng.random((N_KV, HD))).astype(np.float32)
    hi = spread * (0.5 + rng.random((N_KV, HD))).astype(np.float32)
    if uniform:
        return KVQLayer(lo, hi, nuq.uniform_levels(cfg.bits_k), nuq.uniform_levels(cfg.bits_v))
    lk = np.sort(rng.uniform(-1, 1, 2**cfg.bits_k)).astype(np.float32)
    lv = np.sort(rng.uniform(-1, 1, 2**cfg.bits_v)).astype(np.float32)
    return KVQLayer(lo, hi, lk, lv)


def test_three_bit_codes_pack_as_one_stream():
    codes = np.arange(8, dtype=np.uint8)  # 0..7, 3 bits each, 24 bits
    packed = pack_codes(codes, 3)
    stream = sum(int(c) << (3 * i) for i, c in enumerate(codes))
    assert packed.tolist() == [stream & 255, stream >> 8 & 255, stream >> 16]
    rng = np.random.default_rng(0)
    for bits in (2, 3, 4, 8):
        c = rng.integers(0, 2**bits, (5, 64), dtype=np.uint8)
        assert (unpack_codes(pack_codes(c, bits), bits) == c).all()


def test_nearest_level_ties_go_down():
    levels = np.array([-1, -0.25, 0.5, 1], np.float32)
    t = np.array([-2, -0.625, -0.62, 0.125, 0.13, 0.75, 0.76, 3], np.float32)
    assert nuq.nearest_codes(t, levels).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_block_outliers_exact_and_dense_within_half_a_level_gap(bits):
    rng = np.random.default_rng(bits)
    cfg = preset(f"kvquant{bits}").for_head_dim(HD)
    tab = tables(cfg, rng).head(1)
    k = rng.normal(0, 0.6, (cfg.block, HD)).astype(np.float16)
    v = rng.normal(0, 1, (cfg.block, HD)).astype(np.float16)
    k[3, 7], v[9, 2], v[4, 4] = 40.0, -30.0, 25.0  # planted outliers
    b = quantize_block(k, v, 5, cfg, tab)
    n_out = n_outliers(cfg, HD)
    assert n_out == 20 and len(b.k_out_idx) == len(b.v_out_idx) == n_out
    assert {3 * HD + 7} <= set(b.k_out_idx.tolist()) and {9 * HD + 2, 4 * HD + 4} <= set(b.v_out_idx.tolist())
    assert (np.diff(b.k_out_idx.astype(int)) > 0).all() and (np.diff(b.v_out_idx.astype(int)) > 0).all()
    kh, vh = b.dequantize(cfg, tab)
    ki, vi = b.k_out_idx.astype(int), b.v_out_idx.astype(int)
    assert (kh.reshape(-1)[ki] == k.reshape(-1)[ki]).all() and (vh.reshape(-1)[vi] == v.reshape(-1)[vi]).all()
    # a dense key inside its channel's range is off by at most half the widest level gap
    # (or the distance to the end level), times the channel's scale
    gap_k = max(np.diff(tab.levels_k).max() / 2, 1 - tab.levels_k[-1], tab.levels_k[0] + 1)
    inside = np.abs(nuq.normalize(k, tab.k_zero, tab.k_scale)) <= 1
    dense = inside.reshape(-1).copy()
    dense[ki] = False
    err = np.abs(kh - k.astype(np.float64)).reshape(-1)[dense]
    assert (err <= (gap_k * tab.k_scale[None, :].repeat(cfg.block, 0).reshape(-1)[dense]) * (1 + 1e-3)).all()
    # every value but the outliers lies in its token's range: half a gap of that range
    gap_v = max(np.diff(tab.levels_v).max() / 2, 1 - tab.levels_v[-1], tab.levels_v[0] + 1)
    vd = np.ones(cfg.block * HD, bool)
    vd[vi] = False
    verr = np.abs(vh - v.astype(np.float64)).reshape(-1)[vd]
    bound = gap_v * b.v_scale.astype(np.float64)[:, None].repeat(HD, 1).reshape(-1)[vd] + 2**-10 * np.abs(v).max()
    assert (verr <= bound).all()


def test_pre_rope_attention_rotates_every_key_at_its_position():
    """Before any event, a pre-RoPE cache attends as a post-RoPE one whose keys were rotated
    first: up to where each rounds to fp16 (the one pre-RoPE, the other post-RoPE)."""
    rng = np.random.default_rng(3)
    cfg = preset("kvquant2").with_overrides(block=64, group_k=64)
    n = 40  # < sink + block: all fp16
    q = rng.normal(size=(n, N_HEAD, HD)).astype(np.float32)
    k = rng.normal(size=(n, N_KV, HD)).astype(np.float32)
    v = rng.normal(size=(n, N_KV, HD)).astype(np.float32)
    pre = LayerCache.new(cfg, 0, N_KV, HD, tables(cfg, rng))
    post = LayerCache.new(preset("f16"), 0, N_KV, HD)
    pos = np.arange(n)
    qr = ROPE.apply(q, pos).astype(np.float32)
    a = attend(pre, qr, k, v, ROPE)
    b = attend(post, qr, ROPE.apply(k, pos).astype(np.float32), v)
    assert np.abs(a - b).max() < 5e-3
    with pytest.raises(InvalidArgumentError, match="RoPE"):
        attend(pre, qr, k, v)


def test_quantized_attention_close_to_exact_and_footprint_measured():
    rng = np.random.default_rng(4)
    cfg = preset("kvquant4")
    n = 1 + 3 * cfg.block + 5
    k = rng.normal(0, 0.5, size=(n, N_KV, HD)).astype(np.float32)
    v = rng.normal(size=(n, N_KV, HD)).astype(np.float32)
    q = rng.normal(size=(1, N_HEAD, HD)).astype(np.float32)
    layer = LayerCache.new(cfg, 0, N_KV, HD, tables(cfg, rng, spread=1.5, uniform=True))
    layer.append(k, v)
    assert len(layer.heads[0].blocks) == 3 and len(layer.heads[0].window) == 5
    exact = LayerCache.new(preset("f16"), 0, N_KV, HD)
    exact.append(ROPE.apply(k, np.arange(n)).astype(np.float32), v)
    kn, vn = rng.normal(size=(1, N_KV, HD)).astype(np.float32), rng.normal(size=(1, N_KV, HD)).astype(np.float32)
    a = attend(layer, q, kn, vn, ROPE)
    b = attend(exact, q, ROPE.apply(kn, [n]).astype(np.float32), vn)
    # random values: a token of N(0, 1) spans about ±3, 4-bit steps of 0.4 leave 0.11 rms per
    # entry, and the output (a mean of such tokens) keeps that relative error
    assert np.linalg.norm(a - b) < 0.15 * np.linalg.norm(b)
    fp, formula = measure([layer]), footprint(cfg, n, HD, N_KV, 1)
    assert fp.bytes == formula.bytes and fp.bytes["sparse"] == 3 * N_KV * 2 * n_outliers(cfg, HD) * 4


def test_ott_pool_on_kvquant_keeps_the_smallest_keys_exact():
    """KVQuant with OTT's pool (the specification's composition): each event pools the
    tokens of smallest key L1 norm, they stay exact in fp16 and are masked in their block;
    the rest is the plain KVQuant block of the mean-substituted tokens, and the footprint
    counts the pool and the masks."""
    rng = np.random.default_rng(5)
    cfg = preset("kvquant2").with_overrides(pool=3, extra_pool=8)
    n = 1 + 3 * cfg.block + 5
    k = rng.normal(0, 0.5, size=(n, N_KV, HD)).astype(np.float32)
    v = rng.normal(size=(n, N_KV, HD)).astype(np.float32)
    small = [4, 40, 41]  # tokens of tiny keys: the pool at the end, the tokens they displaced in the extra pool
    k[small] *= 1e-3
    tab = tables(cfg, rng)
    layer = LayerCache.new(cfg, 0, N_KV, HD, tab)
    layer.append(k, v)
    k16, v16 = k.astype(np.float16), v.astype(np.float16)
    for h, head in enumerate(layer.heads):
        pooled = np.concatenate([head.pool.pos, head.extra.pos])
        assert head.pool.pos.tolist() == small and len(head.extra) == 2
        assert (head.pool.k == k16[head.pool.pos, h]).all() and (head.pool.v == v16[head.pool.pos, h]).all()
        for j, b in enumerate(head.blocks):
            slot = b.positions[b.masked]
            assert set(slot.tolist()) == set(pooled.tolist()) & set(b.positions.tolist()), (h, j)
            blk = k16[b.positions, h], v16[b.positions, h]
            sub = [substitute_mean(x, b.masked) for x in blk]
            want = quantize_block(*sub, int(b.positions[0]), cfg, tab.head(h), b.masked)
            assert block_bytes(b) == block_bytes(want), (h, j)
        pos = head.tokens()[0]
        assert len(pos) == n and sorted(pos.tolist()) == list(range(n))
    fp, formula = measure([layer]), footprint(cfg, n, HD, N_KV, 1)
    assert fp.bytes["masks"] == formula.bytes["masks"] == 3 * N_KV * cfg.block // 8
    assert fp.bytes["pool"] == formula.bytes["pool"] > 0


def block_bytes(b):
    return b"".join(np.ascontiguousarray(getattr(b, f)).tobytes() for f in b.__dataclass_fields__ if f != "pos0")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(rot_v=1), "rot_v=1 does not apply"),
        (dict(bits_k=8), "bits_k=8 is not one of"),
        (dict(param_bits=8), "param_bits=8"),
        (dict(outliers=2000), "more than 10 %"),
        (dict(group_k=16), "group_k=16 must equal block"),
    ],
)
def test_invalid_kvquant_configs(overrides, match):
    with pytest.raises(InvalidArgumentError, match=match):
        preset("kvquant2").with_overrides(**overrides)


def test_kvquant_knobs_need_the_scheme():
    with pytest.raises(InvalidArgumentError, match="KVQuant scheme only"):
        preset("kivi2").with_overrides(outliers=100)
    with pytest.raises(InvalidArgumentError, match="KVQuant scheme only"):
        preset("ott2").with_overrides(qnorm=1)
    with pytest.raises(InvalidArgumentError, match="both choose the levels"):
        preset("kvquant2").with_overrides(qnorm=1, uniform=1)
    with pytest.raises(InvalidArgumentError, match="bits_k=3"):
        preset("kivi2").with_overrides(bits_k=3)
    with pytest.raises(InvalidArgumentError, match="65536"):
        preset("kvquant2").with_overrides(block=1024, group_k=1024).for_head_dim(128)
