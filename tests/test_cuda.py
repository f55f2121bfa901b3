"""The CUDA path: kernel sources compile, kernels match the CPU reference, CPU and CUDA decode alike.

- Compile (needs only nvcc, as on CI): every native/src/cuda/*.cu for sm_80/86/89/90.
- Kernels (needs a GPU and a build with OTT_CUDA): `ott-cuda-ops check` runs the case table of
  native/tests/cuda_ops.cpp: appends and quantization events bit for bit against kv_quant.c,
  fused attention within 3e-4 (relative L2) of float64.
- End to end (needs a GPU): greedy decoding of a random-weights llama model on CPU and on
  CUDA, f16, ott2, key-tiered ottr2, ottr2t with a recent block and symmetric values, and
  ottr2tr (keys cached before RoPE; also on a qwen2 model, NeoX pairs) caches, 64 tokens
  after a 200-token prompt (so quantization events fire). The two backends
  round matmuls differently (ggml-cuda: fp16 activations in fp16 GEMMs, TF32 in fp32 ones),
  and with a 2-bit cache a K/V value that lands on the other side of a rounding boundary
  changes a whole quantization step; so the logits agree within
  LOGITS_BUDGET (relative L2 per step: at worst, and in the median), and the tokens are
  equal until a step whose CPU top-2 gap is at most twice the largest logit difference there
  (a near-tie the rounding explains; the test prints the numbers). The same check runs on
  SmolLM2 with its weights dequantized to F32, so that both backends multiply the same values
  in float: SmolLM2 as shipped (Q4_1) goes through ggml-cuda's quantized matmul kernels,
  whose rounding differs from the CPU's by far more (docs/cuda.md).
"""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ott_gguf.errors import InvalidArgumentError, UnsupportedError
from ott_gguf.model import Model, Weights, cuda_device_count
from ott_gguf.reference import preset
from ott_gguf.reference.config import parse_mode

REPO = Path(__file__).resolve().parent.parent
CUDA_SOURCES = sorted((REPO / "native" / "src" / "cuda").glob("*.cu"))
# attn_rows.cu is built once per head size and code widths (native/CMakeLists.txt): the test
# compiles its largest instance, the tensor-core one
SOURCE_DEFINES = {"attn_rows.cu": ["-DOTT_ATTN_HD=128", "-DOTT_ATTN_BK=2", "-DOTT_ATTN_BV=2"]}
ARCHS = ("80", "86", "89", "90")
N_GEN = 64
TIERS = "ottr2:hi_k=4:lo_k=8"  # a mode with knobs, as bench/accuracy.py spells them
# key tiers, symmetric values and a recent block re-coded at every event from the second on
RECENT = "ottr2t:recent=1:sym_v=1:extra_pool=0"
# relative L2 of a step's logits, CPU vs CUDA: (the largest over the steps, their median or None)
LOGITS_BUDGET = {kv: (0.15, None) for kv in ("ott2", "ottr2", TIERS, RECENT, "ottr2tr")}
LOGITS_BUDGET["f16"] = (1e-2, None)
# KVQuant's cache (tables of a made-up sidecar): keys before RoPE, and after it
KVQ = ["kvquant2", "kvquant3:pre_rope=0"]
LOGITS_BUDGET.update({kv: (0.15, None) for kv in KVQ})
# The same over SmolLM2's 30 layers. With ott2 (teacher-forced on 64 tokens, H200): the GPU
# alone differs by up to 0.23 (median 0.041) between the prompt fed whole and in ubatches of
# 16, CPU and CUDA by up to 0.17 (median 0.015), and ott2 from the f16 cache by a median 0.29.
SMOL_BUDGET = {"f16": (3e-2, None), "ott2": (0.3, 0.05)}

needs_gpu = pytest.mark.skipif(
    cuda_device_count() == 0, reason="no CUDA device, or this build has no CUDA support (OTT_CUDA)"
)


