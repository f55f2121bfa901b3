"""Write small random GGUF models (llama or qwen2) with llama.cpp's key and tensor names.

The files carry a tiny but valid byte-level BPE tokenizer (GPT-2 byte alphabet, a few merges,
ChatML control tokens) and a ChatML chat template, so every layer of the runtime can be
exercised without a real checkpoint. Weights are random: projections ~ N(0, 1/n_in), so
activations and logits keep unit scale instead of collapsing to a uniform distribution.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf.quants import quantize

from ott_gguf.chat import CHATML_TEMPLATE

WEIGHT_TYPES = {
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
    "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
}
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# a few English merges, each joining two tokens that exist by then (Ġ is the byte-level space)
MERGES = [
    "Ġ t",
    "h e",
    "i n",
    "e r",
    "a n",
    "o n",
    "r e",
    "Ġ a",
    "Ġ s",
    "Ġt he",
    "Ġ w",
    "a t",
    "e n",
    "o r",
    "i s",
    "Ġ c",
    "in g",
    "Ġ o",
    "Ġ i",
    "Ġ b",
]


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> unicode mapping, indexed by byte value: printable bytes stand for themselves,
    the other 68 (controls, space, ...) get the code points 256, 257, ... in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    chars, shifted = [], 256
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(shifted))
            shifted += 1
    return chars


def vocabulary(n_vocab: int | None) -> tuple[list[str], list[int]]:
    """Tokens and token types: 256 bytes, merge results, control tokens, then [PADi] up to n_vocab."""
    tokens = byte_alphabet() + [m.replace(" ", "") for m in MERGES] + CONTROL_TOKENS
    types = [TokenType.NORMAL] * (len(tokens) - len(CONTROL_TOKENS)) + [TokenType.CONTROL] * len(CONTROL_TOKENS)
    if n_vocab is not None:
        if n_vocab < len(tokens):
            raise ValueError(f"n_vocab {n_vocab} is smaller than the {len(tokens)} tokens of the test tokenizer")
        types += [TokenType.UNUSED] * (n_vocab - len(tokens))
        tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    return tokens, [int(t) for t in types]


def write_random_model(
    path,
    arch: str = "qwen2",
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_vocab: int | None = None,
    seed: int = 0,
    dtype: str = "f16",
    tied_output: bool = False,
    n_ctx_train: int = 512,
    rope_freq_base: float = 10000.0,
    rms_eps: float = 1e-6,
) -> Path:
    """Write a random model to `path` and return it. Matrices are stored as `dtype`, norms and biases as F32;
    n_vocab None means exactly the tokenizer's tokens. qwen2 gets Q/K/V biases, llama none."""
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"arch must be 'llama' or 'qwen2', got {arch!r}")
    if dtype not in WEIGHT_TYPES:
        raise ValueError(f"dtype must be one of {sorted(WEIGHT_TYPES)}, got {dtype!r}")
    if n_embd % n_head or n_head % n_head_kv or (n_embd // n_head) % 2:
        raise ValueError(
            f"need n_head | n_embd, n_head_kv | n_head and an even head size: "
            f"n_embd={n_embd} n_head={n_head} n_head_kv={n_head_kv}"
        )
    if dtype in ("q8_0", "q4_1") and (n_embd % 32 or n_ff % 32):
        raise ValueError(f"{dtype} needs n_embd and n_ff divisible by 32, got {n_embd} and {n_ff}")
    qtype, file_type = WEIGHT_TYPES[dtype]
    tokens, token_types = vocabulary(n_vocab)
    n_embd_head = n_embd // n_head
    rng = np.random.default_rng(seed)

    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"random-{arch}-test")
    writer.add_file_type(file_type)
    writer.add_block_count(n_layer)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_freq_base(rope_freq_base)
    writer.add_layer_norm_rms_eps(rms_eps)
    if arch == "llama":  # the llama converter writes these two as well
        writer.add_vocab_size(len(tokens))
        writer.add_rope_dimension_count(n_embd_head)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    def matrix(name: str, n_out: int, n_in: int) -> None:
        """numpy [n_out, n_in] = ggml ne [n_in, n_out]."""
        w = rng.normal(0.0, 1.0 / np.sqrt(n_in), size=(n_out, n_in)).astype(np.float32)
        writer.add_tensor(name, quantize(w, qtype), raw_dtype=qtype)

    def vector(name: str, n: int, mean: float, std: float) -> None:
        writer.add_tensor(name, (mean + std * rng.standard_normal(n)).astype(np.float32))

    # The llama converter permutes Q/K rows for adjacent-pair rope; random weights need no permutation.
    matrix("token_embd.weight", len(tokens), n_embd)
    for il in range(n_layer):
        blk = f"blk.{il}"
        vector(f"{blk}.attn_norm.weight", n_embd, 1.0, 0.1)
        matrix(f"{blk}.attn_q.weight", n_head * n_embd_head, n_embd)
        matrix(f"{blk}.attn_k.weight", n_head_kv * n_embd_head, n_embd)
        matrix(f"{blk}.attn_v.weight", n_head_kv * n_embd_head, n_embd)
        if arch == "qwen2":
            vector(f"{blk}.attn_q.bias", n_head * n_embd_head, 0.0, 0.1)
            vector(f"{blk}.attn_k.bias", n_head_kv * n_embd_head, 0.0, 0.1)
            vector(f"{blk}.attn_v.bias", n_head_kv * n_embd_head, 0.0, 0.1)
        matrix(f"{blk}.attn_output.weight", n_embd, n_head * n_embd_head)
        vector(f"{blk}.ffn_norm.weight", n_embd, 1.0, 0.1)
        matrix(f"{blk}.ffn_gate.weight", n_ff, n_embd)
        matrix(f"{blk}.ffn_up.weight", n_ff, n_embd)
        matrix(f"{blk}.ffn_down.weight", n_embd, n_ff)
    vector("output_norm.weight", n_embd, 1.0, 0.1)
    if not tied_output:
        matrix("output.weight", len(tokens), n_embd)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def write_copy(
    src,
    dst,
    n_layer: int | None = None,
    dequantize: bool = False,
    keys: dict | None = None,
    drop: tuple[str, ...] = (),
    arch: str | None = None,
) -> Path:
    """Copy the GGUF file `src` to `dst`, keeping its first n_layer blocks (all when None) and
    with dequantize, storing every quantized matrix as F32 (the same values, unrounded).
    keys: metadata to set, name -> (value, GGUFValueType, element type of an array or None);
    drop: names of tensors to leave out; arch: another general.architecture (the other keys
    keep their names)."""
    from gguf import GGUFReader, GGUFValueType
    from gguf.quants import dequantize as dequantized

    reader = GGUFReader(src)
    arch = arch if arch is not None else reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == f"{arch}.block_count" and n_layer is not None:
            value = n_layer
        vtype = field.types[0]
        if field.name not in (keys or {}):
            writer.add_key_value(
                field.name, value, vtype, sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY else None
            )
    for name, (value, vtype, sub_type) in (keys or {}).items():
        writer.add_key_value(name, value, vtype, sub_type=sub_type)
    for t in reader.tensors:
        if t.name in drop:
            continue
        if n_layer is not None and t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_layer:
            continue
        if dequantize and t.tensor_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            shape = tuple(reversed(t.shape.tolist()))
            writer.add_tensor(t.name, dequantized(t.data, t.tensor_type).reshape(shape).astype(np.float32))
        else:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)


