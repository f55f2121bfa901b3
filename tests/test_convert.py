"""The Hugging Face -> GGUF converter: round trip of the real SmolLM2, tiny random Qwen2 and
llama checkpoints, the Hub path (offline cache), and bad inputs."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, TokenType
from gguf.quants import dequantize

import convert
from convert_checkpoints import (
    QWEN2_SPLIT,
    SMOLLM2_PRE_TOKENIZER,
    TINY,
    TINY_SPM_PIECES,
    smollm2_checkpoint,
    tiny_llama_checkpoint,
    tiny_qwen2_checkpoint,
    unpermute_rope_rows,
    write_json,
)
from ott_gguf.errors import InvalidArgumentError, ModelFileError, UnsupportedError

REPO = Path(__file__).resolve().parent.parent
# "The capital of France is Paris. The capital of Germany is" in SmolLM2's vocabulary
PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 5498, 314]


def metadata(reader: GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def tensors_f32(reader: GGUFReader) -> dict[str, np.ndarray]:
    return {
        t.name: dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist()))) for t in reader.tensors
    }


def no_output_left(out: Path) -> bool:
    return not out.exists() and not out.with_name(out.name + ".tmp").exists()


# ---- (a) SmolLM2 round trip -------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol_hf(smollm2_path, tmp_path_factory):
    directory = tmp_path_factory.mktemp("smollm2-hf")
    expected = smollm2_checkpoint(smollm2_path, directory)
    return directory, expected


@pytest.fixture(scope="module")
def smol_f32(smol_hf, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-gguf") / "smollm2-f32.gguf"
    assert convert.main([str(smol_hf[0]), str(out), "--outtype", "f32"]) == 0
    return out


def test_smollm2_round_trip_tensors_equal_dequantized_original(smol_hf, smol_f32):
    _, expected = smol_hf
    reader = GGUFReader(smol_f32)
    assert sorted(t.name for t in reader.tensors) == sorted(expected)
    for t in reader.tensors:
        assert t.tensor_type == Q.F32, t.name
        np.testing.assert_array_equal(t.data, expected[t.name], err_msg=t.name)


def test_smollm2_round_trip_metadata_equal(smollm2_path, smol_f32):
    original, ours = metadata(GGUFReader(smollm2_path)), metadata(GGUFReader(smol_f32))
    keys = [k for k in original if k.startswith("llama.")] + [
        "general.architecture",
        "general.quantization_version",
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.padding_token_id",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_space_prefix",
        "tokenizer.chat_template",
    ]
    assert len(keys) > 20
    for key in keys:
        assert ours.get(key) == original[key], key
    assert ours["tokenizer.ggml.pre"] == "smollm"
    assert ours["general.file_type"] == 0  # ALL_F32
    assert ours["general.size_label"] == "135M"


def test_smollm2_round_trip_runtime_logits(smollm2_path, smol_f32):
    """The converted F32 file in our runtime computes the original model: its logits match the
    float reference forward pass of the same weights to F32/F16-KV rounding, the original's
    tokenizer ids are reproduced, and greedy choices agree with the original Q4_1 file."""
    from ott_gguf.model import Model
    from reference_forward import ReferenceModel

    converted = Model(smol_f32, n_ctx=256, n_threads=2, device="cpu")
    original = Model(smollm2_path, n_ctx=256, n_threads=2, device="cpu")
    text = "The capital of France is Paris. 12345 apples cost $3.50, don't they?\n<|im_start|>user"
    assert converted.tokenize(text, parse_special=True) == original.tokenize(text, parse_special=True)

    ours = converted.eval(PROMPT, all_logits=True)  # [n_tokens, n_vocab]
    ref = ReferenceModel(smol_f32).forward(PROMPT)
    rel = np.linalg.norm(ours - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert rel.max() < 5e-3, rel
    assert (ours.argmax(-1) == original.eval(PROMPT, all_logits=True).argmax(-1)).all()


# ---- (b) tiny random Qwen2: sharded BF16 safetensors, tokenizer.json ---------------------------


@pytest.fixture(scope="module")
def qwen2_hf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-hf")
    return directory, tiny_qwen2_checkpoint(directory, np.random.default_rng(0))


@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
def test_qwen2_tensors(qwen2_hf, tmp_path, outtype):
    directory, hf = qwen2_hf
    out = tmp_path / f"qwen2-{outtype}.gguf"
    convert.convert(str(directory), out, outtype=outtype)
    reader = GGUFReader(out)
    got = tensors_f32(reader)
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert len(got) == 3 + 12 * TINY["n_layer"]

    weight_type = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[outtype]
    for name, src in [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight"),
        ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight"),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
    ]:
        assert types[name] == weight_type, name
        want = hf[src]  # qwen2: no row permutation
        if outtype == "q8_0":
            # per 32-block scale d = amax/127, stored in F16: error <= d/2 + 127 * |d - f16(d)| < 0.57 d
            amax = np.abs(want.reshape(-1, 32)).max(-1).repeat(32).reshape(want.shape)
            assert (np.abs(got[name] - want) <= amax / 127 * 0.57).all(), name
        elif outtype == "f16":
            np.testing.assert_array_equal(got[name], want.astype(np.float16).astype(np.float32), err_msg=name)
        else:  # F32 and BF16 hold BF16 source values exactly
            np.testing.assert_array_equal(got[name], want, err_msg=name)
    for name, src in [
        ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias"),
        ("blk.1.attn_v.bias", "model.layers.1.self_attn.v_proj.bias"),
        ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ]:
        assert types[name] == Q.F32, name  # 1-D tensors stay F32
        np.testing.assert_array_equal(got[name], hf[src], err_msg=name)
    assert metadata(reader)["general.file_type"] == {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[outtype]


def test_qwen2_metadata_and_vocab(qwen2_hf, tmp_path):
    directory, _ = qwen2_hf
    out = tmp_path / "qwen2.gguf"
    convert.convert(str(directory), out, outtype="f16")
    meta = metadata(GGUFReader(out))
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    config = json.loads((directory / "config.json").read_text())

    assert meta["general.architecture"] == "qwen2"
    assert {k: v for k, v in meta.items() if k.startswith("qwen2.")} == pytest.approx(
        {
            "qwen2.block_count": 2,
            "qwen2.context_length": 4096,
            "qwen2.embedding_length": 64,
            "qwen2.feed_forward_length": 96,
            "qwen2.attention.head_count": 4,
            "qwen2.attention.head_count_kv": 2,
            "qwen2.rope.freq_base": 1e6,
            "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
        }
    )

    tokens = meta["tokenizer.ggml.tokens"]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "qwen2"
    assert len(tokens) == config["vocab_size"] == 288
    for text, tid in tokenizer["model"]["vocab"].items():
        assert tokens[tid] == text and meta["tokenizer.ggml.token_type"][tid] == TokenType.NORMAL
    for added in tokenizer["added_tokens"]:
        assert tokens[added["id"]] == added["content"]
        assert meta["tokenizer.ggml.token_type"][added["id"]] == TokenType.CONTROL
    assert tokens[287] == "[PAD287]" and meta["tokenizer.ggml.token_type"][287] == TokenType.UNUSED
    assert meta["tokenizer.ggml.merges"] == [" ".join(m) for m in tokenizer["model"]["merges"]]
    assert meta["tokenizer.ggml.eos_token_id"] == tokens.index("<|im_end|>")
    assert meta["tokenizer.ggml.padding_token_id"] == tokens.index("<|endoftext|>")
    assert meta["tokenizer.ggml.bos_token_id"] == config["bos_token_id"]  # from config.json: no bos_token
    assert meta["tokenizer.ggml.add_bos_token"] is False  # ByteLevel post-processor
    assert "tokenizer.ggml.add_space_prefix" not in meta  # llama family only
    assert meta["tokenizer.chat_template"].startswith("{% for m in messages %}")
    assert meta["general.sampling.temp"] == pytest.approx(0.7)
    assert meta["general.sampling.top_k"] == 20
    assert meta["general.sampling.top_p"] == pytest.approx(0.8)
    assert meta["general.sampling.penalty_repeat"] == pytest.approx(1.05)


# ---- the pre-tokenizer table ---------------------------------------------------------------------

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def split_then_bytes(regex: str) -> dict:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        ],
    }


@pytest.mark.parametrize(
    "pre_tokenizer, clean_up, name",
    [
        ({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}, True, "gpt-2"),
        (SMOLLM2_PRE_TOKENIZER, False, "smollm"),
        (SMOLLM2_PRE_TOKENIZER, True, "starcoder"),
        (split_then_bytes(LLAMA3_SPLIT), True, "llama-bpe"),
        (split_then_bytes(LLAMA3_SPLIT), None, "llama-bpe"),
        (split_then_bytes(QWEN2_SPLIT), False, "qwen2"),
        (split_then_bytes(QWEN2_SPLIT), True, "stablelm2"),
    ],
)
def test_pre_tokenizer_names(pre_tokenizer, clean_up, name):
    from convert.pretokenizer import pre_tokenizer_name

    assert pre_tokenizer_name({"pre_tokenizer": pre_tokenizer}, clean_up, Path("tokenizer.json")) == name


# ---- tiny llama: SentencePiece tokenizer.model, Llama 3 / linear rope scaling, tied output ------

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_llama_spm_vocab_permutation_and_llama3_rope(tmp_path):
    directory = tmp_path / "llama-hf"
    hf = tiny_llama_checkpoint(directory, np.random.default_rng(1), LLAMA3_ROPE)
    out = tmp_path / "llama.gguf"
    convert.convert(str(directory), out, outtype="f32")
    reader = GGUFReader(out)
    got, meta = tensors_f32(reader), metadata(reader)

    # Q/K rows permuted for GGML's rope, everything else as is; tied output and inv_freq not written
    n_head, n_head_kv = TINY["n_head"], TINY["n_head_kv"]
    np.testing.assert_array_equal(
        unpermute_rope_rows(got["blk.0.attn_q.weight"], n_head), hf["model.layers.0.self_attn.q_proj.weight"]
    )
    np.testing.assert_array_equal(
        unpermute_rope_rows(got["blk.1.attn_k.weight"], n_head_kv), hf["model.layers.1.self_attn.k_proj.weight"]
    )
    assert not np.array_equal(got["blk.0.attn_q.weight"], hf["model.layers.0.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(got["blk.1.attn_v.weight"], hf["model.layers.1.self_attn.v_proj.weight"])
    assert "output.weight" not in got and not any("rot" in name for name in got)

    # rope_freqs: Llama 3.1's divisors, computed here in float64 from the published formula
    rope = LLAMA3_ROPE
    dim = TINY["n_embd"] // n_head
    wavelen = 2 * math.pi * 500000.0 ** (np.arange(0, dim, 2) / dim)
    low_wl = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wl = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
        rope["high_freq_factor"] - rope["low_freq_factor"]
    )
    want = np.where(
        wavelen < high_wl, 1.0, np.where(wavelen > low_wl, rope["factor"], 1 / ((1 - smooth) / rope["factor"] + smooth))
    )
    assert want.min() == 1.0 and want.max() == rope["factor"] and ((want > 1) & (want < 8)).any()  # all 3 regimes
    np.testing.assert_allclose(got["rope_freqs.weight"], want, rtol=1e-6)
    assert meta["llama.rope.dimension_count"] == dim and meta["llama.vocab_size"] == len(TINY_SPM_PIECES) + 1

    # SentencePiece vocabulary: pieces, scores and types, the added token as CONTROL
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.pre"] == "default"
    tokens, scores, types = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    for i, (text, score, kind) in enumerate(TINY_SPM_PIECES):
        assert tokens[i] == text and scores[i] == score
        assert types[i] == (TokenType.NORMAL if kind == 4 else kind)  # USER_DEFINED pieces -> NORMAL, as llama.cpp
    assert tokens[-1] == "<|user|>" and types[-1] == TokenType.CONTROL and scores[-1] == -1000.0
    assert (
        meta["tokenizer.ggml.bos_token_id"],
        meta["tokenizer.ggml.eos_token_id"],
        meta["tokenizer.ggml.unknown_token_id"],
    ) == (1, 2, 0)
    assert meta["tokenizer.ggml.add_bos_token"] is True and meta["tokenizer.ggml.add_eos_token"] is False
    assert meta["tokenizer.ggml.add_space_prefix"] is True


def test_llama_linear_rope_scaling_keys(tmp_path):
    directory = tmp_path / "llama-hf"
    tiny_llama_checkpoint(directory, np.random.default_rng(2), {"type": "linear", "factor": 4.0})
    out = tmp_path / "llama.gguf"
    convert.convert(str(directory), out, outtype="q8_0")
    reader = GGUFReader(out)
    meta = metadata(reader)
    assert meta["llama.rope.scaling.type"] == "linear" and meta["llama.rope.scaling.factor"] == 4.0
    assert "rope_freqs.weight" not in {t.name for t in reader.tensors}
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_up.weight"] == Q.Q8_0 and types["blk.0.ffn_norm.weight"] == Q.F32


def test_pytorch_bin_checkpoint_equals_safetensors(tmp_path):
    """pytorch_model.bin (BF16, read by torch with weights_only) converts to the same file content."""
    import torch

    st_dir = tmp_path / "st"
    hf = tiny_llama_checkpoint(st_dir, np.random.default_rng(3), None)
    bin_dir = tmp_path / "bin"
    shutil.copytree(st_dir, bin_dir)
    (bin_dir / "model.safetensors").unlink()
    torch.save({n: torch.from_numpy(a).to(torch.bfloat16) for n, a in hf.items()}, bin_dir / "pytorch_model.bin")
    outs = []
    for d in (st_dir, bin_dir):
        outs.append(tmp_path / f"{d.name}.gguf")
        convert.convert(str(d), outs[-1], outtype="f32")
    a, b = tensors_f32(GGUFReader(outs[0])), tensors_f32(GGUFReader(outs[1]))
    assert a.keys() == b.keys()
    for name in a:
        bf16 = torch.from_numpy(np.array(a[name])).to(torch.bfloat16).float().numpy()
        np.testing.assert_array_equal(b[name], bf16, err_msg=name)


# ---- (c) the Hub path, offline, through the command line ---------------------------------------


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "convert", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=REPO,
        timeout=300,
    )


def test_hub_repo_id_from_offline_cache(qwen2_hf, tmp_path):
    directory, hf = qwen2_hf
    cache = tmp_path / "hf-home" / "hub"
    repo = cache / "models--tiny-org--tiny-qwen2"
    sha = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(directory, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(cache)}

    out = tmp_path / "from-hub.gguf"
    proc = run_cli(["tiny-org/tiny-qwen2", str(out), "--outtype", "f32"], env)
    assert proc.returncode == 0, proc.stderr
    reader = GGUFReader(out)
    assert metadata(reader)["general.name"] == "tiny-qwen2"
    np.testing.assert_array_equal(
        tensors_f32(reader)["blk.0.ffn_gate.weight"], hf["model.layers.0.mlp.gate_proj.weight"]
    )

    missing = tmp_path / "missing.gguf"
    proc = run_cli(["tiny-org/not-cached", str(missing)], env)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert "tiny-org/not-cached" in lines[-1] and "HF_HUB_OFFLINE=1" in lines[-1], proc.stderr
    assert no_output_left(missing)


# ---- (d) bad inputs: one clear error, no output file --------------------------------------------


def _no_config(d: Path) -> None:
    (d / "config.json").unlink()


def _unknown_architecture(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    write_json(d / "config.json", config | {"architectures": ["GPTNeoXForCausalLM"]})


def _truncated_safetensors(d: Path) -> None:
    shard = d / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])


def _shape_mismatch(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    write_json(d / "config.json", config | {"intermediate_size": 128})


def _unsupported_rope_scaling(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    write_json(d / "config.json", config | {"rope_scaling": {"type": "dynamic", "factor": 2.0}})


def _unknown_pre_tokenizer(d: Path) -> None:
    tokenizer = json.loads((d / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\w+"
    write_json(d / "tokenizer.json", tokenizer)


def _missing_tensor(d: Path) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    config = json.loads((d / "config.json").read_text())
    write_json(d / "config.json", config | {"num_hidden_layers": 3})
    assert "model.layers.2.mlp.up_proj.weight" not in index["weight_map"]


def _config_with(**fields):
    def break_it(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        write_json(d / "config.json", config | fields)

    break_it.__name__ = "_config_" + "_".join(f"{k}_{v}" for k, v in fields.items()).replace(" ", "")
    return break_it


def _config_not_utf8(d: Path) -> None:
    (d / "config.json").write_bytes((d / "config.json").read_bytes().replace(b'"hidden_size"', b'"hidden_\xff"'))


def _config_nan_rope_theta(d: Path) -> None:  # Python's json reads NaN; a GGUF must not get it
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(re.sub(r'"rope_theta": [0-9.e+]+', '"rope_theta": NaN', text))


def _tokenizer_json_list(d: Path) -> None:
    write_json(d / "tokenizer.json", [1, 2, 3])


def _tokenizer_vocab_list(d: Path) -> None:
    tokenizer = json.loads((d / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"] = list(tokenizer["model"]["vocab"])
    write_json(d / "tokenizer.json", tokenizer)


def _added_token_without_id(d: Path) -> None:
    tokenizer = json.loads((d / "tokenizer.json").read_text())
    del tokenizer["added_tokens"][0]["id"]
    write_json(d / "tokenizer.json", tokenizer)


@pytest.mark.parametrize(
    "break_it, error, words",
    [
        (_config_with(num_hidden_layers=10**9), ModelFileError, ["num_hidden_layers", "[1, 1024]"]),
        (_config_with(num_hidden_layers="2"), ModelFileError, ["num_hidden_layers", "'2'"]),
        (_config_with(hidden_size=64.0), ModelFileError, ["hidden_size", "64.0"]),
        (_config_with(num_attention_heads=0), ModelFileError, ["num_attention_heads", "0"]),
        (_config_with(num_key_value_heads=0), ModelFileError, ["num_key_value_heads", "0"]),
        (_config_with(num_key_value_heads=3), ModelFileError, ["not a multiple of num_key_value_heads 3"]),
        (_config_with(vocab_size=None), ModelFileError, ["missing 'vocab_size'"]),
        (_config_with(rms_norm_eps=-1e-6), ModelFileError, ["rms_norm_eps"]),
        (_config_with(rope_theta="big"), ModelFileError, ["rope_theta"]),
        (_config_with(rope_scaling=[1, 2]), ModelFileError, ["rope_scaling"]),
        (_config_with(tie_word_embeddings="yes"), ModelFileError, ["tie_word_embeddings"]),
        (_config_with(architectures=[7]), ModelFileError, ["architectures"]),
        (_config_not_utf8, ModelFileError, ["config.json", "not UTF-8"]),
        (_config_nan_rope_theta, ModelFileError, ["rope_theta", "nan"]),
        (_tokenizer_json_list, ModelFileError, ["tokenizer.json", "JSON object"]),
        (_tokenizer_vocab_list, ModelFileError, ["tokenizer.json", "model.vocab"]),
        (_added_token_without_id, ModelFileError, ["tokenizer.json", "added_tokens[0]", "'id'"]),
        (_no_config, ModelFileError, ["no config.json"]),
        (
            _unknown_architecture,
            UnsupportedError,
            ["GPTNeoXForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"],
        ),
        (_truncated_safetensors, ModelFileError, ["model-00002-of-00002.safetensors", "truncated"]),
        (_shape_mismatch, ModelFileError, ["mlp.", "[96, 64]", "config.json implies"]),
        (_unsupported_rope_scaling, UnsupportedError, ["config.json", "rope scaling 'dynamic'", "linear"]),
        (_unknown_pre_tokenizer, UnsupportedError, ["tokenizer.json", "unknown pre-tokenizer"]),
        (_missing_tensor, ModelFileError, ["blk.2.", "lacks"]),
    ],
    ids=lambda v: v.__name__.strip("_")[:40] if callable(v) else None,
)
def test_bad_input_raises_one_clear_error(qwen2_hf, tmp_path, break_it, error, words):
    directory = tmp_path / "broken"
    shutil.copytree(qwen2_hf[0], directory)
    break_it(directory)
    out = tmp_path / "out.gguf"
    with pytest.raises(error) as info:
        convert.main([str(directory), str(out)])
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message
    assert no_output_left(out)


def test_failure_while_writing_removes_partial_file(qwen2_hf, tmp_path, monkeypatch):
    """A tensor that turns out unreadable after the header is written (file shrunk between
    planning and reading) leaves neither OUT nor OUT.tmp behind."""
    directory = tmp_path / "shrinking"
    shutil.copytree(qwen2_hf[0], directory)
    out = tmp_path / "out.gguf"
    real_open = convert.converter.open_checkpoint

    def open_then_truncate(d):
        refs = real_open(d)
        shard = d / "model-00002-of-00002.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])
        return refs

    monkeypatch.setattr(convert.converter, "open_checkpoint", open_then_truncate)
    with pytest.raises(ModelFileError, match="truncated while reading"):
        convert.convert(str(directory), out)
    assert no_output_left(out)


def test_bad_arguments(qwen2_hf, tmp_path):
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        convert.convert(str(qwen2_hf[0]), tmp_path / "no-such-dir" / "out.gguf")
    with pytest.raises(ModelFileError, match="no such directory"):
        convert.convert(str(tmp_path / "nothing-here"), tmp_path / "out.gguf")
    with pytest.raises(SystemExit):
        convert.main([str(qwen2_hf[0]), str(tmp_path / "out.gguf"), "--outtype", "q4_0"])
