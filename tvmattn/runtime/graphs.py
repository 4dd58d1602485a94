"""CUDA-graph decode: a whole decode step captured once per batch bucket and replayed.

A decode step launches hundreds of small kernels (every layer's matmuls, norms and attention);
at small batches the host takes longer to launch them than the GPU to run them. `DecodeGraphs`
captures the step (whatever the caller's `step(bucket)` launches on TVM's current stream,
including the cache's per-layer attention calls) into a CUDA graph and replays it, so no
Python and no VM instruction runs per layer during a replay.

What makes a replay valid for any sequences:
- Buckets: a batch of n sequences runs the graph of the smallest bucket >= n (1, 2, 4, ...,
  max_batch). Rows n..bucket-1 are padding: they append nothing (append position -1) and attend
  to one slot of page 0 (their outputs are junk and ignored).
- The plan lives at fixed addresses: `PagedKVCache.begin_graph_decode` plans the step (page
  tables, lengths, positions; no cascade) into a layout that depends only on the bucket
  (`graph_layout`: every array at a fixed offset, page indices last with a fixed capacity) in a
  device buffer of its own, uploaded with one copy before the replay. Kernels read lengths and
  page tables from it, so sequences of any length, added, removed, forked or popped between
  steps replay the same graph. Launch parameters that the graph freezes (grid sizes, split
  counts) depend on the bucket alone: the decode kernels choose split counts from the batch
  size and read lengths at run time.
- MHA_SLIDING layers (tvmattn.runtime.windows): their window level (one decode request per
  sequence over the sliding pages its window touches, at most `window_pages_per_row` pages
  each) and the new tokens' positions in their pages sit in the same layout, at fixed offsets
  with a page-index capacity of bucket * window_pages_per_row; their pages are taken and
  released (the window slides) by the host planning of each step, as in begin_forward, and
  padded rows append nothing there either.
- The caller's inputs and outputs stay put: the step reads its inputs from buffers the caller
  owns (fixed per bucket), and the outputs of the captured call are kept and rewritten by every
  replay. A model library's `decode_step` allocates its intermediates once per VM
  (models/pipeline.py lift_graph_storage). Bucket 1 runs the static `embed` + `decode` instead
  (tvmattn.session.library_decode_step: single-row GEMV kernels, faster for one row): their
  intermediates come from the VM's memory pool, freed after the capture and rewritten by each
  replay before they are read, so a replay is safe while no one holds a pool tensor across it
  (tvmattn.session and scripts/bench_e2e.py read each step's logits before the next step).
- TVM's workspace pool: the decode kernels take their split-KV partials from TVM's per-thread
  CUDA workspace pool, which frees a page only when a larger request comes. Before the first
  capture the cache runs its decode kernels at every batch size up to max_num_sequences
  (`PagedKVCache.reserve_decode_workspace`), so the pool holds pages of the largest sizes this
  cache asks for and never frees one a graph uses. A kernel outside this cache that asks the
  same thread's pool for more could still free one: run graphs from the thread that reserved.

Graphs are rebuilt, never replayed stale: each records the cache's graph-plan buffer (a new
one when the page capacity grows) and its kernels; a change of either recaptures. A new cache
(a new library or settings) needs a new `DecodeGraphs`. Memory held: one output set per
captured bucket and the plan buffer (`memory_bytes`), for at most len(buckets) graphs.

The CUDA runtime (`libcudart`, loaded by TVM) is reached through ctypes, as in upload.py.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import time
from typing import Any, Callable

import numpy as np
import tvm
import tvm_ffi

from .errors import KVCacheError
from .plan import ALIGN, ArraySpec, ForwardPlan, LevelArrays, PlanArrays
from .slides import ceildiv
from .upload import _load_cudart

_CAPTURE_MODE_RELAXED = 2  # cudaStreamCaptureModeRelaxed


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """The batch buckets of a graph set: powers of two below max_batch, then max_batch."""
    if max_batch < 1:
        raise KVCacheError(f"max_batch must be at least 1, got {max_batch}")
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return (*sizes, max_batch)


def bucket_of(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n."""
    for size in buckets:
        if size >= n:
            return size
    raise KVCacheError(f"a batch of {n} sequences exceeds the largest graph bucket {buckets[-1]}")


