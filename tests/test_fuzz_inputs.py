"""Property tests (hypothesis, derandomized): command lines of random flag values, and
converter inputs with a random field replaced by a random JSON value. Either the command
works, or it ends with exactly one `error:` line (exit 1, or 2 for a malformed command line);
the converter either writes a file or raises an OttError with a one-line message."""

import json
import math
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import convert
from convert_checkpoints import tiny_qwen2_checkpoint
from make_gguf import write_random_model
from ott_gguf.cli import main
from ott_gguf.errors import OttError

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

INTS = st.one_of(st.integers(-3, 3), st.sampled_from([2**31, 2**40, -(2**31), 2**63]), st.text(max_size=6))
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["nan", "inf", "-inf", "1e400"]),
    st.text(max_size=6),
)
# flag -> strategy of its value (counts that would allocate or spawn in proportion stay small)
FLAGS = {
    "-n": st.one_of(st.integers(-2, 3), st.sampled_from([2**31, 2**40])),
    "-c": st.one_of(st.integers(-2, 64), st.sampled_from([2**31, 2**40, 2**24 + 1])),
    "-t": st.one_of(st.integers(-1, 2), st.sampled_from([513, 2**31, 2**40])),
    "--temp": FLOATS,
    "--top-p": FLOATS,
    "--min-p": FLOATS,
    "--repeat-penalty": FLOATS,
    "--top-k": INTS,
    "--repeat-last-n": INTS,
    "--seed": INTS,
    "--kv": st.sampled_from(["f16", "ott2", "kivi4", "bogus", ""]),
    "--kv-bits-k": INTS,
    "--kv-group-v": INTS,
    "--kv-window": INTS,
    "--kv-pool": INTS,
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("fuzz") / "tiny.gguf", n_layer=1, dtype="f32")


def _check_outcome(code: int, err: str) -> None:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if not line.startswith("note: ")]
    if code == 0:
        assert not [line for line in lines if line.startswith("error: ")], err
    else:
        assert code in (1, 2), (code, err)
        assert len(lines) == 1 and lines[0].startswith("error: "), err


@SETTINGS
@given(
    flags=st.dictionaries(st.sampled_from(sorted(FLAGS)), st.none(), max_size=5).flatmap(
        lambda chosen: st.fixed_dictionaries({f: FLAGS[f] for f in chosen})
    )
)
def test_run_with_random_flag_values(tiny, capsys, flags):
    argv = ["run", str(tiny), "-p", "hello", "-n", "2"]
    for flag, value in flags.items():
        argv += [flag, str(value)]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code
    _check_outcome(code, capsys.readouterr().err)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2-hf")
    tiny_qwen2_checkpoint(directory, np.random.default_rng(0))
    return directory


JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=8),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6,
)


def _paths(obj, prefix=()):
    """Every (path of keys/indices) inside a JSON document, shallowest first."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:4]):
            yield from _paths(v, prefix + (i,))


def _replace(doc, path, value):
    if not path:
        return value
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


@SETTINGS
@given(data=st.data())
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json"])
def test_convert_with_a_random_json_field(checkpoint, tmp_path_factory, name, data):
    work = tmp_path_factory.mktemp("broken")
    directory = work / "ckpt"
    shutil.copytree(checkpoint, directory)
    doc = json.loads((directory / name).read_text())
    paths = list(_paths(doc))[:400]
    path = data.draw(st.sampled_from(paths), label="path")
    doc = _replace(doc, path, data.draw(JSON_VALUES, label="value"))
    (directory / name).write_text(json.dumps(doc, allow_nan=True))
    out = work / "out.gguf"
    try:
        convert.convert(str(directory), out)
    except OttError as e:
        assert "\n" not in str(e)
        assert not out.exists()
    else:
        from gguf import GGUFReader

        fields = GGUFReader(out).fields
        theta = fields.get("qwen2.rope.freq_base")
        assert theta is None or math.isfinite(theta.contents())
    finally:
        shutil.rmtree(work)
