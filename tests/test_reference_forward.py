"""The numpy reference forward pass on real models, and the random GGUF writer it is used with."""

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from make_gguf import write_random_model
from reference_forward import ReferenceModel

# Whole-word tokens of both vocabularies (Ġ = leading space); "The", " of" and " is" match llama.cpp's
# ids for SmolLM2 in tests/data/tokenizer/smollm2.json (504, 282, 314).
PROMPT = ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]


def predicts_paris(model: ReferenceModel) -> None:
    ids = [model.tokens.index(t) for t in PROMPT]
    logits = model.forward(ids)
    assert logits.shape == (len(ids), len(model.tokens))
    top = np.argsort(-logits[-1])[:5]
    assert model.tokens[top[0]] == "ĠParis", f"top-5 after the prompt: {[model.tokens[i] for i in top]}"


def test_smollm2_capital_of_france(smollm2_path):
    # llama arch: GQA (9 heads, 3 kv heads), adjacent-pair rope, tied output (no output.weight in the file)
    model = ReferenceModel(smollm2_path)
    assert model.arch == "llama" and (model.n_head, model.n_head_kv) == (9, 3)
    assert model.w["output.weight"] is model.w["token_embd.weight"]
    predicts_paris(model)


@pytest.mark.slow
def test_qwen25_capital_of_france(qwen05_path):
    # qwen2 arch: Q/K/V biases, half-split rope, 14 heads on 2 kv heads; about half a minute on two cores
    model = ReferenceModel(qwen05_path)
    assert model.arch == "qwen2" and "blk.0.attn_q.bias" in model.w
    predicts_paris(model)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype,qtype", [("f32", Q.F32), ("f16", Q.F16), ("q8_0", Q.Q8_0)])
def test_random_model_reads_back(tmp_path, arch, dtype, qtype):
    path = write_random_model(tmp_path / "m.gguf", arch=arch, n_layer=2, dtype=dtype)
    reader = gguf.GGUFReader(path)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == arch
    assert (
        field(f"{arch}.block_count"),
        field(f"{arch}.embedding_length"),
        field(f"{arch}.feed_forward_length"),
        field(f"{arch}.attention.head_count"),
        field(f"{arch}.attention.head_count_kv"),
    ) == (2, 64, 128, 4, 2)
    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "qwen2"
    tokens = field("tokenizer.ggml.tokens")
    assert tokens[ord("a")] == "a" and tokens[ord(" ")] == "Ġ" and "Ġthe" in tokens
    assert tokens[field("tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert "<|im_start|>" in field("tokenizer.chat_template")

    tensors = {t.name: t for t in reader.tensors}
    assert list(tensors["token_embd.weight"].shape) == [64, len(tokens)]  # ggml ne order
    assert tensors["blk.1.attn_k.weight"].tensor_type == qtype and list(tensors["blk.1.attn_k.weight"].shape) == [
        64,
        32,
    ]
    assert tensors["blk.0.ffn_norm.weight"].tensor_type == Q.F32
    assert ("blk.0.attn_q.bias" in tensors) == (arch == "qwen2")
    assert "output.weight" in tensors

    model = ReferenceModel(path)
    ids = [tokens.index(t) for t in ["<|im_start|>", "u", "s", "er", "Ċ", "h", "i"]]
    logits = model.forward(ids)
    assert logits.shape == (len(ids), len(tokens)) and np.isfinite(logits).all()
    assert logits[-1].std() > 0.5  # not a near-uniform distribution
    # causal: a prefix gets the same logits whatever follows it
    np.testing.assert_allclose(model.forward(ids[:3]), logits[:3], rtol=1e-4, atol=1e-4)


def test_quantized_weights_track_f32(tmp_path):
    ids = [1, 2, 3, 40, 50, 60, 70]
    ref = ReferenceModel(write_random_model(tmp_path / "f32.gguf", dtype="f32", seed=3)).forward(ids)
    # rms logit error relative to the logit spread; q8_0 alone loses ~0.5% per matrix, compounded over the 16 matrices
    for dtype, budget in [("f16", 0.005), ("q8_0", 0.06)]:
        logits = ReferenceModel(write_random_model(tmp_path / f"{dtype}.gguf", dtype=dtype, seed=3)).forward(ids)
        rel_rms = np.sqrt(np.mean((logits - ref) ** 2)) / ref.std()
        assert 1e-5 < rel_rms < budget, f"{dtype}: relative rms error {rel_rms:.4f}"


def test_tied_output_and_padded_vocab(tmp_path):
    path = write_random_model(tmp_path / "tied.gguf", arch="llama", tied_output=True, n_vocab=320)
    model = ReferenceModel(path)
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(path).tensors}
    assert len(model.tokens) == 320 and model.tokens[-1] == "[PAD319]"
    logits = model.forward([5, 6, 7])
    assert logits.shape == (3, 320)
    with pytest.raises(ValueError, match="smaller than"):
        write_random_model(tmp_path / "small.gguf", n_vocab=100)


def test_normal_rope_on_permuted_weights_equals_neox(tmp_path):
    # The llama converter interleaves the two halves of each Q/K head (row i -> 2i, row half+i -> 2i+1) so that
    # adjacent-pair rope on the permuted rows equals half-split rope on the original rows.
    normal = ReferenceModel(write_random_model(tmp_path / "llama.gguf", arch="llama", seed=5, dtype="f32"))
    neox = ReferenceModel(tmp_path / "llama.gguf")
    neox.neox = True
    d = normal.n_embd_head
    for il in range(normal.n_layer):
        for name, heads in [("attn_q", normal.n_head), ("attn_k", normal.n_head_kv)]:
            w = normal.w[f"blk.{il}.{name}.weight"]  # [heads * d, n_embd], interleaved
            neox.w[f"blk.{il}.{name}.weight"] = w.reshape(heads, d // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
    ids = [10, 20, 30, 40, 50, 60]
    np.testing.assert_allclose(neox.forward(ids), normal.forward(ids), rtol=1e-4, atol=1e-4)
    neox.neox = False  # the un-interleaved rows with the wrong pairing give different logits
    assert np.abs(neox.forward(ids) - normal.forward(ids)).max() > 1e-2
