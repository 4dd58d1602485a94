"""Specification of the device sampler (tir_kernels.sampling, tvmattn.device_sampling): the
kernel's draws follow the float64 reference distribution of tvmattn.sampling's contract
(chi-square over many draws per option, with uniforms the test feeds), each draw is the
reference's inverse CDF at its uniform, greedy picks the lowest id among equal maxima, and the
DeviceSampler gives the host Sampler's tokens for the same seeds, falling back to it per row."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from harness import load_script
from test_sampling import LOGITS, VOCAB, chi_square_p
from test_sampling import reference as reference_distribution
from tir_kernels.sampling import (NON_FINITE, SamplingConfig, SamplingSchedule, apply_penalties,
                                  choose_sampling_schedule, sample_tokens)
from tvmattn.device_sampling import DeviceSampler, has_device_sampling, penalty_rows
from tvmattn.sampling import Sampler, SamplingOptions

DRAWS = 20000
P_MIN = 1e-4  # fixed seeds: a correct kernel passes every time, a wrong distribution fails (self-checks below)
TARGETS = [pytest.param("llvm", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
COUNTS = np.array([0, 3, 1, 0, 2, 0, 0, 5, 0, 1, 0, 0])


class Kernels:
    """The compiled sample and penalty kernels for one target and logits dtype."""

    def __init__(self, target: str, dtype: str = "float32", schedule: SamplingSchedule | None = None):
        self.config = SamplingConfig(dtype, target)
        self.device = tvm.cuda(0) if self.config.is_gpu else tvm.cpu(0)
        self.dtype = dtype
        build = lambda f: tvm.compile(tvm.IRModule({"main": f}), target=self.config.tvm_target())["main"]  # noqa: E731
        self._sample = build(sample_tokens(self.config, schedule))
        self._penalize = build(apply_penalties(self.config, schedule))

    def tensor(self, array):
        return tvm.runtime.tensor(np.ascontiguousarray(array), self.device)

    def sample(self, logits: np.ndarray, params: np.ndarray, token_ids=None, amounts=None) -> np.ndarray:
        """tokens [rows] of logits [rows, vocab] (penalized first when token_ids is given)."""
        logits_nd = self.tensor(np.asarray(logits).astype(self.dtype if self.dtype != "bfloat16" else "float32"))
        if token_ids is not None:
            self._penalize(logits_nd, self.tensor(token_ids.astype(np.int32)), self.tensor(amounts.astype(np.float32)))
        out = self.tensor(np.zeros(len(params), np.int32))
        self._sample(logits_nd, self.tensor(params.astype(np.float32)), out)
        return out.numpy()


_BUILT: dict = {}


def kernels_for(target: str, dtype: str = "float32") -> Kernels:
    if (target, dtype) not in _BUILT:
        _BUILT[target, dtype] = Kernels(target, dtype)
    return _BUILT[target, dtype]


def uniforms(n: int, seed: int = 0) -> np.ndarray:
    """n uniform draws in [0, 1) as float32 (the host's float64 draws, as DeviceSampler sends them)."""
    u = np.random.default_rng(seed).random(n)
    return np.minimum(u, np.nextafter(np.float32(1), np.float32(0))).astype(np.float32)


def params_for(u: np.ndarray, temperature=1.0, top_k=0, top_p=1.0) -> np.ndarray:
    return np.stack([u, np.full(u.shape, temperature), np.full(u.shape, top_k), np.full(u.shape, top_p)], 1)


def inverse_cdf(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The token numpy's Generator.choice(p=probs) draws for each uniform u (id-order CDF)."""
    cdf = np.cumsum(probs)
    return np.searchsorted(cdf / cdf[-1], u, side="right")


def assert_draws_invert_the_cdf(tokens: np.ndarray, probs: np.ndarray, u: np.ndarray, eps: float) -> None:
    """Each drawn token's CDF interval [cdf before it, cdf through it] holds its uniform within eps:
    the kernel's float32 sums over a long vocabulary may move u across the boundaries of tail
    tokens of width ~1e-7 (a neighbouring token, rightly), never to a token far from u."""
    cdf = np.cumsum(probs) / probs.sum()
    low, high = cdf[tokens] - probs[tokens] / probs.sum(), cdf[tokens]
    bad = np.flatnonzero((u < low - eps) | (u > high + eps))
    assert bad.size == 0, f"{bad.size} draws outside their CDF interval, e.g. u={u[bad[:3]]} -> tokens {tokens[bad[:3]]}"


def penalty_inputs(rows: int, counts, presence: float, frequency: float):
    ids = np.flatnonzero(counts)
    amounts = frequency * counts[ids] + presence
    return np.tile(ids, (rows, 1)), np.tile(amounts, (rows, 1))


CASES = {
    "plain": dict(temperature=1.0),
    "hot": dict(temperature=2.5),
    "cold": dict(temperature=0.4),
    "top_k": dict(temperature=1.0, top_k=4),
    "top_k_1": dict(temperature=1.0, top_k=1),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "top_p_small": dict(temperature=1.3, top_p=0.05),
    "top_k_and_p": dict(temperature=0.8, top_k=6, top_p=0.8),
    "penalties": dict(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.4),
    "penalties_top_p": dict(temperature=0.9, top_p=0.7, presence_penalty=-1.0, frequency_penalty=-0.3),
}


def draw_case(kernels: Kernels, kwargs: dict, draws: int = DRAWS, seed: int = 0):
    """(tokens drawn by the kernel, reference probabilities, the uniforms) for one option set."""
    options = SamplingOptions(**kwargs)
    u = uniforms(draws, seed)
    logits = np.tile(LOGITS, (draws, 1))
    ids = amounts = counts = None
    if options.penalized:
        counts = COUNTS
        ids, amounts = penalty_inputs(draws, counts, options.presence_penalty, options.frequency_penalty)
    tokens = kernels.sample(logits, params_for(u, options.temperature, options.top_k, options.top_p), ids, amounts)
    expected = reference_distribution(LOGITS, options.temperature, options.top_k, options.top_p, counts,
                                      options.presence_penalty, options.frequency_penalty)
    return tokens, expected, u


def assert_follows(tokens: np.ndarray, expected: np.ndarray) -> None:
    seen = np.bincount(tokens, minlength=len(expected))
    assert seen[expected == 0].sum() == 0, f"a token outside top-k / top-p was drawn: {seen}"
    live = expected > 0
    if live.sum() > 1:
        p = chi_square_p(seen[live], expected[live] * len(tokens))
        assert p > P_MIN, (p, seen, np.round(expected * len(tokens)))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", CASES)
def test_draws_follow_the_reference_distribution(target, name):
    tokens, expected, u = draw_case(kernels_for(target), CASES[name])
    assert_follows(tokens, expected)
    # each draw is the reference's inverse CDF at its uniform (float32 rounding at a boundary aside)
    assert (tokens != inverse_cdf(expected, u)).sum() <= 2


@pytest.mark.parametrize("target", TARGETS)
def test_chi_square_rejects_a_wrong_kernel(target):
    """The check can fail: draws with the temperature ignored, with top-p ignored, or with a
    penalty left out are rejected against the intended distribution."""
    kernels = kernels_for(target)
    wrong_temperature, _, _ = draw_case(kernels, dict(temperature=1.0))
    _, hot, _ = draw_case(kernels, dict(temperature=1.6), draws=1)
    assert chi_square_p(np.bincount(wrong_temperature, minlength=VOCAB), hot * DRAWS) < P_MIN
    no_top_p, _, _ = draw_case(kernels, dict(temperature=1.0, top_p=0.999))
    _, nucleus, _ = draw_case(kernels, dict(temperature=1.0, top_p=0.9), draws=1)
    assert np.bincount(no_top_p, minlength=VOCAB)[nucleus == 0].sum() > 0
    unpenalized, _, _ = draw_case(kernels, dict(temperature=1.0))
    _, penalized, _ = draw_case(kernels, dict(temperature=1.0, frequency_penalty=0.2), draws=1)
    assert chi_square_p(np.bincount(unpenalized, minlength=VOCAB), penalized * DRAWS) < P_MIN


@pytest.mark.parametrize("target", TARGETS)
def test_greedy_is_the_argmax_with_the_lowest_id_among_ties(target):
    kernels = kernels_for(target)
    vocab = 3000  # more ids than a CUDA block has threads: ties across threads
    logits = np.random.default_rng(1).normal(0, 1, (4, vocab)).astype(np.float32)
    logits[1, [2999, 700, 1300]] = 50.0
    logits[2, :] = 0.0
    logits[3, [5, 6]] = [-3e38, 60.0]
    u = uniforms(4)
    tokens = kernels.sample(logits, params_for(u, temperature=0.0, top_k=3, top_p=0.5))
    assert tokens.tolist() == [int(np.argmax(logits[0])), 700, 0, 6]


@pytest.mark.parametrize("target", TARGETS)
def test_greedy_over_a_vocabulary_of_many_argmax_blocks(target):
    """A row longer than one block of the CUDA argmax pass (threads x ARGMAX_LOADS ids): equal
    maxima in different blocks give the lowest id, a maximum in the last, partial block wins,
    a NaN there or an inf in the first block flags the row; sampled rows beside them."""
    from tir_kernels.sampling import ARGMAX_LOADS

    kernels = kernels_for(target)
    block = choose_sampling_schedule(SamplingConfig("float32", "cuda")).threads * ARGMAX_LOADS
    vocab = 4 * block + 37
    logits = np.random.default_rng(21).normal(0, 1, (6, vocab)).astype(np.float32)
    logits[0, [3 * block + 1, block, block - 1]] = 40.0  # ties across blocks: block - 1
    logits[1, vocab - 1] = 40.0  # the last, partial block
    logits[2, vocab - 5] = np.nan
    logits[3, 7] = np.inf
    logits[4, [block + 3, 2 * block + 9]] = 30.0
    params = params_for(uniforms(6, seed=22), temperature=0.0)
    params[4:, 1] = 1.0  # rows 4 and 5 sampled
    tokens = kernels.sample(logits, params)
    assert tokens[:4].tolist() == [block - 1, vocab - 1, -1, -1]
    assert tokens[4] in (block + 3, 2 * block + 9)  # e^30 against a tail of e^N(0,1): one of the two
    expected = reference_distribution(logits[5], 1.0, 0, 1.0)
    assert tokens[5] == inverse_cdf(expected, params[5:6, 0])[0]


@pytest.mark.parametrize("target", TARGETS)
def test_rows_holding_nan_or_inf_get_the_non_finite_token(target):
    """Greedy or sampled, a row with one NaN, +inf or -inf logit (anywhere, also past the first
    CUDA block's worth of ids) gets -1; the finite rows of the same batch are unaffected."""
    kernels = kernels_for(target)
    vocab = 3000
    logits = np.random.default_rng(2).normal(0, 1, (8, vocab)).astype(np.float32)
    logits[1, 2999] = np.nan
    logits[2, 0] = np.inf
    logits[3, 1700] = -np.inf
    logits[5, 300] = np.nan
    logits[6, 2] = np.inf
    u = uniforms(8, seed=3)
    params = params_for(u, temperature=1.0, top_k=0, top_p=0.9)
    params[:4, 1] = 0.0  # rows 0-3 greedy, rows 4-7 sampled
    tokens = kernels.sample(logits, params)
    assert tokens[[1, 2, 3, 5, 6]].tolist() == [-1] * 5
    assert tokens[0] == int(np.argmax(logits[0]))
    expected = reference_distribution(logits[4], 1.0, 0, 0.9)
    assert tokens[4] == inverse_cdf(expected, u[4:5])[0]
    assert 0 <= tokens[7] < vocab


@pytest.mark.parametrize("target", TARGETS)
def test_ties_at_the_cut_keep_the_lowest_ids(target):
    """numpy's stable order: of equal logits at the top-k / top-p boundary, the lowest ids stay."""
    kernels = kernels_for(target)
    logits = np.array([0.0, 2.0, 1.0, 2.0, 1.0, 1.0, 2.0, -1.0], np.float32)
    u = uniforms(6000, seed=4)
    for kwargs in (dict(top_k=2), dict(top_k=5), dict(top_p=0.5), dict(top_p=0.93), dict(top_k=5, top_p=0.8)):
        options = SamplingOptions(**kwargs)
        tokens = kernels.sample(np.tile(logits, (len(u), 1)), params_for(u, 1.0, options.top_k, options.top_p))
        expected = reference_distribution(logits, 1.0, options.top_k, options.top_p)
        assert_follows(tokens, expected)
        assert (tokens != inverse_cdf(expected, u)).sum() <= 2, kwargs


@pytest.mark.parametrize("target", TARGETS)
def test_rows_of_one_batch_follow_their_own_options(target):
    kernels = kernels_for(target)
    rng = np.random.default_rng(5)
    rows, vocab = 64, 700
    logits = rng.normal(0, 2, (rows, vocab)).astype(np.float32)
    u = uniforms(rows, seed=6)
    params = np.stack([u, rng.choice([0.0, 0.5, 1.0, 1.7], rows), rng.choice([0, 1, 7, 50, 699, 5000], rows),
                       rng.choice([1.0, 0.9, 0.3, 0.01], rows)], 1)
    tokens = kernels.sample(logits, params)
    for r in range(rows):
        t, k, p = float(params[r, 1]), int(params[r, 2]), float(params[r, 3])
        if t == 0.0:
            assert tokens[r] == np.argmax(logits[r])
            continue
        expected = reference_distribution(logits[r], t, k if k < vocab else 0, p)
        assert tokens[r] == inverse_cdf(expected, u[r:r + 1])[0], (r, t, k, p)


def test_half_precision_logits_are_read_as_float32():
    kernels = kernels_for("llvm", "float16")
    tokens, expected, _ = draw_case(kernels, dict(temperature=0.7, top_k=8, top_p=0.9), draws=6000)
    half = LOGITS.astype(np.float16).astype(np.float32)
    assert_follows(tokens, reference_distribution(half, 0.7, 8, 0.9))


def gemma_vocab_case(rows: int, seed: int):
    """Logits over 262,144 tokens whose mass sits on a few ids spread over the row (the first,
    the last, and ids in different threads' chunks), with a long tail."""
    vocab = 262144
    rng = np.random.default_rng(seed)
    logits = rng.normal(-4.0, 1.0, vocab).astype(np.float32)
    hot = np.array([0, 17, 65535, 131072, 200001, 262143])
    logits[hot] = [9.0, 8.5, 9.5, 8.0, 9.2, 8.8]
    return np.tile(logits, (rows, 1)), logits


@pytest.mark.slow
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kwargs", [dict(temperature=1.0), dict(temperature=0.8, top_k=40, top_p=0.9),
                                    dict(temperature=1.2, top_p=0.5), dict(temperature=0.0)])
