"""MLA layers in tvmattn.PagedKVCache against a reference that expands the latent rows.

`MLAModel` drives an MLA cache as a DeepSeek model does (MLC-LLM's calls to TVM's cache), per
layer: append_mla_kv of the step's latent rows, then
- in a decode step (every sequence appends one token) cross_attention over the history and the
  new rows;
- otherwise self_attention among the new tokens at the model's own head dims (192 / 128, as
  in DeepSeek), cross_attention over the history, and merge_attn_output_inplace.
Beside the cache it keeps each sequence's latent rows unpaged and checks every output and LSE
against plain multi-head attention over per-head K (the whole row) and V (its latent part),
tests/reference.py, and the cached rows through debug_get_kv_mla (bit for bit).

A scenario also runs through TVM's own C++ cache with the same kernels (created by the same
positional call), which must give the same outputs. Bad input raises KVCacheError and leaves
the cache as it was. CPU always; CUDA through the `target` fixture where a GPU is present.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import reference as ref
import tvm
from harness import empty, randn, tensor, to_dtype
from tvm.runtime import ShapeTuple

import tir_kernels
from tir_kernels import AttentionConfig, MLAConfig
from tvmattn import KVCacheError, PagedKVCache
from tvmattn.runtime.ffi import AttnKind, install_vm_builtins, paged_attention_kv_cache_create, uninstall_vm_builtins

LAYERS, HEADS, LATENT, ROPE, DTYPE = 2, 4, 64, 16, "float16"
QK = LATENT + ROPE
SELF_QK, SELF_V = 192, 128  # the model's own (not absorbed) head dims of self-attention, as DeepSeek's
SM_SCALE = 1.0 / np.sqrt(SELF_QK)


def device_of(target: str):
    return tvm.cuda(0) if target.startswith("cuda") else tvm.cpu(0)


@dataclasses.dataclass(frozen=True)
class Dims:
    """An MLA model's attention sizes: query heads, latent and rope widths, dtype."""

    heads: int = HEADS
    latent: int = LATENT
    rope: int = ROPE
    dtype: str = DTYPE

    @property
    def qk(self) -> int:
        return self.latent + self.rope


DEEPSEEK_V2_LITE = Dims(16, 512, 64, "bfloat16")


def check_close(actual, expected, what: str, lse: bool = False, dtype: str = DTYPE,
                lse_tolerance: tuple = ref.LSE_TOLERANCE) -> None:
    rtol, atol = lse_tolerance if lse else ref.TOLERANCES[dtype]
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=what)


def expanded_attention(q, rows, latent: int, causal: bool):
    """q [qo, H, qk] over latent rows [kv, qk]: every head's key is the row, its value the latent part."""
    k = np.repeat(np.asarray(rows, np.float64)[:, None, :], q.shape[1], axis=1)
    return ref.attention(q, k, k[:, :, :latent], SM_SCALE, causal)


