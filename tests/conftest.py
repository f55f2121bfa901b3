"""Shared fixtures: where the real models and data live.

OTT_MODELS_DIR holds the GGUF files fetched by ../shared/peers/fetch_models.sh and
tests/fetch_models.sh; tests/data/ holds llama.cpp's reference outputs (made by
tests/make_llamacpp_data.py); WikiText-2 comes from tests/wikitext.py (an offline copy in
$OTT_TEST_DATA or ../shared/data, else the Hugging Face Hub). A missing model fails the
test: CI fetches everything before it runs.

Models run on the default device (a GPU when the build has CUDA and one is present), except
where a test's oracle is the CPU's arithmetic (the numpy reference with ggml's CPU rounding,
llama.cpp's CPU outputs, chunked or batched runs bit for bit equal to single ones, the CPU
cache's allocations): those pass device="cpu". On a GPU, ggml-cuda's quantized matmuls
round differently with each batch size (docs/cuda.md); the CUDA path has its own tests
in test_cuda.py and test_kv_native.py.
"""

import json
import os
from pathlib import Path

import pytest

from wikitext import wikitext2_test

REPO = Path(__file__).resolve().parent.parent


# The fast lane (`pytest -m "not slow"`) runs no real model: a test that asks for one of these
# fixtures is slow, whatever else it does.
REAL_MODEL_FIXTURES = {"smollm2_path", "qwen05_path", "gemma3_path", "wikitext_path"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"missing test input {path} (set OTT_MODELS_DIR / OTT_SHARED_DIR)")
    return path


@pytest.fixture(scope="session")
def models_dir() -> Path:
    return _require(Path(os.environ.get("OTT_MODELS_DIR", REPO / ".dev" / "models")).resolve())


@pytest.fixture(scope="session")
def smollm2_path(models_dir) -> Path:
    return _require(models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def qwen05_path(models_dir) -> Path:
    return _require(models_dir / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


@pytest.fixture(scope="session")
def gemma3_path(models_dir) -> Path:
    return _require(models_dir / "gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """llama.cpp's outputs for the tests (tokenizer ids, perplexities), kept in the repository."""
    return _require(REPO / "tests" / "data")


@pytest.fixture(scope="session")
def llamacpp_perplexity(reference_dir):
    """(model, n_ctx, chunks) -> (ppl, stderr) of llama.cpp with an f16 cache on WikiText-2."""
    runs = json.loads((reference_dir / "perplexity.json").read_text(encoding="utf-8"))["runs"]
    return {(r["model"], r["n_ctx"], r["chunks"]): (r["ppl"], r["err"]) for r in runs}


@pytest.fixture(scope="session")
def wikitext_path() -> Path:
    return wikitext2_test()
