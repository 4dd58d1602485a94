"""MHA_SLIDING layers: attention over each token's last `layer_sliding_window_size` tokens.

A query at position p of its sequence attends to the keys at positions max(0, p - W + 1) .. p,
W = layer_sliding_window_size: the sliding window of Mistral and of Gemma-2/3's local layers,
in every step. These layers keep their K/V in pages of their own (tvmattn.runtime.slides: a
sequence's pages before its next query's window are recycled when a step is kept), so they
have page tables, append positions and a plan level of their own.

Plan (`window_plan`, host numpy, once per step): one paged-decode request per new token, its
page table the pages its window touches and length_info [3, N] = (slots used in the last
page, slot of the window's first token in the first page, sink 0), read by the
sliding-window decode kernel (`decode_paged_sliding_window`), and the pool position of each
new token in the sliding pages. Launches (`WindowStep`): an MHA_SLIDING layer appends the new
tokens' K/V to its pages first, then runs that one decode launch over all of them; the MHA
layers run the step's usual levels.

Prefill steps whose windows hide nothing (`window_prefill_plan`: no token tree, some
sequence appends more than one token, and every sequence's length after the append is at most
W, so its sliding pages still hold every token and no query's window excludes a key) attend
with the tiled paged prefill kernel instead, one causal request per sequence over its whole sliding page
table: query i of n sees keys 0 .. length - n + i, exactly its window. Other prefill steps keep
the per-token decode (the prefill kernels mask no window's start), as does the CPU over FP8
pages, where the paged prefill is the scalar tile and the per-token decode the faster kernel.

TVM's C++ cache attends the same way in decode steps; in other steps it runs the history's
last W tokens through the causal sliding prefill and the new tokens unwindowed, so a query
there may see more or fewer keys than its window (docs/design.md, "MHA_SLIDING"); it keeps
every token in every layer.
"""

from __future__ import annotations

import operator

import numpy as np

from .forward import Step
from .plan import LevelArrays
from .slides import SlidingPages, ceildiv

_SLIDE_PAGES = operator.attrgetter("slide_pages")
_SLIDE_DROPPED = operator.attrgetter("slide_dropped")
_LENGTH = operator.attrgetter("length")


def _new_tokens(seqs: list, lengths):
    """The sliding page tables of a step's sequences (after the append) and where its new tokens
    are: int64 lengths n [B], page indptr [B+1], the concatenated pages (int32), lengths after
    the append [B], the new tokens' indptr [B+1] and each new token's position [sum n]."""
    batch = len(seqs)
    n = np.asarray(lengths, dtype=np.int64)
    counts = np.fromiter(map(len, map(_SLIDE_PAGES, seqs)), np.int64, batch)
    indptr = np.zeros(batch + 1, dtype=np.int64)
    counts.cumsum(out=indptr[1:])
    pages = np.frombuffer(bytearray(b"".join(map(_SLIDE_PAGES, seqs))), np.int32)
    end = np.fromiter(map(_LENGTH, seqs), np.int64, batch)
    token_start = np.zeros(batch + 1, dtype=np.int64)
    n.cumsum(out=token_start[1:])
    positions = np.repeat(end - n - token_start[:-1], n) + np.arange(int(token_start[-1]))
    return n, indptr, pages, end, token_start, positions


def window_plan(seqs: list, lengths, window: int, page_size: int) -> tuple[LevelArrays, np.ndarray]:
    """The MHA_SLIDING layers' part of a step: seqs are the step's sequences after the append
    (their `slide_pages` hold every new token), lengths [B] the tokens each appended. Returns
    (level, append_positions): int32 arrays page_indptr [N+1], page_indices [nnz], length_info
    [3, N], k_offset [N] (the first key's position), qo_indptr None (paged decode); and each
    new token's pool position in the sliding pages [N]."""
    n, indptr, pages, end, _, p = _new_tokens(seqs, lengths)
    dropped = np.fromiter(map(_SLIDE_DROPPED, seqs), np.int64, len(seqs))
    total = len(p)
    s = np.maximum(p - window + 1, 0)  # its window's first position
    base = np.repeat(indptr[:-1] - dropped, n)  # + a page index: its place in `pages`
    first, last = base + s // page_size, base + p // page_size
    count = last - first + 1
    page_indptr = np.zeros(total + 1, dtype=np.int64)
    count.cumsum(out=page_indptr[1:])
    flat = np.arange(int(page_indptr[-1])) - np.repeat(page_indptr[:-1] - first, count)
    length_info = np.stack([p % page_size + 1, s % page_size, np.zeros_like(p)]).astype(np.int32)
    positions = (pages[last].astype(np.int64) * page_size + p % page_size).astype(np.int32)
    level = LevelArrays(page_indptr.astype(np.int32), pages[flat].astype(np.int32), length_info, s.astype(np.int32),
                        None)
    return level, positions


