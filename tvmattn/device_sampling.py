"""Sampling on the device: `DeviceSampler` picks a step's tokens with a model library's `sample`
and `apply_penalties` functions (tir_kernels.sampling) where the logits are, and reads back only
the token ids.

There is one sampler semantics, tvmattn.sampling's (its docstring is the contract): a
DeviceSampler works on the requests' own `Sampler`s (their options, random generators and token
counts) and draws each row's uniform number from the request's generator exactly as the host
sampler's `Generator.choice` does (one `random()` per sampled token), so a seeded request gets
the same tokens either way, up to float32 rounding at a boundary of the inverse CDF. Rows the
kernels do not serve are sampled by the host `Sampler` from that row of logits alone:
  - a grammar mask (constrained decoding),
  - logprobs (the penalized log-softmax and its top alternatives are computed on the host),
  - a request whose vocabulary is smaller than the logits' (padded LM heads).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import tvm

from .sampling import Sampler, SamplingOptions, TokenLogprob

SAMPLING_FUNCTIONS = ("sample", "apply_penalties")
# The largest float32 below 1: a uniform draw in [0, 1) stays below 1 in float32.
_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))


def has_device_sampling(metadata: dict[str, Any]) -> bool:
    """Whether a library (its `_metadata` document) exports the sampling functions."""
    return all(name in metadata.get("functions", ()) for name in SAMPLING_FUNCTIONS)


def served_on_device(options: SamplingOptions, mask: np.ndarray | None) -> bool:
    """Whether the kernels serve a request's choice (no mask, no logprobs)."""
    return mask is None and not options.logprobs


def penalty_rows(samplers: Sequence[Sampler | None], rows: Sequence[int], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """(token_ids [n, m] int32 (-1 pads), amounts [n, m] float32) of `apply_penalties` for the
    samplers at `rows` (n = len(samplers)): each token a request generated, once, with
    frequency_penalty * count + presence_penalty; other rows get none."""
    entries = {}
    for i in rows:
        s = samplers[i]
        if s is not None and s.counts is not None:
            ids = np.flatnonzero(s.counts[:vocab])
            if ids.size:
                amounts = s.options.frequency_penalty * s.counts[ids] + s.options.presence_penalty
                entries[i] = (ids, amounts)
    width = max((ids.size for ids, _ in entries.values()), default=0)
    token_ids = np.full((len(samplers), width), -1, np.int32)
    amounts = np.zeros((len(samplers), width), np.float32)
    for i, (ids, amount) in entries.items():
        token_ids[i, :ids.size] = ids
        amounts[i, :ids.size] = amount
    return token_ids, amounts


def sample_params(samplers: Sequence[Sampler | None], rows: Sequence[int]) -> np.ndarray:
    """params [n, 4] float32 of `sample`: (u, temperature, top_k, top_p) of the samplers at
    `rows`, u drawn from each sampling (temperature > 0) request's generator; other rows greedy."""
    params = np.zeros((len(samplers), 4), np.float32)
    params[:, 3] = 1.0
    for i in rows:
        options = samplers[i].options
        u = 0.0 if options.greedy else min(samplers[i].rng.random(), _BELOW_ONE)
        params[i] = (u, options.temperature, options.top_k, options.top_p)
    return params


class DeviceSampler:
    """A step's token choices by the library's sampling functions (module docstring).

    vm: a relax.VirtualMachine of a library with `has_device_sampling`; device: where its
    logits live."""

    def __init__(self, vm, device: tvm.runtime.Device):
        self._sample = vm["sample"]
        self._penalize = vm["apply_penalties"]
        self.device = device

    def choose(self, logits, samplers: Sequence[Sampler | None],
               masks: Sequence[np.ndarray | None] | None = None) -> list[tuple[int, TokenLogprob | None] | None]:
        """One choice per row of `logits` (a float32 device tensor [rows, vocab] or [b, s, vocab],
        rows = b * s, as the library returned it) for samplers[row] (None: no choice for that
        row, e.g. a prompt chunk that is not its last); masks[row]: the grammar's allowed tokens
        (bool [vocab]) or None. Returns (token, logprob record or None) per row, None where the
        sampler is None. The device rows' logits are penalized in place; the caller still calls
        each request's `Sampler.accept` with the token it emits."""
        vocab = int(logits.shape[-1])
        rows = int(np.prod([int(d) for d in logits.shape[:-1]]))
        if str(logits.dtype) != "float32":
            raise ValueError(f"logits must be float32, got {logits.dtype}")
        if len(samplers) != rows:
            raise ValueError(f"samplers: expected one per row of logits ({rows}), got {len(samplers)}")
        masks = [None] * rows if masks is None else list(masks)
        if len(masks) != rows:
            raise ValueError(f"masks: expected one per row of logits ({rows}), got {len(masks)}")
        flat = logits if len(logits.shape) == 2 else logits._create_view((rows, vocab))
        on_device, on_host = [], []
        for i, s in enumerate(samplers):
            if s is None:
                continue
            if served_on_device(s.options, masks[i]) and s.vocab_size == vocab:
                on_device.append(i)
            else:
                on_host.append(i)
        out: list[tuple[int, TokenLogprob | None] | None] = [None] * rows
        for i in on_host:  # read before the penalties change any row (they change device rows only)
            row = flat._create_view((vocab,), relative_byte_offset=i * vocab * 4).numpy()
            out[i] = samplers[i].choose(row, masks[i])
        if not on_device:
            return out
        token_ids, amounts = penalty_rows(samplers, on_device, vocab)
        if token_ids.shape[1]:
            self._penalize(flat, tvm.runtime.tensor(token_ids, self.device), tvm.runtime.tensor(amounts, self.device))
        params = sample_params(samplers, on_device)
        tokens = self._sample(flat, tvm.runtime.tensor(params, self.device)).numpy()
        for i in on_device:
            out[i] = (int(tokens[i]), None)
        return out
