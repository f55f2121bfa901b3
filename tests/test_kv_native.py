"""The native quantized KV cache against the numpy specification (ott_gguf/reference).

Harness: a random F32 model decodes token chunks through the native cache. After every
chunk, the fp16 K/V the native cache stored for the chunk (read back with ott_kv_export
from its sink and window, before any event can quantize them) are appended to one
reference LayerCache per layer. Then:

- stores, bit for bit: codes, scales, mins and masks of every block, sink, outlier pool
  and extra pool (values and positions), window, tracing state, for every layer and KV head;
- attention, within a budget: the reference runs the model's forward pass for the chunk
  with float64 attention (reference.attend) over its cache and the same chunk K/V; the
  native logits must match to a relative L2 error of LOGIT_BUDGET per token. The only
  differences are float32 rounding in the matmuls and the native attention's float32
  softmax (exp to 3e-7 relative) and accumulation.
"""

import numpy as np
import pytest

from ott_gguf.errors import UnsupportedError
from ott_gguf.model import Model, cuda_device_count, set_cpu_int_dots
from ott_gguf.reference import KVConfig, LayerCache, attend, preset
from ott_gguf.reference.footprint import measure
from ott_gguf.reference.rope import Rope
from ott_gguf.reference.rotation import HADAMARD, hadamard, restore, rotate
from reference_forward import ReferenceModel, rms_norm, silu

INT_DOTS = set_cpu_int_dots(None)  # on by default where the CPU has them (AVX-512 VNNI)


def logit_budget(int_dots: bool) -> float:
    """float32 matrix products on the CPU: 2e-4. The CPU attention's integer dot products
    (AVX-512 VNNI, ott.h: ott_set_cpu_int_dots) take q·scale and p·scale in 16-bit fixed point:
    up to 2.6e-4 measured over CASES, so 1e-3. ggml-cuda's products round through TF32/fp16
    (misses of about 2e-3 at the CPU budget were seen on an H200), so a GPU build gets 5e-3."""
    if cuda_device_count():
        return 5e-3
    return 1e-3 if int_dots else 2e-4


LOGIT_BUDGET = logit_budget(INT_DOTS)  # the process default

# small blocks so that a few hundred tokens cross every boundary many times; groups of 16
# take the native attention's fused path (decode rows read codes directly), groups of 8 or
# 4 its materialised path (tiles dequantised first, as for prompt chunks)
SMALL = KVConfig(
    bits_k=2, bits_v=2, group_k=16, group_v=16, block=16, window=4, pool=2, extra_pool=5, skip_layers=1, sink=2
)