class MLAModel:
    """An MLA cache and the unpaged latent rows it must hold (see the module docstring). `call`
    runs a cache function by name: the cache's method, or a `vm.builtin.*` function (TVM's C++
    cache, or ours through install_vm_builtins) with the cache first."""

    def __init__(self, target="llvm", page_size=16, seed=0, cache=None, call=None, cross_without_history=True,
                 dims: Dims = Dims(), **options):
        self.device = device_of(target)
        self.target = target
        self.d = dims
        options = {"max_num_sequences": 8, "max_total_seq_len": 512, "prefill_chunk_size": 128, **options}
        self.cache = cache or PagedKVCache(num_layers=LAYERS, num_qo_heads=dims.heads, num_kv_heads=1,
                                           qk_head_dim=dims.qk, v_head_dim=dims.latent, dtype=dims.dtype,
                                           page_size=page_size, attn_kinds="mla", device=self.device, **options)
        self.call = call or (lambda name, *args: getattr(self.cache, name)(*args))
        self.rng = np.random.default_rng(seed)
        self.rows: dict[int, list] = {}
        self.outputs: list = []  # every output of every step, in order (to compare two caches)
        # run cross_attention when no sequence of the step has a history (MLC-LLM's "prefill"
        # mode does not; TVM's cache then writes no output, ours o = 0, lse = -5e4)
        self.cross_without_history = cross_without_history

    def add(self, seq_id):
        self.call("add_sequence", seq_id)
        self.rows[seq_id] = [np.zeros((0, self.d.qk)) for _ in range(LAYERS)]

    def fork(self, parent, child, pos=-1):
        self.call("fork_sequence", parent, child, pos)
        end = len(self.rows[parent][0]) if pos == -1 else pos
        self.rows[child] = [r[:end].copy() for r in self.rows[parent]]

    def popn(self, seq_id, n):
        self.call("popn", seq_id, n)
        self.rows[seq_id] = [r[: len(r) - n] for r in self.rows[seq_id]]

    def remove(self, seq_id):
        self.call("remove_sequence", seq_id)
        del self.rows[seq_id]

    def forward(self, seq_ids, lengths, check_plan=None):
        """One step; check_plan(plan) runs after begin_forward (our caches)."""
        self.call("begin_forward", seq_ids, lengths)
        if check_plan is not None:
            check_plan(self.cache.current_plan())
        decode = all(n == 1 for n in lengths)
        total = sum(lengths)
        for layer in range(LAYERS):
            kv = randn(self.rng, (total, self.d.qk), self.d.dtype)
            self.call("append_mla_kv", layer, tensor(kv, self.device))
            history = [self.rows[s][layer] for s in seq_ids]
            starts = np.cumsum([0] + lengths)
            stored = self.stored(layer, kv)
            for i, s in enumerate(seq_ids):
                self.rows[s][layer] = np.concatenate([history[i], stored[starts[i] : starts[i + 1]]])
            keys = [self.rows[s][layer] for s in seq_ids] if decode else history
            what = f"{seq_ids} {lengths} layer {layer}"
            cross = decode or self.cross_without_history or any(len(h) for h in history)
            o_cross, lse_cross = self._cross(layer, total, starts, keys, what) if cross else (None, None)
            if not decode:
                self.outputs.append(self._self_and_merge(layer, total, starts, lse_cross, what))
            self.outputs.append(o_cross)
        self.call("end_forward")

    def stored(self, layer, kv):
        """What the pages hold of appended rows kv [n, qk] (float64): the rows themselves."""
        return kv.astype(np.float64)

    def paged_lse_tolerance(self) -> tuple:
        """(rtol, atol) of an lse over the pages (cross attention, and the merge that takes it)."""
        return ref.LSE_TOLERANCE

    def _cross(self, layer, total, starts, keys, what):
        d = self.d
        q = randn(self.rng, (total, d.heads, d.qk), d.dtype)
        o = empty((total, d.heads, d.latent), d.dtype, self.device)
        lse = empty((total, d.heads), "float32", self.device)
        self.call("cross_attention", layer, SM_SCALE, tensor(q, self.device), o, lse)
        o, lse = o.numpy().astype(np.float64), lse.numpy()
        for i, rows in enumerate(keys):
            lo, hi = starts[i], starts[i + 1]
            eo, el = expanded_attention(q[lo:hi], rows, d.latent, causal=False)
            check_close(o[lo:hi], eo, f"cross o of request {i}, {what}", dtype=d.dtype)
            check_close(lse[lo:hi], el, f"cross lse of request {i}, {what}", lse=True,
                        lse_tolerance=self.paged_lse_tolerance())
        return o, lse

    def _self_and_merge(self, layer, total, starts, lse_cross, what):
        h, dtype = self.d.heads, self.d.dtype
        q, k = (randn(self.rng, (total, h, SELF_QK), dtype) for _ in range(2))
        v = randn(self.rng, (total, h, SELF_V), dtype)
        o, lse = empty((total, h, SELF_V), dtype, self.device), empty((total, h), "float32", self.device)
        self.call("self_attention", layer, SM_SCALE, *(tensor(x, self.device) for x in (q, k, v)), o, lse)
        o_self, lse_self = o.numpy().astype(np.float64), lse.numpy()
        for i in range(len(starts) - 1):
            lo, hi = starts[i], starts[i + 1]
            eo, el = ref.attention(q[lo:hi], k[lo:hi], v[lo:hi], SM_SCALE, causal=True)
            check_close(o_self[lo:hi], eo, f"self o of request {i}, {what}", dtype=dtype)
            check_close(lse_self[lo:hi], el, f"self lse of request {i}, {what}", lse=True)
        if lse_cross is None:
            return o_self
        # the cross output projected to the self-attention's width (the model's W_UV), then merged
        projected = randn(self.rng, (total, h, SELF_V), dtype)
        self.call("merge_attn_output_inplace", o, lse, tensor(projected, self.device),
                  tensor(lse_cross.astype(np.float32), self.device))
        eo, el = ref.merge_states(o_self, lse_self, projected, lse_cross)
        check_close(o.numpy().astype(np.float64), eo, f"merged o, {what}", dtype=dtype)
        check_close(lse.numpy(), el, f"merged lse, {what}", lse=True, lse_tolerance=self.paged_lse_tolerance())
        return o.numpy().astype(np.float64)

    def read_rows(self, seq_id):
        n = len(self.rows[seq_id][0])
        kv = empty((LAYERS, n, self.d.qk), self.d.dtype, self.device)
        self.call("debug_get_kv_mla", seq_id, 0, n, kv)
        return kv.numpy().astype(np.float64)

    def check_rows(self):
        for seq_id, rows in self.rows.items():
            if len(rows[0]):
                np.testing.assert_array_equal(self.read_rows(seq_id), np.stack(rows), err_msg=f"rows of {seq_id}")

    def check_no_leaks(self, initial_pages: int):
        self.check_rows()
        for seq_id in list(self.rows):
            self.remove(seq_id)
        assert self.cache.empty() and self.cache.get_num_available_pages() == initial_pages


