"""Calibration of the KV cache from a model's own keys and values (docs/design.md §8): the sidecar
GGUF `<model>.kvcalib.gguf` that calibrated rotations read (native/src/kv/kv_calib.h
describes its keys and tensors).

Per layer and KV head, over the calibration text:

    c = mean of the vectors (post-RoPE keys, or values)
    U = eigenvectors of their covariance, by decreasing eigenvalue (each one's largest
        component made positive, so the result does not depend on the solver's signs)
    R = Hd · Uᵀ   with Hd the Hadamard rotation of that (layer, head, kind) (rotation.py)

Uᵀ turns a vector into its principal components; the Hadamard then spreads them, so every
channel of x' = R (x - c) carries about the same variance and a few large components no
longer set a whole group's range.

With `kvq` (kvq_calibration.py: a torch pass for Fisher information) the sidecar also holds
KVQuant's per-channel key thresholds and nuq codebooks.

The keys and values are read back from the runtime itself: each calibration window runs
through the fp16 cache, whose stores are then exported (Model.kv_head_state). The text is cut into windows of n_ctx tokens (BOS first when the vocabulary
adds it), at most n_seqs of them; everything is deterministic.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from . import __version__
from .errors import InvalidArgumentError
from .kvq_calibration import KVQCalibration, add_to_sidecar
from .reference.rotation import hadamard


@dataclass(frozen=True)
class Calibration:
    """Statistics of one model on calibration text, per layer and KV head."""

    arch: str
    model_hash: str  # ott_model_fingerprint, 16 hex digits
    n_tokens: int  # tokens the statistics were taken over (per layer and head)
    text: str  # what the text was (for the sidecar's record)
    rot_k: np.ndarray | None  # float32 [n_layer, n_head_kv, d, d]; None: KVQuant tables only
    center_k: np.ndarray | None  # float32 [n_layer, n_head_kv, d]
    rot_v: np.ndarray | None
    center_v: np.ndarray | None
    kvq: KVQCalibration | None = None  # KVQuant tables (kvq_calibration.py), when computed


def principal_rotation(
    sum_x: np.ndarray, sum_xx: np.ndarray, n: int, hd_rot: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(R, c) of one head from the sums of its n vectors: sum_x [d], sum_xx [d, d] (float64)."""
    c = sum_x / n
    cov = sum_xx / n - np.outer(c, c)
    w, u = np.linalg.eigh(cov)  # ascending eigenvalues
    u = u[:, ::-1]
    u *= np.where(u[np.abs(u).argmax(axis=0), np.arange(u.shape[1])] < 0, -1.0, 1.0)
    return hd_rot @ u.T, c


class _Sums:
    """Running sums of the vectors of every (layer, KV head), float64."""

    def __init__(self, n_layer: int, n_head_kv: int, d: int):
        self.x = np.zeros((n_layer, n_head_kv, d))
        self.xx = np.zeros((n_layer, n_head_kv, d, d))
        self.n = np.zeros((n_layer, n_head_kv), dtype=np.int64)  # vectors summed (a local layer's ring holds fewer)

    def add(self, il: int, h: int, rows: np.ndarray) -> None:
        r = rows.astype(np.float64)  # [n, d]
        self.x[il, h] += r.sum(axis=0)
        self.xx[il, h] += r.T @ r
        self.n[il, h] += len(r)


