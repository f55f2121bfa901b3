"""Peak memory of the converter on a 1.1B-parameter random llama checkpoint.

    python bench/convert_memory.py [--outtypes f16,q8_0] [--tmp DIR]

Writes a random LlamaForCausalLM checkpoint of TinyLlama's shape (22 layers, n_embd 2048,
n_ff 5632, 32 heads / 4 KV heads, n_vocab 32000; F16 weights in two safetensors shards with an
index, a byte-level BPE tokenizer.json) into a temporary directory, converts it once per output
type in a child process, and reports the child's peak resident memory beside the checkpoint
size, its largest tensor and the peak of a child that only imports the converter. The peak is
the child's own VmHWM, read at its exit (ru_maxrss of a child would include the parent's pages
it had before exec). Everything written is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parent.parent
N_LAYER, N_EMBD, N_FF, N_HEAD, N_HEAD_KV, N_VOCAB = 22, 2048, 5632, 32, 4, 32000


def layer_tensors(il: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    n_kv = N_HEAD_KV * N_EMBD // N_HEAD
    shapes = {
        "self_attn.q_proj.weight": (N_EMBD, N_EMBD),
        "self_attn.k_proj.weight": (n_kv, N_EMBD),
        "self_attn.v_proj.weight": (n_kv, N_EMBD),
        "self_attn.o_proj.weight": (N_EMBD, N_EMBD),
        "mlp.gate_proj.weight": (N_FF, N_EMBD),
        "mlp.up_proj.weight": (N_FF, N_EMBD),
        "mlp.down_proj.weight": (N_EMBD, N_FF),
        "input_layernorm.weight": (N_EMBD,),
        "post_attention_layernorm.weight": (N_EMBD,),
    }
    return {
        f"model.layers.{il}.{name}": (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
        for name, shape in shapes.items()
    }


def write_checkpoint(directory: Path) -> tuple[int, int]:
    """Returns (parameter count, bytes of the largest tensor)."""
    rng = np.random.default_rng(0)
    shards = {
        "model-00001-of-00002.safetensors": range(0, N_LAYER // 2),
        "model-00002-of-00002.safetensors": range(N_LAYER // 2, N_LAYER),
    }
    weight_map, n_params, largest = {}, 0, 0
    for file, layers in shards.items():
        tensors = {}
        for il in layers:
            tensors |= layer_tensors(il, rng)
        if layers.start == 0:
            tensors["model.embed_tokens.weight"] = (
                rng.standard_normal((N_VOCAB, N_EMBD), dtype=np.float32) * 0.02
            ).astype(np.float16)
        else:
            tensors["model.norm.weight"] = np.ones(N_EMBD, dtype=np.float16)
            tensors["lm_head.weight"] = (rng.standard_normal((N_VOCAB, N_EMBD), dtype=np.float32) * 0.02).astype(
                np.float16
            )
        save_file(tensors, str(directory / file))
        weight_map |= {name: file for name in tensors}
        n_params += sum(a.size for a in tensors.values())
        largest = max(largest, max(a.nbytes for a in tensors.values()))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": N_EMBD,
                "intermediate_size": N_FF,
                "num_hidden_layers": N_LAYER,
                "num_attention_heads": N_HEAD,
                "num_key_value_heads": N_HEAD_KV,
                "vocab_size": N_VOCAB,
                "max_position_embeddings": 2048,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
                "torch_dtype": "float16",
            }
        )
    )
    # byte-level BPE: the 256 byte symbols, then distinct made-up tokens up to n_vocab
    byte_symbols = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(256 + i) for i in range(256 - 94)]
    vocab = {t: i for i, t in enumerate(byte_symbols + [f"tok{i}" for i in range(N_VOCAB - 256)])}
    (directory / "tokenizer.json").write_text(
        json.dumps(
            {
                "added_tokens": [],
                "normalizer": None,
                "pre_tokenizer": {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": True,
                },
                "decoder": {"type": "ByteLevel"},
                "model": {"type": "BPE", "vocab": vocab, "merges": []},
            }
        )
    )
    return n_params, largest


# runs the converter's CLI with the given arguments (none: only imports it), then prints VmHWM
CHILD = """
import sys
import convert
if sys.argv[1:]:
    convert.main(sys.argv[1:])
print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])
"""


def peak_rss_of(args: list[str]) -> tuple[float, float]:
    """Convert with CLI `args` in a child process; (its peak RSS in MiB, wall seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"convert {' '.join(args)} failed: {proc.stderr[-2000:]}")
    return int(proc.stdout.split()[-1]) / 1024, wall  # VmHWM is in kB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--outtypes", default="f16,q8_0")
    p.add_argument("--tmp", default=None, help="where to write the checkpoint (default: system temp dir)")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="convert-memory-", dir=args.tmp))
    try:
        ckpt = work / "llama-1b"
        ckpt.mkdir()
        t0 = time.perf_counter()
        n_params, largest = write_checkpoint(ckpt)
        size = sum(f.stat().st_size for f in ckpt.iterdir())
        print(
            f"checkpoint: {n_params / 1e9:.2f}B parameters, F16, {size / 2**30:.2f} GiB on disk, "
            f"largest tensor {largest / 2**20:.0f} MiB (written in {time.perf_counter() - t0:.0f} s)"
        )
        base, _ = peak_rss_of([])
        print(f"{'import only':>12}: peak RSS {base:7.0f} MiB")
        for outtype in args.outtypes.split(","):
            out = work / f"out-{outtype}.gguf"
            rss, wall = peak_rss_of([str(ckpt), str(out), "--outtype", outtype])
            print(
                f"{outtype:>12}: peak RSS {rss:7.0f} MiB ({(rss - base) / (largest / 2**20):.1f} x largest "
                f"tensor above import), output {out.stat().st_size / 2**30:.2f} GiB, {wall:.0f} s"
            )
            out.unlink()
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
