"""Loaded GGUF weights and the decoding contexts that share them: the public Python API.

    model = Model("SmolLM2-135M-Instruct.Q4_1.gguf", n_ctx=2048)   # weights + one context
    ids = model.tokenize("The capital of France is")
    logits = model.eval(ids)            # F32 [n_vocab], last token
    f16 = Context(model.weights, n_ctx=2048, kv="f16")              # a second cache, same weights

Weights stay in native memory in their GGUF types; Python reads the metadata (with the
`gguf` package) only to describe the model and build the tokenizer and chat template.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from ._native import check, ffi, lib
from .ctx_size import available_memory, context_bytes_per_token, default_n_ctx
from .errors import InvalidArgumentError, ModelFileError, UnsupportedError
from .reference.config import AUTO_CPU, AUTO_ORDER, PRESETS, KVConfig, preset
from .reference.footprint import Footprint, footprint, ring_rows
from .tier_scale import tier_scale

# Where a model's calibration sidecar is looked for when none is given: beside the model.
CALIB_SUFFIX = ".kvcalib.gguf"


def default_calibration(model_path: str | os.PathLike) -> Path:
    """The sidecar path `<model>.kvcalib.gguf` of a model file (it may not exist)."""
    p = Path(model_path)
    return p.with_name(p.stem + CALIB_SUFFIX)


@dataclass(frozen=True)
class ModelInfo:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd_head: int
    n_ff: int
    rope_type: int
    rope_freq_base: float
    rope_freq_scale: float
    norm_rms_eps: float
    tied_output: bool
    n_params: int
    weight_bytes: int
    x8_bytes: int  # of them stored as 8 interleaved rows (Weights(x8=True), AVX2 or AVX-512 VNNI)
    device: str  # where the model runs: "cpu" or "cuda:N"
    n_swa: int  # sliding window of the local layers (tokens); 0: all layers global


@dataclass(frozen=True)
class KVStats:
    bytes_allocated: int  # KV bytes allocated now, all layers and sequences
    bytes_used: int  # bytes holding live tokens
    n_tokens: int  # live tokens summed over sequences
    bytes_per_token_layer: float  # everything counted
    bits_per_element: float  # average over K and V elements


@dataclass
class Profile:
    """Compute time by kind of graph node since profiling was turned on (ott.h: ott_profile)."""

    attn_ms: float  # attention over the cache
    append_ms: float  # new tokens into the cache, quantization events
    rotate_ms: float  # rotations of queries, keys, values and outputs
    other_ms: float  # projections, FFN, norms, output head
    n_ubatches: int


INT32_MAX = 2**31 - 1


def _check_count(name: str, value) -> None:
    """A count the C API takes as int32_t: an int in [1, INT32_MAX]."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 1 <= value <= INT32_MAX:
        raise InvalidArgumentError(f"{name} = {value!r} must be an integer in [1, {INT32_MAX}]")


def _struct_to(cls, c_struct):
    values = {}
    for f in fields(cls):
        v = getattr(c_struct, f.name)
        values[f.name] = ffi.string(v).decode() if f.type == "str" else v
    return cls(**values)