def test_gemma_sized_vocabulary(target, kwargs):
    kernels = kernels_for(target)
    rows = 1024
    batch, logits = gemma_vocab_case(rows, seed=7)
    options = SamplingOptions(**kwargs)
    u = uniforms(rows, seed=8)
    tokens = kernels.sample(batch, params_for(u, options.temperature, options.top_k, options.top_p))
    if options.greedy:
        assert (tokens == np.argmax(logits)).all()
        return
    expected = reference_distribution(logits, options.temperature, options.top_k, options.top_p)
    assert (tokens != inverse_cdf(expected, u)).sum() <= 2
    live = expected > 0.01  # chi-square over the hot tokens, the tail pooled
    seen = np.bincount(tokens, minlength=len(expected))
    observed = np.append(seen[live], seen[~live].sum())
    wanted = np.append(expected[live], expected[~live].sum()) * rows
    assert chi_square_p(observed[wanted > 0], wanted[wanted > 0]) > P_MIN


@pytest.mark.gpu
@pytest.mark.parametrize("kwargs", [dict(temperature=1.0), dict(temperature=0.8, top_k=40, top_p=0.9)])
def test_gemma_sized_vocabulary_many_draws_on_the_gpu(kwargs):
    """20,000 draws over 262,144 tokens on the GPU: chi-square over the hot ids. The draws go in
    launches of 2,500 rows (2.6 GB of float32 logits each): all at once would hold 21 GB on the host."""
    kernels = kernels_for("cuda")
    chunk = 2500
    batch, logits = gemma_vocab_case(chunk, seed=9)
    options = SamplingOptions(**kwargs)
    u = uniforms(DRAWS, seed=10)
    params = params_for(u, options.temperature, options.top_k, options.top_p)
    tokens = np.concatenate([kernels.sample(batch, params[start:start + chunk])
                             for start in range(0, DRAWS, chunk)])
    expected = reference_distribution(logits, options.temperature, options.top_k, options.top_p)
    assert_draws_invert_the_cdf(tokens, expected, u, eps=1e-4)
    live = expected > 1e-3
    seen = np.bincount(tokens, minlength=len(expected))
    observed = np.append(seen[live], seen[~live].sum())
    wanted = np.append(expected[live], expected[~live].sum()) * DRAWS
    assert chi_square_p(observed[wanted > 0], wanted[wanted > 0]) > P_MIN


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cuda_source_builds_without_a_gpu(arch):
    """The CUDA kernels compile to source for the arch (no driver needed): one block of the
    schedule's threads per row, block-wide sums through shared memory."""
    config = SamplingConfig("float32", f"cuda:{arch}")
    threads = choose_sampling_schedule(config).threads
    for func in (sample_tokens(config), apply_penalties(config)):
        name = str(func.attrs["global_symbol"])
        module = tvm.compile(tvm.IRModule({name: func}), target=config.tvm_target())
        source = module.mod.imports[0].inspect_source()
        assert f"{name}_kernel" in source
        if name == "tvmattn_sample":
            assert f"__launch_bounds__({threads})" in source
            assert "__shared__" in source and "__syncthreads()" in source


