"""Command line: convert SRC OUT.gguf [--outtype T] [--revision R]."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from .converter import convert
from .outtype import OUTTYPES


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The converter's arguments; shared by `python -m convert` and `python -m ott_gguf convert`."""
    p.add_argument("src", metavar="SRC", help="checkpoint directory, or Hugging Face Hub repo id org/name")
    p.add_argument("out", metavar="OUT.gguf", help="GGUF file to write")
    p.add_argument(
        "--outtype",
        choices=list(OUTTYPES),
        default="f16",
        help="type of the weight matrices (norms and 1-D tensors stay f32); default f16",
    )
    p.add_argument("--revision", help="Hub branch, tag or commit (repo ids only)")
    p.add_argument("--log", action="store_true", help="log each step")
    return p


def run(args: argparse.Namespace) -> int:
    """Convert as the parsed arguments say; raises ott_gguf.errors exceptions on bad input."""
    if args.log:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    convert(args.src, args.out, outtype=args.outtype, revision=args.revision)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m convert SRC OUT.gguf ...`; raises ott_gguf.errors exceptions, returns 0 on success."""
    p = add_arguments(
        argparse.ArgumentParser(prog="python -m convert", description="Convert a Hugging Face checkpoint to GGUF.")
    )
    return run(p.parse_args(argv))
