"""The native KVQuant ops against the numpy specification (reference/kvquant.py, attention.py):

- quantization (native/src/kv/kv_kvq.c): every byte of a head-block — codes, per-token value
  ranges, sparse indices and values — equal to the spec's arrays, for 2, 3 and 4 bits, with
  outlier shares 0, 1 and 2.5 %, on data full of ties (equal scores, values on midpoints);
- attention (kvq_attn_cpu.h, in native/src/cpu/ott_ops_cpu.cpp): codebook lookup and RoPE at
  each key's position, within ATTN_BUDGET of the float64 spec over blocks, sink and window, on
  keys and values of SmolLM2's own layers.

These ops are internal (not in ott.h), so they are called directly from the libott.so beside
the loaded binding (cffi in ABI mode, the declarations below copied from kv_layout.h, kv_kvq.h
and kvq_attn_cpu.h).
"""

from pathlib import Path

import numpy as np
import pytest
from cffi import FFI

from ott_gguf.reference import LayerCache, attend, nuq, preset
from ott_gguf.reference.kvquant import KVQLayer, n_outliers, quantize_block

# float32 sums over a few hundred keys and float32 cos/sin of positions below 4096 (one
# rounding of θ's cosine, 6e-8): 2e-6 relative seen; 2e-5 leaves room for other compilers
ATTN_BUDGET = 2e-5

CDEF = """
typedef uint16_t ott_fp16;
typedef struct { int32_t head_dim, block, bits_k, bits_v, n_out; } ott_kvq_geom;
typedef struct { const float * k_zero; const float * k_scale; const float * levels_k; const float * levels_v; } ott_kvq_tables;
size_t ott_kvq_scratch_bytes(const ott_kvq_geom * g);
void ott_kvq_quantize_block_ref(const ott_kvq_geom * g, const ott_kvq_tables * tab, const ott_fp16 * k,
                                const ott_fp16 * v, uint8_t * out, void * scratch);
void ott_kvq_channel_params_ref(const float * lo, const float * hi, int32_t n, float * zero, float * scale);
typedef struct { int32_t n_rot; int32_t neox; int32_t n_pos; const float * cs; const float * tile; } ott_rope_table;
void ott_rope_table_fill(int32_t n_rot, double freq_base, double freq_scale, int32_t n_pos, float * cs);
void ott_rope_tile_fill(int32_t n_rot, double freq_base, double freq_scale, float * tile);
typedef struct {
    const uint8_t * blocks; int32_t n_blocks; int64_t block_stride; int32_t pos0;
    const ott_fp16 * k; const ott_fp16 * v; const int32_t * pos; int32_t n; const uint8_t * const * block_list;
} ott_kvq_head_stores;
size_t ott_cpu_kvq_attn_scratch(const ott_kvq_geom * g, int32_t n_q);
void ott_cpu_kvq_attn(const ott_kvq_geom * g, const ott_kvq_tables * tab, const ott_kvq_head_stores * st,
                      const ott_rope_table * rope, const float * q, int32_t n_q, const int32_t * n_visible,
                      float kq_scale, float * out, float * scratch);
"""


@pytest.fixture(scope="module")
def native():
    import ott_gguf._native as pkg

    # the binding may be the installed distribution's while the tests import the checkout
    folder = Path(pkg._mod.__file__).parent
    ffi = FFI()
    ffi.cdef(CDEF)
    return ffi, ffi.dlopen(str(folder / "libott.so"))


def align(n):
    return (n + 63) // 64 * 64


def block_bytes(b, cfg, head_dim):
    """The spec's KVQBlock laid out as kv_layout.h's ott_kvq_block_layout says."""
    parts = [b.v_zero, b.v_scale, b.k_codes, b.v_codes, b.k_out_idx, b.k_out_val, b.v_out_idx, b.v_out_val]
    out = bytearray()
    for a in parts:
        raw = np.ascontiguousarray(a).tobytes()
        out += raw + bytes(align(len(raw)) - len(raw))
    return bytes(out)


