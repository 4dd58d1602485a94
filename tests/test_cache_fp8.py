"""The cache scenarios of test_cache.py on FP8 pages (PagedKVCache(kv_dtype=...)), unchanged, and
those of test_cache_layer_kinds.py (MHA_SLIDING layers beside MHA ones, FP8KindsModel): the
scenario functions run with test_cache.Model replaced by FP8Model, whose truth holds what FP8
pages hold (the codes of x / scale, read as code * scale, per layer, K/V and KV head).

What a step attends over: a decode step (every sequence appends one token, no window) appends
first and reads every key from the pages (quantized); any other step (prefill, chunked prefill,
token trees, windowed sequences) reads the history from the pages and the step's own keys from
its arguments (ragged prefill: not quantized). The reference does the same, so outputs are
checked at the fp16 tolerance of test_cache.py.

Default tier: a cheap subset of the scenarios for e4m3; -m slow: every listed scenario and both
formats. Plus the options' checks, set_kv_scales and bytes_per_token.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import reference as ref
import test_cache
from fp8_reference import dequantize, quantize
from harness import to_dtype
from test_cache import DTYPE, HKV, HQ, LAYERS, ROPE_SCALE, ROPE_THETA, SM_SCALE, Model

from tvmattn import KVCacheError, PagedKVCache
from tvmattn.runtime.cache import kv_bytes_per_token


class FP8Model(Model):
    """test_cache.Model over FP8 pages with per-(layer, K/V, head) scales."""

    def __init__(self, target="llvm", rope_mode="none", page_size=4, sliding=False, seed=0, *, kv_dtype, **options):
        rng = np.random.default_rng(1000 + seed)
        self.scales = (10.0 ** rng.uniform(-2.3, -1.7, (LAYERS, 2, HKV))).astype(np.float32)
        self.kv_dtype = kv_dtype
        self._decode_step = False
        super().__init__(target, rope_mode, page_size, sliding, seed, kv_dtype=kv_dtype, kv_scales=self.scales,
                         **options)

    def _expected(self, seq_ids, lengths, history, layer, qkv):
        self._decode_step = all(n == 1 for n in lengths) and not any(s in self.window for s in seq_ids)
        return super()._expected(seq_ids, lengths, history, layer, qkv)

    def _attend(self, seq_id, layer, q, k, v, positions) -> np.ndarray:
        if self.rope == "normal":  # rotated in fp32, rounded to fp16, then quantized
            q = to_dtype(ref.rope(q, positions, ROPE_THETA, ROPE_SCALE), DTYPE)
            k = to_dtype(ref.rope(k, positions, ROPE_THETA, ROPE_SCALE), DTYPE)
        stored = []
        for kv, x in ((0, k), (1, v)):
            scale = self.scales[layer, kv][None, :, None]
            stored.append(dequantize(quantize(x, scale, self.kv_dtype), scale))
        self.k[seq_id][layer] = np.concatenate([self.k[seq_id][layer], stored[0]])
        self.v[seq_id][layer] = np.concatenate([self.v[seq_id][layer], stored[1]])
        keys, values = self.k[seq_id][layer].copy(), self.v[seq_id][layer].copy()
        if not self._decode_step:  # the step's own keys come from its arguments
            keys[len(keys) - len(k):] = k.astype(np.float64)
            values[len(values) - len(v):] = v.astype(np.float64)
        if self.rope == "inline":
            q = ref.rope(q, positions, ROPE_THETA, ROPE_SCALE)
            keys = ref.rope(keys, np.arange(len(keys)), ROPE_THETA, ROPE_SCALE)
        return ref.attention(q, keys, values, SM_SCALE, causal=True)[0]

    def check_kv(self) -> None:
        """debug_get_kv of every sequence: the dequantized truth, rounded to fp16."""
        assert self.cache.get_total_sequence_length() == sum(self.length(s) for s in self.k)
        for seq_id in self.k:
            k, v = test_cache.read_kv(self.cache, seq_id, self.length(seq_id), self.device)
            np.testing.assert_allclose(k, np.stack(self.k[seq_id]), rtol=1e-3, atol=1e-6, err_msg=f"K of {seq_id}")
            np.testing.assert_allclose(v, np.stack(self.v[seq_id]), rtol=1e-3, atol=1e-6, err_msg=f"V of {seq_id}")


# (scenario, its arguments after target), the default tier's subset first
SCENARIOS = [
    ("test_prefill_then_decode", ("normal", 16)),
    ("test_fork_positions", (4,)),
    ("test_popn", (4,)),
    ("test_sliding_window_with_sinks", ("inline",)),
    ("test_cascade_two_forks_of_a_long_prefix", ()),
    ("test_token_tree_chains", ()),
    ("test_prefill_then_decode", ("none", 4)),
    ("test_prefill_then_decode", ("inline", 4)),
    ("test_fork_positions", (16,)),
    ("test_fork_chain_8_deep", ()),
    ("test_popn", (16,)),
    ("test_sliding_window_with_sinks", ("none",)),
    ("test_sliding_window_with_forks", ()),
    ("test_sliding_window_rope_normal_runs_inline", ()),
    ("test_cascade_prefill_plan", ()),
    ("test_clear", ()),
]
DEFAULT_TIER = 6
CASES = [
    pytest.param(fmt, name, args, id=f"{name[5:]}-{'-'.join(map(str, args))}-{fmt.split('_')[1]}",
                 marks=() if fmt == "float8_e4m3fn" and i < DEFAULT_TIER else pytest.mark.slow)
    for fmt in ("float8_e4m3fn", "float8_e5m2")
    for i, (name, args) in enumerate(SCENARIOS)
]


@pytest.mark.parametrize("fmt,name,args", CASES)
def test_scenarios_on_fp8_pages(monkeypatch, target, fmt, name, args):
    monkeypatch.setattr(test_cache, "Model", functools.partial(FP8Model, kv_dtype=fmt))
    getattr(test_cache, name)(target, *args)


def test_wrong_scales_are_seen():
    """The check can fail: a model whose truth uses other scales than the cache's disagrees."""
    m = FP8Model(kv_dtype="float8_e4m3fn", seed=3)
    m.cache.set_kv_scales(m.scales * 1.37)  # (a power of two would move every code exactly)
    m.add(0)
    m.forward([0], [5])
    with pytest.raises(AssertionError):
        m.forward([0], [1])


