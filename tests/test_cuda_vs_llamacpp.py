"""bench/cuda_vs_llamacpp.py reads llama-batched-bench's table (its output on an H100, b11434)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from cuda_vs_llamacpp import parse_batched_bench  # noqa: E402

RAN = """\
main: n_kv_max = 399360, n_batch = 4096, n_ubatch = 1024, flash_attn = 1, is_pp_shared = 0, is_tg_separate = 0

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
| 16384 |      8 |   24 | 393408 |   48.776 |  8061.75 |    0.580 |   330.80 |   49.356 |  7970.84 |
"""

OUT_OF_MEMORY = """\
0.09.375.094 E ggml_backend_cuda_buffer_type_alloc_buffer: allocating 7393.93 MiB on device 0: cudaMalloc failed: out of memory
llama_batched_bench: error: failed to create the llama_context
"""


def test_a_run_gives_its_decode_rate():
    assert parse_batched_bench(RAN) == [{"pp": 16384, "batch": 24, "s_pp": 8061.75, "s_tg": 330.80}]


def test_a_run_that_did_not_fit_gives_no_row():
    assert parse_batched_bench(OUT_OF_MEMORY) == []