class Weights:
    """A GGUF model loaded once: weights in native memory, description, tokenizer and chat
    template. Any number of `Context`s decode with the same weights (llama.cpp's model and
    context); the weights stay loaded until their last context is freed."""

    def __init__(self, path: str | os.PathLike, *, repack: bool = True, x8: bool = True, device: str | None = None):
        """repack: store matmul weights in a faster CPU layout where the type has one: ggml's
        repacked layouts, and with x8 Q4_1 and Q8_0 matrices as 8 interleaved rows on AVX2 or
        AVX-512 VNNI (this library's kernels, ggml's results bit for bit; `info.x8_bytes`).
        device: "cpu", "cuda" or "cuda:N"; None runs on the first GPU when this build has CUDA
        and one is present, else on the CPU (`self.info.device` says which)."""
        self.path = Path(path)
        self._lock = threading.Lock()
        self._model = None
        self._tier_scale: np.ndarray | None = None
        self._auto: str | None = None  # what kv "auto" is on these weights (kv_config)
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: no such file")
        mparams = ffi.new("ott_model_params *", lib.ott_model_default_params())
        mparams.repack = int(repack)
        mparams.x8 = int(x8)
        if device is not None:
            if not isinstance(device, str) or len(device.encode()) >= len(mparams.device):
                raise InvalidArgumentError(f"device {device!r} is not one of cpu, cuda, cuda:N")
            mparams.device = device.encode()
        pmodel = ffi.new("ott_model **")
        check(lib.ott_model_load(str(self.path).encode(), mparams, pmodel))
        self._model = ffi.gc(pmodel[0], lib.ott_model_free)

        cinfo = ffi.new("ott_model_info *")
        check(lib.ott_model_get_info(self._model, cinfo))
        self.info = _struct_to(ModelInfo, cinfo)
        self.n_vocab = self.info.n_vocab
        window = ffi.new("int32_t *")
        self.layer_windows: list[int] = []  # per layer: its sliding window, 0 for a global layer
        for il in range(self.info.n_layer):
            check(lib.ott_model_layer_window(self._model, il, window))
            self.layer_windows.append(window[0])

        from .chat import ChatTemplate
        from .gguf_meta import read_metadata, read_tensors
        from .tokenizer import Tokenizer

        meta = read_metadata(self._model)
        self.tokenizer = Tokenizer.from_fields(meta)
        self.chat_template = ChatTemplate.from_fields(meta)
        # metadata to describe the model: scalars and short arrays (vocabularies are the tokenizer's)
        self.metadata = {
            k: v for k, v in meta.items() if not (hasattr(v, "__len__") and not isinstance(v, str) and len(v) > 64)
        }
        self.tensors = read_tensors(self._model)
        self.tensor_types = dict(Counter(t.type_name for t in self.tensors))

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def tier_scale(self) -> np.ndarray:
        """The key tiers' query scale of this model, float32 [n_layer, n_head_kv, head_dim]
        (tier_scale.py), computed from the weights once."""
        if self._tier_scale is None:
            i = self.info
            n_rot = int(self.metadata.get(f"{i.arch}.rope.dimension_count", i.n_embd_head))
            self._tier_scale = tier_scale(
                self.path, self.tensors, i.n_layer, i.n_head, i.n_head_kv, i.n_embd_head, n_rot, i.rope_type
            )
        return self._tier_scale

    def kv_config(self, kv: str | KVConfig) -> KVConfig:
        """The KVConfig of a mode name or KVConfig on these weights: "auto" is the first preset
        of AUTO_ORDER that this model's cache takes (the native library decides: a plain RoPE
        for keys cached before it, head sizes for rotations and groups), AUTO_CPU only on the
        CPU. A model that takes none of them is one error."""
        if isinstance(kv, KVConfig):
            return kv
        if kv != "auto":
            return preset(kv)
        if self._auto is None:
            why = ""
            for name in AUTO_ORDER:
                if name == AUTO_CPU and self.info.device != "cpu":
                    continue
                try:
                    self.kv_seq_bytes(preset(name), 1024)
                except (UnsupportedError, InvalidArgumentError) as e:
                    why = str(e)
                    continue
                self._auto = name
                break
            else:
                raise UnsupportedError(
                    f"{self.path}: --kv auto: no quantized preset fits this model ({', '.join(AUTO_ORDER)}; {why})"
                )
        return preset(self._auto)

    def fingerprint(self) -> int:
        """The fingerprint of the model file's tensor data (a calibration sidecar names it)."""
        out = ffi.new("uint64_t *")
        with self._lock:
            if self._model is None:
                raise InvalidArgumentError(f"{self.path}: the weights are closed")
            check(lib.ott_model_fingerprint(self._model, out))
        return out[0]

    def local_layers(self, n_ctx: int) -> frozenset[int]:
        """The layers a context of n_ctx tokens keeps in an fp16 ring of their sliding window:
        those whose window is shorter than the context (ott.h: ott_model_layer_window)."""
        return frozenset(il for il, w in enumerate(self.layer_windows) if 0 < w < n_ctx)

    def kv_footprint(
        self, kv: str | KVConfig, n_tokens: int, n_ctx: int | None = None, n_ubatch: int = 512
    ) -> Footprint:
        """The footprint of a `kv` cache for one sequence of n_tokens tokens of this model in a
        context of n_ctx (default: n_tokens) and n_ubatch, everything counted
        (reference/footprint.py; the extra pool at the most it can hold). Local layers count
        their fp16 ring."""
        i = self.info
        cfg = self.kv_config(kv)
        n_ctx = n_ctx or n_tokens
        return footprint(
            cfg,
            n_tokens,
            i.n_embd_head,
            i.n_head_kv,
            i.n_layer,
            self.local_layers(n_ctx),
            ring_rows(i.n_swa, n_ctx, n_ubatch),
        )

    def kv_seq_bytes(self, kv: str | KVConfig, n_ctx: int, n_ubatch: int = 512, prefill_fp16: bool = False) -> int:
        """Bytes a context of n_ctx tokens with a `kv` cache allocates at most for each of its
        sequences on these weights' device (ott.h: ott_kv_seq_bytes): the memory to plan with.
        Above the footprint, which counts the stored data alone: head-block arrays start on
        64-byte boundaries, the window ring and the pools are allocated whole."""
        cfg = self.kv_config(kv).for_head_dim(self.info.n_embd_head)
        cparams = ffi.new("ott_context_params *", lib.ott_context_default_params())
        cparams.n_ctx = n_ctx
        cparams.n_ubatch = n_ubatch
        _set_kv_params(cparams.kv, cfg, prefill_fp16)
        out = ffi.new("int64_t *")
        with self._lock:
            if self._model is None:
                raise InvalidArgumentError(f"{self.path}: the weights are closed")
            check(lib.ott_kv_seq_bytes(self._model, cparams, out))
        return int(out[0])

    def close(self) -> None:
        """Drop this handle on the weights: they are freed now, or when their last context is
        (each context holds them until it is freed)."""
        with self._lock:
            self._model = None


