"""Our kernels inside TVM's own C++ paged KV cache (`vm.builtin.paged_attention_kv_cache_create`).

Every MHA slot of the cache gets a tir_kernels kernel (as `["tirx", f]` for attention, a plain
function for the auxiliary ones). The cache then does what a model does: add sequences, prefill
(ragged self-attention + paged cross-attention + merge), decode, fork (within a page: copy
single page; at the end: shared prefix, cascade over depths + merge), pop tokens, and read K/V
back with debug_get_kv. The test keeps each sequence's K/V unpaged and checks every layer's
output against the float64 reference and the cached K/V against what was appended.

Slots we do not fill: MLA (`[]`) and tree attention, which is off (`[]`) except in the
token-tree test; that one runs with our tree kernels and, as an anchor, with TVM's.
"""

from __future__ import annotations

import enum

import numpy as np
import pytest
import reference as ref
import tvm
from harness import device_for, randn, tensor, to_dtype
from tvm.relax.frontend.nn.llm.kv_cache import (
    AttnKind,
    tree_attn,
    tree_attn_cpu,
    tree_attn_with_paged_kv_cache,
    tree_attn_with_paged_kv_cache_cpu,
)
from tvm.runtime import ShapeTuple

from tir_kernels import (
    AttentionConfig,
    compact_copy,
    copy_single_page,
    debug_get_kv,
    default_sm_scale,
    merge_state,
    paged_decode,
    paged_prefill,
    tree_mask_paged_prefill,
    tree_mask_ragged_prefill,
    ragged_prefill,
    split_rotary,
    transpose_append,
)
from tvmattn.runtime.ffi import CreateArgs

NUM_LAYERS = 2
HQ, HKV, D, PAGE_SIZE, DTYPE = 8, 2, 64, 16, "float16"
ROPE_THETA, ROPE_SCALE = 5e5, 1.0
RESERVED_SEQS, TOKEN_CAPACITY, PREFILL_CHUNK = 16, 2048, 512
SM_SCALE = default_sm_scale(D)


class RopeMode(enum.IntEnum):
    """TVM's RoPEMode: NORMAL rotates q/k in split_rotary before caching; INLINE rotates in the
    attention kernels (rotary_mode=1) and caches K un-rotated."""

    NONE = 0
    NORMAL = 1
    INLINE = 2


def builtin(name: str):
    return tvm.get_global_func(f"vm.builtin.{name}")


# TVM's tree-attention kernels (config -> PrimFunc), for the token-tree test only.
def tvm_tree_ragged(config: AttentionConfig):
    args = (config.num_kv_heads, config.num_qo_heads, config.head_dim, config.dtype, {})
    return tree_attn(*args, config.tvm_target()) if config.is_gpu else tree_attn_cpu(*args)


def tvm_tree_paged(config: AttentionConfig):
    args = (config.num_kv_heads, config.num_qo_heads, config.head_dim, config.dtype, {})
    if config.is_gpu:
        return tree_attn_with_paged_kv_cache(*args, config.tvm_target())
    return tree_attn_with_paged_kv_cache_cpu(*args)


def tree_kernel(kernels, whose: str, kind: str, config: AttentionConfig):
    """Tree-attention kernel of `whose` ("ours" or "tvm") for the paged or ragged slot."""
    generators = {("ours", "paged"): tree_mask_paged_prefill, ("ours", "ragged"): tree_mask_ragged_prefill,
                  ("tvm", "paged"): tvm_tree_paged, ("tvm", "ragged"): tvm_tree_ragged}
    return kernels.get(generators[whose, kind], config)


