"""The vectorized host planner (SequenceTable.reserve_plain + build_plan_arrays) against the
per-sequence one (SequenceTable.reserve + build_plan), which stays the reference.

Property-based with plain seeded random generation: each scenario drives one SequenceTable
through random adds, removals, forks (at page boundaries, inside pages, at 0 and at the end),
popn (also into pages that forks share) and forward steps over random batches (1 to 256
sequences, in random or family order so that forks sharing a prefix sit side by side and form
cascade groups), decode steps (every sequence appends one token) and prefill steps (random
lengths, empty histories, page boundaries). Before every step the table is copied; the copy
runs the reference and the table the vectorized path, and the two must agree exactly:
  - the page copies (copy-on-write), every sequence's state and the allocator's free list
    and reference counts afterwards (the same pages, handed out in the same order);
  - the plan: decode flag, every host array (dtype, shape, values), the packing layout and
    the packed buffer (the arrays' places in it; padding is not initialized);
  - on a full cache: the same KVCacheError, and neither changed anything.
Decode steps often repeat one batch: from its second step on, the vectorized path runs on the
tables the step before kept (SequenceTable.steady), which must equal a fresh gather; where no
page is shared and no sequence starts a page, reserve_plain takes the next slots
(`_reserve_next_slot`), which must still equal the reference.
No device and no kernels: the whole file runs in seconds on the CPU.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tvmattn.runtime.errors import KVCacheError
from tvmattn.runtime.pages import PageAllocator
from tvmattn.runtime.plan import PlanArrays, build_plan, build_plan_arrays, cascade_groups, cascade_groups_arrays
from tvmattn.runtime.sequences import SequenceTable, TableArrays, _ones

MAX_BATCHES = (1, 3, 16, 64, 256)
STEADY_STEPS: list = []  # the steps that ran on the kept tables of the step before (SequenceTable.steady)
NEXT_SLOT_STEPS: list = []  # the steps reserve_plain took as the last one's next slots


def table_state(table: SequenceTable) -> tuple:
    """Everything reserve may change: each sequence's fields and the allocator's state."""
    seqs = {seq_id: (list(seq.pages), seq.length, seq.window_size, seq.sink_size, seq.sink, seq.window_offset,
                     list(seq.tree)) for seq_id, seq in table.seqs.items()}
    return seqs, list(table.allocator._free), list(table.allocator._refs)


def named_arrays(host: PlanArrays) -> list:
    """(name, array or None) for every array of a plan, in packing order."""
    out = [(name, getattr(host, name)) for name in ("q_positions", "append_indptr", "k_ragged_offset",
                                                    "append_positions")]
    for kind in ("fused", "cross"):
        for depth, level in enumerate(getattr(host, kind)):
            out += [(f"{kind}[{depth}].{field}", value) for field, value in zip(level._fields, level)]
    return out + [(f"tree[{i}]", value) for i, value in enumerate(host.tree)]


def assert_same_plan(ref, vec, what: str) -> None:
    assert (vec.decode, vec.tree, vec.total) == (ref.decode, ref.tree, ref.total), what
    assert (vec.seq_ids, vec.lengths) == (ref.seq_ids, ref.lengths), what
    ref_arrays, vec_arrays = named_arrays(ref.host), named_arrays(vec.host)
    assert [name for name, _ in vec_arrays] == [name for name, _ in ref_arrays], what
    for (name, expected), (_, actual) in zip(ref_arrays, vec_arrays):
        if expected is None:
            assert actual is None, f"{what}: {name}"
            continue
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
            f"{what}: {name}: {actual.dtype}{actual.shape} vs {expected.dtype}{expected.shape}"
        np.testing.assert_array_equal(actual, expected, err_msg=f"{what}: {name}")
    assert vec.specs == ref.specs, f"{what}: packing layout"
    assert vec.buffer.dtype == ref.buffer.dtype and vec.buffer.shape == ref.buffer.shape, what
    for (name, spec), (_, array) in zip(named_arrays(vec.specs), vec_arrays):  # (padding is left as it was)
        if spec is not None:
            packed = vec.buffer[spec.offset : spec.offset + array.size]
            np.testing.assert_array_equal(packed, ref.buffer[spec.offset : spec.offset + array.size],
                                          err_msg=f"{what}: {name} in the packed buffer")


def check_step(table: SequenceTable, seq_ids: list, lengths: list, sliding: bool, cascade: bool, what: str) -> bool:
    """One forward step both ways (see the module docstring); True when it ran (False: the
    cache was full, identically for both)."""
    ref_table = copy.deepcopy(table)
    before = table_state(table)
    ps = table.page_size
    ref_seqs = [ref_table.get(seq_id) for seq_id in seq_ids]
    seqs = [table.get(seq_id) for seq_id in seq_ids]
    steady = table.steady(seq_ids)  # the kept tables of a steady run of steps, as PagedKVCache uses them
    if steady is not None:
        kept_seqs, tables = steady
        assert len(kept_seqs) == len(seqs) and all(a is b for a, b in zip(kept_seqs, seqs)), what
        gathered = TableArrays.gather(seqs)
        for field in TableArrays._fields:
            np.testing.assert_array_equal(getattr(tables, field), getattr(gathered, field), err_msg=f"{what}: kept "
                                          f"{field}")
        STEADY_STEPS.append(what)
    else:
        tables = TableArrays.gather(seqs) if len(seq_ids) % 2 else None  # as PagedKVCache passes them, or not
    keep = seq_ids if len(seq_ids) % 3 else None  # keep the tables for a next steady step (or not)
    try:
        appended, ref_copies = ref_table.reserve(ref_seqs, lengths, None)
    except KVCacheError as error:
        with pytest.raises(KVCacheError) as raised:
            table.reserve_plain(seqs, lengths, tables, keep)
        assert str(raised.value) == str(error), what
        assert table_state(table) == before == table_state(ref_table), f"{what}: a failed step changed the table"
        assert table.steady(seq_ids) is None, what
        return False
    batch, copies = table.reserve_plain(seqs, lengths, tables, keep)
    assert copies == ref_copies, f"{what}: page copies"
    assert table_state(table) == table_state(ref_table), f"{what}: table after the append"
    for tables, ref_tables in ((batch.history, [a.history for a in appended]), (batch.seqs, [a.seq for a in appended])):
        assert cascade_groups_arrays(tables, ps) == cascade_groups(ref_tables, ps), f"{what}: cascade groups"
    np.testing.assert_array_equal(batch.positions, np.concatenate([np.asarray(a.positions, np.int32)
                                                                   for a in appended]), err_msg=what)
    ref = build_plan(seq_ids, appended, lengths, ps, sliding, cascade=cascade)
    vec = build_plan_arrays(seq_ids, lengths, batch, ps, sliding, cascade=cascade)
    assert_same_plan(ref, vec, what)
    if batch.lengths is _ones(len(seq_ids)):
        NEXT_SLOT_STEPS.append(what)
    return True


class Scenario:
    """Random operations on one SequenceTable (seeded), checking every step."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        rng = self.rng
        self.seed = seed
        self.max_batch = MAX_BATCHES[seed % len(MAX_BATCHES)]
        self.page_size = int(rng.choice([1, 2, 4, 16]))
        self.sliding = bool(rng.integers(2))  # the kernels read length_info as [3, R]
        # tokens the sequences may hold; some seeds run short of pages on purpose
        budget = self.max_batch * int(rng.choice([8, 40, 80]))
        pages = budget // self.page_size + self.max_batch * 4 + 4
        if seed % 7 == 3:
            pages = max(4, pages // 6)
        self.table = SequenceTable(PageAllocator(pages), self.page_size, self.max_batch * 2, sliding_window=False)
        self.next_id = 0
        self.steps = self.full = 0

    def ids(self) -> list:
        return list(self.table.seqs)

    def add(self) -> int:
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self.table.add(seq_id)
        return seq_id

    def fork(self) -> None:
        parent = self.table.get(int(self.rng.choice(self.ids())))
        ps, length = self.page_size, parent.length
        choices = [-1, 0, length, (length // ps) * ps, int(self.rng.integers(0, length + 1))]
        position = choices[int(self.rng.integers(len(choices)))]
        try:
            self.table.fork(parent.seq_id, self.next_id, position)
            self.next_id += 1
        except KVCacheError:  # out of pages for the copy of a partly filled page
            pass

    def branch(self) -> None:
        """A fork of a whole sequence, then popn of a few tokens from the fork and perhaps the
        parent: both may end inside a page they share (the next append copies it)."""
        parent = self.table.get(int(self.rng.choice(self.ids())))
        child = self.next_id
        self.table.fork(parent.seq_id, child)
        self.next_id += 1
        for seq in (self.table.get(child), parent)[: int(self.rng.integers(1, 3))]:
            self.table.popn(seq.seq_id, min(seq.length, int(self.rng.integers(1, self.page_size + 1))))

    def popn(self) -> None:
        seq = self.table.get(int(self.rng.choice(self.ids())))
        n = int(self.rng.choice([1, self.page_size, int(self.rng.integers(0, seq.length + 1))]))
        self.table.popn(seq.seq_id, min(n, seq.length))

    def batch(self) -> list:
        """A random batch: a random subset in random order, or in id order (forks beside their
        parents' other forks)."""
        ids = self.ids()
        size = min(len(ids), self.max_batch)
        if self.rng.random() < 0.6:
            size = int(self.rng.integers(1, size + 1))
        chosen = list(self.rng.choice(ids, size, replace=False))
        if self.rng.random() < 0.5:
            chosen.sort()
        return [int(seq_id) for seq_id in chosen]

    def lengths(self, size: int, decode: bool) -> list:
        if decode:
            return [1] * size
        ps = self.page_size
        kinds = self.rng.integers(0, 4, size)
        values = [1, ps, ps + 1, int(self.rng.integers(1, 3 * ps + 2))]
        return [max(1, values[k] if k < 3 else int(self.rng.integers(1, 3 * ps + 2))) for k in kinds]

    def step(self, decode: bool, seq_ids: list | None = None) -> list:
        """A step of seq_ids (default: a random batch); returns seq_ids."""
        seq_ids = self.batch() if seq_ids is None else seq_ids
        lengths = self.lengths(len(seq_ids), decode)
        what = f"seed {self.seed}, step {self.steps}: {'decode' if decode else 'prefill'} of {len(seq_ids)}"
        cascade = self.rng.random() < 0.8
        if check_step(self.table, seq_ids, lengths, self.sliding, cascade, what):
            self.steps += 1
        else:
            self.full += 1
        return seq_ids

    def run(self, rounds: int) -> None:
        rng = self.rng
        for _ in range(self.max_batch):
            self.add()
        self.step(decode=False)
        for _ in range(rounds):
            op = rng.random()
            if op < 0.08 and len(self.table) < self.table.max_sequences:
                for _ in range(int(rng.integers(1, 4))):
                    if len(self.table) < self.table.max_sequences:
                        self.add()
            elif op < 0.2 and len(self.table) < self.table.max_sequences:
                for _ in range(int(rng.integers(1, 4))):
                    if len(self.table) < self.table.max_sequences:
                        self.fork()
            elif op < 0.24:
                self.popn()
            elif op < 0.3 and len(self.table) < self.table.max_sequences:
                try:
                    self.branch()
                except KVCacheError:  # out of pages for the fork's copy of a partly filled page
                    pass
            elif op < 0.36 and len(self.table) > 1:
                self.table.remove(int(rng.choice(self.ids())))
            elif op < 0.55:
                self.step(decode=False)
            else:  # decode steps, often a run of them over one batch (steady, as a server decodes)
                same = rng.random() < 0.6
                seq_ids = None
                for _ in range(int(rng.integers(1, 5))):
                    seq_ids = self.step(decode=True, seq_ids=seq_ids if same else None)
            self.table.allocator.check_invariants()


@pytest.mark.parametrize("seed", range(40))
def test_vectorized_plan_equals_per_sequence_plan(seed):
    scenario = Scenario(seed)
    scenario.run(rounds=30)
    assert scenario.steps > 0


def test_steady_steps_run_on_kept_tables():
    """Runs of steps over one batch take SequenceTable.steady's kept tables (checked in
    check_step against a fresh gather); any change of a sequence in between drops them."""
    STEADY_STEPS.clear()
    for seed in range(8):
        Scenario(seed).run(rounds=30)
    assert len(STEADY_STEPS) >= 20, STEADY_STEPS
    table = SequenceTable(PageAllocator(64), 4, 8, sliding_window=False)
    ids = [0, 1, 2, 3]  # (check_step keeps the tables of a batch of 4)
    for seq_id in ids:
        table.add(seq_id)
    table.reserve_plain([table.get(i) for i in ids], [5, 2, 7, 1], None, ids)
    assert table.steady(ids) is not None and table.steady([0, 2, 1, 3]) is None and table.steady(ids[:3]) is None
    for change in (lambda: table.popn(1, 1), lambda: table.fork(0, 5), lambda: table.remove(5),
                   lambda: table.add(6), lambda: table.reserve_plain([table.get(0)], [1])):
        check_step(table, ids, [1] * 4, False, True, "steady")
        assert table.steady(ids) is not None
        change()
        assert table.steady(ids) is None


def test_steady_decode_steps_take_the_next_slots():
    """Runs of decode steps over one batch with no page shared (no forks): every step but the
    ones where some sequence starts a page takes reserve_plain's next slots, and still equals
    the reference (check_step); a popn or another batch in between sends the next step down the
    general path, and so does a shared page (a fork)."""
    NEXT_SLOT_STEPS.clear()
    for page_size, sizes in ((4, (1, 3, 6)), (16, (2, 5)), (1, (3,))):
        table = SequenceTable(PageAllocator(400), page_size, 16, sliding_window=False)
        for seq_id in range(8):
            table.add(seq_id)
        table.reserve_plain([table.get(i) for i in range(8)], [5, 1, 8, 3, 4, 2, 7, 6], None)
        for size in sizes:
            ids = list(range(size))
            for step in range(2 * page_size + 3):
                assert check_step(table, ids, [1] * size, False, True, f"ps {page_size} b{size} step {step}")
    assert len(NEXT_SLOT_STEPS) >= 30, len(NEXT_SLOT_STEPS)
    assert not any(what.startswith("ps 1 ") for what in NEXT_SLOT_STEPS)  # (every token starts a page)
    table = SequenceTable(PageAllocator(64), 4, 8, sliding_window=False)
    ids = [0, 1]
    for seq_id in ids:
        table.add(seq_id)
    table.reserve_plain([table.get(i) for i in ids], [5, 2], None)
    # (last, a fork: while a page is shared no step takes them)
    for change in (lambda: table.popn(1, 1), lambda: check_step(table, [0], [1], False, True, "other batch"),
                   lambda: table.fork(0, 5)):
        check_step(table, ids, [1, 1], False, True, "steady")
        NEXT_SLOT_STEPS.clear()
        for _ in range(4):  # (a step in which a sequence starts a page takes the general path)
            check_step(table, ids, [1, 1], False, True, "next")
        assert NEXT_SLOT_STEPS
        change()
        NEXT_SLOT_STEPS.clear()
        check_step(table, ids, [1, 1], False, True, "after a change")
        assert not NEXT_SLOT_STEPS


def test_shared_last_page_copied_once():
    """Two sequences whose appends both write into one shared, partly filled page: the first
    copies it, after which the second owns it alone and writes in place (as reserve does)."""
    table = SequenceTable(PageAllocator(32), 4, 8, sliding_window=False)
    table.add(0)
    check_step(table, [0], [8], False, True, "prefill")
    table.fork(0, 1)  # shares both full pages
    table.popn(1, 2)
    table.popn(0, 1)  # both now end inside the second page, which they share
    check_step(table, [0, 1], [1, 1], False, True, "decode into a shared page")
    assert table.get(0).pages[1] != table.get(1).pages[1]


def test_cascade_groups_of_forks():
    """Forks of one prefix, side by side and interleaved with unrelated sequences."""
    for page_size in (1, 4):
        table = SequenceTable(PageAllocator(512), page_size, 32, sliding_window=False)
        table.add(0)
        table.add(100)
        check_step(table, [0, 100], [37, 9], False, True, "prefill")
        for child, position in ((1, -1), (2, 24), (3, 12), (4, 37)):
            table.fork(0, child, position)
        for order in ([0, 1, 2, 3, 4, 100], [100, 4, 0, 3, 1, 2], [1, 100, 2, 0, 3, 4]):
            for lengths in ([1] * 6, [3, 1, 5, 2, 1, 4]):
                check_step(table, order, lengths, False, True, f"page {page_size}, {order}, {lengths}")


def test_table_arrays_gather():
    table = SequenceTable(PageAllocator(64), 4, 8, sliding_window=False)
    for seq_id, n in ((0, 0), (1, 5), (2, 8), (3, 0)):
        table.add(seq_id)
        if n:
            table.reserve_plain([table.get(seq_id)], [n])
    tables = TableArrays.gather([table.get(i) for i in range(4)])
    assert tables.counts.tolist() == [0, 2, 2, 0] and tables.indptr.tolist() == [0, 0, 2, 4, 4]
    assert tables.slot_end.tolist() == [0, 5, 8, 0]
    assert tables.pages.tolist() == list(table.get(1).pages) + list(table.get(2).pages)
