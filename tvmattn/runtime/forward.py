"""One forward step in progress: the kernel launches of every per-layer call, prepared once.

`Step` is built by `PagedKVCache.begin_forward` from the uploaded plan. Its methods run the
launches of one layer; they take the layer's pages, the caller's tensors and sm_scale, and do
nothing else (the cache has checked the arguments).

attention_with_fused_qkv, per layer:
  decode step:  split_rotary_append(qkv) -> q, k and v into their page slots (one launch; or
                split_rotary then transpose_append where the cache has no fused kernel);
                [shared level -> o]; paged decode -> o (merged). A plain decode step (one
                paged level) of a cache with decode_append: that one launch does it all.
  prefill step: split_rotary(qkv) -> q, k, v (RoPE applied when the mode is "normal"); ragged
                causal prefill over the new tokens -> o; [shared level]; history level; each
                merged into o by LSE; then transpose_append(k, v)
  tree step:    as a decode step, then tree-mask paged prefill over whole sequences -> o
self_attention runs ragged prefill over the new tokens (tree-mask ragged prefill in a tree
step), cross_attention the history levels. attention_with_shared_kv runs a step's attention
(the part after the append) for a layer that reads another layer's pages.
"""

from __future__ import annotations

import dataclasses
import functools

import tvm

from .backends import RopeMode, TIRPagedDecode
from .kernels import DecodeByShape
from .plan import BufferViews, ForwardPlan, LevelArrays, PlanArrays


@dataclasses.dataclass(frozen=True)
class Rope:
    mode: RopeMode
    scale: float
    theta: float


@dataclasses.dataclass(frozen=True)
class Kernels:
    """What a step launches: attention backends and auxiliary functions."""

    ragged: object  # RaggedPrefill
    paged_prefill: object  # PagedPrefill
    paged_decode: object  # PagedDecode
    split_rotary: object
    transpose_append: object
    merge: object
    tree_paged: object = None  # PagedPrefillTreeMask, for tree steps
    tree_ragged: object = None  # RaggedPrefillTreeMask, for tree steps
    split_rotary_append: object = None  # split_rotary + transpose_append in one launch (optional)
    decode_append: object = None  # split_rotary_append + the paged decode in one launch (optional)


class Workspace:
    """Device buffers of a step's intermediates, sized for prefill_chunk_size tokens:
    q [C, Hq, D], k [C, Hkv, D], v [C, Hkv, Dv], o_tmp [C, Hq, Dv], lse and lse_tmp [C, Hq] f32."""

    def __init__(self, chunk: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                 dtype: str, device, split_qkv: bool = True):
        """split_qkv: allocate q, k and v (MLA caches, whose caller passes them, do not)."""
        shapes = {
            "q": ((num_qo_heads, head_dim), dtype),
            "k": ((num_kv_heads, head_dim), dtype),
            "v": ((num_kv_heads, v_head_dim), dtype),
            "o_tmp": ((num_qo_heads, v_head_dim), dtype),
            "lse": ((num_qo_heads,), "float32"),
            "lse_tmp": ((num_qo_heads,), "float32"),
        }
        if not split_qkv:
            shapes = {name: shape for name, shape in shapes.items() if name not in ("q", "k", "v")}
        self._buffers = {name: BufferViews(tvm.runtime.empty((chunk, *row), dt, device=device),
                                           functools.partial(_rows, row, dt))
                         for name, (row, dt) in shapes.items()}

    def views(self, n: int) -> dict:
        """name -> view of the first n rows."""
        return {name: views[n] for name, views in self._buffers.items()}


def _for_step(func, batch: int, level: LevelArrays):
    """func, or a DecodeByShape's variant for a step of `batch` requests over `level`'s pages."""
    return func.variant(batch, int(level.page_indices.shape[0])) if isinstance(func, DecodeByShape) else func


def _rows(row: tuple, dtype: str, n: int) -> tuple:
    """(shape, dtype, byte offset) of the first n rows."""
    return (n, *row), dtype, 0


