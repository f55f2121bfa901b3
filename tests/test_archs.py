"""Qwen3, Gemma 3 and Phi-3 end to end: tiny random checkpoints (tiny_archs.py) through our
converter and runtime, against transformers' own forward pass and llama.cpp's results on the
same GGUF files (data/llamacpp_tiny_archs.json); every KV mode on each; the real Gemma 3
270M against llama.cpp's WikiText-2 perplexity."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from gguf import GGUFValueType

import convert
from make_gguf import write_copy, write_kvq_sidecar
from ott_gguf.errors import ModelFileError, UnsupportedError
from ott_gguf.model import Model, Weights
from ott_gguf.perplexity import perplexity
from ott_gguf.reference.config import PRESETS
from tiny_archs import CHECKPOINTS, FIXTURE, LLAMACPP_CHECKED, PPL_BYTES, PPL_CHUNKS, PPL_CTX, TOKENIZER_TEXTS, build

PROMPT = "the cat in the hat sat on the mat, and then the cat ate a hat. " * 2
N_PROMPT = 72  # longer than every window (16, 24) and than Phi-3's original context (32)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-archs")
    return {name: build(name, root) for name in CHECKPOINTS}, root


@pytest.fixture(scope="module")
def llamacpp():
    return json.loads(FIXTURE.read_text(encoding="utf-8"))["models"]


def hf_logits(directory, ids, **overrides) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )
    for key, value in overrides.items():
        setattr(model.config, key, value)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("n_ubatch", [512, 8])
def test_logits_match_transformers(ggufs, name, n_ubatch):
    """All 72 rows of logits against transformers' float32 forward. Budget 0.02·rms(logits): the
    GGUF holds the same float32 weights, so the difference is our fp16 K/V cache and ggml's
    fp16 rounding of Q inside flash attention (relative 2^-11 per element), carried through 2-4
    layers; measured 0.0004-0.001·rms. In chunks of 8 the local layers' ring wraps (23 rows
    for a window of 16)."""
    paths, root = ggufs
    model = Model(paths[name], n_ctx=128, n_ubatch=n_ubatch, n_threads=2, device="cpu")
    ids = model.tokenize(PROMPT)[:N_PROMPT]
    assert len(ids) == N_PROMPT
    ours = np.concatenate([model.eval(ids[i : i + n_ubatch], all_logits=True) for i in range(0, N_PROMPT, n_ubatch)])
    ref = hf_logits(root / name, ids)
    budget = 0.02 * np.sqrt(np.mean(ref**2))
    assert np.abs(ours - ref).max() < budget, (np.abs(ours - ref).max(), budget)
    assert (ours.argmax(1) == ref.argmax(1)).all()
    if model.weights.info.n_swa:  # the window matters: without it the reference moves far more
        assert np.abs(hf_logits(root / name, ids, sliding_window=4096) - ref).max() > 20 * budget


@pytest.mark.parametrize("name", LLAMACPP_CHECKED)
def test_perplexity_matches_llamacpp(ggufs, llamacpp, wikitext_path, name):
    """llama-perplexity on the same files; both score the same tokens with fp16 caches, so they
    agree to the last digits llama.cpp prints (measured 1e-6 relative)."""
    model = Model(ggufs[0][name], n_ctx=PPL_CTX, n_threads=2, device="cpu")
    text = wikitext_path.read_bytes()[:PPL_BYTES].decode("utf-8")
    result = perplexity(model, text, PPL_CTX, n_chunks=PPL_CHUNKS, progress=False)
    assert result.ppl == pytest.approx(llamacpp[name]["ppl"], rel=1e-4)


@pytest.mark.parametrize("name", LLAMACPP_CHECKED)
def test_tokenizer_ids_match_llamacpp(ggufs, llamacpp, name):
    weights = Weights(ggufs[0][name])
    for parse, key in ((False, "plain"), (True, "parse_special")):
        ours = [weights.tokenize(t, add_special=True, parse_special=parse) for t in TOKENIZER_TEXTS]
        assert ours == llamacpp[name]["ids"][key], key


def test_auto_falls_back_where_keys_cannot_precede_rope(ggufs):
    """auto on the CPU: ottr2tr where the cache takes it (Qwen3, Gemma 3), ottr2tg (its keys
    after RoPE) for Phi-3, whose LongRoPE factors keep keys from being cached before RoPE."""
    for name, want in (("qwen3", "ottr2tr"), ("gemma3", "ottr2tr"), ("phi3-window", "ottr2tg")):
        w = Weights(ggufs[0][name], device="cpu")
        assert w.kv_config("auto") == PRESETS[want], name
        w.close()


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "phi3-window"])
@pytest.mark.parametrize("kv", [k for k in PRESETS if k != "f16"])
def test_every_kv_mode_runs(ggufs, name, kv, tmp_path):
    """A 400-token prompt (quantization events after 160 tokens) in each mode: logits finite and
    close to the fp16 cache's (random tiny models make 2-bit keys hard: the bound is loose),
    and the native memory equal to the footprint's formula, the local ring counted in fp16.
    Phi-3 with a window shorter than the context has only local layers: the mode has nothing
    to quantize. KVQuant reads made-up tables (make_gguf.write_kvq_sidecar); it and every mode
    with keys cached before RoPE (ottr2tr) refuse LongRoPE (Phi-3), whose keys they could not
    rotate themselves."""
    path = ggufs[0][name]
    f16 = Model(path, n_ctx=512, n_threads=2, device="cpu")
    ids = (f16.tokenize(PROMPT * 8) * 2)[:400]
    ref = f16.eval(ids, all_logits=True)
    calib = write_kvq_sidecar(path, tmp_path / "t.kvcalib.gguf") if PRESETS[kv].kvq else None
    if PRESETS[kv].pre_rope and name == "phi3-window":  # LongRoPE's factors: keys not rotated here
        with pytest.raises(UnsupportedError, match="pre-RoPE keys need a plain RoPE"):
            Model(path, n_ctx=512, n_threads=2, kv=kv, device="cpu", kv_calib=calib)
        return
    model = Model(path, n_ctx=512, n_threads=2, kv=kv, device="cpu", kv_calib=calib)
    got = model.eval(ids, all_logits=True)
    assert np.isfinite(got).all()
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.5
    info, stats = model.info, model.kv_stats()
    local = model.weights.local_layers(512)
    assert len(local) == {"qwen3": 0, "gemma3": 3, "phi3-window": 2}[name]
    assert (stats.bits_per_element < 16) == (len(local) < info.n_layer)
    fp = model.kv_footprint(400)
    assert fp.bytes["local"] == len(local) * info.n_head_kv * 400 * 2 * 2 * info.n_embd_head  # ring of 512 rows
    assert fp.total_bytes * 0.98 <= stats.bytes_used <= fp.total_bytes  # the formula bounds the extra pool


def test_gemma3_layer_kinds_and_info(ggufs, capsys):
    from ott_gguf.cli import main

    weights = Weights(ggufs[0]["gemma3"])
    assert weights.layer_windows == [16, 16, 0, 16] and weights.info.n_swa == 16
    assert weights.local_layers(128) == {0, 1, 3} and weights.local_layers(16) == set()
    assert main(["info", str(ggufs[0]["gemma3"]), "-c", "128", "--kv", "ott2"]) == 0
    out = capsys.readouterr().out
    assert "3 local (sliding window of 16 tokens, fp16 ring), 1 global (2)" in out
    assert "ott2 on the 1 global layers, an fp16 ring of 128 tokens on the 3 local" in out


@pytest.mark.parametrize(
    "name, messages, expected",
    [
        (
            "gemma3",
            [{"role": "user", "content": "hi"}],
            "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
        ),
        ("phi3", [{"role": "user", "content": "hi"}], "<|user|>\nhi<|end|>\n<|assistant|>\n"),
        ("qwen3", [{"role": "user", "content": "hi"}], "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
    ],
)
def test_chat_templates_render(ggufs, name, messages, expected):
    weights = Weights(ggufs[0][name])
    assert weights.chat_template.render(messages, add_generation_prompt=True) == expected


def test_global_layers_rank_key_tiers_by_their_own_query_scale(ggufs):
    """Gemma 3's one global layer (2 of 4) keeps its quantized stores in a cache of its own
    layers only: its key tiers must rank channels by layer 2's query scale, not by the scale of
    the model's first layer. Tokens go in one at a time, each read back from the window before
    an event quantizes it, into a reference cache of that layer; its blocks match bit for bit."""
    from ott_gguf.reference import LayerCache
    from test_kv_native import block_arrays

    cfg = PRESETS["ottr2t"].with_overrides(block=16, group_k=16, window=4, rot_v=0, skip_layers=0)
    model = Model(ggufs[0]["gemma3"], n_ctx=128, n_ubatch=8, n_threads=2, kv=cfg, device="cpu")
    info, il = model.info, 2
    assert model.weights.local_layers(128) == {0, 1, 3}
    u = model.weights.tier_scale()
    assert not np.allclose(u[il], u[0])
    ref = LayerCache.new(cfg, il, info.n_head_kv, info.n_embd_head, tier_scale=u[il])
    for tok in model.tokenize(PROMPT)[:N_PROMPT]:
        model.eval([tok])
        states = [model.kv_head_state(il, 0, h) for h in range(info.n_head_kv)]
        k = np.stack([st.window_k[-1] for st in states])[None]  # [1, n_head_kv, head_dim]
        v = np.stack([st.window_v[-1] for st in states])[None]
        ref.append(k, v)
    for h, head in enumerate(ref.heads):
        st = model.kv_head_state(il, 0, h)
        assert len(st.blocks) == len(head.blocks) >= 3
        for j, rb in enumerate(head.blocks):
            for name, arr in block_arrays(st.blocks[j], st.block_offsets, rb).items():
                assert (arr.view(np.uint8) == getattr(rb, name).view(np.uint8)).all(), f"head {h} block {j} {name}"


def test_ring_cannot_truncate_into_dropped_positions(ggufs):
    """Local layers keep the last n_swa - 1 + n_ubatch positions: truncating further back than
    the ring holds fails and leaves the sequence as it was; clearing always works."""
    model = Model(ggufs[0]["gemma3"], n_ctx=128, n_ubatch=8, n_threads=2, device="cpu")
    ids = model.tokenize(PROMPT)[:N_PROMPT]
    for i in range(0, N_PROMPT, 8):
        model.eval(ids[i : i + 8])
    with pytest.raises(UnsupportedError, match="sliding-window cache no longer holds"):
        model.truncate(0, 30)
    assert model.seq_len(0) == N_PROMPT
    model.truncate(0, N_PROMPT - 4)  # within the ring
    assert model.seq_len(0) == N_PROMPT - 4
    model.truncate(0, 0)
    assert model.seq_len(0) == 0


@pytest.mark.parametrize(
    "name, keys, drop, words",
    [
        (
            "gemma3",
            {"gemma3.attention.sliding_window_pattern": ([True, False], GGUFValueType.ARRAY, GGUFValueType.BOOL)},
            (),
            "'gemma3.attention.sliding_window_pattern' must be an array of 4 booleans",
        ),
        ("gemma3", {}, ("blk.1.attn_q_norm.weight",), "tensor 'blk.1.attn_q_norm.weight' is missing"),
        (
            "gemma3",
            {"gemma3.rope.scaling.type": ("longrope", GGUFValueType.STRING, None)},
            (),
            "rope scaling type 'longrope' is not supported",
        ),
        ("phi3", {}, ("rope_factors_short.weight",), "tensor 'rope_factors_short.weight' is missing"),
    ],
)
def test_unsupported_file_is_one_error_naming_it(ggufs, tmp_path, name, keys, drop, words):
    bad = write_copy(ggufs[0][name], tmp_path / "bad.gguf", keys=keys, drop=drop)
    with pytest.raises((ModelFileError, UnsupportedError)) as e:
        Weights(bad)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "name, change, error, words",
    [
        ("gemma3", {"query_pre_attn_scalar": 256}, UnsupportedError, "query_pre_attn_scalar = 256 is not supported"),
        ("gemma3", {"hidden_activation": "gelu"}, UnsupportedError, "hidden_activation 'gelu' is not supported"),
        (
            "phi3",
            {"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}},
            ModelFileError,
            "expected 4 (half the rotated dimensions)",
        ),
    ],
)
def test_converter_refuses_what_gguf_cannot_say(ggufs, tmp_path, name, change, error, words):
    directory = ggufs[1] / name
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    try:
        with pytest.raises(error, match=re.escape(words)):
            convert.convert(str(directory), tmp_path / "out.gguf")
    finally:
        (directory / "config.json").write_text(json.dumps(config))
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.slow
def test_gemma3_270m_wikitext2_perplexity_matches_llamacpp(gemma3_path, wikitext_path, llamacpp_perplexity):
    """Gemma 3 270M Q4_K_M at 2048 tokens (local layers' window 512: the ring wraps) against
    llama.cpp's (tests/data/perplexity.json): within 1 %."""
    ref_ppl, _ = llamacpp_perplexity["Gemma-3-270M Q4_K_M", 2048, 5]
    model = Model(gemma3_path, n_ctx=2048, n_threads=2, device="cpu")
    result = perplexity(model, wikitext_path.read_text(encoding="utf-8"), 2048, n_chunks=5, progress=False)
    assert abs(result.ppl / ref_ppl - 1) < 0.01, (result.ppl, ref_ppl)
