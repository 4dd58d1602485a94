"""The MHA_SLIDING layers' pages: a pool of their own, recycled as the window slides.

A query at position q of a sequence attends, in an MHA_SLIDING layer, to the keys at positions
q - W + 1 .. q (W = layer_sliding_window_size). A sequence of committed length L (its tokens
less an uncommitted token tree) asks its next query at position L or later (a step's queries
too: chunked prefill appends after L), so these layers need only its tokens at positions
`needed_from(L) = max(0, L - W + 1)` and later. Every page wholly before that is released when
a step is kept (never while it may still be rolled back), so a sequence holds at most
ceil((W - 1) / page_size) + 1 sliding pages between steps, however long it is.

Layout (the fields `slide_pages`, `slide_dropped` of a sequences.Sequence): pages stay aligned
to token positions, token t in slot t % page_size of slide_pages[t // page_size -
slide_dropped]. A window's pages are then a slice of the table and its offset in the first one
is its first position % page_size, so the MHA_SLIDING layers' one paged-decode level (one
request per new token, tvmattn.runtime.windows) is planned with numpy from the flat tables.

The pages come from an allocator of their own (`SlidingPages.allocator`, journaled like the
cache's: a rolled-back step leaves both exactly as they were) over pools sized for the
windows (CacheOptions.sliding_num_pages), plus one zero page after them: debug_get_kv reads
the positions a sequence dropped from it. Forks share the full pages of the window and copy
a partly filled one (PageCopy(sliding=True)); popn and fork_pos may reach back only as far as
the kept tokens serve (`check_keeps`): popping or forking before that is refused.
"""

from __future__ import annotations

from .errors import KVCacheError
from .pages import PageAllocator


def ceildiv(a: int, b: int) -> int:
    return -(-a // b)


class SlidingPages:
    """The allocator and window arithmetic of the MHA_SLIDING layers' pages."""

    def __init__(self, num_pages: int, page_size: int, window: int):
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.window = window

    @property
    def zero_page(self) -> int:
        """The pool page after the allocator's pages: never written, all zeros."""
        return self.allocator.num_pages

    def needed_from(self, length: int) -> int:
        """The first position that queries at `length` and later read."""
        return max(0, length - self.window + 1)

    def check_keeps(self, seq, length: int, what: str) -> None:
        """KVCacheError unless `seq` keeps what queries from position `length` on read."""
        kept = seq.slide_dropped * self.page_size
        if self.needed_from(length) < kept:
            raise KVCacheError(
                f"{what}: sequence {seq.seq_id} would continue from position {length}, whose window starts at "
                f"{self.needed_from(length)}, but its MHA_SLIDING layers have released the tokens before {kept} "
                f"(their window is {self.window}; the earliest position it can continue from is "
                f"{kept + self.window - 1})")

    def drop(self, seq) -> None:
        """Release the pages wholly before what the sequence's next query reads (its committed
        length: the tokens less an uncommitted token tree)."""
        target = self.needed_from(seq.length - len(seq.tree)) // self.page_size
        count = min(target - seq.slide_dropped, len(seq.slide_pages))
        if count > 0:
            self.allocator.release_all(seq.slide_pages[:count])
            del seq.slide_pages[:count]
            seq.slide_dropped += count

    def truncate(self, seq) -> None:
        """Release the pages after the sequence's (shortened) length."""
        keep = max(ceildiv(seq.length, self.page_size) - seq.slide_dropped, 0)
        if keep < len(seq.slide_pages):
            self.allocator.release_all(seq.slide_pages[keep:])
            del seq.slide_pages[keep:]
        if not seq.slide_pages and seq.length == 0:
            seq.slide_dropped = 0

    def fork(self, parent, end: int) -> tuple:
        """(page table, dropped pages, the partial page to copy as (src, slots) or None) of a
        fork of `parent` at `end` (checked: check_keeps, a free page for a partial copy); the
        full pages are retained, a partly filled last page is left for the caller to allocate."""
        ps = self.page_size
        dropped = self.needed_from(end) // ps
        full, partial = divmod(end, ps)
        base = parent.slide_dropped
        pages = parent.slide_pages[dropped - base : full - base]
        for page in pages:
            self.allocator.retain(page)
        copy = (parent.slide_pages[full - base], partial) if partial else None
        return pages, dropped, copy

    def pages_needed(self, seq, length: int) -> int:
        """Pages `seq` needs beyond its table to hold `length` tokens."""
        return ceildiv(length, self.page_size) - seq.slide_dropped - len(seq.slide_pages)

    def held(self) -> int:
        """Pages in use."""
        return self.allocator.num_pages - self.allocator.num_free
