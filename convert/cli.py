"""Command line: convert SRC OUT.gguf [--outtype T] [--revision R]."""
from __future__ import annotations

import argparse
import logging
from typing import Sequence

from .converter import convert
from .outtype import OUTTYPES


def parser(prog: str = "python -m convert") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Convert a Hugging Face checkpoint to GGUF.")
    p.add_argument("src", help="checkpoint directory, or Hugging Face Hub repo id org/name")
    p.add_argument("out", help="GGUF file to write")
    p.add_argument("--outtype", choices=list(OUTTYPES), default="f16",
                   help="type of the weight matrices (norms and 1-D tensors stay f32); default f16")
    p.add_argument("--revision", help="Hub branch, tag or commit (repo ids only)")
    p.add_argument("--verbose", action="store_true", help="log each step")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the converter; raises ott_gguf.errors exceptions on bad input, returns 0 on success."""
    args = parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    convert(args.src, args.out, outtype=args.outtype, revision=args.revision)
    return 0
