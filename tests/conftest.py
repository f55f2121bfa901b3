"""Shared fixtures: where the real models and data live.

OTT_MODELS_DIR holds the GGUF files fetched by ../shared/peers/fetch_models.sh;
OTT_SHARED_DIR is the shared/ folder beside the checkout (data and llama.cpp fixtures).
A missing file fails the test: CI fetches everything before it runs.

Models run on the default device (a GPU when the build has CUDA and one is present), except
where a test's oracle is the CPU's arithmetic (the numpy reference with ggml's CPU rounding,
llama.cpp's CPU outputs, chunked or batched runs bit for bit equal to single ones, the CPU
cache's allocations): those pass device="cpu". On a GPU, ggml-cuda's quantized matmuls
round differently with each batch size (docs/cuda.md); the CUDA path has its own tests
in test_cuda.py and test_kv_native.py.
"""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _require(path: Path) -> Path:
    if not path.exists():
        pytest.fail(f"missing test input {path} (set OTT_MODELS_DIR / OTT_SHARED_DIR)")
    return path


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    return _require(Path(os.environ.get("OTT_SHARED_DIR", REPO.parent / "shared")))


@pytest.fixture(scope="session")
def models_dir() -> Path:
    return _require(Path(os.environ.get("OTT_MODELS_DIR", REPO / ".dev" / "models")))


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
def fixtures_dir(shared_dir) -> Path:
    return _require(shared_dir / "fixtures")


@pytest.fixture(scope="session")
def wikitext_path(shared_dir) -> Path:
    return _require(shared_dir / "data" / "wikitext-2-raw" / "wiki.test.raw")