@pytest.mark.parametrize("page_size", [1, 16])
def test_mla_prefill_extend_decode(target, page_size):
    """Empty histories (a first prefill: cross-attention sees nothing), a prefill over a history,
    decode steps, a mixed batch of 1-token and long appends, page boundaries."""
    m = MLAModel(target, page_size, seed=1)
    initial = m.cache.get_num_available_pages()
    for s in (0, 1, 2):
        m.add(s)
    m.forward([0, 1, 2], [17, 1, 5])
    m.forward([1, 0], [16, 3])
    m.forward([0, 1, 2], [1, 1, 1])
    m.forward([2, 0, 1], [1, 1, 1])
    m.forward([2, 1], [1, 14])  # mixed: a 1-token append in a prefill step
    m.check_no_leaks(initial)


def test_mla_fork_popn_cascade(target):
    """Forks at a page boundary and inside a page (a copied page), a chain of forks, popn into a
    shared page (copied before the next append), adjacent forks of one prefix attending to it
    once (a cascade level merged at the latent width), remove."""
    m = MLAModel(target, 4, seed=2)
    initial = m.cache.get_num_available_pages()
    m.add(0)
    m.forward([0], [18])
    m.fork(0, 1, 16)  # at a page boundary
    m.fork(0, 2, 10)  # inside a page
    m.fork(2, 3)  # the whole parent
    m.forward([0, 1, 2, 3], [1, 1, 1, 1])

    def cascade(plan):
        assert len(plan.host.cross) == 2, "forks of one prefix attend to it as a cascade level"

    m.forward([0, 1, 3], [2, 3, 1], cascade)
    m.forward([0, 1], [1, 1])
    m.popn(3, 5)  # into pages shared with 2
    m.forward([3, 2], [2, 6])
    m.check_rows()
    m.remove(1)
    m.forward([0, 2, 3], [1, 1, 1])
    m.check_no_leaks(initial)