class Context:
    """A decoding context on loaded `Weights`: a KV cache for up to n_seq_max sequences of
    n_ctx tokens each, and the calls that evaluate batches in it."""

    def __init__(
        self,
        weights: Weights,
        *,
        n_ctx: int | None = None,
        n_seq_max: int = 1,
        n_ubatch: int = 512,
        n_threads: int | None = None,
        kv: str | KVConfig = "f16",
        prefill_fp16: bool = False,
        kv_calib: str | os.PathLike | None = None,
    ):
        """kv: a mode name (f16, kivi2, kivi4, ott2, ott4, ottr2, ottr2t, ottr2tr, ottr2tg, ottr3, or auto:
        Weights.kv_config) or a KVConfig, e.g.
        `preset("ott2").with_overrides(pool=8)`. prefill_fp16: a multi-token chunk attends in
        full precision and is quantized at the sequence's next single-token step.
        kv_calib: the calibration sidecar of a config with calibrated rotations (None: the
        model's `<model>.kvcalib.gguf`, see calibrate.py)."""
        self._lock = threading.RLock()  # one native call at a time (see _handle)
        self._ctx = None
        for name, value, optional in (
            ("n_ctx", n_ctx, True),
            ("n_seq_max", n_seq_max, False),
            ("n_ubatch", n_ubatch, False),
            ("n_threads", n_threads, True),
        ):
            if not (optional and value is None):
                _check_count(name, value)
        if weights._model is None:
            raise InvalidArgumentError(f"{weights.path}: the weights are closed")
        kv_cfg = weights.kv_config(kv)
        if prefill_fp16 and not kv_cfg.quantized:
            raise InvalidArgumentError("prefill_fp16 applies to a quantized KV cache, not to f16")
        self.kv_calib = _calibration_for(kv_cfg, weights.path, kv_calib)
        self.weights = weights
        # what the context decodes, described by its weights
        self.path, self.info, self.n_vocab = weights.path, weights.info, weights.n_vocab
        self.tokenizer, self.chat_template = weights.tokenizer, weights.chat_template
        self.metadata, self.tensors, self.tensor_types = weights.metadata, weights.tensors, weights.tensor_types

        # no n_ctx: the trained context, capped by the memory available (ctx_size.py)
        self.n_ctx_note: str | None = None
        if n_ctx is None:
            n_ctx = self._default_n_ctx(kv_cfg, n_seq_max, n_ubatch)
        cparams = ffi.new("ott_context_params *", lib.ott_context_default_params())
        cparams.n_ctx = n_ctx
        cparams.n_seq_max = n_seq_max
        cparams.n_ubatch = n_ubatch
        cparams.n_threads = n_threads or 0
        self.kv_config = kv_cfg.for_head_dim(self.info.n_embd_head)
        _set_kv_params(cparams.kv, self.kv_config, prefill_fp16)
        c_calib = ffi.NULL
        if self.kv_calib and self.kv_config.kvq:  # the tables, read here (kvq_calibration.py)
            tables = _kvq_tables(self.kv_config, self.kv_calib, weights)
            c_tables = ffi.from_buffer("float[]", tables)
            cparams.kv.kvq_tables = c_tables  # read during ott_context_init only
        elif self.kv_calib:
            c_calib = ffi.new("char[]", str(self.kv_calib).encode())
        cparams.kv.calib_path = c_calib  # read during ott_context_init only
        c_tier = ffi.from_buffer("float[]", weights.tier_scale()) if self.kv_config.tiered else ffi.NULL
        cparams.kv.tier_scale = c_tier  # read during ott_context_init only
        pctx = ffi.new("ott_context **")
        with weights._lock:
            model = weights._model
            if model is None:
                raise InvalidArgumentError(f"{weights.path}: the weights are closed")
            check(lib.ott_context_init(model, cparams, pctx))
        # The destructor holds the weights' handle: the weights are freed after their last context.
        self._ctx = ffi.gc(pctx[0], lambda ctx, _weights=model: lib.ott_context_free(ctx))
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.n_ubatch = n_ubatch
        self.kv = kv_mode_name(kv_cfg)
        self.prefill_fp16 = prefill_fp16

    def _default_n_ctx(self, kv_cfg: KVConfig, n_seq_max: int, n_ubatch: int) -> int:
        n_train = self.info.n_ctx_train
        kv_per_token = self.weights.kv_seq_bytes(kv_cfg, n_train, n_ubatch) / n_train
        per_token = context_bytes_per_token(kv_per_token * n_seq_max, self.info.n_head, n_ubatch)
        available = available_memory()
        n_ctx = default_n_ctx(n_train, per_token, available)
        if n_ctx < n_train:
            self.n_ctx_note = (
                f"context capped at {n_ctx} tokens of the trained {n_train}: "
                f"{n_train} would take ~{per_token * n_train / 2**30:.1f} GiB, "
                f"{available / 2**30:.1f} GiB are available"
            )
        return n_ctx

    # ---- text ---------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.weights.tokenize(text, add_special, parse_special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.weights.detokenize(ids)

    # ---- decoding -----------------------------------------------------------------------

    def decode_batch(
        self, tokens: Sequence[int], pos: Sequence[int], seq_ids: Sequence[int], want_logits: Sequence[bool]
    ) -> np.ndarray:
        """Evaluate one batch of (token, position, sequence); F32 [n_out, n_vocab] in batch order."""
        n = len(tokens)
        if not (len(pos) == len(seq_ids) == len(want_logits) == n):
            raise InvalidArgumentError("decode_batch: tokens, pos, seq_ids and want_logits differ in length")
        c_tok = ffi.new("int32_t[]", list(tokens))
        c_pos = ffi.new("int32_t[]", list(pos))
        c_seq = ffi.new("int32_t[]", list(seq_ids))
        c_out = ffi.new("int8_t[]", [1 if w else 0 for w in want_logits])
        batch = ffi.new("ott_batch *", {"n_tokens": n, "token": c_tok, "pos": c_pos, "seq_id": c_seq, "logits": c_out})
        ptr = ffi.new("float **")
        n_out = ffi.new("int32_t *")
        with self._handle() as ctx:  # the logits buffer is the context's until its next step
            check(lib.ott_decode(ctx, batch))
            check(lib.ott_get_logits(ctx, ptr, n_out))
            buf = ffi.buffer(ptr[0], n_out[0] * self.n_vocab * 4)
            return np.frombuffer(buf, dtype=np.float32).reshape(n_out[0], self.n_vocab).copy()

    def eval(self, tokens: Sequence[int], seq: int = 0, all_logits: bool = False) -> np.ndarray:
        """Append tokens to sequence `seq`; logits of the last token [n_vocab], or of all [n, n_vocab]."""
        if len(tokens) == 0:
            raise InvalidArgumentError("eval: no tokens")
        n = len(tokens)
        want = [True] * n if all_logits else [False] * (n - 1) + [True]
        with self._lock:  # the sequence's length and the step that appends to it, together
            start = self.seq_len(seq)
            out = self.decode_batch(tokens, range(start, start + n), [seq] * n, want)
        return out if all_logits else out[0]

    def seq_len(self, seq: int = 0) -> int:
        n = ffi.new("int32_t *")
        with self._handle() as ctx:
            check(lib.ott_seq_len(ctx, seq, n))
        return n[0]

    def truncate(self, seq: int = 0, n_keep: int = 0) -> None:
        """Keep the first n_keep tokens of sequence `seq` (0 clears it)."""
        with self._handle() as ctx:
            check(lib.ott_seq_truncate(ctx, seq, n_keep))

    def tokens_until_event(self, seq: int = 0) -> int | None:
        """Tokens sequence `seq` can take until the next quantization event fires (after the
        last of them); None when the cache never quantizes. Chunks of exactly this size, one
        `eval` each (n_ubatch at least as large), are decode-faithful: every token sees the
        cache token-by-token decoding would show it."""
        n = ffi.new("int32_t *")
        with self._handle() as ctx:
            check(lib.ott_seq_tokens_until_event(ctx, seq, n))
        return n[0] or None

    def kv_head_state(self, layer: int, seq: int, head: int) -> KVHeadState:
        """A copy of the raw stores of one KV head of a quantized cache (see KVHeadState)."""
        with self._lock:  # both exports see the same state
            return self._kv_head_state(layer, seq, head)

    def _kv_head_state(self, layer: int, seq: int, head: int) -> KVHeadState:
        st = ffi.new("ott_kv_head_state *")
        with self._handle() as ctx:
            check(lib.ott_kv_export(ctx, layer, seq, head, st))
        hd = self.info.n_embd_head
        arrays = {
            "blocks": np.zeros((st.n_blocks - st.n_recent, st.block_bytes), np.uint8),
            "sink_k": np.zeros((st.n_sink, hd), np.float16),
            "sink_v": np.zeros((st.n_sink, hd), np.float16),
            "pool_k": np.zeros((st.n_pool, hd), np.float16),
            "pool_v": np.zeros((st.n_pool, hd), np.float16),
            "pool_pos": np.zeros(st.n_pool, np.int32),
            "extra_k": np.zeros((st.n_extra, hd), np.float16),
            "extra_v": np.zeros((st.n_extra, hd), np.float16),
            "extra_pos": np.zeros(st.n_extra, np.int32),
            "window_k": np.zeros((st.n_window, hd), np.float16),
            "window_v": np.zeros((st.n_window, hd), np.float16),
            "recent": np.zeros((st.n_recent, st.recent_bytes), np.uint8),
        }
        ctypes = {np.uint8: "uint8_t *", np.float16: "uint16_t *", np.int32: "int32_t *"}
        for name, a in arrays.items():
            setattr(st, name, ffi.cast(ctypes[a.dtype.type], ffi.from_buffer(a)))
        with self._handle() as ctx:
            check(lib.ott_kv_export(ctx, layer, seq, head, st))
        return KVHeadState(
            n_tokens=st.n_tokens,
            tracing=bool(st.tracing),
            block_offsets=dict(zip(KVHeadState.BLOCK_ARRAYS, list(st.block_offsets))),
            recent_offsets=dict(zip(KVHeadState.BLOCK_ARRAYS, list(st.recent_offsets))),
            **arrays,
        )

    def copy_sequence(self, src: int, dst: int) -> None:
        """Make sequence `dst` a copy of sequence `src` (a shared prompt decoded once)."""
        with self._handle() as ctx:
            check(lib.ott_seq_copy(ctx, src, dst))

    def fingerprint(self) -> int:
        """The fingerprint of the model file's tensor data (Weights.fingerprint)."""
        return self.weights.fingerprint()

    def set_threads(self, n_threads: int) -> None:
        _check_count("n_threads", n_threads)
        with self._handle() as ctx:
            check(lib.ott_context_set_threads(ctx, n_threads))

    # ---- memory -------------------------------------------------------------------------

    def kv_stats(self) -> KVStats:
        st = ffi.new("ott_kv_stats *")
        with self._handle() as ctx:
            check(lib.ott_get_kv_stats(ctx, st))
        return _struct_to(KVStats, st)

    def set_profile(self, on: bool) -> None:
        """Start (resetting the counters) or stop timing graph nodes by kind; CPU only. While
        on, steps run as several smaller graphs and get slower."""
        with self._handle() as ctx:
            check(lib.ott_set_profile(ctx, 1 if on else 0))

    def profile(self) -> Profile:
        p = ffi.new("ott_profile *")
        with self._handle() as ctx:
            check(lib.ott_get_profile(ctx, p))
        return _struct_to(Profile, p)

    def kv_footprint(self, n_ctx: int | None = None) -> Footprint:
        """The cache's footprint for one sequence of n_ctx tokens (default: the context size)."""
        return self.weights.kv_footprint(self.kv_config, n_ctx or self.n_ctx, self.n_ctx, self.n_ubatch)

    def kv_bytes_per_token(self, n_ctx: int | None = None) -> int:
        """KV bytes one token occupies across all layers, at a context of n_ctx tokens."""
        return int(round(self.kv_footprint(n_ctx).bytes_per_token_per_layer * self.info.n_layer))

    @contextmanager
    def _handle(self):
        """The native context, held for the block: calls from other threads wait (the lock is
        reentrant, so a method may call another); a closed context is an error."""
        with self._lock:
            if self._ctx is None:
                raise InvalidArgumentError("the context is closed")
            yield self._ctx

    def close(self) -> None:
        """Free the context now (otherwise when garbage-collected). A call running in another
        thread finishes first; calls after close raise InvalidArgumentError."""
        with self._lock:
            if self._ctx is not None:
                ffi.release(self._ctx)
                self._ctx = None

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Model(Context):
    """Weights and one context of their own, the common case:
    `Model(path, n_ctx=2048, kv="ott2")`. Further contexts on the same weights:
    `Context(model.weights, ...)`."""

    def __init__(
        self,
        path: str | os.PathLike | Weights,
        *,
        n_ctx: int | None = None,
        n_seq_max: int = 1,
        n_ubatch: int = 512,
        n_threads: int | None = None,
        kv: str | KVConfig = "f16",
        prefill_fp16: bool = False,
        repack: bool = True,
        device: str | None = None,
        kv_calib: str | os.PathLike | None = None,
    ):
        """Arguments as `Weights` (path, repack, device) and `Context` (the rest); path may be
        loaded Weights instead, which the model then owns (repack and device unused)."""
        super().__init__(
            path if isinstance(path, Weights) else Weights(path, repack=repack, device=device),
            n_ctx=n_ctx,
            n_seq_max=n_seq_max,
            n_ubatch=n_ubatch,
            n_threads=n_threads,
            kv=kv,
            prefill_fp16=prefill_fp16,
            kv_calib=kv_calib,
        )

    def close(self) -> None:
        """Free the context and the weights now (otherwise when garbage-collected)."""
        super().close()
        self.weights.close()


