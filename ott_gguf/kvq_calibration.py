"""KVQuant calibration (docs/kvquant.md, docs/design.md §8): per-channel key thresholds and
Fisher-weighted nuq codebooks from a torch forward and backward pass of the GGUF model's own
weights (torch_model.py) on calibration text, written into the same sidecar as the rotations
(calibrate.py).

Per calibration window of n_ctx tokens (BOS first when the vocabulary adds it), the loss is
the mean next-token cross entropy; the Fisher information of a key or value entry is the
square of the loss's gradient with respect to it (KVQuant's sensitivity). Positions below
SINK (the fp16 sink) take no part. Per layer:

- key thresholds, per KV head and channel, for keys before RoPE ("pre") and after ("post",
  the ablation): the q and 1 - q quantiles of the channel with q = outliers/20000 (outliers
  per 10000; 0: min and max), numpy's linear interpolation;
- codebooks of 2^b levels for b in BITS, keys per (pre/post, outliers), values per outliers:
  1-D k-means of the normalized entries that are not outliers (kvquant.py's rules: keys by
  the thresholds, values by the block's sparse selection and the token's range), each entry
  weighted by its Fisher information. The entries go into HIST_BINS bins on -1 .. 1 (their
  weight and weighted sum), Lloyd's iterations run on the bins from the weighted quantiles
  (i + 0.5)/2^b, until no bin changes cluster or KMEANS_ITERS;
- Q-Norm codebooks beside them (KVQuant's centroid normalization; `qnorm=1` reads them):
  each codebook shifted and scaled so that the same entries, coded with it and decoded,
  keep their (unweighted) mean and standard deviation; the affine map is refitted until
  they stay (the midpoints that code the entries move with the levels).

Everything is deterministic for a given torch build and thread count (torch's CPU matmuls
may sum in another order with another thread count).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from .errors import InvalidArgumentError, ModelFileError
from .reference import kvquant, nuq
from .reference.config import KVConfig, preset

BITS = (2, 3, 4)
OUTLIERS = (0, 100)  # default thresholds calibrated: no outliers and 1 %
SINK = 1  # positions kept in fp16 (the presets' sink)
HIST_BINS = 8192
KMEANS_ITERS = 100
QNORM_ITERS = 500
QNORM_TOL = 1e-4
ROPE_KINDS = ("pre", "post")


@dataclass
class KVQCalibration:
    """Per layer: k_range[(rope, outliers)] float32 [n_head_kv, d, 2] (lo, hi);
    codebook_k[(rope, outliers, bits)] and codebook_v[(outliers, bits)] float32 [2^bits];
    qnorm_k, qnorm_v: their Q-Norm twins (empty in sidecars written before them)."""

    n_layer: int
    block: int  # value blocks the codebooks were fitted on
    outliers: tuple[int, ...]
    k_range: list[dict] = field(default_factory=list)  # [n_layer]
    n_tokens: int = 0  # calibration tokens (windows · n_ctx)
    codebook_k: list[dict] = field(default_factory=list)
    codebook_v: list[dict] = field(default_factory=list)
    qnorm_k: list[dict] = field(default_factory=list)
    qnorm_v: list[dict] = field(default_factory=list)

    def layers(self, cfg: KVConfig) -> list[kvquant.KVQLayer]:
        """The tables a KVQuant config reads, per layer (uniform levels if cfg.uniform)."""
        rope = ROPE_KINDS[0] if cfg.pre_rope else ROPE_KINDS[1]
        if cfg.outliers not in self.outliers:
            raise InvalidArgumentError(
                f"calibration sidecar: no KVQuant thresholds for {cfg.outliers / 100:g} % outliers "
                f"(it has {', '.join(f'{o / 100:g} %' for o in self.outliers)}; calibrate with --kv-outliers)"
            )
        if cfg.qnorm and not self.qnorm_k:
            raise InvalidArgumentError(
                "calibration sidecar: no Q-Norm codebooks (written before them; calibrate again for qnorm=1)"
            )
        books_k, books_v = (self.qnorm_k, self.qnorm_v) if cfg.qnorm else (self.codebook_k, self.codebook_v)
        out = []
        for il in range(self.n_layer):
            r = self.k_range[il][(rope, cfg.outliers)]
            if cfg.uniform:
                lk, lv = nuq.uniform_levels(cfg.bits_k), nuq.uniform_levels(cfg.bits_v)
            else:
                lk = nuq.check_levels(books_k[il][(rope, cfg.outliers, cfg.bits_k)], cfg.bits_k, f"layer {il} keys")
                lv = nuq.check_levels(books_v[il][(cfg.outliers, cfg.bits_v)], cfg.bits_v, f"layer {il} values")
            out.append(kvquant.KVQLayer(r[..., 0], r[..., 1], lk, lv))
        return out


@dataclass
class EntryBins:
    """Entries t in -1 .. 1, optionally weighted, in HIST_BINS bins: each bin's weight (its
    count without weights) and weighted mean entry, and the entries' own (unweighted) mean and
    standard deviation. weighted_kmeans and qnorm_levels read entries only through these."""

    n: np.ndarray
    centre: np.ndarray
    mean: float
    std: float

    @classmethod
    def of(cls, t: np.ndarray, w: np.ndarray | None = None) -> EntryBins:
        edges = np.linspace(-1.0, 1.0, HIST_BINS + 1)
        n, _ = np.histogram(t, bins=edges, weights=w)
        s, _ = np.histogram(t, bins=edges, weights=t if w is None else w * t)
        centre = np.where(n > 0, s / np.where(n > 0, n, 1), (edges[:-1] + edges[1:]) / 2)
        t64 = t.astype(np.float64)
        return cls(n, centre, t64.mean(), t64.std())


def weighted_kmeans(bins: EntryBins, bits: int) -> np.ndarray:
    """Levels float32 [2^bits], ascending, of the binned entries (EntryBins.of(t, w): 1-D
    entries t weighted by w)."""
    wsum, centre = bins.n, bins.centre
    k = 2**bits
    cdf = np.cumsum(wsum) / max(wsum.sum(), np.finfo(float).tiny)
    levels = centre[np.minimum(np.searchsorted(cdf, (np.arange(k) + 0.5) / k), HIST_BINS - 1)]
    levels = np.where(np.diff(levels, prepend=-np.inf) > 0, levels, np.nan)
    levels = np.where(np.isnan(levels), np.linspace(-1, 1, k), levels)  # a degenerate start
    assign = None
    for _ in range(KMEANS_ITERS):
        new = np.searchsorted((levels[:-1] + levels[1:]) / 2, centre)
        if assign is not None and (new == assign).all():
            break
        assign = new
        cw = np.bincount(assign, weights=wsum, minlength=k)
        cs = np.bincount(assign, weights=wsum * centre, minlength=k)
        levels = np.where(cw > 0, cs / np.where(cw > 0, cw, 1), levels)
    levels = np.sort(levels).astype(np.float32)
    if (np.diff(levels) <= 0).any():  # merged clusters
        levels = np.maximum.accumulate(levels + np.arange(k, dtype=np.float32) * np.float32(1e-6))
    return levels


def qnorm_levels(bins: EntryBins, levels: np.ndarray) -> np.ndarray:
    """Q-Norm of a codebook: levels mapped by a * L + c so that the binned entries, coded with
    the result (nearest level) and decoded, keep their mean and standard deviation. The map is
    refitted until the coding stops moving the moments (QNORM_TOL of the standard deviation,
    at most QNORM_ITERS times). float32 [2^bits], ascending."""
    n, mean, std = bins.n, bins.mean, bins.std
    out = levels.astype(np.float64)
    for _ in range(QNORM_ITERS):
        q = out[np.searchsorted((out[:-1] + out[1:]) / 2, bins.centre)]
        q_mean = (n * q).sum() / n.sum()
        q_std = np.sqrt(max((n * q * q).sum() / n.sum() - q_mean**2, 0.0))
        if q_std == 0 or (abs(q_mean - mean) <= QNORM_TOL * std and abs(q_std - std) <= QNORM_TOL * std):
            break
        out = (out - q_mean) * (std / q_std) + mean
    return out.astype(np.float32)


def _fit(t: np.ndarray, w: np.ndarray) -> tuple[dict, dict]:
    """Codebooks and their Q-Norm twins {bits: levels} of entries t weighted by w."""
    weighted = EntryBins.of(t, w)  # binned once for every width
    books = {b: weighted_kmeans(weighted, b) for b in BITS}
    plain = EntryBins.of(t)
    return books, {b: qnorm_levels(plain, lv) for b, lv in books.items()}


def _key_tables(k: np.ndarray, fisher: np.ndarray, outliers: int) -> tuple[np.ndarray, dict, dict]:
    """Thresholds float32 [H, d, 2], codebooks and Q-Norm codebooks {bits: levels} of keys k fp16 [N, H, d]."""
    kf = k.astype(np.float32)
    q = outliers / 20000
    lo, hi = np.quantile(kf, [q, 1 - q], axis=0) if q else (kf.min(axis=0), kf.max(axis=0))
    zero, scale = nuq.channel_params(lo.astype(np.float32), hi.astype(np.float32))
    t = nuq.normalize(k, zero, scale)
    inside = np.abs(t) <= 1
    return np.stack([lo, hi], axis=-1).astype(np.float32), *_fit(t[inside], fisher[inside])


def _value_tables(v: np.ndarray, fisher: np.ndarray, outliers: int, block: int) -> tuple[dict, dict]:
    """Codebooks and Q-Norm codebooks {bits: levels} of values v fp16 [W, n, H, d] (n a multiple of block)."""
    W, n, H, d = v.shape
    blocks = v.reshape(W, n // block, block, H, d).transpose(0, 1, 3, 2, 4)  # [W, nb, H, block, d]
    fw = fisher.reshape(W, n // block, block, H, d).transpose(0, 1, 3, 2, 4)
    cfg = preset("kvquant2").with_overrides(outliers=outliers, block=block, group_k=block)
    out = kvquant.value_outliers(blocks, kvquant.n_outliers(cfg, d))
    t, _, _ = kvquant.normalize_values(blocks, out)
    keep = ~out
    return _fit(t[keep], fw[keep])


def collect_kvq(
    model_path: str | os.PathLike,
    text: str,
    n_ctx: int = 2048,
    n_seqs: int = 16,
    outliers: tuple[int, ...] = OUTLIERS,
    block: int = 32,
    n_threads: int | None = None,
    device: str | None = None,
    progress: bool = True,
) -> KVQCalibration:
    """KVQuant tables of `model_path` on `text` (see the module's docstring)."""
    from .model import Weights
    from .perplexity import tokenize_for_windows
    from .torch_model import TorchModel, _torch

    torch = _torch()
    if n_threads:
        torch.set_num_threads(n_threads)
    if n_ctx <= SINK + block or n_seqs < 1:
        raise InvalidArgumentError(f"calibrate: windows of {n_ctx} tokens (more than {SINK + block}) times {n_seqs}")
    weights = Weights(model_path, device="cpu")
    try:
        ids = tokenize_for_windows(weights.tokenize, text, n_ctx * n_seqs)
        bos = weights.tokenizer.bos_id if weights.tokenizer.add_bos else None
    finally:
        weights.close()
    n_win = min(n_seqs, len(ids) // n_ctx)
    if n_win == 0:
        raise InvalidArgumentError(f"calibrate: the text has {len(ids)} tokens, fewer than one window of {n_ctx}")
    tm = TorchModel(model_path, device=device or "cpu")
    n_used = (n_ctx - SINK) // block * block  # positions SINK .. SINK + n_used - 1
    # per layer: fp16 entries and float32 Fisher of keys pre / post RoPE and values [W, n_used, H, d]
    acts = [{name: [] for name in ("pre", "post", "v", "f_pre", "f_post", "f_v")} for _ in range(tm.n_layer)]
    for w in tqdm(range(n_win), desc="calibrate kvquant", unit="window", disable=not progress):
        window = ids[w * n_ctx : (w + 1) * n_ctx]
        if bos is not None:
            window = [bos] + window[1:]
        seen = []

        def observe(il, k_pre, k_post, v, seen=seen):
            for x in (k_pre, k_post, v):
                x.retain_grad()
            seen.append((il, k_pre, k_post, v))

        tokens = torch.tensor([window], device=tm.device)
        logits = tm.forward(tokens, observe=observe, grads=True)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], tokens[0, 1:])
        loss.backward()
        sl = slice(SINK, SINK + n_used)
        for il, k_pre, k_post, v in seen:
            a = acts[il]
            for name, x in (("pre", k_pre), ("post", k_post), ("v", v)):
                a[name].append(x.detach()[0, sl].cpu().numpy().astype(np.float16))
                a["f_" + name].append(x.grad[0, sl].cpu().numpy().astype(np.float32) ** 2)
        del logits, loss
    cal = KVQCalibration(tm.n_layer, block, tuple(outliers), n_tokens=n_win * n_ctx)
    for il in tqdm(range(tm.n_layer), desc="fit codebooks", unit="layer", disable=not progress):
        a = {name: np.stack(x) for name, x in acts[il].items()}  # [W, n_used, H, d]
        acts[il] = None
        ranges, books_k, books_v, qn_k, qn_v = {}, {}, {}, {}, {}
        for o in outliers:
            for rope in ROPE_KINDS:
                flat = a[rope].reshape(-1, *a[rope].shape[2:])
                ranges[(rope, o)], books, qn = _key_tables(flat, a["f_" + rope].reshape(flat.shape), o)
                books_k.update({(rope, o, b): lv for b, lv in books.items()})
                qn_k.update({(rope, o, b): lv for b, lv in qn.items()})
            books, qn = _value_tables(a["v"], a["f_v"], o, block)
            books_v.update({(o, b): lv for b, lv in books.items()})
            qn_v.update({(o, b): lv for b, lv in qn.items()})
        cal.k_range.append(ranges)
        cal.codebook_k.append(books_k)
        cal.codebook_v.append(books_v)
        cal.qnorm_k.append(qn_k)
        cal.qnorm_v.append(qn_v)
    return cal