@pytest.mark.parametrize("change, message", [
    (dict(dtype="int8"), "dtype='int8' is not supported"),
    (dict(target="rocm"), "target='rocm' is not supported"),
])
def test_config_rejects_bad_fields(change, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**change)


def test_schedule_rejects_bad_fields():
    with pytest.raises(ValueError, match="threads=100"):
        SamplingSchedule(100)
    with pytest.raises(ValueError, match="radix_bits=3"):
        SamplingSchedule(256, 3)
    with pytest.raises(ValueError, match="threads=4 on the CPU"):
        sample_tokens(SamplingConfig(), SamplingSchedule(4))


@pytest.mark.parametrize("bits", [1, 2, 8])
def test_radix_width_changes_speed_not_draws(bits):
    kernels = Kernels("llvm", schedule=SamplingSchedule(1, bits))
    tokens, expected, u = draw_case(kernels, dict(temperature=0.9, top_k=5, top_p=0.85), draws=2000)
    assert (tokens != inverse_cdf(expected, u)).sum() <= 1


# ------------------------------------------------------------------ DeviceSampler
def sampling_vm(target: str):
    from tvmattn.models.export import sampling_module

    key = ("vm", target)
    if key not in _BUILT:
        device = tvm.cuda(0) if target.startswith("cuda") else tvm.cpu(0)
        tvm_target = SamplingConfig("float32", target).tvm_target()
        _BUILT[key] = (relax.VirtualMachine(tvm.compile(sampling_module(target), target=tvm_target), device), device)
    return _BUILT[key]