@dataclass
class KVHeadState:
    """The stores of one KV head of one layer of one sequence (ott.h: ott_kv_export)."""

    BLOCK_ARRAYS = ("k_scale", "k_min", "v_scale", "v_min", "k_codes", "v_codes", "mask", "k_order")

    n_tokens: int
    tracing: bool  # the head still runs Outlier Token Tracing
    block_offsets: dict  # array name (BLOCK_ARRAYS) -> byte offset in a head-block
    blocks: np.ndarray  # uint8 [n_blocks - n_recent, block_bytes] head-blocks (native/src/kv/kv_layout.h)
    sink_k: np.ndarray  # fp16 [n_sink, head_dim]; likewise sink_v
    sink_v: np.ndarray
    pool_k: np.ndarray  # fp16 [n_pool, head_dim], ascending position
    pool_v: np.ndarray
    pool_pos: np.ndarray  # int32 [n_pool]
    extra_k: np.ndarray  # fp16 [n_extra, head_dim], eviction order
    extra_v: np.ndarray
    extra_pos: np.ndarray  # int32 [n_extra]
    window_k: np.ndarray  # fp16 [n_window, head_dim], the most recent positions
    window_v: np.ndarray
    recent_offsets: dict  # as block_offsets, in a recent head-block
    recent: np.ndarray  # uint8 [n_recent, recent_bytes] the newest blocks, 4-bit (KVConfig.recent)


