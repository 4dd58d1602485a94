"""Benchmark one decode step of tvmattn's PagedKVCache beside TVM's C++ paged KV cache.

A decode step of a decoder model: begin_forward (every sequence appends one token),
attention_with_fused_qkv on every layer, end_forward. Three caches run the same inputs:
  - tvmattn:       tvmattn.PagedKVCache (Python) with its default tir_kernels;
  - tvm-cpp+tvm:   TVM's C++ cache (vm.builtin.paged_attention_kv_cache_create) with TVM's
                   own TIR kernels from tvm.relax.frontend.nn.llm, chosen as TVM's
                   TIRPagedKVCache chooses them;
  - tvm-cpp+ours:  TVM's C++ cache with tir_kernels' kernels (as in tests/test_interop.py);
  - tvmattn-ffi:   tvmattn.PagedKVCache called through its `tvmattn.*` global functions (a
                   Shape of ids and lengths to begin_forward; every per-layer call crosses the
                   FFI into Python), as a model library's VM calls it (not run by default).
Each cache is filled by prefill (chunks of whole sequences) with the same qkv, then runs
warm-up and timed decode steps. Host time is the CPU clock around the step's calls without
synchronizing (planning + launches); wall time synchronizes the device before and after.
Reported: medians over the timed steps. The first decode step's outputs of every layer must
agree between the caches, else the run fails.

    python scripts/bench_cache.py                 # H200: 32 layers, 32/8 heads, d 128, fp16, page 16
    python scripts/bench_cache.py --device cpu    # tiny smoke run on the CPU
    python scripts/bench_cache.py --device host   # host paths only: the CPU, kernels without bodies
    python scripts/bench_cache.py --workloads 1x1024 --steps 50 --caches tvmattn,tvm-cpp+tvm
    python scripts/bench_cache.py --json cache.json   # also the rows of docs/bench-format.md
    python scripts/bench_cache.py --device host --layers 30 --workloads 1x512,16x512,64x512 \
        --caches tvm-cpp+tvm,tvmattn,tvmattn-ffi      # SmolLM2's 30 layers, as bench_e2e drives them

`--device host` times the host paths alone, on the CPU: every kernel of every cache is compiled
with its body removed (`null_kernel`: the same arguments and argument checks, no work), at the
H200 preset's layers and workloads (fewer heads, a smaller head dim: pages stay small; the host
path does not depend on them). No outputs are compared there. `--layers N` times a model of N
layers instead of the preset's.

--json PATH writes a row per cache and workload (`make_row`): bench "cache", kernel "step", impl the
cache's name above, batch, seq_len (the context), qo_len 1, ms (wall, median), host_ms (median),
max_abs_diff against the baseline cache (tvm-cpp+tvm, where it ran), and the model's shape. The rows
measured so far are written even when the run fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tvm  # noqa: E402
from tvm.relax.frontend.nn.llm import kv_cache as tvm_kv  # noqa: E402
from tvm.relax.frontend.nn.llm.position_embedding import llama_rope_with_position_map  # noqa: E402
from tvm.runtime import ShapeTuple  # noqa: E402
from tvm.s_tir import dlight  # noqa: E402

import bench_rows  # noqa: E402
from tir_kernels import AttentionConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The attention shape of the model whose decode step is timed."""

    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    rope_mode: str = "normal"
    rope_theta: float = 1e4
    rope_scale: float = 1.0

    @property
    def qkv_heads(self) -> int:
        return self.num_qo_heads + 2 * self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def describe(self) -> str:
        return (f"{self.num_layers} layers, {self.num_qo_heads}/{self.num_kv_heads} heads, d {self.head_dim}, "
                f"{self.dtype}, page {self.page_size}, RoPE {self.rope_mode}")


