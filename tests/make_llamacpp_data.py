"""Rebuild the llama.cpp reference data in tests/data/ from a llama.cpp build.

    python tests/make_llamacpp_data.py LLAMA_CPP_BIN [--models DIR] [--wikitext FILE]

- tokenizer/<name>.json: for each string of tokenizer_strings.json (ours), the ids from
  `llama-tokenize --stdin --ids --no-escape`, with special-token parsing off (`ids`) and on
  (`ids_parse_special`);
- perplexity.json: `llama-perplexity` on WikiText-2 raw test, f16 KV cache, non-overlapping
  windows (the second half of each scored), one entry per model and window size.

The tests read these files only; they never run llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
sys.path.insert(0, str(HERE))

from wikitext import wikitext2_test  # noqa: E402

TOKENIZER_MODELS = {
    "smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
}
# (name in the tests, file, window, windows): the runs the perplexity tests compare against
PERPLEXITY_RUNS = [
    ("SmolLM2-135M-Instruct Q4_1", "SmolLM2-135M-Instruct.Q4_1.gguf", 512, 20),
    ("Qwen2.5-Coder-0.5B-Instruct Q4_K_M", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 512, 20),
    ("Gemma-3-270M Q4_K_M", "gemma-3-270m-q4_k_m.gguf", 2048, 5),
]


def _version(bin_dir: Path) -> str:
    out = subprocess.run([bin_dir / "llama-tokenize", "--version"], capture_output=True, text=True)
    m = re.search(r"build (\d+), commit (\w+)", out.stdout + out.stderr)
    return f"build {m.group(1)} ({m.group(2)})" if m else "unknown"


def tokenize(bin_dir: Path, model: Path, text: str, parse_special: bool) -> list[int]:
    cmd = [bin_dir / "llama-tokenize", "-m", model, "--stdin", "--ids", "--no-escape", "--log-disable"]
    if not parse_special:
        cmd.append("--no-parse-special")
    out = subprocess.run(cmd, input=text.encode("utf-8"), capture_output=True, check=True)
    return json.loads(out.stdout.decode("utf-8").strip().splitlines()[-1])


def make_tokenizer(bin_dir: Path, models: Path, version: str) -> None:
    strings = json.loads((DATA / "tokenizer_strings.json").read_text(encoding="utf-8"))
    (DATA / "tokenizer").mkdir(exist_ok=True)
    for name, file in TOKENIZER_MODELS.items():
        cases = [
            {
                "text": s,
                "ids": tokenize(bin_dir, models / file, s, False),
                "ids_parse_special": tokenize(bin_dir, models / file, s, True),
            }
            for s in strings
        ]
        doc = {
            "producer": f"llama.cpp {version} llama-tokenize --stdin --ids --no-escape [--no-parse-special]",
            "model": file,
            "cases": cases,
        }
        (DATA / "tokenizer" / f"{name}.json").write_text(
            json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
        )
        print(f"tokenizer/{name}.json: {len(cases)} strings")


def make_perplexity(bin_dir: Path, models: Path, wikitext: Path, version: str) -> None:
    runs = []
    for name, file, n_ctx, chunks in PERPLEXITY_RUNS:
        cmd = [
            bin_dir / "llama-perplexity",
            "-m",
            models / file,
            "-f",
            wikitext,
            "-c",
            str(n_ctx),
            "--chunks",
            str(chunks),
            "-t",
            "2",
            "-fa",
            "on",
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out.stdout + out.stderr)
        runs.append(
            {
                "model": name,
                "file": file,
                "n_ctx": n_ctx,
                "chunks": chunks,
                "kv": "f16",
                "ppl": float(m.group(1)),
                "err": float(m.group(2)),
            }
        )
        print(f"{name} -c {n_ctx} --chunks {chunks}: {m.group(1)} +/- {m.group(2)}")
    doc = {
        "producer": f"llama.cpp {version} llama-perplexity -f wiki.test.raw -c N --chunks K -t 2 -fa on (CPU)",
        "runs": runs,
    }
    (DATA / "perplexity.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bin_dir", type=Path, help="llama.cpp's build/bin")
    ap.add_argument("--models", type=Path, default=HERE.parent / ".dev" / "models")
    ap.add_argument("--wikitext", type=Path, default=None, help="wiki.test.raw (default: tests/wikitext.py)")
    ap.add_argument("--only", choices=["tokenizer", "perplexity"])
    args = ap.parse_args()
    version = _version(args.bin_dir)
    if args.only != "perplexity":
        make_tokenizer(args.bin_dir, args.models, version)
    if args.only != "tokenizer":
        make_perplexity(args.bin_dir, args.models, args.wikitext or wikitext2_test(), version)


if __name__ == "__main__":
    main()