OPTION_SETS = [dict(temperature=0.0), dict(temperature=1.0, seed=1), dict(temperature=0.7, top_p=0.8, seed=2),
               dict(temperature=1.3, top_k=5, seed=3), dict(temperature=1.0, top_k=8, top_p=0.9, seed=4,
                                                            presence_penalty=0.5, frequency_penalty=0.3),
               dict(temperature=0.0, frequency_penalty=2.0)]


@pytest.mark.parametrize("target", TARGETS)
def test_device_sampler_gives_the_host_samplers_tokens(target):
    """Seeded requests: the same tokens as the host Sampler, step after step (penalties counted)."""
    vm, device = sampling_vm(target)
    sampler = DeviceSampler(vm, device)
    vocab, steps = 300, 40
    rng = np.random.default_rng(12)
    host = [Sampler(SamplingOptions(**o), vocab) for o in OPTION_SETS]
    dev = [Sampler(SamplingOptions(**o), vocab) for o in OPTION_SETS]
    for _ in range(steps):
        logits = rng.normal(0, 1.5, (len(host), 1, vocab)).astype(np.float32)
        expected = [h.choose(logits[i, 0])[0] for i, h in enumerate(host)]
        got = sampler.choose(tvm.runtime.tensor(logits, device), dev)
        assert [token for token, _ in got] == expected
        for h, d, token in zip(host, dev, expected):
            h.accept(token)
            d.accept(token)