def collect(
    model_path: str | os.PathLike,
    text: str,
    n_ctx: int = 2048,
    n_seqs: int = 16,
    n_threads: int | None = None,
    device: str | None = None,
    progress: bool = True,
    text_name: str = "",
) -> Calibration:
    """Keys and values of `model_path` on `text`, reduced to rotations and centres."""
    from .model import Model
    from .perplexity import tokenize_for_windows

    if n_ctx < 16 or n_seqs < 1:
        raise InvalidArgumentError(f"calibrate: windows of {n_ctx} tokens (at least 16) times {n_seqs} (at least 1)")
    model = Model(model_path, n_ctx=n_ctx, kv="f16", n_threads=n_threads, device=device)
    try:
        info = model.info
        ids = tokenize_for_windows(model.tokenize, text, n_ctx * n_seqs)
        n_win = min(n_seqs, len(ids) // n_ctx)
        if n_win == 0:
            raise InvalidArgumentError(f"calibrate: the text has {len(ids)} tokens, fewer than one window of {n_ctx}")
        bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None
        d, L, H = info.n_embd_head, info.n_layer, info.n_head_kv
        sums = {"k": _Sums(L, H, d), "v": _Sums(L, H, d)}
        for w in tqdm(range(n_win), desc="calibrate", unit="window", disable=not progress):
            window = ids[w * n_ctx : (w + 1) * n_ctx]
            if bos is not None:
                window = [bos] + window[1:]
            model.truncate(0)
            for i in range(0, n_ctx, model.n_ubatch):
                model.eval(window[i : i + model.n_ubatch])
            for il in range(L):
                for h in range(H):
                    st = model.kv_head_state(il, 0, h)
                    sums["k"].add(il, h, st.window_k)
                    sums["v"].add(il, h, st.window_v)
        n = n_win * n_ctx
        out = {}
        for kind, s in sums.items():
            rots, centres = np.empty((L, H, d, d)), np.empty((L, H, d))
            for il in range(L):
                for h in range(H):
                    rots[il, h], centres[il, h] = principal_rotation(
                        s.x[il, h], s.xx[il, h], int(s.n[il, h]), hadamard(d, il, h, kind == "v")
                    )
            out[kind] = (rots.astype(np.float32), centres.astype(np.float32))
        return Calibration(info.arch, f"{model.fingerprint():016x}", n, text_name, *out["k"], *out["v"])
    finally:
        model.close()


def _part(path: str | os.PathLike) -> Path:
    """The temporary name `write` writes a sidecar to before moving it into place."""
    path = Path(path)
    return path.with_name(path.name + ".part")


def check_writable(path: str | os.PathLike) -> None:
    """One error line now, not after minutes of calibration, when the sidecar cannot be
    written at path (no such folder, no permission): its temporary file is made and removed."""
    tmp = _part(path)
    try:
        with open(tmp, "wb"):
            pass
        tmp.unlink()
    except OSError as e:
        raise InvalidArgumentError(f"calibrate: cannot write {path}: {e.strerror or e}") from None


def write(cal: Calibration, path: str | os.PathLike) -> None:
    """The sidecar GGUF of `cal` (written to a temporary name, then moved into place)."""
    from gguf import GGUFWriter

    path, tmp = Path(path), _part(path)
    if cal.rot_k is not None:
        L, H, d = cal.rot_k.shape[:3]
    else:
        L, (H, d) = cal.kvq.n_layer, next(iter(cal.kvq.k_range[0].values())).shape[:2]
    w = GGUFWriter(str(tmp), arch="ott-kvcalib")
    w.add_string("ott.calib.architecture", cal.arch)
    w.add_uint32("ott.calib.block_count", L)
    w.add_uint32("ott.calib.head_count_kv", H)
    w.add_uint32("ott.calib.key_length", d)
    w.add_string("ott.calib.model_hash", cal.model_hash)
    w.add_string("ott.calib.text", cal.text)
    w.add_uint64("ott.calib.n_tokens", cal.n_tokens)
    w.add_string("ott.calib.version", __version__)
    for il in range(L if cal.rot_k is not None else 0):
        w.add_tensor(f"ott.rot_k.{il}", np.ascontiguousarray(cal.rot_k[il]))
        w.add_tensor(f"ott.center_k.{il}", np.ascontiguousarray(cal.center_k[il]))
        w.add_tensor(f"ott.rot_v.{il}", np.ascontiguousarray(cal.rot_v[il]))
        w.add_tensor(f"ott.center_v.{il}", np.ascontiguousarray(cal.center_v[il]))
    if cal.kvq is not None:
        add_to_sidecar(w, cal.kvq)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
