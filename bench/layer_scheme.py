"""A per-layer choice between `ottr2tr` and `kvquant2` (issue "KVQuant mode": "a per-layer choice
of scheme if the measurements favour it"), by replay (docs/kvquant.md, "A per-layer choice of
scheme").

The model runs in torch (ott_gguf/torch_model.py) with the numpy specification's caches, as
bench/kept_replay.py replays `ottr2tr` (recent blocks, re-coding, pools) and
bench/kvquant_accuracy.py replays `kvquant2` (calibrated tables from the sidecar), each
decode-faithful. Two passes a window:

  1. screening: every layer's attention computed exactly and through both caches from the same
     inputs (the exact output goes on, so this pass is also the exact forward), and each cache's error over the scored queries (the
     second half) as a share of the exact output's energy, Σ|o - o_exact|² / Σ|o_exact|²;
  2. the mixed cache: `kvquant2` in the layers where its error was below `ottr2tr`'s, `ottr2tr`
     elsewhere, and `ottr2tr` alone, each against the exact forward (KL, top-1, bits per
     element at ctx counted from the stores). With no layer favouring `kvquant2` the mixed row
     is `ottr2tr`'s and is not run.

    python bench/layer_scheme.py MODEL --sidecar SIDECAR -f ../shared/data/wikitext-2-raw/wiki.test.raw \
        [--windows 1] [--ctx 4096] [-t 2]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kept_replay import Replay, window_tokens  # noqa: E402
from kvquant_accuracy import SimulatedCache, sidecar_replay_parser  # noqa: E402

from ott_gguf.kvq_calibration import read_sidecar  # noqa: E402
from ott_gguf.perplexity import kl_and_top1, windows  # noqa: E402
from ott_gguf.reference import measure  # noqa: E402
from ott_gguf.reference.config import preset  # noqa: E402
from ott_gguf.torch_model import TorchModel  # noqa: E402


class Schemes:
    """The two caches of one window, behind one attention hook per pass."""

    def __init__(self, tm: TorchModel, tier_scale, tables):
        self.tm, self.tier_scale, self.tables = tm, tier_scale, tables
        self.ott_cfg = preset("ottr2tr").for_head_dim(tm.head_dim)
        self.kvq_cfg = preset("kvquant2")

    def caches(self):
        """Fresh replays: (ottr2tr's, kvquant2's)."""
        ott = Replay(self.tm, self.ott_cfg, self.tier_scale, "", 0)
        return ott, SimulatedCache(self.tm, self.kvq_cfg, self.tables.layers(self.kvq_cfg))

    def screen(self, tokens, half: int) -> tuple[np.ndarray, np.ndarray]:
        """Per layer the error share of (ottr2tr, kvquant2): float64 [n_layer, 2]; and the exact
        forward's logits of the scored tokens [n - 1 - half, n_vocab], which this pass computes."""
        import torch

        ott, kvq = self.caches()
        err = np.zeros((self.tm.n_layer, 2))

        def attend(il, q, k_pre, k_post, v):
            exact = self.tm.causal_attention(q, k_post, v)
            ref = exact[0, half:].double()
            for s, cache in enumerate((ott, kvq)):
                o = cache.attend(il, q, k_pre, k_post, v)[0, half:].double()
                err[il, s] = float(((o - ref) ** 2).sum() / (ref**2).sum())
            return exact

        with torch.no_grad():
            logits = self.tm.forward(tokens, attend=attend)[0, half:-1].numpy()
        return err, logits

    def mixed(self, tokens, kvq_layers: set[int], half: int, ref: np.ndarray):
        """KL and top-1 (per scored token) and bits per element with kvquant2 in kvq_layers."""
        import torch

        ott, kvq = self.caches()

        def attend(il, q, k_pre, k_post, v):
            return (kvq if il in kvq_layers else ott).attend(il, q, k_pre, k_post, v)

        with torch.no_grad():
            logits = self.tm.forward(tokens, attend=attend)[0, half:-1].numpy()
        kl, top1 = kl_and_top1(ref, logits)
        return kl, top1, measure(sorted(ott.layers + kvq.layers, key=lambda c: c.il)).bits_per_element


def main(argv=None) -> int:
    import torch

    ap = sidecar_replay_parser(__doc__, windows=1)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    ids, bos, tier_scale = window_tokens(args.model, args.file, args.ctx * args.windows)
    tm = TorchModel(args.model)
    schemes = Schemes(tm, tier_scale, read_sidecar(args.sidecar, tm.n_layer))
    half = args.ctx // 2
    for w, window in enumerate(windows(ids, args.ctx, min(args.windows, len(ids) // args.ctx), bos)):
        tokens = torch.from_numpy(window.astype(np.int64))[None]
        t0 = time.perf_counter()
        err, ref = schemes.screen(tokens, half)
        print(f"window {w}: screening {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        print(f"\n{Path(args.model).name}, window {w}: attention error share of the scored queries, by layer\n")
        print("| layer | ottr2tr | kvquant2 | kvquant2 / ottr2tr |\n|---:|---:|---:|---:|")
        for il, (a, b) in enumerate(err):
            print(f"| {il} | {a:.2e} | {b:.2e} | {b / a:.2f} |")
        kvq_layers = {il for il, (a, b) in enumerate(err) if b < a}
        rows = {"ottr2tr": set()}
        if kvq_layers:
            rows[f"kvquant2 in layers {sorted(kvq_layers)}, ottr2tr elsewhere"] = kvq_layers
        print("\n| cache | bits at ctx | KL to exact | top-1 |\n|---|---:|---:|---:|")
        for name, layers in rows.items():
            t0 = time.perf_counter()
            kl, top1, bits = schemes.mixed(tokens, layers, half, ref)
            print(f"| {name} | {bits:.2f} | {kl.mean():.4f} | {100 * top1.mean():.2f} % |", flush=True)
            print(f"window {w}: {name} {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
