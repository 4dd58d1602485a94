"""The plans tvmattn's cache gives its attention kernels, against what the CUDA kernels read.

bench_e2e.py's calls (a first prefill and prefill repetitions of one sequence, then per batch
size: prefills of every sequence, decode steps, removal) run on the Python cache on the CPU with
Gemma 3's attention shapes (4/1 heads of 256, page 16, sliding window 512 on MHA_SLIDING layers
beside an MHA layer), every kernel slot a checker instead of a kernel. The decode checker replays
the CUDA split-KV decode kernel's index math (tir_kernels/decode_tc.py as compiled for sm_90:
min(max(132 // batch, 1), 64) splits at most, one per 128 keys, 64-key tiles, the sliding
window's first-page offset) and asserts that every key it reads lies in its request's pages,
inside page_indices, on a page of the pool; the append checkers that every slot lies in the pool.
"""

from __future__ import annotations

import numpy as np
import pytest

PAGE, WINDOW, HQ, HKV, D = 16, 512, 4, 1, 256
SMS = 132  # H100 / H200: the split count's numerator in the compiled kernel


class Checkers:
    """Kernel slots that check their launch's arguments; `problems` collects what they find."""

    def __init__(self):
        self.problems: list[str] = []
        self.launches: dict[str, int] = {}

    def _count(self, name):
        self.launches[name] = self.launches.get(name, 0) + 1

    def decode(self, sliding: bool):
        def run(q, pages, page_indptr, page_indices, length_info, k_offset, q_position, o, lse, *_):
            self._count("decode_sliding" if sliding else "decode")
            self.problems += decode_reads_problems(int(q.shape[0]), int(pages.shape[0]), page_indptr.numpy(),
                                                   page_indices.numpy(), length_info.numpy(), sliding)
            if k_offset.shape[0] != q.shape[0] or q_position.shape[0] != q.shape[0]:
                self.problems.append(f"decode: k_offset {k_offset.shape} / q_position {q_position.shape} "
                                     f"for {q.shape[0]} requests")
        return run

    def prefill(self, q, qo_indptr, pages, page_indptr, page_indices, length_info, *_):
        self._count("prefill_paged")
        indptr, indices = page_indptr.numpy().astype(np.int64), page_indices.numpy().astype(np.int64)
        if indptr[-1] > indices.shape[0] or qo_indptr.numpy()[-1] != q.shape[0]:
            self.problems.append("prefill: indptr past its arrays")
        used = indices[: indptr[-1]]
        if used.size and (used.min() < 0 or used.max() >= pages.shape[0]):
            self.problems.append(f"prefill: page {used.min()}..{used.max()} outside a pool of {pages.shape[0]}")

    def ragged(self, q, qo_indptr, k, v, kv_indptr, *_):
        self._count("prefill_ragged")
        if kv_indptr.numpy()[-1] > k.shape[0] or qo_indptr.numpy()[-1] > q.shape[0]:
            self.problems.append("ragged prefill: indptr past its arrays")

    def _slots(self, name, pages, slots):
        self._count(name)
        slots = slots.numpy().astype(np.int64)
        kept = slots[slots >= 0]
        if kept.size and kept.max() >= pages.shape[0] * PAGE:
            self.problems.append(f"{name}: slot {kept.max()} past a pool of {pages.shape[0]} pages")

    def split_rotary_append(self, qkv, positions, q, pages, slots, apply_rope):
        self._slots("split_rotary_append", pages, slots)

    def transpose_append(self, pages, k, v, slots):
        self._slots("transpose_append", pages, slots)

    def split_rotary(self, *_):
        self._count("split_rotary")

    def merge_state(self, *_):
        self._count("merge")

    def copy_single_page(self, pages, src, dst, length):
        self._count("copy_single_page")
        if not (0 <= src < pages.shape[0] and 0 <= dst < pages.shape[0]):
            self.problems.append(f"copy_single_page {src} -> {dst} of {pages.shape[0]} pages")

    def slots(self) -> dict:
        return {"decode_paged": self.decode(False), "decode_paged_sliding_window": self.decode(True),
                "prefill_paged": self.prefill, "prefill_paged_sliding_window": self.prefill,
                "prefill_ragged": self.ragged, "split_rotary_append": self.split_rotary_append,
                "split_rotary": self.split_rotary, "transpose_append": self.transpose_append,
                "merge_state": self.merge_state, "copy_single_page": self.copy_single_page}


