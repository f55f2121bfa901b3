"""Tokenizer: llama.cpp's ids on our strings (tests/data/tokenizer), round trips, pre-tokenizer edge cases,
special tokens, streaming decode, and a SentencePiece vocabulary small enough to work out
by hand."""

import json

import pytest
from gguf import GGUFReader

from ott_gguf.errors import ModelFileError, UnsupportedError
from ott_gguf.pretokenize import pre_tokenizer
from ott_gguf.tokenizer import Attr, StreamDecoder, Tokenizer


@pytest.fixture(scope="module")
def smollm2_fields(smollm2_path):
    reader = GGUFReader(smollm2_path)
    return {name: f.contents() for name, f in reader.fields.items() if name.startswith("tokenizer.ggml.")}


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_fields):
    return Tokenizer.from_fields(smollm2_fields)


@pytest.fixture(scope="module")
def qwen_tok(qwen05_path):
    return Tokenizer.from_gguf(qwen05_path)


def _cases(reference_dir, name):
    return json.loads((reference_dir / "tokenizer" / f"{name}.json").read_text(encoding="utf-8"))["cases"]


# ---- llama.cpp's ids -------------------------------------------------------------------


@pytest.mark.parametrize("name, tok_fixture", [("smollm2", "smollm2_tok"), ("qwen2", "qwen_tok")])
def test_ids_match_llama_cpp(name, tok_fixture, request, reference_dir):
    tok = request.getfixturevalue(tok_fixture)
    cases = _cases(reference_dir, name)
    assert len(cases) > 50
    for case in cases:
        text = case["text"]
        assert tok.encode(text, parse_special=False) == case["ids"], f"parse_special off: {text!r}"
        assert tok.encode(text, parse_special=True) == case["ids_parse_special"], f"parse_special on: {text!r}"


@pytest.mark.parametrize("name, tok_fixture", [("smollm2", "smollm2_tok"), ("qwen2", "qwen_tok")])
def test_decode_round_trips(name, tok_fixture, request, reference_dir):
    tok = request.getfixturevalue(tok_fixture)
    for case in _cases(reference_dir, name):
        text = case["text"]
        assert tok.decode(tok.encode(text)) == text
        # Control tokens are written back as their text unless skipped.
        assert tok.decode(tok.encode(text, parse_special=True)) == text


def test_metadata(smollm2_tok, qwen_tok):
    assert (smollm2_tok.model, smollm2_tok.pre, smollm2_tok.n_vocab) == ("gpt2", "smollm", 49152)
    assert (smollm2_tok.bos_id, smollm2_tok.eos_id, smollm2_tok.add_bos, smollm2_tok.add_eos) == (1, 2, False, False)
    assert smollm2_tok.token_text(1) == "<|im_start|>"
    assert (qwen_tok.pre, qwen_tok.eos_id, qwen_tok.add_bos) == ("qwen2", 151645, False)
    assert qwen_tok.token_text(qwen_tok.eot_id) == "<|im_end|>"  # found by its text: no eot key in the file


def test_end_of_generation(smollm2_tok, qwen_tok):
    def eog_texts(tok):
        return {tok.token_text(i) for i in range(tok.n_vocab) if tok.is_eog(i)}

    # llama.cpp: eos, the texts it knows as end of turn/text, and the fim repo/pad/file-sep tokens.
    assert eog_texts(smollm2_tok) == {"<|endoftext|>", "<|im_end|>", "<reponame>"}
    assert eog_texts(qwen_tok) == {
        "<|endoftext|>",
        "<|im_end|>",
        "</s>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
    assert not smollm2_tok.is_eog(smollm2_tok.encode("Hello")[0])


# ---- pre-tokenizers ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "pre, words",
    [
        # digits: one by one (smollm, qwen2), groups of 3 (llama3), a run (gpt2)
        ("smollm", ["1", "2", "3", "4", "5", " a", "  ", " b", "\n\n", "\t", "c", "'s"]),
        ("qwen2", ["1", "2", "3", "4", "5", " a", "  ", " b", "\n\n", "\tc", "'s"]),
        ("llama-bpe", ["123", "45", " a", "  ", " b", "\n\n", "\tc", "'s"]),
        ("gpt2", ["12345", " a", "  ", " b", "\n\n", "\t", "c", "'s"]),
        # llama.cpp's fallback cuts punctuation runs first, so the apostrophe stands alone
        ("default", ["123", "45", " a", "  ", " b", "\n\n", "\t", "c", "'", "s"]),
    ],
)
def test_pre_tokenizer_words(pre, words):
    # A whitespace run before a word leaves its last space to the word; Llama 3 / Qwen2 keep
    # newlines apart from the tab that leads the next word.
    assert pre_tokenizer(pre).split("12345 a   b\n\n\tc's") == words