def write_kvq_sidecar(model_path: str | Path, dst: str | Path, seed: int = 0) -> Path:
    """A calibration sidecar with KVQuant tables for the model at model_path (its real model
    hash and shapes), the tables themselves made up: key thresholds ±(1 .. 3) per channel,
    codebooks of tanh-spaced levels. For tests of the runtime's KVQuant cache, which must
    follow whatever tables it is given."""
    from ott_gguf.calibrate import Calibration, write
    from ott_gguf.kvq_calibration import BITS, OUTLIERS, ROPE_KINDS, KVQCalibration
    from ott_gguf.model import Weights

    weights = Weights(model_path, device="cpu")
    try:
        info, model_hash = weights.info, f"{weights.fingerprint():016x}"
    finally:
        weights.close()
    rng = np.random.default_rng(seed)
    cal = KVQCalibration(info.n_layer, 32, OUTLIERS, n_tokens=0)
    for _ in range(info.n_layer):
        ranges, books_k, books_v = {}, {}, {}
        for o in OUTLIERS:
            for rope in ROPE_KINDS:
                a = rng.uniform(1.0, 3.0, (info.n_head_kv, info.n_embd_head)).astype(np.float32)
                ranges[(rope, o)] = np.stack([-a, a * rng.uniform(0.5, 1.0, a.shape).astype(np.float32)], -1)
                for b in BITS:
                    books_k[(rope, o, b)] = (np.tanh(np.linspace(-1.5, 1.5, 2**b)) / np.tanh(1.5)).astype(np.float32)
            for b in BITS:
                books_v[(o, b)] = np.linspace(-1.0, 1.0, 2**b, dtype=np.float32) ** 3
        cal.k_range.append(ranges)
        cal.codebook_k.append(books_k)
        cal.codebook_v.append(books_v)
    write(Calibration(info.arch, model_hash, 0, "made-up tables", None, None, None, None, kvq=cal), dst)
    return Path(dst)