def _calibration_for(cfg: KVConfig, model_path: Path, given: str | os.PathLike | None) -> Path | None:
    """The sidecar a config needs: the one given, else the model's default; None when the
    config needs none (a sidecar given then is an error: nothing reads it)."""
    if not cfg.calibrated:
        if given is not None:
            raise InvalidArgumentError(
                f"{given}: a calibration sidecar is read only by calibrated rotations and the KVQuant cache"
            )
        return None
    path = Path(given) if given is not None else default_calibration(model_path)
    if not path.is_file():
        needs = "the KVQuant cache needs" if cfg.kvq else "a calibrated rotation needs"
        how = "python -m ott_gguf calibrate MODEL -f TEXT" + (" --kvquant" if cfg.kvq else "")
        raise ModelFileError(
            f"{path}: no calibration sidecar there"
            + ("" if given is not None else f" ({needs} one beside the model: {how})")
        )
    return path


# KVConfig knobs that are not fields of ott_kv_params: the scheme is its type, and uniform
# or Q-Norm levels are a choice of the tables (_kvq_tables)
_PYTHON_KNOBS = ("kvq", "uniform", "qnorm")


def _set_kv_params(c_kv, cfg: KVConfig, prefill_fp16: bool) -> None:
    """Fill an ott_kv_params from a validated KVConfig."""
    if cfg.quantized:
        c_kv.type = lib.OTT_KV_KVQUANT if cfg.kvq else lib.OTT_KV_KIVI if cfg.pool == 0 else lib.OTT_KV_OTT
        for f in fields(KVConfig):
            if f.name not in _PYTHON_KNOBS:
                setattr(c_kv, f.name, getattr(cfg, f.name))
        c_kv.prefill_fp16 = int(prefill_fp16)
    else:
        c_kv.type = lib.OTT_KV_F16


