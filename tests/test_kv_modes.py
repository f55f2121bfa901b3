"""KV cache modes on the real models: names and overrides in the Python API and the CLI,
one clear error for invalid combinations (Python and native), the fp16 default, and a
2K-token ott2 run on SmolLM2 whose memory accounting matches its allocation exactly."""

import numpy as np
import pytest

from ott_gguf import cli
from ott_gguf._native import ffi, lib
from ott_gguf.errors import InvalidArgumentError, ModelFileError, UnsupportedError
from ott_gguf.model import Context, Model, Weights
from ott_gguf.reference import PRESETS, preset
from ott_gguf.reference.config import AUTO, AUTO_CPU


def test_kvquant_needs_its_tables_info_does_not(smollm2_path, capsys):
    with pytest.raises(ModelFileError, match="the KVQuant cache needs one beside the model"):
        Model(smollm2_path, n_ctx=256, n_threads=2, kv="kvquant2", device="cpu")
    # info shows the footprint without them, store by store (reference/footprint.py)
    assert cli.main(["info", str(smollm2_path), "--kv", "kvquant2", "-c", "4096"]) == 0
    out = capsys.readouterr().out
    assert "2.67 bits per element at 4096 tokens" in out
    assert "sink 0.004, codes 1.984, scales 0.248, sparse 0.310, window 0.121 bits per element" in out


PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 5498, 314]


@pytest.fixture(scope="module")
def smol_ott2(smollm2_path):
    return Model(smollm2_path, n_ctx=2304, n_threads=2, kv="ott2", device="cpu")  # the CPU cache grows by blocks


def test_f16_is_the_default_cache(smollm2_path):
    default = Model(smollm2_path, n_ctx=64, n_threads=2)
    named = Model(smollm2_path, n_ctx=64, n_threads=2, kv="f16")
    config = Model(smollm2_path, n_ctx=64, n_threads=2, kv=preset("f16"))
    a = default.eval(PROMPT, all_logits=True)
    assert np.array_equal(a, named.eval(PROMPT, all_logits=True))
    assert np.array_equal(a, config.eval(PROMPT, all_logits=True))
    assert default.kv == named.kv == config.kv == "f16"
    assert default.kv_stats().bits_per_element == 16
    assert default.tokens_until_event() is None


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "f16" and not PRESETS[n].kvq])
def test_modes_by_name(smollm2_path, name):
    model = Model(smollm2_path, n_ctx=256, n_threads=2, kv=name, device="cpu")
    assert model.kv == name and model.kv_config == preset(name).for_head_dim(64)
    cfg = model.kv_config
    assert model.tokens_until_event() == cfg.sink + cfg.window + cfg.block
    f16 = Model(smollm2_path, n_ctx=64, n_threads=2, device="cpu").eval(PROMPT)
    logits = model.eval(PROMPT)  # every token still in the fp16 window
    assert int(np.argmax(logits)) == int(np.argmax(f16))
    assert np.abs(logits - f16).max() < 0.05 * np.abs(f16).max()
    st = model.kv_head_state(cfg.skip_layers, 0, 0)
    assert len(st.window_k) == len(PROMPT) and st.tracing == cfg.traces(cfg.skip_layers)


def test_auto_is_the_2bit_preset_where_it_runs(smollm2_path, capsys):
    """auto: ottr2tr on the CPU for a model with a plain RoPE, in the Python API and the CLI
    (a knob overridden makes it a custom mode); ottr3 without a model (test_archs.py: ottr2tg
    for a model whose RoPE is scaled; test_cuda.py: on a GPU)."""
    model = Model(smollm2_path, n_ctx=256, n_threads=2, kv="auto", device="cpu")
    assert model.kv == AUTO_CPU == "ottr2tr" and model.weights.kv_config("auto") == preset("ottr2tr")
    assert preset("auto") == preset(AUTO) == preset("ottr3")
    assert cli.main(["info", str(smollm2_path), "--kv", "auto", "-c", "4096"]) == 0
    assert "ottr2tr: " in capsys.readouterr().out
    assert cli.main(["info", str(smollm2_path), "--kv", "auto", "--kv-recent", "4", "-c", "4096"]) == 0
    assert "custom: " in capsys.readouterr().out


