"""`PagedKVCache`: the paged K/V pools of a model's attention layers and the sequences in them.

Owns the device pools (one tensor per layer, `[num_pages, 2, Hkv, page_size, D]`, index 0 =
K, 1 = V; in an MLA cache `[num_pages, page_size, qk_head_dim]`, one latent row per token;
an MHA_SLIDING layer's has `sliding_pool_pages`, see tvmattn.runtime.slides), the page
allocators and sequence table, the kernels, and the forward step in progress.
Sequence operations change the host bookkeeping (and copy pages on the device when a fork
or a copy-on-write needs it); `begin_forward` plans a step on the host and uploads its
index arrays with one copy; the per-layer attention calls check their arguments and launch.

Semantics follow TVM's C++ cache (paged_kv_cache.cc), with these choices:
- a sequence with a sliding window keeps `sink_size` tokens plus the most recent ones,
  `window_size` in all; the sink is exactly `sink_size` tokens even when the sequence shares
  pages with a fork (TVM instead pins every shared prefix block);
- a cache with `support_sliding_window` applies RoPE "normal" as "inline" (in the attention
  kernels, at positions within the cache), as TVM does, since cached keys move when the
  window slides;
- a forward step is a transaction (see PagedKVCache, "Forward steps are transactions"):
  end_forward keeps it only when every layer wrote its K/V, and a step abandoned in any way
  (cancel_forward, a new begin_forward, remove/fork/popn/clear, a failed launch) is rolled
  back; TVM keeps whatever a step reserved. A sliding window therefore slides when a step is
  kept (at end_forward), not at begin_forward;
- token trees (`begin_forward` with `token_tree_parent_ptr`) may grow over several forwards
  before a commit, which moves the accepted path into place with compact_copy (TVM's commit
  handles only trees appended in the last forward); trees that are not chains are refused in
  caches with support_sliding_window or inline RoPE (as TVM does), and a sequence with an
  uncommitted tree cannot be forked; a windowed sequence's window slides only when the path
  is committed, so it keeps exactly what appending the path one by one would keep;
- per-layer kinds (`attn_kinds`, TVM's AttnKind): MHA layers need `v_head_dim == qk_head_dim`;
  MHA_SLIDING layers attend to each token's last `layer_sliding_window_size` tokens in every
  step (tvmattn.runtime.windows; TVM does so in decode steps only) and keep only the tokens a
  future query's window reads, in pools and pages of their own (tvmattn.runtime.slides; TVM
  keeps every token in every layer), so popn / fork_pos cannot go back past what they
  released (KVCacheError) and debug_get_kv reads zeros there; a cache is either every
  layer MLA (tvmattn.runtime.mla: latent pages, append_mla_kv / self_attention /
  cross_attention, no token trees, no sliding windows, as in TVM) or MHA / MHA_SLIDING.
Every method validates its arguments before changing anything and raises KVCacheError (a call
that abandons a forward step in progress rolls the step back first, even when it then refuses
its own arguments).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from array import array

import numpy as np
import tvm
import tvm_ffi

from tir_kernels import AttentionConfig, RopeScaling
from tir_kernels.schedules import choose_prefill_schedule
from tir_kernels.support import (FP8_KV_DTYPES, cuda_arch_of, dtype_problem, is_fp8, kv_dtype_problem, numpy_dtype,
                                 page_size_problem)

from .backend_choice import attention_kernels
from .backends import (PagedDecode, PagedPrefill, PagedPrefillTreeMask, RaggedPrefill, RaggedPrefillTreeMask,
                       RopeMode, backend_from_spec, bind_workspace)
from .errors import KVCacheError, as_tensor, check, check_finite, check_int, check_tensor
from .forward import Kernels, Rope, Step, Workspace
from .graphs import empty_decode_plan, graph_layout, layout_end, pad_decode_plan, window_pages_per_row
from .kernels import DecodeByShape, Deferred, KernelSet, default_kernels, paged_slots
from .kinds import AttnKind, parse_attn_kinds
from .mla import MLAStep, check_mla_kernels, merge_for, mla_config, mla_kernel_set, ragged_for
from .pages import PageAllocator
from .slides import SlidingPages
from .plan import DeviceArrays, ForwardPlan, build_plan, build_plan_arrays, plan_size_bound, with_window
from .sequences import PageCopy, SequenceTable, TableArrays
from .trees import accepted_path, check_new_nodes, compact_copies, is_chain, tree_step
from .windows import WindowStep, window_plan, window_prefill_plan

log = logging.getLogger("tvmattn.cache")


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    """The configuration of a PagedKVCache (see PagedKVCache for each field)."""

    num_layers: int
    num_qo_heads: int
    num_kv_heads: int
    qk_head_dim: int
    v_head_dim: int | None = None
    dtype: str = "float16"
    page_size: int = 16
    max_num_sequences: int = 32
    max_total_seq_len: int = 4096
    prefill_chunk_size: int = 2048
    rope_mode: str = "none"
    rope_scale: float = 1.0
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | dict | None = None
    support_sliding_window: bool = False
    attn_kinds: tuple | None = None  # per layer AttnKind (None, or one kind: every layer)
    layer_sliding_window_size: int = 1024  # the window of MHA_SLIDING layers
    kv_dtype: str = ""  # the pages' element type ("" or dtype: the dtype; or an FP8 format)

    def __post_init__(self):
        for name in ("num_layers", "num_qo_heads", "num_kv_heads", "qk_head_dim", "max_num_sequences",
                     "max_total_seq_len", "prefill_chunk_size"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.qk_head_dim)
        object.__setattr__(self, "v_head_dim", check_int("v_head_dim", self.v_head_dim, 1))
        object.__setattr__(self, "attn_kinds", parse_attn_kinds(self.attn_kinds, self.num_layers))
        object.__setattr__(self, "layer_sliding_window_size",
                           check_int("layer_sliding_window_size", self.layer_sliding_window_size, 1))
        if self.is_mla:
            check(self.v_head_dim < self.qk_head_dim, f"v_head_dim={self.v_head_dim}: an MLA cache's v_head_dim is "
                  f"the latent width, less than qk_head_dim={self.qk_head_dim} (latent + rope)")
            check(not self.support_sliding_window, "support_sliding_window: MLA layers have no sliding windows "
                  "(as in TVM)")
        else:
            check(self.v_head_dim == self.qk_head_dim, f"v_head_dim={self.v_head_dim}: must equal qk_head_dim="
                  f"{self.qk_head_dim} for MHA layers (a v_head_dim below qk_head_dim is an MLA cache: "
                  'attn_kinds="mla")')
        check(self.num_qo_heads % self.num_kv_heads == 0,
              f"num_kv_heads={self.num_kv_heads} must divide num_qo_heads={self.num_qo_heads}")
        object.__setattr__(self, "page_size", check_int("page_size", self.page_size))
        for name, problem in (("dtype", dtype_problem), ("page_size", page_size_problem)):
            expected = problem(getattr(self, name))
            check(expected is None, f"{name} must be {expected}, got {getattr(self, name)!r}")
        if self.kv_dtype in (None, "", self.dtype):
            object.__setattr__(self, "kv_dtype", "")
        else:
            problem = kv_dtype_problem(self.kv_dtype)
            check(problem is None and is_fp8(self.kv_dtype),
                  f"kv_dtype must be {self.dtype!r} (the dtype) or an FP8 format {FP8_KV_DTYPES}, got {self.kv_dtype!r}")
        object.__setattr__(self, "rope_mode", RopeMode.parse(self.rope_mode).name.lower())
        for name in ("rope_scale", "rope_theta"):
            check(float(getattr(self, name)) > 0, f"{name} must be positive, got {getattr(self, name)!r}")
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "rope_scaling", _rope_scaling(self.rope_scaling))
        object.__setattr__(self, "support_sliding_window", bool(self.support_sliding_window))
        check(not (self.has_layer_windows and self.effective_rope_mode == RopeMode.INLINE),
              f"rope_mode={self.rope_mode!r}: MHA_SLIDING layers need RoPE applied before caching or by the model "
              "(inline RoPE, also what support_sliding_window turns \"normal\" into, is not supported with them)")

    @property
    def is_mla(self) -> bool:
        """Every layer is MLA."""
        return self.attn_kinds[0] == AttnKind.MLA

    @property
    def has_layer_windows(self) -> bool:
        """Some layer is MHA_SLIDING."""
        return AttnKind.MHA_SLIDING in self.attn_kinds

    @property
    def sequence_windows(self) -> bool:
        """Sequences may get sliding windows (support_sliding_window, which TVM turns off in a
        cache with MHA_SLIDING layers)."""
        return self.support_sliding_window and not self.has_layer_windows

    @property
    def kv_fp8(self) -> bool:
        """The pages hold FP8 codes (tir_kernels.kv_quant); each layer's pool has one page more,
        its last, holding the layer's scales."""
        return is_fp8(self.kv_dtype)

    @property
    def page_dtype(self) -> str:
        """The element type of the pages."""
        return self.kv_dtype or self.dtype

    @property
    def pool_pages(self) -> int:
        """Pages of each layer's pool: num_pages, plus the scale page of FP8 pools."""
        return self.num_pages + (1 if self.kv_fp8 else 0)

    @property
    def num_pages(self) -> int:
        """Pages per layer, as TVM sizes them: enough for max_total_seq_len tokens plus one,
        plus two per sequence with sliding windows (partly emptied pages)."""
        pages = -(-self.max_total_seq_len // self.page_size) + 1
        return pages + (2 * self.max_num_sequences if self.support_sliding_window else 0)

    @property
    def sliding_num_pages(self) -> int:
        """Pages of the MHA_SLIDING layers' own allocator (0 without such layers): what every
        sequence's window needs between steps (ceil((W - 1) / page_size) + 1 pages each) plus a
        step's new tokens (a prefill chunk, a page more per sequence), at most num_pages."""
        if not self.has_layer_windows:
            return 0
        window_pages = -(-(self.layer_sliding_window_size - 1) // self.page_size)
        bound = self.max_num_sequences * (window_pages + 2) + -(-self.prefill_chunk_size // self.page_size)
        return min(self.num_pages, bound)

    @property
    def sliding_pool_pages(self) -> int:
        """Pages of an MHA_SLIDING layer's pool: sliding_num_pages, a zero page (what
        debug_get_kv reads for released positions), and the scale page of FP8 pools."""
        return self.sliding_num_pages + 1 + (1 if self.kv_fp8 else 0)

    def layer_page_bytes(self) -> int:
        """Device bytes of one page of one layer's pool."""
        elem = numpy_dtype(self.page_dtype).itemsize
        if self.is_mla:
            return self.page_size * self.qk_head_dim * elem
        return self.num_kv_heads * self.page_size * (self.qk_head_dim + self.v_head_dim) * elem

    @property
    def effective_rope_mode(self) -> RopeMode:
        mode = RopeMode.parse(self.rope_mode)
        return RopeMode.INLINE if self.support_sliding_window and mode == RopeMode.NORMAL else mode

    def attention_config(self, target: str) -> AttentionConfig:
        try:
            return AttentionConfig(self.num_qo_heads, self.num_kv_heads, self.qk_head_dim, self.v_head_dim,
                                   dtype=self.dtype, page_size=self.page_size, target=target,
                                   rope_theta=self.rope_theta, rope_scale=self.rope_scale,
                                   rope_scaling=self.rope_scaling, kv_dtype=self.kv_dtype)
        except ValueError as error:
            raise KVCacheError(f"no kernels for this cache configuration: {error}") from None


def check_kv_scales(options: CacheOptions, scales) -> np.ndarray:
    """FP8 scales as float32 [num_layers, 2, num_kv_heads] (an MLA cache: [num_layers, 2, 1], index
    1: 0 = the latent columns, 1 = the rotary ones), broadcast from `scales`; each finite and
    positive (KVCacheError naming kv_scales otherwise)."""
    heads, names = (1, "[num_layers, 2, 1] (latent, rope)") if options.is_mla else (
        options.num_kv_heads, "[num_layers, 2, num_kv_heads]")
    shape = (options.num_layers, 2, heads)
    try:
        array = np.broadcast_to(np.asarray(scales, dtype=np.float64), shape).astype(np.float32)
    except (ValueError, TypeError):
        raise KVCacheError(f"kv_scales must broadcast to {names} = {list(shape)}, got "
                           f"shape {np.shape(scales)}") from None
    check(bool(np.isfinite(array).all() and (array > 0).all()), "kv_scales must be finite and positive")
    return np.ascontiguousarray(array)


def scale_page_pool(shape: tuple, page_dtype: str, scales) -> np.ndarray:
    """A zero pool of `shape` in page_dtype; with scales ([2, Hkv] float32) its last page holds
    them as tir_kernels.kv_quant reads them (4 little-endian bytes at [-1, kv, head, 0, 0:4]; an
    MLA pool [P, ps, D]: the latent scale at [-1, 0, 0:4], the rotary part's at [-1, 0, 4:8])."""
    pool = np.zeros(shape, dtype=numpy_dtype(page_dtype))
    if scales is not None and len(shape) == 3:
        pool.view(np.uint8)[-1, 0, :8] = np.asarray(scales, "<f4").reshape(2).view(np.uint8)
    elif scales is not None:
        pool.view(np.uint8)[-1, :, :, 0, :4] = np.asarray(scales, "<f4").reshape(2, -1, 1).view(np.uint8)
    return pool


def kv_bytes_per_token(options: CacheOptions) -> int:
    """Device bytes one cached token takes in a cache of `options`, over all layers: K and V
    rows (an MLA layer: one latent row) of the page dtype (FP8: one byte an element)."""
    elem = numpy_dtype(options.page_dtype).itemsize
    if options.is_mla:
        return options.num_layers * options.qk_head_dim * elem
    return options.num_layers * options.num_kv_heads * (options.qk_head_dim + options.v_head_dim) * elem


def _rope_scaling(value) -> RopeScaling | None:
    if value is None or isinstance(value, RopeScaling):
        return value
    if isinstance(value, dict):
        try:
            return RopeScaling.from_hf(value)
        except (KeyError, ValueError) as error:
            raise KVCacheError(f"rope_scaling {value!r} is not supported: {error}") from None
    raise KVCacheError(f"rope_scaling must be a RopeScaling, a Hugging Face dict or None, got {value!r}")


def target_for(device) -> str:
    """The tir_kernels target for a device: "cuda:sm_XY" for a CUDA GPU, "llvm" for the CPU."""
    kind = device.dlpack_device_type()
    if kind == 2:  # kDLCUDA
        arch = cuda_arch_of(device)
        return f"cuda:{arch}" if arch else "cuda"
    check(kind == 1, f"device {device} is not supported: expected a CPU or a CUDA device")
    return "llvm"


class PagedKVCache:
    """A paged KV cache for the attention layers of one model.

    Options (all keyword-only):
      num_layers, num_qo_heads, num_kv_heads, qk_head_dim, v_head_dim (= qk_head_dim): the model.
      dtype: of K/V, q, o ("float16", "bfloat16", "float32"); page_size: tokens per page (a
        power of two, at most 128).
      max_num_sequences: sequences the cache holds at once; max_total_seq_len: tokens it can hold
        (sets the number of pages, see CacheOptions.num_pages); prefill_chunk_size: most tokens
        one begin_forward may append.
      rope_mode: "none", "normal" (RoPE applied to q and k before K is cached) or "inline"
        (applied inside attention; K cached unrotated); rope_scale, rope_theta, rope_scaling
        (Llama-3 RopeScaling or a Hugging Face dict).
      support_sliding_window: sequences may get a sliding window with an attention sink.
      attn_kinds: per-layer kinds (TVM's AttnKind: "mha", "mla", "mha_sliding" or their
        integers), one for every layer or None (MHA). "mla" (every layer): pages
        [num_pages, page_size, qk_head_dim], qk_head_dim = latent + rope, v_head_dim = latent.
      layer_sliding_window_size: the window of "mha_sliding" layers (TVM's default, 1024).
      kv_dtype: the pages' element type: the dtype (default), or "float8_e4m3fn" / "float8_e5m2"
        (FP8 pages: half the bytes of fp16; K/V are stored as the codes of x / scale, saturated
        and rounded to nearest even, and read as code * scale; MHA layers only).
      kv_scales: the FP8 scales, float32 [num_layers, 2, num_kv_heads] (index 1: 0 = K, 1 = V;
        an MLA cache: [num_layers, 2, 1], 0 = the latent columns, 1 = the rotary ones),
        or anything numpy broadcasts to it (default 1.0, as vLLM's); `tvmattn.calibrate_kv_scales`
        computes them from prompts. set_kv_scales changes them while the cache is empty.
      device: a tvm.runtime.Device (default tvm.cpu()).
      kernels: optional overrides, slot name -> backend spec or function (see tvmattn.runtime.kernels);
        every other slot gets tvmattn's kernel for this configuration, built once per process.
        (A Python callable given as a kernel makes every attention_with_fused_qkv check its
        arguments in Python first; compiled kernels check them at entry.)
      backend: "tir" (tvmattn's kernels) or "flashinfer" (FlashInfer's modules, built by
        `python -m tvmattn.flashinfer.build`, in the prefill and decode slots; where FlashInfer
        cannot serve the cache it falls back to TIR with a logged warning, see
        runtime/backend_choice.py); `self.backend` says which one runs.

    Forward steps are transactions. begin_forward reserves a step's rows (pages, lengths, tree
    nodes); the layers' calls write them; end_forward keeps the step only when it is complete:
    every layer wrote the step's K/V (attention_with_fused_qkv on an MHA or MHA_SLIDING layer,
    append_mla_kv on an MLA layer; a call of attention_with_shared_kv stands for the layer
    that makes it, which reads another layer's K/V and writes none; self_attention and
    cross_attention write nothing). Then windows slide. Otherwise end_forward rolls the step
    back and raises KVCacheError naming the layers that did not write. Rolled back means
    exactly as before begin_forward: lengths, page tables, reference counts and the free list
    (in order), token trees, windows. So a row is only ever read once written: a step's
    attention reads the history and the rows its own layer appended, and rows a rolled-back
    step reserved (in pages that may hold another sequence's old K/V) are never attended.
    Calls while a step is in progress:
      - abandon it (roll it back, then do their work): cancel_forward, begin_forward and
        begin_graph_decode (a new step), remove_sequence, fork_sequence, popn (n counts the
        tokens from before the step), clear; and a per-layer call whose launch raised after
        its arguments were checked (later calls of the step are refused; end_forward raises
        once to say so);
      - are refused with KVCacheError, the step intact: a per-layer call with bad arguments
        (the layer may be called again), commit_accepted_token_tree_nodes and
        enable_sliding_window_for_seq (call end_forward first), debug_get_kv and
        debug_get_kv_mla (the step's rows are not all written), reserve_decode_workspace;
      - leave it going: add_sequence, the queries (lengths and pages include the step's
        reservation) and merge_attn_output_inplace.
    Outside a step, end_forward and cancel_forward do nothing.

    Threads: a cache is not thread-safe. It takes no locks; its methods (and the `tvmattn.*`
    functions over it) must be called from one thread at a time, as a model's forward calls
    them: begin_forward, the layers' attention calls, end_forward, in order. Serve several
    threads with one cache per thread, or a lock around each whole forward step. Distinct caches
    share nothing mutable (the compiled kernels they share are read-only) and may be used from
    different threads at once.
    """

    def __init__(self, *, num_layers: int, num_qo_heads: int, num_kv_heads: int, qk_head_dim: int,
                 v_head_dim: int | None = None, dtype: str = "float16", page_size: int = 16,
                 max_num_sequences: int = 32, max_total_seq_len: int = 4096, prefill_chunk_size: int = 2048,
                 rope_mode: str = "none", rope_scale: float = 1.0, rope_theta: float = 10000.0,
                 rope_scaling: RopeScaling | dict | None = None, support_sliding_window: bool = False,
                 attn_kinds=None, layer_sliding_window_size: int = 1024, kv_dtype: str = "", kv_scales=None,
                 device=None, kernels: dict | None = None, backend: str = "tir"):
        self.options = CacheOptions(num_layers, num_qo_heads, num_kv_heads, qk_head_dim, v_head_dim, dtype,
                                    page_size, max_num_sequences, max_total_seq_len, prefill_chunk_size,
                                    rope_mode, rope_scale, rope_theta, rope_scaling, support_sliding_window,
                                    attn_kinds, layer_sliding_window_size, kv_dtype)
        opts = self.options
        self._kv_scales = check_kv_scales(opts, 1.0 if kv_scales is None else kv_scales)
        self.device = tvm.cpu() if device is None else device
        self.target = target_for(self.device)
        self._kinds = opts.attn_kinds
        self._mla = self._window_decode = None
        if opts.is_mla:
            self._init_mla_kernels(backend, kernels)
        else:
            self.backend, kernels = attention_kernels(backend, opts, self.target, kernels)
            self.kernels: KernelSet = default_kernels(
                opts.attention_config(self.target), opts.num_layers, sliding_window=opts.sequence_windows,
                layer_windows=opts.has_layer_windows, overrides=kernels)
            self._step_kernels = self._check_kernels(self.kernels)
        k = self._step_kernels
        # MHA_SLIDING layers run prefill steps whose windows hide nothing with the paged prefill
        # kernel (runtime/windows.py) where it is TIR's (FlashInfer's would need a plan of its
        # own); on the CPU only where that kernel is the vectorized one (pages not FP8): the
        # scalar tile is slower there than the per-token sliding decode
        self._window_prefill = self._window_decode is not None and k.paged_prefill.kind == "tir" and \
            (self.target != "llvm" or choose_prefill_schedule(opts.attention_config(self.target)).vector_lanes > 0)
        self._backend_plans = self._planning_backends()  # run _begin_backends in _start_step
        self._flashinfer_workspace = bind_workspace((k.ragged, k.paged_prefill, k.paged_decode), self.device)
        self._rope = Rope(opts.effective_rope_mode, opts.rope_scale, opts.rope_theta)
        self._allocator = PageAllocator(opts.num_pages)
        # the MHA_SLIDING layers' pages: an allocator and smaller pools of their own (runtime/slides.py)
        self._slides = SlidingPages(opts.sliding_num_pages, opts.page_size, opts.layer_sliding_window_size) \
            if opts.has_layer_windows else None
        self._table = SequenceTable(self._allocator, opts.page_size, opts.max_num_sequences, opts.sequence_windows,
                                    self._slides)
        self._sliding_layers = [layer for layer, kind in enumerate(self._kinds) if kind == AttnKind.MHA_SLIDING]
        if opts.is_mla:
            page_shape = (opts.pool_pages, opts.page_size, opts.qk_head_dim)
        else:
            page_shape = (opts.pool_pages, 2, opts.num_kv_heads, opts.page_size, opts.qk_head_dim)
        self._pools = [self._zeros((opts.sliding_pool_pages, *page_shape[1:]) if kind == AttnKind.MHA_SLIDING
                                   else page_shape, layer) for layer, kind in enumerate(self._kinds)]
        # attention_with_fused_qkv's fast path: the MHA layers' pools, where every launch is a
        # compiled function, which checks its arguments (see that method; FlashInfer's modules and
        # Python callables given as kernels take the checked path)
        self._fast_pages = {} if self._backend_plans or not _compiled_launches(k) else {
            layer: pool for layer, (pool, kind) in enumerate(zip(self._pools, self._kinds)) if kind == AttnKind.MHA}
        self._workspace = Workspace(opts.prefill_chunk_size, opts.num_qo_heads, opts.num_kv_heads, opts.qk_head_dim,
                                    opts.v_head_dim, opts.dtype, self.device, split_qkv=not opts.is_mla)
        self._arrays = DeviceArrays(self.device)
        # CUDA-graph decode steps: a plan buffer of their own, created on first use (_graph_layout)
        self._graph_arrays: DeviceArrays | None = None
        self._graph_page_capacity = 0
        self._graph_layouts: dict = {}
        self._graph_generation = 0
        self._step: Step | None = None
        self._last_step: Step | None = None  # the last plain Step made (its launches serve repeats)
        self._rolled_back: str | None = None  # why the last step was rolled back by a failed launch
        self._num_layers = opts.num_layers
        self._shapes: dict = {}

    def _zeros(self, shape: tuple, layer: int) -> tvm.runtime.Tensor:
        """A zeroed pool of the page dtype; an FP8 pool's last page holds the layer's scales."""
        opts = self.options
        pool = tvm.runtime.empty(shape, opts.page_dtype, device=self.device)
        pool.copyfrom(scale_page_pool(shape, opts.page_dtype, self._kv_scales[layer] if opts.kv_fp8 else None))
        return pool

    @property
    def kv_scales(self) -> np.ndarray:
        """The FP8 scales, float32 [num_layers, 2, num_kv_heads] (a copy; 1.0 for unquantized pages)."""
        return self._kv_scales.copy()

    def set_kv_scales(self, scales) -> None:
        """Replace the FP8 scales ([num_layers, 2, num_kv_heads] or what broadcasts to it): only
        while the cache holds no sequence (stored codes would change meaning) and outside a step."""
        opts = self.options
        check(opts.kv_fp8, f"set_kv_scales: the pages are {opts.page_dtype}, not FP8 (kv_dtype)")
        check(self._step is None, "set_kv_scales: a forward step is in progress")
        check(len(self._table) == 0, "set_kv_scales: the cache holds sequences (remove them or clear() first)")
        scales = check_kv_scales(opts, scales)
        self._kv_scales = scales
        for layer, pool in enumerate(self._pools):
            pool.copyfrom(scale_page_pool(tuple(pool.shape), opts.page_dtype, scales[layer]))

    def bytes_per_token(self) -> int:
        """Device bytes one cached token takes over all layers (K and V pages)."""
        return kv_bytes_per_token(self.options)

    def _init_mla_kernels(self, backend: str, kernels: dict | None) -> None:
        """The kernels of an MLA cache (TIR only: FlashInfer's MLA modules are not built here)."""
        opts = self.options
        if backend != "tir":
            log.warning("backend %r not used for MLA layers: tvmattn runs them with its TIR kernels", backend)
        self.backend = "tir"
        config = mla_config(opts.num_qo_heads, opts.qk_head_dim, opts.v_head_dim, opts.dtype, opts.page_size,
                            self.target, opts.kv_dtype)
        self.kernels = mla_kernel_set(config, opts.num_layers, dict(kernels or {}))
        self._mla = check_mla_kernels(self.kernels)
        m = self._mla
        self._step_kernels = Kernels(m.ragged, m.prefill, m.decode, None, None, m.merge)

    def _check_kernels(self, kernels: KernelSet) -> Kernels:
        """The backends and functions a step runs; KVCacheError names a missing slot."""
        paged = paged_slots(self.options.sequence_windows)
        if self.options.has_layer_windows:
            self._window_decode = backend_from_spec(kernels.decode_paged_sliding_window, PagedDecode)
            check(self._window_decode is not None, "kernels: slot 'decode_paged_sliding_window' is empty, but the "
                  "cache's MHA_SLIDING layers run it")
            check(self._window_decode.kind == "tir", "kernels: slot 'decode_paged_sliding_window' must be a TIR "
                  "kernel (FlashInfer's modules have no window offsets)")
        roles = {"prefill_ragged": RaggedPrefill, paged[0]: PagedPrefill, paged[1]: PagedDecode}
        backends = {}
        for slot, role in roles.items():
            backends[slot] = backend_from_spec(getattr(kernels, slot), role)
            check(backends[slot] is not None, f"kernels: slot {slot!r} is empty, but this cache runs it")
        for slot in ("transpose_append", "split_rotary", "copy_single_page", "merge_state"):
            check(callable(getattr(kernels, slot)), f"kernels: slot {slot!r} must be a function, "
                  f"got {getattr(kernels, slot)!r}")
        fused = kernels.split_rotary_append
        check(fused is None or callable(fused),
              f"kernels: slot 'split_rotary_append' must be a function, got {fused!r}")
        decode_append = kernels.decode_append
        check(decode_append is None or callable(decode_append),
              f"kernels: slot 'decode_append' must be a function, got {decode_append!r}")
        # it computes the plain decode slot's attention, not a sliding-window cache's decode (a
        # replaced decode, FlashInfer's or TVM's, is not a TIRPagedDecode: Step's decode closure,
        # the one caller, then takes neither)
        if self.options.sequence_windows:
            decode_append = None
        return Kernels(backends["prefill_ragged"], backends[paged[0]], backends[paged[1]], kernels.split_rotary,
                       kernels.transpose_append, kernels.merge_state, split_rotary_append=fused,
                       decode_append=decode_append)

    # -- sequences
    def add_sequence(self, seq_id: int) -> None:
        """Add an empty sequence (inside a forward step too: the step goes on)."""
        self._table.add(seq_id)

    def remove_sequence(self, seq_id: int) -> None:
        """Remove a sequence and release its pages (inside a step: after rolling it back)."""
        self._abandon()
        self._table.remove(seq_id)

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int = -1) -> None:
        """Add `child_id` with the first `fork_pos` tokens of `parent_id` (-1: all of them).

        Full pages are shared; a partly filled page at the fork point is copied (every layer).
        A parent with a sliding window can only be forked within its sink (the child has no
        window), as in TVM. In a cache with MHA_SLIDING layers the fork point's window must be
        in the pages those layers keep (fork_pos >= the parent's released positions + W - 1,
        see runtime/slides.py), else KVCacheError. Inside a forward step: after rolling the
        step back.
        """
        self._abandon()
        copies = self._table.fork(parent_id, child_id, fork_pos)
        if copies:
            try:
                self._copy_pages(copies)
            except BaseException:
                self._table.remove(child_id)
                raise

    def popn(self, seq_id: int, n: int) -> None:
        """Remove the last `n` tokens of a sequence (it may then end inside a shared page; the
        next append copies that page first). Inside a forward step: after rolling it back, so
        n counts the tokens the sequence had before the step. In a cache with MHA_SLIDING
        layers, a popn to a length whose next query's window reaches tokens those layers have
        released is refused (KVCacheError, the sequence unchanged): they keep the window of
        the sequence's next query only (runtime/slides.py)."""
        self._abandon()
        self._table.popn(seq_id, n)

    def clear(self) -> None:
        """Remove every sequence (and the forward step in progress)."""
        self._abandon()
        self._table.clear()

    def enable_sliding_window_for_seq(self, seq_id: int, window_size: int, sink_size: int) -> None:
        """Keep only the first `sink_size` and the last `window_size - sink_size` tokens of the
        sequence (0 <= sink_size < window_size); the window slides as tokens are appended
        (when each forward step, or token-tree commit, is kept). Refused inside a forward step."""
        check(not self.options.has_layer_windows, "enable_sliding_window_for_seq: this cache has MHA_SLIDING layers "
              "(their window is layer_sliding_window_size); per-sequence windows are off in such a cache, as in TVM")
        self._refuse_in_step("enable_sliding_window_for_seq")
        self._table.enable_sliding_window(seq_id, window_size, sink_size)

    def _copy_pages(self, copies: list[PageCopy]) -> None:
        """Run page copies: each on the pools of its pages (PageCopy.sliding: the MHA_SLIDING
        layers', else the others')."""
        if not copies:  # (the usual step: no loop over the layers)
            return
        copy = self.kernels.copy_single_page
        for pool, kind in zip(self._pools, self._kinds):
            sliding = kind == AttnKind.MHA_SLIDING
            for src, dst, length, of_sliding in copies:
                if of_sliding == sliding:
                    copy(pool, src, dst, length)

    # -- forward
    def begin_forward(self, seq_ids, append_lengths, token_tree_parent_ptr=None) -> None:
        """Start a step that appends append_lengths[i] tokens to seq_ids[i].

        Plans every launch of the step on the host and uploads its index arrays with one copy.
        token_tree_parent_ptr: for speculative decoding, the parent of each new token within its
        sequence's token tree (-1: a root; parents before children; every sequence of the step
        gives its tokens' parents, an ordinary sequence a chain). A tree may grow over several
        steps; commit_accepted_token_tree_nodes then keeps one path. A node sees the history
        before its tree, its ancestors and itself; its RoPE position is the committed length
        plus its depth. A windowed sequence keeps every node until the commit (its window
        slides then), so any tree that fits in the free pages can be committed; what could not
        be run or committed is refused here: a tree that is not a chain in a cache with
        sliding windows or inline RoPE, a tree over MAX_TREE_NODES nodes, a step without
        enough free pages.

        A step in progress is rolled back first (it was abandoned); this step is kept by
        end_forward once every layer has written its K/V (see "Forward steps are transactions").
        """
        if self._step is not None or self._rolled_back is not None:
            self._abandon()
        seq_ids, lengths, steady = self._check_batch(seq_ids, append_lengths)
        page_size, sliding = self.options.page_size, self.options.sequence_windows
        if steady is not None and token_tree_parent_ptr is None:
            # the sequences of the last step, unchanged since (checked then): the usual decode step
            (seqs, tables), trees = steady, None
        else:
            check(token_tree_parent_ptr is None or not self.options.is_mla, "token_tree_parent_ptr: token trees are "
                  "not supported in an MLA cache (as in TVM)")
            seqs = self._sequences(seq_ids)
            trees = self._check_tree(seqs, lengths, token_tree_parent_ptr)
            tables = None
        masked = trees is not None and not all(is_chain(seq.tree + new) for seq, new in zip(seqs, trees))
        if masked:
            self._check_tree_support()
        nodes = sum(seq.tree_tokens for seq in seqs) + sum(lengths) if masked else 0
        try:  # (a failure after the reserve undoes it: no step, nothing changed)
            if tables is not None or (trees is None and not any(map(_WINDOW_SIZE, seqs))):
                # the usual step (no sliding window, no token tree): planned with numpy over the batch
                if tables is None:
                    tables = TableArrays.gather(seqs)
                self._arrays.reserve(plan_size_bound(len(tables.pages), lengths, page_size))
                batch, copies = self._table.reserve_plain(seqs, lengths, tables, seq_ids)
                self._copy_pages(copies)
                plan = build_plan_arrays(seq_ids, lengths, batch, page_size, sliding)
            else:
                pages = sum(len(seq.pages) for seq in seqs)
                self._arrays.reserve(plan_size_bound(pages, lengths, page_size, nodes))
                appended, copies = self._table.reserve(seqs, lengths, trees)
                self._copy_pages(copies)
                tree = None
                if masked:
                    tree = tree_step([a.seq.tree for a in appended],
                                     [a.seq.length - a.seq.tree_tokens for a in appended], lengths)
                plan = build_plan(seq_ids, appended, lengths, page_size, sliding, tree=tree)
            if self._slides is not None:  # the MHA_SLIDING layers' level, over their own pages
                window = self.options.layer_sliding_window_size
                if trees is None and max(lengths) > 1 and self._window_prefill and \
                        max(map(_LENGTH, seqs)) <= window:  # no window hides a key: tiled prefill
                    plan = with_window(plan, *window_prefill_plan(seqs, lengths, page_size))
                else:
                    plan = with_window(plan, *window_plan(seqs, lengths, window, page_size))
            self._start_step(plan, self._arrays)
        except BaseException:
            self._table.rollback_step()
            raise

    def _start_step(self, plan: ForwardPlan, device_arrays: DeviceArrays) -> None:
        """The backends' plan step, the upload, and the Step that the layers' calls run."""
        if self._backend_plans:
            self._begin_backends(plan)
        arrays = device_arrays.upload(plan)
        if self._shapes.get("n") != plan.total:
            self._shapes = self._step_shapes(plan.total)
        last = self._last_step
        if last is not None and last.repeats(plan, arrays, self._step_kernels):
            # a decode step of the last one's layout (the usual step): its prepared launches
            self._step = last.again(plan)
            return
        work = self._workspace.views(plan.total)
        if self._mla is not None:
            self._step = MLAStep(plan, arrays, self._step_kernels, work, self._rope, self._mla)
        elif plan.host.window:
            self._step = WindowStep(plan, arrays, self._step_kernels, work, self._rope, self._window_decode)
        else:
            self._step = self._last_step = Step(plan, arrays, self._step_kernels, work, self._rope)

    def _planning_backends(self) -> bool:
        """Some backend of a step has a plan step (FlashInfer's; TIR kernels have none)."""
        k = self._step_kernels
        backends = (k.ragged, k.paged_prefill, k.paged_decode, k.tree_paged, k.tree_ragged)
        return not self.options.is_mla and any(b is not None and b.kind != "tir" for b in backends)

    def end_forward(self) -> None:
        """Keep the step in progress: its tokens join their sequences (windows slide). Only a
        complete step is kept: one in which every layer wrote the step's K/V
        (attention_with_fused_qkv on an MHA or MHA_SLIDING layer, append_mla_kv on an MLA
        layer; each attention_with_shared_kv call stands for a layer that reads another's).
        Otherwise the step is rolled back and KVCacheError names the layers that did not write.
        Outside a step it does nothing, except to report (KVCacheError, once) a step that a
        failed launch rolled back."""
        step = self._step
        if step is None:
            reason, self._rolled_back = self._rolled_back, None
            if reason is not None:
                raise KVCacheError(f"end_forward: {reason}; nothing of the step was kept")
            return
        self._step = None
        if len(step.appended_layers) + step.shared_reads < self._num_layers:
            self._table.rollback_step()
            missing = [layer for layer in range(self._num_layers) if layer not in step.appended_layers]
            raise KVCacheError(f"end_forward: layers {missing} did not write this step's K/V (attention_with_fused_qkv"
                               "; append_mla_kv in an MLA cache), so the step was rolled back: its sequences are as "
                               "they were before begin_forward")
        self._table.commit_step()

    def cancel_forward(self) -> None:
        """Abandon the step in progress (if any): roll it back, so that every sequence, page and
        token tree is as it was before begin_forward."""
        self._abandon()

    def _abandon(self) -> None:
        """Roll back the step in progress, if any."""
        self._rolled_back = None
        if self._step is not None:
            self._step = None
            self._table.rollback_step()

    def _failed(self, step: Step, what: str, error: BaseException) -> None:
        """A launch of `step` raised (after its arguments were checked): its pages may hold part
        of a layer's rows, so the step is rolled back."""
        if self._step is step:
            self._step = None
            self._table.rollback_step()
            self._rolled_back = f"the step was rolled back when {what} raised ({type(error).__name__}: {error})"

    def _launch(self, step: Step, what: str, launch, *args) -> None:
        """launch(*args), the step rolled back if it raises."""
        try:
            launch(*args)
        except BaseException as error:
            self._failed(step, what, error)
            raise

    def _refuse_in_step(self, what: str) -> None:
        if self._step is not None:
            raise KVCacheError(f"{what}: a forward step is in progress (its rows are not all written); call "
                               "end_forward, or cancel_forward to abandon the step, first")

    def _check_batch(self, seq_ids, append_lengths) -> tuple[list, list, tuple | None]:
        """(seq_ids, lengths, SequenceTable.steady(seq_ids)), checked; the sequences' existence
        is checked later (_sequences), except in a steady step."""
        seq_ids, lengths = _int_list("seq_ids", seq_ids), _int_list("append_lengths", append_lengths)
        steady = self._table.steady(seq_ids)
        # (messages are formatted only on failure: this runs every step)
        if len(seq_ids) != len(lengths):
            raise KVCacheError(f"seq_ids has {len(seq_ids)} entries but append_lengths has {len(lengths)}: they "
                               "must have one entry per sequence")
        check(len(seq_ids) > 0, "seq_ids is empty: a forward needs at least one sequence")
        if steady is None and len(set(seq_ids)) != len(seq_ids):
            raise KVCacheError(f"seq_ids {seq_ids} names a sequence twice")
        if min(lengths) < 1:
            i = next(i for i, n in enumerate(lengths) if n < 1)
            raise KVCacheError(f"append_lengths[{i}]={lengths[i]}: every sequence must append at least one token")
        total, chunk = sum(lengths), self.options.prefill_chunk_size
        if total > chunk:
            raise KVCacheError(f"append_lengths add up to {total} tokens, more than prefill_chunk_size={chunk}; "
                               "split the step into chunks")
        return seq_ids, lengths, steady

    def _sequences(self, seq_ids: list) -> list:
        """The sequences named by seq_ids (KVCacheError names the first unknown one)."""
        table = self._table.seqs
        if not table.keys() >= set(seq_ids):
            for i, seq_id in enumerate(seq_ids):
                self._table.get(seq_id, f"seq_ids[{i}]")
        return list(map(table.__getitem__, seq_ids))

    def _check_tree(self, seqs: list, lengths: list, parents) -> list | None:
        """The new nodes' parents per sequence (None without a token tree); checks them, or
        that no sequence has an uncommitted tree when there are none."""
        if parents is None:
            if any(map(len, map(_TREE, seqs))):
                for seq in seqs:
                    check(seq.tree_tokens == 0, f"sequence {seq.seq_id} has {seq.tree_tokens} token-tree tokens "
                          "not committed yet; call commit_accepted_token_tree_nodes first")
            return None
        parents = _int_list("token_tree_parent_ptr", parents)
        check(len(parents) == sum(lengths), f"token_tree_parent_ptr has {len(parents)} entries, expected one per "
              f"new token ({sum(lengths)})")
        trees, start = [], 0
        for seq, n in zip(seqs, lengths):
            check_new_nodes(seq.seq_id, seq.tree, parents[start : start + n])
            trees.append(parents[start : start + n])
            start += n
        return trees

    def _check_tree_support(self) -> None:
        """This cache can run a step whose token trees are not all chains; builds the tree-mask
        kernels on first use."""
        check(not self.options.support_sliding_window, "token trees that are not chains are not supported by a "
              "cache with support_sliding_window (tree attention has no sliding-window kernels, as in TVM)")
        check(not self.options.has_layer_windows, "token trees that are not chains are not supported by a cache "
              "with MHA_SLIDING layers (tree attention has no sliding-window kernels)")
        check(self._rope.mode != RopeMode.INLINE, "token trees that are not chains are not supported with "
              'rope_mode="inline": a node\'s RoPE position is its depth, not its place in the cache; use "normal"')
        if self._step_kernels.tree_paged is not None:
            return
        if self.backend == "flashinfer":
            log.warning("token trees run tvmattn's TIR tree-mask kernels: FlashInfer has no tree-mask attention")
        built, backends = {}, {}
        for slot, role in (("tree_attn_paged_kv", PagedPrefillTreeMask), ("tree_attn_ragged", RaggedPrefillTreeMask)):
            spec = getattr(self.kernels, slot)
            if isinstance(spec, Deferred):
                spec = built[slot] = spec.build()
            backends[slot] = backend_from_spec(spec, role)
        check(backends["tree_attn_paged_kv"] is not None, "kernels: slot 'tree_attn_paged_kv' is empty, so this "
              "cache cannot run token trees that are not chains")
        self.kernels = dataclasses.replace(self.kernels, **built)
        self._step_kernels = dataclasses.replace(self._step_kernels, tree_paged=backends["tree_attn_paged_kv"],
                                                 tree_ragged=backends["tree_attn_ragged"])
        self._backend_plans = self._planning_backends()

    def _begin_backends(self, plan: ForwardPlan) -> None:
        """The backends' plan step (nothing for TIR kernels)."""
        opts, host, k = self.options, plan.host, self._step_kernels
        heads = (opts.num_qo_heads, opts.num_kv_heads, opts.qk_head_dim, opts.v_head_dim)
        for backend in (k.ragged, k.paged_prefill, k.paged_decode):
            backend.new_forward()
        if plan.tree:
            (level,), indptr = host.fused, host.append_indptr
            for backend in (k.tree_paged, k.tree_ragged):
                if backend is not None:
                    backend.begin_forward(level.page_indptr, level.length_info, indptr, len(plan.lengths),
                                          opts.page_size, *heads, self._rope.mode)
            levels = host.cross  # for cross_attention
        else:
            levels = host.fused
            if not plan.decode:
                self._begin_ragged(plan)
        self._begin_levels(plan, levels, 0)

    def _begin_ragged(self, plan: ForwardPlan) -> None:
        """The ragged prefill's plan step (causal, over the step's new tokens)."""
        opts, indptr = self.options, plan.host.append_indptr
        self._step_kernels.ragged.begin_forward(indptr, indptr, len(plan.lengths), plan.total, opts.num_qo_heads,
                                                opts.num_kv_heads, opts.qk_head_dim, opts.v_head_dim, True)

    def _begin_levels(self, plan: ForwardPlan, levels, first_depth: int) -> None:
        """The paged backends' plan step of `levels`, at depths first_depth, first_depth + 1, ..."""
        opts, k = self.options, self._step_kernels
        heads = (opts.num_qo_heads, opts.num_kv_heads, opts.qk_head_dim, opts.v_head_dim)
        for depth, level in enumerate(levels, first_depth):
            indptr = level.page_indptr
            if level.kernel == "decode":
                k.paged_decode.begin_forward(depth, indptr, len(indptr) - 1, opts.page_size, *heads,
                                             self._rope.mode, opts.dtype, opts.dtype)
            else:
                k.paged_prefill.begin_forward(depth, level.qo_indptr, indptr, level.length_info,
                                              len(indptr) - 1, plan.total, opts.page_size, *heads, False)

    def _step_shapes(self, n: int) -> dict:
        opts = self.options
        hq, hkv, d, dv = opts.num_qo_heads, opts.num_kv_heads, opts.qk_head_dim, opts.v_head_dim
        if opts.is_mla:
            return {"n": n, "kv": (n, d), "q": (n, hq, d), "o": (n, hq, dv), "lse": (n, hq)}
        return {"n": n, "qkv": (n, hq + 2 * hkv, d), "q": (n, hq, d), "k": (n, hkv, d), "v": (n, hkv, dv),
                "o": (n, hq, dv), "lse": (n, hq)}

    # -- attention
    def _active(self, what: str) -> Step:
        step = self._step
        if step is None:
            reason = "" if self._rolled_back is None else f" ({self._rolled_back})"
            raise KVCacheError(f"{what}: no forward step in progress{reason}; call begin_forward first")
        return step

    def _layer(self, layer_id):
        if type(layer_id) is not int or not 0 <= layer_id < self.options.num_layers:
            layer_id = check_int("layer_id", layer_id, 0, self.options.num_layers - 1)
        return self._pools[layer_id]

    def _layer_of_kind(self, what: str, layer_id, kinds: tuple, use: str):
        """The pages of layer_id, whose kind must be one of `kinds` (else KVCacheError naming `use`)."""
        pages = self._layer(layer_id)
        kind = self._kinds[int(layer_id)]
        if kind not in kinds:
            raise KVCacheError(f"{what}: layer {layer_id} is an {kind.name} layer; {use}")
        return pages, kind

    def _tensor(self, name: str, tensor, dtype: str | None = None):
        return check_tensor(name, tensor, self._shapes[name], dtype or self.options.dtype, self.device)

    def attention_with_fused_qkv(self, layer_id: int, sm_scale: float, qkv, o) -> None:
        """Attention of this step's new tokens over their sequences (history + new tokens,
        causal; an MHA_SLIDING layer's within each token's window), appending the new K/V to
        the layer's pages.

        qkv [n, Hq + 2*Hkv, D] (heads: q, then k, then v), o [n, Hq, Dv]; n = tokens of the step.
        """
        # fast path (an MHA layer): straight to the launches, whose own argument checks (TVM's, at
        # the entry of every compiled kernel: shapes against the step's rows, dtypes, devices,
        # compactness) are the check; see _fast_path_failed for a launch that raises
        step = self._step
        if type(layer_id) is int and step is not None and type(sm_scale) is float and math.isfinite(sm_scale):
            pages = self._fast_pages.get(layer_id)
            if pages is not None:
                try:
                    step.fused(pages, qkv, o, sm_scale)
                except BaseException as error:
                    if not self._fast_path_failed(step, layer_id, sm_scale, qkv, o, error):
                        raise
                    return
                step.appended_layers.add(layer_id)
                return
        self._attention_with_fused_qkv(layer_id, sm_scale, qkv, o)

    def _fast_path_failed(self, step: Step, layer_id: int, sm_scale: float, qkv, o, error: BaseException) -> bool:
        """After a launch of attention_with_fused_qkv's fast path raised `error`: the Python checks
        of qkv and o raise KVCacheError naming a refused argument (the step goes on: a launch
        refuses its arguments before it runs, and a refused o is seen by the attention kernel
        after the append wrote the layer's rows of this step, rows the step reserved, which
        nothing reads before the layer runs again and a rolled-back step never exposes). Where
        the checks convert an argument (a DLPack tensor), the checked path launches (True).
        Otherwise a kernel failed: the step is rolled back and the caller re-raises (False)."""
        if isinstance(error, Exception):
            try:
                checked_qkv, checked_o = self._tensor("qkv", qkv), self._tensor("o", o)
            except KVCacheError as refusal:
                raise refusal from None  # (the launch's own message says less)
            if checked_qkv is not qkv or checked_o is not o:
                self._attention_with_fused_qkv(layer_id, sm_scale, checked_qkv, checked_o)
                return True
        self._failed(step, f"attention_with_fused_qkv of layer {layer_id}", error)
        return False

    def _attention_with_fused_qkv(self, layer_id: int, sm_scale: float, qkv, o) -> None:
        """attention_with_fused_qkv with every argument checked in Python."""
        step = self._active("attention_with_fused_qkv")
        pages, kind = self._layer_of_kind("attention_with_fused_qkv", layer_id, _MHA_KINDS,
                                          "MLA layers run append_mla_kv, self_attention and cross_attention")
        qkv, o, sm_scale = self._tensor("qkv", qkv), self._tensor("o", o), check_finite("sm_scale", sm_scale)
        launch = step.attention_in_window if kind == AttnKind.MHA_SLIDING and step.plan.host.window else step.fused
        self._launch(step, f"attention_with_fused_qkv of layer {layer_id}", launch, pages, qkv, o, sm_scale)
        step.appended_layers.add(int(layer_id))

    def attention_with_shared_kv(self, source_layer_id: int, sm_scale: float, q, k, v, o) -> None:
        """Attention of this step's new tokens over the K/V of layer `source_layer_id` (a layer
        that shares another's cache; an MHA_SLIDING source's window applies), appending
        nothing; that layer must have run attention_with_fused_qkv in this step (its new K/V
        are then in its pages).

        q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, Dv]: the query and the source layer's key and value
        of the step's tokens, as split_rotary gives them (RoPE applied in rope_mode "normal")
        -> o [n, Hq, Dv]."""
        step = self._active("attention_with_shared_kv")
        pages, kind = self._layer_of_kind("attention_with_shared_kv", source_layer_id, _MHA_KINDS,
                                          "only MHA layers' K/V can be shared (as in TVM)")
        check(source_layer_id in step.appended_layers, f"attention_with_shared_kv: source layer {source_layer_id} "
              "has not run attention_with_fused_qkv in this step, so its pages lack the step's K/V")
        q, k, v, o = (self._tensor(name, t) for name, t in (("q", q), ("k", k), ("v", v), ("o", o)))
        sm_scale, what = check_finite("sm_scale", sm_scale), f"attention_with_shared_kv over layer {source_layer_id}"
        if kind == AttnKind.MHA_SLIDING and step.plan.host.window:
            self._launch(step, what, step.attend_in_window, pages, q, o, sm_scale)
        else:
            self._launch(step, what, step.attend, pages, q, k, v, o, sm_scale)
        step.shared_reads += 1

    def append_mla_kv(self, layer_id: int, kv) -> None:
        """Write this step's latent rows kv [n, qk_head_dim] (latent, then rope part) into the
        MLA layer's pages; n = tokens of the step."""
        step = self._active("append_mla_kv")
        pages, _ = self._layer_of_kind("append_mla_kv", layer_id, (AttnKind.MLA,),
                                       "MHA layers append in attention_with_fused_qkv")
        self._launch(step, f"append_mla_kv of layer {layer_id}", step.append_mla_kv, pages, self._tensor("kv", kv))
        step.appended_layers.add(int(layer_id))

    def self_attention(self, layer_id: int, sm_scale: float, q, k, v, o, lse) -> None:
        """Causal attention among this step's new tokens only (nothing is cached).

        MHA layer: q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, Dv] -> o [n, Hq, Dv], lse [n, Hq] f32
        (base 2). MLA layer: the model's own head dims, q and k [n, Hq, d_qk], v and o [n, Hq, d_v]
        (e.g. 192 / 128), no RoPE in the kernel.
        """
        step = self._active("self_attention")
        _, kind = self._layer_of_kind("self_attention", layer_id, (AttnKind.MHA, AttnKind.MLA),
                                      "a windowed layer has no self/cross split (use attention_with_fused_qkv)")
        what = f"self_attention of layer {layer_id}"
        if kind == AttnKind.MLA:
            self._mla_self_attention(step, what, q, k, v, o, lse, check_finite("sm_scale", sm_scale))
            return
        check(not step.tree or self._step_kernels.tree_ragged is not None, "self_attention: this step has token "
              "trees and the kernels' slot 'tree_attn_ragged' is empty")
        q, k, v, o = (self._tensor(name, t) for name, t in (("q", q), ("k", k), ("v", v), ("o", o)))
        lse, sm_scale = self._tensor("lse", lse, "float32"), check_finite("sm_scale", sm_scale)
        if not step.ragged_planned:  # a decode step: the ragged prefill is planned on first use
            self._launch(step, what, self._begin_ragged, step.plan)
            step.ragged_planned = True
        self._launch(step, what, step.self_attention, q, k, v, o, lse, sm_scale)

    def _mla_self_attention(self, step, what: str, q, k, v, o, lse, sm_scale: float) -> None:
        """MLA self-attention: shapes checked against each other, the ragged prefill of their dims."""
        opts, n = self.options, step.plan.total
        q = as_rows("q", q, n, opts.num_qo_heads, opts.dtype, self.device)
        d_qk = int(q.shape[2])
        k = check_tensor("k", k, (n, opts.num_qo_heads, d_qk), opts.dtype, self.device)
        v = as_rows("v", v, n, opts.num_qo_heads, opts.dtype, self.device)
        d_v = int(v.shape[2])
        o = check_tensor("o", o, (n, opts.num_qo_heads, d_v), opts.dtype, self.device)
        lse = check_tensor("lse", lse, (n, opts.num_qo_heads), "float32", self.device)
        ragged = self._mla.ragged or ragged_for(opts.num_qo_heads, d_qk, d_v, opts.dtype, self.target)
        self._launch(step, what, step.mla_self_attention, ragged, q, k, v, o, lse, sm_scale)

    def cross_attention(self, layer_id: int, sm_scale: float, q, o, lse) -> None:
        """Attention of this step's queries over the cached tokens before the step (no mask).

        MHA layer: q [n, Hq, D] -> o [n, Hq, Dv], lse [n, Hq] f32 (base 2; rows with no key:
        o = 0, lse = -5e4). MLA layer: absorbed q [n, Hq, qk_head_dim] -> o [n, Hq, v_head_dim]
        (the latent width); in a decode step over the history and the step's rows (appended
        by append_mla_kv first), as TVM's cache does.
        """
        step = self._active("cross_attention")
        pages, kind = self._layer_of_kind("cross_attention", layer_id, (AttnKind.MHA, AttnKind.MLA),
                                          "a windowed layer has no self/cross split (use attention_with_fused_qkv)")
        check(not step.grown_tree, "cross_attention: a token tree of this step grew over an earlier forward, so "
              "its history holds uncommitted nodes that only some queries see; use attention_with_fused_qkv")
        q, o, lse = self._tensor("q", q), self._tensor("o", o), self._tensor("lse", lse, "float32")
        sm_scale, what = check_finite("sm_scale", sm_scale), f"cross_attention of layer {layer_id}"
        if kind == AttnKind.MLA and step.decode and int(layer_id) not in step.appended_layers:
            raise KVCacheError(f"cross_attention: in a decode step an MLA layer attends over the step's rows too, "
                               f"which layer {layer_id} has not written: call append_mla_kv first")
        if not step.cross_planned and kind != AttnKind.MLA:  # cross levels have plans of their own (FlashInfer)
            self._launch(step, what, self._begin_levels, step.plan, step.plan.host.cross, step.cross_depth)
            step.cross_planned = True
        self._launch(step, what, step.cross_attention, pages, q, o, lse, sm_scale)

    def merge_attn_output_inplace(self, o1, lse1, o2, lse2) -> None:
        """(o1, lse1) <- the merge of two attention results over disjoint keys (base-2 LSE).

        o1, o2 [n, Hq, Dv]; lse1, lse2 [n, Hq] f32. In an MLA cache Dv is the width of the
        merged outputs (the model's v head dim, e.g. 128, or the latent width).
        """
        opts = self.options
        n = _rows("o1", o1)
        width, merge = opts.v_head_dim, self.kernels.merge_state
        if opts.is_mla:
            o1 = as_rows("o1", o1, n, opts.num_qo_heads, opts.dtype, self.device)
            width = int(o1.shape[2])
            if width != opts.v_head_dim:
                merge = self._mla.merge_output or merge_for(opts.num_qo_heads, width, opts.dtype, self.target)
        shapes = {"o": (n, opts.num_qo_heads, width), "lse": (n, opts.num_qo_heads)}
        tensors = [check_tensor(name, t, shapes[name[:-1]], opts.dtype if name[0] == "o" else "float32",
                                self.device) for name, t in (("o1", o1), ("lse1", lse1), ("o2", o2), ("lse2", lse2))]
        merge(*tensors)

    # -- commits of token trees
    def commit_accepted_token_tree_nodes(self, seq_ids, leaf_indices) -> None:
        """Keep, per sequence, the path from its tree's root to node leaf_indices[i] of its
        uncommitted token tree (-1: keep none) and drop the other nodes.

        The path's K/V move into the tree's first slots (compact_copy, every layer), so the
        sequence ends exactly as if the accepted tokens had been appended one by one: a windowed
        sequence's window slides now (never while the tree is uncommitted). Every sequence is
        checked before any changes: a refused commit changes nothing. Refused inside a forward
        step (call end_forward first).
        """
        self._refuse_in_step("commit_accepted_token_tree_nodes")
        seq_ids, leaves = _int_list("seq_ids", seq_ids), _int_list("leaf_indices", leaf_indices)
        check(len(seq_ids) == len(leaves), f"seq_ids has {len(seq_ids)} entries but leaf_indices has {len(leaves)}")
        check(len(set(seq_ids)) == len(seq_ids), f"seq_ids {seq_ids} names a sequence twice")
        seqs = [self._table.get(seq_id, f"seq_ids[{i}]") for i, seq_id in enumerate(seq_ids)]
        for seq, leaf in zip(seqs, leaves):
            check(leaf == -1 or seq.tree_tokens > 0,
                  f"sequence {seq.seq_id}: no token tree to commit (or it is committed already)")
            check(-1 <= leaf < max(seq.tree_tokens, 1), f"leaf_indices: {leaf} is not a node of the token tree of "
                  f"sequence {seq.seq_id} ({seq.tree_tokens} nodes)")
        paths = [accepted_path(seq.tree, leaf) for seq, leaf in zip(seqs, leaves)]
        self._compact(seqs, paths)
        self._table.commit_trees(seqs, paths)

    def _compact(self, seqs: list, paths: list) -> None:
        """Move each accepted path into place (compact_copy over every layer's pages); changes
        no bookkeeping (a refusal here leaves the cache as it was)."""
        page_size = self.options.page_size
        indptr, moves, slide_moves = [0], [[], []], [[], []]
        for seq, path in zip(seqs, paths):
            first = seq.length - seq.tree_tokens
            pairs = compact_copies(path, first)
            if pairs:
                tables = [(seq.positions(first, seq.length, page_size), moves)]
                if self._slides is not None:  # (chains only, which move nothing: kept for completeness)
                    tables.append((seq.slide_positions(first, seq.length, page_size), slide_moves))
                for positions, (sources, destinations) in tables:
                    sources += [int(positions[src - first]) for src, _ in pairs]
                    destinations += [int(positions[dst - first]) for _, dst in pairs]
            indptr.append(len(moves[0]))
        if not moves[0]:
            return
        check(self.kernels.compact_copy is not None, "kernels: slot 'compact_copy' is empty, so this cache cannot "
              "commit token trees that are not chains")
        indptr_dev = tvm.runtime.tensor(np.asarray(indptr, dtype=np.int32), device=self.device)
        pos_dev = {False: tvm.runtime.tensor(np.asarray(moves, dtype=np.int32), device=self.device)}
        if slide_moves[0]:
            pos_dev[True] = tvm.runtime.tensor(np.asarray(slide_moves, dtype=np.int32), device=self.device)
        for pool, kind in zip(self._pools, self._kinds):
            self.kernels.compact_copy(pool, indptr_dev, pos_dev[kind == AttnKind.MHA_SLIDING], len(seqs))

    # -- queries
    def empty(self) -> bool:
        """No sequence and every page free (the MHA_SLIDING layers' too)."""
        return len(self._table) == 0 and self._allocator.num_free == self._allocator.num_pages and (
            self._slides is None or self._slides.held() == 0)

    def get_num_available_pages(self) -> int:
        return self._allocator.num_free

    def get_total_sequence_length(self) -> int:
        return self._table.total_length()

    def get_query_positions(self) -> tvm.runtime.Tensor:
        """int32 [n] on the device: the RoPE position of each token of this step."""
        return self._active("get_query_positions").query_positions()

    def debug_get_kv(self, seq_id: int, start: int, end: int, k, v) -> None:
        """Copy K and V of tokens start .. end-1 of a sequence, every layer, into
        k [num_layers, end - start, Hkv, D] and v [num_layers, end - start, Hkv, Dv].

        An MHA_SLIDING layer keeps a token only while a future query's window can read it:
        its rows of a token it released (every token before `sliding_kept_from(seq_id)`) are
        zeros (read from its pool's zero page)."""
        check(not self.options.is_mla, "debug_get_kv: this is an MLA cache; use debug_get_kv_mla")
        positions, n = self._debug_positions(seq_id, start, end)
        opts = self.options
        k = check_tensor("k", k, (opts.num_layers, n, opts.num_kv_heads, opts.qk_head_dim), opts.dtype, self.device)
        v = check_tensor("v", v, (opts.num_layers, n, opts.num_kv_heads, opts.v_head_dim), opts.dtype, self.device)
        self._refuse_in_step("debug_get_kv")
        slide_positions = None
        if self._slides is not None:
            seq = self._table.get(seq_id)
            slide_positions = tvm.runtime.tensor(seq.slide_positions(start, end, opts.page_size,
                                                                     self._slides.zero_page), device=self.device)
        for layer, (pool, kind) in enumerate(zip(self._pools, self._kinds)):
            self.kernels.debug_get_kv(pool, slide_positions if kind == AttnKind.MHA_SLIDING else positions, k, v,
                                      layer)

    def sliding_kept_from(self, seq_id: int) -> int:
        """The first token of a sequence whose K/V the MHA_SLIDING layers still hold (they
        released the pages before it; 0 in a cache without such layers)."""
        seq = self._table.get(seq_id)
        return 0 if self._slides is None else seq.slide_dropped * self.options.page_size

    def memory_report(self) -> dict:
        """What the cache's K/V pages hold now, against what full attention would hold.

        Keys (pages are counted once however many sequences share them): tokens (the
        sequences' lengths, summed); page_bytes (one page of one layer); layers, sliding_layers;
        pages (pages in use by the non-sliding layers, per layer: every token);
        sliding_pages (in use by the MHA_SLIDING layers, per layer: each sequence's window);
        held_bytes (in use, every layer); full_bytes (what every layer would hold keeping every
        token: pages x layers); saved_bytes (full - held); pool_bytes (the pools allocated,
        every layer; FP8 scale pages and the sliding pools' zero page included);
        full_pool_bytes (the same with every layer's pool as large as an MHA layer's)."""
        opts = self.options
        page = opts.layer_page_bytes()
        layers, sliding = opts.num_layers, len(self._sliding_layers)
        pages = self._allocator.num_pages - self._allocator.num_free
        sliding_pages = self._slides.held() if self._slides is not None else 0
        held = (layers - sliding) * pages * page + sliding * sliding_pages * page
        full = layers * pages * page
        pool = sum(int(p.shape[0]) for p in self._pools) * page
        return {"tokens": self._table.total_length(), "page_bytes": page, "layers": layers,
                "sliding_layers": sliding, "pages": pages, "sliding_pages": sliding_pages, "held_bytes": held,
                "full_bytes": full, "saved_bytes": full - held, "pool_bytes": pool,
                "full_pool_bytes": layers * opts.pool_pages * page}

    def debug_get_kv_mla(self, seq_id: int, start: int, end: int, kv) -> None:
        """Copy the latent rows of tokens start .. end-1 of a sequence, every layer, into
        kv [num_layers, end - start, qk_head_dim] (an MLA cache)."""
        check(self.options.is_mla, "debug_get_kv_mla: this cache has no MLA layers; use debug_get_kv")
        positions, n = self._debug_positions(seq_id, start, end)
        opts = self.options
        kv = check_tensor("kv", kv, (opts.num_layers, n, opts.qk_head_dim), opts.dtype, self.device)
        self._refuse_in_step("debug_get_kv_mla")
        for layer, pool in enumerate(self._pools):
            self.kernels.debug_get_kv(pool, positions, kv, layer)

    def _debug_positions(self, seq_id: int, start: int, end: int) -> tuple:
        """(int32 pool positions of tokens start .. end-1 on the device, end - start), checked."""
        check(self.kernels.debug_get_kv is not None, "kernels: slot 'debug_get_kv' is empty")
        seq = self._table.get(seq_id)
        start, end = check_int("start", start), check_int("end", end)
        check(0 <= start < end <= seq.length, f"start={start}, end={end}: expected 0 <= start < end <= "
              f"{seq.length} (the length of sequence {seq_id})")
        positions = tvm.runtime.tensor(seq.positions(start, end, self.options.page_size), device=self.device)
        return positions, end - start

    # -- CUDA-graph decode (tvmattn.runtime.graphs)
    def begin_graph_decode(self, seq_ids, bucket: int) -> None:
        """begin_forward of a decode step (one new token per sequence) for a CUDA-graph replay:
        planned without cascade, padded to `bucket` rows, in the bucket's fixed layout in the
        graph-plan buffer (see tvmattn.runtime.graphs). The step's tensors have `bucket` rows.
        In a cache with MHA_SLIDING layers their window level is planned as in begin_forward
        (their pages taken here; windows slide when end_forward keeps the step)."""
        self._check_graph_decode("begin_graph_decode")
        self._abandon()
        seq_ids, lengths, steady = self._check_batch(seq_ids, [1] * len(seq_ids))
        limit = min(self.options.max_num_sequences, self.options.prefill_chunk_size)
        if not (isinstance(bucket, int) and len(seq_ids) <= bucket <= limit):
            raise KVCacheError(f"bucket={bucket!r}: expected an int from the batch size {len(seq_ids)} to {limit}")
        if steady is not None:  # (checked in the last step)
            seqs, tables = steady
        else:
            seqs = self._sequences(seq_ids)
            check(not any(map(_WINDOW_SIZE, seqs)), "a graph decode step cannot hold sequences with a sliding window")
            self._check_tree(seqs, lengths, None)
            tables = TableArrays.gather(seqs)
        layout = self._graph_layout(bucket, len(tables.pages) + 2 * bucket)
        batch, copies = self._table.reserve_plain(seqs, lengths, tables, seq_ids)
        try:
            self._copy_pages(copies)
            plan = build_plan_arrays(seq_ids, lengths, batch, self.options.page_size,
                                     self.options.sequence_windows, cascade=False)
            if self._slides is not None:  # the MHA_SLIDING layers' level, over their own pages
                level, positions = window_plan(seqs, lengths, self.options.layer_sliding_window_size,
                                               self.options.page_size)
                plan = dataclasses.replace(plan, host=plan.host._replace(window=(level,),
                                                                         slide_positions=(positions,)))
            self._start_step(pad_decode_plan(plan, bucket, layout), self._graph_arrays)
        except BaseException:
            self._table.rollback_step()
            raise

    def _step_progress(self) -> tuple:
        """(layers that wrote, attention_with_shared_kv calls) of the step in progress: what a
        CUDA graph captured in it replays (tvmattn.runtime.graphs)."""
        step = self._active("_step_progress")
        return frozenset(step.appended_layers), step.shared_reads

    def _replay_progress(self, progress: tuple) -> None:
        """Count what a replayed CUDA graph ran (`_step_progress` of its capture) in the step."""
        step = self._active("_replay_progress")
        layers, shared = progress
        step.appended_layers.update(layers)
        step.shared_reads += shared

    def reserve_graph_plan(self, seq_ids, bucket: int) -> int:
        """Make the graph-plan buffer large enough for a graph decode step of seq_ids in `bucket`
        (a larger one replaces it: graphs captured before are recaptured); returns its
        generation (see graph_state)."""
        seq_ids = _int_list("seq_ids", seq_ids)
        steady = self._table.steady(seq_ids)  # (a steady step's kept tables: no pass over the batch)
        if steady is not None:
            pages = len(steady[1].pages)
        else:
            pages = sum(len(seq.pages) for seq in self._sequences(seq_ids))
        self._graph_layout(bucket, pages + 2 * bucket)
        return self._graph_generation

    def reserve_decode_workspace(self) -> None:
        """Run the paged decode kernel (layer 0's pages, scratch outputs) at every batch size a
        step of this cache can have (up to max_num_sequences), so that TVM's per-thread CUDA
        workspace pool holds pages for the largest split-KV partials this cache asks for and
        never frees one that a captured graph uses (tvmattn.runtime.graphs)."""
        self._check_graph_decode("reserve_decode_workspace")
        check(self._step is None, "reserve_decode_workspace: a forward step is in progress")
        empty = empty_decode_plan(self.options.sequence_windows, self._slides is not None)
        mha = [pool for pool, kind in zip(self._pools, self._kinds) if kind == AttnKind.MHA]
        window = [self._pools[layer] for layer in self._sliding_layers]
        for batch in range(1, min(self.options.max_num_sequences, self.options.prefill_chunk_size) + 1):
            self._start_step(pad_decode_plan(empty, batch, self._graph_layout(batch, 2 * batch)), self._graph_arrays)
            try:
                self._step.decode_scratch((mha or self._pools)[0])
                if window:  # the MHA_SLIDING layers' decode kernel too (WindowStep)
                    self._step.window_scratch(window[0])
            finally:
                self._step = None

    def graph_state(self) -> tuple:
        """What a captured graph depends on besides the plan's contents: the graph-plan buffer
        and the kernels a decode step launches (a graph captured against another is stale)."""
        k = self._step_kernels
        return (self._graph_generation, id(k.paged_decode), id(k.split_rotary_append), id(k.decode_append),
                id(k.split_rotary), id(k.transpose_append), id(self._window_decode))

    def graph_plan_bytes(self) -> int:
        return 0 if self._graph_arrays is None else 4 * self._graph_arrays.capacity

    @property
    def graph_decode_supported(self) -> bool:
        """CUDA-graph decode steps serve caches of MHA and MHA_SLIDING layers (an MLA layer's
        kernels are not in the graph layout)."""
        return set(self._kinds) <= _GRAPH_KINDS

    def _check_graph_decode(self, what: str) -> None:
        if not self.graph_decode_supported:
            others = sorted({kind.name for kind in self._kinds} - {kind.name for kind in _GRAPH_KINDS})
            raise KVCacheError(f"{what}: CUDA-graph decode steps serve caches of MHA_SLIDING and MHA layers only; "
                               f"this cache has {others} layers (run begin_forward)")

    def _graph_layout(self, bucket: int, page_indices: int):
        """The bucket's graph layout, with a page capacity of at least `page_indices` (a larger
        one means a new graph-plan buffer: graphs captured before are recaptured)."""
        opts = self.options
        if self._graph_arrays is None or page_indices > self._graph_page_capacity:
            # (the largest request callers make: every page in use plus 2 per row of the largest
            # bucket, so that a full cache never replaces the buffer and recaptures the graphs)
            self._graph_page_capacity = max(page_indices, 2 * self._graph_page_capacity,
                                            opts.num_pages + 2 * opts.max_num_sequences)
            end = layout_end(graph_layout(opts.max_num_sequences, self._graph_page_capacity, True,
                                          self._graph_window_pages()))
            self._graph_arrays = DeviceArrays(self.device, end)
            self._graph_layouts = {}
            self._graph_generation += 1
        layout = self._graph_layouts.get(bucket)
        if layout is None:
            layout = self._graph_layouts[bucket] = graph_layout(bucket, self._graph_page_capacity,
                                                                opts.sequence_windows, self._graph_window_pages())
        return layout

    def _graph_window_pages(self) -> int:
        """Window pages per row of the graph layout's MHA_SLIDING level (0: no such layers)."""
        opts = self.options
        return window_pages_per_row(opts.layer_sliding_window_size, opts.page_size) if self._slides is not None else 0

    # -- inspection (tests)
    def sequence_state(self, seq_id: int) -> dict:
        """A copy of a sequence's bookkeeping: pages, length, window fields."""
        seq = self._table.get(seq_id)
        return {field: (list(value) if isinstance(value, (list, array)) else value)
                for field in seq.__slots__ for value in (getattr(seq, field),)}

    def sequence_ids(self) -> list:
        return sorted(self._table.seqs)

    def current_plan(self):
        """The ForwardPlan of the step in progress (None outside a step)."""
        return None if self._step is None else self._step.plan


def _compiled_launches(kernels: Kernels) -> bool:
    """Whether every function a step of MHA layers launches is a tvm_ffi Function (a compiled
    kernel checks its arguments at entry; a Python callable given as a kernel may not)."""
    funcs = [kernels.split_rotary, kernels.transpose_append, kernels.merge]
    optional = [func for func in (kernels.split_rotary_append, kernels.decode_append) if func is not None]
    backends = [getattr(backend, "func", None) for backend in (kernels.ragged, kernels.paged_prefill,
                                                                kernels.paged_decode)]
    for func in optional + backends:  # (a backend without a function: not compiled)
        funcs += func.variants if isinstance(func, DecodeByShape) else [func]
    return all(isinstance(func, tvm_ffi.Function) for func in funcs)


_WINDOW_SIZE = operator.attrgetter("window_size")
_LENGTH = operator.attrgetter("length")
_MHA_KINDS = (AttnKind.MHA, AttnKind.MHA_SLIDING)
_GRAPH_KINDS = frozenset(_MHA_KINDS)  # the layer kinds of CUDA-graph decode steps
_TREE = operator.attrgetter("tree")


def _int_list(name: str, values) -> list:
    if type(values) is tvm_ffi.Shape:  # (int64 values: no check needed; the FFI's begin_forward passes them)
        return list(values)
    try:
        items = list(values)
    except TypeError:
        raise KVCacheError(f"{name} must be a sequence of integers, got {values!r}") from None
    if set(map(type, items)) <= {int}:  # plain ints (the usual case) need no conversion
        return items
    return [check_int(f"{name}[{i}]", value) for i, value in enumerate(items)]


def as_rows(name: str, tensor, n: int, heads: int, dtype: str, device):
    """`tensor` as a Tensor [n, heads, d] (any d) of dtype and device, else KVCacheError."""
    tensor = as_tensor(name, tensor)
    shape = tuple(int(x) for x in tensor.shape)
    if len(shape) != 3 or shape[:2] != (n, heads):
        raise KVCacheError(f"{name} must have shape ({n}, {heads}, d), got {shape}")
    return check_tensor(name, tensor, tensor.shape, dtype, device)


def _rows(name: str, tensor) -> int:
    shape = getattr(tensor, "shape", None)
    check(shape is not None and len(shape) >= 1, f"{name} must be a tensor, got {type(tensor).__name__}")
    return int(shape[0])
