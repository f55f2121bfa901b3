"""The tiny random Qwen3, Gemma 3 and Phi-3 checkpoints of the architecture tests, and the
llama.cpp results on their GGUF files kept in data/llamacpp_tiny_archs.json.

    python tests/tiny_archs.py LLAMA_CPP_BIN_DIR [WIKI_TEST_RAW]

rebuilds the checkpoints, converts them (f32) and records llama.cpp's perplexity
(`llama-perplexity -c 64 --chunks 8 -t 2 -fa on` on the first PPL_BYTES of WikiText-2) and
token ids (`llama-tokenize --ids --no-escape`, with and without --no-parse-special) into the
fixture file. The weights are drawn with numpy's seeded generator (convert_checkpoints.py),
so the files are the same wherever they are built.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from convert_checkpoints import tiny_gemma3_checkpoint, tiny_phi3_checkpoint, tiny_qwen3_checkpoint  # noqa: E402

FIXTURE = HERE / "data" / "llamacpp_tiny_archs.json"
PPL_CTX, PPL_CHUNKS, PPL_BYTES = 64, 8, 6000

# name -> checkpoint builder. llama.cpp runs Phi-3 without its sliding window (it disables it),
# so the files it checks have none; "phi3-window" is checked against transformers only.
CHECKPOINTS: dict[str, Callable[[Path], dict]] = {
    "qwen3": tiny_qwen3_checkpoint,
    "gemma3": tiny_gemma3_checkpoint,
    "phi3": lambda d: tiny_phi3_checkpoint(d, sliding_window=None),
    "phi4-mini": lambda d: tiny_phi3_checkpoint(d, sliding_window=None, bpe=True),
    "phi3-window": tiny_phi3_checkpoint,
}
LLAMACPP_CHECKED = ("qwen3", "gemma3", "phi3", "phi4-mini")

TOKENIZER_TEXTS = [
    "the cat in the hat",
    " leading space",
    "two  spaces   three",
    "line one\nline two\n\n\ttab",
    "digits 1234567 and 3.14159",
    "naïve café 東京 🙂",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "<|user|>\nthe cat<|end|>\n<|assistant|>\n",
    "<|im_start|>user\nthe hat<|im_end|>\n",
    "    indented():\n        return 1",
    "DON'T shout, they're HERE",
]


def build(name: str, root: Path) -> Path:
    """Checkpoint `name` under root, converted to root/name.gguf (f32); returns the GGUF path."""
    import convert

    directory = root / name
    CHECKPOINTS[name](directory)
    out = root / f"{name}.gguf"
    if convert.main([str(directory), str(out), "--outtype", "f32"]) != 0:
        raise RuntimeError(f"converting {directory} failed")
    return out


def _llamacpp(bin_dir: Path, tool: str, args: list[str], stdin: str | None = None) -> str:
    with tempfile.TemporaryFile("w+", encoding="utf-8") as log:
        subprocess.run(
            [str(bin_dir / tool), *args],
            input=stdin,
            stdin=None if stdin is not None else subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            check=True,
        )
        log.seek(0)
        return log.read()


def record(bin_dir: Path, wiki: Path) -> dict:
    fixture = {
        "command": {
            "perplexity": f"llama-perplexity -c {PPL_CTX} --chunks {PPL_CHUNKS} -t 2 -fa on",
            "text_bytes": PPL_BYTES,
        },
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "text.txt"
        text.write_bytes(wiki.read_bytes()[:PPL_BYTES])
        for name in LLAMACPP_CHECKED:
            gguf = build(name, Path(tmp))
            for _ in range(20):  # llama.cpp's logger thread sometimes loses the last lines at exit
                out = _llamacpp(
                    bin_dir,
                    "llama-perplexity",
                    [
                        "-m",
                        str(gguf),
                        "-f",
                        str(text),
                        "-c",
                        str(PPL_CTX),
                        "--chunks",
                        str(PPL_CHUNKS),
                        "-t",
                        "2",
                        "-fa",
                        "on",
                    ],
                )
                if found := re.search(r"Final estimate: PPL = ([\d.e+]+)", out):
                    break
            ppl = float(found[1])
            ids = {}
            for parse in (False, True):
                for t in TOKENIZER_TEXTS:
                    args = ["-m", str(gguf), "--stdin", "--ids", "--no-escape", "--log-disable"]
                    line = _llamacpp(bin_dir, "llama-tokenize", args + ([] if parse else ["--no-parse-special"]), t)
                    ids.setdefault("parse_special" if parse else "plain", []).append(
                        json.loads(line.strip().splitlines()[-1])
                    )
            fixture["models"][name] = {"ppl": ppl, "ids": ids}
    return fixture


if __name__ == "__main__":
    bin_dir = Path(sys.argv[1])
    wiki = (
        Path(sys.argv[2])
        if len(sys.argv) > 2
        else HERE.parent.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
    )
    FIXTURE.write_text(json.dumps(record(bin_dir, wiki), ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE}")
