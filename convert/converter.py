"""Hugging Face checkpoint -> GGUF: the steps in order.

Everything that can be wrong with the input (config, architecture, tensor names and shapes,
truncated files, tokenizer) is checked before the output file is opened.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ott_gguf.errors import InvalidArgumentError, ModelFileError, OttError

from .hparams import read_config
from .hub import resolve_source
from .metadata import add_general
from .outtype import OUTTYPES
from .registry import architecture_for
from .source import open_checkpoint
from .tensor_plan import plan_tensors
from .vocab import add_vocab, load_vocab
from .writer import write_gguf

log = logging.getLogger(__name__)


def convert(src: str, out: str | Path, outtype: str = "f16", revision: str | None = None) -> Path:
    """Convert the checkpoint `src` (directory or Hub repo id) to the GGUF file `out`."""
    if outtype not in OUTTYPES:
        raise InvalidArgumentError(f"unknown output type '{outtype}' (choose from {', '.join(OUTTYPES)})")
    out = Path(out)
    if not out.parent.is_dir():
        raise InvalidArgumentError(f"{out}: directory {out.parent} does not exist")

    directory = resolve_source(src, revision)
    try:
        arch = architecture_for(read_config(directory), directory / "config.json")
        hparams = arch.hparams
        tensors = plan_tensors(arch, open_checkpoint(directory), outtype, directory)
        vocab = load_vocab(directory, hparams.n_vocab, hparams.config)
    except OttError:
        raise
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as e:
        # the checks above cover the keys the converter relies on; an architecture's optional
        # field of a wrong JSON type lands here, still as one line naming the checkpoint
        raise ModelFileError(
            f"{directory}: a checkpoint file has a field of an unexpected type or value ({type(e).__name__}: {e})"
        ) from e
    log.info("%s: %s -> %s, %d tensors, %s", src, hparams.architecture, arch.name, len(tensors), outtype)

    # a Hub snapshot directory is named by its commit hash: name the model by its repo id then
    name = Path(src).name if directory != Path(src).expanduser() else directory.resolve().name

    def add_metadata(w) -> None:
        add_general(w, name, OUTTYPES[outtype][1], tensors, directory)
        arch.add_parameters(w)
        add_vocab(w, vocab, arch.space_prefix(vocab.add_space_prefix, vocab.model))

    write_gguf(out, arch.name, add_metadata, tensors, lambda t: t.produce(arch))
    return out