class Step:
    """The launches of one forward step (see the module docstring)."""

    def __init__(self, plan: ForwardPlan, arrays: PlanArrays, kernels: Kernels, work: dict, rope: Rope):
        """arrays: the plan's arrays as device views."""
        self.plan = plan
        self.total = plan.total
        self.decode = plan.decode
        self.tree = plan.tree
        # some tree has nodes from earlier forwards (in the pages, seen only by their descendants)
        self.grown_tree = plan.tree and bool((plan.host.tree[0][1:] - plan.host.tree[0][:-1] > plan.lengths).any())
        self._a = arrays
        self._k = kernels
        self._rope = rope
        self.q, self.k, self.v = work.get("q"), work.get("k"), work.get("v")
        self.o_tmp, self.lse, self.lse_tmp = work["o_tmp"], work["lse"], work["lse_tmp"]
        self._fused = [] if plan.tree else [self._level(d, level) for d, level in enumerate(arrays.fused)]
        # cross levels have depths of their own after the fused ones (their plans may differ);
        # the cache plans them on the first cross_attention (in a tree step, in begin_forward)
        self.cross_depth = len(self._fused)
        self.cross_planned = plan.tree
        # a decode step plans no ragged prefill (attention_with_fused_qkv runs none); the cache
        # plans it on the first self_attention
        self.ragged_planned = not plan.decode or plan.tree
        self._cross = [self._level(self.cross_depth + d, level) for d, level in enumerate(arrays.cross)]
        self._apply_rope = int(rope.mode == RopeMode.NORMAL)
        self.appended_layers: set = set()  # layers whose new K/V this step has appended
        self.shared_reads = 0  # attention_with_shared_kv calls (each stands for a layer that writes nothing)
        # attention_with_fused_qkv(pages, qkv, o, sm_scale): in a plain decode step one closure
        # over prebound arguments (two launches, no other Python), else the general method
        self._launches = self._decode_launches()
        self.fused = self._launches or self.attention_with_fused_qkv

    def repeats(self, plan: ForwardPlan, arrays: PlanArrays, kernels: Kernels) -> bool:
        """Whether a step of `plan` makes this step's launches: both plain decode steps with one
        closure of launches (`_decode_launches`), the same device arrays (one layout of one plan
        buffer: the same views), rows and kernels."""
        return (self._launches is not None and arrays is self._a and kernels is self._k and plan.total == self.total
                and plan.decode and not plan.tree and not plan.host.window)

    def again(self, plan: ForwardPlan) -> "Step":
        """A new Step of `plan` (`repeats` holds) sharing this one's prepared launches."""
        step = object.__new__(Step)
        step.__dict__.update(self.__dict__)
        step.plan = plan
        step.appended_layers = set()
        step.shared_reads = 0
        step.cross_planned = step.ragged_planned = False
        return step

    def _decode_launches(self):
        """attention_with_fused_qkv of a decode step with one paged level and a TIR decode kernel
        (the usual decode step) as a closure that makes the launches with arguments bound here:
        decode_append where the cache has it and the rope mode is not inline, else
        split_rotary_append (or split_rotary + transpose_append), then paged decode (the variant
        of a DecodeByShape picked once for the step). None for any other step."""
        if not self.decode or self.tree or len(self._fused) != 1 or type(self).attention_with_fused_qkv is not \
                Step.attention_with_fused_qkv:
            return None
        decode = self._k.paged_decode
        if not isinstance(decode, TIRPagedDecode) or type(decode).mha is not TIRPagedDecode.mha:
            return None
        a, (level,), rope = self._a, self._a.fused, self._rope
        func = _for_step(decode.func, self.total, level)
        q, lse, q_positions, positions, apply_rope = self.q, self.lse, a.q_positions, a.append_positions, \
            self._apply_rope
        indptr, indices, info, k_offset = level.page_indptr, level.page_indices, level.length_info, level.k_offset
        inline, scale, theta = int(rope.mode == RopeMode.INLINE), rope.scale, rope.theta
        split_append = self._k.split_rotary_append
        if split_append is None and self._k.split_rotary is None:  # (an MLA step: no fused-QKV layers)
            return None
        fused = self._k.decode_append
        if fused is not None and not inline:
            fused = _for_step(fused, self.total, level)

            def launches(pages, qkv, o, sm_scale):
                fused(qkv, pages, indptr, indices, info, q_positions, positions, o, lse, apply_rope, sm_scale)
        elif split_append is not None:
            def launches(pages, qkv, o, sm_scale):
                split_append(qkv, q_positions, q, pages, positions, apply_rope)
                func(q, pages, indptr, indices, info, k_offset, q_positions, o, lse, inline, scale, theta, sm_scale)
        else:
            split, append, k, v = self._k.split_rotary, self._k.transpose_append, self.k, self.v

            def launches(pages, qkv, o, sm_scale):
                split(qkv, q_positions, q, k, v, apply_rope)
                append(pages, k, v, positions)
                func(q, pages, indptr, indices, info, k_offset, q_positions, o, lse, inline, scale, theta, sm_scale)
        return launches

    def _level(self, depth: int, level: LevelArrays):
        """A function (pages, q, o, lse, sm_scale) running one paged level (the backends' plan
        of `depth`)."""
        rope, q_positions = self._rope, self._a.q_positions
        indptr, indices, info, k_offset = level.page_indptr, level.page_indices, level.length_info, level.k_offset
        if level.kernel == "decode":
            mha = self._k.paged_decode.mha

            def run(pages, q, o, lse, sm_scale):
                mha(depth, q, pages, indptr, indices, info, k_offset, q_positions, rope.mode, rope.scale,
                    rope.theta, sm_scale, o, lse)
        else:
            mha, qo_indptr = self._k.paged_prefill.mha, level.qo_indptr

            def run(pages, q, o, lse, sm_scale):
                mha(depth, q, qo_indptr, pages, indptr, indices, info, q_positions, k_offset, False, rope.mode,
                    rope.scale, rope.theta, sm_scale, o, lse)
        return run

    def _paged(self, levels: list, pages, q, o, lse, sm_scale: float, have_output: bool) -> None:
        """Run `levels` into (o, lse); each merges into what o already holds."""
        for run in levels:
            if have_output:
                run(pages, q, self.o_tmp, self.lse_tmp, sm_scale)
                self._k.merge(o, lse, self.o_tmp, self.lse_tmp)
            else:
                run(pages, q, o, lse, sm_scale)
                have_output = True

    def _ragged(self, q, k, v, o, lse, sm_scale: float) -> None:
        a, rope = self._a, self._rope
        indptr = a.append_indptr
        if self.tree:
            mn_indptr, mask = a.tree
            self._k.tree_ragged.mha(q, k, v, indptr, indptr, a.q_positions, mn_indptr, mask, rope.mode, rope.scale,
                                    rope.theta, sm_scale, o, lse)
            return
        self._k.ragged.mha(q, k, v, indptr, indptr, a.q_positions, a.k_ragged_offset, True, rope.mode,
                           rope.scale, rope.theta, sm_scale, o, lse)

    def _tree_paged(self, pages, q, o, lse, sm_scale: float) -> None:
        a, rope = self._a, self._rope
        (level,), (mn_indptr, mask) = a.fused, a.tree
        self._k.tree_paged.mha(q, level.qo_indptr, pages, level.page_indptr, level.page_indices, level.length_info,
                               level.k_offset, a.q_positions, mn_indptr, mask, rope.mode, rope.scale, rope.theta,
                               sm_scale, o, lse)

    def _split_append(self, pages, qkv) -> None:
        """self.q <- the query heads of qkv; its key and value heads -> their page slots."""
        a, k = self._a, self._k
        if k.split_rotary_append is not None:
            k.split_rotary_append(qkv, a.q_positions, self.q, pages, a.append_positions, self._apply_rope)
        else:
            k.split_rotary(qkv, a.q_positions, self.q, self.k, self.v, self._apply_rope)
            k.transpose_append(pages, self.k, self.v, a.append_positions)

    def attention_with_fused_qkv(self, pages, qkv, o, sm_scale: float) -> None:
        q, k, v = self.q, self.k, self.v
        if self.tree or self.decode:
            self._split_append(pages, qkv)
        else:
            self._k.split_rotary(qkv, self._a.q_positions, q, k, v, self._apply_rope)
        self.attend(pages, q, k, v, o, sm_scale)
        if not (self.tree or self.decode):
            self._k.transpose_append(pages, k, v, self._a.append_positions)

    def attend(self, pages, q, k, v, o, sm_scale: float) -> None:
        """The attention of a step's tokens over `pages` (history, and the new tokens: in the
        pages in decode and tree steps, in k and v in prefill steps) -> o."""
        if self.tree:
            self._tree_paged(pages, q, o, self.lse, sm_scale)
        elif self.decode:
            self._paged(self._fused, pages, q, o, self.lse, sm_scale, have_output=False)
        else:
            self._ragged(q, k, v, o, self.lse, sm_scale)
            self._paged(self._fused, pages, q, o, self.lse, sm_scale, have_output=True)

    def decode_scratch(self, pages) -> None:
        """The step's paged decode over `pages` from the q workspace into the scratch o/lse
        (PagedKVCache.reserve_decode_workspace: only the launch matters, not the result)."""
        self._paged(self._fused, pages, self.q, self.o_tmp, self.lse_tmp, 1.0, have_output=False)

    def self_attention(self, q, k, v, o, lse, sm_scale: float) -> None:
        self._ragged(q, k, v, o, lse, sm_scale)

    def cross_attention(self, pages, q, o, lse, sm_scale: float) -> None:
        self._paged(self._cross, pages, q, o, lse, sm_scale, have_output=False)

    def query_positions(self):
        return self._a.q_positions