def check_kvq_sidecar(cfg: KVConfig, given: str | os.PathLike, weights: Weights) -> None:
    """Read the KVQuant tables of the sidecar given for these weights; a missing, foreign or
    malformed one is the error a context would raise."""
    _kvq_tables(cfg, _calibration_for(cfg, weights.path, given), weights)


def _kvq_tables(cfg: KVConfig, sidecar: Path, weights: Weights) -> np.ndarray:
    """ott_kv_params.kvq_tables of a KVQuant config from the calibration sidecar of these
    weights: per layer k_lo, k_hi [n_head_kv][head_dim], levels_k, levels_v (float32, one
    flat array). A sidecar of another model file is one error."""
    from .kvq_calibration import open_sidecar, read_sidecar

    info = weights.info
    field = open_sidecar(sidecar).fields.get("ott.calib.model_hash")
    theirs, ours = (str(field.contents()) if field else "-"), f"{weights.fingerprint():016x}"
    if theirs != ours:
        raise InvalidArgumentError(
            f"{sidecar}: calibration sidecar is for another model file (model hash {theirs}, this file {ours})"
        )
    parts = []
    for il, layer in enumerate(read_sidecar(sidecar, info.n_layer).layers(cfg)):
        if layer.k_lo.shape != (info.n_head_kv, info.n_embd_head) or layer.k_hi.shape != layer.k_lo.shape:
            raise ModelFileError(
                f"{sidecar}: KVQuant key thresholds of layer {il} are {list(layer.k_lo.shape)}, "
                f"expected [{info.n_head_kv}, {info.n_embd_head}]"
            )
        parts += [layer.k_lo, layer.k_hi, layer.levels_k, layer.levels_v]
    return np.ascontiguousarray(np.concatenate([np.ravel(p) for p in parts]), dtype=np.float32)