# ---- the sidecar's KVQuant tensors -------------------------------------------------------


def tensor_names(cal: KVQCalibration, il: int) -> dict[str, np.ndarray]:
    """Sidecar tensors of layer il: ott.kvq.{pre|post}.{outliers}.k_range.{il} [H, d, 2],
    ott.kvq.{pre|post}.{outliers}.{bits}.codebook_k.{il} and ott.kvq.{outliers}.{bits}.codebook_v.{il} [2^bits],
    and the Q-Norm twins of the codebooks, qnorm_k and qnorm_v in their place."""
    out = {f"ott.kvq.{r}.{o}.k_range.{il}": x for (r, o), x in cal.k_range[il].items()}
    books = [("codebook", cal.codebook_k, cal.codebook_v)] + (
        [("qnorm", cal.qnorm_k, cal.qnorm_v)] if cal.qnorm_k else []
    )
    for kind, bk, bv in books:
        out.update({f"ott.kvq.{r}.{o}.{b}.{kind}_k.{il}": x for (r, o, b), x in bk[il].items()})
        out.update({f"ott.kvq.{o}.{b}.{kind}_v.{il}": x for (o, b), x in bv[il].items()})
    return out


def add_to_sidecar(w, cal: KVQCalibration) -> None:
    """Write cal's keys and tensors with a GGUFWriter w."""
    w.add_uint32("ott.kvq.block", cal.block)
    w.add_array("ott.kvq.outliers", list(cal.outliers))
    for il in range(cal.n_layer):
        for name, x in tensor_names(cal, il).items():
            w.add_tensor(name, np.ascontiguousarray(x, dtype=np.float32))


