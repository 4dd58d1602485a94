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

Cascade (one shared level): a run of adjacent sequences of the batch whose page tables start
with the same full pages (forks of one prefix) attends to those shared pages once, as one
request of a paged prefill holding all their queries (non-causal: every query comes after the
prefix), and attends to the rest of its pages on its own; the two are merged by LSE. A run is
extended while that does not shrink the number of page reads it saves. Windowed sequences do
not take part.

Arrays (name: shape; R = requests of a level, B = batch, N = new tokens):
- q_positions [N] (first, at offset 0, as TVM's query positions are): RoPE position of each new
  token = its sequence's length before the step + its index among the new tokens;
- append_indptr [B+1]; k_ragged_offset [B] (RoPE position of the first new token);
- append_positions [N]: pool position of each new token (-1: dropped by a window, not stored);
- per paged level "<level>.": page_indptr [R+1], page_indices [nnz], length_info [R] or [3, R]
  (last_page_len, window_offset, sink) with sliding-window kernels, k_offset [R] (RoPE
  position of the level's first key); the shared level also qo_indptr [R+1];
- decode steps also "paged.history_length_info": the same tables without the new tokens (a
  last page of length 0 contributes nothing), for cross_attention.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import tvm

from .sequences import Appended, ceildiv
from .upload import make_uploader

ALIGN = 16  # int32 elements: every packed array starts at a 64-byte boundary


class ArraySpec(NamedTuple):
    offset: int  # elements from the start of the buffer
    shape: tuple


@dataclasses.dataclass(frozen=True)
class LevelSpec:
    """One paged attention launch of a step."""

    prefix: str  # name prefix of the level's arrays
    kernel: str  # "prefill" or "decode"
    qo_indptr: str | None  # array name (prefill)
    length_info: str  # array name


@dataclasses.dataclass
class ForwardPlan:
    """Everything a step's launches read, on the host."""

    seq_ids: list
    lengths: list
    total: int
    decode: bool  # append first, then paged decode over whole sequences
    buffer: np.ndarray  # int32, all arrays packed
    specs: dict  # name -> ArraySpec
    host: dict  # name -> the array as packed (for backends' begin_forward)
    fused: list  # LevelSpecs run by attention_with_fused_qkv after the ragged part (prefill)
    cross: list  # LevelSpecs over the history, run by cross_attention


class Packer:
    """Collects named int32 arrays into one buffer, each aligned to ALIGN elements."""

    def __init__(self):
        self.specs: dict[str, ArraySpec] = {}
        self.host: dict[str, np.ndarray] = {}
        self._size = 0

    def add(self, name: str, values) -> None:
        array = np.asarray(values, dtype=np.int32)
        self.specs[name] = ArraySpec(self._size, array.shape)
        self.host[name] = array
        self._size += max(ceildiv(array.size, ALIGN), 1) * ALIGN

    def finish(self) -> np.ndarray:
        buffer = np.empty(self._size, dtype=np.int32)
        for name, spec in self.specs.items():
            array = self.host[name]
            buffer[spec.offset : spec.offset + array.size] = array.ravel()
        return buffer


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
            return np.asarray(last_page_len, dtype=np.int32)
        return np.array([last_page_len, self.window_offset, self.sink], dtype=np.int32)

    def pack(self, packer: Packer, prefix: str, sliding: bool) -> None:
        packer.add(prefix + ".page_indptr", self.page_indptr)
        packer.add(prefix + ".page_indices", self.page_indices)
        packer.add(prefix + ".length_info", self.length_info(self.last_page_len, sliding))
        packer.add(prefix + ".k_offset", self.k_offset)


def build_plan(seq_ids: list, appended: list[Appended], lengths: list, page_size: int, sliding: bool,
               cascade: bool = True) -> ForwardPlan:
    """The plan of a step. appended[i] describes seq_ids[i] (see SequenceTable.reserve);
    sliding: the paged kernels read length_info as [3, R]."""
    decode = all(n == 1 for n in lengths) and not any(a.seq.window_size for a in appended)
    packer = Packer()
    _pack_new_tokens(packer, appended, lengths)
    tables = [a.seq if decode else a.history for a in appended]
    groups = cascade_groups(tables, page_size) if cascade else []
    shared = []
    if groups:
        _shared_table(groups, tables, page_size).pack(packer, "shared", sliding)
        shared = [LevelSpec("shared", "prefill", "shared.qo_indptr", "shared.length_info")]
        packer.add("shared.qo_indptr", _shared_qo_indptr(groups, packer.host["append_indptr"]))
    main = _main_table(tables, groups, page_size)
    main.pack(packer, "paged", sliding)
    if decode:
        history_last = [max(n - 1, 0) for n in main.last_page_len]
        packer.add("paged.history_length_info", main.length_info(history_last, sliding))
        fused = shared + [LevelSpec("paged", "decode", None, "paged.length_info")]
        cross = shared + [LevelSpec("paged", "decode", None, "paged.history_length_info")]
    else:
        kernel = "decode" if all(n == 1 for n in lengths) else "prefill"
        history = LevelSpec("paged", kernel, "append_indptr", "paged.length_info")
        fused = shared + ([history] if main.page_indices else [])
        cross = shared + [history]
    return ForwardPlan(list(seq_ids), list(lengths), sum(lengths), decode, packer.finish(), packer.specs,
                       packer.host, fused, cross)


def _pack_new_tokens(packer: Packer, appended: list[Appended], lengths: list) -> None:
    history = np.array([a.history.length for a in appended], dtype=np.int64)
    indptr = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    positions = np.repeat(history - indptr[:-1], lengths) + np.arange(indptr[-1])
    packer.add("q_positions", positions)
    packer.add("append_indptr", indptr)
    packer.add("k_ragged_offset", history)
    flat: list[int] = []
    for a in appended:
        flat.extend(a.positions)
    packer.add("append_positions", flat)


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


def plan_size_bound(seqs: list, lengths: list, page_size: int) -> int:
    """An upper bound of the packed size (elements) of the plan of a step, known before the
    step changes any page table."""
    pages = sum(len(seq.pages) + ceildiv(n, page_size) + 1 for seq, n in zip(seqs, lengths))
    return 2 * pages + 2 * sum(lengths) + 16 * (len(seqs) + 2) + 24 * ALIGN


class BufferViews:
    """Views into one device buffer, each made once per (shape, dtype, byte offset).

    TVM's Tensor._create_view costs ~5 us of Python; a step needs ~20 views, and consecutive
    decode steps mostly need the same ones (measured: 16 new views were 80 of the 91 us of a
    begin_forward + end_forward at batch 1)."""

    LIMIT = 4096  # forget every view beyond this many (ragged prefill shapes vary freely)

    def __init__(self, buffer):
        self.buffer = buffer
        self._made: dict = {}

    def get(self, shape: tuple, dtype: str, byte_offset: int = 0):
        key = (shape, dtype, byte_offset)
        view = self._made.get(key)
        if view is None:
            if len(self._made) >= self.LIMIT:
                self._made.clear()
            view = self._made[key] = self.buffer._create_view(shape, dtype, byte_offset)
        return view


class DeviceArrays:
    """One device int32 buffer (grown on demand) that receives a packed plan in one copy
    (tvmattn.runtime.upload: without blocking the host on CUDA); kernels get views into it."""

    def __init__(self, device, capacity: int = 1 << 14):
        self.device = device
        self._views = BufferViews(tvm.runtime.empty((capacity,), "int32", device=device))
        self.capacity = capacity
        self._uploader = make_uploader(device)  # non-blocking, stream-ordered on CUDA

    def reserve(self, size: int) -> None:
        if size > self.capacity:
            self.capacity = max(size, 2 * self.capacity)
            self._views = BufferViews(tvm.runtime.empty((self.capacity,), "int32", device=self.device))

    def upload(self, plan: ForwardPlan) -> dict:
        """Copy the plan's buffer to the device; returns name -> int32 view."""
        self.reserve(plan.buffer.size)
        views = self._views
        self._uploader.copy(plan.buffer, views.get(tuple(plan.buffer.shape), "int32"))
        return {name: views.get(tuple(spec.shape), "int32", 4 * spec.offset) for name, spec in plan.specs.items()}
