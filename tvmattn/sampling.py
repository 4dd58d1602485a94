"""Per-request sampling: `SamplingOptions` (validated at construction) and `Sampler`, which picks
each next token of one request from a row of logits (numpy only, no TVM import).

The order of operations on a row of logits (float64):

1. an optional allow-mask (grammar-constrained decoding): disallowed tokens get -inf;
2. penalties over the tokens generated so far (not the prompt), as OpenAI defines them:
   ``logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``;
3. logprobs (when asked) are read here: log-softmax of the penalized logits, before
   temperature, top-k and top-p (the model's distribution, not the truncated one);
4. temperature 0: the argmax (the lowest token id among equal maxima), nothing random;
5. otherwise logits / temperature, then top-k (the k most likely tokens; 0 = off), then top-p
   (the smallest set of most likely tokens whose probability reaches top_p), renormalized, and
   one draw from the request's own generator (`seed`: reproducible per request whatever the
   batch it runs in).

This is the one sampler contract; the device sampler (tvmattn.device_sampling.DeviceSampler,
kernels in tir_kernels.sampling) implements it too, on the requests' own `Sampler`s:
- the kept set after top-k / top-p is a prefix of the tokens in decreasing probability, equal
  ones by increasing id (numpy's stable argsort), so ties at the cut keep the lowest ids;
- the draw is one `rng.random()` u per sampled token and the first token, in id order, whose
  cumulative probability exceeds u (what `Generator.choice(p=...)` does), so the device gives the
  host's tokens for a seed up to float32 rounding at a boundary (it computes in float32; its
  top-p comparison has a relative slack of 1e-6 instead of 1e-12);
- rows with a mask or logprobs, or a vocabulary smaller than the logits', are chosen here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

MAX_TOP_LOGPROBS = 20


class SamplingError(ValueError):
    """A sampling option out of range; the message names the field."""


def _number(name: str, value, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise SamplingError(f"{name} must be finite, got {value!r}")
    if low is not None and (value <= low if low_open else value < low):
        raise SamplingError(f"{name} must be {'>' if low_open else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise SamplingError(f"{name} must be <= {high}, got {value!r}")
    return float(value)


def _integer(name: str, value, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise SamplingError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise SamplingError(f"{name} must be >= {low}, got {value!r}")
    if high is not None and value > high:
        raise SamplingError(f"{name} must be <= {high}, got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """How one request picks its tokens (OpenAI's fields and ranges).

    temperature >= 0 (0: greedy); top_p in (0, 1]; top_k >= 0 (0: off); seed: the request's
    random generator (None: fresh entropy); presence_penalty, frequency_penalty in [-2, 2];
    max_tokens >= 1 new tokens; stop: strings that end the answer (not included in it);
    stop_token_ids: extra token ids that end it (besides the model's own, unless ignore_eos);
    logprobs: return each chosen token's log-probability, with top_logprobs (0..20) alternatives.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "temperature", _number("temperature", self.temperature, 0.0))
        set_(self, "top_p", _number("top_p", self.top_p, 0.0, 1.0, low_open=True))
        set_(self, "top_k", _integer("top_k", self.top_k, 0))
        if self.seed is not None:
            set_(self, "seed", _integer("seed", self.seed, 0))
        set_(self, "presence_penalty", _number("presence_penalty", self.presence_penalty, -2.0, 2.0))
        set_(self, "frequency_penalty", _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        set_(self, "max_tokens", _integer("max_tokens", self.max_tokens, 1))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise SamplingError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        set_(self, "stop", tuple(stop))
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise SamplingError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        set_(self, "stop_token_ids", tuple(_integer("stop_token_ids[]", t, 0) for t in self.stop_token_ids))
        if not isinstance(self.logprobs, bool):
            raise SamplingError(f"logprobs must be a boolean, got {self.logprobs!r}")
        set_(self, "top_logprobs", _integer("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS))
        if self.top_logprobs and not self.logprobs:
            raise SamplingError(f"top_logprobs={self.top_logprobs} needs logprobs=true")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class TokenLogprob(NamedTuple):
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob) of the most likely tokens, best first


def log_softmax(z: np.ndarray) -> np.ndarray:
    finite = z[np.isfinite(z)]
    shift = finite.max() if finite.size else 0.0
    with np.errstate(divide="ignore"):
        return z - shift - math.log(np.exp(z - shift).sum())


def distribution(logits: np.ndarray, options: SamplingOptions) -> np.ndarray:
    """The probabilities [vocab] float64 a draw follows (temperature > 0; logits already
    masked and penalized): temperature, top-k, top-p, renormalized."""
    z = logits.astype(np.float64) / options.temperature
    probs = np.exp(z - z[np.isfinite(z)].max())
    vocab = probs.shape[0]
    order = None
    if options.top_k and options.top_k < vocab:
        order = np.argsort(-probs, kind="stable")
        probs[order[options.top_k:]] = 0.0
    probs /= probs.sum()
    if options.top_p < 1.0:
        if order is None:
            order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep = int(np.searchsorted(cumulative, options.top_p * (1 - 1e-12))) + 1
        probs[order[keep:]] = 0.0
        probs /= probs.sum()
    return probs


class Sampler:
    """The token choices of one request: its options, its random generator and the counts of
    the tokens it generated (for the penalties)."""

    def __init__(self, options: SamplingOptions, vocab_size: int):
        self.options = options
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(options.seed)
        self.counts = np.zeros(vocab_size, np.int64) if options.penalized else None

    def penalized(self, logits: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """float64 logits [vocab] after the mask (bool [vocab], True = allowed) and the penalties."""
        z = np.asarray(logits, dtype=np.float64)[: self.vocab_size]
        if mask is not None or self.counts is not None:
            z = z.copy()
        if mask is not None:
            z[~mask[: self.vocab_size]] = -np.inf
        if self.counts is not None:
            seen = self.counts > 0
            z -= self.options.frequency_penalty * self.counts + self.options.presence_penalty * seen
        return z

    def choose(self, logits: np.ndarray, mask: np.ndarray | None = None) -> tuple[int, TokenLogprob | None]:
        """One token from logits [>= vocab] (float); (token, its logprob record or None)."""
        options = self.options
        z = self.penalized(logits, mask)
        if options.greedy:
            token = int(np.argmax(z))
        else:
            probs = distribution(z, options)
            token = int(self.rng.choice(probs.shape[0], p=probs))
        record = None
        if options.logprobs:
            logp = log_softmax(z)
            top = ()
            if options.top_logprobs:
                best = np.argsort(-logp, kind="stable")[: options.top_logprobs]
                top = tuple((int(t), float(logp[t])) for t in best)
            record = TokenLogprob(token, float(logp[token]), top)
        return token, record

    def accept(self, token: int) -> None:
        """Count a token the request emitted (the penalties see it from the next choice on)."""
        if self.counts is not None:
            self.counts[token] += 1