@pytest.mark.parametrize("target", TARGETS)
def test_device_sampler_falls_back_to_the_host_per_row(target):
    """A masked row, a logprobs row and a smaller-vocabulary row are the host Sampler's; a None
    row gets no choice; the device rows are still the kernel's."""
    vm, device = sampling_vm(target)
    vocab = 64
    logits = np.random.default_rng(13).normal(0, 1, (5, vocab)).astype(np.float32)
    mask = np.zeros(vocab, bool)
    mask[[3, 9, 40]] = True
    options = [dict(temperature=0.9, seed=5), dict(temperature=0.0, logprobs=True, top_logprobs=2),
               dict(temperature=1.0, seed=6), None, dict(temperature=0.0)]
    masks = [mask, None, None, None, None]
    vocabs = [vocab, vocab, vocab - 4, vocab, vocab]
    make = lambda: [None if o is None else Sampler(SamplingOptions(**o), v) for o, v in zip(options, vocabs)]  # noqa: E731
    host, dev = make(), make()
    got = DeviceSampler(vm, device).choose(tvm.runtime.tensor(logits, device), dev, masks)
    expected = [None if h is None else h.choose(logits[i], masks[i]) for i, h in enumerate(host)]
    assert got[3] is None and got[0][0] in (3, 9, 40)
    assert [g if g is None else g[0] for g in got] == [e if e is None else e[0] for e in expected]
    assert got[1][1] == expected[1][1]  # the host's logprob record
    assert got[4] == (int(np.argmax(logits[4])), None)