def test_pre_tokenizer_contractions_and_trailing_space():
    assert pre_tokenizer("qwen2").split("IT'S x ") == ["IT", "'S", " x", " "]  # case-insensitive
    assert pre_tokenizer("gpt2").split("IT'S x ") == ["IT", "'", "S", " x", " "]  # GPT-2: lower case only
    assert pre_tokenizer("llama3").split("a\u00a0\u3000b") == ["a", "\u00a0", "\u3000b"]  # Unicode spaces


def test_unknown_pre_tokenizer_is_unsupported(smollm2_fields):
    with pytest.raises(UnsupportedError, match="tokenizer.ggml.pre = 'no-such-pre'"):
        Tokenizer.from_fields({**smollm2_fields, "tokenizer.ggml.pre": "no-such-pre"})


def test_unknown_model_is_unsupported(smollm2_fields):
    with pytest.raises(UnsupportedError, match="tokenizer.ggml.model = 'bert'"):
        Tokenizer.from_fields({**smollm2_fields, "tokenizer.ggml.model": "bert"})


def test_bad_files(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelFileError, match="not a readable GGUF"):
        Tokenizer.from_gguf(junk)
    with pytest.raises(ModelFileError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_fields({"tokenizer.ggml.model": "gpt2"})


# ---- edge cases on the real vocabularies --------------------------------------------------


def test_empty_text(smollm2_tok):
    assert smollm2_tok.encode("") == []
    assert smollm2_tok.decode([]) == ""


def test_add_bos_and_eos_from_metadata(smollm2_fields):
    tok = Tokenizer.from_fields(
        {**smollm2_fields, "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": True}
    )
    plain = tok.encode("Hello", add_special=False)
    assert tok.encode("Hello") == [1] + plain + [2]
    assert tok.decode(tok.encode("Hello"), skip_special=True) == "Hello"
    assert tok.decode(tok.encode("Hello")) == "<|im_start|>Hello<|im_end|>"


@pytest.mark.parametrize("tok_fixture", ["smollm2_tok", "qwen_tok"])
@pytest.mark.parametrize(
    "text",
    [
        " " * 33,
        "\n" * 40,
        "\t\t x \r\n\r\n",
        "a" * 5000,
        "🙂" * 300,
        "日本語の文章です。" * 20,
        "x" + "\u200d" * 10 + "y",
        "0" * 1000,
        "9" * 1001 + "\n",
    ],
)
def test_round_trip_edge_cases(tok_fixture, text, request):
    tok = request.getfixturevalue(tok_fixture)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_to_piece(i) for i in ids) == text.encode("utf-8")


def test_digits_per_vocabulary(smollm2_tok, qwen_tok):
    # Both split digits one by one, so a number is exactly its digits' tokens.
    for tok in (smollm2_tok, qwen_tok):
        assert tok.encode("2026") == [tok.encode(d)[0] for d in "2026"]


def test_long_repeated_character(smollm2_tok):
    ids = smollm2_tok.encode("a" * 10000)
    # SmolLM2 has "aaaa": one token per 4 characters.
    assert ids == smollm2_tok.encode("aaaa") * 2500