def kv_mode_name(cfg: KVConfig) -> str:
    """The preset a KVConfig equals (f16, kivi2, ott2 ...), or "custom"."""
    return next((name for name, preset_cfg in PRESETS.items() if preset_cfg == cfg), "custom")


def physical_cores() -> int:
    return lib.ott_physical_cores()


def cuda_device_count() -> int:
    """CUDA devices this build can run on (0 without CUDA support or without a GPU)."""
    return lib.ott_cuda_device_count()


def set_cpu_x8_vnni(on: bool | None) -> bool:
    """For the whole process: whether the weights stored as 8 interleaved rows (`Weights(x8=True)`)
    are multiplied by the kernels of AVX-512 VNNI (the default where the CPU has it) or of AVX2,
    with the same results either way (ott.h: ott_set_cpu_x8_vnni); None asks without changing it.
    UnsupportedError for True where the CPU lacks AVX-512 VNNI; returns the setting now in effect."""
    out = ffi.new("int32_t *")
    check(lib.ott_set_cpu_x8_vnni(-1 if on is None else 1 if on else 0, out))
    return bool(out[0])


def set_cpu_int_dots(on: bool | None) -> bool:
    """For the whole process: whether the CPU attention of a quantized cache multiplies 1-, 2-
    and 4-bit codes by 16-bit integer multiply-adds (AVX-512 VNNI, the default where the CPU has
    it) or in float (ott.h: ott_set_cpu_int_dots); None asks without changing it.
    UnsupportedError for True where the CPU lacks them; returns the setting now in effect."""
    out = ffi.new("int32_t *")
    check(lib.ott_set_cpu_int_dots(-1 if on is None else 1 if on else 0, out))
    return bool(out[0])