class ReferenceRun:
    """The reference cache of every layer of one sequence, and the model's forward pass over it."""

    def __init__(self, ref: ReferenceModel | None, cfg: KVConfig, model: Model, kvq: list | None = None):
        """ref None: stores only (chunk() needs the model's weights). kvq: the KVQuant
        scheme's tables per layer (reference.kvquant.KVQLayer)."""
        self.ref = ref
        info = model.info
        u = model.weights.tier_scale() if cfg.tiered else None  # the key tiers' query scale
        self.layers = [
            LayerCache.new(
                cfg, il, info.n_head_kv, info.n_embd_head, kvq[il] if kvq else None, u[il] if cfg.tiered else None
            )
            for il in range(info.n_layer)
        ]
        # keys cached before RoPE are rotated in attention (the query is, as ever, by the model)
        self.rope = Rope(ref.n_rot, ref.freq_base, ref.freq_scale, ref.neox) if ref and cfg.pre_rope else None
        self.n_tokens = 0
        # Hadamard rotations per layer and KV head (rotation.py), None where the config has none
        self.rot = {
            kind: [
                [hadamard(info.n_embd_head, il, h, kind == "v") for h in range(info.n_head_kv)]
                for il in range(info.n_layer)
            ]
            if getattr(cfg, f"rot_{kind}") == HADAMARD
            else None
            for kind in ("k", "v")
        }

    def rotate_heads(self, x: np.ndarray, kind: str, il: int, undo: bool = False) -> np.ndarray:
        """x [n, heads, hd] with each head's rotation of its KV head (or its inverse)."""
        rots = self.rot[kind]
        if rots is None:
            return x
        rep = x.shape[1] // len(rots[il])
        f = restore if undo else rotate
        return np.stack([f(x[:, h], rots[il][h // rep]) for h in range(x.shape[1])], axis=1)

    def chunk(self, tokens: list[int], kv: list[tuple[np.ndarray, np.ndarray]], append: bool = True) -> np.ndarray:
        """Logits [n, n_vocab] of a chunk whose K/V per layer are kv[il] (float32 [n, n_head_kv, hd])."""
        r, n = self.ref, len(tokens)
        cos, sin = r.rope_tables(self.n_tokens + n)
        cos, sin = cos[self.n_tokens :], sin[self.n_tokens :]
        x = r.w["token_embd.weight"][np.asarray(tokens)]
        for il, layer in enumerate(self.layers):
            blk = f"blk.{il}"
            h = rms_norm(x, r.w[f"{blk}.attn_norm.weight"], r.eps)
            q = r.rope(r.linear(h, f"{blk}.attn_q").reshape(n, r.n_head, r.n_embd_head), cos, sin)
            q = self.rotate_heads(q, "k", il)
            out = self.rotate_heads(attend(layer, q, *kv[il], rope=self.rope), "v", il, undo=True)
            out = out.astype(np.float32).reshape(n, -1)
            x = x + r.linear(out, f"{blk}.attn_output")
            h = rms_norm(x, r.w[f"{blk}.ffn_norm.weight"], r.eps)
            x = x + r.linear(silu(r.linear(h, f"{blk}.ffn_gate")) * r.linear(h, f"{blk}.ffn_up"), f"{blk}.ffn_down")
        if append:
            self.append(kv)
        x = rms_norm(x, r.w["output_norm.weight"], r.eps)
        return x @ r.w["output.weight"].T

    def append(self, kv: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for layer, (k, v) in zip(self.layers, kv):
            layer.append(k, v)
        self.n_tokens += len(kv[0][0])


def stored_kv(model: Model, n_new: int, seq: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """The fp16 K/V the native cache stored for the last n_new tokens of `seq`, per layer:
    float32 [n_new, n_head_kv, head_dim] each. They must still sit in the sink or the window."""
    out = []
    for il in range(model.info.n_layer):
        ks, vs = [], []
        for h in range(model.info.n_head_kv):
            st = model.kv_head_state(il, seq, h)
            n_sink, win0 = len(st.sink_k), st.n_tokens - len(st.window_k)
            pos = range(st.n_tokens - n_new, st.n_tokens)
            assert all(p < n_sink or p >= win0 for p in pos), "chunk tokens already quantized"
            ks.append([st.sink_k[p] if p < n_sink else st.window_k[p - win0] for p in pos])
            vs.append([st.sink_v[p] if p < n_sink else st.window_v[p - win0] for p in pos])
        out.append((np.array(ks, np.float32).transpose(1, 0, 2), np.array(vs, np.float32).transpose(1, 0, 2)))
    return out


def block_arrays(blocks: np.ndarray, offsets: dict, rb) -> dict:
    """The arrays of native head-block j laid out like reference block rb (same shapes, dtypes)."""
    out = {}
    for name, off in offsets.items():
        want = getattr(rb, name)
        out[name] = blocks[off : off + want.nbytes].view(want.dtype).reshape(want.shape)
    return out


def assert_same_state(model: Model, run: ReferenceRun, seq: int = 0) -> None:
    """Every store of every layer and KV head, bit for bit."""
    for il, layer in enumerate(run.layers):
        for h, head in enumerate(layer.heads):
            st = model.kv_head_state(il, seq, h)
            where = f"layer {il} head {h} at {head.n_tokens} tokens"
            assert st.n_tokens == head.n_tokens, where
            assert st.tracing == head.tracing, where
            for name, ref, ours in [
                ("sink", head.sink, (st.sink_k, st.sink_v, None)),
                ("pool", head.pool, (st.pool_k, st.pool_v, st.pool_pos)),
                ("extra", head.extra, (st.extra_k, st.extra_v, st.extra_pos)),
                ("window", head.window, (st.window_k, st.window_v, None)),
            ]:
                assert ours[0].shape == ref.k.shape, f"{where}: {name} holds {len(ours[0])} not {len(ref)}"
                assert (ours[0].view(np.uint16) == ref.k.view(np.uint16)).all(), f"{where}: {name} K"
                assert (ours[1].view(np.uint16) == ref.v.view(np.uint16)).all(), f"{where}: {name} V"
                if ours[2] is not None:
                    assert ours[2].tolist() == ref.pos.tolist(), f"{where}: {name} positions"
            assert len(st.blocks) + len(st.recent) == len(head.blocks), where
            n_old = len(st.blocks)
            for j, rb in enumerate(head.blocks):
                got = (
                    block_arrays(st.blocks[j], st.block_offsets, rb)
                    if j < n_old
                    else block_arrays(st.recent[j - n_old], st.recent_offsets, rb)
                )
                for name, arr in got.items():
                    assert (arr.view(np.uint8) == getattr(rb, name).view(np.uint8)).all(), f"{where}: block {j} {name}"


def rel_err(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def random_model(tmp_path, head_dim: int, gqa: int, n_layer: int = 2, seed: int = 0):
    from make_gguf import write_random_model

    n_head_kv = 2 if gqa == 1 else 1
    n_head = n_head_kv * gqa
    return write_random_model(
        tmp_path / f"r{head_dim}-{gqa}.gguf",
        arch="qwen2",
        dtype="f32",
        n_embd=head_dim * n_head,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_ff=128,
        seed=seed,
        n_ctx_train=4096,
    )


def run_chunks(model: Model, run: ReferenceRun, tokens: list[int], sizes, check_every: int = 1):
    """Feed tokens in chunks of the given sizes (cycled); compare logits each chunk and
    stores every check_every chunks and at the end. Returns the largest logit error."""
    worst, i, c = 0.0, 0, 0
    while i < len(tokens):
        n = min(sizes[c % len(sizes)], len(tokens) - i)
        chunk = tokens[i : i + n]
        ours = model.eval(chunk, all_logits=True)
        theirs = run.chunk(chunk, stored_kv(model, n))
        worst = max(worst, float(rel_err(ours, theirs).max()))
        i, c = i + n, c + 1
        if c % check_every == 0 or i == len(tokens):
            assert_same_state(model, run)
    return worst


# ---------------------------------------------------------------- bit-exact stores + attention

CASES = [
    # id, head_dim, gqa, config, tokens, chunk sizes
    ("hd64-gqa1-small", 64, 1, SMALL, 230, [1, 3, 4, 2]),
    ("hd64-gqa3-groups8x4", 64, 3, SMALL.with_overrides(group_k=8, group_v=4), 150, [1, 4]),
    ("hd128-gqa3-small", 128, 3, SMALL, 200, [4, 1]),
    ("hd64-gqa7-small", 64, 7, SMALL, 150, [2, 3]),
    ("hd128-gqa1-4bit-g4", 128, 1, SMALL.with_overrides(bits_k=4, bits_v=4, group_k=16, group_v=32), 120, [4]),
    ("hd64-gqa3-8bit", 64, 3, SMALL.with_overrides(bits_k=8, bits_v=8, group_k=4), 90, [3]),
    ("hd64-gqa1-kivi", 64, 1, SMALL.with_overrides(pool=0, extra_pool=0, sink=0), 120, [4, 1]),
    ("hd64-gqa3-stop-early", 64, 3, SMALL.with_overrides(pool=3, extra_pool=3, window=8), 160, [8, 5]),
    ("hd128-gqa7-window1", 128, 7, SMALL.with_overrides(window=1, sink=0, pool=1, extra_pool=2), 70, [1]),
    ("hd64-gqa3-clip", 64, 3, SMALL.with_overrides(clip=1), 150, [1, 4]),
    ("hd64-gqa3-rot-kv", 64, 3, SMALL.with_overrides(rot_k=HADAMARD, rot_v=HADAMARD), 120, [1, 4]),
    ("hd128-gqa1-rot-v-clip", 128, 1, SMALL.with_overrides(rot_v=HADAMARD, clip=1), 100, [3]),
    ("hd64-gqa3-params8", 64, 3, SMALL.with_overrides(param_bits=8), 150, [1, 4]),
    ("hd64-gqa3-clip-params8", 64, 3, SMALL.with_overrides(param_bits=8, clip=1, rot_v=HADAMARD), 150, [1, 4]),
    (
        "hd128-gqa1-params8-4bit-rot",
        128,
        1,
        SMALL.with_overrides(param_bits=8, bits_k=4, bits_v=4, group_v=32, rot_v=HADAMARD),
        100,
        [4],
    ),
    (
        "hd128-gqa1-clip-4bit",
        128,
        1,
        SMALL.with_overrides(clip=1, bits_k=4, bits_v=4, group_k=16, group_v=32),
        120,
        [4],
    ),
    ("hd64-gqa3-keys-per-token", 64, 3, SMALL.with_overrides(key_axis=1, group_k=32), 150, [1, 4]),
    ("hd64-gqa3-key-tiers", 64, 3, SMALL.with_overrides(hi_k=4, lo_k=4), 150, [1, 4]),
    (
        "hd128-gqa1-key-tiers-clip-p8-rot-v",
        128,
        1,
        SMALL.with_overrides(hi_k=2, lo_k=5, clip=1, param_bits=8, rot_v=HADAMARD),
        100,
        [3],
    ),
    ("hd64-gqa3-key-tiers-hi-only", 64, 3, SMALL.with_overrides(hi_k=3), 150, [4, 1]),
    (
        "hd128-gqa1-keys-per-token-p8-rot",
        128,
        1,
        SMALL.with_overrides(key_axis=1, group_k=256, param_bits=8, rot_k=HADAMARD),
        100,
        [3],
    ),
    (
        "hd64-gqa3-keys-per-token-rot-clip-p8",
        64,
        3,
        SMALL.with_overrides(key_axis=1, group_k=64, param_bits=8, clip=1, rot_k=HADAMARD, rot_v=HADAMARD),
        150,
        [1, 4],
    ),
    # recent blocks: re-coded from their 4-bit codes as they age, into tiers, clipped 2-bit
    # groups with 8-bit parameters, per-token keys
    ("hd64-gqa3-recent1-key-tiers", 64, 3, SMALL.with_overrides(hi_k=4, lo_k=8, clip=1, recent=1), 150, [1, 4]),
    (
        "hd128-gqa1-recent2-clip-p8-rot-v",
        128,
        1,
        SMALL.with_overrides(clip=1, param_bits=8, rot_v=HADAMARD, recent=2),
        120,
        [3, 4],
    ),
    ("hd64-gqa3-recent3-keys-per-token", 64, 3, SMALL.with_overrides(key_axis=1, group_k=32, recent=3), 150, [4, 1]),
    # symmetric value groups: fp16 scales at 2 bits, 8-bit scales at 4 bits, and with clipped
    # ranges under recent blocks and key tiers (the groups of ottr2tr)
    ("hd64-gqa3-sym-v", 64, 3, SMALL.with_overrides(sym_v=1), 150, [1, 4]),
    (
        "hd128-gqa1-sym-v-4bit-p8",
        128,
        1,
        SMALL.with_overrides(sym_v=1, bits_k=4, bits_v=4, group_v=32, param_bits=8),
        100,
        [3],
    ),
    (
        "hd64-gqa3-sym-v-recent2-tiers-clip-p8-rot-v",
        64,
        3,
        SMALL.with_overrides(sym_v=1, hi_k=4, lo_k=8, clip=1, param_bits=8, rot_v=HADAMARD, recent=2),
        150,
        [1, 4],
    ),
    # keys cached before RoPE, rotated in attention: every store (blocks, recent blocks, pool
    # and extra pool at their positions, sink, window, the chunk), per-channel and per-token keys
    ("hd64-gqa3-pre-rope", 64, 3, SMALL.with_overrides(pre_rope=1), 150, [1, 4]),
    (
        "hd64-gqa3-pre-rope-recent2-tiers-sym-v",
        64,
        3,
        SMALL.with_overrides(pre_rope=1, hi_k=4, lo_k=8, clip=1, param_bits=8, rot_v=HADAMARD, recent=2, sym_v=1),
        150,
        [1, 4],
    ),
    # tiles of 64 slots: AVX-512 scores keys before RoPE two vectors of slots at a time
    (
        "hd64-gqa3-pre-rope-tiers-block64",
        64,
        3,
        SMALL.with_overrides(
            pre_rope=1, hi_k=4, lo_k=8, clip=1, param_bits=8, rot_v=HADAMARD, recent=2, sym_v=1, block=64, group_k=64
        ),
        300,
        [1, 4],
    ),
    # 7 query rows a KV head: decode rows scored all at once (AVX-512's 8-row RoPE kernel)
    (
        "hd64-gqa7-pre-rope-tiers-sym-v",
        64,
        7,
        SMALL.with_overrides(pre_rope=1, hi_k=4, lo_k=8, clip=1, param_bits=8, rot_v=HADAMARD, recent=2, sym_v=1),
        150,
        [1],
    ),
    (
        "hd128-gqa1-pre-rope-keys-per-token",
        128,
        1,
        SMALL.with_overrides(pre_rope=1, key_axis=1, group_k=32),
        200,
        [3, 1],
    ),
]


@pytest.fixture(params=["float", "int"])
def dots(request):
    """The CPU attention's dot products over codes: in float, or as integers where the CPU has them."""
    on = request.param == "int"
    if on and (not INT_DOTS or cuda_device_count()):
        pytest.skip("no AVX-512 VNNI on this CPU" if not INT_DOTS else "the model runs on the GPU")
    set_cpu_int_dots(on)
    yield on
    set_cpu_int_dots(INT_DOTS)


def test_int_dots_switch(tmp_path):
    """The switch takes effect: the same steps over a 2-bit preset's blocks (the fused path)
    give other logits with integer dot products than in float, within the budget; where the
    CPU lacks them, asking for them is one UnsupportedError and changes nothing."""
    assert set_cpu_int_dots(None) is INT_DOTS  # a question, never an error
    if not INT_DOTS:
        with pytest.raises(UnsupportedError, match="VNNI"):
            set_cpu_int_dots(True)
        assert set_cpu_int_dots(False) is False
        return
    path = random_model(tmp_path, 64, 3)
    model = Model(path, n_ctx=512, n_seq_max=2, n_threads=2, kv=preset("ottr2"), device="cpu")
    tokens = np.random.default_rng(5).integers(0, model.n_vocab, 260).tolist()
    model.eval(tokens[:256])  # two quantized blocks
    logits = {}
    try:
        for on in (False, True):
            assert set_cpu_int_dots(on) is on
            model.copy_sequence(0, 1)
            logits[on] = np.stack([model.eval([t], 1) for t in tokens[256:]])
            model.truncate(1, 0)
    finally:
        set_cpu_int_dots(INT_DOTS)
    err = rel_err(logits[True], logits[False])
    assert 0 < err.max() < logit_budget(True)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_native_matches_reference(tmp_path, case, dots):
    _, head_dim, gqa, cfg, n_tokens, sizes = case
    path = random_model(tmp_path, head_dim, gqa)
    # keys grouped per token are CPU only (the CUDA cache refuses them)
    cpu_only = cfg.key_axis
    model = Model(path, n_ctx=512, n_threads=2, kv=cfg, device="cpu" if cpu_only else None)
    run = ReferenceRun(ReferenceModel(path), cfg, model)
    tokens = np.random.default_rng(head_dim + gqa).integers(0, model.n_vocab, n_tokens).tolist()
    worst = run_chunks(model, run, tokens, sizes)
    assert worst < logit_budget(dots)
    assert model.kv_stats().bytes_used == measure(run.layers).total_bytes  # same accounting
    # the boundaries the case was meant to cross
    head = run.layers[1].heads[0]
    assert len(head.blocks) >= 3
    if cfg.pool:
        assert len(head.pool) == cfg.pool and len(head.extra) > 0


def test_stop_rule_reached(tmp_path):
    """With a tiny extra pool every traced head stops tracing; later blocks have no masks."""
    cfg = SMALL.with_overrides(extra_pool=2)
    path = random_model(tmp_path, 64, 3)
    model = Model(path, n_ctx=512, n_threads=2, kv=cfg)
    run = ReferenceRun(ReferenceModel(path), cfg, model)
    tokens = np.random.default_rng(5).integers(0, model.n_vocab, 150).tolist()
    run_chunks(model, run, tokens, [4], check_every=8)
    head = run.layers[1].heads[0]
    assert not head.tracing and not model.kv_head_state(1, 0, 0).tracing
    assert not head.blocks[-1].masked.any()


@pytest.mark.parametrize(
    "cfg",
    [SMALL.with_overrides(skip_layers=0), SMALL.with_overrides(skip_layers=0, window=0, sink=0)],
    ids=["small", "window0"],
)
def test_large_chunks_one_layer(tmp_path, cfg):
    """Chunks larger than the window that span several events (prompt processing): the
    chunk attends to itself in full precision and is quantized as it is appended. A
    one-layer model's K/V do not depend on the cache, so a second context whose window never
    quantizes (same chunks, same graphs) provides them."""
    path = random_model(tmp_path, 64, 3, n_layer=1)
    keep = cfg.with_overrides(window=400)
    model = Model(path, n_ctx=512, n_threads=2, kv=cfg)
    probe = Model(path, n_ctx=512, n_threads=2, kv=keep)
    run = ReferenceRun(ReferenceModel(path), cfg, model)
    tokens = np.random.default_rng(2).integers(0, model.n_vocab, 300).tolist()
    run_probed_chunks(model, probe, run, tokens, [40, 1, 37, 64, 100, 3, 55], assert_same_state)


def run_probed_chunks(model: Model, probe: Model, run: ReferenceRun, tokens: list[int], sizes, same_stores):
    """Feed tokens in chunks of the given sizes to model and probe (a context of the same
    model whose window never quantizes: it keeps every chunk's K/V readable); after each
    chunk the logits must match the reference's within LOGIT_BUDGET and same_stores(model,
    run) must hold."""
    i = 0
    for n in sizes:
        chunk = tokens[i : i + n]
        ours = model.eval(chunk, all_logits=True)
        probe.eval(chunk)
        theirs = run.chunk(chunk, stored_kv(probe, n))
        assert rel_err(ours, theirs).max() < LOGIT_BUDGET
        same_stores(model, run)
        i += n


def test_prefill_fp16(tmp_path):
    """prefill_fp16: a prompt given in several ubatches attends in full precision as one
    chunk; its events fire before the next single-token step."""
    path = random_model(tmp_path, 64, 3)
    model = Model(path, n_ctx=512, n_threads=2, n_ubatch=16, kv=SMALL, prefill_fp16=True)
    run = ReferenceRun(ReferenceModel(path), SMALL, model)
    tokens = np.random.default_rng(3).integers(0, model.n_vocab, 100).tolist()
    ours = model.eval(tokens[:90], all_logits=True)
    theirs = run.chunk(tokens[:90], stored_kv(model, 90))  # one reference chunk, then appended
    assert rel_err(ours, theirs).max() < LOGIT_BUDGET
    assert len(model.kv_head_state(1, 0, 0).blocks) == 0  # nothing quantized yet
    for t in tokens[90:]:
        ours = model.eval([t], all_logits=True)
        theirs = run.chunk([t], stored_kv(model, 1))
        assert rel_err(ours, theirs).max() < LOGIT_BUDGET
    assert_same_state(model, run)


def test_sequences_in_one_batch(tmp_path):
    """Several sequences of different lengths in one batch: each equals its own run."""
    path = random_model(tmp_path, 64, 3)
    batched = Model(path, n_ctx=256, n_seq_max=3, n_threads=2, kv=SMALL)
    alone = Model(path, n_ctx=256, n_threads=2, kv=SMALL)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, batched.n_vocab, n).tolist() for n in (5, 41, 70)]
    for s, p in enumerate(prompts):
        batched.eval(p, seq=s)
    step = [int(rng.integers(0, batched.n_vocab)) for _ in prompts]
    out = batched.decode_batch(step, [len(p) for p in prompts], [0, 1, 2], [True] * 3)
    for s, p in enumerate(prompts):
        alone.truncate(0)
        alone.eval(p)
        want = alone.eval([step[s]])
        assert rel_err(out[s], want) < 1e-5
        st, ref = batched.kv_head_state(1, s, 0), alone.kv_head_state(1, 0, 0)
        assert (st.blocks == ref.blocks).all() and (st.window_k == ref.window_k).all()


def test_copy_sequence(tmp_path):
    """A copied sequence has the same stores and continues exactly as its source does."""
    path = random_model(tmp_path, 64, 3)
    model = Model(path, n_ctx=256, n_seq_max=2, n_threads=2, kv=SMALL)
    tokens = np.random.default_rng(7).integers(0, model.n_vocab, 90).tolist()
    model.eval(tokens[:70], seq=0)
    model.copy_sequence(0, 1)
    for il in range(model.info.n_layer):
        a, b = model.kv_head_state(il, 0, 0), model.kv_head_state(il, 1, 0)
        assert (a.blocks == b.blocks).all() and (a.pool_pos == b.pool_pos).all() and (a.window_v == b.window_v).all()
    one = model.eval(tokens[70:], seq=0, all_logits=True)
    two = model.eval(tokens[70:], seq=1, all_logits=True)
    assert np.array_equal(one, two)
    kept = model.kv_head_state(1, 1, 0)
    model.truncate(0, 0)  # the copy owns its memory
    model.eval(tokens[::-1], seq=0)
    after = model.kv_head_state(1, 1, 0)
    assert model.seq_len(1) == 90 and np.array_equal(kept.blocks, after.blocks)
    assert np.array_equal(kept.extra_k, after.extra_k)


def test_truncate(tmp_path):
    path = random_model(tmp_path, 64, 1)
    model = Model(path, n_ctx=256, n_threads=2, kv=SMALL)
    tokens = np.random.default_rng(6).integers(0, model.n_vocab, 60).tolist()
    model.eval(tokens)
    st = model.kv_head_state(0, 0, 0)
    frozen = 60 - len(st.window_k)
    model.truncate(0, frozen + 1)  # only window tokens dropped
    assert model.seq_len() == frozen + 1
    with pytest.raises(UnsupportedError, match="quantized"):
        model.truncate(0, frozen - 1)
    model.truncate(0, 0)
    stats = model.kv_stats()
    assert model.seq_len() == 0 and stats.bytes_used == 0
    if model.info.device == "cpu":  # the CPU cache frees its blocks; the CUDA one allocates once
        assert stats.bytes_allocated == 0
    again = Model(path, n_ctx=256, n_threads=2, kv=SMALL)
    assert np.array_equal(model.eval(tokens[:20], all_logits=True), again.eval(tokens[:20], all_logits=True))


def test_tokens_until_event(tmp_path):
    path = random_model(tmp_path, 64, 1)
    model = Model(path, n_ctx=256, n_threads=2, kv=SMALL)
    run = LayerCache.new(SMALL, 0, 1, 64)
    assert model.tokens_until_event() == run.tokens_until_event() == SMALL.sink + SMALL.window + SMALL.block
    for n in (1, 21, 5, 16):
        model.eval([1] * n)
        run.append(np.zeros((n, 1, 64), np.float32), np.zeros((n, 1, 64), np.float32))
        assert model.tokens_until_event() == run.tokens_until_event()
    assert Model(path, n_ctx=64, n_threads=2).tokens_until_event() is None


def test_default_presets_on_qwen(qwen05_path):
    """ott2's defaults (block 128, window 32, pool 3) on a real GQA-7 model, through two
    events: stores bit for bit; logits within the budget of the model's own rounding
    (Q4_K weights: ggml quantizes activations to 8 bits before each matmul, the reference
    does not, so only stores are compared exactly here)."""
    cfg = preset("ott2")
    model = Model(qwen05_path, n_ctx=512, n_threads=2, kv=cfg)
    run = ReferenceRun(None, cfg, model)
    tokens = model.tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n" * 20)[:300]
    i = 0
    while i < len(tokens):
        n = min(32, len(tokens) - i)
        model.eval(tokens[i : i + n])
        run.append(stored_kv(model, n))
        i += n
    assert len(run.layers[5].heads[0].blocks) == 2
    assert_same_state(model, run)