@pytest.mark.parametrize("target", TARGETS)
def test_device_sampler_reports_rows_that_are_not_finite(target):
    """NaN or inf in a device row, a host (logprobs) row or a row with no sampler: each is named;
    the other rows still get their choices (wait), choose raises NonFiniteLogits."""
    from tvmattn.device_sampling import NonFiniteLogits

    vm, device = sampling_vm(target)
    sampler = DeviceSampler(vm, device)
    assert sampler.flags_non_finite
    vocab = 40
    logits = np.random.default_rng(15).normal(0, 1, (5, vocab)).astype(np.float32)
    logits[0, 3], logits[2, 39], logits[3, 0] = np.nan, np.inf, -np.inf
    options = [dict(temperature=1.0, seed=1), dict(temperature=0.0), dict(temperature=0.0, logprobs=True), None,
               dict(temperature=0.5, seed=2)]
    samplers = [None if o is None else Sampler(SamplingOptions(**o), vocab) for o in options]
    step = sampler.launch(sampler.prepare(samplers, vocab=vocab), tvm.runtime.tensor(logits, device)).wait()
    assert step.non_finite == [True, False, True, True, False]
    assert step.on_device == [0, 1, 4] and step.on_host == [2]
    assert step.choices[0] is None and step.choices[2] is None and step.choices[3] is None
    assert step.choices[1] == (int(np.argmax(logits[1])), None)
    with pytest.raises(NonFiniteLogits, match=r"\[0, 2, 3\]"):
        sampler.choose(tvm.runtime.tensor(logits, device), samplers)


@pytest.mark.parametrize("target", TARGETS)
def test_a_plan_made_before_the_logits_gives_the_same_choices(target):
    """prepare (uniforms drawn, inputs uploaded) before the logits exist, launch and wait after:
    the host sampler's tokens; host=True rows are chosen on the host from the whole,
    unpenalized row; the device rows' generators advance by one draw each at prepare."""
    vm, device = sampling_vm(target)
    sampler = DeviceSampler(vm, device)
    vocab = 120
    rng = np.random.default_rng(16)
    host = [Sampler(SamplingOptions(**o), vocab) for o in OPTION_SETS]
    dev = [Sampler(SamplingOptions(**o), vocab) for o in OPTION_SETS]
    forced = [i % 2 == 1 for i in range(len(dev))]
    for _ in range(6):
        logits = rng.normal(0, 1.5, (len(dev), vocab)).astype(np.float32)
        plan = sampler.prepare(dev, host=forced, vocab=vocab)
        assert plan.on_host == [i for i, f in enumerate(forced) if f]
        step = sampler.launch(plan, tvm.runtime.tensor(logits, device)).wait()
        expected = [h.choose(logits[i])[0] for i, h in enumerate(host)]
        assert [c[0] for c in step.choices] == expected
        for i in plan.on_host:
            np.testing.assert_array_equal(step.host_rows[i], logits[i])
        for h, d, token in zip(host, dev, expected):
            h.accept(token)
            d.accept(token)


@pytest.mark.parametrize("target", TARGETS)
def test_a_plan_uploaded_for_a_graph_samples_like_the_host(target):
    """prepare(params_at=) uploads the `sample` parameters into a buffer of the caller's (a CUDA
    graph's, ModelSession.graph_sample_params), where `sample` reads them (run here as the graph
    would); launch(sampled=) then only reads its ids back: the host samplers' tokens, a row
    without a sampler greedy, a host=True row chosen on the host."""
    vm, device = sampling_vm(target)
    sampler = DeviceSampler(vm, device)
    vocab = 90
    rng = np.random.default_rng(18)
    options = [o for o in OPTION_SETS if "frequency_penalty" not in o and "presence_penalty" not in o]
    host = [Sampler(SamplingOptions(**o), vocab) for o in options] + [None]
    dev = [Sampler(SamplingOptions(**o), vocab) for o in options] + [None]
    forced = [i == 1 for i in range(len(dev))]
    graph_params = tvm.runtime.tensor(np.zeros((8, 4), np.float32), device)  # a bucket of 8 rows
    for _ in range(5):
        logits = rng.normal(0, 1.5, (len(dev), vocab)).astype(np.float32)
        params_at = graph_params._create_view((len(dev), 4))
        plan = sampler.prepare(dev, host=forced, vocab=vocab, params_at=params_at)
        rows = tvm.runtime.tensor(logits, device)
        sampled = vm["sample"](rows, params_at)  # what the graph's last kernel does
        step = sampler.launch(plan, rows, sampled=sampled).wait()
        expected = [h.choose(logits[i])[0] for i, h in enumerate(host) if h is not None]
        assert [c[0] for c in step.choices[:-1]] == expected and step.choices[-1] is None
        assert step.greedy[-1] == int(np.argmax(logits[-1])) and step.on_host == [1]
        for h, d, token in zip(host, dev, expected):
            h.accept(token)
            d.accept(token)