def test_mla_deepseek_v2_lite_shapes(target):
    """DeepSeek-V2-Lite's attention (16 heads, latent 512, rope 64, bf16): prefill, an extend
    step over a history, decode steps across a page boundary, a fork."""
    m = MLAModel(target, 16, seed=5, dims=DEEPSEEK_V2_LITE)
    initial = m.cache.get_num_available_pages()
    m.add(0)
    m.add(1)
    m.forward([0, 1], [40, 9])
    m.forward([1, 0], [24, 3])
    for _ in range(3):
        m.forward([0, 1], [1, 1])
    m.fork(0, 2, 30)
    m.forward([2, 0, 1], [1, 1, 1])
    m.check_no_leaks(initial)


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [Dims(128, 512, 64, "float16"), DEEPSEEK_V2_LITE], ids=["h128-fp16", "h16-bf16"])
def test_mla_wgmma_decode_in_cache(monkeypatch, dims):
    """The cache's decode levels on mla_sm90's wgmma decode (picked for every batch here): decode
    steps across page and 64-row step boundaries, a fork inside a page (a cascade level), popn,
    against the expanded reference."""
    from tvmattn.runtime import mla as runtime_mla

    batches = []

    def pick(config, batch):
        batches.append(batch)
        return "wgmma"

    monkeypatch.setattr(runtime_mla, "choose_mla_decode_kernel", pick)
    m = MLAModel("cuda", 16, seed=7, dims=dims)
    initial = m.cache.get_num_available_pages()
    for s in (0, 1, 2):
        m.add(s)
    m.forward([0, 1, 2], [62, 15, 1])
    for _ in range(3):
        m.forward([0, 1, 2], [1, 1, 1])
    m.fork(0, 3, 40)
    m.forward([3, 0, 1, 2], [1, 1, 1, 1])
    m.popn(1, 5)
    m.forward([1, 2], [1, 1])
    m.check_no_leaks(initial)
    assert batches and max(batches) >= 3


def create_args(kernels, config: MLAConfig, target: str, seqs=8, capacity=512, chunk=128):
    """TVM's positional create call of an MLA cache, our kernels in its slots."""
    ragged = kernels.get(tir_kernels.ragged_prefill, AttentionConfig(HEADS, HEADS, SELF_QK, SELF_V, dtype=DTYPE,
                                                                      target=target))
    self_merge = kernels.get(tir_kernels.merge_state, MLAConfig(HEADS, SELF_V, 0, dtype=DTYPE, target=target))
    placeholder = tvm.get_global_func("tvmattn.kv_state_clear")  # never called by an MLA cache
    return [
        ShapeTuple([seqs, capacity, chunk, config.page_size, 0]),
        ShapeTuple([0, LAYERS]), HEADS, 1, QK, LATENT, ShapeTuple([int(AttnKind.MLA)] * LAYERS), False, 0, 1.0, 1e4,
        None, tvm.runtime.empty((), DTYPE, device=device_of(target)),
        None, kernels.get(tir_kernels.mla_transpose_append, config),
        ["tirx", ragged], [], [], [], [], [], [],
        ["tirx", kernels.get(tir_kernels.mla_paged_prefill, config)],
        [kernels.get(tir_kernels.merge_state, config), self_merge],
        placeholder, kernels.get(tir_kernels.mla_copy_single_page, config),
        kernels.get(tir_kernels.mla_debug_get_kv, config, LAYERS), placeholder,
    ]


def scenario(m: MLAModel) -> None:
    for s in (0, 1):
        m.add(s)
    m.forward([0, 1], [20, 5])
    m.forward([0, 1], [1, 1])
    m.fork(0, 2, 20)
    m.forward([0, 2, 1], [3, 4, 2])
    m.forward([0, 1, 2], [1, 1, 1])
    m.popn(1, 2)
    m.forward([1, 0], [1, 17])
    m.check_rows()


