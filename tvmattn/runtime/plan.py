"""Host planning of one forward step: every index array the step's kernels read, packed into
one int32 buffer that is uploaded to the device with one copy.

Two ways to attend, chosen per step:
- decode (every sequence appends one token and none has a sliding window): the new tokens are
  appended to the pages first, then paged decode runs over each whole sequence;
- prefill (otherwise): ragged causal prefill over the new tokens, merged by LSE with paged
  prefill over each sequence's history (paged decode when every append length is 1), then the
  append. The history is read before this step's tokens are written, as TVM's cache does, so
  a sliding window drops tokens only after the step: the new tokens see the whole cached
  window plus each other.

- tree (some sequence's token tree is not a chain; see tvmattn.runtime.trees): the new tokens
  are appended first, then tree-mask paged prefill runs over each whole sequence (history,
  earlier nodes of its tree and this step's nodes): a node sees the history and its
  ancestors. q_positions are then the committed length plus each node's depth. No cascade.

Two planners build the same plans: `build_plan`, sequence by sequence from the `Appended` of
`SequenceTable.reserve` (every kind of step), and `build_plan_arrays`, with numpy over the
whole batch from the flat tables of `SequenceTable.reserve_plain` (steps without sliding
windows or token trees: the usual decode and prefill steps, which PagedKVCache plans this way).
tests/test_plan_vectorized.py checks that they agree array by array; a change to one needs the
same change to the other.

Cascade (one shared level): a run of adjacent sequences of the batch whose page tables start
with the same full pages (forks of one prefix) attends to those shared pages once, as one
request of a paged prefill holding all their queries (non-causal: every query comes after the
prefix), and attends to the rest of its pages on its own; the two are merged by LSE. A run is
extended while that does not shrink the number of page reads it saves. Windowed sequences do
not take part.

Arrays (`PlanArrays`, one structure whether it holds the host arrays, their places in the
buffer (`ArraySpec`) or device views; packed in field order; R = requests of a level, B = batch,
N = new tokens):
- q_positions [N] (first, at offset 0, as TVM's query positions are): RoPE position of each new
  token = its sequence's length before the step + its index among the new tokens;
- append_indptr [B+1]; k_ragged_offset [B] (RoPE position of the first new token);
- append_positions [N]: pool position of each new token (-1: dropped by a window, not stored);
- fused, cross: the paged levels (`LevelArrays`) that attention_with_fused_qkv (after the ragged
  part in prefill) and cross_attention run, the shared level first. A level: page_indptr [R+1],
  page_indices [nnz], length_info [R] or [3, R] (last_page_len, window_offset, sink) with
  sliding-window kernels, k_offset [R] (RoPE position of the level's first key), and for paged
  prefill qo_indptr [R+1] (the shared level's own; append_indptr for the history level); None
  for paged decode. In a decode step cross's last level has its own length_info: the same
  tables without the new tokens (a last page of length 0 contributes nothing).
- tree: (mn_indptr [B+1], mask [total_nodes, 2]) in a tree step, else absent; fused is then the
  tree level over whole sequences (qo_indptr = append_indptr) and cross the history level.
- window: in caches with MHA_SLIDING layers, their one paged-decode level over their own pages
  (one request per new token, see tvmattn.runtime.windows), else absent; slide_positions [N]
  with it: each new token's pool position in those pages.
Levels share arrays (fused and cross the same tables; append_indptr as qo_indptr); each array
is packed once, where it first appears.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Callable, Generic, Hashable, NamedTuple, TypeVar

import numpy as np
import tvm

from .sequences import Appended, AppendedArrays, TableArrays
from .trees import TreeStep
from .upload import make_uploader

ALIGN = 16  # int32 elements: every packed array starts at a 64-byte boundary

T = TypeVar("T")  # what a field holds: np.ndarray (host), ArraySpec (packed), a device view
U = TypeVar("U")


class ArraySpec(NamedTuple):
    offset: int  # elements from the start of the buffer
    shape: tuple


class LevelArrays(NamedTuple, Generic[T]):
    """What one paged attention launch of a step reads (R requests; see the module docstring)."""

    page_indptr: T  # [R+1]
    page_indices: T  # [nnz]
    length_info: T  # [R], or [3, R] with sliding-window kernels
    k_offset: T  # [R]
    qo_indptr: T | None  # [R+1] for paged prefill; None: paged decode (one query per request)

    @property
    def kernel(self) -> str:
        """The paged kernel that runs this level: "prefill" or "decode"."""
        return "decode" if self.qo_indptr is None else "prefill"

    def map(self, f: Callable[[T], U]) -> LevelArrays[U]:
        qo_indptr = self.qo_indptr
        return LevelArrays(f(self.page_indptr), f(self.page_indices), f(self.length_info), f(self.k_offset),
                           None if qo_indptr is None else f(qo_indptr))


class PlanArrays(NamedTuple, Generic[T]):
    """Every index array of a step, in packing order (see the module docstring)."""

    q_positions: T  # [N]
    append_indptr: T  # [B+1]
    k_ragged_offset: T  # [B]
    append_positions: T  # [N]
    fused: tuple[LevelArrays[T], ...]  # run by attention_with_fused_qkv (after the ragged part in prefill)
    cross: tuple[LevelArrays[T], ...]  # over the history, run by cross_attention
    tree: tuple[T, ...] = ()  # (tree_attn_mn_indptr, tree_attn_mask) in a tree step
    window: tuple[LevelArrays[T], ...] = ()  # the MHA_SLIDING layers' level (tvmattn.runtime.windows)
    slide_positions: tuple[T, ...] = ()  # [N]: their pool position of each new token (with `window`)

    def map(self, f: Callable[[T], U]) -> PlanArrays[U]:
        """The same arrays with f applied to each, in packing order."""
        return PlanArrays(f(self.q_positions), f(self.append_indptr), f(self.k_ragged_offset),
                          f(self.append_positions), tuple([level.map(f) for level in self.fused]),
                          tuple([level.map(f) for level in self.cross]), tuple([f(a) for a in self.tree]),
                          tuple([level.map(f) for level in self.window]), tuple([f(a) for a in self.slide_positions]))


@dataclasses.dataclass
class ForwardPlan:
    """Everything a step's launches read, on the host."""

    seq_ids: list
    lengths: list
    total: int
    decode: bool  # append first, then paged decode over whole sequences
    tree: bool  # append first, then tree-mask paged prefill over whole sequences
    buffer: np.ndarray  # int32, all arrays packed
    specs: PlanArrays[ArraySpec]  # where each array lies in buffer
    host: PlanArrays[np.ndarray]  # the arrays as packed (for backends' begin_forward)


