"""The malformed-GGUF corpus (tests/malformed_gguf.py): every case ends in one line, an
error or a clean run, never a traceback or an abort. It runs in a child process so that an
abort names the case instead of ending the test session."""

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from make_gguf import write_random_model
from malformed_gguf import KV, corpus, parse, run_case, serialize

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_random_model(
        tmp_path_factory.mktemp("corpus") / "base.gguf",
        arch="llama",
        n_embd=32,
        n_head=2,
        n_head_kv=1,
        n_ff=32,
        n_layer=1,
        dtype="f32",
    )


def test_corpus_has_every_class(base):
    names = [name for name, _ in corpus(base.read_bytes())]
    assert len(names) >= 300 and len(set(names)) == len(names)
    for prefix in (
        "truncate@",
        "bitflip",
        "huge:",
        "kvtype:",
        "ttype:",
        "offset:",
        "shape:",
        "missing-key:",
        "missing-tensor:",
        "value:",
        "count:",
    ):
        assert any(n.startswith(prefix) for n in names), prefix


def test_every_case_ends_cleanly(base):
    env = dict(
        os.environ, PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""), GGML_NO_BACKTRACE="1"
    )
    proc = subprocess.run(
        [sys.executable, str(HERE / "malformed_gguf.py"), str(base)], capture_output=True, env=env, timeout=900
    )
    lines = proc.stdout.decode("utf-8", "replace").splitlines()
    assert proc.returncode == 0, (
        f"exit {proc.returncode} at case {lines[-1] if lines else '?'!r}: "
        f"{proc.stderr.decode(errors='replace')[-2000:]}"
    )
    results = dict(line.split(": ", 1) for line in lines[:-1])
    assert lines[-1] == f"{len(results)} cases, 0 tracebacks"
    assert all(r == "ok" or r.startswith("error: ") for r in results.values())
    assert results["valid"] == "ok"
    # a file cut short anywhere, or declaring more than it holds, is an error
    assert all(r.startswith("error: ") for n, r in results.items() if n.startswith(("truncate@", "huge:")))
    assert results["value:llama.rope.dimension_count=15"].endswith("rope.dimension_count 15 is odd")


def test_a_key_with_control_bytes_is_escaped_in_the_message(base, tmp_path):
    """The message that names a key from the file stays one line: its control bytes escaped
    (native/src/ott.cpp), a long key cut at 64 bytes (gguf_scan.cpp)."""
    g = parse(base.read_bytes())
    for key, shown in ((b"bad\nkey\x01", "bad\\nkey\\x01"), (b"k" * 70 + b"\n", "k" * 64 + "...")):
        g.kvs.append(KV(key, 4, 7))  # a UINT32
        data = bytearray(serialize(g))
        at = data.index(key) + len(key)
        data[at : at + 4] = struct.pack("<I", 99)  # its value type: unknown
        g.kvs.pop()
        path = tmp_path / "case.gguf"
        path.write_bytes(bytes(data))
        assert run_case(path).endswith(f"metadata '{shown}': unknown value type (at byte {at + 4})")
