"""Write a GGUF with the shapes of Llama-2-7B and random F16 weights (real 7B weights are not
available offline; decode speed does not depend on their values).

    python bench/llama7b_gguf.py OUT.gguf [--n-ctx-train 32768] [--n-head-kv 8]

32 layers, n_embd 4096, 32 heads (no GQA; `--n-head-kv 8` gives Llama-3-8B's grouping of
8 KV heads), n_ff 11008, n_vocab 32000: 6.74 G parameters, 13.5 GB. Tensors are streamed
one at a time (at most one tensor in memory, ~260 MB): the header and tensor index are
written first, then each tensor's data. Values are slices of a pool of N(0, 1) draws
scaled by 1/sqrt(n_in) (one pool per fan-in), so activations keep unit scale. The vocabulary
is a byte-level BPE alphabet padded with filler tokens ("[PAD123]"): normal tokens, so that
the text a server streams from random weights is visible.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType

N_EMBD, N_LAYER, N_HEAD, N_FF, N_VOCAB = 4096, 32, 32, 11008, 32000
POOL = 1 << 27  # random fp16 values shared by every tensor (256 MB)
NAME = "random-llama-2-7b-shape"  # general.name of the files written here


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> unicode mapping: printable bytes stand for themselves, the others get
    the code points 256, 257, ... in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    out, shifted = [], 256
    for b in range(256):
        out.append(chr(b) if b in printable else chr(shifted))
        shifted += b not in printable
    return out


def tensor_list(n_layer: int, n_head_kv: int = N_HEAD) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, numpy shape [n_out, n_in] or [n], n_in for the scale; 0 = a norm vector)."""
    out = [("token_embd.weight", (N_VOCAB, N_EMBD), N_EMBD)]
    n_embd_kv = N_EMBD // N_HEAD * n_head_kv
    for il in range(n_layer):
        b = f"blk.{il}"
        out += [
            (f"{b}.attn_norm.weight", (N_EMBD,), 0),
            (f"{b}.attn_q.weight", (N_EMBD, N_EMBD), N_EMBD),
            (f"{b}.attn_k.weight", (n_embd_kv, N_EMBD), N_EMBD),
            (f"{b}.attn_v.weight", (n_embd_kv, N_EMBD), N_EMBD),
            (f"{b}.attn_output.weight", (N_EMBD, N_EMBD), N_EMBD),
            (f"{b}.ffn_norm.weight", (N_EMBD,), 0),
            (f"{b}.ffn_gate.weight", (N_FF, N_EMBD), N_EMBD),
            (f"{b}.ffn_up.weight", (N_FF, N_EMBD), N_EMBD),
            (f"{b}.ffn_down.weight", (N_EMBD, N_FF), N_FF),
        ]
    return out + [("output_norm.weight", (N_EMBD,), 0), ("output.weight", (N_VOCAB, N_EMBD), N_EMBD)]


def write(path: Path, n_ctx_train: int = 32768, n_layer: int = N_LAYER, n_head_kv: int = N_HEAD, seed: int = 0) -> Path:
    if n_head_kv <= 0 or N_HEAD % n_head_kv:
        raise SystemExit(f"error: --n-head-kv {n_head_kv} does not divide the {N_HEAD} heads")
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal(POOL, dtype=np.float32)
    pools = {n: (normal / np.sqrt(n)).astype(np.float16) for n in (N_EMBD, N_FF)}  # one per fan-in
    del normal

    tokens = byte_alphabet() + ["Ġt", "<|endoftext|>"]
    types = [TokenType.NORMAL] * (len(tokens) - 1) + [TokenType.CONTROL]
    types += [TokenType.NORMAL] * (N_VOCAB - len(tokens))  # random weights pick these: visible text
    tokens += [f"[PAD{i}]" for i in range(len(tokens), N_VOCAB)]

    w = GGUFWriter(str(path), "llama")
    w.add_name(NAME)
    w.add_file_type(LlamaFileType.MOSTLY_F16)
    w.add_block_count(n_layer)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(N_VOCAB)
    w.add_rope_dimension_count(N_EMBD // N_HEAD)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([int(t) for t in types])
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)

    tensors = tensor_list(n_layer, n_head_kv)
    for name, shape, n_in in tensors:
        dtype = np.float16 if n_in else np.float32
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(
            name,
            shape,
            np.dtype(dtype),
            nbytes,
            raw_dtype=GGMLQuantizationType.F16 if n_in else GGMLQuantizationType.F32,
        )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _name, shape, n_in in tensors:
        n = int(np.prod(shape))
        if n_in == 0:
            data = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        else:
            pool = pools[n_in]
            start = int(rng.integers(0, POOL - 1))
            part = pool[start : start + n]
            data = np.concatenate([part, pool[: n - len(part)]]) if len(part) < n else part
        w.write_tensor_data(data.reshape(shape))
    w.close()
    return path


def written_here(path: Path) -> bool:
    """Whether the GGUF at path is one this script wrote (its general.name)."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).get_field("general.name")
    return field is not None and field.contents() == NAME


def ensure(path: Path, kv_modes: list[str] = ()) -> Path:
    """path, written with the defaults above first when it does not exist (the benchmarks' --model),
    and, for a model written here, its calibration sidecar `<path>.kvcalib.gguf` when one of
    kv_modes is a KVQuant mode and none is there: made-up tables (tests/make_gguf.py), which time
    the cache as real ones would (random weights have nothing to calibrate). A real model's
    sidecar comes from `python -m ott_gguf calibrate`; none is made up beside it."""
    import time

    if not path.exists():
        t = time.perf_counter()
        write(path)
        print(f"wrote {path} in {time.perf_counter() - t:.0f} s", flush=True)
    from ott_gguf.model import default_calibration
    from ott_gguf.reference.config import mode_config

    sidecar = default_calibration(path)
    wanted = any(mode_config(m).kvq for m in kv_modes)  # a preset's name, or a preset with knobs
    if wanted and not sidecar.exists() and written_here(path):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from make_gguf import write_kvq_sidecar

        write_kvq_sidecar(path, sidecar)
        print(f"wrote {sidecar} (made-up KVQuant tables, for speed only)", flush=True)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--n-ctx-train", type=int, default=32768)
    ap.add_argument("--n-layer", type=int, default=N_LAYER, help="fewer layers for a quick check (default 32)")
    ap.add_argument("--n-head-kv", type=int, default=N_HEAD, help=f"KV heads (default {N_HEAD}: no GQA)")
    args = ap.parse_args(argv)
    write(args.out, args.n_ctx_train, args.n_layer, args.n_head_kv)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