def test_auto_falls_back_by_head_size(tmp_path):
    """auto on head sizes the rotated presets cannot take: 96 (no Hadamard rotation) gets
    kivi4, whose groups of 32 divide it; 40 takes no quantized preset: one error naming them."""
    from make_gguf import write_random_model

    for hd, want in ((96, "kivi4"), (40, None)):
        path = write_random_model(tmp_path / f"hd{hd}.gguf", n_embd=2 * hd, n_head=2, n_head_kv=1, dtype="f32")
        w = Weights(path, device="cpu")
        if want:
            assert w.kv_config("auto") == preset(want)
            assert Model(w, n_ctx=64, kv="auto", n_threads=1).kv == want
        else:
            with pytest.raises(UnsupportedError, match="no quantized preset fits this model") as e:
                w.kv_config("auto")
            assert "\n" not in str(e.value)
            w.close()


@pytest.mark.parametrize(
    "kv, kwargs, message",
    [
        ("ott3", {}, "kv mode 'ott3' is not one of"),
        (preset("ott2").with_overrides(group_v=48), {}, "group_v=48 does not divide head_dim=64"),
        ("f16", {"prefill_fp16": True}, "prefill_fp16 applies to a quantized KV cache"),
    ],
)
def test_invalid_modes(smollm2_path, kv, kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        Model(smollm2_path, n_ctx=64, n_threads=2, kv=kv, **kwargs)


@pytest.mark.parametrize(
    "knobs, message",
    [
        (dict(type=lib.OTT_KV_OTT, pool=0, extra_pool=0), "pool=0 must be > 0 in OTT mode"),
        (dict(type=lib.OTT_KV_KIVI), "pool=3 must be 0 in KIVI mode"),
        (dict(bits_k=3), "bits_k=3 is not one of 2, 4, 8"),
        (dict(block=100), "block=100 must be a multiple of 8"),
        (dict(group_k=48), "group_k=48 must divide block"),
        (dict(group_v=48), "group_v=48 does not divide head_dim"),
        (dict(pool=128), "pool=128 must be in 0..block-1"),
        (dict(pool=0, type=lib.OTT_KV_KIVI), "extra_pool=32 needs pool > 0"),
        (dict(window=-1), "window=-1 must be >= 0"),
        (dict(hi_k=4, group_k=64), "key tiers (hi_k=4, lo_k=0) need bits_k=2, key_axis=0, group_k=block"),
        (dict(hi_k=9, lo_k=8), "hi_k=9 and lo_k must be >= 0 with hi_k + lo_k <= 16"),
        (dict(type=lib.OTT_KV_F16), "the fp16 cache takes no quantization knobs"),
        (dict(type=9), "unknown KV cache type 9"),
    ],
)
def test_native_rejects_invalid_knobs(smollm2_path, knobs, message):
    """C callers get one clear line too (the Python API validates before it gets here)."""
    model = Model(smollm2_path, n_ctx=64, n_threads=2)
    params = ffi.new("ott_context_params *", lib.ott_context_default_params())
    params.n_ctx = 64
    params.kv.type = lib.OTT_KV_OTT
    for name in (
        "bits_k",
        "bits_v",
        "group_k",
        "group_v",
        "block",
        "window",
        "pool",
        "extra_pool",
        "skip_layers",
        "sink",
    ):
        setattr(params.kv, name, getattr(preset("ott2"), name))
    for name, value in knobs.items():
        setattr(params.kv, name, value)
    out = ffi.new("ott_context **")
    assert lib.ott_context_init(model.weights._model, params, out) == lib.OTT_ERR_INVALID_ARG
    assert message in ffi.string(lib.ott_last_error()).decode()


def test_ott2_2k_tokens_memory_accounting(smol_ott2, wikitext_path):
    """2K+ tokens through ott2: allocation = every head-block and fp16 store held, use = the
    footprint accounting of the stores' real contents, growth one event at a time."""
    model = smol_ott2
    info, cfg = model.info, model.kv_config
    ids = model.tokenize(wikitext_path.read_text(encoding="utf-8")[:30000])[:2048]
    model.eval(ids)
    tok = int(np.argmax(model.eval([ids[-1]])))
    for _ in range(15):
        tok = int(np.argmax(model.eval([tok])))
    n_tokens = model.seq_len()
    assert n_tokens == 2064

    hd, n_kv = info.n_embd_head, info.n_head_kv
    token = 2 * hd * 2  # K and V, fp16
    alloc = used = n_extra = 0
    for il in range(info.n_layer):
        traces = cfg.traces(il)
        pool_cap = (cfg.pool + cfg.extra_pool) if traces else 0
        for h in range(n_kv):
            st = model.kv_head_state(il, 0, h)
            n_blocks = len(st.blocks)
            assert n_blocks == (n_tokens - cfg.window) // cfg.block
            alloc += n_blocks * st.blocks.shape[1]
            alloc += (cfg.sink + cfg.window + cfg.block) * token + pool_cap * (token + 4) + 3 * 4  # 3 int32 counts
            data = (
                hd * cfg.block * (cfg.bits_k + cfg.bits_v) // 8
                + (cfg.block // cfg.group_k * hd + cfg.block * hd // cfg.group_v) * 4
                + (cfg.block // 8 if traces else 0)
            )
            used += (
                n_blocks * data
                + (len(st.sink_k) + len(st.window_k)) * token
                + (len(st.pool_k) + len(st.extra_k)) * (token + 4)
            )
            assert len(st.pool_k) == (cfg.pool if traces else 0)
            n_extra += len(st.extra_k)
    stats = model.kv_stats()
    assert stats.bytes_allocated == alloc
    assert stats.bytes_used == used
    assert stats.n_tokens == n_tokens
    assert stats.bits_per_element == pytest.approx(8 * used / (n_tokens * info.n_layer * n_kv * 2 * hd))
    # the formula of reference/footprint.py is the same accounting, the extra pool at its bound
    formula = model.kv_footprint(n_tokens)
    extra_bound = formula.bytes["extra_pool"] // (token + 4)
    assert used + (extra_bound - n_extra) * (token + 4) == formula.total_bytes
    # no full-context fp16 allocation: under a quarter of what fp16 needs for these tokens
    assert stats.bytes_allocated < 0.25 * n_tokens * info.n_layer * n_kv * token

    # storage grows by one allocation per event: the n_head_kv head-blocks of every layer
    n = model.tokens_until_event()
    model.eval([tok] * (n - 1))
    assert model.kv_stats().bytes_allocated == alloc
    model.eval([tok])
    grown = model.kv_stats().bytes_allocated - alloc
    assert grown == info.n_layer * n_kv * model.kv_head_state(0, 0, 0).blocks.shape[1]


@pytest.mark.parametrize(
    ("model_fixture", "kv"),
    [("smollm2_path", "f16"), ("smollm2_path", "kivi2"), ("smollm2_path", "ottr2t"), ("smollm2_path", "kvquant2")]
    + [("gemma3_path", "ott2")],
)
def test_seq_bytes_is_the_allocation(request, tmp_path, model_fixture, kv):
    """Weights.kv_seq_bytes, what memory plans use (server slots, the default context), is
    what a sequence's cache holds once it fills its context (Gemma 3: fp16 rings in its local
    layers), and more than the footprint's data in a quantized mode."""
    from make_gguf import write_kvq_sidecar

    path = request.getfixturevalue(model_fixture)
    weights = Weights(path)
    n_ctx = 1100
    calib = write_kvq_sidecar(path, tmp_path / "made-up.kvcalib.gguf") if kv.startswith("kvquant") else None
    ctx = Context(weights, n_ctx=n_ctx, n_threads=2, kv=kv, kv_calib=calib)
    ids = np.random.default_rng(0).integers(0, ctx.n_vocab, n_ctx).tolist()
    for i in range(0, n_ctx, 512):
        ctx.eval(ids[i : i + 512])
    seq, footprint = weights.kv_seq_bytes(kv, n_ctx), weights.kv_footprint(kv, n_ctx).total_bytes
    assert ctx.kv_stats().bytes_allocated == seq
    assert seq == footprint if kv == "f16" else seq > footprint
    ctx.close()


def test_seq_bytes_needs_no_sidecar_and_checks_the_config(smollm2_path):
    """Sizing is geometry: KVQuant without its tables and a calibrated rotation without its
    sidecar are sized like their uncalibrated twins; a knob the model cannot take is one error,
    as when a context is made; closed weights are an error."""
    weights = Weights(smollm2_path)
    assert weights.kv_seq_bytes(preset("ottr2").with_overrides(rot_k=2), 1024) == weights.kv_seq_bytes("ottr2", 1024)
    assert weights.kv_seq_bytes("kvquant2", 1024) == weights.kv_seq_bytes(
        preset("kvquant2").with_overrides(pre_rope=0), 1024
    )
    with pytest.raises(InvalidArgumentError, match="group_v=48 does not divide head_dim=64"):
        weights.kv_seq_bytes(preset("kivi2").with_overrides(group_v=48), 1024)
    weights.close()
    with pytest.raises(InvalidArgumentError, match="the weights are closed"):
        weights.kv_seq_bytes("f16", 1024)


def test_ott4_close_to_f16_on_text(smollm2_path, wikitext_path):
    """Decode-faithful chunks on 1K tokens of WikiText: the 4-bit OTT cache's next-token
    distribution stays close to the fp16 cache's (measured: mean KL 0.025, top-1 0.94; the
    2-bit modes are measured by the accuracy report, not bounded here)."""
    f16 = Model(smollm2_path, n_ctx=1024, n_threads=2)
    ott = Model(smollm2_path, n_ctx=1024, n_threads=2, kv="ott4")
    ids = f16.tokenize(wikitext_path.read_text(encoding="utf-8")[:12000])[:1000]
    want = [i >= 700 for i in range(len(ids))]
    a = f16.decode_batch(ids, range(len(ids)), [0] * len(ids), want)
    parts, i = [], 0
    while i < len(ids):
        n = min(ott.tokens_until_event(), len(ids) - i)
        parts.append(ott.decode_batch(ids[i : i + n], range(i, i + n), [0] * n, want[i : i + n]))
        i += n
    b = np.concatenate(parts)

    def log_softmax(x):
        x = x.astype(np.float64) - x.max(1, keepdims=True)
        return x - np.log(np.exp(x).sum(1, keepdims=True))

    la, lb = log_softmax(a), log_softmax(b)
    kl = (np.exp(la) * (la - lb)).sum(1)
    assert kl.mean() < 0.06 and (a.argmax(1) == b.argmax(1)).mean() > 0.9


def test_cli_flags(smollm2_path, capsys):
    assert cli.main(["info", str(smollm2_path), "--kv", "ott2", "--kv-pool", "5"]) == 0
    out = capsys.readouterr().out
    assert "KV footprint" in out and "bits per element at 8192 tokens" in out
    assert cli.main(["info", str(smollm2_path), "--kv", "ott2", "-c", "4096"]) == 0
    model = Model(smollm2_path, n_ctx=64, kv="ott2")
    want, out = model.kv_footprint(4096), capsys.readouterr().out
    assert (
        f"{want.bytes_per_token_per_layer:.1f} bytes per token per layer, "
        f"{want.bits_per_element:.2f} bits per element at 4096 tokens"
    ) in out
    seq_bytes = model.weights.kv_seq_bytes("ott2", 4096)
    assert f"{seq_bytes / 2**20:.1f} MiB per sequence of 4096 tokens at most" in out
    assert cli.main(["run", str(smollm2_path), "--kv", "kivi2", "--kv-group-v", "48", "-p", "x", "-n", "1"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "error: kv config: group_v=48 does not divide head_dim=64"
    assert cli.main(["run", str(smollm2_path), "--kv", "f16", "--kv-window", "8", "-p", "x", "-n", "1"]) == 1
    assert "window=8 does not apply to the fp16 cache" in capsys.readouterr().err
    assert (
        cli.main(
            [
                "run",
                str(smollm2_path),
                "--kv",
                "ott4",
                "--kv-sink",
                "4",
                "--prefill-fp16",
                "-t",
                "2",
                "-p",
                "The capital of France is",
                "-n",
                "3",
                "--temp",
                "0",
            ]
        )
        == 0
    )
    assert "Paris" in capsys.readouterr().out
