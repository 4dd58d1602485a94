"""Sequence bookkeeping: each sequence's page table and length, forks, popn, sliding windows.

A sequence's K/V lives in `pages` (page ids, in order); `page_size` consecutive *slots* make a
page, so slot `s` is slot `s % page_size` of page `pages[s // page_size]` and has the pool
position `pages[s // page_size] * page_size + s % page_size`.

Token `t` of a sequence (0 <= t < length) is in slot `t` unless a sliding window has dropped
tokens. A windowed sequence (window_size > 0) keeps its first `sink_size` tokens (the
attention sink) and its most recent tokens, `window_size` in all. Once its window first
slides, `sink` = sink_size and token `t` is in slot `t` when `t < sink`, else in slot
`t - sink + window_offset`. Pages that hold only dropped tokens are released and removed from
the page table, which shifts the later slots down by a page each (so `window_offset` stays
within the page after the last sink page). This is the layout TVM's cache keeps and the
sliding-window kernels read: length_info = (last_page_len, window_offset, sink).

Invariant: `len(pages) == ceil(slot_end / page_size)` with `slot_end = window_offset + length -
sink`, the slot after the last token.

Page tables are `array.array("i")` (int32): list-like for the per-sequence code, and a
batch's tables join into one numpy array without a Python loop (`TableArrays.gather`).

Sharing: pages are reference counted (`PageAllocator`). A fork shares its parent's full pages
and gets a private copy of a partly filled page at the fork point (a `PageCopy` the cache runs
for every layer), so it never sees its parent's later tokens. `popn` may leave a sequence
whose last page is shared and partly filled (popping into a shared prefix); the next append
first copies that page (copy-on-write). Every mutating method validates first; `reserve`
undoes its page changes when it runs out of pages.

MHA_SLIDING layers (`slides`, tvmattn.runtime.slides): each sequence also has `slide_pages`,
the pages of those layers from its next query's window on, over an allocator of their own.
Every method here keeps them beside `pages`: reserves take their pages too (journaled, undone
with the step), a kept step releases the ones before the window, fork and popn refuse positions
whose window they released.

Steps: `reserve` / `reserve_plain` append a forward step's tokens and keep what it takes to
undo them (the sequences' lengths and page-table ends, or copies of the sequences, and the
allocator's journal of the step); `commit_step` keeps the step, `rollback_step` puts every
sequence, page and reference count back as it was before the reserve. Any other change of
the table but `add` commits a step still open (the cache commits or rolls back first). A window slides
only when a step is committed (or a token tree's path is, `commit_trees`), never while the
step's rows may be rolled back: the pages it frees are then never written by the step, and a
sequence with an uncommitted token tree keeps every node until the commit, which keeps the
tokens that appending the accepted path one by one would keep.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from array import array
from typing import NamedTuple

import numpy as np

from .errors import KVCacheError, check, check_int
from .pages import PageAllocator
from .slides import SlidingPages


def ceildiv(a: int, b: int) -> int:
    return -(-a // b)


def page_array(pages=()) -> array:
    """A page table: an int32 array.array of page ids."""
    return array("i", pages)


class PageCopy(NamedTuple):
    """Copy slots [0, length) of page `src` to page `dst`: every layer's pool except the
    MHA_SLIDING layers', or (sliding) only theirs (see SlidingPages)."""

    src: int
    dst: int
    length: int
    sliding: bool = False