def window_prefill_plan(seqs: list, lengths, page_size: int) -> tuple[LevelArrays, np.ndarray]:
    """The MHA_SLIDING layers' part of a step whose windows hide nothing (see the module
    docstring; the caller checks that every sequence's length is at most the window, so none
    has dropped a page): one causal paged-prefill request per sequence over its whole sliding
    page table. Returns (level, append_positions) as `window_plan`, the level's length_info [B]
    (the last page's used slots), k_offset [B] zeros, qo_indptr [B+1] the append indptr."""
    batch = len(seqs)
    n, indptr, pages, end, qo_indptr, p = _new_tokens(seqs, lengths)
    positions = (pages[np.repeat(indptr[:-1], n) + p // page_size].astype(np.int64) * page_size
                 + p % page_size).astype(np.int32)
    level = LevelArrays(indptr.astype(np.int32), pages.copy(), ((end - 1) % page_size + 1).astype(np.int32),
                        np.zeros(batch, dtype=np.int32), qo_indptr.astype(np.int32))
    return level, positions


def sliding_pages_held(length: int, window: int, page_size: int) -> int:
    """Pages an MHA_SLIDING layer holds for a sequence of `length` tokens between steps (no
    token tree, no page shared): those from its next query's window on."""
    return ceildiv(length, page_size) - SlidingPages(1, page_size, window).needed_from(length) // page_size


class WindowStep(Step):
    """A step of a cache with MHA_SLIDING layers: Step's launches, and the windowed ones."""

    def __init__(self, plan, arrays, kernels, work: dict, rope, window_decode):
        """window_decode: the sliding-window paged decode backend; a window level planned for
        prefill (`window_prefill_plan`) runs kernels.paged_prefill (a TIR kernel: it has no
        plan step) instead."""
        super().__init__(plan, arrays, kernels, work, rope)
        (level,), (self._slide_positions,) = arrays.window, arrays.slide_positions
        q_positions = arrays.q_positions
        indptr, indices, info, k_offset = level.page_indptr, level.page_indices, level.length_info, level.k_offset
        self.window_kernel = level.kernel
        if level.kernel == "prefill":
            mha, qo_indptr = kernels.paged_prefill.mha, level.qo_indptr

            def run(pages, q, o, lse, sm_scale):
                mha(0, q, qo_indptr, pages, indptr, indices, info, q_positions, k_offset, True, rope.mode,
                    rope.scale, rope.theta, sm_scale, o, lse)
        else:
            mha = window_decode.mha

            def run(pages, q, o, lse, sm_scale):
                mha(0, q, pages, indptr, indices, info, k_offset, q_positions, rope.mode, rope.scale, rope.theta,
                    sm_scale, o, lse)

        self._window_run = run

    def attention_in_window(self, pages, qkv, o, sm_scale: float) -> None:
        """attention_with_fused_qkv of an MHA_SLIDING layer: append to its own pages, then attend
        in the windows."""
        a, k = self._a, self._k
        if k.split_rotary_append is not None:
            k.split_rotary_append(qkv, a.q_positions, self.q, pages, self._slide_positions, self._apply_rope)
        else:
            k.split_rotary(qkv, a.q_positions, self.q, self.k, self.v, self._apply_rope)
            k.transpose_append(pages, self.k, self.v, self._slide_positions)
        self._window_run(pages, self.q, o, self.lse, sm_scale)

    def attend_in_window(self, pages, q, o, sm_scale: float) -> None:
        """The windowed attention of the step's queries q over `pages` (their K/V appended)."""
        self._window_run(pages, q, o, self.lse, sm_scale)

    def window_scratch(self, pages) -> None:
        """The step's windowed attention over `pages` from the q workspace into the scratch o/lse
        (PagedKVCache.reserve_decode_workspace: only the launch matters, not the result)."""
        self._window_run(pages, self.q, self.o_tmp, self.lse_tmp, 1.0)
