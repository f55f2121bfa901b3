"""Hugging Face checkpoints for the converter tests: one rebuilt from a real GGUF, tiny random ones.

The HF names, the inverse of llama's Q/K row permutation and the file formats are written
out here independently of convert/, so the tests check the converter against them.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
from gguf import GGUFReader, TokenType
from gguf.quants import dequantize
from safetensors.numpy import save_file

GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    _, il, kind, suffix = gguf_name.split(".")
    return f"model.layers.{il}.{LAYER_NAMES[kind]}.{suffix}"


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF llama Wq/Wk rows (pairs interleaved per head) -> HF rows (halves per head)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1), encoding="utf-8")


def write_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """float32 arrays whose values are exact bfloat16 -> a safetensors file of BF16 tensors
    (the safetensors numpy API cannot write BF16: numpy has no such dtype)."""
    header, blobs, offset = {}, [], 0
    for name, a in tensors.items():
        bits = (np.ascontiguousarray(a, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [offset, offset + len(bits)]}
        blobs.append(bits)
        offset += len(bits)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for blob in blobs:
            f.write(blob)


def write_sentencepiece_model(path: Path, pieces: list[tuple[str, float, int]]) -> None:
    """A protobuf ModelProto: `pieces` (text, score, SentencePiece type) and a TrainerSpec saying
    BPE with byte fallback (model_type = 3, byte_fallback = 35), which sentencepiece needs to
    accept <0xNN> pieces."""

    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    def field_bytes(field: int, payload: bytes) -> bytes:
        return varint(field << 3 | 2) + varint(len(payload)) + payload

    model = b""
    for text, score, kind in pieces:
        piece = (
            field_bytes(1, text.encode())
            + varint(2 << 3 | 5)
            + struct.pack("<f", score)
            + varint(3 << 3)
            + varint(kind)
        )
        model += field_bytes(1, piece)
    model += field_bytes(2, varint(3 << 3) + varint(2) + varint(35 << 3) + varint(1))
    path.write_bytes(model)


# ---- SmolLM2 rebuilt from its GGUF ------------------------------------------------------------

SMOLLM2_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ],
}


def smollm2_checkpoint(gguf_path: Path, directory: Path) -> dict[str, np.ndarray]:
    """Write an HF LlamaForCausalLM checkpoint (f32 safetensors, tokenizer.json) equivalent to
    the GGUF; return the dequantized GGUF tensors by GGUF name, F32 in numpy order."""
    reader = GGUFReader(gguf_path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    n_head, n_head_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]

    expected, hf = {}, {}
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32)  # [n_rows, n_cols]
        expected[t.name] = data
        if ".attn_q." in t.name:
            data = unpermute_rope_rows(data, n_head)
        elif ".attn_k." in t.name:
            data = unpermute_rope_rows(data, n_head_kv)
        hf[hf_name(t.name)] = np.ascontiguousarray(data)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(hf, str(directory / "model.safetensors"))

    # float32 key values as the short decimal a config.json would hold
    def short(x: float) -> float:
        return float(str(np.float32(x)))

    write_json(
        directory / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": meta["llama.embedding_length"],
            "intermediate_size": meta["llama.feed_forward_length"],
            "num_hidden_layers": meta["llama.block_count"],
            "num_attention_heads": n_head,
            "num_key_value_heads": n_head_kv,
            "max_position_embeddings": meta["llama.context_length"],
            "rms_norm_eps": short(meta["llama.attention.layer_norm_rms_epsilon"]),
            "rope_theta": short(meta["llama.rope.freq_base"]),
            "rope_scaling": None,
            "vocab_size": meta["llama.vocab_size"],
            "tie_word_embeddings": "output.weight" not in expected,
            "bos_token_id": meta["tokenizer.ggml.bos_token_id"],
            "eos_token_id": meta["tokenizer.ggml.eos_token_id"],
            "hidden_act": "silu",
            "torch_dtype": "float32",
        },
    )

    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    special = [i for i, t in enumerate(types) if t == TokenType.CONTROL]
    write_json(
        directory / "tokenizer.json",
        {
            "version": "1.0",
            "added_tokens": [
                {
                    "id": i,
                    "content": tokens[i],
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": True,
                }
                for i in special
            ],
            "normalizer": None,
            "pre_tokenizer": SMOLLM2_PRE_TOKENIZER,
            "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "vocab": {tok: i for i, tok in enumerate(tokens)},
                "merges": meta["tokenizer.ggml.merges"],
            },
        },
    )
    write_json(
        directory / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "bos_token": tokens[meta["tokenizer.ggml.bos_token_id"]],
            "eos_token": tokens[meta["tokenizer.ggml.eos_token_id"]],
            "unk_token": tokens[meta["tokenizer.ggml.unknown_token_id"]],
            "pad_token": tokens[meta["tokenizer.ggml.padding_token_id"]],
            "chat_template": meta["tokenizer.chat_template"],
            "model_max_length": meta["llama.context_length"],
            "tokenizer_class": "GPT2Tokenizer",
            "added_tokens_decoder": {str(i): {"content": tokens[i], "special": True} for i in special},
        },
    )
    write_json(
        directory / "generation_config.json",
        {"bos_token_id": meta["tokenizer.ggml.bos_token_id"], "eos_token_id": meta["tokenizer.ggml.eos_token_id"]},
    )
    return expected


# ---- tiny random checkpoints ------------------------------------------------------------------

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TINY_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r")]
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY = dict(n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_layer=2)


def bf16_exact(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 0.05) -> np.ndarray:
    """Random float32 values that bfloat16 represents exactly."""
    a = (rng.standard_normal(shape) * scale).astype(np.float32)
    return (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def tiny_byte_bpe_tokenizer(split: str = QWEN2_SPLIT) -> tuple[dict, list[str]]:
    """A byte-level BPE tokenizer.json with Qwen2's pre-tokenizer (or the regex `split`); returns
    it and its token list."""
    tokens = list(bytes_to_unicode().values()) + ["".join(m) for m in TINY_MERGES] + TINY_SPECIALS
    tokenizer = {
        "version": "1.0",
        "added_tokens": [
            {
                "id": tokens.index(s),
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for s in TINY_SPECIALS
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens) if t not in TINY_SPECIALS},
            "merges": [list(m) for m in TINY_MERGES],
        },
    }
    return tokenizer, tokens


def tiny_qwen2_checkpoint(directory: Path, rng: np.random.Generator, n_vocab: int = 288) -> dict[str, np.ndarray]:
    """Qwen2ForCausalLM, BF16 weights in two safetensors shards with an index; returns the HF tensors (F32)."""
    e, h, kv, ff = TINY["n_embd"], TINY["n_head"], TINY["n_head_kv"], TINY["n_ff"]
    hd = e // h
    tensors = {
        "model.embed_tokens.weight": bf16_exact(rng, (n_vocab, e)),
        "model.norm.weight": bf16_exact(rng, (e,), 1.0),
        "lm_head.weight": bf16_exact(rng, (n_vocab, e)),
    }
    for il in range(TINY["n_layer"]):
        p = f"model.layers.{il}."
        tensors |= {
            p + "input_layernorm.weight": bf16_exact(rng, (e,), 1.0),
            p + "self_attn.q_proj.weight": bf16_exact(rng, (h * hd, e)),
            p + "self_attn.q_proj.bias": bf16_exact(rng, (h * hd,)),
            p + "self_attn.k_proj.weight": bf16_exact(rng, (kv * hd, e)),
            p + "self_attn.k_proj.bias": bf16_exact(rng, (kv * hd,)),
            p + "self_attn.v_proj.weight": bf16_exact(rng, (kv * hd, e)),
            p + "self_attn.v_proj.bias": bf16_exact(rng, (kv * hd,)),
            p + "self_attn.o_proj.weight": bf16_exact(rng, (e, h * hd)),
            p + "post_attention_layernorm.weight": bf16_exact(rng, (e,), 1.0),
            p + "mlp.gate_proj.weight": bf16_exact(rng, (ff, e)),
            p + "mlp.up_proj.weight": bf16_exact(rng, (ff, e)),
            p + "mlp.down_proj.weight": bf16_exact(rng, (e, ff)),
        }
    directory.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, part in shards.items():
        write_bf16_safetensors(directory / file, {n: tensors[n] for n in part})
    write_json(
        directory / "model.safetensors.index.json",
        {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}},
    )

    tokenizer, tokens = tiny_byte_bpe_tokenizer()
    write_json(directory / "tokenizer.json", tokenizer)
    write_json(
        directory / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
        },
    )
    write_json(
        directory / "config.json",
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": e,
            "intermediate_size": ff,
            "num_hidden_layers": TINY["n_layer"],
            "num_attention_heads": h,
            "num_key_value_heads": kv,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "vocab_size": n_vocab,
            "tie_word_embeddings": False,
            "bos_token_id": tokens.index("<|endoftext|>"),
            "eos_token_id": tokens.index("<|im_end|>"),
            "torch_dtype": "bfloat16",
            "use_sliding_window": False,
        },
    )
    write_json(
        directory / "generation_config.json",
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},
    )
    return tensors


# SentencePiece types: NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6
TINY_SPM_PIECES = (
    [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    + [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    + [("▁t", -1.0, 1), ("he", -2.0, 1), ("▁the", -3.0, 1), ("in", -4.0, 1), ("▁a", -5.0, 1), ("<tool>", 0.0, 4)]
)


def tiny_llama_checkpoint(
    directory: Path, rng: np.random.Generator, rope_scaling: dict | None
) -> dict[str, np.ndarray]:
    """LlamaForCausalLM with a SentencePiece tokenizer.model and tied embeddings, F16 weights in
    model.safetensors; returns the HF tensors (F32 values exact in F16)."""
    e, h, kv, ff = TINY["n_embd"], TINY["n_head"], TINY["n_head_kv"], TINY["n_ff"]
    n_vocab = len(TINY_SPM_PIECES) + 1  # one id beyond the SentencePiece model: added token

    def f16(shape, scale=0.05):
        return (rng.standard_normal(shape) * scale).astype(np.float16).astype(np.float32)

    tensors = {"model.embed_tokens.weight": f16((n_vocab, e)), "model.norm.weight": f16((e,), 1.0)}
    for il in range(TINY["n_layer"]):
        p = f"model.layers.{il}."
        tensors |= {
            p + "input_layernorm.weight": f16((e,), 1.0),
            p + "self_attn.q_proj.weight": f16((e, e)),
            p + "self_attn.k_proj.weight": f16((kv * e // h, e)),
            p + "self_attn.v_proj.weight": f16((kv * e // h, e)),
            p + "self_attn.o_proj.weight": f16((e, e)),
            p + "post_attention_layernorm.weight": f16((e,), 1.0),
            p + "mlp.gate_proj.weight": f16((ff, e)),
            p + "mlp.up_proj.weight": f16((ff, e)),
            p + "mlp.down_proj.weight": f16((e, ff)),
            p + "self_attn.rotary_emb.inv_freq": f16((e // h // 2,)),
        }
    directory.mkdir(parents=True, exist_ok=True)
    save_file({n: a.astype(np.float16) for n, a in tensors.items()}, str(directory / "model.safetensors"))
    write_sentencepiece_model(directory / "tokenizer.model", TINY_SPM_PIECES)
    write_json(
        directory / "tokenizer_config.json",
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_prefix_space": True,
            "added_tokens_decoder": {str(n_vocab - 1): {"content": "<|user|>", "special": True}},
        },
    )
    write_json(
        directory / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": e,
            "intermediate_size": ff,
            "num_hidden_layers": TINY["n_layer"],
            "num_attention_heads": h,
            "num_key_value_heads": kv,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "vocab_size": n_vocab,
            "rope_scaling": rope_scaling,
            "tie_word_embeddings": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float16",
        },
    )
    return tensors


# ---- tiny random Qwen3, Gemma 3 and Phi-3 checkpoints ---------------------------------------
#
# Weights are drawn here (numpy, fixed seeds), so a checkpoint is the same wherever it is built
# and its llama.cpp results can be kept as fixtures. Projections ~ N(0, 1/n_in) and embeddings
# ~ N(0, 1) keep activations at unit scale, so attention is far from uniform and the logits
# differ between positions (Gemma's embedding ~ N(0, 1/n_embd): it is scaled by sqrt(n_embd)
# and tied to the output); norm weights ~ 1 (Gemma's ~ 0: it multiplies by 1 + w).

GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
QWEN3_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma's SentencePiece vocabulary in small: its four specials first, bytes, a few merges, and
# the chat-turn tokens that tokenizer_config marks special
GEMMA3_SPM_PIECES = (
    [("<pad>", 0.0, 3), ("<eos>", 0.0, 3), ("<bos>", 0.0, 3), ("<unk>", 0.0, 2)]
    + [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    + [
        ("▁t", -1.0, 1),
        ("he", -2.0, 1),
        ("▁the", -3.0, 1),
        ("in", -4.0, 1),
        ("▁a", -5.0, 1),
        ("at", -6.0, 1),
        ("▁c", -7.0, 1),
        ("▁cat", -8.0, 1),
        ("▁▁", -9.0, 1),
        ("<start_of_turn>", 0.0, 4),
        ("<end_of_turn>", 0.0, 4),
    ]
)
PHI3_SPM_ADDED = ["<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"]
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _random_weights(
    rng: np.random.Generator, shapes: dict[str, tuple[int, ...]], norm_mean: float, embed_std: float = 1.0
) -> dict[str, np.ndarray]:
    """HF name -> float32 values exact in bfloat16: 1-D tensors are norms around norm_mean,
    the embedding ~ N(0, embed_std²), matrices ~ N(0, 1/n_in)."""
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            a = norm_mean + 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name:
            a = embed_std * rng.standard_normal(shape)
        else:
            a = rng.standard_normal(shape) / np.sqrt(shape[1])
        out[name] = (np.asarray(a, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    return out


def _save(directory: Path, tensors: dict[str, np.ndarray], config: dict, tokenizer_config: dict, bf16: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if bf16:
        write_bf16_safetensors(directory / "model.safetensors", tensors)
    else:
        save_file(tensors, str(directory / "model.safetensors"))
    write_json(directory / "config.json", config)
    write_json(directory / "tokenizer_config.json", tokenizer_config)


def tiny_qwen3_checkpoint(directory: Path, seed: int = 3) -> dict:
    """Qwen3ForCausalLM: head_dim 32 (not n_embd/n_head), separate lm_head, byte-level BPE with
    Qwen2's pre-tokenizer, BF16 weights. Returns config.json."""
    e, h, kv, ff, hd, n_layer = 64, 4, 2, 96, 32, 2
    tokenizer, tokens = tiny_byte_bpe_tokenizer()
    n_vocab = len(tokens)
    shapes = {"model.embed_tokens.weight": (n_vocab, e), "model.norm.weight": (e,), "lm_head.weight": (n_vocab, e)}
    for il in range(n_layer):
        p = f"model.layers.{il}."
        shapes |= {
            p + "input_layernorm.weight": (e,),
            p + "self_attn.q_proj.weight": (h * hd, e),
            p + "self_attn.k_proj.weight": (kv * hd, e),
            p + "self_attn.v_proj.weight": (kv * hd, e),
            p + "self_attn.o_proj.weight": (e, h * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "post_attention_layernorm.weight": (e,),
            p + "mlp.gate_proj.weight": (ff, e),
            p + "mlp.up_proj.weight": (ff, e),
            p + "mlp.down_proj.weight": (e, ff),
        }
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": e,
        "intermediate_size": ff,
        "num_hidden_layers": n_layer,
        "num_attention_heads": h,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "vocab_size": n_vocab,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": tokens.index("<|endoftext|>"),
        "eos_token_id": tokens.index("<|im_end|>"),
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
    }
    _save(
        directory,
        _random_weights(np.random.default_rng(seed), shapes, 1.0),
        config,
        {
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": QWEN3_TEMPLATE,
        },
        bf16=True,
    )
    write_json(directory / "tokenizer.json", tokenizer)
    return config


