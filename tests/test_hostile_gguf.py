"""Hostile GGUF metadata: values that pass a naive parse but would abort ggml, compute NaN,
read past what the tokenizer or template expect, or cost time or memory out of proportion to
the file. Each must be refused with one line naming the key, or run within a stated bound."""

import math
import struct
import time

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from make_gguf import write_copy, write_random_model
from ott_gguf import Model
from ott_gguf.chat import MAX_RENDER_CHARS
from ott_gguf.errors import BackendError, ModelFileError, OttError, UnsupportedError
from ott_gguf.model import Weights

F32, U32, I32, STR, ARR, BOOL = (
    GGUFValueType.FLOAT32,
    GGUFValueType.UINT32,
    GGUFValueType.INT32,
    GGUFValueType.STRING,
    GGUFValueType.ARRAY,
    GGUFValueType.BOOL,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny llama (head size 16, 2 layers, F32 weights) every case starts from."""
    return write_random_model(tmp_path_factory.mktemp("hostile") / "base.gguf", arch="llama", dtype="f32")


def _load_error(path) -> OttError:
    with pytest.raises(OttError) as info:
        Weights(path)
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize(
    "keys, words",
    [
        ({"llama.rope.dimension_count": (15, U32, None)}, ["rope.dimension_count 15 is odd"]),
        ({"llama.attention.layer_norm_rms_epsilon": (-1e-5, F32, None)}, ["layer_norm_rms_epsilon", "-1e-05"]),
        ({"llama.attention.layer_norm_rms_epsilon": (math.nan, F32, None)}, ["layer_norm_rms_epsilon", "nan"]),
        ({"llama.attention.layer_norm_rms_epsilon": (math.inf, F32, None)}, ["layer_norm_rms_epsilon", "inf"]),
        ({"llama.attention.layer_norm_rms_epsilon": (0.0, F32, None)}, ["layer_norm_rms_epsilon", "= 0"]),
        ({"llama.attention.layer_norm_rms_epsilon": ("small", STR, None)}, ["layer_norm_rms_epsilon", "not a number"]),
        ({"llama.rope.freq_base": (math.nan, F32, None)}, ["rope.freq_base", "nan"]),
        ({"llama.rope.freq_base": (0.0, F32, None)}, ["rope.freq_base", "= 0"]),
        ({"llama.rope.freq_base": (-10000.0, F32, None)}, ["rope.freq_base", "-10000"]),
        ({"llama.rope.freq_base": (math.inf, F32, None)}, ["rope.freq_base", "inf"]),
        (
            {"llama.rope.scaling.type": ("linear", STR, None), "llama.rope.scaling.factor": (math.nan, F32, None)},
            ["rope.scaling.factor", "nan"],
        ),
        (
            {"llama.attention.head_count": (6, U32, None), "llama.attention.head_count_kv": (3, U32, None)},
            ["embedding_length 64 is not a multiple of head_count 6"],
        ),
        ({"llama.context_length": (1 << 30, U32, None)}, ["context_length", "out of range"]),
        ({"tokenizer.ggml.tokens": ([1, 2, 3], ARR, I32)}, ["tokenizer.ggml.tokens", "array of strings"]),
        ({"tokenizer.ggml.merges": ([1, 2], ARR, I32)}, ["tokenizer.ggml.merges", "array of strings"]),
        ({"tokenizer.ggml.token_type": (["a"], ARR, STR)}, ["tokenizer.ggml.token_type", "array of integers"]),
        ({"tokenizer.ggml.bos_token_id": ("1", STR, None)}, ["tokenizer.ggml.bos_token_id", "an integer"]),
        ({"tokenizer.ggml.add_bos_token": ("yes", STR, None)}, ["tokenizer.ggml.add_bos_token", "a boolean"]),
        ({"tokenizer.ggml.model": (2, U32, None)}, ["tokenizer.ggml.model", "a string"]),
        ({"tokenizer.ggml.pre": (["qwen2"], ARR, STR)}, ["tokenizer.ggml.pre", "a string"]),
        ({"tokenizer.chat_template": (7, U32, None)}, ["chat template must be a string"]),
        ({"tokenizer.chat_template": ("{% for %}", STR, None)}, ["chat template does not compile"]),
    ],
    ids=lambda v: (
        "-".join(f"{k.split('.', 1)[1]}={str(x[0])[:12]}" for k, x in v.items()) if isinstance(v, dict) else None
    ),
)
def test_bad_metadata_is_one_line_naming_it(base, tmp_path, keys, words):
    message = str(_load_error(write_copy(base, tmp_path / "bad.gguf", keys=keys)))
    for word in words:
        assert word in message, message


def test_scores_of_the_wrong_type(base, tmp_path):
    """An SPM vocabulary whose scores are strings (they are read as floats)."""
    n = len(GGUFReader(base).fields["tokenizer.ggml.tokens"].contents())
    keys = {"tokenizer.ggml.model": ("llama", STR, None), "tokenizer.ggml.scores": (["0.5"] * n, ARR, STR)}
    assert "tokenizer.ggml.scores must be an array of numbers" in str(
        _load_error(write_copy(base, tmp_path / "bad.gguf", keys=keys))
    )


def test_byte_token_must_be_hex(base, tmp_path):
    """SentencePiece BYTE tokens are <0xNN>; another text is refused at load, not at decode."""
    types = GGUFReader(base).fields["tokenizer.ggml.token_type"].contents()
    types[5] = 6  # BYTE
    keys = {"tokenizer.ggml.model": ("llama", STR, None), "tokenizer.ggml.token_type": (types, ARR, I32)}
    assert "is a BYTE token but not <0xNN>" in str(_load_error(write_copy(base, tmp_path / "bad.gguf", keys=keys)))


def test_nul_inside_the_architecture(base, tmp_path):
    """ "llama\\0x" would read as "llama" through a C string."""
    message = str(_load_error(write_copy(base, tmp_path / "bad.gguf", arch="llama\0x")))
    assert "general.architecture" in message and "NUL" in message


def _gguf_with_keys(path, n_kv: int, declared: int | None = None):
    """A GGUF v3 file of n_kv uint8 keys and no tensors (declaring `declared` keys)."""
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv if declared is None else declared))
        for i in range(n_kv):
            key = f"k{i:07d}".encode()
            f.write(struct.pack("<Q", len(key)) + key + struct.pack("<IB", 0, 1))
    return path


def test_many_metadata_keys_are_refused_before_parsing(tmp_path):
    """ggml's parser compares each key with all before it: 300k keys took minutes. The header
    walk refuses more than 4096 keys in a small fraction of a second."""
    path = _gguf_with_keys(tmp_path / "keys.gguf", 300_000)
    t0 = time.perf_counter()
    message = str(_load_error(path))
    assert time.perf_counter() - t0 < 2.0
    assert "300000 metadata keys declared, at most 4096" in message


def test_counts_past_the_file_are_refused(tmp_path):
    message = str(_load_error(_gguf_with_keys(tmp_path / "keys.gguf", 3, declared=4000)))
    assert "truncated" in message


def test_template_that_explodes_is_stopped(base, tmp_path):
    keys = {"tokenizer.chat_template": ("{{ 'x' * 1000000000 }}", STR, None)}
    weights = Weights(write_copy(base, tmp_path / "t.gguf", keys=keys))
    t0 = time.perf_counter()
    with pytest.raises(UnsupportedError, match=f"limit {MAX_RENDER_CHARS}"):
        weights.chat_template.render([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - t0 < 1.0


def test_trained_context_of_2_to_the_24_is_capped(base, tmp_path, monkeypatch):
    """No n_ctx: min(trained context, the tokens that fit in a quarter of the memory there is)."""
    path = write_copy(base, tmp_path / "long.gguf", keys={"llama.context_length": (1 << 24, U32, None)})
    monkeypatch.setattr("ott_gguf.model.available_memory", lambda: 1 << 30)
    model = Model(path, n_threads=1)
    # per token: f16 K and V of 2 layers x 2 KV heads x 16, and 512 x (4 heads + 1) F32 scores
    per_token = 2 * 2 * 2 * 16 * 2 + 512 * 5 * 4
    assert model.n_ctx == (1 << 28) // per_token // 256 * 256
    assert model.n_ctx_note.startswith(f"context capped at {model.n_ctx} tokens of the trained 16777216")
    assert Model(path, n_ctx=4096, n_threads=1).n_ctx_note is None


@pytest.mark.parametrize("kv", ["f16", "ottr2"])
def test_nan_weight_names_the_first_layer(base, tmp_path, kv):
    """A NaN in layer 1's FFN: the step fails naming layer 1 and the sequence keeps its length.
    Naming it recomputes the step node by node, our cache's attention ops included (two
    threads: they take the attention items in turn)."""
    path = write_copy(base, tmp_path / "nan.gguf")
    reader = GGUFReader(path, "r+")
    next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight").data[0, 0] = np.nan
    del reader
    model = Model(path, n_ctx=64, n_threads=2, kv=kv)
    with pytest.raises(BackendError, match="layer 1 is the first whose output holds a NaN"):
        model.eval([1, 2, 3])
    assert model.seq_len(0) == 0


def test_too_many_tensors_are_refused(tmp_path):
    path = tmp_path / "tensors.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 0))
    assert "tensors declared, at most 16384" in str(_load_error(path))


def test_unsupported_error_for_nested_arrays(tmp_path):
    path = tmp_path / "nested.gguf"
    key = b"a"
    path.write_bytes(
        b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + key + struct.pack("<IIQ", 9, 9, 1) + bytes(64)
    )
    assert isinstance(_load_error(path), ModelFileError)
