"""`python -m ott_gguf` end to end on the real SmolLM2 GGUF, and its answers to bad input.

Every failure must be one line `error: ...` on stderr naming the file or flag, a non-zero
exit code (2 for command-line usage), and no traceback unless --verbose.
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import ott_gguf

# The subprocess imports the same ott_gguf as this test process (the installed package in CI,
# the checkout in development): its folder leads the path and is the working directory.
PACKAGE_ROOT = Path(ott_gguf.__file__).resolve().parent.parent


def cli(*args, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "ott_gguf", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=PACKAGE_ROOT,
        env=env,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str, code: int = 1) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ---- working commands -----------------------------------------------------------------------


def test_info_describes_the_model(smollm2_path):
    proc = cli("info", smollm2_path)
    assert proc.returncode == 0, proc.stderr
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in proc.stdout.strip().splitlines())
    reader = gguf.GGUFReader(smollm2_path)
    meta = {
        k: reader.fields[k].contents()
        for k in reader.fields
        if not k.startswith("GGUF.") and "tokens" not in k and "merges" not in k and "token_type" not in k
    }
    n_layer, n_head_kv = meta["llama.block_count"], meta["llama.attention.head_count_kv"]
    head = meta["llama.embedding_length"] // meta["llama.attention.head_count"]
    assert fields["architecture"] == "llama"
    assert fields["layers"] == str(n_layer)
    assert fields["context"].startswith(str(meta["llama.context_length"]))
    assert fields["KV cache f16"].startswith(f"{2 * n_layer * n_head_kv * head * 2} bytes per token")
    assert "gpt2 (pre-tokenizer smollm)" in fields["vocabulary"]
    assert fields["chat template"] == "yes"
    counts = {}
    for t in reader.tensors:
        counts[t.tensor_type.name.lower()] = counts.get(t.tensor_type.name.lower(), 0) + 1
    listed = dict(item.rsplit(" ", 1) for item in fields["tensor types"].split(", "))
    assert {k: int(v) for k, v in listed.items()} == counts
    n_params = sum(int(np.prod(t.shape)) for t in reader.tensors)
    assert fields["parameters"].startswith(f"{n_params / 1e6:.2f} M")


@pytest.fixture(scope="module")
def tokenizer_cases(reference_dir):
    cases = json.loads((reference_dir / "tokenizer" / "smollm2.json").read_text(encoding="utf-8"))["cases"]
    special = next(c for c in cases if c["ids"] != c["ids_parse_special"])
    longest = max(cases, key=lambda c: len(c["text"]))
    return [special, longest]


def test_tokenize_ids_match_llamacpp(smollm2_path, tokenizer_cases):
    for case in tokenizer_cases:
        proc = cli("tokenize", smollm2_path, "-p", case["text"], "--ids")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == case["ids_parse_special"]
        proc = cli("tokenize", smollm2_path, "-p", case["text"], "--ids", "--no-parse-special")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout) == case["ids"]


def test_tokenize_prints_id_and_piece_lines(smollm2_path):
    proc = cli("tokenize", smollm2_path, "-p", "<|im_start|>Hello world")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    pieces = [re.fullmatch(r"\s*(\d+) -> '(.*)'", line).groups() for line in lines]
    assert "".join(p for _, p in pieces) == "<|im_start|>Hello world"
    ids = json.loads(cli("tokenize", smollm2_path, "-p", "<|im_start|>Hello world", "--ids").stdout)
    assert [int(i) for i, _ in pieces] == ids


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from ott_gguf.model import Model

    model = Model(smollm2_path, n_ctx=256, n_threads=2)
    yield model
    model.close()


def test_run_greedy_matches_the_python_api(smollm2_path, smollm2):
    from ott_gguf.generate import generate_text
    from ott_gguf.sampling import SamplingParams

    prompt = "The capital of France is"
    proc = cli("run", smollm2_path, "-p", prompt, "-n", 8, "--temp", 0, "-c", 256, "-t", 2)
    assert proc.returncode == 0, proc.stderr
    expected = "".join(generate_text(smollm2, prompt, 8, SamplingParams(temperature=0)))
    assert expected.strip()
    assert proc.stdout == expected + "\n"


def test_run_logit_bias_bans_a_token(smollm2_path, smollm2):
    from ott_gguf.generate import generate_text
    from ott_gguf.sampling import SamplingParams

    prompt = "1, 2, 3, 4, 5,"
    greedy = "".join(generate_text(smollm2, prompt, 4, SamplingParams(temperature=0)))
    banned = smollm2.tokenize(greedy, add_special=False)[0]
    proc = cli("run", smollm2_path, "-p", prompt, "-n", 4, "--temp", 0, "-c", 256, "-l", f"{banned}-100")
    assert proc.returncode == 0, proc.stderr
    bias = {banned: -100.0}
    expected = "".join(generate_text(smollm2, prompt, 4, SamplingParams(temperature=0, logit_bias=bias)))
    assert proc.stdout == expected + "\n" and smollm2.tokenize(expected, add_special=False)[0] != banned
    assert_one_line_error(cli("run", smollm2_path, "-p", prompt, "-l", "5x1"), "--logit-bias", code=2)


def test_chat_answers_each_line_and_keeps_the_conversation(smollm2_path):
    proc = cli(
        "chat",
        smollm2_path,
        "--temp",
        0,
        "-n",
        24,
        "-c",
        512,
        "-t",
        2,
        stdin="What is the capital of France?\nAnd of Italy?\n",
    )
    assert proc.returncode == 0, proc.stderr
    replies = proc.stdout.strip("\n").split("\n")
    assert len([r for r in replies if r.strip()]) >= 2, proc.stdout


def _fresh_greedy(model, messages, max_tokens):
    from ott_gguf.generate import generate_text
    from ott_gguf.sampling import SamplingParams

    ids = model.tokenize(
        model.chat_template.render(messages, add_generation_prompt=True), add_special=False, parse_special=True
    )
    return "".join(generate_text(model, ids, max_tokens, SamplingParams(temperature=0)))


def test_chat_session_reuses_the_cache_and_matches_a_fresh_run(smollm2_path, smollm2):
    from ott_gguf.chat_session import ChatSession
    from ott_gguf.model import Model
    from ott_gguf.sampling import SamplingParams

    with Model(smollm2_path, n_ctx=256, n_threads=2) as model:
        evaluated = []
        eval_tokens = model.eval
        model.eval = lambda tokens, seq=0, **kw: evaluated.append(len(tokens)) or eval_tokens(tokens, seq, **kw)
        session = ChatSession(model, SamplingParams(temperature=0), max_reply=16)
        for turn, question in enumerate(["What is the capital of France?", "And of Italy?", "Which was first?"]):
            evaluated.clear()
            cached_before = len(session.cached)
            reply = "".join(session.reply(question))
            assert reply == _fresh_greedy(smollm2, session.messages[:-1], 16)
            if turn:
                # Only the part after the cached conversation is evaluated as a prompt.
                n_prompt = len(session.cached) - (len(evaluated) - 1)
                assert evaluated[0] < n_prompt - cached_before + 8, (evaluated[0], n_prompt, cached_before)
            assert model.seq_len(0) == len(session.cached)


def test_chat_session_drops_the_oldest_turns_when_the_context_is_full(smollm2_path):
    from ott_gguf.chat_session import ChatSession
    from ott_gguf.errors import ContextFullError
    from ott_gguf.model import Model
    from ott_gguf.sampling import SamplingParams

    with Model(smollm2_path, n_ctx=128, n_threads=2) as model:
        session = ChatSession(model, SamplingParams(temperature=0), max_reply=16)
        questions = [
            "What is the capital of France?",
            "And of Italy?",
            "And what about the capital of Spain?",
            "Which of these cities is the largest?",
            "Name a river in each of them.",
        ]
        for question in questions:
            "".join(session.reply(question))
        users = [m["content"] for m in session.messages if m["role"] == "user"]
        assert users == questions[-len(users) :] and len(users) < len(questions)
        assert model.seq_len(0) <= model.n_ctx
        with pytest.raises(ContextFullError, match="the context holds 128"):
            list(session.reply("word " * 200))
        assert [m["content"] for m in session.messages if m["role"] == "user"] == users


def test_perplexity_prints_running_values_and_the_estimate(smollm2_path, smollm2, wikitext_path, tmp_path):
    from ott_gguf.perplexity import perplexity

    text = wikitext_path.read_text(encoding="utf-8")[:20_000]
    sample = tmp_path / "sample.txt"
    sample.write_text(text, encoding="utf-8")
    proc = cli("perplexity", smollm2_path, "-f", sample, "--chunks", 2, "-c", 128, "-t", 2)
    assert proc.returncode == 0, proc.stderr
    running = re.findall(r"^\[(\d)\](\d+\.\d{4})$", proc.stdout, re.MULTILINE)
    assert [i for i, _ in running] == ["1", "2"]
    final = re.search(
        r"^Final estimate: PPL = (\d+\.\d{4}) ± (\d+\.\d{5}) \(2 windows, 126 tokens scored\)$",
        proc.stdout,
        re.MULTILINE,
    )
    assert final, proc.stdout
    expected = perplexity(smollm2, text, 128, n_chunks=2, progress=False)
    assert float(final[1]) == pytest.approx(expected.ppl, abs=1e-4)
    assert float(final[2]) == pytest.approx(expected.stderr, abs=1e-5)
    assert float(running[-1][1]) == pytest.approx(expected.ppl, abs=1e-4)


def test_perplexity_kl_matches_two_separate_models(smollm2_path, wikitext_path, tmp_path):
    """--kl runs the f16 reference as a second context on the same weights: the same KL and
    top-1 agreement as two models loaded apart."""
    from ott_gguf.model import Model
    from ott_gguf.perplexity import perplexity

    text = wikitext_path.read_text(encoding="utf-8")[:20_000]
    sample = tmp_path / "sample.txt"
    sample.write_text(text, encoding="utf-8")
    proc = cli(
        "perplexity",
        smollm2_path,
        "-f",
        sample,
        "--chunks",
        2,
        "-c",
        128,
        "-t",
        2,
        "--kv",
        "ott2",
        "--kl",
        "--device",
        "cpu",
    )
    assert proc.returncode == 0, proc.stderr
    found = re.search(
        r"^KL to f16 cache = (\d+\.\d{6}) nats, top-1 agreement = (\d+\.\d{2}) %$", proc.stdout, re.MULTILINE
    )
    assert found, proc.stdout
    expected = perplexity(
        Model(smollm2_path, n_ctx=128, n_threads=2, kv="ott2", device="cpu"),
        text,
        128,
        n_chunks=2,
        progress=False,
        reference=Model(smollm2_path, n_ctx=128, n_threads=2, device="cpu"),
    )
    assert 0 < float(found[1]) == pytest.approx(expected.kl, abs=1e-6)
    assert float(found[2]) == pytest.approx(100 * expected.top1, abs=0.01)


def test_bench_prints_a_row_per_test_and_depth(smollm2_path):
    proc = cli("bench", smollm2_path, "-p", 32, "-n", 4, "-d", "0,64", "-r", 2, "-t", 2)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"^\| (pp32|tg4) \| (\d+) \| (\d+\.\d\d) \|", proc.stdout, re.MULTILINE)
    assert [(t, d) for t, d, _ in rows] == [("pp32", "0"), ("tg4", "0"), ("pp32", "64"), ("tg4", "64")]
    assert all(float(ts) > 0 for _, _, ts in rows)


def test_bench_quantized_cache_at_a_depth(smollm2_path):
    """A prompt at a depth quantizes blocks that the cache cannot truncate off again: each
    repetition starts from a copy of the filled sequence instead."""
    proc = cli("bench", smollm2_path, "--kv", "ottr2tg", "-p", 200, "-n", 8, "-d", 300, "-r", 2, "-t", 2)
    assert proc.returncode == 0, proc.stderr
    rows = re.findall(r"^\| (pp200|tg8) \| 300 \| (\d+\.\d\d) \|", proc.stdout, re.MULTILINE)
    assert [t for t, _ in rows] == ["pp200", "tg8"] and all(float(ts) > 0 for _, ts in rows)


def test_convert_subcommand(tmp_path):
    proc = cli("convert", "--help")
    assert proc.returncode == 0 and "Convert a Hugging Face checkpoint to GGUF" in proc.stdout
    not_a_checkpoint = tmp_path / "empty"
    not_a_checkpoint.mkdir()
    assert_one_line_error(cli("convert", not_a_checkpoint, tmp_path / "out.gguf"), str(not_a_checkpoint), "config.json")
    assert not (tmp_path / "out.gguf").exists()
    assert_one_line_error(cli("convert", not_a_checkpoint), "OUT.gguf", code=2)  # usage error: one line too


# ---- bad input ------------------------------------------------------------------------------


def test_missing_model_file(tmp_path):
    assert_one_line_error(cli("info", tmp_path / "missing.gguf"), "missing.gguf")


def test_native_dir_without_a_build(tmp_path, monkeypatch):
    """OTT_NATIVE_DIR names the build to run: a folder without one is an error, not the
    installed build in its place (the library loads before the model is opened)."""
    monkeypatch.setenv("OTT_NATIVE_DIR", str(tmp_path))
    proc = cli("info", tmp_path / "model.gguf")
    assert_one_line_error(proc, f"OTT_NATIVE_DIR={tmp_path}", "no _ott_cffi extension there")


def test_truncated_gguf(smollm2_path, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_path, "rb") as f:
        truncated.write_bytes(f.read(1 << 20))
    assert_one_line_error(cli("run", truncated, "-p", "hi", "-n", 1), "truncated.gguf")


def test_not_a_gguf_file(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("these are notes, not a model\n" * 100)
    assert_one_line_error(cli("info", text), "notes.gguf")


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "neox.gguf"
    writer = gguf.GGUFWriter(path, "gptneox")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((32, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_error(cli("info", path), "gptneox")


def test_prompt_longer_than_the_context(smollm2_path):
    line = assert_one_line_error(cli("run", smollm2_path, "-c", 16, "-n", 4, "-p", "one two three four " * 10))
    numbers = [int(n) for n in re.findall(r"\d+", line)]
    assert 16 in numbers and any(n > 16 for n in numbers), line


def test_run_says_when_the_context_ends_the_text(smollm2_path, smollm2):
    proc = cli("run", smollm2_path, "-c", 12, "-n", 40, "--temp", 0, "-t", 2, "-p", "Once upon a time")
    assert proc.returncode == 0, proc.stderr
    n_prompt = len(smollm2.tokenize("Once upon a time", add_special=True, parse_special=True))
    note = proc.stderr.strip().splitlines()[-1]
    assert note == (
        f"note: stopped after {12 - n_prompt} of 40 tokens: the context of 12 tokens is full (raise -c/--ctx-size)"
    )
    full = cli("run", smollm2_path, "-c", 256, "-n", 4, "--temp", 0, "-t", 2, "-p", "Once upon a time")
    assert full.returncode == 0 and "note:" not in full.stderr, full.stderr


def test_bench_with_nothing_to_measure():
    assert_one_line_error(cli("bench", "-p", 0, "-n", 0), "-p and -n are both 0")


def test_unknown_flag():
    assert_one_line_error(cli("run", "--bogus"), "--bogus", code=2)


def test_bad_flag_value(smollm2_path):
    assert_one_line_error(cli("run", smollm2_path, "-p", "hi", "-n", "many"), "-n/--n-predict", "many", code=2)
    assert_one_line_error(cli("run", smollm2_path, "-p", "hi", "-t", 100000), "-t/--threads", "1..512", code=2)


def test_serve_refuses_bad_slot_settings(smollm2_path):
    assert_one_line_error(cli("serve", smollm2_path, "--parallel", "auto"), "--kv-memory")
    assert_one_line_error(cli("serve", smollm2_path, "--kv-memory", "lots"), "--kv-memory", "lots", code=2)
    assert_one_line_error(cli("serve", smollm2_path, "--parallel", "0"), "--parallel", code=2)
    # the budget holds no slot of 4096 f16 tokens (90 MiB each)
    assert_one_line_error(
        cli("serve", smollm2_path, "-c", 4096, "--parallel", "auto", "--kv-memory", "16MiB", "--port", 0),
        "16.0 MiB holds no slot",
    )


def test_serve_refuses_an_address_it_cannot_listen_on(smollm2_path):
    assert_one_line_error(cli("serve", smollm2_path, "--port", 70000), "--port", "0..65535", code=2)
    with socket.create_server(("127.0.0.1", 0)) as taken:  # the port is checked before the model loads
        port = taken.getsockname()[1]
        assert_one_line_error(cli("serve", smollm2_path, "--port", port), f"cannot listen on 127.0.0.1:{port}")


def test_calibrate_checks_its_output_before_the_work(smollm2_path, wikitext_path, tmp_path):
    out = tmp_path / "no-such-folder" / "x.kvcalib.gguf"
    proc = cli("calibrate", smollm2_path, "-f", wikitext_path, "-o", out, timeout=60)
    assert_one_line_error(proc, f"cannot write {out}")
    assert not out.parent.exists()


def test_counts_beyond_int32(smollm2_path):
    assert_one_line_error(cli("run", smollm2_path, "-p", "hi", "-n", 1, "-c", 2**40), "[1, 2147483647]")
    assert_one_line_error(cli("run", smollm2_path, "-p", "hi", "-n", 1, "-t", 2**40), "-t/--threads", "1..512", code=2)


def test_perplexity_text_from_a_fifo_does_not_block(smollm2_path, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert_one_line_error(cli("perplexity", smollm2_path, "-f", fifo, timeout=60), "fifo", "not a regular file")


def test_missing_perplexity_text(smollm2_path, tmp_path):
    assert_one_line_error(cli("perplexity", smollm2_path, "-f", tmp_path / "absent.txt"), "absent.txt")


def test_verbose_shows_the_traceback(tmp_path):
    proc = cli("--verbose", "info", tmp_path / "missing.gguf")
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")
