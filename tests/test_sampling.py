"""Specification of tvmattn.sampling: SamplingOptions' validation (every error names its field)
and Sampler's draws against an independent float64 reference distribution (chi-square over many
draws per option set; greedy exactly)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tvmattn.sampling import Sampler, SamplingError, SamplingOptions

VOCAB = 12
LOGITS = np.random.default_rng(3).normal(0, 0.8, VOCAB).astype(np.float32)


def chi_square_p(observed, expected) -> float:
    """The p-value of Pearson's chi-square statistic (Wilson-Hilferty approximation of the
    chi-square tail: close enough at the 1e-4 level for these degrees of freedom)."""
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    k = len(observed) - 1
    z = ((statistic / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, counts=None, presence=0.0, frequency=0.0, mask=None):
    """Written from OpenAI's definitions, one token at a time (no shared code with the sampler)."""
    z = [float(x) for x in logits]
    for t in range(len(z)):
        if mask is not None and not mask[t]:
            z[t] = -math.inf
        c = 0 if counts is None else int(counts[t])
        z[t] -= frequency * c + (presence if c > 0 else 0.0)
    finite = [v for v in z if v != -math.inf]
    m = max(finite)
    weights = [math.exp((v - m) / temperature) if v != -math.inf else 0.0 for v in z]
    ranked = sorted(range(len(z)), key=lambda t: (-weights[t], t))
    if top_k:
        for t in ranked[top_k:]:
            weights[t] = 0.0
    total = sum(weights)
    probs = [w / total for w in weights]
    if top_p < 1.0:
        kept, mass = set(), 0.0
        for t in ranked:
            if probs[t] == 0.0:
                break
            kept.add(t)
            mass += probs[t]
            if mass >= top_p - 1e-12:
                break
        probs = [p if t in kept else 0.0 for t, p in enumerate(probs)]
        total = sum(probs)
        probs = [p / total for p in probs]
    return np.array(probs)


CASES = {
    "plain": dict(temperature=1.0),
    "hot": dict(temperature=2.5),
    "cold": dict(temperature=0.4),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "top_k_and_p": dict(temperature=0.8, top_k=6, top_p=0.8),
    "penalties": dict(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.4),
    "negative_penalties": dict(temperature=1.0, presence_penalty=-1.0, frequency_penalty=-0.3),
}


@pytest.mark.parametrize("name", CASES)
def test_draws_follow_the_reference_distribution(name):
    kwargs = CASES[name]
    options = SamplingOptions(seed=11, **kwargs)
    sampler = Sampler(options, VOCAB)
    counts = None
    if options.penalized:
        counts = np.array([0, 3, 1, 0, 2, 0, 0, 5, 0, 1, 0, 0])
        sampler.counts[:] = counts
    expected = reference(LOGITS, options.temperature, options.top_k, options.top_p, counts,
                         options.presence_penalty, options.frequency_penalty)
    draws = 6000
    seen = np.bincount([sampler.choose(LOGITS)[0] for _ in range(draws)], minlength=VOCAB)
    assert seen[expected == 0].sum() == 0, "a token outside top-k / top-p was drawn"
    live = expected > 0
    p = chi_square_p(seen[live], expected[live] * draws)
    assert p > 1e-4, (seen, np.round(expected * draws))


def test_chi_square_check_rejects_a_wrong_distribution():
    expected = reference(LOGITS)
    wrong = reference(LOGITS, temperature=1.3)
    seen = np.bincount(np.random.default_rng(0).choice(VOCAB, size=6000, p=wrong), minlength=VOCAB)
    assert chi_square_p(seen, expected * 6000) < 1e-4
    assert chi_square_p(np.bincount(np.random.default_rng(0).choice(VOCAB, size=6000, p=expected), minlength=VOCAB),
                        expected * 6000) > 1e-4


def test_mask_excludes_tokens_and_renormalizes():
    mask = np.ones(VOCAB, bool)
    mask[[int(np.argmax(LOGITS)), 0, 5]] = False
    sampler = Sampler(SamplingOptions(seed=2), VOCAB)
    seen = np.bincount([sampler.choose(LOGITS, mask)[0] for _ in range(8000)], minlength=VOCAB)
    expected = reference(LOGITS, mask=mask)
    assert seen[~mask].sum() == 0
    p = chi_square_p(seen[mask], expected[mask] * 8000)
    assert p > 1e-4


def test_greedy_is_the_argmax_after_mask_and_penalties():
    greedy = Sampler(SamplingOptions(temperature=0), VOCAB)
    assert greedy.choose(LOGITS)[0] == int(np.argmax(LOGITS))
    mask = np.ones(VOCAB, bool)
    mask[int(np.argmax(LOGITS))] = False
    assert greedy.choose(LOGITS, mask)[0] == int(np.argsort(-LOGITS)[1])
    tied = np.zeros(VOCAB, np.float32)
    assert greedy.choose(tied)[0] == 0  # the lowest id among equal maxima
    penalized = Sampler(SamplingOptions(temperature=0, frequency_penalty=2.0), VOCAB)
    best = int(np.argmax(LOGITS))
    gap = float(np.sort(LOGITS)[-1] - np.sort(LOGITS)[-2])
    for _ in range(int(gap / 2.0) + 1):
        penalized.accept(best)
    assert penalized.choose(LOGITS)[0] != best  # counted enough times, the best token loses its lead


def test_seed_makes_a_request_reproducible():
    a = Sampler(SamplingOptions(seed=5, temperature=1.3), VOCAB)
    b = Sampler(SamplingOptions(seed=5, temperature=1.3), VOCAB)
    c = Sampler(SamplingOptions(seed=6, temperature=1.3), VOCAB)
    run = lambda s: [s.choose(LOGITS)[0] for _ in range(50)]  # noqa: E731
    first = run(a)
    assert first == run(b) and first != run(c)


def test_logprobs_are_the_penalized_log_softmax_with_top_alternatives():
    options = SamplingOptions(temperature=0.7, seed=1, logprobs=True, top_logprobs=3, presence_penalty=0.5)
    sampler = Sampler(options, VOCAB)
    sampler.accept(int(np.argmax(LOGITS)))
    token, record = sampler.choose(LOGITS)
    z = LOGITS.astype(np.float64) - 0.5 * (np.arange(VOCAB) == np.argmax(LOGITS))
    logp = z - np.log(np.exp(z).sum())
    assert record.token == token and record.logprob == pytest.approx(logp[token], abs=1e-9)
    best = np.argsort(-logp)[:3]
    assert [t for t, _ in record.top] == list(best)
    assert [lp for _, lp in record.top] == pytest.approx(list(logp[best]), abs=1e-9)
    assert Sampler(SamplingOptions(), VOCAB).choose(LOGITS)[1] is None


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(seed=-3), "seed"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(stop=[""]), "stop"),
    (dict(stop=[3]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logprobs="yes"), "logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
])
def test_bad_options_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(SamplingError, match=field):
        SamplingOptions(**kwargs)


def test_options_are_normalized_and_frozen():
    options = SamplingOptions(stop="END", stop_token_ids=[3, 4], temperature=1)
    assert options.stop == ("END",) and options.stop_token_ids == (3, 4) and isinstance(options.temperature, float)
    with pytest.raises(AttributeError):
        options.temperature = 0.5  # type: ignore[misc]