def create_cache(kernels, config: AttentionConfig, rope_mode: RopeMode, sliding: bool = False, tree: str = ""):
    """tree: "" (tree slots off), "ours" or "tvm" (whose tree-attention kernels fill them)."""
    """TVM's cache with our kernels (CreateArgs: paged_kv_cache.cc's 28 arguments by name)."""

    def ours(generator, *extra, cfg=config):
        return kernels.get(generator, cfg, *extra)

    sliding_config = config.replace(sliding_window=True)
    args = CreateArgs(
        cache_config=ShapeTuple([RESERVED_SEQS, TOKEN_CAPACITY, PREFILL_CHUNK, config.page_size, int(sliding)]),
        layer_indptr=ShapeTuple([0, NUM_LAYERS]),  # one pipeline stage
        num_qo_heads=config.num_qo_heads,
        num_kv_heads=config.num_kv_heads,
        qk_head_dim=config.head_dim,
        v_head_dim=config.v_head_dim,
        attn_kinds=ShapeTuple([int(AttnKind.MHA)] * NUM_LAYERS),
        enable_kv_transfer=False,
        rope_mode=int(rope_mode),
        rope_scale=config.rope_scale,
        rope_theta=config.rope_theta,
        rope_ext_factors=None,
        init=tvm.runtime.empty((), config.dtype, device=device_for(config)),  # dtype and device of the pages
        transpose_append_mha=ours(transpose_append),
        transpose_append_mla=None,
        prefill_ragged=["tirx", ours(ragged_prefill)],
        prefill_paged=["tirx", ours(paged_prefill)],
        decode_paged=["tirx", ours(paged_decode)],
        prefill_paged_sliding=["tirx", ours(paged_prefill, cfg=sliding_config)] if sliding else [],
        decode_paged_sliding=["tirx", ours(paged_decode, cfg=sliding_config)] if sliding else [],
        tree_paged=["tirx", tree_kernel(kernels, tree, "paged", config)] if tree else [],
        tree_ragged=["tirx", tree_kernel(kernels, tree, "ragged", config)] if tree else [],
        mla_prefill=[],
        merge=[ours(merge_state)],
        split_rotary=ours(split_rotary),
        copy_single_page=ours(copy_single_page),
        debug_get_kv=ours(debug_get_kv, NUM_LAYERS),
        compact_copy=ours(compact_copy),
    )
    return builtin("paged_attention_kv_cache_create")(*args.positional())