def fp8_cache(**options):
    return PagedKVCache(**{"num_layers": LAYERS, "num_qo_heads": HQ, "num_kv_heads": HKV, "qk_head_dim": 64,
                           "page_size": 16, "max_total_seq_len": 256, "kv_dtype": "float8_e4m3fn", **options})


def test_options_and_scales():
    cache = fp8_cache()
    np.testing.assert_array_equal(cache.kv_scales, np.ones((LAYERS, 2, HKV), np.float32))  # vLLM's default
    assert cache.options.page_dtype == "float8_e4m3fn"
    scales = np.array([[[0.5, 2.0], [1.0, 4.0]], [[0.25, 1.0], [3.0, 1.5]]])
    cache.set_kv_scales(scales)
    np.testing.assert_array_equal(cache.kv_scales, scales.astype(np.float32))
    pool = cache._pools[1].numpy()  # the scale page, as the kernels read it
    np.testing.assert_array_equal(pool.view(np.uint8)[-1, :, :, 0, :4].copy().view("<f4")[..., 0], scales[1])
    cache.add_sequence(0)
    with pytest.raises(KVCacheError, match="holds sequences"):
        cache.set_kv_scales(1.0)
    for bad, message in ((-1.0, "finite and positive"), (np.ones(3), "broadcast"), (np.nan, "finite")):
        with pytest.raises(KVCacheError, match=message):
            fp8_cache(kv_scales=bad)
    with pytest.raises(KVCacheError, match="kv_dtype"):
        fp8_cache(kv_dtype="int8")
    with pytest.raises(KVCacheError, match="not FP8"):
        fp8_cache(kv_dtype="float16").set_kv_scales(1.0)


def test_fp8_pages_hold_twice_the_tokens_per_byte():
    """bytes_per_token halves from fp16 to FP8 (a pool of a given budget holds 2x the tokens;
    the scale page is one page a layer, independent of the budget)."""
    fp16 = fp8_cache(kv_dtype="float16")
    fp8 = fp8_cache()
    assert fp16.bytes_per_token() == LAYERS * HKV * 2 * 64 * 2
    assert fp16.bytes_per_token() == 2 * fp8.bytes_per_token() == 2 * kv_bytes_per_token(fp8.options)
    assert fp8._pools[0].shape[0] == fp16._pools[0].shape[0] + 1
    assert fp8.get_num_available_pages() == fp16.get_num_available_pages()


# ---- MHA_SLIDING layers beside MHA layers (test_cache_layer_kinds) on FP8 pages ----

import test_cache_layer_kinds as kinds  # noqa: E402


