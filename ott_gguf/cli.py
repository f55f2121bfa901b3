"""Command line: `python -m ott_gguf {run,chat,serve,info,perplexity,bench,tokenize,calibrate,convert} ...`.

MODEL is a GGUF path, a Hub repo id `org/name[:file.gguf]`, or omitted for the default
SmolLM2-135M-Instruct Q4_1 (see resolve.py). Errors print one line `error: ...` on stderr
and exit with 1 (2 for a bad command line); `--verbose` adds the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import traceback
from pathlib import Path

from .chat_session import ChatSession
from .errors import ContextFullError, InvalidArgumentError, OttError
from .reference.config import PRESETS as _KV_PRESETS
from .reference.rotation import ROTATIONS

# info and tokenize evaluate nothing: a small context keeps the KV allocation negligible.
_NO_EVAL_CTX = 256
# --kv-* overrides: KVConfig knob -> what it sets
_KV_KNOBS = {
    "bits_k": "bits per key code",
    "bits_v": "bits per value code",
    "group_k": "tokens per key group",
    "group_v": "channels per value group",
    "block": "tokens quantized together",
    "window": "fp16 window R",
    "pool": "outlier tokens per KV head",
    "extra_pool": "extra-pool tokens per KV head",
    "skip_layers": "first layers without outlier tracing",
    "sink": "first tokens kept in fp16",
    "clip": "clipped group ranges (1) or min-max (0)",
    "param_bits": "bits of a group's scale and min: 16 or 8",
    "key_axis": "key groups per channel (0) or per token along the head (1, CPU only)",
    "hi_k": "key tiers: of every 16 channels of a block, ranked by range x query scale, the first coded with 4 bits",
    "lo_k": "key tiers: of every 16 channels of a block, the last ones coded with 1 bit",
    "recent": "the newest N blocks keep 4-bit keys and values, re-coded to the mode's codes as they age",
    "sym_v": "value groups symmetric around zero, their scale alone stored (1) or scale and min (0)",
    "pre_rope": "keys cached before RoPE, rotated at their position in attention (1) or after (0)",
}
# --kv-rot-k / --kv-rot-v: KVConfig rotation knob -> what it rotates
_KV_ROTATIONS = {"rot_k": "keys (and queries)", "rot_v": "values (undone after attention)"}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit code 2), like every other error here."""

    def error(self, message: str):
        sys.stderr.write(f"error: {_one_line(self.prog)}: {_one_line(message)} (see {self.prog} --help)\n")
        sys.exit(2)


