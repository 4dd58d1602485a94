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
  - a request whose vocabulary is smaller than the logits' (padded LM heads),
  - rows the caller asks for whole (`host=`; the serving engine's kept logits).

A step is split so that the host waits on the device only for what it reads (the fallback
rows, when there are any, and the token ids), never to upload:
`prepare` (before the step's forward is launched) draws the uniforms and uploads the kernels'
parameters; `launch` (once the forward is queued) reads the fallback rows, queues the penalty
and sampling kernels and starts an asynchronous copy of the ids (CUDA: cudaMemcpyAsync into
pinned memory, then an event); `PendingChoices.wait` samples the fallback rows on the host,
which overlaps the kernels, and only then waits for the ids. On the CPU every call is
synchronous and the split changes nothing.

Non-finite logits: the `sample` kernel gives token NON_FINITE (-1) to a row holding a NaN or inf
logit; `wait` reports such rows (and fallback rows that are not finite) in
`StepChoices.non_finite`, so the caller fails the requests concerned without reading logits.
A library whose kernel predates that flag (`DeviceSampler.flags_non_finite` is False) is not
used for sampling by the serving engine.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import tvm
import tvm_ffi

from tir_kernels.sampling import NON_FINITE  # the kernel's token for a row holding a NaN or inf logit

from .runtime.upload import _load_cudart, make_uploader
from .sampling import Sampler, SamplingOptions, TokenLogprob

SAMPLING_FUNCTIONS = ("sample", "apply_penalties")
# a step's sampled ids written as the next step's input ids on the device (NON_FINITE as 0):
# exported beside them; libraries compiled before it lack it (ModelSession.feeds_tokens)
FEED_FUNCTION = "feed_tokens"
# The largest float32 below 1: a uniform draw in [0, 1) stays below 1 in float32.
_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))
_CUDA_MEMCPY_DEVICE_TO_HOST = 2
_CUDA_EVENT_DISABLE_TIMING = 2


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


class NonFiniteLogits(ValueError):
    """Rows of logits that hold a NaN or inf (`rows`: their indices)."""

    def __init__(self, rows: list[int]):
        super().__init__(f"logits rows {rows} are not finite")
        self.rows = rows


@dataclasses.dataclass
class StepChoices:
    """The choices of one step: choices[row] = (token, logprob record or None), None where the
    row had no sampler or is not finite; greedy[row]: the argmax of a row without a sampler (the
    lowest id among equal maxima; None for a row with one, or not finite), e.g. a verified draft
    node's; non_finite[row]: the row holds a NaN or inf (every row, sampled or not, is checked);
    on_device / on_host: the rows with a sampler chosen by the kernels / the host."""

    choices: list[tuple[int, TokenLogprob | None] | None]
    greedy: list[int | None]
    non_finite: list[bool]
    on_device: list[int]
    on_host: list[int]
    host_rows: dict[int, np.ndarray]  # the rows read whole (fallback and `host=` rows), before the penalties


@dataclasses.dataclass
class SamplingPlan:
    """What `prepare` made before the forward: which rows go where, and the kernels' inputs
    already on the device."""

    rows: int
    samplers: list[Sampler | None]
    masks: list[np.ndarray | None]
    on_device: list[int]
    on_host: list[int]
    copied: list[int]  # the rows read whole: on_host and the `host=` rows without a sampler
    params: Any  # device tensor [rows, 4] float32
    penalties: tuple[Any, Any] | None  # device tensors (token_ids [rows, m] int32, amounts [rows, m] float32)


class _SyncReadback:
    """The ids read back by a blocking copy (the CPU, or no CUDA runtime)."""

    def start(self, tokens, rows: int) -> Callable[[], np.ndarray]:
        return lambda: tokens.numpy()[:rows]


