"""A corpus of malformed GGUF files, generated from one small valid model, and a runner that
loads each one and reports how it ended.

Cases (`corpus(base)`, several hundred, each a (name, bytes) pair; nothing stored):
- truncations at every structural offset of the file (header fields, each key, type, value,
  array header, the first and last array items, each tensor-info field, the data section);
- bit flips at seeded positions of the header;
- huge counts and lengths (key, string and array lengths, n_kv, n_tensors, n_dims, dims);
- bad value types, bad tensor types;
- bad, overlapping, misaligned and out-of-file tensor offsets; inconsistent shapes;
- missing keys, missing tensors;
- the hostile hyper-parameters and tokenizer types of tests/test_hostile_gguf.py;
- fuzzer findings kept as recipes (tests/data/fuzz_regressions.json, see bench/fuzz_gguf.py).

`python tests/malformed_gguf.py BASE.gguf` (or `--cases N` to stop early) runs every case in
this process: it loads the file, and when that works decodes three tokens, then prints one
line per case, `name: ok` or `name: error: <message>`. A case that raises anything but an
OttError prints `name: TRACEBACK ...` and the runner exits 1; one that aborts the process
leaves `name: ...` as the last line it printed. The tests and the sanitizer script run it
as a child process.
"""

from __future__ import annotations

import json
import random
import struct
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REGRESSIONS = HERE / "data" / "fuzz_regressions.json"

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9


@dataclass
class KV:
    key: bytes
    type: int
    value: object  # scalar, bytes (string), or (elem_type, [items]) for arrays


@dataclass
class TensorInfo:
    name: bytes
    dims: list[int]
    type: int
    offset: int


@dataclass
class GGUF:
    version: int
    kvs: list[KV]
    tensors: list[TensorInfo]
    data: bytes
    alignment: int = 32
    marks: list[int] = field(default_factory=list)  # structural offsets of the serialized file


def _read_value(buf: bytes, pos: int, t: int):
    if t == STRING:
        n = struct.unpack_from("<Q", buf, pos)[0]
        return buf[pos + 8 : pos + 8 + n], pos + 8 + n
    if t == ARRAY:
        et, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        items = []
        for _ in range(n):
            v, pos = _read_value(buf, pos, et)
            items.append(v)
        return (et, items), pos
    fmt = _SCALAR[t]
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)


def parse(buf: bytes) -> GGUF:
    """A well-formed GGUF file (the base of the corpus), field by field."""
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    pos, kvs, tensors = 24, [], []
    for _ in range(n_kv):
        n = struct.unpack_from("<Q", buf, pos)[0]
        key = buf[pos + 8 : pos + 8 + n]
        t = struct.unpack_from("<I", buf, pos + 8 + n)[0]
        value, pos = _read_value(buf, pos + 12 + n, t)
        kvs.append(KV(key, t, value))
    for _ in range(n_tensors):
        n = struct.unpack_from("<Q", buf, pos)[0]
        name = buf[pos + 8 : pos + 8 + n]
        pos += 8 + n
        n_dims = struct.unpack_from("<I", buf, pos)[0]
        dims = list(struct.unpack_from(f"<{n_dims}Q", buf, pos + 4))
        pos += 4 + 8 * n_dims
        t, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        tensors.append(TensorInfo(name, dims, t, offset))
    alignment = next((kv.value for kv in kvs if kv.key == b"general.alignment"), 32)
    start = (pos + alignment - 1) // alignment * alignment
    return GGUF(version, kvs, tensors, buf[start:], alignment)


def _write_value(out: bytearray, marks: list[int], t: int, v, top: bool = True) -> None:
    if t == STRING:
        out += struct.pack("<Q", len(v)) + v
    elif t == ARRAY:
        et, items = v
        out += struct.pack("<IQ", et, len(items))
        for i, item in enumerate(items):
            if top and (i < 2 or i == len(items) - 1):
                marks.append(len(out))
            _write_value(out, marks, et, item, top=False)
    else:
        out += struct.pack(_SCALAR[t], v)