def tiny_gemma3_checkpoint(directory: Path, seed: int = 4, sliding_window: int = 16) -> dict:
    """Gemma3ForCausalLM (text only): 4 layers, the third global and the others local with a
    window of `sliding_window`, head_dim 32, tied embeddings, Gemma's SentencePiece layout,
    BF16 weights. Returns config.json."""
    e, h, kv, ff, hd = 64, 4, 2, 96, 32
    layer_types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    n_vocab = len(GEMMA3_SPM_PIECES)
    shapes = {"model.embed_tokens.weight": (n_vocab, e), "model.norm.weight": (e,)}
    for il in range(len(layer_types)):
        p = f"model.layers.{il}."
        shapes |= {
            p + "input_layernorm.weight": (e,),
            p + "self_attn.q_proj.weight": (h * hd, e),
            p + "self_attn.k_proj.weight": (kv * hd, e),
            p + "self_attn.v_proj.weight": (kv * hd, e),
            p + "self_attn.o_proj.weight": (e, h * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "post_attention_layernorm.weight": (e,),
            p + "pre_feedforward_layernorm.weight": (e,),
            p + "post_feedforward_layernorm.weight": (e,),
            p + "mlp.gate_proj.weight": (ff, e),
            p + "mlp.up_proj.weight": (ff, e),
            p + "mlp.down_proj.weight": (e, ff),
        }
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": e,
        "intermediate_size": ff,
        "num_hidden_layers": len(layer_types),
        "num_attention_heads": h,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "query_pre_attn_scalar": hd,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "sliding_window": sliding_window,
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "vocab_size": n_vocab,
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    turns = {
        str(i): {"content": t, "special": True} for i, (t, _, _) in enumerate(GEMMA3_SPM_PIECES) if "_of_turn" in t
    }
    _save(
        directory,
        _random_weights(np.random.default_rng(seed), shapes, 0.0, 1 / np.sqrt(e)),
        config,
        {
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<bos>",
            "eos_token": "<eos>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
            "added_tokens_decoder": turns,
            "chat_template": GEMMA3_TEMPLATE,
        },
        bf16=True,
    )
    write_sentencepiece_model(directory / "tokenizer.model", GEMMA3_SPM_PIECES)
    return config


def tiny_phi3_checkpoint(
    directory: Path, seed: int = 5, sliding_window: int | None = 24, long_rope: bool = True, bpe: bool = False
) -> dict:
    """Phi3ForCausalLM: fused qkv_proj and gate_up_proj, rope over half of each head
    (partial_rotary_factor 0.5), LongRoPE factors with original context 32 (long factors beyond
    it), F32 weights. Tokenizer: Phi-3's SentencePiece with its added chat tokens, or (bpe)
    Phi-4-mini's byte-level BPE with the o200k pre-tokenizer. Returns config.json."""
    e, h, kv, ff, n_layer = 64, 4, 2, 96, 2
    hd = e // h
    if bpe:
        tokenizer, tokens = tiny_byte_bpe_tokenizer(GPT4O_SPLIT)
        n_vocab = len(tokens)
    else:
        n_vocab = len(TINY_SPM_PIECES) + len(PHI3_SPM_ADDED)
    shapes = {"model.embed_tokens.weight": (n_vocab, e), "model.norm.weight": (e,), "lm_head.weight": (n_vocab, e)}
    for il in range(n_layer):
        p = f"model.layers.{il}."
        shapes |= {
            p + "input_layernorm.weight": (e,),
            p + "self_attn.qkv_proj.weight": ((h + 2 * kv) * hd, e),
            p + "self_attn.o_proj.weight": (e, h * hd),
            p + "post_attention_layernorm.weight": (e,),
            p + "mlp.gate_up_proj.weight": (2 * ff, e),
            p + "mlp.down_proj.weight": (e, ff),
        }
    rng = np.random.default_rng(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if long_rope:
        n = hd // 2 // 2  # half of the rotated dimensions
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "long_factor": (1.0 + 3.0 * rng.random(n)).round(4).tolist(),
            "short_factor": (1.0 + 0.2 * rng.random(n)).round(4).tolist(),
        }
    config = {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": e,
        "intermediate_size": ff,
        "num_hidden_layers": n_layer,
        "num_attention_heads": h,
        "num_key_value_heads": kv,
        "max_position_embeddings": 256,
        "original_max_position_embeddings": 32,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
        "rope_scaling": rope if long_rope else None,
        "rope_theta": 10000.0,
        "sliding_window": sliding_window,
        "vocab_size": n_vocab,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "pad_token_id": None,
    }
    if bpe:
        config |= {"bos_token_id": tokens.index("<|endoftext|>"), "eos_token_id": tokens.index("<|im_end|>")}
        tok_config = {
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "tokenizer_class": "GPT2Tokenizer",
            "chat_template": QWEN3_TEMPLATE,
        }
    else:
        config |= {"bos_token_id": 1, "eos_token_id": len(TINY_SPM_PIECES) + PHI3_SPM_ADDED.index("<|endoftext|>")}
        tok_config = {
            "add_bos_token": False,
            "add_eos_token": False,
            "bos_token": "<s>",
            "eos_token": "<|endoftext|>",
            "unk_token": "<unk>",
            "tokenizer_class": "LlamaTokenizer",
            "chat_template": PHI3_TEMPLATE,
            "added_tokens_decoder": {
                str(len(TINY_SPM_PIECES) + i): {"content": t, "special": True} for i, t in enumerate(PHI3_SPM_ADDED)
            },
        }
    _save(directory, _random_weights(rng, shapes, 1.0), config, tok_config, bf16=False)
    if bpe:
        write_json(directory / "tokenizer.json", tokenizer)
    else:
        write_sentencepiece_model(directory / "tokenizer.model", TINY_SPM_PIECES)
    return config