class CacheUnderTest:
    """TVM's cache plus the unpaged truth: per sequence and layer, the K and V the cache must
    hold (K rotated when RoPE is NORMAL), and, with a sliding window, (window, sink)."""

    def __init__(self, kernels, target: str, rope_mode: RopeMode = RopeMode.NONE, sliding: bool = False,
                 tree: str = "", seed: int = 0):
        self.config = AttentionConfig(HQ, HKV, D, dtype=DTYPE, page_size=PAGE_SIZE, target=target,
                                      rope_theta=ROPE_THETA, rope_scale=ROPE_SCALE)
        self.device = device_for(self.config)
        self.rope_mode = rope_mode
        self.cache = create_cache(kernels, self.config, rope_mode, sliding, tree)
        self.rng = np.random.default_rng(seed)
        self.k: dict[int, list[np.ndarray]] = {}
        self.v: dict[int, list[np.ndarray]] = {}
        self.window: dict[int, tuple[int, int]] = {}

    # Sequence bookkeeping, mirrored in the truth.
    def add(self, seq_id: int, window: tuple[int, int] | None = None) -> None:
        builtin("kv_state_add_sequence")(self.cache, seq_id)
        self.k[seq_id] = [np.zeros((0, HKV, D), DTYPE) for _ in range(NUM_LAYERS)]
        self.v[seq_id] = [np.zeros((0, HKV, D), DTYPE) for _ in range(NUM_LAYERS)]
        if window is not None:
            builtin("attention_kv_cache_enable_sliding_window_for_seq")(self.cache, seq_id, *window)
            self.window[seq_id] = window

    def fork(self, parent: int, child: int, pos: int = -1) -> None:
        builtin("kv_state_fork_sequence")(self.cache, parent, child, pos)
        end = len(self.k[parent][0]) if pos == -1 else pos
        self.k[child] = [k[:end].copy() for k in self.k[parent]]
        self.v[child] = [v[:end].copy() for v in self.v[parent]]

    def popn(self, seq_id: int, n: int) -> None:
        builtin("kv_state_popn")(self.cache, seq_id, n)
        self.k[seq_id] = [k[: len(k) - n] for k in self.k[seq_id]]
        self.v[seq_id] = [v[: len(v) - n] for v in self.v[seq_id]]

    def remove(self, seq_id: int) -> None:
        builtin("kv_state_remove_sequence")(self.cache, seq_id)
        del self.k[seq_id], self.v[seq_id]

    def length(self, seq_id: int) -> int:
        return len(self.k[seq_id][0])

    # One forward step over all layers.
    def forward(self, seq_ids, lengths, tree_parents=None) -> None:
        """Append `lengths[i]` new tokens to `seq_ids[i]` in every layer and check each layer's
        output. tree_parents[i]: parent (-1 = root) of each new token of sequence i, for a token
        tree; None = a chain."""
        args = [self.cache, ShapeTuple(seq_ids), ShapeTuple(lengths)]
        if tree_parents is not None:
            args.append(ShapeTuple([p for parents in tree_parents for p in parents]))
        builtin("kv_state_begin_forward")(*args)
        for layer in range(NUM_LAYERS):
            q = [randn(self.rng, (n, HQ, D), DTYPE) for n in lengths]
            k = [randn(self.rng, (n, HKV, D), DTYPE) for n in lengths]
            v = [randn(self.rng, (n, HKV, D), DTYPE) for n in lengths]
            qkv = np.concatenate([np.concatenate(parts, axis=1) for parts in zip(q, k, v)])
            o = tvm.runtime.empty((sum(lengths), HQ, D), DTYPE, device=self.device)
            builtin("attention_kv_cache_attention_with_fused_qkv")(self.cache, layer, SM_SCALE, tensor(qkv, self.device), o)
            o = o.numpy().astype(np.float64)
            start = 0
            for i, seq_id in enumerate(seq_ids):
                n = lengths[i]
                parents = None if tree_parents is None else tree_parents[i]
                expected = self._expected(seq_id, layer, q[i], k[i], v[i], parents)
                rtol, atol = ref.TOLERANCES[DTYPE]
                np.testing.assert_allclose(o[start : start + n], expected, rtol=rtol, atol=atol,
                                           err_msg=f"layer {layer}, sequence {seq_id}")
                start += n
        builtin("kv_state_end_forward")(self.cache)
        for seq_id in seq_ids:
            self._slide(seq_id)

    def _expected(self, seq_id, layer, q, k, v, parents):
        """Append k/v to the truth; the reference output of the new queries."""
        history = len(self.k[seq_id][layer])
        positions = history + (np.arange(len(q)) if parents is None else _depths(parents))
        if self.rope_mode == RopeMode.NORMAL:
            # split_rotary rotates q and k and writes them in the kernel dtype.
            q = to_dtype(ref.rope(q, positions, ROPE_THETA, ROPE_SCALE), DTYPE)
            k = to_dtype(ref.rope(k, positions, ROPE_THETA, ROPE_SCALE), DTYPE)
        self.k[seq_id][layer] = np.concatenate([self.k[seq_id][layer], k])
        self.v[seq_id][layer] = np.concatenate([self.v[seq_id][layer], v])
        keys, values = self.k[seq_id][layer], self.v[seq_id][layer]
        if self.rope_mode == RopeMode.INLINE:
            q = ref.rope(q, positions, ROPE_THETA, ROPE_SCALE)
            keys = ref.rope(keys, np.arange(len(keys)), ROPE_THETA, ROPE_SCALE)
        if parents is None:
            return ref.attention(q, keys, values, SM_SCALE, causal=True)[0]
        # Token tree: node i sees the history and its ancestors (itself included).
        rows = []
        for i in range(len(q)):
            visible = list(range(history)) + [history + a for a in _ancestors(parents, i)]
            rows.append(ref.attention(q[i : i + 1], keys[visible], values[visible], SM_SCALE, causal=False)[0])
        return np.concatenate(rows)

    def _slide(self, seq_id: int) -> None:
        """Sliding window: keep the sink and the most recent tokens, `window` in all."""
        if seq_id not in self.window:
            return
        window, sink = self.window[seq_id]
        excess = self.length(seq_id) - window
        if excess > 0:
            keep = np.r_[0:sink, sink + excess : self.length(seq_id)]
            self.k[seq_id] = [k[keep] for k in self.k[seq_id]]
            self.v[seq_id] = [v[keep] for v in self.v[seq_id]]

    def commit_tree(self, seq_ids, tree_parents, leaves) -> None:
        """Keep, per sequence, only the path root..leaf of the last forward's token tree.
        seq_ids must be in the order of that forward (TVM indexes its append map by position)."""
        builtin("attention_kv_cache_commit_accepted_token_tree_nodes")(self.cache, ShapeTuple(seq_ids), ShapeTuple(leaves))
        for seq_id, parents, leaf in zip(seq_ids, tree_parents, leaves):
            history = self.length(seq_id) - len(parents)
            keep = np.r_[0:history, [history + a for a in _ancestors(parents, leaf)]].astype(int)
            self.k[seq_id] = [k[keep] for k in self.k[seq_id]]
            self.v[seq_id] = [v[keep] for v in self.v[seq_id]]

    def check_cached_kv(self) -> None:
        """debug_get_kv of every sequence equals the truth (all layers). Copies are exact; K
        rotated by split_rotary (fp32 math) may differ from the float64 truth by one fp16 ulp."""
        rtol, atol = (2e-3, 1e-3) if self.rope_mode == RopeMode.NORMAL else (0, 0)
        for seq_id in self.k:
            n = self.length(seq_id)
            k = tvm.runtime.empty((NUM_LAYERS, n, HKV, D), DTYPE, device=self.device)
            v = tvm.runtime.empty((NUM_LAYERS, n, HKV, D), DTYPE, device=self.device)
            builtin("attention_kv_cache_debug_get_kv")(self.cache, seq_id, 0, n, k, v)
            np.testing.assert_allclose(k.numpy(), np.stack(self.k[seq_id]), rtol=rtol, atol=atol,
                                       err_msg=f"K of sequence {seq_id}")
            np.testing.assert_array_equal(v.numpy(), np.stack(self.v[seq_id]), err_msg=f"V of sequence {seq_id}")