class _AsyncReadback:
    """The ids copied by cudaMemcpyAsync into pinned host memory on TVM's current stream, after
    the sampling kernel; an event marks the copy's end. Two slots alternate, so a step's copy
    may be started before the previous step's ids are read (lookahead steps); a read must come
    before its slot's next-but-one copy starts (a later read is refused)."""

    SLOTS = 2

    def __init__(self, cudart: ctypes.CDLL, device):
        self._rt, self._device = cudart, device
        self._buffers = [np.empty(0, np.int32) for _ in range(self.SLOTS)]
        self._events = [ctypes.c_void_p() for _ in range(self.SLOTS)]
        self._in_flight = [False] * self.SLOTS
        self._copies = 0  # copies started so far: copy k uses slot k % SLOTS
        for event in self._events:
            self._call("cudaEventCreateWithFlags", ctypes.byref(event), _CUDA_EVENT_DISABLE_TIMING)

    def _call(self, name: str, *args) -> None:
        status = getattr(self._rt, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} failed with CUDA error {status}")

    def _grow(self, slot: int, rows: int) -> None:
        if self._buffers[slot].size:
            self._call("cudaHostUnregister", ctypes.c_void_p(self._buffers[slot].ctypes.data))
        buffer = self._buffers[slot] = np.empty(max(rows, 1024), np.int32)
        self._call("cudaHostRegister", ctypes.c_void_p(buffer.ctypes.data), ctypes.c_size_t(buffer.nbytes), 0)

    def _wait(self, slot: int) -> None:
        if self._in_flight[slot]:
            self._call("cudaEventSynchronize", self._events[slot])
            self._in_flight[slot] = False

    def start(self, tokens, rows: int) -> Callable[[], np.ndarray]:
        copy, slot = self._copies, self._copies % self.SLOTS
        self._wait(slot)
        if rows > self._buffers[slot].size:
            self._grow(slot, rows)
        buffer = self._buffers[slot]
        stream = ctypes.c_void_p(tvm_ffi.get_raw_stream(self._device) or None)
        self._call("cudaSetDevice", self._device.index)
        self._call("cudaMemcpyAsync", ctypes.c_void_p(buffer.ctypes.data), ctypes.c_void_p(tokens.data_ptr()),
                   ctypes.c_size_t(4 * rows), _CUDA_MEMCPY_DEVICE_TO_HOST, stream)
        self._call("cudaEventRecord", self._events[slot], stream)
        self._in_flight[slot] = True
        self._copies += 1

        def read() -> np.ndarray:
            _ = tokens  # the device ids live until the copy has run
            if self._copies - copy > self.SLOTS:
                raise RuntimeError(f"the ids of copy {copy} were overwritten by copy {self._copies - 1}: read each "
                                   f"step's ids before starting {self.SLOTS} more")
            self._wait(slot)
            return buffer[:rows].copy()

        return read

    def __del__(self):
        try:
            for slot in range(self.SLOTS):
                self._wait(slot)
                if self._buffers[slot].size:
                    self._rt.cudaHostUnregister(ctypes.c_void_p(self._buffers[slot].ctypes.data))
                self._rt.cudaEventDestroy(self._events[slot])
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _make_readback(device):
    if device.dlpack_device_type() != tvm.cuda(0).dlpack_device_type():
        return _SyncReadback()
    cudart = _load_cudart()
    if cudart is None:
        return _SyncReadback()
    try:
        return _AsyncReadback(cudart, device)
    except (RuntimeError, AttributeError):
        return _SyncReadback()


class _Staging:
    """A device tensor reused from step to step (grown when a step needs more), written by the
    device's uploader (asynchronous on CUDA): a view of the first `shape` elements."""

    def __init__(self, device, dtype: str, uploader):
        self.device, self.dtype, self.uploader = device, dtype, uploader
        self.tensor = None

    def put(self, array: np.ndarray):
        """array (float32 or int32) on the device: a view of the staging tensor."""
        size = max(array.size, 1)
        if self.tensor is None or int(self.tensor.shape[0]) < size:
            self.tensor = tvm.runtime.empty((max(2 * size, 256),), "int32", self.device)
        self.write(array, self.tensor)
        return self.tensor._create_view(array.shape, self.dtype)

    def write(self, array: np.ndarray, tensor) -> None:
        """array's elements (as this staging's dtype) into the first elements of `tensor` (a
        device tensor of 4-byte elements) by the uploader."""
        if array.size:  # the uploaders copy int32 elements: the float32 bits travel as they are
            bits = np.ascontiguousarray(array, self.dtype).view(np.int32).reshape(-1)
            self.uploader.copy(bits, tensor._create_view(bits.shape, "int32"))


