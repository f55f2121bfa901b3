"""One Model (or Context) used from several threads: every native call holds the context's
lock, so calls are serialized and see a consistent cache; close() waits for the call in
progress, and calls after it raise InvalidArgumentError. Contexts on the same weights run in
parallel. Without the lock these runs aborted (SIGABRT, SIGFPE or SIGSEGV)."""

import threading

import numpy as np
import pytest

from make_gguf import write_random_model
from ott_gguf import Model
from ott_gguf.errors import InvalidArgumentError
from ott_gguf.model import Context

N_THREADS, STEPS = 4, 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("threads") / "tiny.gguf", n_layer=2, dtype="f32")


def _prompt(seq: int) -> list[int]:
    return [(7 * seq + 3 * i) % 200 + 1 for i in range(STEPS)]


def _decode(model, seq: int) -> np.ndarray:
    """Feed the sequence's prompt token by token; the logits of each step."""
    return np.stack([model.eval([t], seq=seq) for t in _prompt(seq)])


def _run_threads(target, n: int) -> list:
    errors, threads = [], []

    def guarded(i):
        try:
            target(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    for i in range(n):
        threads.append(threading.Thread(target=guarded, args=(i,)))
        threads[-1].start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads)
    return errors


def test_threads_hammering_one_model_get_the_single_threaded_logits(tiny):
    expected = {}
    with Model(tiny, n_ctx=64, n_seq_max=N_THREADS, n_threads=1) as model:
        for seq in range(N_THREADS):
            expected[seq] = _decode(model, seq)
    got = {}
    with Model(tiny, n_ctx=64, n_seq_max=N_THREADS, n_threads=2) as model:

        def work(seq):
            got[seq] = _decode(model, seq)
            model.kv_stats()
            assert model.seq_len(seq) == STEPS
            model.truncate(seq, 0)
            model.set_threads(1 + seq % 2)

        assert _run_threads(work, N_THREADS) == []
    for seq in range(N_THREADS):
        np.testing.assert_allclose(got[seq], expected[seq], rtol=1e-5, atol=1e-5)


def test_close_during_calls_waits_then_refuses(tiny):
    model = Model(tiny, n_ctx=4096, n_seq_max=N_THREADS, n_threads=1)
    started = threading.Barrier(N_THREADS + 1)
    outcomes = []

    def work(seq):
        started.wait()
        done = 0
        try:
            for _ in range(10_000):
                model.eval([1 + seq], seq=seq)
                done += 1
        except InvalidArgumentError as e:
            outcomes.append((done, str(e)))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(N_THREADS)]
    for t in threads:
        t.start()
    started.wait()
    model.close()
    for t in threads:
        t.join(timeout=300)
    assert len(outcomes) == N_THREADS
    assert all(msg == "the context is closed" for _, msg in outcomes)
    assert all(done < 10_000 for done, _ in outcomes)
    with pytest.raises(InvalidArgumentError, match="closed"):
        model.seq_len(0)
    model.close()  # twice is fine


def test_contexts_on_shared_weights_run_in_parallel(tiny):
    with Model(tiny, n_ctx=64, n_threads=1) as model:
        expected = _decode(model, 0)
        contexts = [Context(model.weights, n_ctx=64, n_threads=1) for _ in range(N_THREADS)]
        got = {}

        def work(i):
            got[i] = _decode(contexts[i], 0)

        assert _run_threads(work, N_THREADS) == []
        for i in range(N_THREADS):
            np.testing.assert_allclose(got[i], expected, rtol=1e-5, atol=1e-5)
            contexts[i].close()
