"""MHA_SLIDING layers: attention over each token's last `layer_sliding_window_size` tokens.

Such a layer keeps every token in its pages (the cache's other layers see them all; no page
is freed), and a query at position p of its sequence attends to the keys at positions
max(0, p - W + 1) .. p, W = layer_sliding_window_size: the sliding window of Mistral and of
Gemma-2/3's local layers, in every step.

Plan (`window_level`, host numpy, once per step): one paged-decode request per new token,
its page table the pages its window touches and length_info [3, N] = (slots used in the last
page, slot of the window's first token in the first page, sink 0), read by the
sliding-window decode kernel (`decode_paged_sliding_window`). Launches (`WindowStep`): the
new tokens' K/V are appended first, then that one decode launch over all of them. A step whose
sequences are all no longer than W (after the append) needs no window: there the cache plans
no level and MHA_SLIDING layers run as MHA layers (the same keys, cascade and prefill kernels).

TVM's C++ cache attends the same way in decode steps; in other steps it runs the history's
last W tokens through the causal sliding prefill and the new tokens unwindowed, so a query
there may see more or fewer keys than its window (docs/design.md, "MHA_SLIDING").
"""

from __future__ import annotations

import numpy as np

from .forward import Step
from .plan import LevelArrays
from .sequences import TableArrays


def window_level(tables: TableArrays, lengths: np.ndarray, window: int, page_size: int) -> LevelArrays:
    """The level of one step: tables are the step's sequences after the append (lengths =
    slot_end, no sequence windows), lengths [B] the tokens each appended. Returns int32 arrays:
    page_indptr [N+1], page_indices [nnz], length_info [3, N], k_offset [N] (first key's
    position); qo_indptr None (paged decode)."""
    n = np.asarray(lengths, dtype=np.int64)
    total = int(n.sum())
    token_start = np.zeros(len(n) + 1, dtype=np.int64)
    n.cumsum(out=token_start[1:])
    end = tables.slot_end.astype(np.int64)
    p = np.repeat(end - n - token_start[:-1], n) + np.arange(total)  # each new token's position
    s = np.maximum(p - window + 1, 0)  # its window's first position
    first, last = s // page_size, p // page_size
    count = last - first + 1
    page_indptr = np.zeros(total + 1, dtype=np.int64)
    count.cumsum(out=page_indptr[1:])
    base = np.repeat(tables.indptr[:-1].astype(np.int64), n) + first  # its first page in tables.pages
    flat = np.arange(int(page_indptr[-1])) - np.repeat(page_indptr[:-1] - base, count)
    length_info = np.stack([p % page_size + 1, s % page_size, np.zeros_like(p)]).astype(np.int32)
    return LevelArrays(page_indptr.astype(np.int32), tables.pages[flat].astype(np.int32), length_info,
                       s.astype(np.int32), None)


class WindowStep(Step):
    """A step of a cache with MHA_SLIDING layers: Step's launches, and the windowed ones."""

    def __init__(self, plan, arrays, kernels, work: dict, rope, window_decode):
        super().__init__(plan, arrays, kernels, work, rope)
        (level,) = arrays.window
        mha, q_positions = window_decode.mha, arrays.q_positions
        indptr, indices, info, k_offset = level.page_indptr, level.page_indices, level.length_info, level.k_offset

        def run(pages, q, o, lse, sm_scale):
            mha(0, q, pages, indptr, indices, info, k_offset, q_positions, rope.mode, rope.scale, rope.theta,
                sm_scale, o, lse)

        self._window_run = run

    def attention_in_window(self, pages, qkv, o, sm_scale: float) -> None:
        """attention_with_fused_qkv of an MHA_SLIDING layer: append, then attend in the windows."""
        self._split_append(pages, qkv)
        self._window_run(pages, self.q, o, self.lse, sm_scale)

    def attend_in_window(self, pages, q, o, sm_scale: float) -> None:
        """The windowed attention of the step's queries q over `pages` (their K/V appended)."""
        self._window_run(pages, q, o, self.lse, sm_scale)
