"""SentencePiece vocabulary (tokenizer.ggml.model = "llama") from tokenizer.model.

Same result as llama.cpp's converter: the model's pieces with their scores and types,
overridden by added_tokens.json and tokenizer_config.json's added_tokens_decoder.
"""

from __future__ import annotations

import logging
from pathlib import Path

from gguf import TokenType

from .bpe_vocab import looks_special
from .hparams import read_json
from .sentencepiece_model import read_pieces

log = logging.getLogger(__name__)

ADDED_TOKEN_SCORE = -1000.0
PAD_SCORE = -10000.0


def spm_tokens(directory: Path, n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types), each of length n_vocab."""
    pieces = read_pieces(directory / "tokenizer.model")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores = [PAD_SCORE] * n_vocab
    types = [int(TokenType.UNUSED)] * n_vocab
    if len(pieces) > n_vocab:
        log.warning(
            "tokenizer.model has %d pieces, config.json's vocab_size is %d: ignoring the rest", len(pieces), n_vocab
        )
    for i, piece in enumerate(pieces[:n_vocab]):
        tokens[i] = piece.text
        scores[i] = piece.score
        # llama.cpp's converter writes SentencePiece's USER_DEFINED pieces as NORMAL
        types[i] = TokenType.NORMAL if piece.type == TokenType.USER_DEFINED else piece.type

    def override(tid: int, text: str, kind: TokenType) -> None:
        if not 0 <= tid < n_vocab:
            log.warning("added token %r has id %d, outside the vocabulary of %d: ignored", text, tid, n_vocab)
            return
        tokens[tid] = text
        scores[tid] = ADDED_TOKEN_SCORE
        types[tid] = int(kind)

    if (directory / "added_tokens.json").is_file():
        for text, tid in read_json(directory / "added_tokens.json").items():
            override(int(tid), text, TokenType.USER_DEFINED)
    if (directory / "tokenizer_config.json").is_file():
        decoder = read_json(directory / "tokenizer_config.json").get("added_tokens_decoder", {})
        for tid, data in decoder.items():
            text = data["content"]
            if data.get("special") or looks_special(text):
                override(int(tid), text, TokenType.CONTROL)
            else:
                override(int(tid), text.replace("\u2581", " "), TokenType.USER_DEFINED)
    return tokens, scores, [int(t) for t in types]