def _ancestors(parents, node):
    """Path root..node (node included) in a token tree given by parent pointers."""
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _depths(parents):
    return np.array([len(_ancestors(parents, i)) - 1 for i in range(len(parents))])


@pytest.mark.parametrize("rope_mode", [RopeMode.NONE, RopeMode.NORMAL, RopeMode.INLINE], ids=lambda m: m.name.lower())
def test_tvm_cache_with_our_kernels(kernels, target, rope_mode):
    c = CacheUnderTest(kernels, target, rope_mode, seed=int(rope_mode))
    for seq_id in (0, 1, 2):
        c.add(seq_id)
    c.forward([0, 1, 2], [23, 16, 5])  # prefill from empty: ragged prefill only
    c.forward([0, 1, 2], [7, 12, 1])  # chunked prefill: paged (history) + ragged (new) + merge
    for _ in range(2):
        c.forward([0, 1, 2], [1, 1, 1])  # decode
    c.check_cached_kv()

    c.fork(0, 3, pos=20)  # inside a page: copy_single_page copies the shared part of page 1
    c.fork(1, 4)  # at the end: 3 and 4 share their parents' pages
    for _ in range(2):
        c.forward([0, 3, 1, 4], [1, 1, 1, 1])  # decode over shared prefixes (cascade + merge)
    c.forward([3, 4, 2], [9, 3, 17])
    c.check_cached_kv()

    c.popn(0, 3)
    c.popn(4, 1)
    c.forward([0, 4], [1, 2])
    c.check_cached_kv()

    for seq_id in (3, 0, 4, 1, 2):
        c.remove(seq_id)
        c.check_cached_kv()
    assert builtin("attention_kv_cache_empty")(c.cache)


def test_tvm_cache_sliding_window(kernels, target):
    """Sequences with an attention sink and a sliding window: our sliding-window prefill and
    decode read length_info as (last_page_len, sliding_window_offset, sink_size)."""
    c = CacheUnderTest(kernels, target, sliding=True, seed=5)
    windows = {0: (20, 6), 1: (33, 4), 2: (40, 0)}
    for seq_id, window in windows.items():
        c.add(seq_id, window)
    c.forward([0, 1, 2], [4, 6, 7])
    c.forward([0, 1, 2], [19, 30, 35])
    c.forward([0, 1, 2], [6, 5, 2])
    for _ in range(18):
        c.forward([0, 1, 2], [1, 1, 1])
    c.check_cached_kv()


@pytest.mark.parametrize("tree_kernels", ["ours", "tvm"])
def test_tvm_cache_commit_token_tree(kernels, target, tree_kernels):
    """TVM's cache runs a token tree (tree_attn_mn_indptr and tree_attn_mask filled by its C++)
    through the tree-attention slots, ours (tree_mask_paged_prefill / tree_mask_ragged_prefill)
    or TVM's, checked against the reference; committing accepted nodes moves their K/V with
    our compact_copy."""
    c = CacheUnderTest(kernels, target, tree=tree_kernels, seed=9)
    c.add(0)
    c.add(1)
    c.forward([1, 0], [9, 21])
    # New tokens of sequence 0 form the tree 0 -> {1, 2}, 1 -> 3, 2 -> 4, 4 -> 5; sequence 1's a chain.
    # TVM decides whether to compact from the LAST sequence of the commit call, so the tree goes last.
    chain, tree = [-1, 0, 1], [-1, 0, 0, 1, 2, 4]
    c.forward([1, 0], [len(chain), len(tree)], tree_parents=[chain, tree])
    c.check_cached_kv()
    # Sequence 0 keeps the path 0 -> 2 -> 4 -> 5 (three tokens move), sequence 1 the prefix 0 -> 1.
    c.commit_tree([1, 0], [chain, tree], [1, 5])
    c.check_cached_kv()
    c.forward([0, 1], [1, 1])
    c.check_cached_kv()