def _percent(text: str) -> float:
    """A percentage 0 .. 10 with at most two decimals (KVQuant outliers, per 10000 inside)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got '{text}'") from None
    if not 0 <= value <= 10 or abs(value * 100 - round(value * 100)) > 1e-9:
        raise argparse.ArgumentTypeError(f"must be 0 .. 10 in steps of 0.01, got {text}")
    return value


def _one_line(text: str) -> str:
    """`text` on one line, newlines as spaces, other unprintable characters escaped (a file's
    or a flag's bytes never reach the terminal as control characters)."""
    text = " ".join(text.split("\n"))
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


MAX_THREADS = 512  # what the native library accepts (native/src/context.cpp: ott_context_set_threads)


def _int_at_least(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got '{text}'") from None
        if value < low or (high is not None and value > high):
            bounds = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return value

    return parse


def _logit_bias(text: str) -> tuple[int, float]:
    """TOKEN_ID(+/-)BIAS, as llama.cpp's --logit-bias: (token id, bias)."""
    m = re.fullmatch(r"(\d+)([+-](?:\d+\.?\d*|\.\d+))", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID(+/-)BIAS such as 15043+1, got '{text}'")
    return int(m.group(1)), float(m.group(2))


def _depth_list(text: str) -> list[int]:
    try:
        depths = [int(d) for d in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if min(depths) < 0:
        raise argparse.ArgumentTypeError(f"depths must be >= 0, got '{text}'")
    return depths


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}


def _size(text: str) -> int:
    """Bytes from '2GiB', '512MiB', '1.5G' (K, M, G, T and KiB ... binary; KB, MB, GB, TB decimal)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match[2].lower() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 2GiB, 512MiB or 1.5G, got '{text}'")
    return int(float(match[1]) * _SIZE_UNITS[match[2].lower()])


def _slot_count(text: str) -> int | None:
    """An integer >= 1, or 'auto' (None): as many slots as the KV memory budget fits."""
    return None if text == "auto" else _int_at_least(1)(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m ott_gguf", description="Run GGUF language models (llama, mistral, qwen2).")
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors"
    )
    common = argparse.ArgumentParser(add_help=False, parents=[verbose])
    common.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="GGUF path, Hub repo id org/name[:file.gguf], or omitted for SmolLM2-135M-Instruct Q4_1",
    )

    kvopts = argparse.ArgumentParser(add_help=False)
    kvopts.add_argument(
        "--kv",
        default="f16",
        choices=[*_KV_PRESETS, "auto"],
        help="KV cache mode (default f16; auto: the recommended quantized cache)",
    )
    for knob, what in _KV_KNOBS.items():
        kvopts.add_argument(
            f"--kv-{knob.replace('_', '-')}",
            dest=f"kv_{knob}",
            type=_int_at_least(0),
            metavar="N",
            help=f"override the mode's {what}",
        )
    for knob, what in _KV_ROTATIONS.items():
        kvopts.add_argument(
            f"--kv-{knob.replace('_', '-')}",
            dest=f"kv_{knob}",
            choices=ROTATIONS,
            help=f"override the mode's rotation of {what}",
        )
    kvopts.add_argument(
        "--kv-outliers",
        dest="kv_outliers",
        type=_percent,
        metavar="PCT",
        help="override the mode's dense-and-sparse outliers, percent of a block's values (KVQuant)",
    )
    kvopts.add_argument(
        "--kv-calib",
        type=Path,
        metavar="FILE",
        help="calibration sidecar of calibrated rotations (default: MODEL.kvcalib.gguf beside the model)",
    )
    kvopts.add_argument(
        "--prefill-fp16",
        action="store_true",
        help="a prompt attends in full precision and is quantized afterwards (quantized modes)",
    )

    # where the work runs: every command that computes with the model (runtime, calibrate)
    compute = argparse.ArgumentParser(add_help=False)
    compute.add_argument(
        "-t", "--threads", type=_int_at_least(1, MAX_THREADS), help="CPU threads (default: physical cores)"
    )
    compute.add_argument(
        "--device",
        help="cpu, cuda or cuda:N (default: the first GPU when this build has CUDA and one is present, else cpu)",
    )
    compute.add_argument(
        "--no-repack",
        dest="repack",
        action="store_false",
        help="keep the file's weight layout on the CPU (default: a faster one where the type has it)",
    )
    runtime = argparse.ArgumentParser(add_help=False, parents=[kvopts, compute])

    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument(
        "-n", "--n-predict", type=_int_at_least(1), default=256, help="tokens to generate at most (default 256)"
    )
    sampling.add_argument("-c", "--ctx-size", type=_int_at_least(2), help="context size (default: the model's)")
    sampling.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    sampling.add_argument("--top-k", type=_int_at_least(0), default=40, help="0 = off (default 40)")
    sampling.add_argument("--top-p", type=float, default=0.95, help="1 = off (default 0.95)")
    sampling.add_argument("--min-p", type=float, default=0.05, help="0 = off (default 0.05)")
    sampling.add_argument("--repeat-penalty", type=float, default=1.0, help="1 = off (default 1.0)")
    sampling.add_argument(
        "--repeat-last-n",
        type=_int_at_least(-1),
        default=64,
        help="tokens the penalty looks back; -1 = all, 0 = off (default 64)",
    )
    sampling.add_argument("--seed", type=_int_at_least(0), help="random seed (default: random)")
    sampling.add_argument(
        "-l",
        "--logit-bias",
        type=_logit_bias,
        action="append",
        metavar="TOKEN_ID(+/-)BIAS",
        help="add BIAS (-100 .. 100) to a token's logit before sampling, e.g. 15043+1 or 15043-100 (repeatable)",
    )

    p = sub.add_parser("run", parents=[common, runtime, sampling], help="generate text from a prompt")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("-p", "--prompt", help="prompt text (special tokens like <|im_start|> are parsed)")
    mode.add_argument("--chat", action="store_true", help="interactive chat (same as the chat command)")
    p.add_argument("--system", help="system message for --chat")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "chat",
        parents=[common, runtime, sampling],
        help="interactive chat with the model's chat template, one message per stdin line",
    )
    p.add_argument("--system", help="system message")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser(
        "serve",
        parents=[common, runtime],
        help="OpenAI-compatible HTTP server with continuous batching (docs/server.md)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_int_at_least(0, 65535), default=8080, help="port (default 8080; 0: a free one)")
    p.add_argument(
        "--parallel",
        type=_slot_count,
        default=4,
        metavar="N|auto",
        help="slots: sequences decoded together (default 4); auto: as many as --kv-memory fits",
    )
    p.add_argument("-c", "--ctx-size", type=_int_at_least(2), help="tokens per slot (default: the model's context)")
    p.add_argument(
        "--kv-memory",
        type=_size,
        metavar="SIZE",
        help="KV cache budget for all slots, e.g. 2GiB (with --parallel auto: picks the slot count)",
    )
    p.add_argument(
        "-b",
        "--batch",
        type=_int_at_least(1),
        default=512,
        help="tokens per step: one per generating slot, then prompt chunks (default 512)",
    )
    p.add_argument(
        "--max-queue",
        type=_int_at_least(0),
        default=64,
        help="requests that may wait for a slot; more get 503 (default 64)",
    )
    p.add_argument(
        "--prompt-cache",
        action="store_true",
        help="a new request reuses the cached prefix of its prompt that a free slot holds (a chat's "
        "earlier turns); its output may then differ from the request alone by rounding",
    )
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route except /health")
    p.add_argument("--alias", help="model id in the API (default: the file name without .gguf)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "info", parents=[common, kvopts], help="describe a model: architecture, sizes, tensor types, KV bytes"
    )
    p.add_argument(
        "-c",
        "--ctx-size",
        type=_int_at_least(1),
        help="context of the KV bytes and footprint lines (default: the trained context)",
    )
    p.set_defaults(func=cmd_info)

    p = sub.add_parser(
        "perplexity", parents=[common, runtime], help="perplexity over non-overlapping windows, llama.cpp's method"
    )
    p.add_argument("-f", "--file", required=True, type=Path, help="text file (UTF-8)")
    p.add_argument("-c", "--ctx-size", type=_int_at_least(4), default=512, help="window size in tokens (default 512)")
    p.add_argument("--chunks", type=_int_at_least(1), help="number of windows (default: all)")
    p.add_argument(
        "-b",
        "--ubatch",
        type=_int_at_least(1),
        help="tokens per decode call (default: decode-faithful chunks for a quantized cache, else 512)",
    )
    p.add_argument(
        "--kl",
        action="store_true",
        help="also run the f16 cache and report the mean KL divergence to it and top-1 agreement",
    )
    p.set_defaults(func=cmd_perplexity)

    p = sub.add_parser("bench", parents=[common, runtime], help="prompt and decode tokens/s at context depths")
    p.add_argument("-p", "--n-prompt", type=_int_at_least(0), default=512, help="prompt tokens (default 512)")
    p.add_argument("-n", "--n-gen", type=_int_at_least(0), default=128, help="decoded tokens (default 128)")
    p.add_argument("-d", "--depths", type=_depth_list, default=[0], help="comma-separated depths (default 0)")
    p.add_argument("-r", "--reps", type=_int_at_least(1), default=5, help="repetitions, median reported (default 5)")
    p.add_argument("-b", "--ubatch", type=_int_at_least(1), default=512, help="tokens per decode call (default 512)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("tokenize", parents=[common], help="token ids of a text, like llama-tokenize")
    p.add_argument("-p", "--prompt", required=True, help="text to tokenize")
    p.add_argument("--ids", action="store_true", help="print only a JSON list of ids")
    p.add_argument("--no-parse-special", action="store_true", help="treat special-token text as plain text")
    p.add_argument("--no-bos", action="store_true", help="do not add BOS/EOS even if the vocabulary does")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser(
        "calibrate",
        parents=[common, compute],
        help="rotations of the KV cache from the model's keys and values on a text (a sidecar GGUF)",
    )
    p.add_argument("-f", "--file", required=True, type=Path, help="calibration text (UTF-8), not the evaluation text")
    p.add_argument("-o", "--output", type=Path, help="sidecar to write (default: MODEL.kvcalib.gguf beside the model)")
    p.add_argument("-c", "--ctx-size", type=_int_at_least(16), default=2048, help="tokens per window (default 2048)")
    p.add_argument(
        "--windows", type=_int_at_least(1), default=16, help="windows of the text to use at most (default 16)"
    )
    p.add_argument(
        "--kvquant",
        action="store_true",
        help="also KVQuant's key thresholds and Fisher-weighted codebooks (needs torch: ott-gguf[calibrate])",
    )
    p.add_argument(
        "--kvquant-only",
        action="store_true",
        help="only the KVQuant tables (no rotations: skips the runtime's pass over the text)",
    )
    p.add_argument(
        "--kv-outliers",
        type=_percent,
        nargs="+",
        metavar="PCT",
        default=[0.0, 1.0],
        help="outlier percentages to calibrate KVQuant thresholds for (default 0 1)",
    )
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser(
        "convert",
        parents=[verbose],
        help="convert a Hugging Face checkpoint to GGUF",
        description="Convert a Hugging Face checkpoint to GGUF.",
    )
    _converter_cli().add_arguments(p)
    p.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    n_global = 0
    while n_global < len(argv) and argv[n_global] in ("-v", "--verbose"):
        n_global += 1
    verbose = n_global > 0 or "--verbose" in argv
    try:
        args = build_parser().parse_args(argv)
        verbose = args.verbose
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except OttError as e:
        return _fail(str(e), verbose)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        return _fail(f"{where}{e.strerror or e}", verbose)
    except ImportError as e:
        # A broken installation (native library, optional dependency) is one line too.
        return _fail(str(e), verbose)


def _fail(message: str, verbose: bool) -> int:
    if verbose:
        traceback.print_exc()
    print("error: " + _one_line(message), file=sys.stderr)
    return 1


def _load(args, n_ctx: int | None, n_ubatch: int = 512, kv=None, scratch: bool = False):
    """The model of args with its --kv cache (or the KVConfig kv instead); scratch: a second
    sequence where that cache is quantized (bench's repetitions at a depth start from a copy)."""
    # Imported here so that --help and usage errors work without loading the native library.
    from .model import Model, Weights
    from .resolve import resolve_model

    weights = Weights(
        resolve_model(args.model), repack=getattr(args, "repack", True), device=getattr(args, "device", None)
    )
    try:
        kv_cfg = kv or _kv_config(args, weights)
        model = Model(
            weights,
            n_ctx=n_ctx,
            n_seq_max=2 if scratch and kv_cfg.quantized else 1,
            n_ubatch=n_ubatch,
            n_threads=getattr(args, "threads", None),
            kv=kv_cfg,
            prefill_fp16=getattr(args, "prefill_fp16", False),
            kv_calib=None if kv else getattr(args, "kv_calib", None),
        )
    except BaseException:
        weights.close()
        raise
    if model.n_ctx_note:
        print(f"note: {model.n_ctx_note} (-c sets the context size)", file=sys.stderr)
    return model


def _kv_config(args, weights=None):
    """The --kv mode with its --kv-* overrides, validated (one clear error when invalid); auto
    as the weights resolve it (Weights.kv_config), or the model-independent AUTO without them."""
    from .reference.config import preset

    kv = getattr(args, "kv", "f16")
    cfg = weights.kv_config(kv) if weights is not None else preset(kv)
    rotations = {
        knob: None if getattr(args, f"kv_{knob}", None) is None else ROTATIONS.index(getattr(args, f"kv_{knob}"))
        for knob in _KV_ROTATIONS
    }
    outliers = getattr(args, "kv_outliers", None)
    return cfg.with_overrides(
        **{knob: getattr(args, f"kv_{knob}", None) for knob in _KV_KNOBS},
        **rotations,
        outliers=None if outliers is None else round(outliers * 100),
    )


def _kv_description(kv: str, fp) -> str:
    return (
        f"{kv}: {fp.bytes_per_token_per_layer:.1f} bytes per token per layer, "
        f"{fp.bits_per_element:.2f} bits per element at {fp.n_ctx} tokens (everything counted)"
    )


def _layer_kinds(weights, n_ctx: int) -> str:
    """The layer count, and which layers are local (an fp16 ring of their window) at n_ctx."""
    local = weights.local_layers(n_ctx)
    n = weights.info.n_layer
    if not local:
        window = weights.info.n_swa
        return f"{n}" + (
            f" (sliding window of {window} tokens, not shorter than the context: all global)" if window else ""
        )
    glob = [il for il in range(n) if il not in local]
    listed = ", ".join(map(str, glob)) if glob else "none"
    return (
        f"{n}: {len(local)} local (sliding window of {weights.info.n_swa} tokens, fp16 ring), "
        f"{len(glob)} global ({listed})"
    )


def _sampling(args):
    from .sampling import SamplingParams

    return SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        repeat_last_n=args.repeat_last_n,
        seed=args.seed,
        logit_bias=dict(args.logit_bias) if args.logit_bias else None,
    )


# ---- run / chat -----------------------------------------------------------------------------


def cmd_run(args) -> int:
    if args.chat:
        return cmd_chat(args)
    if args.prompt is None:
        raise InvalidArgumentError("run: give a prompt with -p PROMPT, or use --chat")
    if args.system is not None:
        raise InvalidArgumentError("run: --system needs --chat")
    from .generate import check_fits, generate_text

    sampling = _sampling(args)
    model = _load(args, args.ctx_size)
    ids = model.tokenize(args.prompt, add_special=True, parse_special=True)
    check_fits(model, len(ids))
    for piece in generate_text(model, ids, args.n_predict, sampling):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    # the last token sampled is not evaluated: the cache holds the prompt and all but it
    n_out = model.seq_len(0) - len(ids) + 1
    if n_out < args.n_predict and model.seq_len(0) + 1 >= model.n_ctx:
        print(
            f"note: stopped after {n_out} of {args.n_predict} tokens: the context of {model.n_ctx} tokens "
            "is full (raise -c/--ctx-size)",
            file=sys.stderr,
        )
    return 0


def cmd_chat(args) -> int:
    sampling = _sampling(args)
    model = _load(args, args.ctx_size)
    session = ChatSession(model, sampling, max_reply=args.n_predict, system=args.system)
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        try:
            for piece in session.reply(line.rstrip("\n")):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except ContextFullError as e:
            # One message too long for the context ends that turn, not the conversation.
            print(f"error: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()


def cmd_serve(args) -> int:
    if args.parallel is None and args.kv_memory is None:
        raise InvalidArgumentError("serve: --parallel auto needs --kv-memory SIZE")
    try:
        from .server import listen, open_slots, serve
    except ImportError as e:
        raise ImportError(f"serve needs the 'serve' extra (pip install 'ott-gguf[serve]'): {e}") from None
    from .model import Weights
    from .resolve import resolve_model

    sock = listen(args.host, args.port)  # before the model loads: a taken port fails at once
    weights = Weights(resolve_model(args.model), repack=args.repack, device=args.device)
    kv_cfg = _kv_config(args, weights)
    ctx, plan = open_slots(
        weights,
        kv_config=kv_cfg,
        n_ctx=args.ctx_size or weights.info.n_ctx_train,
        parallel=args.parallel,
        kv_memory=args.kv_memory,
        batch=args.batch,
        n_threads=args.threads,
        prefill_fp16=args.prefill_fp16,
        kv_calib=args.kv_calib,
    )
    model_id = args.alias or weights.path.name.removesuffix(".gguf")
    serve(
        ctx,
        plan,
        sock=sock,
        model_id=model_id,
        api_key=args.api_key,
        max_queue=args.max_queue,
        batch=args.batch,
        prompt_cache=args.prompt_cache,
    )
    return 0


# ---- info / tokenize ------------------------------------------------------------------------

_ROPE_NAMES = {0: "normal", 2: "neox"}


def cmd_info(args) -> int:
    from .model import kv_mode_name
    from .reference.config import preset
    from .reference.footprint import ring_rows

    # the KVQuant cache needs its calibrated tables, info does not: the formula's footprint on an
    # f16 context; a sidecar named with --kv-calib is still read, so that a bad one is an error here too
    kv_cfg = _kv_config(args)
    model = _load(args, _NO_EVAL_CTX, kv=preset("f16") if kv_cfg.kvq else None)
    if kv_cfg.kvq and args.kv_calib is not None:
        from .model import check_kvq_sidecar

        check_kvq_sidecar(kv_cfg, args.kv_calib, model.weights)
    kv_cfg = _kv_config(args, model.weights)  # auto as these weights resolve it
    kv_name = kv_mode_name(kv_cfg)
    info, meta = model.info, model.metadata
    file_bytes = model.path.stat().st_size
    n_ctx = args.ctx_size or info.n_ctx_train
    fp = model.weights.kv_footprint(kv_cfg, n_ctx, n_ctx, model.n_ubatch)  # a context of n_ctx tokens
    seq_bytes = model.weights.kv_seq_bytes(kv_cfg, n_ctx, model.n_ubatch)
    kv_per_token = int(round(fp.bytes_per_token_per_layer * info.n_layer))
    local = model.weights.local_layers(n_ctx)
    rows = [
        ("file", f"{model.path} ({file_bytes / 2**20:.1f} MiB)"),
        ("name", meta.get("general.name", "-")),
        ("architecture", info.arch),
        (
            "parameters",
            f"{info.n_params / 1e6:.2f} M (weights {info.weight_bytes / 2**20:.1f} MiB, "
            f"{8 * info.weight_bytes / info.n_params:.2f} bits per weight)",
        ),
        ("context", f"{info.n_ctx_train} tokens (trained)"),
        ("layers", _layer_kinds(model.weights, n_ctx)),
        ("embedding", str(info.n_embd)),
        ("feed-forward", str(info.n_ff)),
        ("heads", f"{info.n_head} query, {info.n_head_kv} key/value, head size {info.n_embd_head}"),
        (
            "rope",
            f"{_ROPE_NAMES.get(info.rope_type, info.rope_type)}, base {info.rope_freq_base:g}, "
            f"scale {info.rope_freq_scale:g}",
        ),
        ("rms norm eps", f"{info.norm_rms_eps:g}"),
        ("output", "tied to the token embedding" if info.tied_output else "separate matrix"),
        (
            "vocabulary",
            f"{info.n_vocab} tokens, {meta.get('tokenizer.ggml.model', '?')} "
            f"(pre-tokenizer {meta.get('tokenizer.ggml.pre', 'default')}), "
            f"BOS {model.tokenizer.bos_id} ({'added' if model.tokenizer.add_bos else 'not added'}), "
            f"EOS {meta.get('tokenizer.ggml.eos_token_id', '-')}",
        ),
        ("chat template", "yes" if "tokenizer.chat_template" in meta else "no (ChatML is used)"),
        (
            f"KV cache {kv_name}",
            f"{kv_per_token} bytes per token ({kv_per_token / 1024:.1f} KiB; "
            f"{kv_per_token * n_ctx / 2**20:.1f} MiB for {n_ctx} tokens)"
            + (
                f"; {kv_name} on the {info.n_layer - len(local)} global layers, an fp16 ring of "
                f"{ring_rows(info.n_swa, n_ctx, model.n_ubatch)} tokens on the {len(local)} local"
                if local
                else ""
            ),
        ),
        ("KV footprint", _kv_description(kv_name, fp)),
        (
            "KV stores",
            ", ".join(f"{store} {fp.bits_per_element * b / fp.total_bytes:.3f}" for store, b in fp.bytes.items() if b)
            + " bits per element",
        ),
        (
            "KV allocation",
            f"{seq_bytes / 2**20:.1f} MiB per sequence of {n_ctx} tokens at most, "
            f"{seq_bytes / fp.total_bytes:.2f}x the footprint (aligned arrays, whole rings and pools)",
        ),
        (
            "tensor types",
            ", ".join(
                f"{name.lower()} {n}" for name, n in sorted(model.tensor_types.items(), key=lambda kv: (-kv[1], kv[0]))
            ),
        ),
    ]
    width = max(len(k) for k, _ in rows) + 2
    for key, value in rows:
        print(f"{key:<{width}}{value}")
    return 0


def cmd_calibrate(args) -> int:
    from dataclasses import replace

    from .calibrate import check_writable, collect, write
    from .model import default_calibration
    from .resolve import resolve_model

    path = resolve_model(args.model)
    text = _read_text(args.file)
    out = args.output or default_calibration(path)
    check_writable(out)
    kvq = None
    if args.kvquant or args.kvquant_only:
        from .kvq_calibration import collect_kvq

        kvq = collect_kvq(
            path,
            text,
            n_ctx=args.ctx_size,
            n_seqs=args.windows,
            outliers=tuple(sorted({round(p * 100) for p in args.kv_outliers})),
            n_threads=args.threads,
            device=args.device,
        )
    if args.kvquant_only:
        from .calibrate import Calibration
        from .model import Weights

        weights = Weights(path, repack=args.repack, device="cpu")
        try:
            cal = Calibration(
                weights.info.arch,
                f"{weights.fingerprint():016x}",
                kvq.n_tokens,
                args.file.name,
                None,
                None,
                None,
                None,
                kvq=kvq,
            )
        finally:
            weights.close()
    else:
        cal = collect(
            path,
            text,
            n_ctx=args.ctx_size,
            n_seqs=args.windows,
            n_threads=args.threads,
            device=args.device,
            text_name=args.file.name,
        )
        cal = replace(cal, kvq=kvq)
    write(cal, out)
    what = (
        "KVQuant tables" if args.kvquant_only else "rotations of keys and values" + (", KVQuant tables" if kvq else "")
    )
    print(
        f"wrote {out}: {what}, {kvq.n_layer if args.kvquant_only else cal.rot_k.shape[0]} layers, "
        f"from {cal.n_tokens} tokens of {args.file.name}"
    )
    return 0


def _read_text(path: Path) -> str:
    # a FIFO or a device would block or never end: only a regular file is read
    if path.exists() and not path.is_file():
        raise InvalidArgumentError(f"{path}: not a regular file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgumentError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _converter_cli():
    """The converter's CLI module: `ott_gguf.convert` in an installed package, the checkout's
    top-level `convert/` when running from the source tree (pip installs it under ott_gguf)."""
    try:
        return importlib.import_module("ott_gguf.convert.cli")
    except ModuleNotFoundError as e:
        if e.name not in ("ott_gguf.convert", "ott_gguf.convert.cli"):
            raise
        return importlib.import_module("convert.cli")


def cmd_convert(args) -> int:
    return _converter_cli().run(args)


def cmd_tokenize(args) -> int:
    model = _load(args, _NO_EVAL_CTX)
    ids = model.tokenize(args.prompt, add_special=not args.no_bos, parse_special=not args.no_parse_special)
    if args.ids:
        print(json.dumps(ids))
        return 0
    for tok in ids:
        # A piece may be part of a UTF-8 character: its lone bytes are shown as \xNN.
        piece = model.tokenizer.token_to_piece(tok, special=True).decode("utf-8", errors="backslashreplace")
        print(f"{tok:6d} -> '{piece}'")
    return 0


# ---- perplexity / bench ---------------------------------------------------------------------


def cmd_perplexity(args) -> int:
    from tqdm import tqdm

    from .perplexity import perplexity

    text = _read_text(args.file)
    n_ctx = args.ctx_size
    if n_ctx % 2:
        raise InvalidArgumentError(f"perplexity: -c must be even, got {n_ctx}")
    # Without -b, a quantized cache is fed in decode-faithful chunks (each ends where the next
    # quantization event fires, docs/design.md §3); an fp16 cache takes the window in ubatches of 512.
    kv_cfg = _kv_config(args)
    ubatch = args.ubatch or (None if kv_cfg.quantized else min(512, n_ctx))
    model = _load(args, n_ctx, n_ubatch=min(ubatch or 512, n_ctx))
    reference = None
    if args.kl:  # an f16 cache on the same weights
        from .model import Context

        reference = Context(model.weights, n_ctx=n_ctx, n_ubatch=min(ubatch or 512, n_ctx), n_threads=args.threads)
    chunking = f"ubatch {ubatch}" if ubatch else "decode-faithful chunks (to each quantization event)"
    print(
        f"perplexity: {args.file}, windows of {n_ctx} tokens ({n_ctx // 2 - 1} scored each), "
        f"{chunking}, kv {model.kv}{', KL to the f16 cache' if reference else ''}",
        flush=True,
    )
    result = perplexity(
        model,
        text,
        n_ctx,
        n_chunks=args.chunks,
        ubatch=ubatch,
        progress=True,
        on_chunk=lambda i, ppl: tqdm.write(f"[{i}]{ppl:.4f}"),
        reference=reference,
    )
    print(
        f"Final estimate: PPL = {result.ppl:.4f} ± {result.stderr:.5f} "
        f"({result.chunks} windows, {result.n_tokens_scored} tokens scored)"
    )
    if reference is not None:
        print(f"KL to f16 cache = {result.kl:.6f} nats, top-1 agreement = {100 * result.top1:.2f} %")
    return 0


def cmd_bench(args) -> int:
    from .bench import bench, format_table
    from .model import physical_cores

    if args.n_prompt == 0 and args.n_gen == 0:
        raise InvalidArgumentError("bench: nothing to measure: -p and -n are both 0")
    n_ctx = max(args.depths) + max(args.n_prompt, args.n_gen)
    model = _load(args, n_ctx, n_ubatch=min(args.ubatch, n_ctx), scratch=True)
    rows = bench(
        model,
        n_prompt=args.n_prompt,
        n_gen=args.n_gen,
        depths=args.depths,
        reps=args.reps,
        scratch=1 if model.n_seq_max > 1 else None,
    )
    print(
        f"model {model.path.name} | threads {args.threads or physical_cores()} | kv {model.kv} | "
        f"ubatch {args.ubatch} | {args.reps} repetitions"
    )
    print(format_table(rows))
    print(f"KV footprint {_kv_description(model.kv, model.kv_footprint())}")
    return 0