def test_special_tokens_only_when_parsed(smollm2_tok):
    text = "<|im_start|>user\nHi<|im_end|>"
    parsed = smollm2_tok.encode(text, parse_special=True)
    assert parsed[0] == 1 and parsed[-1] == 2
    assert parsed[1:-1] == smollm2_tok.encode("user\nHi")
    plain = smollm2_tok.encode(text, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert smollm2_tok.decode(parsed, skip_special=True) == "user\nHi"
    assert smollm2_tok.token_to_piece(1) == b"" and smollm2_tok.token_to_piece(1, special=True) == b"<|im_start|>"


def test_user_defined_tokens_are_always_cut(qwen_tok):
    # <tool_call> is a user-defined token in Qwen2.5: llama.cpp cuts it out even without
    # parse_special, and writes it back even when skipping control tokens.
    tool = qwen_tok.encode("<tool_call>", parse_special=False)
    assert len(tool) == 1 and qwen_tok.token_attr(tool[0]) == Attr.USER_DEFINED
    assert qwen_tok.decode(qwen_tok.encode("x<tool_call>y"), skip_special=True) == "x<tool_call>y"
    # "</s>" is a normal token in the file that llama.cpp promotes to control (end of generation).
    assert qwen_tok.encode("</s>", parse_special=True) == [qwen_tok.encode("</s>", parse_special=True)[0]]
    assert len(qwen_tok.encode("</s>", parse_special=False)) > 1


def test_stream_decoder_holds_back_partial_characters(smollm2_tok):
    ids = smollm2_tok.encode("ok😀!")
    # SmolLM2 spells the emoji's four bytes with three tokens (F0 9F | 98 | 80).
    assert [smollm2_tok.token_to_piece(i) for i in ids[1:4]] == [b"\xf0\x9f", b"\x98", b"\x80"]
    stream = StreamDecoder(smollm2_tok)
    assert [stream.feed(i) for i in ids] == ["ok", "", "", "😀", "!"]
    assert stream.flush() == ""


def test_stream_decoder_flushes_invalid_bytes(smollm2_tok):
    first_byte_of_emoji = smollm2_tok.encode("😀")[0]
    stream = StreamDecoder(smollm2_tok)
    assert stream.feed(first_byte_of_emoji) == ""
    assert stream.flush() == "\ufffd"


def test_wikitext_prefix(smollm2_tok, wikitext_path):
    text = wikitext_path.read_text(encoding="utf-8")[:100_000]
    ids = smollm2_tok.encode(text)
    # English encyclopedia text: about 4 characters per token for a 49k vocabulary.
    assert 3.0 < len(text) / len(ids) < 5.5
    assert smollm2_tok.decode(ids) == text
    assert all(0 <= i < smollm2_tok.n_vocab for i in ids)


# ---- SentencePiece (`llama`) vocabulary worked out by hand -------------------------------

BYTE0 = 3  # <0x00> .. <0xFF> are ids 3 .. 258
SPM_PIECES = [  # id, text, score
    (259, "\u2581", -5.0),
    (260, "h", -5.0),
    (261, "e", -5.0),
    (262, "l", -5.0),
    (263, "o", -5.0),
    (264, "a", -5.0),
    (265, "\u2581h", -1.0),
    (266, "ll", -0.5),
    (267, "ell", -0.8),
    (268, "\u2581hell", -2.0),
    (269, "el", -3.0),
    (270, "aa", -1.5),
    (271, "lo", -4.0),
]


def _spm(**options):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [t for _, t, _ in SPM_PIECES]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0] * (3 + 256) + [s for _, _, s in SPM_PIECES]
    assert [tokens.index(t) for _, t, _ in SPM_PIECES] == [i for i, _, _ in SPM_PIECES]
    fields = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
    }
    fields.update({f"tokenizer.ggml.{k}": v for k, v in options.items()})
    return Tokenizer.from_fields(fields)


def test_spm_merges_by_score():
    # "hello" -> "▁hello" = ▁ h e l l o. Pairs that are tokens: ▁h -1.0, el -3.0, ll -0.5, lo -4.0.
    # Best score first: ll -> ▁ h e ll o; now e+ll = ell (-0.8) is the best -> ▁ h ell o;
    # then ▁h -> ▁h ell o; then ▁h+ell = ▁hell (-2.0) -> ▁hell o. (Left to right, el would
    # have been taken before ll.)
    tok = _spm()
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.add_bos) == (1, 2, 0, True)
    assert tok.encode("hello") == [1, 268, 263]
    assert tok.encode("hello", add_special=False) == [268, 263]


def test_spm_equal_scores_merge_leftmost():
    # ▁ a a a: both a+a pairs score -1.5; the left one goes first -> ▁ aa a.
    assert _spm().encode("aaa", add_special=False) == [259, 270, 264]


def test_spm_byte_fallback():
    # é is no token: its UTF-8 bytes C3 A9 become <0xC3> <0xA9>.
    tok = _spm()
    ids = tok.encode("hé", add_special=False)
    assert ids == [265, BYTE0 + 0xC3, BYTE0 + 0xA9]
    assert tok.decode(ids) == "hé"


def test_spm_space_prefix():
    tok = _spm()
    # Spaces are ▁; "a a" -> ▁ a ▁ a, no pair is a token.
    assert tok.encode("a a", add_special=False) == [259, 264, 259, 264]
    assert tok.decode([259, 264, 259, 264]) == "a a"  # the added space is dropped again
    # Without the prefix: h e l l o -> h e ll o -> h ell o (no "hell").
    assert _spm(add_space_prefix=False).encode("hello", add_special=False) == [260, 267, 263]
    # llama.cpp puts a space again before text that follows a special token.
    assert tok.encode("hello</s>hello", add_special=False, parse_special=True) == [268, 263, 2, 268, 263]
    assert 2 not in tok.encode("hello</s>hello", add_special=False, parse_special=False)


def test_spm_decode_and_specials():
    tok = _spm(add_eos_token=True)
    ids = tok.encode("hello a")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special=True) == "hello a"
    assert tok.decode(ids) == "<s>hello a</s>"
    stream = StreamDecoder(tok, skip_special=True)
    assert [stream.feed(i) for i in [265, BYTE0 + 0xC3, BYTE0 + 0xA9]] == [" h", "", "é"]