class FP8KindsModel(kinds.KindsModel):
    """test_cache_layer_kinds.KindsModel over FP8 pages: its truth holds the dequantized codes.
    Which keys a layer reads from the pages (quantized): in a decode step all of them; in another
    step an MHA layer reads the history from the pages and the step's keys from its arguments;
    an MHA_SLIDING layer appends first and reads every key from its own pages in every step
    (tvmattn.runtime.windows: the windowed decode per new token, or the paged prefill over the
    sliding pages)."""

    def __init__(self, target="llvm", page_size=4, rope_mode="none", seed=0, *, kv_dtype, **options):
        rng = np.random.default_rng(2000 + seed)
        self.scales = (10.0 ** rng.uniform(-2.3, -1.7, (len(kinds.KINDS), 2, kinds.HKV))).astype(np.float32)
        self.kv_dtype = kv_dtype
        super().__init__(target, page_size, rope_mode, seed, kv_dtype=kv_dtype, kv_scales=self.scales, **options)

    def _stored(self, layer, kv, x):
        scale = self.scales[layer, kv][None, :, None]
        return dequantize(quantize(x, scale, self.kv_dtype), scale)

    def _windowed(self, history, lengths):
        return any(h + n > self.window for h, n in zip(history, lengths))

    def _expected(self, seq_ids, lengths, history, layer, kind, qkv):
        from_pages = all(n == 1 for n in lengths) or kind == "mha_sliding"
        out, start = [], 0
        for seq_id, n, h in zip(seq_ids, lengths, history):
            q, k, v = self._split(qkv[start:start + n], h + np.arange(n))
            start += n
            self.k[seq_id][layer] = np.concatenate([self.k[seq_id][layer], self._stored(layer, 0, k)])
            self.v[seq_id][layer] = np.concatenate([self.v[seq_id][layer], self._stored(layer, 1, v)])
            keys, values = self.k[seq_id][layer].copy(), self.v[seq_id][layer].copy()
            if not from_pages:
                keys[h:], values[h:] = k.astype(np.float64), v.astype(np.float64)
            mask = kinds.visible(kind, h, n, self.window)
            out.append(ref.attention(q, keys, values, kinds.SM_SCALE, False, mask)[0])
        return np.concatenate(out)

    def _shared(self, seq_ids, lengths, history, qkv):
        assert self._windowed(history, lengths), "attention_with_shared_kv is checked in windowed steps only"
        super()._shared(seq_ids, lengths, history, qkv)

    def check_kv(self):
        """debug_get_kv: the dequantized truth, rounded to fp16 (zeros where the MHA_SLIDING
        layers released their tokens: `kept`)."""
        for seq_id in self.k:
            n = len(self.k[seq_id][0])
            if n:
                k, v = (kinds.empty((len(self.kinds), n, kinds.HKV, kinds.D), kinds.DTYPE, self.device)
                        for _ in range(2))
                self.cache.debug_get_kv(seq_id, 0, n, k, v)
                truth = self.kept(seq_id)
                for name, got, index in (("K", k, 0), ("V", v, 1)):
                    np.testing.assert_allclose(got.numpy().astype(np.float64), np.stack([t[index] for t in truth]),
                                               rtol=1e-3, atol=1e-6, err_msg=f"{name} of {seq_id}")


@pytest.mark.parametrize("fmt", [pytest.param("float8_e4m3fn", id="e4m3"),
                                 pytest.param("float8_e5m2", id="e5m2", marks=pytest.mark.slow)])
@pytest.mark.parametrize("page_size,rope_mode", [(4, "none"), pytest.param(1, "normal", marks=pytest.mark.slow)])
def test_layer_windows_on_fp8_pages(target, fmt, page_size, rope_mode):
    """[MHA_SLIDING, MHA, MHA_SLIDING] layers on FP8 pages: prefills within and beyond the window,
    prefills over a history, decode steps, attention_with_shared_kv over a windowed layer, a
    mixed batch, forks (copy-on-write of a shared page), popn; no page leaked."""
    m = FP8KindsModel(target, page_size, rope_mode, seed=page_size, kv_dtype=fmt)
    initial = m.cache.get_num_available_pages()
    for s in (0, 1, 2):
        m.add(s)
    m.forward([0, 1, 2], [3, 1, 2])  # every sequence within the window: no windowed level
    m.forward([0, 1, 2], [9, 1, 3])
    m.forward([1, 0], [7, 3], shared_from_window=True)
    for _ in range(2):
        m.forward([0, 1, 2], [1, 1, 1], shared_from_window=True)
    m.forward([2, 0], [1, 6])
    # the earliest fork point the sliding layers allow (their window's first token still held)
    m.fork(0, 3, max(m.cache.sliding_kept_from(0) + m.window - 1, len(m.k[0][0]) - 1))
    m.fork(1, 4)
    m.forward([3, 4, 0], [2, 1, 1])
    m.popn(4, len(m.k[4][0]) - (m.cache.sliding_kept_from(4) + m.window - 1))
    m.forward([4, 1], [1, 9])
    m.check_kv()
    m.remove(0)
    m.forward([1, 2, 3, 4], [1, 1, 1, 1])
    m.check_no_leaks(initial)


def test_layer_windows_reference_can_fail():
    """The FP8 kinds model disagrees with a cache whose scales are not its own."""
    m = FP8KindsModel(seed=9, kv_dtype="float8_e4m3fn")
    m.cache.set_kv_scales(m.scales * 1.37)
    m.add(0)
    with pytest.raises(AssertionError):
        m.forward([0], [9])
