"""A model library built with TVM's stock `TIRPagedKVCache` runs on tvmattn's cache.

The model (tvm.relax.frontend.nn, built for llvm): two decoder attention layers, each a fused
QKV projection, `attention_with_fused_qkv` through the KV cache (RoPE mode NORMAL, GQA), an
output projection and a residual. It exports `create_kv_cache`, `prefill` (tokens of a batch
packed as [1, n, hidden]) and `decode` ([batch, 1, hidden]).

The same driver (it only calls `vm.builtin.*` names and the VM's functions) runs one scenario:
add sequences, a batched prefill, decode steps, forks (at the end and inside a page), a chunked
prefill on a fork, popn, remove; first on TVM's C++ cache, then, after install_vm_builtins(),
on tvmattn's cache (with the library's own kernels, and with tvmattn's kernels). Every step's
output and the final debug_get_kv contents must match TVM's run and a float64 numpy model that
keeps each sequence's K/V unpaged.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import reference as ref
import tvm
from harness import NP_DTYPES
from tvm import relax
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op
from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache as NNPagedKVCache
from tvm.relax.frontend.nn.llm.kv_cache import RopeMode, TIRPagedKVCache
from tvm.runtime import ShapeTuple

from tvmattn.runtime.cache import PagedKVCache
from tvmattn.runtime.errors import KVCacheError
from tvmattn.runtime.ffi import install_vm_builtins, uninstall_vm_builtins, vm_builtins_installed

NUM_LAYERS, HQ, HKV, D, HIDDEN = 2, 4, 2, 32, 64
ROPE_THETA = 10000.0
MAX_BATCH, CAPACITY, PREFILL_CHUNK, PAGE_SIZE = 8, 512, 128, 16
SM_SCALE = D**-0.5


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------
class AttentionLayer(nn.Module):
    def __init__(self):
        self.qkv_proj = nn.Linear(HIDDEN, (HQ + 2 * HKV) * D, bias=False)
        self.o_proj = nn.Linear(HQ * D, HIDDEN, bias=False)

    def forward(self, x: nn.Tensor, cache: NNPagedKVCache, layer_id: int) -> nn.Tensor:
        b, s, _ = x.shape
        qkv = op.reshape(self.qkv_proj(x), (b, s, HQ + 2 * HKV, D))
        o = cache.attention_with_fused_qkv(layer_id, qkv, HQ, sm_scale=SM_SCALE)
        return x + self.o_proj(op.reshape(o, (b, s, HQ * D)))


class TinyModel(nn.Module):
    def __init__(self, dtype: str):
        self.layers = nn.ModuleList([AttentionLayer() for _ in range(NUM_LAYERS)])
        self.dtype = dtype

    def _forward(self, x, cache):
        for layer_id, layer in enumerate(self.layers):
            x = layer(x, cache, layer_id)
        return x, cache

    def prefill(self, x, cache):
        return self._forward(x, cache)

    def decode(self, x, cache):
        return self._forward(x, cache)

    def create_kv_cache(self, max_batch_size, max_total_seq_len, prefill_chunk_size, page_size):
        return TIRPagedKVCache(
            attn_kind="mha",
            max_batch_size=max_batch_size,
            max_total_seq_len=max_total_seq_len,
            prefill_chunk_size=prefill_chunk_size,
            page_size=page_size,
            support_sliding_window=0,
            layer_partition=relax.ShapeExpr([0, NUM_LAYERS]),
            num_hidden_layers=NUM_LAYERS,
            num_attention_heads=HQ,
            num_key_value_heads=HKV,
            qk_head_dim=D,
            v_head_dim=D,
            mla_original_qk_head_dim=0,
            mla_original_v_head_dim=0,
            rope_mode=RopeMode.NORMAL,
            rope_scale=1,
            rope_theta=ROPE_THETA,
            rope_scaling={},
            rope_ext_factors=relax.prim_value(0),
            rotary_dim=D,
            enable_disaggregation=False,
            dtype=self.dtype,
            target=tvm.target.Target("llvm"),
        )

    def spec(self):
        cache = nn.spec.Object(object_type=NNPagedKVCache)
        packed = {"param_mode": "packed", "effect_mode": "none"}
        return {
            "prefill": {"x": nn.spec.Tensor([1, "n", HIDDEN], self.dtype), "cache": cache, "$": packed},
            "decode": {"x": nn.spec.Tensor(["batch", 1, HIDDEN], self.dtype), "cache": cache, "$": packed},
            "create_kv_cache": {
                "max_batch_size": int,
                "max_total_seq_len": int,
                "prefill_chunk_size": int,
                "page_size": int,
                "$": {"param_mode": "none", "effect_mode": "none"},
            },
        }


@dataclasses.dataclass
class Library:
    executable: relax.VMExecutable
    weights: dict[str, np.ndarray]  # parameter name -> array in the model dtype
    param_names: list[str]
    dtype: str


@pytest.fixture(scope="module", params=["float32", pytest.param("float16", marks=pytest.mark.slow)])
def library(request) -> Library:
    dtype = request.param
    model = TinyModel(dtype)
    model.to(dtype)
    mod, params = model.export_tvm(spec=model.spec())
    with tvm.target.Target("llvm"):
        executable = tvm.compile(mod, "llvm")
    rng = np.random.default_rng(1)
    weights = {name: (rng.standard_normal(p.shape) * 0.15).astype(NP_DTYPES[dtype]) for name, p in params}
    return Library(executable, weights, [name for name, _ in params], dtype)


# ---------------------------------------------------------------------------------------------
# The float64 model with unpaged K/V
# ---------------------------------------------------------------------------------------------
class NumpyModel:
    """The model in float64, rounded to the model dtype where the library stores a tensor (the
    projections, split_rotary's q/k/v, the attention output, the residual sum)."""

    def __init__(self, weights: dict[str, np.ndarray], dtype: str):
        self.w = {name: w.astype(np.float64) for name, w in weights.items()}
        self.dtype = dtype
        self.k: dict[int, list[np.ndarray]] = {}  # seq -> per layer [len, HKV, D], RoPE applied
        self.v: dict[int, list[np.ndarray]] = {}

    def add(self, seq_id):
        self.k[seq_id] = [np.zeros((0, HKV, D)) for _ in range(NUM_LAYERS)]
        self.v[seq_id] = [np.zeros((0, HKV, D)) for _ in range(NUM_LAYERS)]

    def fork(self, parent, child, pos):
        end = len(self.k[parent][0]) if pos == -1 else pos
        self.k[child] = [k[:end] for k in self.k[parent]]
        self.v[child] = [v[:end] for v in self.v[parent]]

    def popn(self, seq_id, n):
        self.k[seq_id] = [k[: len(k) - n] for k in self.k[seq_id]]
        self.v[seq_id] = [v[: len(v) - n] for v in self.v[seq_id]]

    def remove(self, seq_id):
        del self.k[seq_id], self.v[seq_id]

    def forward(self, seq_ids, lengths, x):
        """x [total, HIDDEN] (requests packed in order) -> [total, HIDDEN]."""
        r = self._round
        x = x.astype(np.float64)
        for layer in range(NUM_LAYERS):
            qkv = r(x @ self.w[f"layers.{layer}.qkv_proj.weight"].T).reshape(-1, HQ + 2 * HKV, D)
            o = np.zeros((len(x), HQ, D))
            start = 0
            for seq_id, n in zip(seq_ids, lengths):
                q, k, v = np.split(qkv[start : start + n], [HQ, HQ + HKV], axis=1)
                positions = len(self.k[seq_id][layer]) + np.arange(n)
                q = r(ref.rope(q, positions, ROPE_THETA))
                k = r(ref.rope(k, positions, ROPE_THETA))
                self.k[seq_id][layer] = np.concatenate([self.k[seq_id][layer], k])
                self.v[seq_id][layer] = np.concatenate([self.v[seq_id][layer], v])
                keys, values = self.k[seq_id][layer], self.v[seq_id][layer]
                o[start : start + n] = ref.attention(q, keys, values, SM_SCALE, causal=True)[0]
                start += n
            x = r(x + r(r(o).reshape(len(x), HQ * D) @ self.w[f"layers.{layer}.o_proj.weight"].T))
        return x

    def _round(self, a: np.ndarray) -> np.ndarray:
        return a.astype(NP_DTYPES[self.dtype]).astype(np.float64)


# ---------------------------------------------------------------------------------------------
# The driver: the same host code for every cache
# ---------------------------------------------------------------------------------------------
def builtin(name: str):
    return tvm.get_global_func(f"vm.builtin.{name}")


def _same(a, b) -> bool:
    """Our cache comes back from the VM as the same Python object; TVM's as a new wrapper."""
    return a is b or (hasattr(a, "same_as") and a.same_as(b))


class Driver:
    """Runs the scenario on whichever cache vm.builtin.paged_attention_kv_cache_create makes."""

    def __init__(self, library: Library, seed: int = 7):
        self.lib = library
        self.vm = relax.VirtualMachine(library.executable, tvm.cpu())
        self.params = [tvm.runtime.tensor(library.weights[name]) for name in library.param_names]
        self.cache = self.vm["create_kv_cache"](
            ShapeTuple([MAX_BATCH]), ShapeTuple([CAPACITY]), ShapeTuple([PREFILL_CHUNK]), ShapeTuple([PAGE_SIZE])
        )
        self.rng = np.random.default_rng(seed)
        self.outputs: list[np.ndarray] = []
        self.reference = NumpyModel(library.weights, library.dtype)

    def add(self, seq_id):
        builtin("kv_state_add_sequence")(self.cache, seq_id)
        self.reference.add(seq_id)

    def fork(self, parent, child, pos=-1):
        builtin("kv_state_fork_sequence")(self.cache, parent, child, pos)
        self.reference.fork(parent, child, pos)

    def popn(self, seq_id, n):
        builtin("kv_state_popn")(self.cache, seq_id, n)
        self.reference.popn(seq_id, n)

    def remove(self, seq_id):
        builtin("kv_state_remove_sequence")(self.cache, seq_id)
        self.reference.remove(seq_id)

    def forward(self, seq_ids, lengths):
        dtype = self.lib.dtype
        x = (self.rng.standard_normal((sum(lengths), HIDDEN))).astype(NP_DTYPES[dtype])
        builtin("kv_state_begin_forward")(self.cache, ShapeTuple(seq_ids), ShapeTuple(lengths))
        if all(n == 1 for n in lengths):
            out, cache = self.vm["decode"](tvm.runtime.tensor(x[:, None, :]), self.cache, self.params)
        else:
            out, cache = self.vm["prefill"](tvm.runtime.tensor(x[None]), self.cache, self.params)
        builtin("kv_state_end_forward")(self.cache)
        assert _same(cache, self.cache), "the model must return the cache it was given"
        out = out.numpy().reshape(sum(lengths), HIDDEN).astype(np.float64)
        expected = self.reference.forward(seq_ids, lengths, x)
        rtol, atol = REFERENCE_TOLERANCE[dtype]
        np.testing.assert_allclose(out, expected, rtol=rtol, atol=atol,
                                   err_msg=f"step {len(self.outputs)}: {seq_ids} x {lengths}")
        self.outputs.append(out)

    def cached_kv(self, seq_id) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.reference.k[seq_id][0])
        k = tvm.runtime.empty((NUM_LAYERS, n, HKV, D), self.lib.dtype)
        v = tvm.runtime.empty((NUM_LAYERS, n, HKV, D), self.lib.dtype)
        builtin("attention_kv_cache_debug_get_kv")(self.cache, seq_id, 0, n, k, v)
        return k.numpy().astype(np.float64), v.numpy().astype(np.float64)

    def run_scenario(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Returns each live sequence's cached (K, V) at the end."""
        self.add(0)
        self.add(1)
        self.forward([0, 1], [7, 20])  # batched prefill from empty (ragged only)
        for _ in range(2):
            self.forward([0, 1], [1, 1])  # decode
        self.fork(0, 2)  # at the end: shared pages
        self.fork(1, 3, pos=10)  # inside the first page: a copied page
        self.forward([2], [5])  # chunked prefill on a fork: paged history + ragged + merge
        for _ in range(3):
            self.forward([0, 1, 2, 3], [1, 1, 1, 1])  # decode over shared prefixes
        self.popn(1, 2)
        self.forward([3, 1, 0], [4, 1, 9])  # mixed batch
        self.remove(2)
        self.forward([0, 1, 3], [1, 1, 1])
        assert builtin("attention_kv_cache_get_total_sequence_length")(self.cache) == sum(
            len(k[0]) for k in self.reference.k.values()
        )
        return {seq_id: self.cached_kv(seq_id) for seq_id in self.reference.k}

    def remove_all(self) -> None:
        for seq_id in list(self.reference.k):
            self.remove(seq_id)
        assert builtin("attention_kv_cache_empty")(self.cache)


# Each step's output against the float64 model. In fp16 the legalized matmuls of the library
# also accumulate in fp16 (64-term sums of values up to ~17: several ulps of 0.0156), which the
# reference does not model; the fp16 bound is loose, the check against TVM's run is not.
REFERENCE_TOLERANCE = {"float32": (1e-4, 1e-4), "float16": (2e-2, 1.5e-1)}
# Ours against TVM's run, keyed by (dtype, library_kernels). With the library's kernels only the
# order of merges may differ; with tvmattn's kernels fp16 results differ by an ulp here and
# there, which the next layer's fp16-accumulating matmuls amplify to a few ulps.
TVM_TOLERANCE = {
    ("float32", True): (1e-5, 1e-5),
    ("float16", True): (4e-3, 4e-3),
    ("float32", False): (1e-4, 1e-4),
    ("float16", False): (1e-2, 3e-2),
}


@pytest.fixture(scope="module")
def tvm_run(library):
    """The scenario on TVM's C++ cache: outputs of every step and the final cached K/V."""
    assert not vm_builtins_installed()
    driver = Driver(library)
    assert not isinstance(driver.cache, PagedKVCache)
    kv = driver.run_scenario()
    driver.remove_all()
    return driver.outputs, kv


@pytest.fixture
def builtins_installed():
    def install(library_kernels: bool):
        install_vm_builtins(library_kernels=library_kernels)

    yield install
    uninstall_vm_builtins()


@pytest.mark.parametrize("library_kernels", [True, False], ids=["library-kernels", "tvmattn-kernels"])
def test_stock_model_on_tvmattn_cache(library, tvm_run, builtins_installed, library_kernels):
    builtins_installed(library_kernels)
    driver = Driver(library)
    assert isinstance(driver.cache, PagedKVCache), "the VM must hand back our Python object"
    initial_pages = builtin("attention_kv_cache_get_num_available_pages")(driver.cache)
    kv = driver.run_scenario()

    tvm_outputs, tvm_kv = tvm_run
    rtol, atol = TVM_TOLERANCE[library.dtype, library_kernels]
    assert len(driver.outputs) == len(tvm_outputs)
    for step, (ours, theirs) in enumerate(zip(driver.outputs, tvm_outputs)):
        np.testing.assert_allclose(ours, theirs, rtol=rtol, atol=atol, err_msg=f"step {step}")
    assert kv.keys() == tvm_kv.keys()
    for seq_id, (k, v) in kv.items():
        np.testing.assert_allclose(k, tvm_kv[seq_id][0], rtol=rtol, atol=atol, err_msg=f"K of {seq_id}")
        np.testing.assert_allclose(v, tvm_kv[seq_id][1], rtol=rtol, atol=atol, err_msg=f"V of {seq_id}")
        np.testing.assert_allclose(k, np.stack(driver.reference.k[seq_id]), **_kv_tolerance(library.dtype))
        np.testing.assert_allclose(v, np.stack(driver.reference.v[seq_id]), **_kv_tolerance(library.dtype))

    driver.remove_all()
    assert builtin("attention_kv_cache_get_num_available_pages")(driver.cache) == initial_pages


def _kv_tolerance(dtype):
    rtol, atol = REFERENCE_TOLERANCE[dtype]
    return {"rtol": rtol, "atol": atol}


def test_builtins_restored_and_cpp_cache_still_served(library, builtins_installed):
    """While installed, a C++ cache (created before installing) is forwarded to TVM's function;
    after uninstalling, the builtins are TVM's own again."""
    originals = {name: builtin(name) for name in ("kv_state_add_sequence", "paged_attention_kv_cache_create")}
    cpp = Driver(library)
    builtins_installed(True)
    assert not _same(builtin("kv_state_add_sequence"), originals["kv_state_add_sequence"])
    cpp.add(5)
    cpp.forward([5], [3])
    assert builtin("attention_kv_cache_get_total_sequence_length")(cpp.cache) == 3
    uninstall_vm_builtins()
    assert not vm_builtins_installed()
    assert _same(builtin("paged_attention_kv_cache_create"), originals["paged_attention_kv_cache_create"])
    assert not isinstance(Driver(library).cache, PagedKVCache)


def test_errors_inside_the_vm_surface(library, builtins_installed):
    """A KVCacheError raised by our cache inside a call the VM makes reaches the caller as
    itself, with the cache's message; the cache stays usable."""
    builtins_installed(True)
    driver = Driver(library)
    driver.add(0)
    x = tvm.runtime.tensor(np.zeros((1, 1, HIDDEN), NP_DTYPES[library.dtype]))
    with pytest.raises(KVCacheError, match="call begin_forward first"):
        driver.vm["decode"](x, driver.cache, driver.params)
    builtin("kv_state_begin_forward")(driver.cache, ShapeTuple([0]), ShapeTuple([2]))
    with pytest.raises(KVCacheError, match="qkv must have shape"):
        driver.vm["decode"](x, driver.cache, driver.params)  # one token for a step of two
    with pytest.raises(KVCacheError, match="rolled back"):  # no layer wrote: the step is not kept
        builtin("kv_state_end_forward")(driver.cache)
    assert builtin("attention_kv_cache_get_total_sequence_length")(driver.cache) == 0
    with pytest.raises(KVCacheError, match="3"):
        builtin("kv_state_fork_sequence")(driver.cache, 3, 4, -1)
    driver.remove(0)
    driver.add(1)
    driver.forward([1], [5])
