"""Sampler: greedy, seeds, and that each filter keeps exactly the right tokens with the right frequencies."""

import numpy as np
import pytest

from ott_gguf.errors import InvalidArgumentError
from ott_gguf.sampling import Sampler, SamplingParams

# A fixed distribution over 8 tokens, deliberately not sorted by id.
PROBS = np.array([0.05, 0.25, 0.02, 0.40, 0.10, 0.15, 0.02, 0.01])
LOGITS = np.log(PROBS).astype(np.float32) + 3.0  # a shift changes nothing after softmax

N_DRAWS = 20000
# chi-square critical values at p = 1e-6, by degrees of freedom: a correct sampler fails about once a million runs
CHI2_CRIT = {1: 23.9, 2: 27.6, 3: 30.7, 4: 33.4}


def draw_counts(params: SamplingParams, logits=LOGITS, n=N_DRAWS) -> np.ndarray:
    sampler = Sampler(params)
    counts = np.zeros(logits.size, dtype=np.int64)
    for _ in range(n):
        counts[sampler.sample(logits, [])] += 1
    return counts


def assert_distribution(counts: np.ndarray, allowed: list[int], weights: np.ndarray) -> None:
    """Only `allowed` ids were drawn, with frequencies matching weights renormalised over them."""
    outside = np.setdiff1d(np.nonzero(counts)[0], allowed)
    assert outside.size == 0, f"drew tokens outside the allowed set: {outside.tolist()}"
    expected = weights[allowed] / weights[allowed].sum() * counts.sum()
    chi2 = float((((counts[allowed] - expected) ** 2) / expected).sum())
    assert chi2 < CHI2_CRIT[len(allowed) - 1], f"chi2 {chi2:.1f} for counts {counts[allowed]} vs {expected}"


def test_greedy_is_argmax():
    rng = np.random.default_rng(1)
    sampler = Sampler(SamplingParams(temperature=0.0))
    for _ in range(20):
        logits = rng.normal(size=1000).astype(np.float32)
        assert sampler.sample(logits, []) == int(np.argmax(logits))
    assert SamplingParams(temperature=-1.0).greedy


def test_top_k_1_equals_greedy():
    rng = np.random.default_rng(2)
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=1, top_p=1.0, min_p=0.0, seed=3))
    for _ in range(20):
        logits = rng.normal(size=5000).astype(np.float32)
        assert sampler.sample(logits, []) == int(np.argmax(logits))


def test_seed_reproducible():
    logits = np.zeros(1000, dtype=np.float32)  # uniform: every draw is pure randomness
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    a, b = Sampler(params), Sampler(params)
    draws_a = [a.sample(logits, []) for _ in range(50)]
    assert draws_a == [b.sample(logits, []) for _ in range(50)]
    other = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1235))
    assert draws_a != [other.sample(logits, []) for _ in range(50)]


def test_no_filter_matches_softmax():
    counts = draw_counts(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=10))
    # ids 2, 6, 7 are rare: merge them into one cell for the chi-square
    merged = np.append(counts[[0, 1, 3, 4, 5]], counts[[2, 6, 7]].sum())
    merged_p = np.append(PROBS[[0, 1, 3, 4, 5]], PROBS[[2, 6, 7]].sum())
    expected = merged_p * N_DRAWS
    assert float((((merged - expected) ** 2) / expected).sum()) < 35.9  # 5 dof, p = 1e-6


def test_top_p_keeps_smallest_prefix_reaching_p():
    # sorted probabilities 0.40, 0.25, 0.15, ...: cumulative 0.40, 0.65, 0.80 -> top_p 0.7 keeps three tokens
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.7, min_p=0.0, seed=11)
    assert_distribution(draw_counts(params), [3, 1, 5], PROBS)
    # the same 8 tokens hidden among 4000 near-impossible ones (the sampler then sorts only a partition)
    where = np.random.default_rng(0).choice(4000, size=PROBS.size, replace=False)
    big = np.full(4000, -40.0, dtype=np.float32)
    big[where] = LOGITS
    big_probs = np.zeros(4000)
    big_probs[where] = PROBS
    assert_distribution(draw_counts(params, big, n=5000), where[[3, 1, 5]].tolist(), big_probs)


def test_min_p_keeps_tokens_above_fraction_of_max():
    # min_p 0.2 of p_max 0.40 -> threshold 0.08 keeps 0.40, 0.25, 0.15, 0.10
    counts = draw_counts(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=12))
    assert_distribution(counts, [3, 1, 5, 4], PROBS)


def test_top_k_then_temperature():
    # top_k 3 keeps ids 3, 1, 5; temperature 0.5 squares their probabilities
    counts = draw_counts(SamplingParams(temperature=0.5, top_k=3, top_p=1.0, min_p=0.0, seed=13))
    assert_distribution(counts, [3, 1, 5], PROBS**2)