class PendingChoices:
    """A launched step (`DeviceSampler.launch`); `wait()` -> StepChoices. tokens: the `sample`
    kernel's output on the device (int32 [rows], NON_FINITE for a non-finite row; None when
    every row was read whole), which a next decode step may take as its input ids before the
    host has read them (ModelSession.decode_step)."""

    def __init__(self, plan: SamplingPlan, host_rows: dict[int, np.ndarray], read: Callable[[], np.ndarray] | None,
                 tokens=None):
        self._plan, self._host_rows, self._read = plan, host_rows, read
        self.tokens = tokens

    def wait(self) -> StepChoices:
        """Sample the fallback rows on the host (the kernels run meanwhile), then read the ids."""
        plan = self._plan
        out: list[tuple[int, TokenLogprob | None] | None] = [None] * plan.rows
        greedy: list[int | None] = [None] * plan.rows
        non_finite = [False] * plan.rows
        for i, row in self._host_rows.items():
            if not np.isfinite(row).all():
                non_finite[i] = True
            elif plan.samplers[i] is not None:
                out[i] = plan.samplers[i].choose(row, plan.masks[i])
            else:
                greedy[i] = int(np.argmax(row))
        if self._read is not None:
            tokens = self._read()
            for i in range(plan.rows):
                if i in self._host_rows:
                    continue
                if int(tokens[i]) == NON_FINITE:
                    non_finite[i] = True
                elif plan.samplers[i] is not None:
                    out[i] = (int(tokens[i]), None)
                else:
                    greedy[i] = int(tokens[i])
        return StepChoices(out, greedy, non_finite, list(plan.on_device), list(plan.on_host), self._host_rows)


