"""WikiText-2 raw, test split: the text the perplexity tests and llama.cpp's references use.

Found, in this order:
1. `$OTT_TEST_DATA/wikitext-2-raw/wiki.test.raw`, or `../shared/data/…` beside the checkout:
   the offline copy CI uses;
2. the Hugging Face Hub dataset `ggml-org/ci`, file `wikitext-2-raw-v1.zip` (the archive
   llama.cpp's `scripts/get-wikitext-2.sh` downloads), fetched through `huggingface_hub`
   into its cache and unpacked beside it (`HF_HUB_OFFLINE=1` uses only the cache).
Either way the file must have the published sha256, or the caller gets an error saying which
copy is wrong.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HUB_REPO = "ggml-org/ci"
HUB_FILE = "wikitext-2-raw-v1.zip"
MEMBER = "wikitext-2-raw/wiki.test.raw"
SHA256 = "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08"


def offline_dirs() -> list[Path]:
    """Folders holding an offline copy (`wikitext-2-raw/wiki.test.raw` inside), first wins."""
    dirs = [Path(os.environ["OTT_TEST_DATA"])] if os.environ.get("OTT_TEST_DATA") else []
    return dirs + [REPO.parent / "shared" / "data"]


def _checked(path: Path) -> Path:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise RuntimeError(f"{path}: sha256 {digest}, expected {SHA256} (WikiText-2 raw test)")
    return path


def _from_hub() -> Path:
    from huggingface_hub import hf_hub_download

    archive = Path(hf_hub_download(HUB_REPO, HUB_FILE, repo_type="dataset"))
    out = archive.resolve().parent / "wiki.test.raw"
    if not out.exists():
        with zipfile.ZipFile(archive) as zf:
            data = zf.read(MEMBER)
        tmp = out.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(out)
    return out


def wikitext2_test() -> Path:
    """Path of wiki.test.raw: an offline copy if there is one, else the Hub's (cached)."""
    for d in offline_dirs():
        if (d / MEMBER).is_file():
            return _checked(d / MEMBER)
    return _checked(_from_hub())