def open_sidecar(path: str | os.PathLike):
    """A gguf.GGUFReader of the sidecar at path; one error line when it cannot be read."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the calibration sidecar ({e.strerror or e})") from None
    except (ValueError, IndexError, KeyError):  # gguf-py's parse errors say little about the file
        raise ModelFileError(f"{path}: cannot read the calibration sidecar (truncated or not GGUF)") from None


def read_sidecar(path: str | os.PathLike, n_layer: int) -> KVQCalibration:
    """The KVQuant tables of a sidecar (one error line when it has none or they do not fit)."""
    r = open_sidecar(path)
    if "ott.kvq.outliers" not in r.fields:
        raise ModelFileError(f"{path}: the calibration sidecar has no KVQuant tables (calibrate with --kvquant)")
    if int(r.fields["ott.calib.block_count"].contents()) != n_layer:
        raise InvalidArgumentError(f"{path}: calibration sidecar is for a model of another layer count")
    cal = KVQCalibration(
        n_layer,
        int(r.fields["ott.kvq.block"].contents()),
        tuple(int(o) for o in r.fields["ott.kvq.outliers"].contents()),
    )
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in r.tensors if t.name.startswith("ott.kvq.")}
    kinds = ("codebook", "qnorm") if any(".qnorm_k." in name for name in tensors) else ("codebook",)
    for il in range(n_layer):
        ranges, books = {}, {kind: ({}, {}) for kind in kinds}
        for o in cal.outliers:
            for rope in ROPE_KINDS:
                ranges[(rope, o)] = _tensor(tensors, path, f"ott.kvq.{rope}.{o}.k_range.{il}")
            for kind, (bk, bv) in books.items():
                for b in BITS:
                    for rope in ROPE_KINDS:
                        bk[(rope, o, b)] = _tensor(tensors, path, f"ott.kvq.{rope}.{o}.{b}.{kind}_k.{il}")
                    bv[(o, b)] = _tensor(tensors, path, f"ott.kvq.{o}.{b}.{kind}_v.{il}")
        cal.k_range.append(ranges)
        cal.codebook_k.append(books["codebook"][0])
        cal.codebook_v.append(books["codebook"][1])
        if "qnorm" in books:
            cal.qnorm_k.append(books["qnorm"][0])
            cal.qnorm_v.append(books["qnorm"][1])
    return cal


def _tensor(tensors: dict, path, name: str) -> np.ndarray:
    x = tensors.get(name)
    if x is None:
        raise ModelFileError(f"{path}: calibration sidecar has no tensor '{name}'")
    if not np.isfinite(x).all():
        raise ModelFileError(f"{path}: calibration tensor '{name}' holds a non-finite value")
    return x