def serialize(g: GGUF, n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    """The file of `g`; `g.marks` gets its structural offsets. n_kv / n_tensors: counts to
    declare instead of the real ones."""
    out, marks = bytearray(b"GGUF"), []
    for fmt, v in (
        ("<I", g.version),
        ("<Q", len(g.tensors) if n_tensors is None else n_tensors),
        ("<Q", len(g.kvs) if n_kv is None else n_kv),
    ):
        marks.append(len(out))
        out += struct.pack(fmt, v)
    for kv in g.kvs:
        marks.append(len(out))
        out += struct.pack("<Q", len(kv.key)) + kv.key
        marks.append(len(out))
        out += struct.pack("<I", kv.type)
        marks.append(len(out))
        _write_value(out, marks, kv.type, kv.value)
    for t in g.tensors:
        marks.append(len(out))
        out += struct.pack("<Q", len(t.name)) + t.name
        marks.append(len(out))
        out += struct.pack("<I", len(t.dims)) + struct.pack(f"<{len(t.dims)}Q", *t.dims)
        marks.append(len(out))
        out += struct.pack("<IQ", t.type, t.offset)
    marks.append(len(out))
    out += bytes(-len(out) % g.alignment)
    marks += [len(out), len(out) + len(g.data) // 2, len(out) + len(g.data) - 1]
    out += g.data
    g.marks = marks
    return bytes(out)


def _with_kv(g: GGUF, key: bytes, t: int, value) -> GGUF:
    kvs = [kv for kv in g.kvs if kv.key != key] + [KV(key, t, value)]
    return replace(g, kvs=kvs, tensors=list(g.tensors))


def _kv_index(g: GGUF, suffix: bytes) -> int:
    return next(i for i, kv in enumerate(g.kvs) if kv.key.endswith(suffix))


def _fields(g: GGUF) -> list[tuple[str, int]]:
    """(name, offset) of every count, length and type field of the header of serialize(g)."""
    found, pos = [("n_tensors", 8), ("n_kv", 16)], 24
    for kv in g.kvs:
        found.append((f"keylen:{kv.key.decode()}", pos))
        found.append((f"type:{kv.key.decode()}", pos + 8 + len(kv.key)))
        pos += 8 + len(kv.key) + 4
        if kv.type == STRING:
            found.append((f"strlen:{kv.key.decode()}", pos))
        elif kv.type == ARRAY:
            found.append((f"arrlen:{kv.key.decode()}", pos + 4))
        tmp = bytearray()
        _write_value(tmp, [], kv.type, kv.value)
        pos += len(tmp)
    for t in g.tensors:
        found.append((f"namelen:{t.name.decode()}", pos))
        pos += 8 + len(t.name)
        found.append((f"ndims:{t.name.decode()}", pos))
        for d in range(len(t.dims)):
            found.append((f"dim{d}:{t.name.decode()}", pos + 4 + 8 * d))
        pos += 4 + 8 * len(t.dims) + 12
    return found


def _put(buf: bytes, pos: int, fmt: str, v) -> bytes:
    b = bytearray(buf)
    struct.pack_into(fmt, b, pos, v)
    return bytes(b)


def corpus(base: bytes, seed: int = 0) -> list[tuple[str, bytes]]:
    """Every case, in a fixed order (deterministic for a given base and seed)."""
    g = parse(base)
    valid = serialize(g)
    cases: list[tuple[str, bytes]] = [("valid", valid)]
    # truncations at every structural offset
    cases += [(f"truncate@{m}", valid[:m]) for m in sorted(set(g.marks))]
    # bit flips in the header (seeded)
    rng = random.Random(seed)
    header_end = g.marks[-4]
    for i in range(64):
        pos, bit = rng.randrange(header_end), rng.randrange(8)
        b = bytearray(valid)
        b[pos] ^= 1 << bit
        cases.append((f"bitflip{i}@{pos}.{bit}", bytes(b)))
    # huge counts and lengths
    fields = _fields(g)
    for name, pos in fields:
        if name.startswith("type:"):
            continue
        fmt = "<I" if name.startswith("ndims") else "<Q"
        for v in ((1 << 32) - 1, (1 << 63) - 1) if fmt == "<Q" else (5, 1 << 31):
            cases.append((f"huge:{name}={v}", _put(valid, pos, fmt, v)))
    cases.append(("version=1", _put(valid, 4, "<I", 1)))
    cases.append(("version=4", _put(valid, 4, "<I", 4)))
    cases.append(("magic", b"GGUG" + valid[4:]))
    # bad value types and tensor types
    for name, pos in fields:
        if name.startswith("type:"):
            for bad in (13, 255, STRING, ARRAY, 10):
                cases.append((f"kv{name}={bad}", _put(valid, pos, "<I", bad)))
    for i, t in enumerate(g.tensors[:6]):
        for bad in (4, 5, 39, 1000):
            h = replace(g, tensors=list(g.tensors))
            h.tensors[i] = replace(t, type=bad)
            cases.append((f"ttype:{t.name.decode()}={bad}", serialize(h)))
    # offsets: overlapping, misaligned, out of the file, huge; shapes
    for i, t in enumerate(g.tensors[:6]):
        other = g.tensors[(i + 1) % len(g.tensors)]
        for label, off in (
            ("overlap", other.offset),
            ("misaligned", t.offset + 1),
            ("past-end", len(g.data)),
            ("huge", (1 << 63) - 1),
            ("end-1", len(g.data) - 1),
        ):
            h = replace(g, tensors=list(g.tensors))
            h.tensors[i] = replace(t, offset=off)
            cases.append((f"offset:{t.name.decode()}:{label}", serialize(h)))
        for label, dims in (
            ("swapped", t.dims[::-1]),
            ("doubled", [2 * d for d in t.dims]),
            ("zero", [0] + t.dims[1:]),
            ("extra-dim", t.dims + [3]),
            ("5-dims", t.dims + [1] * 4),
            ("none", []),
        ):
            h = replace(g, tensors=list(g.tensors))
            h.tensors[i] = replace(t, dims=dims)
            cases.append((f"shape:{t.name.decode()}:{label}", serialize(h)))
    # duplicate names, missing keys and tensors
    h = replace(g, tensors=list(g.tensors) + [g.tensors[0]])
    cases.append(("duplicate-tensor", serialize(h)))
    h = replace(g, kvs=list(g.kvs) + [g.kvs[1]])
    cases.append(("duplicate-key", serialize(h)))
    for i, kv in enumerate(g.kvs):
        cases.append((f"missing-key:{kv.key.decode()}", serialize(replace(g, kvs=g.kvs[:i] + g.kvs[i + 1 :]))))
    for i, t in enumerate(g.tensors):
        cases.append(
            (f"missing-tensor:{t.name.decode()}", serialize(replace(g, tensors=g.tensors[:i] + g.tensors[i + 1 :])))
        )
    # hostile values (tests/test_hostile_gguf.py has them by name, this is their raw form)
    arch = next(kv.value for kv in g.kvs if kv.key == b"general.architecture")
    a = arch + b"."
    nan, inf = float("nan"), float("inf")
    for key, t, value in (
        (a + b"rope.dimension_count", 4, 15),
        (a + b"attention.layer_norm_rms_epsilon", 6, nan),
        (a + b"attention.layer_norm_rms_epsilon", 6, -1.0),
        (a + b"rope.freq_base", 6, nan),
        (a + b"rope.freq_base", 6, 0.0),
        (a + b"rope.freq_base", 6, -inf),
        (a + b"context_length", 4, 1 << 24),
        (a + b"block_count", 4, 1 << 30),
        (a + b"attention.head_count", 4, 0),
        (a + b"attention.head_count_kv", 4, 0),
        (a + b"embedding_length", 4, 33),
        (b"general.architecture", STRING, arch + b"\0x"),
        (b"general.alignment", 4, 0),
        (b"general.alignment", 4, 3),
        (b"general.alignment", 4, 1 << 31),
        (b"tokenizer.ggml.tokens", ARRAY, (4, [1, 2, 3])),
        (b"tokenizer.ggml.merges", ARRAY, (6, [0.5])),
        (b"tokenizer.ggml.token_type", ARRAY, (STRING, [b"x"])),
        (b"tokenizer.ggml.bos_token_id", STRING, b"1"),
        (b"tokenizer.ggml.eos_token_id", 4, (1 << 32) - 1),
        (b"tokenizer.ggml.add_bos_token", STRING, b"yes"),
        (b"tokenizer.ggml.model", 4, 1),
        (b"tokenizer.ggml.pre", STRING, b"no-such-pre"),
        (b"tokenizer.chat_template", 4, 7),
        (b"tokenizer.chat_template", STRING, b"{{ 'x' * 10**9 }}"),
        (b"key\0with-nul", 4, 1),
        (b"", 4, 1),
    ):
        cases.append((f"value:{key.decode(errors='replace')}={value!r:.24}", serialize(_with_kv(g, key, t, value))))
    # declared counts that disagree with the content
    for label, nk, nt in (
        ("n_kv+1", len(g.kvs) + 1, None),
        ("n_kv-1", len(g.kvs) - 1, None),
        ("n_tensors+1", None, len(g.tensors) + 1),
        ("n_tensors-1", None, len(g.tensors) - 1),
        ("n_kv=4097", 4097, None),
        ("n_tensors=16385", None, 16385),
    ):
        cases.append((f"count:{label}", serialize(g, n_kv=nk, n_tensors=nt)))
    # fuzzer findings, rebuilt from their recipes
    if REGRESSIONS.is_file():
        for rec in json.loads(REGRESSIONS.read_text(encoding="utf-8")):
            cases.append((f"fuzz:{rec['seed']}:{rec['iteration']}", mutate(valid, rec["seed"], rec["iteration"])))
    return cases


def mutate(data: bytes, seed: int, iteration: int) -> bytes:
    """The fuzzer's mutation `iteration` of run `seed` (bench/fuzz_gguf.py): 1 to 4 edits of a
    random kind — bit flips, bytes set to 0x00/0xff, a u32/u64 overwritten with a boundary
    value, a slice deleted, duplicated or truncated away. Deterministic."""
    rng = random.Random(seed * 1_000_003 + iteration)
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(6)
        pos = rng.randrange(len(b)) if b else 0
        if kind == 0 and b:
            b[pos] ^= 1 << rng.randrange(8)
        elif kind == 1 and b:
            b[pos] = rng.choice((0, 0xFF, 0x7F, 0x80))
        elif kind == 2 and len(b) > pos + 8:
            fmt = rng.choice(("<I", "<Q"))
            v = rng.choice((0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 31, (1 << 63) - 1, (1 << 64) - 1, 4097, 16385))
            struct.pack_into(fmt, b, pos, v & ((1 << (8 * struct.calcsize(fmt))) - 1))
        elif kind == 3:
            del b[pos : pos + rng.randint(1, 64)]
        elif kind == 4:
            n = rng.randint(1, 64)
            b[pos:pos] = b[pos : pos + n]
        else:
            del b[pos:]
    return bytes(b)


def run_case(path: Path) -> str:
    """'ok' or 'error: <one-line message>'; other exceptions propagate."""
    from ott_gguf.errors import OttError
    from ott_gguf.model import Context, Weights

    try:
        weights = Weights(path)
        ctx = Context(weights, n_ctx=32, n_threads=1)
        ctx.eval([1, 2, 3])
        return "ok"
    except OttError as e:
        message = str(e)
        if "\n" in message:
            raise AssertionError(f"a multi-line message: {message!r}") from e
        return f"error: {message}"


def main() -> int:
    import argparse
    import traceback

    ap = argparse.ArgumentParser(description="Run the malformed-GGUF corpus built from BASE.")
    ap.add_argument("base", type=Path)
    ap.add_argument("--cases", type=int, default=None, help="run the first N cases only")
    args = ap.parse_args()
    cases = corpus(args.base.read_bytes())[: args.cases]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, data) in enumerate(cases):
            path = Path(tmp) / f"case{i}.gguf"
            path.write_bytes(data)
            print(f"{name}: ", end="", flush=True)
            try:
                print(run_case(path), flush=True)
            except Exception:  # noqa: BLE001 - a traceback is the failure being looked for
                failed += 1
                print("TRACEBACK " + " | ".join(traceback.format_exc().strip().splitlines()[-3:]), flush=True)
            path.unlink()
    print(f"{len(cases)} cases, {failed} tracebacks", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
