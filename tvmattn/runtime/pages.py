"""The page allocator: which pages of the pool are free, and how many owners each used page has.

Invariants (checked by `check_invariants`, used by the tests):
- a page is either free (reference count 0, on the free list exactly once) or used
  (reference count >= 1, not on the free list);
- `num_free == len(free list)`;
- `num_shared` = the number of pages with two or more references (a cheap "no page is
  shared" test for the planner's copy-on-write check).

Pages are handed out lowest id first (the free list is a stack whose top is the lowest id
after construction). A sequence owns one reference to each page in its page table; forks
share full pages by taking another reference.

Journals: between `open_journal()` and `close_journal()` (a forward step, see
SequenceTable) every alloc/retain/release is journaled, and `rollback_journal()` undoes them in
reverse order, so the free list and the reference counts are exactly as before (the same pages
in the same free-list order). `with allocator.transaction():` does the same for a block that
raises, inside an open journal or on its own.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .errors import KVCacheError

_ALLOC, _RETAIN, _RELEASE = 0, 1, 2


class PageAllocator:
    """Free list plus reference counts over `num_pages` pages with ids 0 .. num_pages-1."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise KVCacheError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self.num_shared = 0  # pages with two or more references
        self._journal: list | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def refcounts(self, pages: np.ndarray) -> np.ndarray:
        """[n] int64: the reference count of each of `pages` ([n] integer array)."""
        return np.fromiter(map(self._refs.__getitem__, pages.tolist()), np.int64, len(pages))

    def alloc(self) -> int:
        """A free page, now with one reference; KVCacheError when none is left."""
        if not self._free:
            raise KVCacheError(f"the KV cache is full: all {self.num_pages} pages are in use")
        page = self._free.pop()
        self._refs[page] = 1
        self._log(_ALLOC, page)
        return page

    def alloc_many(self, count: int) -> list[int]:
        """`count` free pages (all or none)."""
        if count > len(self._free):
            raise KVCacheError(
                f"the KV cache is full: {count} more pages are needed, {len(self._free)} of "
                f"{self.num_pages} are free"
            )
        return [self.alloc() for _ in range(count)]

    def retain(self, page: int) -> None:
        """One more owner of a used page."""
        self._refs[page] += 1
        if self._refs[page] == 2:
            self.num_shared += 1
        self._log(_RETAIN, page)

    def release(self, page: int) -> None:
        """One owner fewer; the page is free again when it has none."""
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)
        elif self._refs[page] == 1:
            self.num_shared -= 1
        self._log(_RELEASE, page)

    def release_all(self, pages) -> None:
        for page in pages:
            self.release(page)

    def reset(self) -> None:
        """Every page free again (in the initial order)."""
        self.__init__(self.num_pages)

    def open_journal(self) -> None:
        """Journal every change from now on (until close_journal or rollback_journal)."""
        assert self._journal is None, "a journal is open already"
        self._journal = []

    def close_journal(self) -> None:
        """Keep the journaled changes and stop journaling."""
        self._journal = None

    def rollback_journal(self) -> None:
        """Undo every journaled change and stop journaling (nothing when no journal is open)."""
        journal, self._journal = self._journal, None
        if journal:
            self._undo(journal)

    @contextlib.contextmanager
    def transaction(self):
        """Undo every change made inside the block if it raises."""
        outer = self._journal is not None
        if not outer:
            self._journal = []
        mark = len(self._journal)
        try:
            yield
        except BaseException:
            self._undo(self._journal[mark:])
            del self._journal[mark:]
            raise
        finally:
            if not outer:
                self._journal = None

    def _log(self, op: int, page: int) -> None:
        if self._journal is not None:
            self._journal.append((op, page))

    def _undo(self, journal: list) -> None:
        for op, page in reversed(journal):
            if op == _ALLOC:
                self._refs[page] = 0
                self._free.append(page)
            elif op == _RETAIN:
                self._refs[page] -= 1
                if self._refs[page] == 1:
                    self.num_shared -= 1
            else:
                if self._refs[page] == 0:
                    self._free.pop()
                self._refs[page] += 1
                if self._refs[page] == 2:
                    self.num_shared += 1

    def check_invariants(self) -> None:
        """Raise AssertionError when the free list and the reference counts disagree."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        for page, refs in enumerate(self._refs):
            assert refs >= 0, f"page {page} has {refs} references"
            assert (refs == 0) == (page in free), f"page {page}: {refs} references, free={page in free}"
        shared = sum(refs >= 2 for refs in self._refs)
        assert self.num_shared == shared, f"num_shared is {self.num_shared}, but {shared} pages are shared"
