"""The model pipeline's CUDA schedule for small-batch matmuls (models/pipeline.SmallBatchMatmul),
and the fused decode ops (compiler.fused_decode) with their CUDA and CPU schedules.

Spec: `[batch_size, 1, K] x [N, K]^T` with a symbolic batch (decode_step's projections, with or
without an element-wise epilogue) is scheduled by the rule and compiles for CUDA; on the GPU it
equals numpy for batches that are and are not multiples of its row chunk; prefill-shaped matmuls,
K that is not a whole number of 16-byte vectors and weights over the cap are left to the next
rule (None).

Fused decode ops: each schedule applies to the ops alone (None for a plain matmul), the CUDA one
compiles to one kernel for sm_90 (static single token and symbolic batch, SmolLM2's shapes and
a K of few vectors), the CPU one equals a float64 numpy RMSNorm + product (+ bias, or SiLU(gate)
* up) at batches 1 and 3; on the GPU, the CUDA one too (batches 1, 3, 64).

Let expressions (pipeline.inline_let_expressions, a workaround for TVM's CommonSubexprElim, which
leaves a variable used before its definition in some functions that hold them): the pass leaves
no Let and keeps the values (nested Lets on the CPU against numpy); TVM's stock tree-attention
kernel with Llama-3 RoPE scaling at the shapes that hit the bug (Llama-3.2-1B's 32 / 8 heads of
64) compiles for CUDA once inlined; the model pipeline runs the pass; slow: the whole stock-cache
library of scripts/llama-3.2-1b-config.json compiles for CUDA.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te
from tvm.script import tirx as T
from harness import compiles_with_nvcc, load_script

from tvmattn.compiler.fused_decode import rms_norm_matmul, rms_norm_matmul_swiglu
from tvmattn.compiler.dependent_launch import PREFETCH_ATTR
from tvmattn.compiler.fused_schedules import CPUFusedDecodeGEMV, CUDAFusedDecodeGEMV
from tvmattn.compiler.pipeline import SMALL_BATCH_THREADS, SmallBatchMatmul, inline_let_expressions, relax_pipeline

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def nt_matmul(n: int, k: int, epilogue: str | None = None, dtype: str = "float16", out_dtype: str = "float16",
              seq: bool = False) -> tvm.tirx.PrimFunc:
    """decode_step's legalized projection: x [batch_size, 1, k] times w [n, k]^T, then `epilogue`
    ("add": + a residual [batch_size, 1, n]; "cast": to out_dtype); seq: x is [1, seq_len, k]
    instead (a prefill)."""
    var = tvm.tirx.Var("seq_len" if seq else "batch_size", "int64")
    x_shape, o_shape = ((1, var, k), (1, var, n)) if seq else ((var, 1, k), (var, 1, n))
    x = te.placeholder(x_shape, dtype, "x")
    w = te.placeholder((n, k), dtype, "w")
    r = te.reduce_axis((0, k), "k")
    mm = te.compute(o_shape, lambda a, b, c: te.sum(x[a, b, r] * w[c, r], axis=r), name="NT_matmul")
    args = [x, w]
    if epilogue == "add":
        res = te.placeholder(o_shape, dtype, "res")
        result = te.compute(o_shape, lambda a, b, c: res[a, b, c] + mm[a, b, c], name="T_add")
        args.append(res)
    elif epilogue == "cast":
        result = te.compute(o_shape, lambda a, b, c: mm[a, b, c].astype(out_dtype), name="T_cast")
    else:
        result = mm
    return te.create_prim_func(args + [result]).with_attr("global_symbol", "main")


CASES = [
    pytest.param(960, 576, None, id="qkv-576"),
    pytest.param(576, 1536, "add", id="down-1536-add"),
    pytest.param(640, 64, "cast", id="head-64-cast"),
]


@pytest.mark.parametrize("n, k, epilogue", CASES)
def test_rule_schedules_decode_projections_for_cuda(n, k, epilogue):
    func = nt_matmul(n, k, epilogue)
    with CUDA:
        sch = SmallBatchMatmul().apply(func, CUDA, False)
        assert sch is not None
        lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=CUDA)
    source = lib.mod.imports[0].inspect_source()
    assert f"__launch_bounds__({SMALL_BATCH_THREADS})" in source and "__shfl" in source


def test_rule_leaves_other_shapes_to_the_next_rule():
    rule = SmallBatchMatmul()
    assert rule.apply(nt_matmul(64, 576, seq=True), CUDA, False) is None  # a prefill
    assert rule.apply(nt_matmul(64, 60), CUDA, False) is None  # K not a multiple of 8 halves
    assert rule.apply(nt_matmul(64, 576), tvm.target.Target("llvm"), False) is None
    # a weight over the cap (an LM head): re-read per block of rows, it keeps dlight's Matmul
    capped = SmallBatchMatmul(max_weight_bytes=64 * 576 * 2 - 1)
    assert capped.apply(nt_matmul(64, 576), CUDA, False) is None
    assert SmallBatchMatmul(max_weight_bytes=64 * 576 * 2).apply(nt_matmul(64, 576), CUDA, False) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("n, k, epilogue", CASES)
@pytest.mark.parametrize("batch", [1, 3, 8, 17, 64])
def test_rule_matches_numpy_on_the_gpu(n, k, epilogue, batch):
    func = nt_matmul(n, k, epilogue, out_dtype="float32")
    with CUDA:
        sch = SmallBatchMatmul().apply(func, CUDA, False)
        lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=CUDA)
    rng = np.random.default_rng(batch)
    x = (rng.standard_normal((batch, 1, k)) * 0.5).astype("float16")
    w = (rng.standard_normal((n, k)) * 0.5).astype("float16")
    expected = x.astype(np.float32) @ w.astype(np.float32).T
    dev = tvm.cuda(0)
    ins = [tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev)]
    if epilogue == "add":
        res = (rng.standard_normal((batch, 1, n)) * 0.5).astype("float16")
        ins.append(tvm.runtime.tensor(res, dev))
        expected = expected + res.astype(np.float32)
    out_dtype = "float32" if epilogue == "cast" else "float16"
    out = tvm.runtime.tensor(np.zeros((batch, 1, n), out_dtype), dev)
    lib["main"](*ins, out)
    got = out.numpy().astype(np.float32)
    # fp16 sums (as the unscheduled function): about 1e-3 relative per product over k terms
    scale = np.abs(expected).max()
    assert np.abs(got - expected).max() <= 2e-2 * scale


# ---------------------------------------------------------------------------------------------
# The fused decode ops (compiler.fused_decode) and their schedules (compiler.fused_schedules)
# ---------------------------------------------------------------------------------------------
LLVM = tvm.target.Target("llvm")


def fused_op(kind: str, k: int, n: int, batch: int | None, dtype: str) -> tvm.tirx.PrimFunc:
    """A fused decode op as the model emits it: kind "plain", "bias" (rms_norm_matmul) or
    "swiglu" (rms_norm_matmul_swiglu, n = 2 I); batch None: the symbolic batch_size."""
    rows = tvm.tirx.Var("batch_size", "int64") if batch is None else batch
    x = te.placeholder((rows, 1, k), dtype, "x")
    g = te.placeholder((k,), dtype, "g")
    w = te.placeholder((n, k), dtype, "w")
    args = [x, g, w]
    if kind == "swiglu":
        y = rms_norm_matmul_swiglu(x, g, w, eps=1e-5)
    elif kind == "bias":
        bias = te.placeholder((n,), dtype, "bias")
        args.append(bias)
        y = rms_norm_matmul(x, g, w, bias, eps=1e-5)
    else:
        y = rms_norm_matmul(x, g, w, eps=1e-5)
    return te.create_prim_func(args + [y]).with_attr("global_symbol", "main")


def fused_reference(kind: str, x, g, w, bias=None) -> np.ndarray:
    """float64 numpy: RMSNorm (its output rounded to x's dtype, as TVM's rms_norm), the product,
    the bias or SiLU(gate) * up; [b, 1, out]."""
    x64 = x.astype(np.float64)[:, 0, :]
    normed = x64 / np.sqrt((x64 ** 2).mean(axis=-1, keepdims=True) + 1e-5) * g.astype(np.float64)
    normed = normed.astype(x.dtype).astype(np.float64)
    y = normed @ w.astype(np.float64).T
    if kind == "bias":
        y = y + bias.astype(np.float64)
    if kind == "swiglu":
        gate, up = np.split(y, 2, axis=-1)
        y = gate / (1 + np.exp(-gate)) * up
    return y[:, None, :]


FUSED_CASES = [
    pytest.param("plain", 576, 960, id="qkv-576x960"),
    pytest.param("bias", 64, 192, id="qkv-bias-64x192"),
    pytest.param("swiglu", 576, 3072, id="gate-up-576x3072"),
    pytest.param("swiglu", 80, 96, id="gate-up-80x96"),  # K of 10 vectors: 2 lanes per column
]


# the CUDA rule's layouts: the normalized row staged in shared memory (the default), per warp
CUDA_RULES = [pytest.param(True, id="staged"), pytest.param(False, id="per-warp")]
# on the GPU also the staged layout without the weight prefetch (each lane's 16-byte vectors interleaved)
GPU_RULES = [pytest.param(dict(staged=True), id="staged"), pytest.param(dict(staged=False), id="per-warp"),
             pytest.param(dict(staged=True, prefetch=False), id="staged-no-prefetch")]


@pytest.mark.parametrize("staged", CUDA_RULES)
@pytest.mark.parametrize("kind, k, n", FUSED_CASES)
@pytest.mark.parametrize("batch", [1, None], ids=["decode", "batch"])
def test_fused_rule_schedules_and_compiles_for_cuda(kind, k, n, batch, staged, tmp_path):
    func = fused_op(kind, k, n, batch, "float16")
    rule = CUDAFusedDecodeGEMV(staged=staged)
    assert rule.apply(func, LLVM, False) is None
    with CUDA:
        sch = rule.apply(func, CUDA, False)
        assert sch is not None
        lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=CUDA)
    source = lib.mod.imports[0].inspect_source()
    kernels = set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source))
    assert len(kernels) == 1, f"one kernel for norm, product and epilogue, got {kernels}"
    assert "__shfl" in source
    compiles_with_nvcc(source, tmp_path)
    # staged: the normalized row in shared memory, read as 16-byte vectors (K a multiple of 8)
    assert ("__shared__" in source) == staged
    if staged and k % 8 == 0:
        assert re.search(r"\*\(uint4\*\)\(\w*rms_norm_shared_local_ptr", source)
    threads = int(re.search(r"__launch_bounds__\((\d+)\)", source).group(1))
    assert threads <= 32 if staged else threads == 32  # one warp a block


PREFETCH_CASES = [  # (kind, K, N, lanes, whether each lane's chunk of K is a conflict-free stride)
    pytest.param("plain", 576, 960, 8, True, id="qkv-576x960"),  # SmolLM2: 144-byte chunks
    pytest.param("swiglu", 576, 3072, 8, True, id="gate-up-576x3072"),
    pytest.param("swiglu", 640, 4096, 16, True, id="gate-up-640x4096"),  # Gemma 3 270M: 80 bytes
    pytest.param("plain", 2048, 3072, 32, False, id="qkv-2048x3072"),  # Llama-1B: 128 bytes, 8 lanes a bank group
]


@pytest.mark.parametrize("kind, k, n, lanes, prefetched", PREFETCH_CASES)
@pytest.mark.parametrize("batch", [1, None], ids=["decode", "batch"])
def test_staged_rule_prefetches_each_lanes_weight_chunk(kind, k, n, lanes, prefetched, batch):
    """Where a lane's contiguous chunk of K is an odd multiple of 16 bytes (its shared-memory
    reads of the normalized row then hit distinct bank groups), the staged rule loads the
    thread's whole chunk of its weight column(s) into registers before it reads x, in a loop
    marked PREFETCH_ATTR (where dependent launch waits); elsewhere, and with prefetch=False,
    the lanes interleave 16-byte vectors loaded as the product needs them."""
    func = fused_op(kind, k, n, batch, "float16")
    for rule, expect in ((CUDAFusedDecodeGEMV(), prefetched), (CUDAFusedDecodeGEMV(prefetch=False), False)):
        with CUDA:
            sch = rule.apply(func, CUDA, False)
            marked = [loop for loop in _loops(sch.mod["main"]) if PREFETCH_ATTR in loop.annotations]
            source = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=CUDA).mod.imports[0].inspect_source()
        assert len(marked) == ((2 if kind == "swiglu" else 1) if expect else 0)
        body = source[source.index("{", source.index("__global__")):]
        registers = [int(r) for r in re.findall(r"half w_local_ptr(?:_1)?\[(\d+)\];", body)]
        weight_loads = [m.start() for m in re.finditer(r"= \*\(uint4\*\)\(w_ptr", body)]
        x_loads = [m.start() for m in re.finditer(r"\(x_ptr \+", body)]
        if expect:
            assert registers and set(registers) == {k // lanes}, registers  # the chunk, no more
            assert max(weight_loads) < min(x_loads)
        else:
            assert set(registers) == {8} and min(weight_loads) > min(x_loads)  # a vector at a time


def _loops(func) -> list:
    found = []
    tvm_ffi.structural_walk(func.body, (tvm.tirx.For, found.append))
    return found


@pytest.mark.parametrize("threads, lanes", [(64, 32), (16, 32), (32, 0)])
def test_cuda_fused_rule_refuses_blocks_other_than_one_warp(threads, lanes):
    with pytest.raises(ValueError, match=f"threads={threads}, lanes={lanes}: expected 1 <= lanes <= threads <= 32"):
        CUDAFusedDecodeGEMV(threads=threads, lanes=lanes)


@pytest.mark.parametrize("flags, message", [(dict(prefetch=1), "prefetch=1: expected a bool"),
                                            (dict(staged="yes"), "staged='yes': expected a bool")])
def test_cuda_fused_rule_takes_its_layout_flags_as_bools(flags, message):
    with pytest.raises(ValueError, match=message):
        CUDAFusedDecodeGEMV(**flags)


def test_fused_rules_leave_other_functions():
    for rule, target in ((CUDAFusedDecodeGEMV(), CUDA), (CPUFusedDecodeGEMV(), LLVM)):
        assert rule.apply(nt_matmul(64, 576), target, False) is None
        assert rule.apply(nt_matmul(64, 576, "add"), target, False) is None
    assert CPUFusedDecodeGEMV().apply(fused_op("plain", 64, 64, 1, "float32"), CUDA, False) is None


@pytest.mark.parametrize("kind, k, n", FUSED_CASES)
@pytest.mark.parametrize("batch", [1, 3])
def test_fused_rule_matches_numpy_on_the_cpu(kind, k, n, batch):
    symbolic = batch != 1  # batch 1: the static decode shape; else the symbolic batch_size
    func = fused_op(kind, k, n, None if symbolic else 1, "float32")
    with LLVM:
        sch = CPUFusedDecodeGEMV().apply(func, LLVM, False)
        assert sch is not None
        lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=LLVM)
    rng = np.random.default_rng(k + n + batch)
    x = rng.standard_normal((batch, 1, k)).astype("float32")
    g = (1 + 0.1 * rng.standard_normal(k)).astype("float32")
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype("float32")
    bias = rng.standard_normal(n).astype("float32") if kind == "bias" else None
    expected = fused_reference(kind, x, g, w, bias)
    out = tvm.runtime.tensor(np.zeros(expected.shape, "float32"))
    lib["main"](*[tvm.runtime.tensor(a) for a in (x, g, w, bias) if a is not None], out)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rule", GPU_RULES)
@pytest.mark.parametrize("kind, k, n", FUSED_CASES + [pytest.param("swiglu", 2048, 16384, id="gate-up-2048x16384"),
                                                       pytest.param("swiglu", 640, 4096, id="gate-up-640x4096")])
@pytest.mark.parametrize("batch", [1, 3, 64])
def test_fused_rule_matches_numpy_on_the_gpu(kind, k, n, batch, rule):
    func = fused_op(kind, k, n, 1 if batch == 1 else None, "float16")
    with CUDA:
        sch = CUDAFusedDecodeGEMV(**rule).apply(func, CUDA, False)
        lib = tvm.compile(tvm.IRModule({"main": sch.mod["main"]}), target=CUDA)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 1, k)).astype("float16")
    g = (1 + 0.1 * rng.standard_normal(k)).astype("float16")
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype("float16")
    bias = rng.standard_normal(n).astype("float16") if kind == "bias" else None
    expected = fused_reference(kind, x, g, w, bias)
    dev = tvm.cuda(0)
    out = tvm.runtime.tensor(np.zeros(expected.shape, "float16"), dev)
    lib["main"](*[tvm.runtime.tensor(a, dev) for a in (x, g, w, bias) if a is not None], out)
    # float32 sums of float16 products, one rounding to float16 at the end
    np.testing.assert_allclose(out.numpy().astype(np.float64), expected, rtol=2e-2, atol=2e-2)


def _lets(func) -> int:
    """How many Let expressions func holds."""
    found = []
    tvm_ffi.structural_walk(func.body, (tvm.tirx.Let, found.append))
    return len(found)


@T.prim_func(s_tir=True)
def nested_lets(x: T.Buffer((8,), "float32"), out: T.Buffer((8,), "float32")):
    """out[i] = let a = x[i] * 2 in (let b = a + i in b * a - b): nested Lets, the inner value
    naming the outer variable."""
    T.func_attr({"global_symbol": "main"})
    a = T.float32()
    b = T.float32()
    for i in range(8):
        out[i] = T.Let(T.Let(b * a - b, where={b: a + T.Cast("float32", i)}), where={a: x[i] * T.float32(2.0)})


def test_inlined_lets_keep_the_values_on_the_cpu():
    mod = tvm.IRModule({"main": nested_lets})
    inlined = inline_let_expressions(mod)
    assert _lets(mod["main"]) == 2 and _lets(inlined["main"]) == 0
    x = np.random.default_rng(0).standard_normal(8).astype("float32")
    a = x.astype("float64") * 2
    b = a + np.arange(8)
    expected = b * a - b
    for m in (mod, inlined):
        out = tvm.runtime.tensor(np.zeros(8, "float32"))
        tvm.compile(m, target=LLVM)["main"](tvm.runtime.tensor(x), out)
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-6)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("heads, kv_heads, head_dim", [
    pytest.param(32, 8, 64, id="llama-3.2-1b"),
    pytest.param(32, 8, 128, id="llama-3-8b"),
    pytest.param(16, 8, 128, id="group-2"),
])
def test_stock_tree_attention_with_llama3_rope_compiles_for_cuda_once_inlined(heads, kv_heads, head_dim):
    """TVM's batch_tree_attn (the stock cache's) at these shapes fails CUDA lowering as written:
    CSE uses a variable before its definition (TVM's CommonSubexprElim and Let expressions)."""
    from tvm.relax.frontend.nn.llm.tree_attn import tree_attn

    mod = tvm.IRModule({"batch_tree_attn": tree_attn(kv_heads, heads, head_dim, "float16", LLAMA3_ROPE, CUDA)})
    assert _lets(mod["batch_tree_attn"]) > 0  # the RoPE frequencies
    inlined = inline_let_expressions(mod)
    assert _lets(inlined["batch_tree_attn"]) == 0
    with CUDA:
        lib = tvm.compile(inlined, target=CUDA)
    assert "batch_tree_attn_kernel" in lib.mod.imports[0].inspect_source()


def test_model_pipeline_inlines_lets():
    with CUDA:
        # (scheduled: the dlight rules take functions of blocks only)
        lowered = relax_pipeline(CUDA)(tvm.IRModule({"main": nested_lets.with_attr("tirx.is_scheduled", True)}))
    assert _lets(lowered["main"]) == 0


@pytest.mark.slow
def test_stock_library_of_llama_3_2_1b_compiles_for_cuda():
    """The whole stock-cache library of Llama-3.2-1B's config (bench_e2e's comparison library:
    batch 64, fused layers, small-batch matmuls) goes through the model pipeline and lowering."""
    import json
    from pathlib import Path

    from tvmattn.models import BuildOptions, compile_module, export_module
    from tvmattn.models.config import model_config_from_hf

    hf = json.loads((Path(__file__).parents[1] / "scripts" / "llama-3.2-1b-config.json").read_text())
    options = BuildOptions(target="cuda:sm_90", dtype="float16", kv_cache="tvm", max_batch_size=64)
    mod, _ = export_module(model_config_from_hf(hf), options)
    assert _lets(mod["batch_tree_attn"]) > 0  # the stock kernels' Llama-3 RoPE frequencies
    executable = compile_module(mod, options)
    assert "batch_tree_attn" in executable.as_text()


def test_bench_fused_gemv_builds_every_variant_and_shares_the_reference(tmp_path):
    """scripts/bench_fused_gemv.py: every variant it compares builds (a library per shape and
    variant), a bad variant name is refused before any build, and its float64 reference is the
    tests' (fused_reference)."""
    bench = load_script("bench_fused_gemv")
    for variant in bench.VARIANTS:
        path = tmp_path / f"smollm2-qkv-{variant}.so"
        assert bench.build(("smollm2-qkv", variant), str(tmp_path)) == str(path) and path.stat().st_size > 0
    with pytest.raises(ValueError, match="one warp"):
        bench.rule("staged-t64-b264")  # more than one warp a block
    with pytest.raises(ValueError, match="expected warp or staged-t<threads>-b<min_blocks>"):
        bench.rule("staged-t32-b264-fast")
    assert not bench.rule("staged-t32-b264-noprefetch").prefetch and bench.rule("staged-t32-b264").prefetch
    rng = np.random.default_rng(3)
    for kind, n in (("plain", 48), ("swiglu", 96)):
        x = rng.standard_normal((1, 1, 64)).astype(np.float16)
        g = (1 + 0.1 * rng.standard_normal(64)).astype(np.float16)
        w = (rng.standard_normal((n, 64)) / 8).astype(np.float16)
        np.testing.assert_allclose(bench.reference(kind, x, g, w), fused_reference(kind, x, g, w)[0, 0], rtol=1e-12)