def test_a_plan_for_a_graph_refuses_penalties_and_bad_buffers():
    """params_at: the rows' shape (rows, 4) float32, and no penalized row (the graph samples the
    logits as they come); the refusal draws nothing (the request's generator is where it was);
    launch(sampled=): ids [rows] int32, and no plan with penalties."""
    vm, device = sampling_vm("llvm")
    sampler = DeviceSampler(vm, device)
    vocab = 16
    penalized = Sampler(SamplingOptions(temperature=1.0, seed=3, presence_penalty=1.0), vocab)
    penalized.accept(2)
    plain = Sampler(SamplingOptions(temperature=1.0, seed=3), vocab)
    state = penalized.rng.bit_generator.state
    with pytest.raises(ValueError, match=r"params_at: rows \[0\] have penalties"):
        sampler.prepare([penalized], vocab=vocab, params_at=tvm.runtime.tensor(np.zeros((1, 4), np.float32), device))
    assert penalized.rng.bit_generator.state == state
    with pytest.raises(ValueError, match=r"params_at: expected a float32 tensor of shape \(1, 4\), got float32 \(2, 4\)"):
        sampler.prepare([plain], vocab=vocab, params_at=tvm.runtime.tensor(np.zeros((2, 4), np.float32), device))
    logits = tvm.runtime.tensor(np.zeros((1, vocab), np.float32), device)
    plan = sampler.prepare([plain], vocab=vocab)
    with pytest.raises(ValueError, match=r"sampled: expected an int32 tensor of shape \(1,\), got int32 \(2,\)"):
        sampler.launch(plan, logits, sampled=tvm.runtime.tensor(np.zeros(2, np.int32), device))
    plan = sampler.prepare([penalized], vocab=vocab)
    with pytest.raises(ValueError, match="sampled: the plan has penalties"):
        sampler.launch(plan, logits, sampled=tvm.runtime.tensor(np.zeros(1, np.int32), device))


def test_the_ids_are_read_after_the_host_rows_are_sampled(monkeypatch):
    """launch queues the kernels and starts the ids' copy without reading it; wait samples the
    fallback rows first and reads the ids last (on CUDA the host's sampling overlaps the
    kernels and the copy); on the CPU the read-back is the synchronous one."""
    from tvmattn.device_sampling import _SyncReadback

    vm, device = sampling_vm("llvm")
    sampler = DeviceSampler(vm, device)
    assert isinstance(sampler._readback, _SyncReadback)
    events = []
    start = sampler._readback.start

    def recording_start(tokens, rows):
        events.append("copy started")
        read = start(tokens, rows)
        return lambda: (events.append("ids read"), read())[1]

    monkeypatch.setattr(sampler._readback, "start", recording_start)
    vocab = 50
    logits = np.random.default_rng(17).normal(0, 1, (3, vocab)).astype(np.float32)
    samplers = [Sampler(SamplingOptions(temperature=0.8, seed=1), vocab),
                Sampler(SamplingOptions(logprobs=True), vocab), Sampler(SamplingOptions(temperature=0.0), vocab)]
    choose = samplers[1].choose
    monkeypatch.setattr(samplers[1], "choose", lambda *a: (events.append("host row sampled"), choose(*a))[1])
    pending = sampler.launch(sampler.prepare(samplers, vocab=vocab), tvm.runtime.tensor(logits, device))
    assert events == ["copy started"]
    step = pending.wait()
    assert events == ["copy started", "host row sampled", "ids read"]
    assert step.choices[2] == (int(np.argmax(logits[2])), None) and step.on_host == [1]


def test_device_sampler_rejects_mismatched_rows():
    vm, device = sampling_vm("llvm")
    logits = tvm.runtime.tensor(np.zeros((2, 8), np.float32), device)
    with pytest.raises(ValueError, match="samplers: expected one per row of logits \\(2\\), got 1"):
        DeviceSampler(vm, device).choose(logits, [Sampler(SamplingOptions(), 8)])
    with pytest.raises(ValueError, match="masks: expected one per row"):
        DeviceSampler(vm, device).choose(logits, [None, None], [None])


