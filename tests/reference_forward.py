"""Independent numpy forward pass for `llama` and `qwen2` GGUF files: the test oracle for the runtime.

Every tensor is dequantized with gguf-py (`gguf.quants.dequantize`), so nothing here shares code
with the native runtime. It is written for clarity, not speed: whole-prompt causal attention,
positions 0..n-1, no KV cache.

GGUF stores a tensor's dimensions as ggml `ne` (fastest-varying first); the numpy array has them
reversed, so a projection with ne = [n_in, n_out] is a numpy [n_out, n_in] matrix W and y = x @ W.T.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

# Rope pairing per architecture. NORMAL rotates adjacent pairs (x[2i], x[2i+1]): the llama converter
# permutes the Q/K rows of Hugging Face checkpoints so that this matches their half-split rotation.
# NEOX rotates (x[i], x[i + n_rot/2]) on unpermuted weights.
ROPE_NEOX = {"llama": False, "qwen2": True}


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class ReferenceModel:
    def __init__(self, path, dtype=np.float32, ggml_numerics: bool = False) -> None:
        """ggml_numerics: round like ggml's CPU backend does (activations to 8-bit blocks before a
        quantized matmul, to fp16 before an F16 matmul; Q and the K/V cache to fp16), so that
        near-tied greedy choices are decided the same way. Off: plain float math."""
        reader = GGUFReader(path)
        self.arch = arch = reader.fields["general.architecture"].contents()
        if arch not in ROPE_NEOX:
            raise ValueError(f"{path}: reference forward supports {sorted(ROPE_NEOX)}, not {arch!r}")

        def meta(key: str, default=None):
            field = reader.fields.get(f"{arch}.{key}")
            if field is None and default is None:
                raise ValueError(f"{path}: missing GGUF key {arch}.{key}")
            return default if field is None else field.contents()

        self.n_layer = int(meta("block_count"))
        self.n_embd = int(meta("embedding_length"))
        self.n_head = int(meta("attention.head_count"))
        self.n_head_kv = int(meta("attention.head_count_kv", self.n_head))
        self.n_embd_head = int(meta("attention.key_length", self.n_embd // self.n_head))
        self.n_rot = int(meta("rope.dimension_count", self.n_embd_head))
        self.eps = float(meta("attention.layer_norm_rms_epsilon"))
        self.freq_base = float(meta("rope.freq_base", 10000.0))
        scaling = meta("rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise ValueError(f"{path}: rope scaling {scaling!r} is not implemented in the reference")
        self.freq_scale = 1.0 / float(meta("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        self.neox = ROPE_NEOX[arch]
        self.tokens = reader.fields["tokenizer.ggml.tokens"].contents()  # token texts, for looking ids up in tests

        # name -> dequantized array in numpy order (reversed ne)
        self.w = {
            t.name: dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist()))).astype(dtype)
            for t in reader.tensors
        }
        self.types = {t.name: t.tensor_type for t in reader.tensors}
        if "output.weight" not in self.w:  # tied embeddings
            self.w["output.weight"] = self.w["token_embd.weight"]
            self.types["output.weight"] = self.types["token_embd.weight"]
        self.dtype = dtype
        self.ggml_numerics = ggml_numerics

    def rope_tables(self, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin: [n_tokens, n_rot/2] for positions 0..n_tokens-1."""
        inv_freq = self.freq_base ** (-np.arange(0, self.n_rot, 2, dtype=np.float64) / self.n_rot)  # [n_rot/2]
        if "rope_freqs.weight" in self.w:  # llama3-style per-frequency divisors
            inv_freq = inv_freq / self.w["rope_freqs.weight"].astype(np.float64)
        theta = np.outer(np.arange(n_tokens) * self.freq_scale, inv_freq)
        return np.cos(theta).astype(self.dtype), np.sin(theta).astype(self.dtype)

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """x: [n_tokens, heads, n_embd_head]; rotates the first n_rot dims of each head."""
        rot, rest = x[..., : self.n_rot], x[..., self.n_rot :]
        half = self.n_rot // 2
        a, b = (rot[..., :half], rot[..., half:]) if self.neox else (rot[..., 0::2], rot[..., 1::2])
        c, s = cos[:, None, :], sin[:, None, :]
        ra, rb = a * c - b * s, a * s + b * c
        out = np.concatenate([ra, rb], -1) if self.neox else np.stack([ra, rb], -1).reshape(rot.shape)
        return np.concatenate([out, rest], -1)

    def activations_for(self, x: np.ndarray, name: str) -> np.ndarray:
        """x as ggml's CPU matmul sees it for weight `name` (only with ggml_numerics)."""
        kind = self.types[name]
        if not self.ggml_numerics or kind == GGMLQuantizationType.F32:
            return x
        if kind in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            return x.astype(np.float16).astype(self.dtype)
        # Q8_K (blocks of 256, f32 scale) for k-quants, else Q8_0/Q8_1 (blocks of 32, fp16 scale)
        block = 256 if kind.name.endswith("_K") else 32
        xb = x.reshape(*x.shape[:-1], -1, block).astype(np.float32)
        amax = np.abs(xb).max(-1, keepdims=True)
        d = amax / np.float32(127)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(
            np.float32
        )  # as ggml's AVX2 path
        q = np.round(xb * inv)
        d = d if block == 256 else d.astype(np.float16).astype(np.float32)
        return (q * d).reshape(x.shape).astype(self.dtype)

    def to_fp16(self, x: np.ndarray) -> np.ndarray:
        return x.astype(np.float16).astype(self.dtype) if self.ggml_numerics else x

    def linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = self.activations_for(x, f"{name}.weight") @ self.w[f"{name}.weight"].T
        bias = self.w.get(f"{name}.bias")  # qwen2 has Q/K/V biases
        return y if bias is None else y + bias

    def forward(self, tokens: list[int]) -> np.ndarray:
        """tokens: [n_tokens] ids at positions 0..n-1 -> logits [n_tokens, n_vocab]."""
        n = len(tokens)
        cos, sin = self.rope_tables(n)
        causal = np.triu(np.full((n, n), -np.inf, dtype=self.dtype), k=1)  # [n_q, n_k]
        group = self.n_head // self.n_head_kv
        x = self.w["token_embd.weight"][np.asarray(tokens)]  # [n, n_embd]

        for il in range(self.n_layer):
            blk = f"blk.{il}"
            h = rms_norm(x, self.w[f"{blk}.attn_norm.weight"], self.eps)
            q = self.linear(h, f"{blk}.attn_q").reshape(n, self.n_head, self.n_embd_head)
            k = self.linear(h, f"{blk}.attn_k").reshape(n, self.n_head_kv, self.n_embd_head)
            v = self.linear(h, f"{blk}.attn_v").reshape(n, self.n_head_kv, self.n_embd_head)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
            q, k, v = self.to_fp16(q), self.to_fp16(k), self.to_fp16(v)  # fp16 KV cache
            k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # query head i uses kv head i // group
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(self.n_embd_head) + causal  # [n_head, n, n]
            attn = np.einsum("hqk,khd->qhd", softmax(scores), v).reshape(n, self.n_head * self.n_embd_head)
            x = x + self.linear(attn, f"{blk}.attn_output")

            h = rms_norm(x, self.w[f"{blk}.ffn_norm.weight"], self.eps)
            x = x + self.linear(
                silu(self.linear(h, f"{blk}.ffn_gate")) * self.linear(h, f"{blk}.ffn_up"), f"{blk}.ffn_down"
            )

        x = rms_norm(x, self.w["output_norm.weight"], self.eps)
        return self.activations_for(x, "output.weight") @ self.w["output.weight"].T  # [n, n_vocab]
