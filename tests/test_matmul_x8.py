"""Q4_1 and Q8_0 weights stored as 8 interleaved rows (native/src/cpu/matmul_x8.h): where the CPU
has AVX2, `Weights(repack=True)` (the default) multiplies them with the library's own kernels
(AVX-512 VNNI's where the CPU has it, else AVX2's; `set_cpu_x8_vnni`), which must give ggml's
products bit for bit. Each test loads the same file twice, with x8 off (ggml's products) and on,
and compares every logit exactly: prefill chunks (many columns), single-token steps (one column)
and a batch of two sequences, with the f16 cache and a quantized one. Without AVX2 (or in a
build without the x86-64 versions) nothing is stored that way (x8_bytes 0) and the tests skip."""

from __future__ import annotations

import numpy as np
import pytest

from make_gguf import write_random_model
from ott_gguf import UnsupportedError
from ott_gguf.model import Context, Weights, set_cpu_x8_vnni

ROW_BYTES = {"q4_1": 20, "q8_0": 34}  # bytes per 32 weights


def run(weights: Weights, kv: str, tokens: list[int]) -> list[np.ndarray]:
    """Logits of two prefill chunks, single-token steps, then one batch of two sequences."""
    ctx = Context(weights, n_ctx=512, n_seq_max=2, kv=kv, n_threads=2)
    out = [ctx.eval(tokens[:37], all_logits=True), ctx.eval(tokens[37:160], all_logits=True)]
    out += [ctx.eval([t]) for t in tokens[160:176]]
    ctx.eval(tokens[:20], seq=1)
    out.append(ctx.decode_batch([tokens[176], tokens[20]], [176, 20], [0, 1], [True, True]))
    return out


def assert_same_logits(path, kv: str, seed: int = 0) -> Weights:
    plain, x8 = Weights(path, x8=False), Weights(path, x8=True)
    assert plain.info.x8_bytes == 0
    if x8.info.x8_bytes == 0:
        pytest.skip("this CPU or build has no 8-row kernels (AVX2): no weights in the 8-row layout")
    tokens = [int(t) for t in np.random.default_rng(seed).integers(10, plain.n_vocab - 10, 200)]
    for i, (a, b) in enumerate(zip(run(plain, kv, tokens), run(x8, kv, tokens), strict=True)):
        assert a.shape == b.shape
        assert np.array_equal(a, b), f"{kv}: result {i} differs by up to {np.abs(a - b).max()}"
    return x8


@pytest.fixture(params=["vnni", "avx2"])
def kernels(request):
    """The 8-row kernels of AVX-512 VNNI or of AVX2, on a CPU that has them."""
    vnni = set_cpu_x8_vnni(None)
    if request.param == "vnni" and not vnni:
        pytest.skip("this CPU lacks AVX-512 VNNI")
    set_cpu_x8_vnni(request.param == "vnni")
    yield request.param
    set_cpu_x8_vnni(vnni)


def test_kernel_switch():
    """Asking is never an error; AVX2's kernels can always be chosen; VNNI's where the CPU
    lacks them is one UnsupportedError that changes nothing."""
    vnni = set_cpu_x8_vnni(None)
    try:
        assert set_cpu_x8_vnni(False) is False
        if vnni:
            assert set_cpu_x8_vnni(True) is True
        else:
            with pytest.raises(UnsupportedError, match="VNNI"):
                set_cpu_x8_vnni(True)
            assert set_cpu_x8_vnni(None) is False
    finally:
        set_cpu_x8_vnni(vnni)


@pytest.mark.parametrize("kv", ["f16", "ottr2tg"])
def test_smollm2_bit_exact(smollm2_path, kv, kernels):
    """SmolLM2's Q4_1 layers and its tied Q8_0 embeddings (the output product and the lookup),
    with each instruction set's kernels."""
    x8 = assert_same_logits(smollm2_path, kv)
    assert x8.info.x8_bytes > 0.9 * x8.info.weight_bytes


def test_gemma3_bit_exact(gemma3_path):
    """Gemma 3's tied Q8_0 embeddings, scaled after the lookup, beside its K-quant layers."""
    x8 = assert_same_logits(gemma3_path, "f16")
    assert x8.info.x8_bytes > 0


def test_qwen_bit_exact(qwen05_path):
    """Qwen2.5-Coder's Q8_0 output beside Q4_K, Q5_0 and Q6_K matrices in ggml's layouts."""
    x8 = assert_same_logits(qwen05_path, "ottr2tr")
    assert x8.info.x8_bytes > 0


@pytest.mark.parametrize(("dtype", "n_vocab", "tied"), [("q4_1", 301, False), ("q4_1", 296, True), ("q8_0", 304, True)])
def test_random_models(tmp_path, dtype, n_vocab, tied):
    """Every matrix with a multiple of 8 rows is stored as 8 rows and the rest stays in the
    file's layout: an output of 301 rows mixes the two; tied embeddings of 296 or 304 rows are
    stored as 8 rows once, for the output product and the lookup (each type's dequantization)."""
    n_embd, n_ff, n_q, n_kv, n_layer = 64, 96, 64, 32, 2
    path = write_random_model(
        tmp_path / f"{dtype}.gguf", arch="llama", n_embd=n_embd, n_ff=n_ff, n_layer=n_layer, n_head=4,
        n_head_kv=2, n_vocab=n_vocab, dtype=dtype, tied_output=tied, seed=3,
    )  # fmt: skip
    x8 = assert_same_logits(path, "f16", seed=1)
    per_row = {n: n // 32 * ROW_BYTES[dtype] for n in (n_embd, n_ff, n_q)}
    layer = (n_q + 2 * n_kv) * per_row[n_embd] + n_embd * per_row[n_q] + 2 * n_ff * per_row[n_embd]
    layer += n_embd * per_row[n_ff]
    output = n_vocab * per_row[n_embd] if n_vocab % 8 == 0 else 0
    assert x8.info.x8_bytes == n_layer * layer + output