@pytest.mark.parametrize("target", TARGETS)
def test_feed_tokens_writes_the_ids_in_place_with_non_finite_rows_as_zero(target):
    """A step's sampled tokens become the next step's input ids on the device: written into the
    caller's tensor (here the first rows of a larger buffer, as a CUDA graph's bucket), the
    NON_FINITE token as 0 so that no embedding lookup reads row -1; the rows after stay."""
    vm, device = sampling_vm(target)
    tokens = np.array([5, NON_FINITE, 0, 267, 3], np.int32)
    buffer = tvm.runtime.tensor(np.full(8, 9, np.int32), device)
    out = vm["feed_tokens"](tvm.runtime.tensor(tokens, device), buffer._create_view((5,), "int32"))
    assert out.numpy().tolist() == [5, 0, 0, 267, 3]
    assert buffer.numpy().tolist() == [5, 0, 0, 267, 3, 9, 9, 9]


def test_penalty_rows_list_each_generated_token_once():
    a, b = Sampler(SamplingOptions(presence_penalty=0.5, frequency_penalty=0.25), 10), Sampler(SamplingOptions(), 10)
    for token in (3, 3, 7):
        a.accept(token)
    ids, amounts = penalty_rows([a, b, None], [0, 1], 10)
    assert ids.tolist() == [[3, 7], [-1, -1], [-1, -1]]
    assert amounts.tolist() == [[1.0, 0.75], [0.0, 0.0], [0.0, 0.0]]


def test_model_libraries_export_the_sampling_functions():
    from tvmattn.models.config import ModelConfig
    from tvmattn.models.export import BuildOptions, export_module

    config = ModelConfig.from_hf({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True})
    mod, document = export_module(config, BuildOptions())
    assert has_device_sampling(document)
    names = {gv.name_hint for gv in mod.get_global_vars()}
    assert {"sample", "apply_penalties", "tvmattn_sample", "tvmattn_apply_penalties", "feed_tokens",
            "tvmattn_feed_tokens"} <= names
    assert "feed_tokens" in document["functions"]


@pytest.mark.slow  # compiles the tiny library (shared with test_generate / test_speculative)
def test_a_compiled_library_samples_on_the_device(tiny_library):
    from tvmattn.models.export import read_metadata

    _, path = tiny_library
    device = tvm.cpu(0)
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), device)
    assert has_device_sampling(read_metadata(vm))
    vocab = 80
    logits = np.random.default_rng(14).normal(0, 1, (3, 1, vocab)).astype(np.float32)
    host = [Sampler(SamplingOptions(**o), vocab) for o in OPTION_SETS[:3]]
    dev = [Sampler(SamplingOptions(**o), vocab) for o in OPTION_SETS[:3]]
    got = DeviceSampler(vm, device).choose(tvm.runtime.tensor(logits, device), dev)
    assert [t for t, _ in got] == [h.choose(logits[i, 0])[0] for i, h in enumerate(host)]


def test_bench_sampling_checks_and_anchor_agree_with_the_kernel():
    """scripts/bench_sampling.py on the CPU build: each mode's parameters, and its kept sets
    hold every token the kernel and the torch anchor draw (greedy: the argmax alone), over many
    rows of a small vocabulary."""
    torch = pytest.importorskip("torch")
    bench = load_script("bench_sampling")
    sample = bench.build("llvm")
    rng = np.random.default_rng(31)
    rows, vocab = 200, 300
    logits = (2 * rng.standard_normal((rows, vocab))).astype(np.float32)
    for mode, (temperature, top_k, top_p) in bench.MODES.items():
        params = bench.params_for(mode, rows, rng)
        assert params.shape == (rows, 4) and (params[:, 1:] == np.float32([temperature, top_k, top_p])).all()
        tokens = tvm.runtime.tensor(np.zeros(rows, np.int32), tvm.cpu())
        sample(tvm.runtime.tensor(logits, tvm.cpu()), tvm.runtime.tensor(params, tvm.cpu()), tokens)
        allowed = bench.kept_sets(logits, mode)
        assert all(int(t) in s for t, s in zip(tokens.numpy(), allowed)), mode
        anchor = bench.torch_sampler(mode)(torch.from_numpy(logits)).numpy()
        assert all(int(t) in s for t, s in zip(anchor, allowed)), mode
        sizes = {len(s) for s in allowed}
        if mode == "top-p":
            assert 1 < min(sizes) and max(sizes) < vocab
        else:
            assert sizes == {{"greedy": 1, "temperature": vocab, "top-k": top_k}[mode]}