class Packer:
    """Packs int32 arrays into one buffer, each aligned to ALIGN elements and stored once
    however often a plan refers to it."""

    def __init__(self):
        self._specs: dict[int, ArraySpec] = {}  # id(array) -> its place
        self._arrays: list[np.ndarray] = []  # in the order of _specs
        self._size = 0

    def add(self, array: np.ndarray) -> ArraySpec:
        spec = self._specs.get(id(array))
        if spec is None:
            spec = self._specs[id(array)] = ArraySpec(self._size, array.shape)
            self._arrays.append(array)
            self._size += -(-array.size // ALIGN) * ALIGN or ALIGN  # an empty array takes ALIGN too
        return spec

    def finish(self) -> np.ndarray:
        buffer = np.empty(self._size, dtype=np.int32)
        for spec, array in zip(self._specs.values(), self._arrays):
            buffer[spec.offset : spec.offset + array.size] = array.ravel()
        return buffer


def _int32(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


class PagedTable:
    """Page tables of one paged level, built request by request."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.page_indptr = [0]
        self.page_indices: list[int] = []
        self.last_page_len: list[int] = []
        self.window_offset: list[int] = []
        self.sink: list[int] = []
        self.k_offset: list[int] = []

    def add(self, pages: list, slot_end: int, window_offset: int = 0, sink: int = 0, k_offset: int = 0) -> None:
        """A request over `pages` whose used slots end at `slot_end` (counted from pages[0])."""
        self.page_indices.extend(pages)
        self.page_indptr.append(len(self.page_indices))
        self.last_page_len.append(slot_end - (len(pages) - 1) * self.page_size if pages else 0)
        self.window_offset.append(window_offset)
        self.sink.append(sink)
        self.k_offset.append(k_offset)

    def length_info(self, last_page_len: list, sliding: bool) -> np.ndarray:
        if not sliding:
            return _int32(last_page_len)
        return np.array([last_page_len, self.window_offset, self.sink], dtype=np.int32)

    def arrays(self, sliding: bool, qo_indptr: np.ndarray | None) -> LevelArrays[np.ndarray]:
        return LevelArrays(_int32(self.page_indptr), _int32(self.page_indices),
                           self.length_info(self.last_page_len, sliding), _int32(self.k_offset), qo_indptr)


def build_plan(seq_ids: list, appended: list[Appended], lengths: list, page_size: int, sliding: bool,
               cascade: bool = True, tree: TreeStep | None = None) -> ForwardPlan:
    """The plan of a step. appended[i] describes seq_ids[i] (see SequenceTable.reserve);
    sliding: the paged kernels read length_info as [3, R]; tree: the arrays of a tree step."""
    if tree is not None:
        return _tree_plan(seq_ids, appended, lengths, page_size, sliding, tree)
    decode = all(n == 1 for n in lengths) and not any(a.seq.window_size for a in appended)
    q_positions, indptr, k_ragged_offset, append_positions = _new_tokens(appended, lengths)
    tables = [a.seq if decode else a.history for a in appended]
    groups = cascade_groups(tables, page_size) if cascade else []
    shared = []
    if groups:
        qo_indptr = _int32(_shared_qo_indptr(groups, indptr))
        shared = [_shared_table(groups, tables, page_size).arrays(sliding, qo_indptr)]
    main = _main_table(tables, groups, page_size)
    if decode:
        paged = main.arrays(sliding, None)
        history_last = [max(n - 1, 0) for n in main.last_page_len]
        history = paged._replace(length_info=main.length_info(history_last, sliding))
        fused, cross = shared + [paged], shared + [history]
    else:
        paged = main.arrays(sliding, None if all(n == 1 for n in lengths) else indptr)
        fused = shared + ([paged] if main.page_indices else [])
        cross = shared + [paged]
    host = PlanArrays(q_positions, indptr, k_ragged_offset, append_positions, tuple(fused), tuple(cross))
    return _pack(seq_ids, lengths, decode, False, host)


def build_plan_arrays(seq_ids: list, lengths: list, batch: AppendedArrays, page_size: int, sliding: bool,
                      cascade: bool = True) -> ForwardPlan:
    """`build_plan` for a batch without sliding windows or token trees, from the flat tables of
    `SequenceTable.reserve_plain`, with numpy over the whole batch: exactly the same arrays.
    Python loops run only over cascade groups (and over the batch when some neighbours share
    their first page, see cascade_groups_arrays)."""
    n, decode = batch.lengths, batch.decode
    groups = cascade_groups_arrays(batch.seqs, page_size) if decode and cascade and batch.shared else []
    if decode and not groups:
        return _decode_plan(seq_ids, lengths, batch, page_size, sliding)
    history = batch.history.slot_end.astype(np.int32)  # the lengths before the step
    if decode:  # one token per sequence: its position is the history length
        indptr, q_positions = np.arange(len(n) + 1, dtype=np.int32), history.copy()
    else:
        indptr = np.zeros(len(n) + 1, dtype=np.int32)
        n.cumsum(out=indptr[1:])
        q_positions = np.repeat(history - indptr[:-1], n) + np.arange(indptr[-1], dtype=np.int32)
    tables = batch.seqs if decode else batch.history
    if not decode:
        groups = cascade_groups_arrays(tables, page_size) if cascade and batch.shared else []
    shared = []
    if groups:
        qo_indptr = _int32(_shared_qo_indptr(groups, indptr))
        shared = [_shared_table_arrays(groups, tables, page_size).arrays(sliding, qo_indptr)]
    page_indptr, page_indices, last_page_len, k_offset = _main_arrays(tables, groups, page_size)
    paged = LevelArrays(page_indptr, page_indices, _length_info(last_page_len, sliding), k_offset,
                        None if decode else indptr)
    if decode:
        fused = shared + [paged]
        history_info = _length_info(np.maximum(last_page_len - 1, 0), sliding)
        cross = shared + [paged._replace(length_info=history_info)]
    else:
        fused = shared + ([paged] if page_indices.size else [])
        cross = shared + [paged]
    host = PlanArrays(q_positions, indptr, history, batch.positions, tuple(fused), tuple(cross))
    return _pack(seq_ids, lengths, decode, False, host)


def _decode_plan(seq_ids: list, lengths: list, batch: AppendedArrays, page_size: int, sliding: bool) -> ForwardPlan:
    """build_plan_arrays of a decode step without cascade (the usual decode step), in as few
    numpy calls as it takes: the token of a sequence whose history ends at slot s goes to slot
    s % page_size of its last page, so the last page holds s % page_size + 1 slots after the
    append and s % page_size before it (the history level's length)."""
    tables, before = batch.seqs, batch.history.slot_end
    history = before.astype(np.int32)  # the lengths before the step
    used = (before % page_size).astype(np.int32)
    indptr, k_offset = _decode_constants(len(lengths))
    paged = LevelArrays(tables.indptr, tables.pages, _length_info(used + 1, sliding), k_offset, None)
    host = PlanArrays(history.copy(), indptr, history, batch.positions, (paged,),
                      (paged._replace(length_info=_length_info(used, sliding)),))
    return _pack_decode(seq_ids, lengths, host)


@functools.lru_cache(maxsize=64)
def _decode_constants(batch: int) -> tuple:
    """Read-only int32 arrays of a decode plan of `batch` sequences: append_indptr 0..batch and
    k_offset (zeros)."""
    indptr, zeros = np.arange(batch + 1, dtype=np.int32), np.zeros(batch, dtype=np.int32)
    indptr.flags.writeable = zeros.flags.writeable = False
    return indptr, zeros


# (batch, length_info's ndim) -> (template specs, the offsets of _decode_arrays, the places of the
# elements of all but the last of them); the page indices come last, so a plan with P of them has
# the template's specs with page_indices (offset, (P,)) and a buffer of offset + P elements
# (rounded up to ALIGN)
_DECODE_LAYOUTS: dict[tuple, tuple] = {}
# (batch, page indices, length_info's ndim) -> (specs, buffer size): the specs of one layout are
# one object (DeviceArrays.upload finds its views by identity)
_DECODE_SPECS: dict[tuple, tuple] = {}


def _decode_arrays(host: PlanArrays) -> tuple:
    """The distinct arrays of a one-level decode plan, in packing order (fused and cross share
    their page tables and k_offset; cross has its own length_info; page indices last)."""
    (level,), (history,) = host.fused, host.cross
    return (host.q_positions, host.append_indptr, host.k_ragged_offset, host.append_positions, level.page_indptr,
            level.length_info, level.k_offset, history.length_info, level.page_indices)


def _pack_decode(seq_ids: list, lengths: list, host: PlanArrays[np.ndarray]) -> ForwardPlan:
    """`_pack` of a decode plan without cascade: its layout depends only on the batch size and
    the number of page indices (the template of the batch size, computed once by _pack, with
    the page indices' shape); the arrays are copied into their places."""
    level = host.fused[0]
    batch, pages, ndim = len(lengths), level.page_indices.size, level.length_info.ndim
    template = _DECODE_LAYOUTS.get((batch, ndim))
    if template is None:
        plan = _pack(seq_ids, lengths, True, False, host)
        (fused,), (cross,) = plan.specs.fused, plan.specs.cross
        offsets = [spec.offset for spec in _decode_arrays(plan.specs)]
        assert (fused.page_indptr, fused.page_indices, fused.k_offset) == \
            (cross.page_indptr, cross.page_indices, cross.k_offset) and offsets == sorted(set(offsets))
        if len(_DECODE_LAYOUTS) >= BufferViews.LIMIT:
            _DECODE_LAYOUTS.clear()
        # the places of every element of the arrays before the page indices, in order (one
        # scatter of their concatenation packs them: fewer numpy calls than a copy per array)
        places = np.concatenate([np.arange(spec.offset, spec.offset + math.prod(spec.shape))
                                 for spec in _decode_arrays(plan.specs)[:-1]])
        _DECODE_LAYOUTS[(batch, ndim)] = (plan.specs, offsets, places)
        return plan
    specs, size = _DECODE_SPECS.get((batch, pages, ndim)) or _decode_specs(template, batch, pages, ndim)
    buffer = np.empty(size, dtype=np.int32)
    *head, indices = _decode_arrays(host)
    buffer[template[2]] = np.concatenate(head, axis=None)  # (axis None: the 2-D length_info of windows, flat)
    buffer[template[1][-1] : template[1][-1] + pages] = indices
    return ForwardPlan(list(seq_ids), list(lengths), batch, True, False, buffer, specs, host)


def _decode_specs(template: tuple, batch: int, pages: int, ndim: int) -> tuple:
    """(specs, buffer size) of a decode plan of `pages` page indices from its batch's template."""
    specs, offsets = template[:2]
    indices = ArraySpec(offsets[-1], (pages,))
    (fused,), (cross,) = specs.fused, specs.cross
    specs = specs._replace(fused=(fused._replace(page_indices=indices),), cross=(cross._replace(page_indices=indices),))
    if len(_DECODE_SPECS) >= BufferViews.LIMIT:
        _DECODE_SPECS.clear()
    layout = _DECODE_SPECS[(batch, pages, ndim)] = (specs, offsets[-1] + (-(-pages // ALIGN) * ALIGN or ALIGN))
    return layout


def _length_info(last_page_len: np.ndarray, sliding: bool) -> np.ndarray:
    """PagedTable.length_info without sliding windows from last_page_len [R] int32: itself, or
    [3, R] (last_page_len, window_offset = 0, sink = 0) for sliding-window kernels."""
    if not sliding:
        return last_page_len
    info = np.zeros((3, len(last_page_len)), dtype=np.int32)
    info[0] = last_page_len
    return info


def _main_arrays(tables: TableArrays, groups: list, page_size: int) -> tuple:
    """_main_table over flat tables: each sequence's pages after its shared prefix. Returns
    int32 page_indptr [B+1], page_indices [nnz], last_page_len [B] and k_offset [B] (without
    cascade groups the first two are the tables' own arrays)."""
    if not groups:
        last_page_len = (tables.slot_end - (tables.counts - 1) * page_size).astype(np.int32)
        if not tables.counts.all():
            last_page_len[tables.counts == 0] = 0
        return tables.indptr, tables.pages, last_page_len, np.zeros(len(tables.counts), dtype=np.int32)
    skip = np.zeros(len(tables.counts), dtype=np.int64)  # shared pages per sequence
    for begin, end, shared in groups:
        skip[begin:end] = shared
    counts = tables.counts - skip
    indptr = np.zeros(len(counts) + 1, dtype=np.int32)
    counts.cumsum(out=indptr[1:])
    within = np.arange(len(tables.pages)) - np.repeat(tables.indptr[:-1], tables.counts)
    pages = tables.pages[within >= np.repeat(skip, tables.counts)]  # without each one's first skip[b]
    last_page_len = np.where(counts > 0, tables.slot_end - (tables.counts - 1) * page_size, 0).astype(np.int32)
    return indptr, pages, last_page_len, (skip * page_size).astype(np.int32)


def _shared_table_arrays(groups: list, tables: TableArrays, page_size: int) -> PagedTable:
    """_shared_table over flat tables (a request per group and per run between groups)."""
    table = PagedTable(page_size)
    for kind, begin, end, shared in _shared_requests(groups, len(tables.slot_end)):
        if kind == "group":
            start = int(tables.indptr[begin])
            table.add(tables.pages[start : start + shared].tolist(), shared * page_size)
        else:
            table.add([], 0)
    return table


def cascade_groups_arrays(tables: TableArrays, page_size: int) -> list[tuple[int, int, int]]:
    """cascade_groups over flat tables (no sliding windows). Without two neighbours that share
    their first full page (the usual batch) no Python loop runs; otherwise the greedy scan of
    cascade_groups runs over the common prefixes of neighbours: within a group every sequence
    shares `shared` pages with the group's first one, so its common prefix with that one is its
    common prefix with its predecessor, capped at `shared`."""
    if len(tables.slot_end) < 2 or not tables.pages.size:
        return []
    full = tables.slot_end // page_size
    starts = tables.indptr[:-1]
    first = tables.pages[np.minimum(starts, len(tables.pages) - 1)]  # a sequence with full > 0 has pages
    candidates = np.flatnonzero((full[:-1] > 0) & (full[1:] > 0) & (first[:-1] == first[1:]))
    if not candidates.size:
        return []
    neighbour = [0] * len(full)  # neighbour[j]: common full pages of sequences j - 1 and j
    for b in candidates.tolist():
        limit = int(min(full[b], full[b + 1]))
        a = tables.pages[starts[b] : starts[b] + limit]
        differ = np.flatnonzero(a != tables.pages[starts[b + 1] : starts[b + 1] + limit])
        neighbour[b + 1] = int(differ[0]) if differ.size else limit
    full = full.tolist()
    groups, i = [], 0
    while i < len(full):
        shared, j = full[i], i + 1
        while j < len(full):
            common = min(shared, full[j], neighbour[j])
            if common == 0 or (j - i) * common < (j - i - 1) * shared:
                break
            shared, j = common, j + 1
        if j - i >= 2:
            groups.append((i, j, shared))
        i = j
    return groups


def _tree_plan(seq_ids: list, appended: list[Appended], lengths: list, page_size: int, sliding: bool,
               tree: TreeStep) -> ForwardPlan:
    """A tree step (see the module docstring)."""
    _, indptr, k_ragged_offset, append_positions = _new_tokens(appended, lengths)
    whole = _main_table([a.seq for a in appended], [], page_size).arrays(sliding, indptr)
    history = _main_table([a.history for a in appended], [], page_size)
    cross = history.arrays(sliding, None if all(n == 1 for n in lengths) else indptr)
    host = PlanArrays(tree.q_positions, indptr, k_ragged_offset, append_positions, (whole,), (cross,),
                      (tree.mn_indptr, tree.mask))
    return _pack(seq_ids, lengths, False, True, host)


def with_window(plan: ForwardPlan, level: LevelArrays[np.ndarray], positions: np.ndarray) -> ForwardPlan:
    """`plan` with the MHA_SLIDING layers' level and append positions added, packed after the
    plan's own arrays (which keep their places: a decode plan's layout stays the one of its batch)."""
    packer = Packer()
    window, slide = level.map(packer.add), packer.add(positions)
    base = plan.buffer.size  # (a multiple of ALIGN)

    def shift(spec: ArraySpec) -> ArraySpec:
        return ArraySpec(spec.offset + base, spec.shape)

    specs = plan.specs._replace(window=(window.map(shift),), slide_positions=(shift(slide),))
    host = plan.host._replace(window=(level,), slide_positions=(positions,))
    return dataclasses.replace(plan, buffer=np.concatenate([plan.buffer, packer.finish()]), specs=specs, host=host)


def _pack(seq_ids: list, lengths: list, decode: bool, tree: bool, host: PlanArrays[np.ndarray]) -> ForwardPlan:
    """Every array of `host` packed in field order, except the levels' page indices, which come
    last (in level order): the other arrays' places then depend only on the batch, so steps
    whose page counts differ share their device views."""
    packer = Packer()
    late = [level.page_indices for level in (*host.fused, *host.cross, *host.window)]
    late_ids = set(map(id, late))
    host.map(lambda array: None if id(array) in late_ids else packer.add(array))
    for array in late:
        packer.add(array)
    specs = host.map(packer.add)
    return ForwardPlan(list(seq_ids), list(lengths), sum(lengths), decode, tree, packer.finish(), specs, host)


def _new_tokens(appended: list[Appended], lengths: list) -> tuple:
    """q_positions, append_indptr, k_ragged_offset, append_positions."""
    history = np.array([a.history.length for a in appended], dtype=np.int32)
    indptr = np.array([0, *itertools.accumulate(lengths)], dtype=np.int32)
    positions = np.repeat(history - indptr[:-1], lengths) + np.arange(indptr[-1], dtype=np.int32)
    flat: list[int] = []
    for a in appended:
        flat.extend(a.positions)
    return positions, indptr, history, _int32(flat)


def _main_table(tables: list, groups: list, page_size: int) -> PagedTable:
    """Each sequence's pages after its shared prefix (all of them outside a cascade group)."""
    start = [0] * len(tables)
    for begin, end, shared in groups:
        start[begin:end] = [shared] * (end - begin)
    table = PagedTable(page_size)
    for seq, skip in zip(tables, start):
        pages = seq.pages[skip:] if skip else seq.pages
        table.add(pages, seq.slot_end - skip * page_size, seq.window_offset, seq.sink, skip * page_size)
    return table


def _shared_table(groups: list, tables: list, page_size: int) -> PagedTable:
    """One request per cascade group (its shared pages) and one empty request per run of
    sequences between groups."""
    table = PagedTable(page_size)
    for kind, begin, end, shared in _shared_requests(groups, len(tables)):
        if kind == "group":
            table.add(tables[begin].pages[:shared], shared * page_size)
        else:
            table.add([], 0)
    return table


def _shared_qo_indptr(groups: list, indptr: np.ndarray) -> list:
    bounds = [0]
    for _, _, end, _ in _shared_requests(groups, len(indptr) - 1):
        bounds.append(int(indptr[end]))
    return bounds


def _shared_requests(groups: list, batch: int):
    """(kind, begin, end, shared pages) covering sequences 0..batch-1 in order."""
    cursor = 0
    for begin, end, shared in groups:
        if cursor < begin:
            yield "empty", cursor, begin, 0
        yield "group", begin, end, shared
        cursor = end
    if cursor < batch:
        yield "empty", cursor, batch, 0


def cascade_groups(tables: list, page_size: int) -> list[tuple[int, int, int]]:
    """Runs (begin, end, shared pages) of adjacent sequences sharing full leading pages."""
    full = [0 if seq.window_size else seq.slot_end // page_size for seq in tables]
    groups, i = [], 0
    while i < len(tables):
        shared, j = full[i], i + 1
        while j < len(tables):
            common = common_prefix(tables[i].pages, tables[j].pages, min(shared, full[j]))
            if common == 0 or (j - i) * common < (j - i - 1) * shared:
                break
            shared, j = common, j + 1
        if j - i >= 2:
            groups.append((i, j, shared))
        i = j
    return groups


def common_prefix(a: list, b: list, limit: int) -> int:
    """Length of the common prefix of a and b, at most `limit` (binary search on slices)."""
    if limit == 0 or a[0] != b[0]:
        return 0
    if a[:limit] == b[:limit]:
        return limit
    low, high = 1, limit  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


def plan_size_bound(pages: int, lengths: list, page_size: int, tree_nodes: int = 0) -> int:
    """An upper bound of the packed size (elements) of the plan of a step, known before the
    step changes any page table: pages, the step's sequences' pages in all; tree_nodes, the
    nodes of the step's token trees."""
    # sum(ceil(n / page_size) + 1) <= sum(n) // page_size + 2 * len(lengths)
    pages += sum(lengths) // page_size + 2 * len(lengths)
    return 2 * pages + 2 * sum(lengths) + 2 * tree_nodes + 16 * (len(lengths) + 2) + 26 * ALIGN


class BufferViews(dict):
    """Views into one device buffer, each made once: views[key] is the view that place(key) =
    (shape, dtype, byte offset) describes.

    TVM's Tensor._create_view runs a fair amount of Python; a step needs a few dozen views, and
    consecutive decode steps mostly need the same ones, so making them anew would dominate a
    small decode step's host time."""

    LIMIT = 4096  # forget every view beyond this many (ragged prefill shapes vary freely)

    def __init__(self, buffer, place: Callable[[Hashable], tuple]):
        super().__init__()
        self.buffer = buffer
        self._place = place

    def __missing__(self, key):
        if len(self) >= self.LIMIT:
            self.clear()
        view = self[key] = self.buffer._create_view(*self._place(key))
        return view


def _int32_place(spec: ArraySpec) -> tuple:
    return spec.shape, "int32", 4 * spec.offset


class DeviceArrays:
    """One device int32 buffer (grown on demand) that receives a packed plan in one copy
    (tvmattn.runtime.upload: without blocking the host on CUDA); kernels get views into it."""

    def __init__(self, device, capacity: int = 1 << 14):
        self.device = device
        self.capacity = 0
        self._uploader = make_uploader(device)  # non-blocking, stream-ordered on CUDA
        self.reserve(capacity)

    def reserve(self, size: int) -> None:
        if size > self.capacity:
            self.capacity = max(size, 2 * self.capacity)
            buffer = tvm.runtime.empty((self.capacity,), "int32", device=self.device)
            self._views = BufferViews(buffer, _int32_place)
            # a plan's layout -> its views (consecutive decode steps mostly share one)
            self._layouts: dict[PlanArrays[ArraySpec], PlanArrays] = {}
            self._last: tuple = (None, None)  # (specs, views) of the last upload

    def upload(self, plan: ForwardPlan) -> PlanArrays:
        """Copy the plan's buffer to the device; returns its arrays as int32 views."""
        self.reserve(plan.buffer.size)
        specs, arrays = self._last
        if specs is not plan.specs:  # (steady decode steps share one layout object: no lookups)
            arrays = self._layouts.get(plan.specs)
            if arrays is None:
                if len(self._layouts) >= BufferViews.LIMIT:
                    self._layouts.clear()
                arrays = self._layouts[plan.specs] = plan.specs.map(self._views.__getitem__)
            self._last = (plan.specs, arrays)
        self._uploader.copy(plan.buffer, self._views.buffer)  # (into the buffer's first elements)
        return arrays