_BUILTIN = {"add_sequence": "kv_state_add_sequence", "remove_sequence": "kv_state_remove_sequence",
            "fork_sequence": "kv_state_fork_sequence", "popn": "kv_state_popn",
            "begin_forward": "kv_state_begin_forward", "end_forward": "kv_state_end_forward"}


def builtin_call(cache, prefix="vm.builtin."):
    def call(name, *args):
        name = _BUILTIN.get(name, f"attention_kv_cache_{name}")
        if name == "kv_state_begin_forward":
            args = tuple(ShapeTuple(a) for a in args)
        return tvm.get_global_func(prefix + name)(cache, *args)

    return call


def test_mla_as_tvm_cache(kernels, target):
    """The same positional create call builds TVM's C++ cache and ours (tvmattn's function, and
    vm.builtin.* after install_vm_builtins); one scenario (prefills with and without history,
    decode steps, a fork inside a page, popn) through TVM's functions on each: every output
    against the reference, and ours equal to TVM's."""
    config = MLAConfig(HEADS, LATENT, ROPE, dtype=DTYPE, page_size=16, target=target)
    args = create_args(kernels, config, target)
    runs = {}
    tvm_cache = tvm.get_global_func("vm.builtin.paged_attention_kv_cache_create")(*args)
    runs["tvm"] = MLAModel(target, seed=3, cache=tvm_cache, call=builtin_call(tvm_cache), cross_without_history=False)
    ours = paged_attention_kv_cache_create(*args)
    assert ours.options.is_mla and ours.kernels.prefill_ragged is not None
    runs["tvmattn"] = MLAModel(target, seed=3, cache=ours, call=builtin_call(ours, "tvmattn."),
                               cross_without_history=False)
    install_vm_builtins()
    try:
        ours_vm = tvm.get_global_func("vm.builtin.paged_attention_kv_cache_create")(*args)
        assert isinstance(ours_vm, PagedKVCache)
        runs["vm.builtin"] = MLAModel(target, seed=3, cache=ours_vm, call=builtin_call(ours_vm),
                                      cross_without_history=False)
        for m in runs.values():
            scenario(m)
    finally:
        uninstall_vm_builtins()
    for name in ("tvmattn", "vm.builtin"):
        assert len(runs[name].outputs) == len(runs["tvm"].outputs)
        for i, (a, b) in enumerate(zip(runs[name].outputs, runs["tvm"].outputs)):
            if b is not None:
                check_close(a, b, f"output {i}: {name} against TVM's cache")


# ---------------------------------------------------------------------------------------------
# Bad input: KVCacheError naming the argument, and the cache exactly as it was


def populated() -> MLAModel:
    m = MLAModel("llvm", 4, seed=4, max_num_sequences=4, max_total_seq_len=64, prefill_chunk_size=32)
    m.add(0)
    m.add(1)
    m.forward([0, 1], [9, 3])
    m.fork(0, 2, 6)
    return m


def state(m: MLAModel) -> tuple:
    c = m.cache
    rows = {s: m.read_rows(s).tobytes() for s in c.sequence_ids()}
    return (c.sequence_ids(), {s: c.sequence_state(s) for s in c.sequence_ids()}, c.get_num_available_pages(),
            c.get_total_sequence_length(), rows)