@dataclasses.dataclass(frozen=True)
class Workload:
    """`batch` sequences of `context` cached tokens each, decoding one token per step."""

    batch: int
    context: int

    @classmethod
    def parse(cls, text: str) -> "Workload":
        batch, context = (int(x) for x in text.lower().split("x"))
        return cls(batch, context)

    def __str__(self) -> str:
        return f"{self.batch}x{self.context}"


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    warmup: int = 5
    steps: int = 20
    prefill_chunk: int = 4096
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Preset:
    device: Callable[[], tvm.runtime.Device]
    model: ModelShape
    workloads: tuple[Workload, ...]
    options: BenchOptions
    tolerance: float  # max |diff| allowed between the caches' first-step outputs
    null_kernels: bool = False  # kernels without bodies: host time only, outputs not compared


PRESETS = {
    "cuda": Preset(lambda: tvm.cuda(0), ModelShape(32, 32, 8, 128, "float16", 16),
                   (Workload(1, 1024), Workload(32, 1024), Workload(256, 512)), BenchOptions(), 2e-2),
    "cpu": Preset(tvm.cpu, ModelShape(2, 4, 2, 32, "float16", 16),
                  (Workload(1, 40), Workload(4, 24)), BenchOptions(warmup=1, steps=3, prefill_chunk=64), 2e-2),
    "host": Preset(tvm.cpu, ModelShape(32, 4, 1, 32, "float16", 16),
                   (Workload(1, 1024), Workload(32, 1024), Workload(256, 512)), BenchOptions(steps=50), 0.0,
                   null_kernels=True),
}