@dataclasses.dataclass(slots=True)
class Sequence:
    """One sequence's state (see the module docstring for the slot layout)."""

    seq_id: int
    pages: array = dataclasses.field(default_factory=page_array)  # int32 page ids
    length: int = 0
    window_size: int = 0  # 0: no sliding window
    sink_size: int = 0  # attention-sink tokens requested with the window
    sink: int = 0  # sink tokens in effect (0 until the window first slides)
    window_offset: int = 0  # slot of the first windowed token
    tree: list = dataclasses.field(default_factory=list)  # parents of the uncommitted token tree's nodes
    # the MHA_SLIDING layers' page table (SlidingPages): token t is in slot t % page_size of
    # slide_pages[t // page_size - slide_dropped]; the first slide_dropped pages were released
    slide_pages: array = dataclasses.field(default_factory=page_array)
    slide_dropped: int = 0

    @property
    def tree_tokens(self) -> int:
        """Tokens of the uncommitted token tree (the sequence's last ones)."""
        return len(self.tree)

    @property
    def slot_end(self) -> int:
        return self.window_offset + self.length - self.sink

    def last_page_len(self, page_size: int) -> int:
        """Used slots of the last page (0 without pages)."""
        return self.slot_end - (len(self.pages) - 1) * page_size if self.pages else 0

    def copy(self) -> "Sequence":
        return Sequence(self.seq_id, page_array(self.pages), self.length, self.window_size, self.sink_size,
                        self.sink, self.window_offset, list(self.tree), page_array(self.slide_pages),
                        self.slide_dropped)

    def assign(self, other: "Sequence") -> None:
        """Take every field of `other` (used to roll back)."""
        for field in self.__slots__:
            setattr(self, field, getattr(other, field))

    def positions(self, start: int, end: int, page_size: int) -> np.ndarray:
        """Pool positions [end - start] int32 of tokens start .. end-1."""
        tokens = np.arange(start, end)
        slots = np.where(tokens < self.sink, tokens, tokens - self.sink + self.window_offset)
        pages = np.asarray(self.pages, dtype=np.int64)[slots // page_size]
        return (pages * page_size + slots % page_size).astype(np.int32)

    def slide_positions(self, start: int, end: int, page_size: int, released: int = -1) -> np.ndarray:
        """Pool positions [end - start] int32 of tokens start .. end-1 in the MHA_SLIDING layers'
        pages; a token they released is at that slot of page `released` (-1: none may be)."""
        tokens = np.arange(start, end)
        index = tokens // page_size - self.slide_dropped
        gone = index < 0
        assert released >= 0 or not gone.any(), "a released token has no position"
        pages = np.asarray(self.slide_pages, dtype=np.int64)[np.maximum(index, 0)] if self.slide_pages else \
            np.zeros(len(tokens), np.int64)
        pages = np.where(gone, released, pages)
        return (pages * page_size + tokens % page_size).astype(np.int32)


@dataclasses.dataclass(frozen=True, slots=True)
class AppendLayout:
    """How appending n tokens (and sliding the window) changes a sequence; computed without
    touching any page. Slots and page indices are counted before the slide."""

    first_slot: int  # slot of the first new token
    num_pages: int  # pages needed before the slide
    drop_slots: tuple  # [begin, end): slots of the tokens the window drops
    drop_pages: tuple  # [begin, end): page indices the window frees
    length: int  # after the step
    sink: int
    window_offset: int

    @property
    def shift(self) -> int:
        """Pages removed from the page table by the slide."""
        return self.drop_pages[1] - self.drop_pages[0]


def append_layout(seq: Sequence, n: int, page_size: int) -> AppendLayout:
    """The layout after appending `n` tokens to `seq` and sliding its window."""
    first = seq.slot_end
    num_pages = ceildiv(first + n, page_size)
    length = seq.length + n
    excess = length - seq.window_size if seq.window_size and length > seq.window_size else 0
    sink, offset = seq.sink, seq.window_offset
    if not excess:
        return AppendLayout(first, num_pages, (0, 0), (0, 0), length, sink, offset)
    if sink == 0 and offset == 0:  # first slide: tokens are in slots 0..length-1
        sink = offset = seq.sink_size
    sink_pages = ceildiv(sink, page_size)
    drop_end = max((offset + excess) // page_size, sink_pages)
    shift = drop_end - sink_pages
    return AppendLayout(first, num_pages, (offset, offset + excess), (sink_pages, drop_end),
                        length - excess, sink, offset + excess - shift * page_size)


@dataclasses.dataclass(slots=True)
class Appended:
    """One sequence of a forward: its state before the append (`history`, whose page table
    already holds a copy-on-write copy) and after it (`seq`), and the pool position of each
    new token (-1: dropped by the window before it was ever cached)."""

    history: Sequence
    seq: Sequence
    positions: list


class TableArrays(NamedTuple):
    """The page tables of B sequences without sliding windows, as flat numpy arrays."""

    pages: np.ndarray  # [nnz] int32: sequence b's pages are pages[indptr[b] : indptr[b + 1]]
    indptr: np.ndarray  # [B+1] int32
    counts: np.ndarray  # [B] int32: pages per sequence
    slot_end: np.ndarray  # [B] int64: the slot after the last token (= the length without a window)

    @staticmethod
    def gather(seqs: list) -> "TableArrays":
        """The current tables of `seqs` (none may have a sliding window), copied."""
        batch = len(seqs)
        counts = np.fromiter(map(len, map(_PAGES, seqs)), np.int32, batch)
        indptr = np.zeros(batch + 1, np.int32)
        counts.cumsum(out=indptr[1:])
        pages = np.frombuffer(bytearray(b"".join(map(_PAGES, seqs))), np.int32)
        return TableArrays(pages, indptr, counts, np.fromiter(map(_LENGTH, seqs), np.int64, batch))


_LENGTH = operator.attrgetter("length")
_PAGES = operator.attrgetter("pages")


@functools.lru_cache(maxsize=64)
def _ones(batch: int) -> np.ndarray:
    """A read-only int64 array of `batch` ones (a decode step's appended lengths)."""
    ones = np.ones(batch, np.int64)
    ones.flags.writeable = False
    return ones


class AppendedArrays(NamedTuple):
    """A batch appended by `SequenceTable.reserve_plain`, as `Appended` describes one sequence."""

    history: TableArrays  # before the append, with copy-on-write copies in place
    seqs: TableArrays  # after the append
    lengths: np.ndarray  # [B] int64: tokens appended per sequence
    decode: bool  # every sequence appended one token
    positions: np.ndarray  # [N] int32: pool position of each new token
    shared: bool  # some page has several owners (else no two sequences share a page: no cascade)


class SequenceTable:
    """The sequences of a cache, over a shared `PageAllocator`."""

    def __init__(self, allocator: PageAllocator, page_size: int, max_sequences: int, sliding_window: bool,
                 slides: SlidingPages | None = None):
        """slides: the MHA_SLIDING layers' pages (tvmattn.runtime.slides), kept beside each
        sequence's page table by every method here (None: no such layers)."""
        self.allocator = allocator
        self.slides = slides
        self.page_size = page_size
        self.max_sequences = max_sequences
        self.sliding_window = sliding_window
        self.seqs: dict[int, Sequence] = {}
        self.version = 0  # bumped by every method that may change a sequence (see tables)
        # (version, seq_ids, their Sequences, TableArrays after the step, next slots) of the last
        # reserve_plain; next slots, where no page of the batch is shared and it was a decode step:
        # (the decode steps every sequence can take before one starts a page, the positions of
        # its new tokens), see _reserve_next_slot; else None
        self._last_plain: tuple | None = None
        self._step: tuple | _Step | None = None  # how to undo the open step (see the module docstring)

    def __len__(self) -> int:
        return len(self.seqs)

    def get(self, seq_id, what: str = "seq_id") -> Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise KVCacheError(f"{what}={seq_id!r}: no such sequence in the KV cache")
        return seq

    def total_length(self) -> int:
        return sum(seq.length for seq in self.seqs.values())

    # -- sequence management (each validates, then changes everything or nothing)
    def add(self, seq_id) -> None:
        """Add an empty sequence (a step still open goes on: it does not touch the new one)."""
        self.version += 1
        seq_id = self._new_id(seq_id, "seq_id")
        self.seqs[seq_id] = Sequence(seq_id)

    def remove(self, seq_id) -> None:
        self.commit_step()
        self.version += 1
        seq = self.get(seq_id)
        self.allocator.release_all(seq.pages)
        if self.slides is not None:
            self.slides.allocator.release_all(seq.slide_pages)
        del self.seqs[seq.seq_id]

    def clear(self) -> None:
        self._step = None
        self.version += 1
        self.seqs.clear()
        self.allocator.reset()
        if self.slides is not None:
            self.slides.allocator.reset()

    def fork(self, parent_id, child_id, fork_pos: int = -1) -> list[PageCopy]:
        """Add `child_id` holding the first `fork_pos` tokens of `parent_id` (-1: all of them).
        Returns the copies of a partly filled page at the fork point (the layers' pages, and
        the MHA_SLIDING layers' own: a fork_pos before what they keep is refused)."""
        self.commit_step()
        self.version += 1
        parent = self.get(parent_id, "parent_id")
        child_id = self._new_id(child_id, "child_id")
        end = check_int("fork_pos", fork_pos, -1, parent.length)
        end = parent.length if end == -1 else end
        check(parent.tree_tokens == 0, f"parent_id={parent_id}: its token tree is not committed yet; "
              "call commit_accepted_token_tree_nodes before forking it")
        check(not parent.window_size or end <= parent.sink_size,
              f"fork_pos={end}: sequence {parent_id} has a sliding window and can only be forked within "
              f"its attention sink of {parent.sink_size} tokens")
        # Tokens [0, end) of the parent are in slots [0, end) (they are all in its sink).
        ps = self.page_size
        full, partial = divmod(end, ps)
        slides = self.slides
        if slides is not None:
            slides.check_keeps(parent, end, f"fork_pos={end}")
            check(not partial or slides.allocator.num_free > 0, "the MHA_SLIDING layers' pages are full: all "
                  f"{slides.allocator.num_pages} are in use")
        copies = []
        pages = parent.pages[:full]
        if partial:
            copies.append(PageCopy(parent.pages[full], self.allocator.alloc(), partial))
            pages.append(copies[-1].dst)  # pages is a copy (a slice)
        for page in parent.pages[:full]:
            self.allocator.retain(page)
        child = self.seqs[child_id] = Sequence(child_id, pages, end)
        if slides is not None:
            child.slide_pages, child.slide_dropped, partial_page = slides.fork(parent, end)
            if partial_page is not None:
                copies.append(PageCopy(partial_page[0], slides.allocator.alloc(), partial_page[1], True))
                child.slide_pages.append(copies[-1].dst)
        return copies

    def popn(self, seq_id, n) -> None:
        """Remove the last `n` tokens of a sequence (0 <= n <= length)."""
        self.commit_step()
        self.version += 1
        seq = self.get(seq_id)
        n = check_int("n", n, 0, seq.length)
        if self.slides is not None:
            self.slides.check_keeps(seq, seq.length - n - max(len(seq.tree) - n, 0), f"popn(n={n})")
        self._pop(seq, n)

    def _pop(self, seq: Sequence, n: int) -> None:
        length = seq.length - n
        if seq.sink and length <= seq.sink:  # only sink tokens are left: slots 0..length-1
            seq.sink = seq.window_offset = 0
        seq.length = length
        del seq.tree[max(len(seq.tree) - n, 0):]  # the last nodes: what is left is still a tree
        keep = ceildiv(seq.slot_end, self.page_size)
        self.allocator.release_all(seq.pages[keep:])
        del seq.pages[keep:]
        if self.slides is not None:
            self.slides.truncate(seq)

    def enable_sliding_window(self, seq_id, window_size, sink_size) -> None:
        self.commit_step()
        self.version += 1
        check(self.sliding_window, "this KV cache was created with support_sliding_window=False")
        seq = self.get(seq_id)
        window = check_int("window_size", window_size, 1)
        sink = check_int("sink_size", sink_size, 0, window - 1)
        check(not seq.window_size, f"seq_id={seq_id}: a sliding window is already enabled for this sequence")
        seq.window_size, seq.sink_size = window, sink

    def _new_id(self, seq_id, what: str) -> int:
        seq_id = check_int(what, seq_id)
        check(seq_id not in self.seqs, f"{what}={seq_id}: the sequence is already in the KV cache")
        check(len(self.seqs) < self.max_sequences,
              f"{what}={seq_id}: the KV cache already holds max_num_sequences={self.max_sequences} sequences")
        return seq_id

    # -- appending (begin_forward), and keeping or undoing a step
    def reserve(self, seqs: list, lengths: list, trees: list | None) -> tuple[list, list]:
        """Make room for `lengths[i]` new tokens in `seqs[i]`; the new tokens are nodes of its
        token tree with parents `trees[i]` (trees None: no token tree). Opens a step (see the
        module docstring): windows slide when it is committed.

        Returns (appended per sequence, page copies to run before the step). Pages come for
        copy-on-write first, then for new tokens. On KVCacheError (out of pages) nothing changed.
        """
        self.commit_step()
        self.version += 1
        self._last_plain = None
        before = [seq.copy() for seq in seqs]
        firsts = [seq.slot_end for seq in seqs]
        slide_copies = self._reserve_slides(seqs, lengths)  # (undone by seq.assign and its journal)
        self.allocator.open_journal()
        try:
            copies = [self._copy_on_write(seq) for seq in seqs]
            histories = [_history(old, c) for old, c in zip(before, copies)]
            fresh = [ceildiv(first + n, self.page_size) - len(seq.pages) for seq, first, n in zip(seqs, firsts, lengths)]
            self._check_free(sum(fresh))
            for i, (seq, n, count) in enumerate(zip(seqs, lengths, fresh)):
                seq.pages.extend(self.allocator.alloc_many(count))
                seq.length += n
                seq.tree = seq.tree + list(trees[i]) if trees is not None else []
        except BaseException:
            for seq, old in zip(seqs, before):
                seq.assign(old)
            self.allocator.rollback_journal()
            if self.slides is not None:
                self.slides.allocator.rollback_journal()
            raise
        self._step = _Step(seqs, before)
        appended = [Appended(h, seq, self._new_positions(seq, first, n))
                    for h, seq, first, n in zip(histories, seqs, firsts, lengths)]
        return appended, [c for c in copies if c is not None] + slide_copies

    def commit_step(self) -> None:
        """Keep the open step (if any): its windowed sequences without a token tree slide."""
        step, self._step = self._step, None
        if step is None:
            return
        self.allocator.close_journal()
        if self.slides is not None:
            self.slides.allocator.close_journal()
            for seq in (step.seqs if type(step) is _Step else step[0]):
                self.slides.drop(seq)
        if type(step) is _Step:
            for seq in step.seqs:
                if seq.window_size and seq.length > seq.window_size and not seq.tree:
                    self.version += 1
                    self._slide_window(seq)

    def rollback_step(self) -> None:
        """Undo the open step (if any): every sequence, page and reference count as before it."""
        step, self._step = self._step, None
        if step is None:
            return
        self.version += 1
        self._last_plain = None
        if type(step) is _Step:
            for seq, old in zip(step.seqs, step.before):
                seq.assign(old)
        else:  # reserve_plain's (seqs, page counts, lengths, copied sequences, their PageCopy, slide_undo)
            seqs, counts, lengths, cow, copies, slide_undo = step
            for seq, count, length in zip(seqs, counts.tolist(), lengths.tolist()):
                del seq.pages[count:]
                seq.length = length
            for b, copy in zip(cow, copies):
                seqs[b].pages[-1] = copy.src
            if slide_undo is not None:
                _undo_slides(seqs, slide_undo)
        self.allocator.rollback_journal()
        if self.slides is not None:
            self.slides.allocator.rollback_journal()

    def commit_trees(self, seqs: list, paths: list) -> None:
        """Keep path `paths[i]` (accepted_path of its tree; its K/V already moved into the
        tree's first slots) of each sequence's token tree and drop the other nodes; a windowed
        sequence then slides. Nothing here can fail: the caller checked every sequence first."""
        self.commit_step()
        self.version += 1
        for seq, path in zip(seqs, paths):
            self._pop(seq, seq.tree_tokens - len(path))
            seq.tree = []
            if self.slides is not None:
                self.slides.drop(seq)
            if seq.window_size and seq.length > seq.window_size:
                self._slide_window(seq)

    def _slide_window(self, seq: Sequence) -> None:
        """Slide a windowed sequence longer than its window: keep its sink and last tokens."""
        layout = append_layout(seq, 0, self.page_size)
        self._slide(seq, layout)
        seq.length, seq.sink, seq.window_offset = layout.length, layout.sink, layout.window_offset

    def steady(self, seq_ids: list) -> tuple[list, TableArrays] | None:
        """(their Sequences, their TableArrays) when seq_ids are the sequences of the last
        reserve_plain given seq_ids, in the same order, and no sequence changed since (a steady
        run of decode steps): they exist, are distinct and have no sliding window and no token
        tree, as then. Else None. Saves the Python passes over the batch of a step."""
        last = self._last_plain
        if last is not None and last[0] == self.version and last[1] == seq_ids:
            return last[2], last[3]
        return None

    def reserve_plain(self, seqs: list, lengths: list, tables: TableArrays | None = None,
                      seq_ids: list | None = None) -> tuple[AppendedArrays, list]:
        """`reserve(seqs, lengths, None)` for a batch in which no sequence has a sliding window
        or a token tree (lengths >= 1), with numpy over the whole batch instead of a Python
        loop: the same page changes (the same pages from the allocator, in the same order) and
        the same errors (on KVCacheError nothing changed). tables: `TableArrays.gather(seqs)`
        where the caller has it already (it becomes the returned history).

        Returns (the batch before and after the append, page copies to run before the step).
        Python loops run only over the sequences that need copy-on-write or new pages, and
        once to add each sequence's length. seq_ids: the sequences' ids (a list the caller no
        longer changes); when given, the sequences and their tables after the step are kept for
        `steady` (the returned arrays must then stay unchanged).
        """
        if self._step is not None:
            self.commit_step()
        last = self._last_plain
        if last is not None and tables is last[3] and last[4] is not None and last[4][0] > 0 \
                and seq_ids is not None and sum(lengths) == len(lengths) and not self.allocator.num_shared:
            return self._reserve_next_slot(seqs, tables, seq_ids, last[4])
        self.version += 1
        self._last_plain = None
        ps = self.page_size
        decode = sum(lengths) == len(lengths)  # one token per sequence
        n = np.array(lengths, dtype=np.int64)
        history = TableArrays.gather(seqs) if tables is None else tables
        first_slot = history.slot_end
        end = first_slot + n
        if decode:  # a new page where the token starts one
            used = first_slot % ps  # slots used in the last page
            fresh = used == 0
            total = int(np.count_nonzero(fresh))
        else:
            fresh = (end + (ps - 1)) // ps - history.counts  # new pages per sequence
            total = int(fresh.sum())
        cow, copies = [], []
        slide_undo = None
        if self.slides is not None:
            slide_undo = [len(seq.slide_pages) for seq in seqs], []
            slide_copies = self._reserve_slides(seqs, lengths, slide_undo)
        shared = self._shared_last_pages(history)
        if shared or total:  # (most decode steps take no page: nothing to journal)
            self.allocator.open_journal()
            try:  # as reserve: copy-on-write first, then new pages
                for b, used_slots in shared:
                    page = seqs[b].pages[-1]
                    if self.allocator.refcount(page) > 1:  # (an earlier copy may have left it private)
                        cow.append(b)
                        copies.append(PageCopy(page, self.allocator.alloc(), used_slots))
                        self.allocator.release(page)
                self._check_free(total)
                new_pages = self.allocator.alloc_many(total)
            except BaseException:
                self.allocator.rollback_journal()
                if slide_undo is not None:
                    _undo_slides(seqs, slide_undo)
                    self.slides.allocator.rollback_journal()
                raise
        # how to undo the step (a plain tuple: this runs every decode step), see rollback_step
        self._step = (seqs, history.counts, history.slot_end, cow, copies, slide_undo)
        # the sequences after the append (tree stays [], sink and window_offset 0)
        if cow:  # (a copy: the tables may be the kept ones, which earlier plans hold)
            history = history._replace(pages=history.pages.copy())
        for b, copy in zip(cow, copies):
            seqs[b].pages[-1] = history.pages[history.indptr[b + 1] - 1] = copy.dst
        if total:
            fresh_end = fresh.cumsum()
            for b in np.flatnonzero(fresh).tolist():
                seqs[b].pages.extend(new_pages[fresh_end[b] - fresh[b] : fresh_end[b]])
        for seq, count in zip(seqs, lengths):
            seq.length += count
        after = TableArrays.gather(seqs) if total else TableArrays(history.pages, history.indptr, history.counts, end)
        # pool position of each new token: its slot's page in the table after the append
        if decode:  # the last page
            pages, slots_in_page = after.pages[after.indptr[1:] - 1], used
        else:  # token t of sequence b is in slot first_slot[b] + t - (its sequence's first token)
            owner = np.repeat(np.arange(len(n)), n)
            slots = np.arange(len(owner)) - np.repeat(n.cumsum() - n - first_slot, n)
            pages, slots_in_page = after.pages[after.indptr[owner] + slots // ps], slots % ps
        positions = (pages * np.int64(ps) + slots_in_page).astype(np.int32)  # in int64, as Python ints
        batch = AppendedArrays(history, after, n, decode, positions, self.allocator.num_shared > 0)
        if seq_ids is not None:
            next_slots = None
            if decode and slide_undo is None and not batch.shared:
                # steps until some sequence's next token starts a page: its slot_end on a page boundary
                room = (ps - after.slot_end % ps) % ps
                next_slots = (int(room.min()) if room.size else 0, positions)
            self._last_plain = (self.version, seq_ids, seqs, after, next_slots)
        return batch, copies if slide_undo is None else copies + slide_copies

    def _reserve_next_slot(self, seqs: list, history: TableArrays, seq_ids: list,
                           next_slots: tuple) -> tuple[AppendedArrays, list]:
        """reserve_plain of a decode step right after the last one of the same sequences in which
        no sequence starts a page and no page is shared (`next_slots`, which the last step keeps
        only in a cache without MHA_SLIDING layers' pages):
        every new token goes to the slot after the last one's, in the same page, so the page
        tables stay and no page is taken. The same result as the general path, in fewer numpy
        calls."""
        room, last_positions = next_slots
        self.version += 1
        # how to undo the step: as reserve_plain's (no copies, no new pages)
        self._step = (seqs, history.counts, history.slot_end, [], [], None)
        for seq in seqs:
            seq.length += 1
        after = history._replace(slot_end=history.slot_end + 1)
        positions = last_positions + 1
        batch = AppendedArrays(history, after, _ones(len(seqs)), True, positions, False)
        self._last_plain = (self.version, seq_ids, seqs, after, (room - 1, positions))
        return batch, []

    def _shared_last_pages(self, history: TableArrays) -> list[tuple[int, int]]:
        """(sequence, used slots) of the sequences whose last page is partly filled and shared
        with another sequence before the step, in order (their append writes into it)."""
        if not self.allocator.num_shared or not history.pages.size:  # (no forks: the usual case)
            return []
        used = history.slot_end % self.page_size
        last = history.pages[history.indptr[1:] - 1]  # meaningful where used > 0 (a page exists)
        shared = (used > 0) & (self.allocator.refcounts(last) > 1)
        if not shared.any():
            return []
        return [(b, int(used[b])) for b in np.flatnonzero(shared).tolist()]

    def _reserve_slides(self, seqs: list, lengths: list, undo: tuple | None = None) -> list[PageCopy]:
        """The MHA_SLIDING layers' part of a reserve (before the sequences' lengths change):
        copy-on-write of a shared, partly filled last page, then the new pages. Opens their
        allocator's journal (kept by commit_step, undone by rollback_step); on KVCacheError
        nothing changed. undo: (page counts before, []), to which (sequence, copied page) pairs
        are added (see _undo_slides). Returns the copies (sliding=True)."""
        slides = self.slides
        if slides is None:
            return []
        allocator, ps = slides.allocator, self.page_size
        counts = undo[0] if undo is not None else [len(seq.slide_pages) for seq in seqs]
        cow = undo[1] if undo is not None else []
        copies = []
        allocator.open_journal()
        try:
            if allocator.num_shared:
                for b, seq in enumerate(seqs):
                    used = seq.length % ps
                    if used and seq.slide_pages and allocator.refcount(seq.slide_pages[-1]) > 1:
                        src = seq.slide_pages[-1]
                        copies.append(PageCopy(src, allocator.alloc(), used, True))
                        allocator.release(src)
                        seq.slide_pages[-1] = copies[-1].dst
                        cow.append((b, src))
            fresh = [slides.pages_needed(seq, seq.length + n) for seq, n in zip(seqs, lengths)]
            needed = sum(fresh)
            if needed > allocator.num_free:
                raise KVCacheError(f"the MHA_SLIDING layers' pages are full: this forward needs {needed} more pages, "
                                   f"{allocator.num_free} of {allocator.num_pages} are free")
            if needed:
                for seq, count in zip(seqs, fresh):
                    if count:
                        seq.slide_pages.extend(allocator.alloc_many(count))
        except BaseException:
            _undo_slides(seqs, (counts, cow))
            allocator.rollback_journal()
            raise
        return copies

    def _copy_on_write(self, seq: Sequence) -> PageCopy | None:
        """Give `seq` a private copy of its last page when the append writes into it while
        another sequence shares it."""
        used = seq.slot_end % self.page_size
        last = len(seq.pages) - 1
        if not used or self.allocator.refcount(seq.pages[last]) == 1:
            return None
        copy = PageCopy(seq.pages[last], self.allocator.alloc(), used)
        self.allocator.release(copy.src)
        seq.pages[last] = copy.dst
        return copy

    def _slide(self, seq: Sequence, layout: AppendLayout) -> int:
        """Release the pages the window frees; returns how many new pages the append needs."""
        begin, end = layout.drop_pages
        old = len(seq.pages)
        if end > begin:
            self.allocator.release_all(seq.pages[begin:min(end, old)])
            del seq.pages[begin:min(end, old)]
        fresh_dropped = max(0, min(end, layout.num_pages) - max(begin, old))
        return layout.num_pages - old - fresh_dropped

    def _check_free(self, needed: int) -> None:
        free = self.allocator.num_free
        if needed > free:
            raise KVCacheError(f"the KV cache is full: this forward needs {needed} more pages, {free} of "
                               f"{self.allocator.num_pages} are free")

    def _new_positions(self, seq: Sequence, first: int, n: int) -> list:
        """Pool position of each of the n new tokens, in slots first .. first + n - 1."""
        ps = self.page_size
        if n == 1:
            return [seq.pages[first // ps] * ps + first % ps]
        slots = np.arange(first, first + n)
        pages = np.asarray(seq.pages, dtype=np.int64)[slots // ps]
        return (pages * ps + slots % ps).tolist()


def _history(before: Sequence, copy: PageCopy | None) -> Sequence:
    """`before` with the page table after copy-on-write (the page the append writes into)."""
    if copy is not None:
        before = before.copy()
        before.pages[-1] = copy.dst
    return before


def _undo_slides(seqs: list, undo: tuple) -> None:
    """Put the MHA_SLIDING layers' page tables of `seqs` back as _reserve_slides found them
    (the allocator's journal is rolled back by the caller)."""
    counts, cow = undo
    for seq, count in zip(seqs, counts):
        del seq.slide_pages[count:]
    for b, src in cow:
        seqs[b].slide_pages[counts[b] - 1] = src


class _Step(NamedTuple):
    """How to undo a step of `reserve`: the sequences and their copies from before it."""

    seqs: list
    before: list
