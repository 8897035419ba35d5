"""One draw from one logits row: the distribution it samples, the log-prob it reports, and
the option checks (no llama.cpp needed)."""

import numpy as np
import pytest

from retrograd.errors import ConfigError
from retrograd.sampler import Sampling, sample_token

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03], dtype=np.float32)) + np.float32(3.0)  # any shift


def frequencies(sampling: Sampling, draws: int = 20000) -> np.ndarray:
    rng = np.random.default_rng(0)
    counts = np.bincount([sample_token(LOGITS, sampling, rng)[0] for _ in range(draws)], minlength=len(LOGITS))
    return counts / draws


P = np.array([0.5, 0.25, 0.15, 0.07, 0.03])


def tempered(t: float) -> np.ndarray:
    return P ** (1 / t) / (P ** (1 / t)).sum()


def test_temperature_reshapes_the_distribution():
    for t in (1.0, 0.5, 2.0):
        assert np.abs(frequencies(Sampling(4, temperature=t)) - tempered(t)).max() < 0.015


@pytest.mark.parametrize("t", [0.3, 0.7, 1.0, 2.0])
def test_logprob_is_the_tempered_softmax(t):
    """The policy that produced the token: log_softmax(logits / T), not the T = 1 value."""
    rng = np.random.default_rng(1)
    for _ in range(50):
        token, logprob = sample_token(LOGITS, Sampling(4, temperature=t), rng)
        assert logprob == pytest.approx(np.log(tempered(t)[token]), abs=1e-6)
        if t != 1.0:
            assert abs(logprob - np.log(P[token])) > 1e-3


@pytest.mark.parametrize("t,top_p,kept", [(1.0, 0.8, 3), (2.0, 0.6, 3), (0.5, 0.9, 2)])
def test_nucleus_logprob_is_renormalised_over_the_kept_tokens(t, top_p, kept):
    """With top_p < 1 the token comes from the nucleus, renormalised: that is its
    behaviour probability (what truncated importance sampling corrects against)."""
    q = tempered(t)  # already sorted, most likely first
    assert np.searchsorted(np.cumsum(q), top_p) + 1 == kept  # the nucleus this case means
    nucleus = q[:kept] / q[:kept].sum()
    rng = np.random.default_rng(2)
    seen = set()
    for _ in range(200):
        token, logprob = sample_token(LOGITS, Sampling(4, temperature=t, top_p=top_p), rng)
        assert token < kept and logprob == pytest.approx(np.log(nucleus[token]), abs=1e-6)
        seen.add(token)
    assert seen == set(range(kept))


def test_top_p_keeps_the_smallest_nucleus():
    freq = frequencies(Sampling(4, top_p=0.8))  # 0.5 + 0.25 < 0.8 <= 0.5 + 0.25 + 0.15
    assert (freq[3:] == 0).all() and (freq[:3] > 0).all()
    assert np.abs(freq[:3] - np.array([0.5, 0.25, 0.15]) / 0.9).max() < 0.015
    assert (frequencies(Sampling(4, top_p=0.4), draws=200)[1:] == 0).all()


def test_one_draw_per_token_so_the_stream_only_depends_on_the_seed():
    a, b = np.random.default_rng(7), np.random.default_rng(7)
    sample_token(LOGITS, Sampling(4, top_p=0.5), a)
    sample_token(LOGITS, Sampling(4, temperature=3.0), b)
    assert a.random() == b.random()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": 0.0}, "temperature 0.0 must be a finite number > 0"),
        ({"temperature": float("nan")}, "temperature nan"),
        ({"top_p": 0.0}, "top_p 0.0 must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p 1.5 must be in (0, 1]"),
        ({"max_new_tokens": 0}, "max_new_tokens 0 must be an integer >= 1"),
    ],
)
def test_bad_options_are_one_line_errors(kwargs, message):
    with pytest.raises(ConfigError) as e:
        Sampling(**({"max_new_tokens": 4} | kwargs))
    assert message in str(e.value) and "\n" not in str(e.value)


def reference_draw(logits: np.ndarray, sampling: Sampling, u: float) -> tuple[int, float]:
    """The definition, in the plainest numpy: the whole vocabulary sorted for the nucleus and
    one cumulative sum over it."""
    x = (logits.astype(np.float64) - logits.max()) / sampling.temperature
    w = np.exp(x)
    order = np.argsort(-w, kind="stable") if sampling.top_p < 1 else np.arange(len(w))
    cdf = np.cumsum(w[order])
    if sampling.top_p < 1:
        cdf = cdf[: int(np.searchsorted(cdf, sampling.top_p * cdf[-1])) + 1]
    token = int(order[min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(cdf) - 1)])
    return token, float(x[token] - np.log(cdf[-1]))


@pytest.mark.parametrize(
    "sampling", [Sampling(4), Sampling(4, temperature=0.6), Sampling(4, top_p=0.9), Sampling(4, top_p=0.5)]
)
def test_large_vocabulary_draws_match_the_plain_definition(sampling):
    """A vocabulary of several search blocks (not a multiple of one), and a nucleus that
    needs tokens far below the most likely one (a peak over a long flat tail, so the weight
    floor must be lowered): the same token and log-prob as the whole-vocabulary sort."""
    gen = np.random.default_rng(3)
    for case in range(40):
        logits = gen.standard_normal(5000).astype(np.float32) * np.float32(0.5 + case / 10)
        if case % 2:
            logits[gen.integers(5000)] += np.float32(9.0)  # weight of each tail token < 1e-3 of the peak
        u = np.random.default_rng(case).random()
        token, logprob = sample_token(logits, sampling, np.random.default_rng(case))
        expected_token, expected_logprob = reference_draw(logits, sampling, u)
        assert token == expected_token
        assert logprob == pytest.approx(expected_logprob, abs=1e-9)