def _bad_calls(m: MLAModel, n: int) -> dict:
    dev = m.device

    def t(shape, dtype=DTYPE):
        return tensor(randn(m.rng, shape, dtype), dev)

    o, lse = empty((n, HEADS, LATENT), DTYPE, dev), empty((n, HEADS), "float32", dev)
    q, k, v, o_self = t((n, HEADS, SELF_QK)), t((n, HEADS, SELF_QK)), t((n, HEADS, SELF_V)), t((n, HEADS, SELF_V))
    return {
        "kv rows": (lambda c: c.append_mla_kv(0, t((n + 1, QK))), r"kv must have shape \(2, 80\)"),
        "kv width": (lambda c: c.append_mla_kv(0, t((n, LATENT))), r"kv must have shape \(2, 80\)"),
        "kv dtype": (lambda c: c.append_mla_kv(0, t((n, QK), "float32")), "kv must have dtype float16"),
        "kv layer": (lambda c: c.append_mla_kv(LAYERS, t((n, QK))), "layer_id must be at most 1"),
        "fused qkv on MLA": (lambda c: c.attention_with_fused_qkv(0, SM_SCALE, t((n, 3, QK)), o),
                             "layer 0 is an MLA layer; MLA layers run append_mla_kv"),
        "shared kv on MLA": (lambda c: c.attention_with_shared_kv(0, SM_SCALE, q, k, v, o), "only MHA layers"),
        "cross q width": (lambda c: c.cross_attention(0, SM_SCALE, q, o, lse), r"q must have shape \(2, 4, 80\)"),
        "cross o width": (lambda c: c.cross_attention(0, SM_SCALE, t((n, HEADS, QK)), o_self, lse),
                          r"o must have shape \(2, 4, 64\)"),
        "self k mismatch": (lambda c: c.self_attention(0, SM_SCALE, q, v, v, o_self, lse), r"k must have shape"),
        "self o mismatch": (lambda c: c.self_attention(0, SM_SCALE, q, k, v, o, lse), r"o must have shape \(2, 4, 128"),
        "self heads": (lambda c: c.self_attention(0, SM_SCALE, t((n, 2, SELF_QK)), k, v, o_self, lse),
                       r"q must have shape \(2, 4, d\)"),
        "merge widths": (lambda c: c.merge_attn_output_inplace(o_self, lse, o, lse), "o2 must have shape"),
        "debug_get_kv on MLA": (lambda c: c.debug_get_kv(0, 0, 1, o, o), "use debug_get_kv_mla"),
        "debug_get_kv_mla shape": (lambda c: c.debug_get_kv_mla(0, 0, 2, t((LAYERS, 3, QK))), "kv must have shape"),
        "graph decode": (lambda c: c.begin_graph_decode([0], 1), r"MHA layers only; this cache has \['MLA'\]"),
    }


def step_state(m: MLAModel) -> tuple:
    """`state` inside a step (whose rows cannot be read yet): all but the rows, and the step."""
    c = m.cache
    return (c.sequence_ids(), {s: c.sequence_state(s) for s in c.sequence_ids()}, c.get_num_available_pages(),
            c.get_total_sequence_length(), id(c.current_plan()))


def test_bad_mla_calls_leave_the_cache_unchanged():
    m = populated()
    before_step = state(m)
    m.cache.begin_forward([0, 2], [1, 1])
    for case, (op, message) in _bad_calls(m, 2).items():
        before = step_state(m)
        with pytest.raises(KVCacheError, match=message):
            op(m.cache)
        assert step_state(m) == before, case
    q = tensor(randn(m.rng, (2, HEADS, QK), DTYPE), m.device)
    o, lse = empty((2, HEADS, LATENT), DTYPE, m.device), empty((2, HEADS), "float32", m.device)
    with pytest.raises(KVCacheError, match="layer 0 has not written: call append_mla_kv first"):
        m.cache.cross_attention(0, SM_SCALE, q, o, lse)  # a decode step's cross_attention reads the step's rows
    with pytest.raises(KVCacheError, match=r"layers \[0, 1\] did not write"):
        m.cache.end_forward()
    assert state(m) == before_step
    before = state(m)
    with pytest.raises(KVCacheError, match="token trees are not supported in an MLA cache"):
        m.cache.begin_forward([0, 2], [2, 1], [-1, 0, -1])
    assert state(m) == before
    with pytest.raises(KVCacheError, match="begin_forward"):
        m.cache.append_mla_kv(0, tensor(np.zeros((1, QK), np.float16), m.device))