def decode_reads_problems(batch: int, pool_pages: int, indptr, indices, length_info, sliding: bool) -> list[str]:
    """What the CUDA split-KV decode kernel would read out of place for these arguments: for each
    request and split, its first and last key (the keys between map to pages monotonically)."""
    indptr, indices, info = indptr.astype(np.int64), indices.astype(np.int64), length_info.astype(np.int64)
    problems = []
    if indptr.shape[0] != batch + 1 or indptr[-1] > indices.shape[0]:
        return [f"decode: page_indptr {indptr.shape} (end {indptr[-1]}) for {batch} requests, "
                f"{indices.shape[0]} page indices"]
    splits_max = min(max(SMS // batch, 1), 64)
    page0, pages = indptr[:-1], indptr[1:] - indptr[:-1]
    if sliding:  # length_info [3, batch]: last page's slots, window's first slot, sink
        last, first_slot, sink = info[0], info[1], info[2]
        kv_len = ((pages - 1) * PAGE + (last - first_slot + sink)) * (pages > 0)
        offset = np.where(kv_len > sink, (first_slot - sink) % PAGE, 0)
    else:
        kv_len = ((pages - 1) * PAGE + info) * (pages > 0)
        first_slot = sink = offset = np.zeros_like(kv_len)
    splits = np.minimum(splits_max, np.maximum((kv_len + 127) // 128, 1))
    split_len = ((kv_len + offset + splits - 1) // splits + 63) // 64 * 64
    covered = np.zeros_like(kv_len)
    for split in range(splits_max):
        begin = np.minimum(split * split_len - offset, kv_len)
        end = np.minimum(begin + split_len, kv_len)
        lo = np.maximum(begin, 0)
        active = (split < splits) & (end > lo)
        covered += np.where(active, end - lo, 0)
        for key in (lo, end - 1):
            position = np.where(key < sink, key, key - sink + first_slot)
            slot = page0 + position // PAGE
            bad = active & ((position < 0) | (slot >= page0 + pages) | (slot >= indices.shape[0]))
            for b in np.flatnonzero(bad)[:3]:
                problems.append(f"decode{'_sliding' if sliding else ''} batch {batch}: request {b} split {split} "
                                f"reads page_indices[{slot[b]}], its pages {page0[b]}..{page0[b] + pages[b] - 1}")
    if (covered != kv_len).any():
        b = int(np.argmax(covered != kv_len))
        problems.append(f"decode batch {batch}: the splits cover {covered[b]} of request {b}'s {kv_len[b]} keys")
    used = indices[: indptr[-1]]
    if used.size and (used.min() < 0 or used.max() >= pool_pages):
        problems.append(f"decode: page {used.min()}..{used.max()} outside a pool of {pool_pages}")
    return problems


def run_bench_calls(prompt: int, batches, steps: int, layers: int = 2, reps: int = 2, max_batch: int = 64):
    """bench_e2e.py's cache calls on a CPU cache with checking slots -> the Checkers."""
    import tvm

    from tvmattn.runtime.cache import PagedKVCache
    from tvmattn.runtime.kinds import AttnKind

    pages_per_sequence = -(-(prompt + 64 + 3 + 8) // PAGE)  # bench_e2e.py's cache size (--steps 64)
    kinds = tuple(AttnKind.MHA if (i + 1) % 6 == 0 or i == layers - 1 else AttnKind.MHA_SLIDING
                  for i in range(layers))
    checkers = Checkers()
    cache = PagedKVCache(num_layers=layers, num_qo_heads=HQ, num_kv_heads=HKV, qk_head_dim=D, dtype="float32",
                         page_size=PAGE, max_num_sequences=max_batch,
                         max_total_seq_len=max_batch * pages_per_sequence * PAGE, prefill_chunk_size=prompt,
                         rope_mode="none", attn_kinds=kinds, layer_sliding_window_size=WINDOW, device=tvm.cpu(0),
                         kernels=checkers.slots())
    buffers: dict = {}

    def forward(seq_ids, lengths):
        n = sum(lengths)
        if n not in buffers:
            buffers[n] = (tvm.runtime.tensor(np.zeros((n, HQ + 2 * HKV, D), "float32")),
                          tvm.runtime.tensor(np.zeros((n, HQ, D), "float32")))
        qkv, o = buffers[n]
        cache.begin_forward(seq_ids, lengths)
        for layer in range(layers):
            cache.attention_with_fused_qkv(layer, 0.0625, qkv, o)
        cache.end_forward()

    for _ in range(1 + reps):  # the first prefill call, then the timed ones
        cache.add_sequence(0)
        forward([0], [prompt])
        cache.remove_sequence(0)
    for batch in batches:
        for seq_id in range(batch):
            cache.add_sequence(seq_id)
            forward([seq_id], [prompt])
        for _ in range(steps):
            forward(list(range(batch)), [1] * batch)
        for seq_id in range(batch):
            cache.remove_sequence(seq_id)
    return checkers


def test_decode_reads_problems_finds_a_request_whose_pages_are_too_few():
    """The checker itself: pages outside the pool, and a request whose length_info claims more
    keys than its pages hold (20 slots used of a 16-slot last page)."""
    indptr, indices = np.array([0, 2], np.int32), np.array([5, 6], np.int32)
    ok = np.array([[16], [0], [0]], np.int32)
    assert decode_reads_problems(1, 8, indptr, indices, ok, sliding=True) == []
    assert decode_reads_problems(1, 8, indptr, np.array([5, 9], np.int32), ok, sliding=True) \
        == ["decode: page 5..9 outside a pool of 8"]
    short = decode_reads_problems(1, 8, np.array([0, 1], np.int32), indices[:1], np.array([[16], [1], [0]], np.int32),
                                  sliding=True)
    assert short == [], "a window starting at slot 1 of its only page reads 15 keys of it"
    over = decode_reads_problems(1, 8, np.array([0, 1], np.int32), indices[:1], np.array([[20], [0], [0]], np.int32),
                                 sliding=True)
    assert any("reads page_indices[1]" in p for p in over)


@pytest.mark.parametrize("prompt, batches", [(600, (1, 16)), (40, (3,))])
def test_bench_calls_past_the_window_stay_inside_what_the_cuda_decode_reads(prompt, batches):
    checkers = run_bench_calls(prompt, batches, steps=4)
    assert checkers.problems == []
    assert checkers.launches["decode"] >= 4 * len(batches) and checkers.launches["decode_sliding"] >= 4 * len(batches)


@pytest.mark.slow
def test_gemma3_e2e_bench_calls_stay_inside_what_the_cuda_decode_reads():
    """bench_e2e.py --prompt-len 4096 at batches 1, 16, 64 (3 warm-up + 64 steps each)."""
    checkers = run_bench_calls(4096, (1, 16, 64), steps=67, reps=3)
    assert checkers.problems == []