class DeviceSampler:
    """A step's token choices by the library's sampling functions (module docstring).

    vm: a relax.VirtualMachine of a library with `has_device_sampling`; device: where its
    logits live."""

    def __init__(self, vm, device: tvm.runtime.Device):
        self._sample = vm["sample"]
        self._penalize = vm["apply_penalties"]
        self.device = device
        # an uploader each: a step's three copies never wait for one another's staging buffer
        self._params = _Staging(device, "float32", make_uploader(device))
        self._token_ids = _Staging(device, "int32", make_uploader(device))
        self._amounts = _Staging(device, "float32", make_uploader(device))
        self._readback = _make_readback(device)
        self._flags: bool | None = None

    @property
    def flags_non_finite(self) -> bool:
        """Whether the library's `sample` gives NON_FINITE to a NaN row (libraries compiled
        before the flag do not): one kernel call on a row of two logits, once."""
        if self._flags is None:
            logits = tvm.runtime.tensor(np.array([[np.nan, 0.0]], np.float32), self.device)
            params = tvm.runtime.tensor(np.array([[0.0, 0.0, 0.0, 1.0]], np.float32), self.device)
            self._flags = int(self._sample(logits, params).numpy()[0]) == NON_FINITE
        return self._flags

    def prepare(self, samplers: Sequence[Sampler | None], masks: Sequence[np.ndarray | None] | None = None,
                host: Sequence[bool] | None = None, vocab: int | None = None, params_at=None) -> SamplingPlan:
        """The plan of a step of len(samplers) rows, made before its logits exist: samplers[row]
        (None: no choice but the row's argmax, StepChoices.greedy, e.g. a draft tree's node, or
        a prompt chunk's row that is not its last; every row is checked for NaN), masks[row] (a
        grammar's allowed tokens, bool [vocab], or None), host[row] (True: the row is read whole,
        and its sampler, if any, chooses on the host); vocab: the logits' width (default: every
        sampler's own). Draws each device row's uniform and uploads the kernels' inputs;
        params_at: a device float32 tensor [rows, 4] to upload the `sample` parameters into (a
        graph that samples, ModelSession.graph_sample_params; its rows take no penalties)."""
        rows = len(samplers)
        masks = [None] * rows if masks is None else list(masks)
        if len(masks) != rows:
            raise ValueError(f"masks: expected one per row of logits ({rows}), got {len(masks)}")
        host = [False] * rows if host is None else list(host)
        if len(host) != rows:
            raise ValueError(f"host: expected one per row of logits ({rows}), got {len(host)}")
        on_device, on_host = [], []
        for i, s in enumerate(samplers):
            if s is None:
                continue
            if (not host[i] and served_on_device(s.options, masks[i])
                    and (vocab is None or s.vocab_size == vocab)):
                on_device.append(i)
            else:
                on_host.append(i)
        token_ids, amounts = penalty_rows(samplers, on_device, vocab or max(
            (s.vocab_size for s in samplers if s is not None), default=0))
        if params_at is not None:
            if tuple(params_at.shape) != (rows, 4) or str(params_at.dtype) != "float32":
                raise ValueError(f"params_at: expected a float32 tensor of shape ({rows}, 4), got "
                                 f"{params_at.dtype} {tuple(params_at.shape)}")
            if token_ids.shape[1]:
                raise ValueError(f"params_at: rows {np.flatnonzero((token_ids >= 0).any(1)).tolist()} have penalties, "
                                 "which must change the logits before they are sampled")
        penalties = None
        if token_ids.shape[1]:
            penalties = (self._token_ids.put(token_ids), self._amounts.put(amounts))
        if params_at is None:
            params = self._params.put(sample_params(samplers, on_device))
        else:
            params = params_at
            self._params.write(sample_params(samplers, on_device), params_at)
        copied = sorted(set(on_host) | {i for i in range(rows) if host[i]})
        return SamplingPlan(rows, list(samplers), masks, on_device, on_host, copied, params, penalties)

    def launch(self, plan: SamplingPlan, logits, sampled=None) -> PendingChoices:
        """Queue the step's sampling on `logits` (a float32 device tensor [rows, vocab] or
        [b, s, vocab], rows = b * s, as the library returned it): the fallback rows are read
        first (before the penalties change the device rows, in place), then the kernels and the
        ids' copy are queued. Every row goes through `sample` (greedy where it has no device
        sampler), so every row is checked for NaN. sampled: the ids [rows] int32 that `sample`
        already chose inside the step's graph with the plan's parameters (prepare's params_at):
        only their copy is queued."""
        vocab = int(logits.shape[-1])
        rows = int(np.prod([int(d) for d in logits.shape[:-1]]))
        if str(logits.dtype) != "float32":
            raise ValueError(f"logits must be float32, got {logits.dtype}")
        if rows != plan.rows:
            raise ValueError(f"samplers: expected one per row of logits ({rows}), got {plan.rows}")
        for i in plan.on_device:
            if plan.samplers[i].vocab_size != vocab:
                raise ValueError(f"row {i}: its sampler's vocabulary {plan.samplers[i].vocab_size} differs from the "
                                 f"logits' {vocab}; prepare(vocab=) sends it to the host")
        flat = logits if len(logits.shape) == 2 else logits._create_view((rows, vocab))
        host_rows = {i: flat._create_view((vocab,), relative_byte_offset=i * vocab * 4).numpy() for i in plan.copied}
        read = tokens = None
        if sampled is not None:
            if tuple(sampled.shape) != (rows,) or str(sampled.dtype) != "int32":
                raise ValueError(f"sampled: expected an int32 tensor of shape ({rows},), got {sampled.dtype} "
                                 f"{tuple(sampled.shape)}")
            if plan.penalties is not None:
                raise ValueError("sampled: the plan has penalties, which the logits must take before sampling")
        if len(host_rows) < rows:
            if sampled is not None:
                tokens = sampled
            else:
                if plan.penalties is not None:
                    self._penalize(flat, *plan.penalties)
                tokens = self._sample(flat, plan.params)
            read = self._readback.start(tokens, rows)
        return PendingChoices(plan, host_rows, read, tokens)

    def choose(self, logits, samplers: Sequence[Sampler | None],
               masks: Sequence[np.ndarray | None] | None = None) -> list[tuple[int, TokenLogprob | None] | None]:
        """One choice per row of `logits` (a float32 device tensor [rows, vocab] or [b, s, vocab],
        rows = b * s, as the library returned it) for samplers[row] (None: no choice for that
        row, e.g. a prompt chunk that is not its last); masks[row]: the grammar's allowed tokens
        (bool [vocab]) or None. Returns (token, logprob record or None) per row, None where the
        sampler is None. The device rows' logits are penalized in place; the caller still calls
        each request's `Sampler.accept` with the token it emits. NonFiniteLogits when a row
        holds a NaN or inf."""
        vocab = int(logits.shape[-1])
        rows = int(np.prod([int(d) for d in logits.shape[:-1]]))
        if len(samplers) != rows:
            raise ValueError(f"samplers: expected one per row of logits ({rows}), got {len(samplers)}")
        step = self.launch(self.prepare(samplers, masks, vocab=vocab), logits).wait()
        bad = [i for i, flag in enumerate(step.non_finite) if flag]
        if bad:
            raise NonFiniteLogits(bad)
        return step.choices