class Native:
    """The ops of one head with its tables, called through cffi."""

    def __init__(self, native, cfg, tab, head_dim):
        self.ffi, self.lib = native
        ffi = self.ffi
        self.cfg, self.hd = cfg, head_dim
        self.g = ffi.new("ott_kvq_geom *", [head_dim, cfg.block, cfg.bits_k, cfg.bits_v, n_outliers(cfg, head_dim)])
        self.keep = [
            np.ascontiguousarray(x, dtype=np.float32) for x in (tab.k_zero, tab.k_scale, tab.levels_k, tab.levels_v)
        ]
        self.tab = ffi.new("ott_kvq_tables *", [ffi.cast("const float *", ffi.from_buffer(x)) for x in self.keep])
        self.size = len(
            block_bytes(
                quantize_block(
                    np.zeros((cfg.block, head_dim), np.float16),
                    np.zeros((cfg.block, head_dim), np.float16),
                    0,
                    cfg,
                    tab,
                ),
                cfg,
                head_dim,
            )
        )

    def ptr(self, kind, a):
        return self.ffi.cast(kind, self.ffi.from_buffer(a))

    def quantize(self, k, v):
        out = np.zeros(self.size, np.uint8)
        scratch = np.zeros(self.lib.ott_kvq_scratch_bytes(self.g) // 4 + 1, np.float32)
        self.lib.ott_kvq_quantize_block_ref(
            self.g,
            self.tab,
            self.ptr("ott_fp16 *", np.ascontiguousarray(k)),
            self.ptr("ott_fp16 *", np.ascontiguousarray(v)),
            self.ptr("uint8_t *", out),
            self.ptr("void *", scratch),
        )
        return out.tobytes()


def tied_tables(cfg, rng, head_dim):
    """Thresholds on a grid of quarters and codebooks whose midpoints are exact quarters too,
    so that many entries land exactly on a midpoint or tie another's score."""
    lo = -rng.integers(1, 5, head_dim).astype(np.float32) / 2
    hi = rng.integers(1, 5, head_dim).astype(np.float32) / 2
    zero, scale = nuq.channel_params(lo, hi)

    def levels(b):
        lv = np.linspace(-1, 1, 2**b) if b != 3 else np.array([-1, -0.75, -0.5, -0.25, 0.25, 0.5, 0.75, 1])
        return lv.astype(np.float32)

    from ott_gguf.reference.kvquant import KVQHead

    return KVQHead(zero, scale, levels(cfg.bits_k), levels(cfg.bits_v))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("outliers", [0, 100, 250])
def test_quantized_block_bit_exact(native, bits, outliers):
    hd = 64
    cfg = preset(f"kvquant{bits}").with_overrides(outliers=outliers, block=32, group_k=32).for_head_dim(hd)
    rng = np.random.default_rng(bits * 1000 + outliers)
    tab = tied_tables(cfg, rng, hd)
    op = Native(native, cfg, tab, hd)
    for trial in range(6):
        if trial % 2:  # ties everywhere: multiples of 1/8
            k = (rng.integers(-24, 24, (cfg.block, hd)) / 8).astype(np.float16)
            v = (rng.integers(-24, 24, (cfg.block, hd)) / 8).astype(np.float16)
        else:  # a spread with planted outliers
            k = rng.normal(0, 1.5, (cfg.block, hd)).astype(np.float16)
            v = rng.standard_t(3, (cfg.block, hd)).astype(np.float16)
        if trial == 4:
            v[7] = 3.0  # a constant token
            v[9, :] = 100.0  # a token that is all outlier
        want = block_bytes(quantize_block(k, v, 0, cfg, tab), cfg, hd)
        got = op.quantize(k, v)
        assert got == want, (trial, next(i for i in range(len(want)) if got[i] != want[i]))


@pytest.fixture(scope="module")
def smol_kv(smollm2_path, wikitext_path):
    """Pre-RoPE keys, values and RoPE'd queries of SmolLM2's layers 1 and 9 on 300 tokens."""
    torch = pytest.importorskip("torch")
    from ott_gguf.model import Weights
    from ott_gguf.torch_model import TorchModel

    torch.set_num_threads(2)
    w = Weights(smollm2_path, device="cpu")
    ids = w.tokenize(wikitext_path.read_text(encoding="utf-8")[:5000])[:300]
    w.close()
    tm = TorchModel(smollm2_path)
    got = {}

    def attend(il, q, k_pre, k_post, v):
        got[il] = (q[0].numpy().copy(), k_pre[0].numpy().copy(), v[0].numpy().copy())
        return tm.causal_attention(q, k_post, v)

    with torch.no_grad():
        tm.forward(torch.tensor([ids]), attend=attend)
    return tm, {il: got[il] for il in (1, 9)}


@pytest.mark.parametrize("il", [1, 9])
@pytest.mark.parametrize("bits", [2, 4])
def test_attention_within_budget_of_float64(native, smol_kv, il, bits):
    tm, kv = smol_kv
    q, k, v = kv[il]  # [n, H, d], [n, H_kv, d]
    n, hd = len(k) - 1, tm.head_dim
    cfg = preset(f"kvquant{bits}")
    lo, hi = np.quantile(k[:n].astype(np.float32), [0.005, 0.995], axis=0)  # [H_kv, d]

    def levels(b):
        return np.sort(np.tanh(np.linspace(-2, 2, 2**b)) / np.tanh(2)).astype(np.float32)

    layer_tab = KVQLayer(lo.astype(np.float32), hi.astype(np.float32), levels(bits), levels(bits))
    layer = LayerCache.new(cfg, il, tm.n_head_kv, hd, layer_tab)
    layer.append(k[:n], v[:n])
    want = attend(layer, q[n:], k[n:], v[n:], tm.rope)[0]  # [H, d] float64

    ffi, lib = native
    n_pos = n + 1
    cs = np.zeros(n_pos * tm.rope.n_rot, np.float32)
    lib.ott_rope_table_fill(
        tm.rope.n_rot, tm.rope.freq_base, tm.rope.freq_scale, n_pos, ffi.cast("float *", ffi.from_buffer(cs))
    )
    tile = np.zeros(128 * tm.rope.n_rot, np.float32)  # OTT_ROPE_TILE positions
    lib.ott_rope_tile_fill(
        tm.rope.n_rot, tm.rope.freq_base, tm.rope.freq_scale, ffi.cast("float *", ffi.from_buffer(tile))
    )
    rope = ffi.new(
        "ott_rope_table *",
        [tm.rope.n_rot, int(tm.rope.neox), n_pos] + [ffi.cast("const float *", ffi.from_buffer(a)) for a in (cs, tile)],
    )
    rep = tm.n_head // tm.n_head_kv
    got = np.zeros_like(want)
    for h, head in enumerate(layer.heads):
        op = Native(native, layer.cfg, head.kvq, hd)
        blocks = np.frombuffer(b"".join(block_bytes(b, layer.cfg, hd) for b in head.blocks), np.uint8)
        assert blocks.tobytes() == b"".join(op.quantize(*blk) for blk in _block_inputs(head, k[:n, h], v[:n, h]))
        rows_k = np.concatenate([head.sink.k, head.window.k, k[n:, h].astype(np.float16)])
        rows_v = np.concatenate([head.sink.v, head.window.v, v[n:, h].astype(np.float16)])
        rows_pos = np.concatenate([head.sink.pos, head.window.pos, [n]]).astype(np.int32)
        st = ffi.new(
            "ott_kvq_head_stores *",
            [
                op.ptr("uint8_t *", blocks),
                len(head.blocks),
                op.size,
                layer.cfg.sink,
                op.ptr("ott_fp16 *", rows_k),
                op.ptr("ott_fp16 *", rows_v),
                op.ptr("int32_t *", rows_pos),
                len(rows_pos),
            ],
        )
        qh = np.ascontiguousarray(q[n, h * rep : (h + 1) * rep], dtype=np.float32)
        out = np.zeros((rep, hd), np.float32)
        scratch = np.zeros(lib.ott_cpu_kvq_attn_scratch(op.g, rep), np.float32)
        lib.ott_cpu_kvq_attn(
            op.g,
            op.tab,
            st,
            rope,
            op.ptr("float *", qh),
            rep,
            ffi.NULL,
            1 / np.sqrt(hd),
            op.ptr("float *", out),
            op.ptr("float *", scratch),
        )
        got[h * rep : (h + 1) * rep] = out
    assert len(layer.heads[0].blocks) == (n - 1) // 32 and len(layer.heads[0].window) > 0
    err = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    assert err.max() < ATTN_BUDGET, err.max()


def _block_inputs(head, k, v):
    """The fp16 inputs of each block of a head (positions pos0 .. pos0+block-1)."""
    for b in head.blocks:
        sl = slice(b.pos0, b.pos0 + len(b.v_zero))
        yield k[sl].astype(np.float16), v[sl].astype(np.float16)