def test_filters_chain_in_llama_cpp_order():
    # top_k 5 keeps {3,1,5,4,0} (mass 0.95); top_p 0.82 over them, renormalised (cumulative 0.421, 0.684, 0.842),
    # keeps {3,1,5}; temperature 2 comes last and only reshapes those three to p ** 0.5.
    # Without top-k first, top_p would keep four (0.40, 0.65, 0.80, 0.90); with temperature first, also four.
    counts = draw_counts(SamplingParams(temperature=2.0, top_k=5, top_p=0.82, min_p=0.0, seed=14))
    assert_distribution(counts, [3, 1, 5], PROBS**0.5)
    # min_p 0.5 after that: threshold 0.5 * 0.40 = 0.20 leaves {3,1}
    counts = draw_counts(SamplingParams(temperature=1.0, top_k=5, top_p=0.82, min_p=0.5, seed=15))
    assert_distribution(counts, [3, 1], PROBS)


def test_large_vocab_stays_in_top_k():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=151936).astype(np.float32)
    top40 = set(np.argsort(-logits)[:40].tolist())
    sampler = Sampler(SamplingParams(seed=0))  # llama.cpp defaults: top_k 40, top_p 0.95, min_p 0.05
    assert all(sampler.sample(logits, []) in top40 for _ in range(20))


def test_repetition_penalty_changes_argmax():
    logits = np.array([2.0, 1.9, -1.0, 0.5], dtype=np.float32)
    params = SamplingParams(temperature=0.0, repeat_penalty=1.2, repeat_last_n=2)
    sampler = Sampler(params)
    assert sampler.sample(logits, []) == 0
    assert sampler.sample(logits, [0]) == 1  # 2.0 / 1.2 = 1.67 < 1.9
    assert sampler.sample(logits, [0, 3, 3]) == 0  # token 0 is outside the last 2 tokens
    assert (
        Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.2, repeat_last_n=-1)).sample(logits, [0, 3, 3]) == 1
    )  # -1 penalises the whole history
    # a negative logit is multiplied: -1.0 * 3 = -3.0 falls below -2.5
    neg = np.array([-1.0, -2.5, -10.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0.0, repeat_penalty=3.0)).sample(neg, [0]) == 1
    assert logits[0] == 2.0  # the caller's logits are not modified


def test_frequency_and_presence_penalties_subtract_per_count():
    logits = np.array([2.0, 1.5, 1.0, 0.0], dtype=np.float32)
    # frequency: token 0 seen twice loses 2 * 0.3 = 0.6 (1.4 < 1.5), token 1 once loses 0.3
    freq = Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.3))
    assert freq.sample(logits, [0, 0]) == 1
    assert freq.sample(logits, [0, 0, 0, 1, 1]) == 0  # 2.0 - 0.9 = 1.1 > 1.0 > 1.5 - 0.6
    # presence: once is enough, the count does not matter
    pres = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.6))
    assert pres.sample(logits, [0]) == 1 and pres.sample(logits, [0, 0, 0]) == 1
    assert pres.sample(logits, [0, 1]) == 0  # 1.4 vs 0.9 vs 1.0
    # applied after the repetition penalty, as llama.cpp does: 2.0 / 2 - 0.6 = 0.4 < 1.0
    both = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, presence_penalty=0.6))
    assert both.sample(logits, [0, 1]) == 2


def test_logit_bias_comes_first_in_the_chain():
    logits = np.array([2.0, 1.5, 1.0, 0.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0.0, logit_bias={0: -100.0})).sample(logits) == 1
    assert Sampler(SamplingParams(temperature=0.0, logit_bias={3: 2.5})).sample(logits) == 3  # 2.5 > 2.0
    # before the penalties, as in llama.cpp: token 3's biased 2.5 is halved to 1.25 < 2.0 (the
    # other order would give 0·2 + 2.5 = 2.5 and pick it)
    assert Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0, logit_bias={3: 2.5})).sample(logits, [3]) == 0
    # a banned token is never drawn, whatever the temperature
    hot = Sampler(SamplingParams(temperature=5.0, top_k=0, top_p=1.0, min_p=0.0, seed=1, logit_bias={0: -100.0}))
    assert 0 not in {hot.sample(logits) for _ in range(200)}
    assert logits[0] == 2.0  # the caller's logits are not modified
    with pytest.raises(InvalidArgumentError, match="outside"):
        Sampler(SamplingParams(logit_bias={4: 1.0})).sample(logits)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"logit_bias": {0: 101.0}},
        {"logit_bias": {-1: 1.0}},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"top_k": 2.5},
        {"min_p": -0.1},
        {"min_p": 1.1},
        {"repeat_penalty": 0.0},
        {"repeat_last_n": -2},
        {"temperature": float("nan")},
        {"seed": -1},
        {"frequency_penalty": 2.5},
        {"presence_penalty": -3.0},
    ],
)
def test_invalid_params_raise(kwargs):
    with pytest.raises(InvalidArgumentError, match="sampling: "):
        SamplingParams(**kwargs)


def test_invalid_inputs_raise():
    sampler = Sampler(SamplingParams(repeat_penalty=1.1))
    with pytest.raises(InvalidArgumentError, match="1-D"):
        sampler.sample(np.zeros((2, 3), dtype=np.float32), [])
    with pytest.raises(InvalidArgumentError, match="outside"):
        sampler.sample(np.zeros(10, dtype=np.float32), [3, 10])