@pytest.mark.slow  # minutes per file for four architectures
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.skipif(cuda_device_count() > 0, reason="this CUDA build compiled these sources for its GPU")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=[p.name for p in CUDA_SOURCES])
def test_cuda_source_compiles(tmp_path, source):
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    cmd = [
        "nvcc",
        "-c",
        "-std=c++17",
        "-O3",
        *gencode,
        "-I",
        str(REPO / "native" / "src"),
        "-I",
        str(REPO / "native" / "include"),
        *SOURCE_DEFINES.get(source.name, []),
        str(source),
        "-o",
        str(tmp_path / "out.o"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{source.name} does not compile:\n{proc.stderr[-4000:]}"


def test_device_names_are_checked(random_llama):
    with pytest.raises(InvalidArgumentError, match="not one of cpu, cuda, cuda:N"):
        Model(random_llama, n_ctx=64, device="gpu")
    with pytest.raises((InvalidArgumentError, UnsupportedError), match="cuda:99"):
        Model(random_llama, n_ctx=64, device="cuda:99")
    assert Model(random_llama, n_ctx=64, n_threads=2, device="cpu").info.device == "cpu"
    default = Model(random_llama, n_ctx=64, n_threads=2)
    assert default.info.device == ("cuda:0" if cuda_device_count() else "cpu")


def _ops_binary() -> Path:
    import ott_gguf._native as native

    return Path(native._mod.__file__).parent / "ott-cuda-ops"


@needs_gpu
def test_kernels_match_cpu_reference():
    exe = _ops_binary()
    assert exe.is_file(), f"{exe}: the kernel checker is missing from this CUDA build"
    proc = subprocess.run([str(exe), "check"], capture_output=True, text=True, timeout=600)
    print(proc.stdout)
    assert proc.returncode == 0, f"kernel checks failed:\n{proc.stdout}\n{proc.stderr}"
    assert "0 case(s) failed" in proc.stdout


def greedy(model: Model, prompt: list[int], n_gen: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and the logits each was picked from."""
    logits = model.eval(prompt)
    tokens, seen = [], []
    for _ in range(n_gen):
        seen.append(logits)
        tokens.append(int(np.argmax(logits)))
        logits = model.eval([tokens[-1]])
    return tokens, seen


def top2_gap(logits: np.ndarray) -> float:
    a, b = np.sort(logits)[-2:]
    return float(b - a)


def assert_same_greedy(path, kv: str, prompt: list[int], n_ctx: int, budget: tuple | None = None, kv_calib=None):
    worst, median = budget or LOGITS_BUDGET[kv]
    cpu_model = Model(path, n_ctx=n_ctx, n_threads=2, kv=parse_mode(kv), kv_calib=kv_calib, device="cpu")
    cpu_tokens, cpu_logits = greedy(cpu_model, prompt, N_GEN)
    cuda_model = Model(path, n_ctx=n_ctx, kv=parse_mode(kv), kv_calib=kv_calib, device="cuda")
    assert cuda_model.info.device == "cuda:0"
    cuda_tokens, cuda_logits = greedy(cuda_model, prompt, N_GEN)
    diverged = next((i for i, (a, b) in enumerate(zip(cpu_tokens, cuda_tokens)) if a != b), None)
    same_prefix = N_GEN if diverged is None else diverged + 1  # steps whose inputs are equal
    errs = [float(np.linalg.norm(a - b) / np.linalg.norm(a)) for a, b in zip(cpu_logits, cuda_logits)][:same_prefix]
    where = f"{Path(path).name} kv={kv}"
    if diverged is None:
        print(f"{where}: {N_GEN} greedy tokens equal; logits rel L2 CPU vs CUDA max {max(errs):.2e}")
    else:
        gap = top2_gap(cpu_logits[diverged])
        noise = float(np.abs(cpu_logits[diverged] - cuda_logits[diverged]).max())
        print(
            f"{where}: tokens equal up to {diverged}, then CPU top-2 gap {gap:.4f} vs largest logit "
            f"difference {noise:.4f}; logits rel L2 up to there max {max(errs):.2e}"
        )
        assert gap <= 2 * noise, (
            f"{where}: greedy tokens differ at {diverged} although the CPU's top-2 gap "
            f"{gap:.4f} exceeds twice the largest logit difference {noise:.4f}"
        )
    assert max(errs) < worst, f"{where}: logits rel L2 CPU vs CUDA {max(errs):.2e} >= {worst}"
    if median is not None:
        print(f"{where}: median over the steps {np.median(errs):.2e}")
        assert np.median(errs) < median, f"{where}: median logits rel L2 CPU vs CUDA {np.median(errs):.2e} >= {median}"


def write_random(tmp_path_factory, arch: str, seed: int):
    """A random model of `arch` with head_dim 64 and GQA 2 (shapes both backends support)."""
    from make_gguf import write_random_model

    return write_random_model(
        tmp_path_factory.mktemp("cuda") / f"{arch}-hd64.gguf",
        arch=arch,
        dtype="f16",
        n_embd=256,
        n_layer=4,
        n_head=4,
        n_head_kv=2,
        n_ff=512,
        n_vocab=512,
        seed=seed,
        n_ctx_train=1024,
    )


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory):
    return write_random(tmp_path_factory, "llama", 11)


@pytest.fixture(scope="module")
def random_qwen2(tmp_path_factory):
    """NeoX RoPE pairs (channel i with i + head_dim/2), Q/K/V biases."""
    return write_random(tmp_path_factory, "qwen2", 12)


@needs_gpu
@pytest.mark.parametrize("kv", ["f16", "ott2", TIERS, RECENT, "ottr2tr"])
def test_greedy_cpu_equals_cuda_random_model(random_llama, kv):
    prompt = np.random.default_rng(5).integers(0, 512, 200).tolist()
    assert_same_greedy(random_llama, kv, prompt, n_ctx=512)


@needs_gpu
def test_keys_before_rope_neox_cpu_equals_cuda(random_qwen2):
    """ottr2tr (keys cached before RoPE) on a model whose RoPE pairs channel i with i + head_dim/2."""
    prompt = np.random.default_rng(15).integers(0, 512, 200).tolist()
    assert_same_greedy(random_qwen2, "ottr2tr", prompt, n_ctx=512)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


# A prompt of three chunks of 150 tokens: the third attends over two quantized blocks, the
# pools (layers 2 and 3) and the window; on the GPU, a chunk of one sequence alone attends by
# flash attention over its gathered rows (kv_quant_cuda.cpp), beside other sequences by the
# fused kernels, and on the CPU by the CPU's.
CHUNK, N_CHUNKS = 150, 3
# relative L2 of the third chunk's logits, flash attention vs the fused kernels over the same
# stores on the GPU: fp16 rounding of the dequantised rows and of ggml's flash attention
FA_BUDGET = 2e-2


@needs_gpu
@pytest.mark.parametrize("kv", ["ott2", "ottr2", TIERS, RECENT, "ottr2tr"])
def test_prompt_chunks_over_quantized_blocks_cpu_equals_cuda(random_llama, kv):
    prompt = np.random.default_rng(12).integers(0, 512, CHUNK * N_CHUNKS).tolist()
    ends = {}
    for device in ("cpu", "cuda"):
        model = Model(random_llama, n_ctx=1024, n_threads=2, kv=parse_mode(kv), device=device)
        ends[device] = [model.eval(prompt[i : i + CHUNK]) for i in range(0, len(prompt), CHUNK)]
    errs = [rel_l2(a, b) for a, b in zip(ends["cpu"], ends["cuda"])]
    print(f"kv={kv}: chunk ends' logits rel L2 CPU vs CUDA {', '.join(f'{e:.2e}' for e in errs)}")
    assert max(errs) < LOGITS_BUDGET[kv][0]


@needs_gpu
@pytest.mark.parametrize("kv", ["ott2", "ottr2", TIERS, RECENT, "ottr2tr"])
def test_flash_attention_chunk_equals_fused_kernels(random_llama, kv):
    model = Model(random_llama, n_ctx=1024, n_seq_max=3, kv=parse_mode(kv), device="cuda")
    prompt = np.random.default_rng(12).integers(0, 512, CHUNK * N_CHUNKS).tolist()
    for i in range(0, CHUNK * (N_CHUNKS - 1), CHUNK):
        model.eval(prompt[i : i + CHUNK], seq=0)
    model.copy_sequence(0, 1)
    model.copy_sequence(0, 2)
    last, n_past = prompt[-CHUNK:], CHUNK * (N_CHUNKS - 1)
    alone = model.eval(last, seq=0)  # flash attention
    beside = model.decode_batch(  # the fused kernels: two sequences in the step
        last + [7],
        list(range(n_past, n_past + CHUNK)) + [n_past],
        [1] * CHUNK + [2],
        [False] * (CHUNK - 1) + [True, False],
    )[0]
    err = rel_l2(beside, alone)
    print(f"kv={kv}: third chunk's logits rel L2, flash attention vs fused kernels {err:.2e}")
    assert err < FA_BUDGET


@pytest.fixture(scope="module")
def random_llama_kvcalib(random_llama, tmp_path_factory):
    """KVQuant tables for random_llama (made up: the caches must follow whatever they are given)."""
    from make_gguf import write_kvq_sidecar

    return write_kvq_sidecar(random_llama, tmp_path_factory.mktemp("kvq") / "llama-hd64.kvcalib.gguf")


@needs_gpu
@pytest.mark.parametrize("kv", KVQ)
def test_kvquant_greedy_cpu_equals_cuda(random_llama, random_llama_kvcalib, kv):
    """Prompt chunks and decoding across many events (blocks of 32), every store on the device."""
    prompt = np.random.default_rng(8).integers(0, 512, 200).tolist()
    assert_same_greedy(random_llama, kv, prompt, n_ctx=512, kv_calib=random_llama_kvcalib)


@needs_gpu
def test_kvquant_copied_sequence_continues_alike(random_llama, random_llama_kvcalib):
    model = Model(random_llama, n_ctx=512, n_seq_max=2, kv="kvquant2", kv_calib=random_llama_kvcalib, device="cuda")
    prompt = np.random.default_rng(9).integers(0, 512, 170).tolist()
    model.eval(prompt, seq=0)
    model.copy_sequence(0, 1)
    np.testing.assert_array_equal(model.eval([7], seq=0), model.eval([7], seq=1))


SMOL_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a screw press. "
)


@pytest.fixture(scope="module")
def smollm2_f32(smollm2_path, tmp_path_factory):
    """SmolLM2 with every matrix dequantized to F32: the same weights, multiplied in float on both backends."""
    from make_gguf import write_copy

    return write_copy(smollm2_path, tmp_path_factory.mktemp("smol") / "smollm2-f32.gguf", dequantize=True)


@needs_gpu
@pytest.mark.parametrize("kv", ["f16", "ott2"])
def test_greedy_cpu_equals_cuda_smollm2(smollm2_f32, kv):
    prompt = Model(smollm2_f32, n_ctx=64, n_threads=2, device="cpu").tokenize(SMOL_TEXT * 6)
    assert len(prompt) > 160
    assert_same_greedy(smollm2_f32, kv, prompt, n_ctx=512, budget=SMOL_BUDGET[kv])


@needs_gpu
@pytest.mark.parametrize("kv", ["f16", "ott2", TIERS, RECENT, "ottr2tr"])
def test_copied_sequence_continues_alike(random_llama, kv):
    model = Model(random_llama, n_ctx=512, n_seq_max=2, kv=parse_mode(kv), device="cuda")
    prompt = np.random.default_rng(6).integers(0, 512, 300).tolist()  # two events: a re-coded block
    model.eval(prompt, seq=0)
    model.copy_sequence(0, 1)
    assert model.seq_len(1) == len(prompt)
    a = model.eval([7], seq=0)
    b = model.eval([7], seq=1)
    np.testing.assert_array_equal(a, b)


# relative L2 of a step's logits, one sequence alone vs in a busy batch on the GPU (the same
# model): what the batch size changes in ggml-cuda's matmul kernels, and with a 2-bit cache the
# codes that rounding flips
BATCH_BUDGET = {"f16": 1e-2, "ott2": 0.15, "ottr2t": 0.15}


def read_prompt(model: Model, seq: int, tokens: list[int], chunk: int) -> list[list[int]]:
    """Feed `tokens` to sequence `seq` in decode-faithful chunks of at most `chunk` (the quantized
    caches' events end them); the chunks."""
    out, i = [], 0
    while i < len(tokens):
        n = min(len(tokens) - i, chunk, model.tokens_until_event(seq) or chunk)
        out.append(tokens[i : i + n])
        model.eval(out[-1], seq)
        i += n
    return out


@needs_gpu
@pytest.mark.parametrize("kv", ["f16", "ott2", "ottr2t"])
def test_a_sequence_in_a_busy_batch_stays_within_budget(random_llama, kv):
    """Sequence 0 reads a prompt and is fed 24 tokens alone, then the same while 31 others of
    other lengths decode or read prompt chunks in the same batches, as the server batches them
    (docs/server.md): its logits move within BATCH_BUDGET."""
    n_seq, steps = 32, 24
    rng = np.random.default_rng(13)
    model = Model(random_llama, n_ctx=512, n_seq_max=n_seq, n_ubatch=512, kv=kv, device="cuda")
    prompt = rng.integers(0, 512, 200).tolist()
    forced = rng.integers(0, 512, steps).tolist()
    chunks = read_prompt(model, 0, prompt, 64)  # the same chunks again in the busy batches
    alone = [model.eval([t], 0) for t in forced]
    model.truncate(0)
    for s in range(1, n_seq):
        read_prompt(model, s, rng.integers(0, 512, int(rng.integers(20, 250))).tolist(), 64)

    together = []
    for feed in chunks + [[t] for t in forced]:
        start = model.seq_len(0)
        tokens, pos, seqs = list(feed), list(range(start, start + len(feed))), [0] * len(feed)
        want = [False] * (len(feed) - 1) + [True]
        for s in range(1, n_seq):  # every fourth reads a prompt chunk, the others decode
            n = 1 if s % 4 else min(4, model.tokens_until_event(s) or 4)
            tokens += rng.integers(0, 512, n).tolist()
            pos += range(model.seq_len(s), model.seq_len(s) + n)
            seqs += [s] * n
            want += [False] * (n - 1) + [True]
        together.append(model.decode_batch(tokens, pos, seqs, want)[0])
    together = together[len(chunks) :]
    errs = [float(np.linalg.norm(a - b) / np.linalg.norm(a)) for a, b in zip(alone, together)]
    print(f"kv={kv}: logits rel L2 alone vs in a batch of {n_seq}: median {np.median(errs):.2e}, max {max(errs):.2e}")
    assert max(errs) < BATCH_BUDGET[kv]


@needs_gpu
def test_cuda_kv_stats_count_quantized_bytes(random_llama):
    f16 = Model(random_llama, n_ctx=512, kv="f16", device="cuda")
    ott = Model(random_llama, n_ctx=512, kv="ott2", device="cuda")
    prompt = np.random.default_rng(7).integers(0, 512, 400).tolist()
    f16.eval(prompt)
    ott.eval(prompt)
    # f16: 2 * head_dim * n_head_kv * 2 bytes; ott2 after 400 tokens: 2 blocks of 128 + 144 fp16
    assert f16.kv_stats().bytes_per_token_layer == 2 * 64 * 2 * 2
    st = ott.kv_stats()
    assert st.n_tokens == 400 and 0 < st.bytes_per_token_layer < 0.6 * 512


@needs_gpu
def test_auto_on_a_gpu_is_the_2bit_preset_with_keys_after_rope(random_llama):
    """auto: ottr2tr on the CPU; on the GPU ottr2tg, whose keys after RoPE keep the attention
    on the integer tensor cores (ottr2tr runs there too, on the FFMA kernel)."""
    assert Weights(random_llama, device="cpu").kv_config("auto") == preset("ottr2tr")
    weights = Weights(random_llama, device="cuda")
    assert weights.kv_config("auto") == preset("ottr2tg")
    assert Model(weights, n_ctx=256, kv="auto").eval([1, 2, 3]).size
    assert Model(weights, n_ctx=256, kv="ottr2tr").eval([1, 2, 3]).size


@needs_gpu
def test_cpu_only_knobs_are_refused_with_one_line(random_llama):
    """What the CUDA cache does not read yet is refused at context creation, naming it."""
    knobs = dict(key_axis=1, group_k=64)
    with pytest.raises(UnsupportedError, match="kv config on CUDA: key_axis=1.* runs on the CPU only"):
        Model(random_llama, n_ctx=256, kv=preset("ottr2").with_overrides(**knobs), device="cuda")
    assert Model(random_llama, n_ctx=256, kv=preset("ottr2").with_overrides(**knobs), device="cpu").eval([1, 2, 3]).size