def window_pages_per_row(window: int, page_size: int) -> int:
    """Pages one decode query's window of `window` tokens touches at most (an MHA_SLIDING
    layer's request, tvmattn.runtime.windows)."""
    return ceildiv(window - 1, page_size) + 1


def graph_layout(bucket: int, page_capacity: int, sliding: bool, window_pages: int = 0) -> PlanArrays[ArraySpec]:
    """Where each array of a graph decode plan of `bucket` rows lies (int32 elements): fixed
    shapes, page indices last with room for `page_capacity` entries. window_pages > 0: the
    MHA_SLIDING layers' level too (page_indptr [bucket+1], length_info [3, bucket], k_offset
    [bucket], slide positions [bucket], page indices with room for bucket * window_pages,
    `window_pages_per_row`), placed before the main level's page indices."""
    offset = 0

    def place(shape: tuple) -> ArraySpec:
        nonlocal offset
        spec = ArraySpec(offset, shape)
        offset += -(-int(np.prod(shape)) // ALIGN) * ALIGN
        return spec

    info = (3, bucket) if sliding else (bucket,)
    q_positions, append_indptr, k_ragged_offset, append_positions = (
        place((bucket,)), place((bucket + 1,)), place((bucket,)), place((bucket,)))
    page_indptr, length_info, k_offset, history_info = place((bucket + 1,)), place(info), place((bucket,)), place(info)
    window, slide_positions = (), ()
    if window_pages:
        w_indptr, w_info, w_offset, slide = place((bucket + 1,)), place((3, bucket)), place((bucket,)), place((bucket,))
        window = (LevelArrays(w_indptr, place((bucket * window_pages,)), w_info, w_offset, None),)
        slide_positions = (slide,)
    page_indices = place((page_capacity,))
    level = LevelArrays(page_indptr, page_indices, length_info, k_offset, None)
    return PlanArrays(q_positions, append_indptr, k_ragged_offset, append_positions, (level,),
                      (level._replace(length_info=history_info),), (), window, slide_positions)


def layout_end(layout: PlanArrays[ArraySpec]) -> int:
    """Elements from the buffer's start to the end of the page-index capacity."""
    pages = layout.fused[0].page_indices
    return pages.offset + pages.shape[0]


def pad_decode_plan(plan: ForwardPlan, bucket: int, layout: PlanArrays[ArraySpec]) -> ForwardPlan:
    """A decode plan of n <= bucket sequences (one level, no cascade; in a cache with
    MHA_SLIDING layers their window level and slide positions too) padded to `bucket` rows in
    `layout`: padded rows append nothing and read one slot of page 0 (of the main pages, and of
    the sliding pages in the window level). The host buffer ends after the last used page index
    (the rest of the capacity is never read); the plan's host arrays are views of it, written in
    place (this runs every graph step: no intermediate arrays)."""
    host = plan.host
    (level,), (history,) = host.fused, host.cross
    n = len(plan.lengths)
    pad = bucket - n
    if not plan.decode or len(host.fused) != 1 or n > bucket:
        raise KVCacheError("a graph step needs a decode plan of one level with at most bucket sequences")
    if len(host.window) != len(layout.window):
        raise KVCacheError("a graph step's plan and layout disagree on the MHA_SLIDING layers' window level")
    levels = [(level, layout.fused[0], "")] + [(w, spec, "window ") for w, spec in zip(host.window, layout.window)]
    used = []  # page indices each level reads: its own, then one per padded row
    for values, spec, what in levels:
        nnz, capacity = int(values.page_indptr[-1]), spec.page_indices.shape[0]
        if nnz + pad > capacity:
            raise KVCacheError(f"the step reads {nnz + pad} {what}page indices, more than the graph plan's capacity "
                               f"{capacity}")
        used.append(nnz)
    main_pages = layout.fused[0].page_indices
    buffer = np.zeros(main_pages.offset + used[0] + pad, np.int32)  # (padding is mostly 0: page 0, offset 0)

    def view(spec: ArraySpec, size: int | None = None) -> np.ndarray:
        if size is not None:
            return buffer[spec.offset : spec.offset + size]
        return buffer[spec.offset : spec.offset + math.prod(spec.shape)].reshape(spec.shape)

    def rows(spec: ArraySpec, values: np.ndarray, fill: int) -> np.ndarray:
        """A [bucket] (or sliding-window length_info [3, bucket]) array: values, then fill in
        the padded rows (length_info: fill in its first row, last_page_len; 0 in the others)."""
        out = view(spec)
        out[..., :n] = values
        if fill:
            (out[0] if out.ndim == 2 else out)[n:] = fill
        return out

    def padded_level(values: LevelArrays, spec: LevelArrays, nnz: int) -> LevelArrays:
        """The level with one request per padded row, over one slot of page 0."""
        indptr = view(spec.page_indptr)
        indptr[: n + 1] = values.page_indptr
        indptr[n + 1 :] = nnz + np.arange(1, pad + 1, dtype=np.int32)
        indices = view(spec.page_indices, nnz + pad)
        indices[:nnz] = values.page_indices[:nnz]
        return LevelArrays(indptr, indices, rows(spec.length_info, values.length_info, 1),
                           rows(spec.k_offset, values.k_offset, 0), None)

    main = padded_level(level, layout.fused[0], used[0])
    window = tuple(padded_level(values, spec, nnz) for (values, spec, _), nnz in zip(levels[1:], used[1:]))
    slides = tuple(rows(spec, positions, -1) for spec, positions in zip(layout.slide_positions, host.slide_positions))
    append_indptr = view(layout.append_indptr)
    append_indptr[:] = np.arange(bucket + 1, dtype=np.int32)
    padded = PlanArrays(rows(layout.q_positions, host.q_positions, 0), append_indptr,
                        rows(layout.k_ragged_offset, host.k_ragged_offset, 0),
                        rows(layout.append_positions, host.append_positions, -1), (main,),
                        (main._replace(length_info=rows(layout.cross[0].length_info, history.length_info, 0)),),
                        (), window, slides)
    return ForwardPlan(plan.seq_ids, plan.lengths, bucket, True, False, buffer, layout, padded)


def empty_decode_plan(sliding: bool, window: bool = False) -> ForwardPlan:
    """The decode plan of no sequence (pad_decode_plan makes every row padding); window: with
    the MHA_SLIDING layers' (empty) window level."""
    empty = np.zeros(0, np.int32)
    info = np.zeros((3, 0), np.int32) if sliding else empty
    level = LevelArrays(np.zeros(1, np.int32), empty, info, empty, None)
    windows, slides = ((level._replace(length_info=np.zeros((3, 0), np.int32)),), (empty,)) if window else ((), ())
    host = PlanArrays(empty, np.zeros(1, np.int32), empty, empty, (level,), (level,), (), windows, slides)
    return ForwardPlan([], [], 0, True, False, np.zeros(0, np.int32), None, host)


class CudaRuntime:
    """The CUDA runtime calls of graph capture and replay (ctypes over libcudart)."""

    def __init__(self, cudart: ctypes.CDLL, device):
        self._rt = cudart
        self.device = device
        self.stream = ctypes.c_void_p()
        self._call("cudaSetDevice", device.index)
        self._call("cudaStreamCreate", ctypes.byref(self.stream))  # a blocking stream: ordered with stream 0

    @staticmethod
    def load(device) -> "CudaRuntime | None":
        cudart = _load_cudart()
        if cudart is None or not hasattr(cudart, "cudaStreamBeginCapture"):
            return None
        return CudaRuntime(cudart, device)

    def _call(self, name: str, *args) -> None:
        status = getattr(self._rt, name)(*args)
        if status != 0:
            self._rt.cudaGetLastError()
            raise RuntimeError(f"{name} failed with CUDA error {status}")

    def capture(self, run: Callable[[], Any]) -> tuple[ctypes.c_void_p, Any]:
        """Capture what run() launches on TVM's current stream (set to this runtime's stream)
        into an executable graph. Returns (graph exec, run's result)."""
        graph, graph_exec = ctypes.c_void_p(), ctypes.c_void_p()
        with tvm_ffi.use_raw_stream(self.device, self.stream.value):
            self._call("cudaStreamBeginCapture", self.stream, _CAPTURE_MODE_RELAXED)
            try:
                result = run()
            finally:
                status = self._rt.cudaStreamEndCapture(self.stream, ctypes.byref(graph))
            if status != 0:
                self._rt.cudaGetLastError()
                raise RuntimeError(f"cudaStreamEndCapture failed with CUDA error {status}: the step launched work "
                                   "that cannot be captured (a synchronizing copy or call?)")
        try:
            self._call("cudaGraphInstantiate", ctypes.byref(graph_exec), graph, ctypes.c_ulonglong(0))
        finally:
            self._rt.cudaGraphDestroy(graph)
        return graph_exec, result

    def launch(self, graph_exec: ctypes.c_void_p) -> None:
        self._call("cudaGraphLaunch", graph_exec, self.stream)

    def synchronize(self) -> None:
        self._call("cudaStreamSynchronize", self.stream)

    def destroy(self, graph_exec: ctypes.c_void_p) -> None:
        self._rt.cudaGraphExecDestroy(graph_exec)


@dataclasses.dataclass
class _Graph:
    exec: ctypes.c_void_p
    outputs: Any  # what the captured step returned: rewritten by every replay
    key: tuple  # the cache state it was captured against (see DecodeGraphs._key)
    output_bytes: int
    progress: tuple  # what its step's layers wrote through the cache (PagedKVCache._step_progress)


class DecodeGraphs:
    """Captured decode steps of one PagedKVCache on CUDA, one graph per batch bucket.

    step(bucket) must launch one decode step of `bucket` rows on TVM's current stream: read its
    inputs from buffers that stay at fixed addresses (the caller writes the real rows before
    `run`), call the cache's per-layer attention (attention_with_fused_qkv with q/k/v/o of
    `bucket` rows, or the tvmattn.* functions through a model library's `decode_step`) and
    return its outputs (tensors, or a tuple/list of them). `run(seq_ids)` begins the step in
    the cache, captures the bucket's graph on first use (the step runs once eagerly first, to
    load modules and allocate; the graph is then launched, which recomputes the same step and
    rewrites the same K/V slots), replays it afterwards, ends the step and returns the bucket's
    outputs (rows len(seq_ids).. are padding). The outputs are the same objects at every replay
    of a bucket: read them before the next run.
    """

    def __init__(self, cache, step: Callable[[int], Any], max_batch: int | None = None):
        if cache.device.dlpack_device_type() != tvm.cuda(0).dlpack_device_type():
            raise KVCacheError("CUDA graphs need a cache on a CUDA device")
        if cache.backend != "tir":
            raise KVCacheError(f"CUDA graphs run tvmattn's TIR kernels; this cache runs {cache.backend!r}")
        self.cache = cache
        self.step = step
        self.max_batch = max_batch or cache.options.max_num_sequences
        if self.max_batch > cache.options.max_num_sequences:  # the graph-plan buffer is sized for that many
            raise KVCacheError(f"max_batch={self.max_batch} exceeds the cache's max_num_sequences "
                               f"{cache.options.max_num_sequences}")
        self.buckets = buckets_for(self.max_batch)
        runtime = CudaRuntime.load(cache.device)
        if runtime is None:
            raise KVCacheError("CUDA graphs need the CUDA runtime (libcudart), which TVM did not load")
        self._runtime = runtime
        self._graphs: dict[int, _Graph] = {}
        self._reserved = None  # the graph-plan buffer generation the workspace was reserved for
        self.captures = 0  # graphs captured so far (recaptures included)
        self.replays = 0

    def _key(self) -> tuple:
        return self.cache.graph_state()

    def run(self, seq_ids) -> Any:
        """One decode step of `seq_ids` (one new token each, inputs already written) -> the
        bucket's outputs (see the class docstring)."""
        bucket = bucket_of(len(seq_ids), self.buckets)
        generation = self.cache.reserve_graph_plan(seq_ids, bucket)
        if self._reserved != generation:  # first use, or a new graph-plan buffer (page capacity)
            self.cache.reserve_decode_workspace()
            self._reserved = generation
        self.cache.begin_graph_decode(seq_ids, bucket)
        try:
            graph = self._graphs.get(bucket)
            if graph is not None and graph.key != self._key():
                self._drop(bucket)
                graph = None
            if graph is None:
                graph = self._capture(bucket)
            else:  # the replay runs the layers' launches the capture made through the cache
                self.cache._replay_progress(graph.progress)
            self._runtime.launch(graph.exec)
            self.replays += 1
        except BaseException:
            self.cache.cancel_forward()
            raise
        self.cache.end_forward()
        return graph.outputs

    def time_replays(self, bucket: int, count: int) -> float:
        """Seconds of GPU time per replay of the bucket's graph: `count` replays launched back to
        back, then one synchronize (no planning or upload between them, so the host never holds
        the GPU back). Each replay recomputes the last step of this bucket from the same inputs
        and plan and rewrites the same K/V slots with the same values, so the cache is unchanged.
        The bucket's graph must be current (run a step of it first)."""
        graph = self._graphs.get(bucket)
        if graph is None or graph.key != self._key():
            raise KVCacheError(f"no current graph of bucket {bucket}: run a decode step of that bucket first")
        if count < 1:
            raise KVCacheError(f"count must be at least 1, got {count}")
        self._runtime.launch(graph.exec)  # (a warm replay: the timed ones start from a busy stream)
        self._runtime.synchronize()
        start = time.perf_counter()
        for _ in range(count):
            self._runtime.launch(graph.exec)
        self._runtime.synchronize()
        return (time.perf_counter() - start) / count

    def _capture(self, bucket: int) -> _Graph:
        self.step(bucket)  # eager warm-up: loads modules, allocates the VM's storage and outputs
        progress = self.cache._step_progress()
        graph_exec, outputs = self._runtime.capture(lambda: self.step(bucket))
        graph = self._graphs[bucket] = _Graph(graph_exec, outputs, self._key(), _nbytes(outputs), progress)
        self.captures += 1
        return graph

    def _drop(self, bucket: int) -> None:
        graph = self._graphs.pop(bucket)
        self._runtime.destroy(graph.exec)

    def invalidate(self) -> None:
        """Drop every graph (they are captured again on next use)."""
        for bucket in list(self._graphs):
            self._drop(bucket)

    @property
    def memory_bytes(self) -> int:
        """Device bytes the graphs keep alive: their outputs and the cache's graph-plan buffer."""
        return sum(g.output_bytes for g in self._graphs.values()) + self.cache.graph_plan_bytes()

    def __del__(self):
        try:
            self.invalidate()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _nbytes(outputs) -> int:
    if isinstance(outputs, (tuple, list)) or type(outputs).__name__ == "Array":
        return sum(_nbytes(o) for o in outputs)
    if isinstance(outputs, tvm.runtime.Tensor):
        return int(np.prod(outputs.shape)) * np.dtype(str(outputs.dtype)).itemsize if outputs.dtype != "bfloat16" \
            else int(np.prod(outputs.shape)) * 2
    return 0