def null_kernel(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """`func` without its body: a call checks the same arguments and does no work."""
    return func.with_body(tvm.tirx.Evaluate(tvm.tirx.const(0, "int32")))


def use_null_kernels() -> None:
    """Every kernel compiled from here on (TVM's here, tvmattn's through tir_kernels.build) has
    no body (for the host preset; process-wide)."""
    import tir_kernels

    global _NULL_KERNELS
    _NULL_KERNELS = True
    real_build = tir_kernels.build
    tir_kernels.build = lambda func, config: real_build(null_kernel(func), config)


_NULL_KERNELS = False


# ---------------------------------------------------------------------------------------------
# Caches under test: one interface over the Python cache and TVM's C++ one.


class StepCache(Protocol):
    def add_sequence(self, seq_id: int) -> None: ...
    def batch_args(self, seq_ids: list[int], lengths: list[int]) -> tuple: ...
    def begin_forward(self, *batch_args) -> None: ...
    def attention(self, layer: int, qkv: tvm.runtime.Tensor, o: tvm.runtime.Tensor) -> None: ...
    def end_forward(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class CacheSize:
    max_num_sequences: int
    max_total_seq_len: int
    prefill_chunk_size: int


class PythonCache:
    """tvmattn.PagedKVCache."""

    def __init__(self, model: ModelShape, size: CacheSize, target: str, device: tvm.runtime.Device):
        from tvmattn import PagedKVCache

        del target  # the cache builds its kernels for `device`
        self.sm_scale = model.sm_scale
        self.cache = PagedKVCache(
            num_layers=model.num_layers, num_qo_heads=model.num_qo_heads, num_kv_heads=model.num_kv_heads,
            qk_head_dim=model.head_dim, dtype=model.dtype, page_size=model.page_size,
            max_num_sequences=size.max_num_sequences, max_total_seq_len=size.max_total_seq_len,
            prefill_chunk_size=size.prefill_chunk_size, rope_mode=model.rope_mode, rope_scale=model.rope_scale,
            rope_theta=model.rope_theta, device=device)

    def add_sequence(self, seq_id: int) -> None:
        self.cache.add_sequence(seq_id)

    def batch_args(self, seq_ids, lengths) -> tuple:
        return list(seq_ids), list(lengths)

    def begin_forward(self, seq_ids, lengths) -> None:
        self.cache.begin_forward(seq_ids, lengths)

    def attention(self, layer, qkv, o) -> None:
        self.cache.attention_with_fused_qkv(layer, self.sm_scale, qkv, o)

    def end_forward(self) -> None:
        self.cache.end_forward()


class FfiPythonCache(PythonCache):
    """tvmattn.PagedKVCache through its registered `tvmattn.*` functions, as the Relax VM of a
    model library calls them (the step's ids and lengths as Shapes)."""

    def __init__(self, model: ModelShape, size: CacheSize, target: str, device: tvm.runtime.Device):
        import tvmattn  # noqa: F401 - registers tvmattn.*

        super().__init__(model, size, target, device)
        self._begin = tvm.get_global_func("tvmattn.kv_state_begin_forward")
        self._attention = tvm.get_global_func("tvmattn.attention_kv_cache_attention_with_fused_qkv")
        self._end = tvm.get_global_func("tvmattn.kv_state_end_forward")

    def batch_args(self, seq_ids, lengths) -> tuple:
        return ShapeTuple(seq_ids), ShapeTuple(lengths)

    def begin_forward(self, seq_ids, lengths) -> None:
        self._begin(self.cache, seq_ids, lengths)

    def attention(self, layer, qkv, o) -> None:
        self._attention(self.cache, layer, self.sm_scale, qkv, o)

    def end_forward(self) -> None:
        self._end(self.cache)


@dataclasses.dataclass(frozen=True)
class CppKernels:
    """The kernels TVM's C++ cache takes (MHA, no sliding window, no tree attention)."""

    transpose_append: tvm.ffi.Function
    ragged_prefill: tvm.ffi.Function
    paged_prefill: tvm.ffi.Function
    paged_decode: tvm.ffi.Function
    merge_state: tvm.ffi.Function
    split_rotary: tvm.ffi.Function
    copy_single_page: tvm.ffi.Function
    debug_get_kv: tvm.ffi.Function
    compact_copy: tvm.ffi.Function


def cpp_create_args(model: ModelShape, size: CacheSize, kernels: CppKernels, device) -> list:
    """The 28 positional arguments of vm.builtin.paged_attention_kv_cache_create (paged_kv_cache.cc)."""
    from tvmattn.runtime.backends import RopeMode
    from tvmattn.runtime.ffi import AttnKind, CreateArgs

    return CreateArgs(
        cache_config=ShapeTuple([size.max_num_sequences, size.max_total_seq_len, size.prefill_chunk_size,
                                 model.page_size, 0]),
        layer_indptr=ShapeTuple([0, model.num_layers]),  # one pipeline stage
        num_qo_heads=model.num_qo_heads,
        num_kv_heads=model.num_kv_heads,
        qk_head_dim=model.head_dim,
        v_head_dim=model.head_dim,
        attn_kinds=ShapeTuple([int(AttnKind.MHA)] * model.num_layers),
        enable_kv_transfer=False,
        rope_mode=int(RopeMode.parse(model.rope_mode)),
        rope_scale=model.rope_scale,
        rope_theta=model.rope_theta,
        rope_ext_factors=None,
        init=tvm.runtime.empty((), model.dtype, device=device),  # dtype and device of the pages
        transpose_append_mha=kernels.transpose_append,
        transpose_append_mla=None,
        prefill_ragged=["tirx", kernels.ragged_prefill],
        prefill_paged=["tirx", kernels.paged_prefill],
        decode_paged=["tirx", kernels.paged_decode],
        prefill_paged_sliding=[],
        decode_paged_sliding=[],
        tree_paged=[],
        tree_ragged=[],
        mla_prefill=[],
        merge=[kernels.merge_state],
        split_rotary=kernels.split_rotary,
        copy_single_page=kernels.copy_single_page,
        debug_get_kv=kernels.debug_get_kv,
        compact_copy=kernels.compact_copy,
    ).positional()


def builtin(name: str) -> tvm.ffi.Function:
    return tvm.get_global_func(f"vm.builtin.{name}")


class CppCache:
    """TVM's C++ PagedAttentionKVCache, driven through its vm.builtin functions."""

    def __init__(self, model: ModelShape, size: CacheSize, kernels: CppKernels, device: tvm.runtime.Device):
        self.sm_scale = model.sm_scale
        self.handle = builtin("paged_attention_kv_cache_create")(*cpp_create_args(model, size, kernels, device))
        self._add = builtin("kv_state_add_sequence")
        self._begin = builtin("kv_state_begin_forward")
        self._attention = builtin("attention_kv_cache_attention_with_fused_qkv")
        self._end = builtin("kv_state_end_forward")

    def add_sequence(self, seq_id: int) -> None:
        self._add(self.handle, seq_id)

    def batch_args(self, seq_ids, lengths) -> tuple:
        return ShapeTuple(seq_ids), ShapeTuple(lengths)

    def begin_forward(self, seq_ids, lengths) -> None:
        self._begin(self.handle, seq_ids, lengths)

    def attention(self, layer, qkv, o) -> None:
        self._attention(self.handle, layer, self.sm_scale, qkv, o)

    def end_forward(self) -> None:
        self._end(self.handle)


# ---------------------------------------------------------------------------------------------
# Kernels for TVM's C++ cache


def _compile_tvm(func, target: tvm.target.Target):
    """Compile one of TVM's kernels; on CUDA the unscheduled ones (transpose-append,
    debug-get-kv, split-rotary) get dlight's fallback schedule, as TVM's own pipeline does."""
    module = tvm.IRModule({"main": null_kernel(func) if _NULL_KERNELS else func})
    if target.kind.name == "cuda":
        with target:
            module = dlight.ApplyDefaultSchedule(dlight.gpu.Fallback())(module)
    return tvm.compile(module, target=target)["main"]


@functools.cache
def tvm_kernels(model: ModelShape, target: str) -> CppKernels:
    """TVM's own kernels (tvm.relax.frontend.nn.llm), as TIRPagedKVCache picks them."""
    hq, hkv, d, dtype, ps = model.num_qo_heads, model.num_kv_heads, model.head_dim, model.dtype, model.page_size
    tgt = AttentionConfig(hq, hkv, d, dtype=dtype, page_size=ps, target=target).tvm_target()
    no_scaling: dict = {}
    if tgt.kind.name == "cuda":
        attention = dict(
            ragged_prefill=tvm_kv._attention_prefill_ragged(hkv, hq, d, d, dtype, no_scaling, tgt),
            paged_prefill=tvm_kv._attention_prefill(hkv, hq, d, dtype, False, no_scaling, tgt, ps),
            paged_decode=tvm_kv._attention_decode(hkv, hq, d, dtype, False, no_scaling, tgt, ps),
            merge_state=tvm_kv._merge_state_inplace(hq, d, dtype, tgt),
            copy_single_page=tvm_kv._copy_single_page(hkv, ps, d, dtype, tgt),
            compact_copy=tvm_kv._compact_kv_copy(hkv, d, dtype, tgt, ps),
        )
    else:
        attention = dict(
            ragged_prefill=tvm_kv._attention_prefill_ragged_cpu(hkv, hq, d, d, dtype, no_scaling),
            paged_prefill=tvm_kv._attention_prefill_cpu(hkv, hq, d, dtype, False, no_scaling, ps),
            paged_decode=tvm_kv._attention_decode_cpu(hkv, hq, d, dtype, False, no_scaling, ps),
            merge_state=tvm_kv._merge_state_inplace_cpu(dtype),
            copy_single_page=tvm_kv._copy_single_page_cpu(hkv, ps, d, dtype),
            compact_copy=tvm_kv._compact_kv_copy_cpu(hkv, d, dtype, ps),
        )
    funcs = dict(
        attention,
        transpose_append=tvm_kv._kv_cache_transpose_append(hkv, d, dtype, ps),
        debug_get_kv=tvm_kv._kv_cache_debug_get_kv(model.num_layers, hkv, d, dtype),
        split_rotary=llama_rope_with_position_map(model.rope_theta, model.rope_scale, d, hq, hkv, dtype, no_scaling),
    )
    return CppKernels(**{name: _compile_tvm(func, tgt) for name, func in funcs.items()})


def our_kernels(model: ModelShape, target: str) -> CppKernels:
    """tir_kernels' kernels for the same shapes: the ones tvmattn.PagedKVCache builds (and
    caches per process) for this model."""
    from tvmattn.runtime.kernels import default_kernels

    config = AttentionConfig(model.num_qo_heads, model.num_kv_heads, model.head_dim, dtype=model.dtype,
                             page_size=model.page_size, target=target, rope_theta=model.rope_theta,
                             rope_scale=model.rope_scale)
    ks = default_kernels(config, model.num_layers)
    return CppKernels(
        transpose_append=ks.transpose_append,
        ragged_prefill=ks.prefill_ragged[1],
        paged_prefill=ks.prefill_paged[1],
        paged_decode=ks.decode_paged[1],
        merge_state=ks.merge_state,
        split_rotary=ks.split_rotary,
        copy_single_page=ks.copy_single_page,
        debug_get_kv=ks.debug_get_kv,
        compact_copy=ks.compact_copy,
    )


CacheFactory = Callable[[ModelShape, CacheSize, str, tvm.runtime.Device], StepCache]
CACHES: dict[str, CacheFactory] = {
    "tvm-cpp+tvm": lambda model, size, target, dev: CppCache(model, size, tvm_kernels(model, target), dev),
    "tvm-cpp+ours": lambda model, size, target, dev: CppCache(model, size, our_kernels(model, target), dev),
    "tvmattn": PythonCache,
    "tvmattn-ffi": FfiPythonCache,
}
DEFAULT_CACHES = ("tvm-cpp+tvm", "tvm-cpp+ours", "tvmattn")
BASELINE = "tvm-cpp+tvm"


# ---------------------------------------------------------------------------------------------
# Inputs, filling, timing


class Inputs:
    """Deterministic qkv: a few prefill blocks (views of their first rows are used), one decode
    qkv per layer, and the output buffers."""

    NUM_PREFILL_BLOCKS = 3

    def __init__(self, model: ModelShape, batch: int, prefill_rows: int, device, seed: int):
        rng = np.random.default_rng(seed)

        def random(rows, heads):
            data = rng.standard_normal((rows, heads, model.head_dim)).astype(model.dtype)
            return tvm.runtime.tensor(data, device=device)

        self.model = model
        self.prefill_blocks = [random(prefill_rows, model.qkv_heads) for _ in range(self.NUM_PREFILL_BLOCKS)]
        self.prefill_out = tvm.runtime.empty((prefill_rows, model.num_qo_heads, model.head_dim), model.dtype, device)
        self.decode_qkv = [random(batch, model.qkv_heads) for _ in range(model.num_layers)]
        self.decode_out = [tvm.runtime.empty((batch, model.num_qo_heads, model.head_dim), model.dtype, device)
                           for _ in range(model.num_layers)]

    def prefill(self, index: int, rows: int) -> tuple[tvm.runtime.Tensor, tvm.runtime.Tensor]:
        m = self.model
        qkv = self.prefill_blocks[index % self.NUM_PREFILL_BLOCKS]
        return (qkv._create_view((rows, m.qkv_heads, m.head_dim), m.dtype, 0),
                self.prefill_out._create_view((rows, m.num_qo_heads, m.head_dim), m.dtype, 0))


def fill(cache: StepCache, model: ModelShape, workload: Workload, inputs: Inputs, chunk: int,
         device: tvm.runtime.Device) -> None:
    """Add the sequences and prefill `context` tokens into each, whole sequences per forward.

    The device is synchronized after every forward, as a serving engine does between steps (it
    samples from the logits). TVM's C++ cache relies on it: begin_forward uploads the step's
    index arrays into one reused device buffer on its copy stream (a non-blocking CUDA stream;
    only copy -> compute is synchronized), without waiting for the previous step's kernels, so
    back-to-back forwards race and its K/V come out corrupted, differently from run to run.
    tvmattn's upload (Tensor.copyfrom) synchronizes the stream by itself.
    """
    if workload.context > chunk:
        raise ValueError(f"context {workload.context} exceeds the prefill chunk {chunk}")
    per_forward = chunk // workload.context
    for seq_id in range(workload.batch):
        cache.add_sequence(seq_id)
    for step, first in enumerate(range(0, workload.batch, per_forward)):
        seq_ids = list(range(first, min(workload.batch, first + per_forward)))
        cache.begin_forward(*cache.batch_args(seq_ids, [workload.context] * len(seq_ids)))
        for layer in range(model.num_layers):
            cache.attention(layer, *inputs.prefill(step + layer, workload.context * len(seq_ids)))
        cache.end_forward()
        device.sync()


@dataclasses.dataclass(frozen=True)
class Measurement:
    cache: str
    workload: Workload
    host_ms: float  # medians
    wall_ms: float
    first_outputs: tuple  # per layer [batch, Hq, D] numpy, from the first decode step


def time_decode(name: str, cache: StepCache, model: ModelShape, workload: Workload, inputs: Inputs,
                device: tvm.runtime.Device, options: BenchOptions) -> Measurement:
    args = cache.batch_args(list(range(workload.batch)), [1] * workload.batch)
    host, wall, first = [], [], ()
    for step in range(options.warmup + options.steps):
        device.sync()
        start = time.perf_counter()
        cache.begin_forward(*args)
        for layer in range(model.num_layers):
            cache.attention(layer, inputs.decode_qkv[layer], inputs.decode_out[layer])
        cache.end_forward()
        launched = time.perf_counter()
        device.sync()
        done = time.perf_counter()
        if step == 0:
            first = tuple(o.numpy() for o in inputs.decode_out)
        if step >= options.warmup:
            host.append((launched - start) * 1e3)
            wall.append((done - start) * 1e3)
    return Measurement(name, workload, statistics.median(host), statistics.median(wall), first)


def bench_workload(model: ModelShape, workload: Workload, caches: Sequence[str], target: str,
                   device: tvm.runtime.Device, options: BenchOptions) -> list[Measurement]:
    """Fill and time each cache in turn (one at a time on the device) on the same inputs."""
    steps = options.warmup + options.steps
    # Capacity in whole pages per sequence (each sequence rounds up to a page), plus one spare.
    pages_per_seq = -(-(workload.context + steps + 1) // model.page_size) + 1
    size = CacheSize(max_num_sequences=workload.batch,
                     max_total_seq_len=workload.batch * pages_per_seq * model.page_size,
                     prefill_chunk_size=options.prefill_chunk)
    per_forward = max(1, options.prefill_chunk // workload.context)
    inputs = Inputs(model, workload.batch, per_forward * workload.context, device, options.seed)
    results = []
    for name in caches:
        cache = CACHES[name](model, size, target, device)
        fill(cache, model, workload, inputs, options.prefill_chunk, device)
        results.append(time_decode(name, cache, model, workload, inputs, device, options))
        del cache
    return results


def max_output_diff(a: Measurement, b: Measurement) -> float:
    return max(float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
               for x, y in zip(a.first_outputs, b.first_outputs))


def check_agreement(results: list[Measurement], tolerance: float) -> list[str]:
    """Lines giving the max |diff| of every pair of caches' first-step outputs, each marked
    DISAGREE when over `tolerance` (or NaN); the caller fails the run after printing them."""
    lines = []
    for i, first in enumerate(results):
        for other in results[i + 1 :]:
            diff = max_output_diff(first, other)
            verdict = "" if diff <= tolerance else f"  DISAGREE (> {tolerance})"
            lines.append(f"{other.workload}: {other.cache} vs {first.cache}: max |diff| {diff:.2e}{verdict}")
    return lines


def format_table(model: ModelShape, options: BenchOptions, results: list[Measurement]) -> str:
    """ms per decode step (host / wall) and the speed-up over the baseline cache (its time / ours)."""
    baselines = {r.workload: r for r in results if r.cache == BASELINE}
    header = f"{'batch x ctx':>12} {'cache':>14} {'host ms':>9} {'wall ms':>9} {'host x':>7} {'wall x':>7}"
    lines = [f"decode step: {model.describe()}; median of {options.steps} steps after {options.warmup} warm-up",
             f"(x = {BASELINE} time / this cache's time; > 1 is faster than TVM's C++ cache with its own kernels)",
             header, "-" * len(header)]
    for r in results:
        base = baselines.get(r.workload)
        speed_host = f"{base.host_ms / r.host_ms:7.2f}" if base else f"{'-':>7}"
        speed_wall = f"{base.wall_ms / r.wall_ms:7.2f}" if base else f"{'-':>7}"
        lines.append(f"{str(r.workload):>12} {r.cache:>14} {r.host_ms:9.3f} {r.wall_ms:9.3f} {speed_host} {speed_wall}")
    return "\n".join(lines)


def make_row(model: ModelShape, options: BenchOptions, r: Measurement, target: str, meta: dict,
             baseline: Measurement | None = None) -> dict:
    """One row of docs/bench-format.md for a measured decode step; max_abs_diff: of its
    first-step outputs against `baseline`'s (left out without one)."""
    row = {"bench": "cache", "kernel": "step", "impl": r.cache, "variant": target, "dtype": model.dtype,
           "num_layers": model.num_layers, "head_dim": model.head_dim, "num_qo_heads": model.num_qo_heads,
           "num_kv_heads": model.num_kv_heads, "page_size": model.page_size, "batch": r.workload.batch,
           "seq_len": r.workload.context, "qo_len": 1, "ms": r.wall_ms, "host_ms": r.host_ms,
           "steps": options.steps, "warmup": options.warmup}
    if baseline is not None:
        row.update(max_abs_diff=max_output_diff(r, baseline), reference=baseline.cache)
    row.update(meta)
    return row


def run(preset: Preset, workloads: Sequence[Workload], caches: Sequence[str], options: BenchOptions,
        rows: list | None = None) -> str:
    """Benchmark every workload; returns the report (table + agreement lines). With a list for
    `rows`, each workload's rows (`make_row`) are appended to it as soon as it is measured."""
    from tvmattn.runtime.cache import target_for

    device = preset.device()
    target = target_for(device)  # the kernels' target, as tvmattn.PagedKVCache picks it
    if preset.null_kernels:
        use_null_kernels()
    variant = f"{target}, null kernels" if preset.null_kernels else target
    meta = bench_rows.run_meta(gpu=target != "llvm") if rows is not None else {}
    results, agreement = [], []
    for workload in workloads:
        measured = bench_workload(preset.model, workload, caches, target, device, options)
        if rows is not None:
            baseline = next((r for r in measured if r.cache == BASELINE), None)
            rows += [make_row(preset.model, options, r, variant, meta,
                              None if r is baseline or preset.null_kernels else baseline) for r in measured]
        if not preset.null_kernels:
            agreement += check_agreement(measured, preset.tolerance)
        results += measured
    outputs = ["first-step outputs:", *agreement] if not preset.null_kernels else ["(null kernels: host time only)"]
    report = "\n".join([format_table(preset.model, options, results), "", *outputs])
    if any("DISAGREE" in line for line in agreement):
        raise RuntimeError(report + "\nfirst-step outputs disagree")
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=sorted(PRESETS), default="cuda")
    parser.add_argument("--workloads", help="comma-separated BATCHxCONTEXT (default: the preset's)")
    parser.add_argument("--caches", default=",".join(DEFAULT_CACHES), help=f"comma-separated subset of {list(CACHES)}")
    parser.add_argument("--layers", type=int, help="layers of the model (default: the preset's)")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--prefill-chunk", type=int)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON (docs/bench-format.md)")
    args = parser.parse_args(argv)
    problem = bench_rows.output_path_problem(args.json)
    if problem:
        parser.error(f"argument --json: {problem}")
    preset = PRESETS[args.device]
    if args.layers is not None:
        if args.layers < 1:
            parser.error(f"argument --layers: expected a positive number, got {args.layers}")
        preset = dataclasses.replace(preset, model=dataclasses.replace(preset.model, num_layers=args.layers))
    options = dataclasses.replace(preset.options, **{k: v for k, v in dict(
        warmup=args.warmup, steps=args.steps, prefill_chunk=args.prefill_chunk).items() if v is not None})
    workloads = [Workload.parse(w) for w in args.workloads.split(",")] if args.workloads else preset.workloads
    caches = args.caches.split(",")
    unknown = [c for c in caches if c not in CACHES]
    if unknown:
        parser.error(f"unknown caches {unknown}; choose from {list(CACHES)}")
    if not args.json:
        print(run(preset, workloads, caches, options))
        return
    rows: list[dict] = []
    try:
        report = run(preset, workloads, caches, options, rows)
    except BaseException:
        if rows:
            bench_rows.write_rows(rows, args.json)
        raise
    print(report)
    bench_rows.write_rows(rows, args.json)


if __name__ == "__main__":
    main()