def test_invalid_mla_options():
    base = dict(num_layers=2, num_qo_heads=4, num_kv_heads=1, qk_head_dim=QK, v_head_dim=LATENT, attn_kinds="mla")
    for bad, message in [({"attn_kinds": ["mla", "mha"]}, "attn_kinds mixes MLA layers with MHA"),
                         ({"attn_kinds": ["mla"]}, "attn_kinds has 1 entries for num_layers=2"),
                         ({"attn_kinds": "linear"}, "LINEAR"),
                         ({"attn_kinds": ["mla", 7]}, r"attn_kinds\[1\] must be one of"),
                         ({"v_head_dim": QK}, "less than qk_head_dim"),
                         ({"v_head_dim": 24, "qk_head_dim": 40}, "no MLA kernels for this cache configuration"),
                         ({"support_sliding_window": True}, "MLA layers have no sliding windows"),
                         ({"kernels": {"prefill_paged_mla": []}}, "slot 'prefill_paged_mla' is empty"),
                         ({"kernels": {"nope": print}}, "unknown slots")]:
        with pytest.raises(KVCacheError, match=message):
            PagedKVCache(**{**base, **bad})


def test_create_call_refusals(kernels):
    """TVM's create call with bad kinds: a named error (attn_kinds), no cache."""
    config = MLAConfig(HEADS, LATENT, ROPE, dtype=DTYPE, page_size=16, target="llvm")
    args = create_args(kernels, config, "llvm")
    for kinds, message in [([1, 0], "attn_kinds mixes MLA"), ([1], "attn_kinds has 1 entries"),
                           ([2, 2], "LINEAR"), ([1, 9], r"attn_kinds\[1\]")]:
        bad = list(args)
        bad[6] = ShapeTuple(kinds)
        with pytest.raises(KVCacheError, match=message):
            paged_attention_kv_cache_create(*bad)


class FP8MLAModel(MLAModel):
    """MLAModel over FP8 latent pages (kv_dtype): the rows it checks against are what the pages
    hold, the codes of x / scale read as code * scale, with per-layer scales for the latent and
    the rotary columns ([num_layers, 2, 1]). Cross-attention reads only pages, so every key and
    value of the reference is dequantized."""

    def __init__(self, target="llvm", page_size=16, seed=0, *, kv_dtype, **options):
        rng = np.random.default_rng(500 + seed)
        latent = 10.0 ** rng.uniform(-2.3, -1.8, LAYERS)
        self.scales = np.stack([latent, latent * 8.0], axis=1)[:, :, None].astype(np.float32)
        self.kv_dtype = kv_dtype
        super().__init__(target, page_size, seed, kv_dtype=kv_dtype, kv_scales=self.scales, **options)

    def stored(self, layer, kv):
        from fp8_reference import column_scales, dequantize, quantize

        cols = column_scales(self.scales[layer, :, 0], self.d.latent, self.d.qk)
        return dequantize(quantize(kv.astype(np.float32), cols, self.kv_dtype), cols)

    def paged_lse_tolerance(self) -> tuple:
        """CUDA's MLA kernels stage code * scale in bfloat16 (fp8_reference.FP8_BF16_LSE_TOLERANCE)."""
        from fp8_reference import FP8_BF16_LSE_TOLERANCE

        on_gpu = self.target.startswith("cuda")
        return FP8_BF16_LSE_TOLERANCE if on_gpu and self.d.dtype == "bfloat16" else ref.LSE_TOLERANCE

    def check_rows(self):
        """debug_get_kv_mla: the dequantized rows, rounded to the dtype."""
        for seq_id, rows in self.rows.items():
            if len(rows[0]):
                expected = to_dtype(np.stack(rows), self.d.dtype).astype(np.float64)
                np.testing.assert_array_equal(self.read_rows(seq_id), expected, err_msg=f"rows of {seq_id}")


FP8_FORMATS = [pytest.param("float8_e4m3fn", id="e4m3"), pytest.param("float8_e5m2", id="e5m2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_mla_fp8_prefill_extend_decode(target, fmt):
    """test_mla_prefill_extend_decode's steps on FP8 latent pages, page size 1 and 16."""
    for page_size in (1, 16):
        m = FP8MLAModel(target, page_size, seed=11, kv_dtype=fmt)
        initial = m.cache.get_num_available_pages()
        for s in (0, 1, 2):
            m.add(s)
        m.forward([0, 1, 2], [17, 1, 5])
        m.forward([1, 0], [16, 3])
        m.forward([0, 1, 2], [1, 1, 1])
        m.forward([2, 1], [1, 14])
        m.check_no_leaks(initial)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_mla_fp8_fork_popn_cascade(target, fmt):
    """Forks at and inside a page (a copied page of codes), popn into a shared page, a cascade
    level merged at the latent width, on FP8 latent pages."""
    m = FP8MLAModel(target, 4, seed=12, kv_dtype=fmt)
    initial = m.cache.get_num_available_pages()
    m.add(0)
    m.forward([0], [18])
    m.fork(0, 1, 16)
    m.fork(0, 2, 10)
    m.fork(2, 3)
    m.forward([0, 1, 2, 3], [1, 1, 1, 1])

    def cascade(plan):
        assert len(plan.host.cross) == 2

    m.forward([0, 1, 3], [2, 3, 1], cascade)
    m.popn(3, 5)
    m.forward([3, 2], [2, 6])
    m.check_rows()
    m.forward([0, 2, 3], [1, 1, 1])
    m.check_no_leaks(initial)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [pytest.param("float8_e4m3fn", id="e4m3"), pytest.param("float8_e5m2", id="e5m2")])
def test_mla_fp8_deepseek_v2_lite_shapes_on_the_gpu(fmt):
    """DeepSeek-V2-Lite's attention on FP8 latent pages on CUDA (the decode the cache picks for
    FP8 pages): prefill, extend, decode steps across a page boundary, a fork."""
    m = FP8MLAModel("cuda", 16, seed=13, dims=DEEPSEEK_V2_LITE, kv_dtype=fmt)
    initial = m.cache.get_num_available_pages()
    m.add(0)
    m.add(1)
    m.forward([0, 1], [40, 9])
    m.forward([1, 0], [24, 3])
    for _ in range(3):
        m.forward([0, 1], [1, 1])
    m.fork(0, 2, 30)
    m.forward([2, 0, 1], [1, 1, 1])
    m.check_no_leaks(initial)


def test_mla_fp8_scales():
    """An MLA cache's FP8 scales are [num_layers, 2, 1] (latent, rope); other shapes and
    non-positive scales are refused naming kv_scales; set_kv_scales rewrites the scale pages."""
    base = dict(num_layers=LAYERS, num_qo_heads=HEADS, num_kv_heads=1, qk_head_dim=QK, v_head_dim=LATENT,
                attn_kinds="mla", max_num_sequences=2, max_total_seq_len=64, kv_dtype="float8_e4m3fn")
    cache = PagedKVCache(**base)
    assert cache.kv_scales.shape == (LAYERS, 2, 1) and (cache.kv_scales == 1).all()
    assert cache.bytes_per_token() == LAYERS * QK
    for bad, message in [(np.ones((LAYERS, 3, 1)), r"\[num_layers, 2, 1\] \(latent, rope\)"),
                         ([[1.0], [0.0]], "finite and positive")]:
        with pytest.raises(KVCacheError, match=message):
            PagedKVCache(**base, kv_scales=bad)
    scales = np.array([[0.5, 4.0], [0.25, 2.0]], np.float32)[:, :, None]
    cache.set_kv_scales(scales)
    np.testing.assert_array_equal(cache.kv_scales, scales)
    for layer, pool in enumerate(cache._pools):
        raw = pool.numpy().view(np.uint8)[-1, 0, :8].view(np.float32)
        np.testing.assert_array_equal(raw, scales[layer, :, 0])
